//! `--max-input-bytes` on every command that reads input: a JSON line longer than the limit is
//! answered `input_too_large` in its place (and the lines after it are answered), without the
//! line ever being held whole; a file larger than the limit is refused before it is read.
//! The large cases run under an address-space limit (`ulimit -v`), so that holding what the
//! input asks for, and not more, is what is checked.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{
    answers, f32_bytes, i32_bytes, nucleus, run_subcommand, temp_dir, text, write_tensors,
};
use safetensors::Dtype;
use serde_json::Value;

const SAMPLE_OK: &str = r#"{"logits": [1, 3, 2], "params": {"temperature": 0}}"#;
const NPU_OK: &str = r#"{"logits": [[1, 3]], "top_k": [1], "top_p": [1]}"#;
const VERIFY_OK: &str =
    r#"{"draft_token_ids": [1], "target_logits": [[1, 3], [3, 1]], "params": {"temperature": 0}}"#;
const MOE_OK: &str = r#"{"x": [[1, 10], [2, 20], [3, 30]], "expert_idx": [[2, 0], [1, 2], [0, 1]], "expert_num": 4}"#;

/// A JSON-lines command, a line it answers without error, and a check of that answer.
type Command3 = (&'static str, &'static str, fn(&Value));

/// The four JSON-lines commands.
fn commands() -> [Command3; 4] {
    [
        ("sample", SAMPLE_OK, |a| {
            assert_eq!(a["tokens"], serde_json::json!([1]))
        }),
        ("top-k-top-p-sample", NPU_OK, |a| {
            assert_eq!(a["logits_select_idx"], serde_json::json!([1]))
        }),
        ("moe-init-routing", MOE_OK, |a| {
            assert_eq!(a["valid_rows"], 6)
        }),
        ("speculative-verify", VERIFY_OK, |a| {
            assert_eq!(a["tokens"], serde_json::json!([1, 0]))
        }),
    ]
}

fn error_of(answer: &Value) -> (&str, &str) {
    (
        answer["error"]["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("not an error: {answer}")),
        answer["error"]["message"].as_str().unwrap(),
    )
}

fn shared(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(path);
    p.to_str().unwrap().to_string()
}

/// Asserts one `error: ...` line on stderr holding every needle, the exit status, no answers.
fn assert_refused(out: &Output, status: i32, needles: &[&str]) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(status), "stderr: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    for needle in needles {
        assert!(err.contains(needle), "{needle:?} not in {err:?}");
    }
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
}

#[test]
fn a_line_longer_than_the_limit_is_answered_in_its_place_and_the_next_ones_still_are() {
    for (command, ok, check) in commands() {
        let long = format!("{{\"padding\": \"{}\"}}", "x".repeat(300));
        // The limit counts the bytes before the `\n` (a `\r` included): a line of exactly
        // 200 bytes passes, one of 201 does not.
        let exact = format!("{ok}{}\r", " ".repeat(199 - ok.len()));
        let input = format!("{ok}\n{long}\n{exact}\n{}\n{ok}", "y".repeat(201));
        let out = run_subcommand(command, &["--max-input-bytes", "200"], &input);
        let got = answers(&out);
        assert_eq!(got.len(), 5, "{command}: {got:?}");
        check(&got[0]);
        for i in [1, 3] {
            let (kind, message) = error_of(&got[i]);
            assert_eq!(kind, "input_too_large", "{command}");
            assert_eq!(
                message,
                "the line is longer than the --max-input-bytes limit of 200 bytes: it was \
                 skipped (raise the limit with --max-input-bytes N)"
            );
        }
        check(&got[2]);
        check(&got[4]);
    }
}

#[test]
fn an_endless_line_is_answered_at_once_and_skipped_in_constant_memory() {
    for (command, _, _) in commands() {
        let mut child = nucleus()
            .args([command, "--input", "/dev/zero", "--max-input-bytes", "1M"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        let answer: Value = serde_json::from_str(&first).unwrap();
        assert_eq!(error_of(&answer).0, "input_too_large", "{command}");
        // Still skipping zeros: the peak memory stays far below what was read.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.id()));
        child.kill().unwrap();
        child.wait().unwrap();
        if let Ok(status) = status {
            let peak_kb: u64 = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .expect("VmHWM");
            assert!(peak_kb < 200_000, "{command}: peak {peak_kb} kB");
        }
    }
}

/// 2 GB of zeros (one line) and a good line under the default 1 GiB limit, with the address
/// space capped at 1.5 GB: the zeros are answered `input_too_large`, the next line is
/// answered, and nothing near 2 GB was ever held (before: `memory allocation of 2147483648
/// bytes failed`, an abort).
#[cfg(unix)]
#[test]
fn two_gigabytes_of_zeros_under_the_default_limit_stay_within_the_limit() {
    let script = format!(
        "ulimit -v 1500000 && (head -c 2G /dev/zero; printf '\\n%s\\n' '{SAMPLE_OK}') | exec \"$0\" sample"
    );
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_nucleus"))
        .output()
        .unwrap();
    let got = answers(&out);
    assert_eq!(got.len(), 2, "{}", text(&out.stderr));
    let (kind, message) = error_of(&got[0]);
    assert_eq!(kind, "input_too_large");
    assert!(
        message.contains("limit of 1073741824 bytes (1G)"),
        "{message}"
    );
    assert_eq!(got[1]["tokens"], serde_json::json!([1]));
}

#[test]
fn max_input_bytes_takes_byte_counts_with_binary_suffixes_and_refuses_zero() {
    for command in [
        "sample",
        "top-k-top-p-sample",
        "moe-init-routing",
        "speculative-verify",
    ] {
        for bad in ["0", "0K", "1.5M", "1T", "-1", "lots"] {
            let out = run_subcommand(command, &[&format!("--max-input-bytes={bad}")], "");
            assert_eq!(out.status.code(), Some(2), "{command} {bad}");
            let err = text(&out.stderr);
            assert!(
                err.starts_with(&format!(
                    "error: invalid value '{bad}' for '--max-input-bytes <N>'"
                )),
                "{err}"
            );
        }
        // 1K = 1024 bytes: a line of 1,024 bytes passes, one of 1,025 does not.
        let ok = commands().into_iter().find(|c| c.0 == command).unwrap().1;
        let at = format!("{ok}{}", " ".repeat(1024 - ok.len()));
        let over = format!("{at} ");
        let got = answers(&run_subcommand(
            command,
            &["--max-input-bytes", "1k"],
            &format!("{at}\n{over}\n"),
        ));
        assert!(got[0].get("error").is_none(), "{command}: {}", got[0]);
        assert_eq!(error_of(&got[1]).0, "input_too_large");
    }
    for args in [
        &["generate", "--prompt", "x", "--max-input-bytes", "0"][..],
        &[
            "grammar",
            "validate",
            "--regex",
            "a",
            "--text",
            "-",
            "--max-input-bytes",
            "0",
        ],
    ] {
        let out = nucleus().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(text(&out.stderr).contains("'--max-input-bytes <N>'"));
    }
}

/// A file of `len` bytes named `name` in `dir`.
fn big_file(dir: &Path, name: &str, len: usize) -> String {
    let path = dir.join(name);
    std::fs::write(&path, vec![b' '; len]).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn a_file_larger_than_the_limit_is_refused_before_it_is_read() {
    let dir = temp_dir("files");
    let big = big_file(&dir, "big.bin", 5000);
    let limit = ["--max-input-bytes", "4K"];
    let good_logits = dir.join("logits.safetensors");
    write_tensors(
        &good_logits,
        &[(
            "logits",
            Dtype::F32,
            vec![1, 3],
            f32_bytes(&[1.0, 3.0, 2.0]),
        )],
    );
    let good_logits = good_logits.to_str().unwrap();
    let npu = dir.join("npu.safetensors");
    write_tensors(
        &npu,
        &[
            ("logits", Dtype::F32, vec![1, 2], f32_bytes(&[1.0, 3.0])),
            ("top_k", Dtype::I32, vec![1], i32_bytes(&[1])),
            ("top_p", Dtype::F32, vec![1], f32_bytes(&[1.0])),
        ],
    );
    let npu = npu.to_str().unwrap();
    let text_file = dir.join("text.txt");
    std::fs::write(&text_file, "yes").unwrap();
    let text_file = text_file.to_str().unwrap();
    let tokenizer = shared("models/minimind-tokenizer/tokenizer.json");
    let cases: Vec<(Vec<&str>, &str, i32)> = vec![
        (vec!["sample", "--logits", &big], "--logits", 1),
        (
            vec!["sample", "--logits", good_logits, "--params", &big],
            "--params",
            1,
        ),
        (
            vec!["top-k-top-p-sample", "--tensors", &big],
            "--tensors",
            1,
        ),
        (
            vec!["top-k-top-p-sample", "--tensors", npu, "--attrs", &big],
            "--attrs",
            1,
        ),
        (
            vec![
                "moe-init-routing",
                "--tensors",
                &big,
                "--attrs",
                r#"{"expert_num": 4}"#,
            ],
            "--tensors",
            1,
        ),
        (
            vec!["moe-init-routing", "--tensors", npu, "--attrs", &big],
            "--attrs",
            1,
        ),
        (
            vec!["generate", "--prompt", "x", "--json-schema", &big],
            "--json-schema",
            1,
        ),
        (
            vec!["generate", "--prompt", "x", "--grammar", &big],
            "--grammar",
            1,
        ),
        // grammar validate: grep's convention, any error is 2.
        (
            vec![
                "grammar",
                "validate",
                "--regex",
                "yes",
                "--text",
                &big,
                "--tokenizer",
                &tokenizer,
            ],
            "--text",
            2,
        ),
        (
            vec![
                "grammar",
                "validate",
                "--grammar",
                &big,
                "--text",
                text_file,
                "--tokenizer",
                &tokenizer,
            ],
            "--grammar",
            2,
        ),
        (
            vec![
                "grammar",
                "validate",
                "--json-schema",
                &big,
                "--text",
                text_file,
                "--tokenizer",
                &tokenizer,
            ],
            "--json-schema",
            2,
        ),
        (
            vec![
                "grammar",
                "validate",
                "--regex",
                "yes",
                "--text",
                text_file,
                "--tokenizer",
                &big,
            ],
            "--tokenizer",
            2,
        ),
    ];
    for (args, flag, status) in cases {
        let out = nucleus()
            .args(&args)
            .args(limit)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        assert_refused(
            &out,
            status,
            &[
                &format!("{flag} {big} is 5000 bytes, more than the --max-input-bytes limit of 4096 bytes (4K)"),
            ],
        );
    }
    // Under the default limit the same files are read.
    let out = nucleus()
        .args([
            "grammar",
            "validate",
            "--regex",
            "yes",
            "--text",
            text_file,
            "--tokenizer",
            &tokenizer,
        ])
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "accepted\n", "{}", text(&out.stderr));
}

/// A pipe or device has no size: at most limit + 1 bytes are read, then it is refused.
#[test]
fn a_pipe_larger_than_the_limit_is_refused_after_limit_plus_one_bytes() {
    let dir = temp_dir("pipes");
    let logits = dir.join("logits.safetensors");
    write_tensors(
        &logits,
        &[(
            "logits",
            Dtype::F32,
            vec![1, 3],
            f32_bytes(&[1.0, 3.0, 2.0]),
        )],
    );
    let run_with_stdin = |args: &[&str], stdin: Vec<u8>| {
        let mut child = nucleus()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        // The reader stops after limit + 1 bytes: a closed pipe is fine here.
        let writer = std::thread::spawn(move || {
            let _ = input.write_all(&stdin);
        });
        let out = child.wait_with_output().unwrap();
        writer.join().unwrap();
        out
    };
    // /dev/zero is endless: the limit ends the read.
    let out = nucleus()
        .args(["sample", "--logits", "/dev/zero", "--max-input-bytes", "1M"])
        .output()
        .unwrap();
    assert_refused(
        &out,
        1,
        &["--logits /dev/zero holds more than the --max-input-bytes limit of 1048576 bytes (1M)"],
    );
    let params = format!("{{\"temperature\": 0{}}}", " ".repeat(5000));
    let out = run_with_stdin(
        &[
            "sample",
            "--logits",
            logits.to_str().unwrap(),
            "--params",
            "/dev/stdin",
            "--max-input-bytes",
            "4K",
        ],
        params.clone().into_bytes(),
    );
    assert_refused(
        &out,
        1,
        &["--params /dev/stdin holds more than the --max-input-bytes limit of 4096 bytes (4K)"],
    );
    // Within the limit, the same pipe is read.
    let out = run_with_stdin(
        &[
            "sample",
            "--logits",
            logits.to_str().unwrap(),
            "--params",
            "/dev/stdin",
        ],
        params.into_bytes(),
    );
    assert_eq!(answers(&out)[0]["tokens"], serde_json::json!([1]));
    // `--text -` reads stdin within the limit.
    let out = run_with_stdin(
        &[
            "grammar",
            "validate",
            "--regex",
            "y*",
            "--text",
            "-",
            "--tokenizer",
            &shared("models/minimind-tokenizer/tokenizer.json"),
            "--max-input-bytes",
            "100",
        ],
        vec![b'y'; 101],
    );
    assert_refused(
        &out,
        2,
        &["--text - (stdin) holds more than the --max-input-bytes limit of 100 bytes"],
    );
}

/// A file name is echoed escaped and cut to a few hundred bytes, so a hostile name cannot
/// flood stderr or forge lines.
#[test]
fn echoed_file_names_are_escaped_and_capped() {
    // A path of over 500 bytes (a name is at most 255), with a newline in it.
    let dir = temp_dir("names").join(format!("bad\nname{}", "n".repeat(240)));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m".repeat(250));
    std::fs::write(&path, b"not safetensors").unwrap();
    for args in [
        vec!["sample", "--logits"],
        vec!["top-k-top-p-sample", "--tensors"],
    ] {
        let out = nucleus().args(&args).arg(&path).output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("bad\\nname"), "{err}");
        assert!(err.contains("...: not a safetensors file"), "{err}");
        assert!(err.len() < 400, "{} bytes: {err}", err.len());
    }
}
