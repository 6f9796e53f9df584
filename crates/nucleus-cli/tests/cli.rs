//! `nucleus generate` as a user runs it: output format, exit codes, errors without panics.

use std::path::PathBuf;
use std::process::{Command, Output};

fn model_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K.gguf")
}

fn nucleus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env_remove("NUCLEUS_MODEL")
        // No hub cache, no network: the hub fallback must fail cleanly.
        .env(
            "HF_HOME",
            std::env::temp_dir().join("nucleus-cli-test-no-hub"),
        )
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run nucleus")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn assert_clean_failure(out: &Output) {
    assert!(!out.status.success(), "expected failure");
    let err = text(&out.stderr);
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(!err.contains("stack backtrace"), "backtrace: {err}");
    assert!(!err.contains("internal error"), "internal error: {err}");
}

#[test]
fn greedy_generate_prints_the_story_and_stats() {
    let model = model_path();
    let out = nucleus(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--temperature",
        "0",
        "--max-tokens",
        "40",
        "--echo",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("Once upon a time, there was a little girl named Lily."),
        "{stdout:?}"
    );
    let stderr = text(&out.stderr);
    assert!(stderr.contains("prefill: 5 tokens"), "{stderr}");
    assert!(stderr.contains("decode: "), "{stderr}");
    assert!(
        stderr.contains("finish reason length, 40 tokens"),
        "{stderr}"
    );
}

#[test]
fn several_prompts_print_whole_completions_under_headers() {
    let model = model_path();
    let out = nucleus(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "",
        "--prompt",
        "Tom had a dog",
        "--n",
        "2",
        "--seed",
        "42",
        "--max-tokens",
        "20",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for header in [
        "--- request 0 sample 0 ---",
        "--- request 0 sample 1 ---",
        "--- request 1 sample 0 ---",
        "--- request 1 sample 1 ---",
    ] {
        assert_eq!(stdout.matches(header).count(), 1, "{header} in {stdout}");
    }
    let stderr = text(&out.stderr);
    assert_eq!(stderr.matches("finish reason").count(), 4, "{stderr}");
    // Same seed, same prompts: the same output again.
    let again = nucleus(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "",
        "--prompt",
        "Tom had a dog",
        "--n",
        "2",
        "--seed",
        "42",
        "--max-tokens",
        "20",
    ]);
    assert_eq!(text(&again.stdout), stdout);
}

#[test]
fn bad_flags_fail_with_usage() {
    let out = nucleus(&["generate", "--prompt", "x", "--top-p", "banana"]);
    assert_clean_failure(&out);
    assert_eq!(out.status.code(), Some(2));
    let out = nucleus(&["generate"]);
    assert_clean_failure(&out);
    let out = nucleus(&["frobnicate"]);
    assert_clean_failure(&out);
}

#[test]
fn out_of_range_parameters_are_named() {
    let model = model_path();
    let out = nucleus(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "x",
        "--top-p",
        "1.5",
    ]);
    assert_clean_failure(&out);
    assert!(text(&out.stderr).contains("top_p"), "{}", text(&out.stderr));
}

#[test]
fn missing_model_names_the_flag() {
    let out = nucleus(&[
        "generate",
        "--prompt",
        "x",
        "--model",
        "/nonexistent/m.gguf",
    ]);
    assert_clean_failure(&out);
    assert!(text(&out.stderr).contains("/nonexistent/m.gguf"));
    // No --model, no NUCLEUS_MODEL, no hub: the error says to pass --model.
    let out = nucleus(&["generate", "--prompt", "x"]);
    assert_clean_failure(&out);
    assert!(
        text(&out.stderr).contains("--model"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn corrupt_model_is_a_short_error() {
    let dir = std::env::temp_dir().join(format!("nucleus-cli-corrupt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bytes = std::fs::read(model_path()).unwrap();
    let cases: [(&str, &[u8]); 3] = [
        ("truncated.gguf", &bytes[..bytes.len() / 3]),
        ("header-only.gguf", &bytes[..64]),
        ("text.gguf", b"this is not a gguf file"),
    ];
    for (name, data) in cases {
        let path = dir.join(name);
        std::fs::write(&path, data).unwrap();
        let out = nucleus(&[
            "generate",
            "--prompt",
            "x",
            "--model",
            path.to_str().unwrap(),
        ]);
        assert_clean_failure(&out);
        assert!(
            text(&out.stderr).starts_with("error:"),
            "{name}: {}",
            text(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
