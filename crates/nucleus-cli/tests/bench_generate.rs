//! `nucleus bench generate` as a user runs it on stories260K (../shared/models): a small run
//! prints the whole table, its figures agree with one another, and bad flags are usage
//! errors.

use std::process::{Command, Output};

fn stories() -> String {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/models/stories260K.gguf")
        .to_str()
        .unwrap()
        .to_string()
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args(["bench", "generate", "--model", &stories()])
        .args(args)
        .output()
        .expect("run nucleus")
}

/// The (median, smallest, largest) of the table row named `name`.
fn row(stdout: &str, name: &str) -> (f64, f64, f64) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(&format!("| {name} |")))
        .unwrap_or_else(|| panic!("no row {name} in\n{stdout}"));
    let cells: Vec<&str> = line.split('|').map(str::trim).collect();
    let (lo, hi) = cells[3].split_once(" to ").expect("a spread");
    (
        cells[2].parse().unwrap(),
        lo.parse().unwrap(),
        hi.parse().unwrap(),
    )
}

#[test]
fn bench_generate_prints_consistent_medians() {
    let out = bench(&[
        "--rounds",
        "3",
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "5",
        "--batch",
        "2",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("batch 2, prompt 16 tokens, 5 generated, 1 thread(s), 3 round(s)"),
        "{stdout}"
    );
    // stories260K stores 1.1 MiB of f32 weights (its tensors, not the tokenizer's metadata).
    assert!(
        stdout.contains("(1.1 MiB of weights as stored)"),
        "{stdout}"
    );
    let mut medians = Vec::new();
    for name in [
        "prefill tokens/s",
        "decode tokens/s",
        "decode ms per step",
        "load s",
        "resident MiB after generating",
        "decode floor ms per step (weights / bandwidth)",
        "read bandwidth GB/s",
    ] {
        let (m, lo, hi) = row(&stdout, name);
        assert!(lo <= m && m <= hi && lo >= 0.0, "{name}: {m} {lo} {hi}");
        medians.push(m);
    }
    // With an odd number of rounds the median of a per-round figure is the figure of the
    // median round: ms per step = 1000 * batch / decode tokens/s, floor = weights / bandwidth.
    let (tokens_s, ms_step) = (medians[1], medians[2]);
    assert!(
        (ms_step - 2000.0 / tokens_s).abs() <= 0.002 + 0.01 * ms_step,
        "{ms_step} ms per step vs {tokens_s} tokens/s"
    );
    let (floor_ms, gb_s) = (medians[5], medians[6]);
    let weights = 1.1 * 1024.0 * 1024.0;
    assert!(
        (floor_ms - weights / (gb_s * 1e9) * 1e3).abs() <= 0.002 + 0.06 * floor_ms,
        "{floor_ms} ms floor vs {gb_s} GB/s"
    );
    // The model is small: the round's process holds well under 1 GiB (the 256 MiB bandwidth
    // buffer is the parent's, never in a round's process).
    assert!(medians[4] > 1.0 && medians[4] < 256.0, "{} MiB", medians[4]);
    if cfg!(feature = "llama-cpp") {
        assert!(stdout.contains("\ngreedy tokens (row 0): "), "{stdout}");
        assert!(stdout.contains("| decode speed (tokens/s) | "), "{stdout}");
    } else {
        assert!(
            stdout.contains("\nllama.cpp: not measured, built without feature llama-cpp"),
            "{stdout}"
        );
    }
}

/// The child process of a round prints the round as one JSON line: row 0's greedy tokens,
/// one per step, and its timings.
#[test]
fn one_round_prints_the_round_as_one_json_line() {
    let out = bench(&[
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "6",
        "--batch",
        "3",
        "--one-round",
        "nucleus",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    let round: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(round["engine"], "Nucleus");
    assert_eq!(round["decode_steps"], 5);
    let tokens = round["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 6, "{stdout}");
    assert!(tokens.iter().all(|t| t.as_u64().is_some_and(|t| t < 512)));
    assert_eq!(round["top2_gaps"], serde_json::json!([]));
    for field in ["load_s", "prefill_s", "decode_s"] {
        assert!(round[field].as_f64().is_some_and(|s| s > 0.0), "{field}");
    }
    // Greedy decoding of the same seeded prompts: the same tokens in another process.
    let again = bench(&[
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "6",
        "--batch",
        "3",
        "--one-round",
        "nucleus",
    ]);
    let again: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(again["tokens"], round["tokens"]);
}

#[test]
fn bad_flags_are_usage_errors() {
    for (args, message) in [
        (
            &["--gen-tokens", "1"][..],
            "error: --gen-tokens must be at least 2, got 1\n",
        ),
        (
            &["--rounds", "0"][..],
            "error: --rounds must be at least 1, got 0\n",
        ),
        (
            &["--batch", "0"][..],
            "error: --batch must be at least 1, got 0\n",
        ),
        (
            &[
                "--prompt-tokens",
                "2040",
                "--gen-tokens",
                "16",
                "--rounds",
                "1",
            ][..],
            "error: --prompt-tokens 2040 + --gen-tokens 16 is more than the model's context of \
             2048\n",
        ),
        (
            &["--one-round", "nucleus", "--threads", "0"][..],
            "error: --threads must be at least 1, got 0\n",
        ),
    ] {
        let out = bench(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert_eq!(String::from_utf8_lossy(&out.stderr), message, "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
