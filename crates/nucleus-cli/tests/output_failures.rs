//! Output that cannot be written: a stderr on `/dev/full` or a closed pipe never crashes a
//! command (it aborted with SIGABRT, exit status 134: `eprintln!` panicked, and the panic
//! hook's own `eprintln!` panicked again), and the exit status stays what it would have been;
//! a stdout that cannot be written is a quiet end on a closed pipe and one `error: writing
//! the output: ...` line otherwise.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::process::{Output, Stdio};

use common::{closed_pipe, dev_full, f32_bytes, run_with, shared, temp_dir, text, write_tensors};
use safetensors::Dtype;

/// The exit code, failing on a death by signal (an abort is SIGABRT).
fn code(out: &Output) -> i32 {
    assert_eq!(out.status.signal(), None, "killed: {:?}", out.status);
    out.status.code().expect("an exit code")
}

/// A named way to make a stderr that cannot be written.
type Unwritable = (&'static str, fn() -> Stdio);

/// The two stderrs that cannot be written.
fn unwritable() -> [Unwritable; 2] {
    [("/dev/full", dev_full), ("a closed pipe", closed_pipe)]
}

#[test]
fn an_error_on_a_stderr_that_cannot_be_written_keeps_its_exit_status() {
    let dir = temp_dir("stderr");
    let logits = dir.join("ok.safetensors");
    write_tensors(
        &logits,
        &[("logits", Dtype::F32, vec![1, 2], f32_bytes(&[1.0, 2.0]))],
    );
    let params = dir.join("p.json");
    std::fs::write(&params, r#"{"bogus": 1}"#).unwrap();
    let (logits, params) = (logits.to_str().unwrap(), params.to_str().unwrap());
    let cases: [(&[&str], i32); 4] = [
        (&["sample", "--input", "/nonexistent"], 1),
        (&["sample", "--logits", logits, "--params", params], 1),
        (
            &[
                "top-k-top-p-sample",
                "--tensors",
                logits,
                "--attrs",
                r#"{"kmax": 3}"#,
            ],
            2,
        ),
        (
            &[
                "grammar",
                "validate",
                "--regex",
                "a",
                "--text",
                "/nonexistent",
            ],
            2,
        ),
    ];
    for (name, stderr) in unwritable() {
        for (args, status) in cases {
            let out = run_with(args, Stdio::piped(), stderr());
            assert_eq!(code(&out), status, "{args:?} with stderr {name}");
        }
    }
}

#[test]
fn a_successful_generate_with_a_stderr_that_cannot_be_written_succeeds() {
    let model = shared("models/stories260K.gguf");
    for (name, stderr) in unwritable() {
        let args = [
            "generate",
            "--model",
            &model,
            "--prompt",
            "hi",
            "--max-tokens",
            "3",
            "--seed",
            "1",
        ];
        let out = run_with(&args, Stdio::piped(), stderr());
        assert_eq!(code(&out), 0, "stderr {name}");
        assert!(!out.stdout.is_empty(), "stderr {name}: no text");
    }
}

/// `grammar validate ARGS` on the text `yes`.
fn validate(args: &[&str], stdout: Stdio) -> Output {
    let dir = temp_dir("validate");
    let text_file = dir.join("t.txt");
    std::fs::write(&text_file, "yes").unwrap();
    let tokenizer = shared("models/minimind-tokenizer/tokenizer.json");
    let mut all = vec!["grammar", "validate", "--tokenizer", &tokenizer];
    all.extend_from_slice(&["--text", text_file.to_str().unwrap()]);
    all.extend_from_slice(args);
    run_with(&all, stdout, Stdio::piped())
}

#[test]
fn grammar_validate_on_a_closed_stdout_keeps_its_verdict_and_a_full_one_is_an_error() {
    // Before: "failed printing to stdout: Broken pipe", exit status 101.
    for (regex, status) in [("yes|no", 0), ("no", 1)] {
        let out = validate(&["--regex", regex], closed_pipe());
        assert_eq!(code(&out), status, "{regex}: {}", text(&out.stderr));
        assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    }
    let out = validate(&["--regex", "yes"], dev_full());
    assert_eq!(code(&out), 2);
    assert_eq!(
        text(&out.stderr),
        "error: writing the output: No space left on device (os error 28)\n"
    );
}

#[test]
fn generate_and_bench_name_a_write_that_fails() {
    let model = shared("models/stories260K.gguf");
    let generate = [
        "generate",
        "--model",
        &model,
        "--prompt",
        "hi",
        "--max-tokens",
        "3",
        "--seed",
        "1",
    ];
    let full = "error: writing the output: No space left on device (os error 28)\n";
    let out = run_with(&generate, dev_full(), Stdio::piped());
    assert_eq!(code(&out), 1);
    assert_eq!(text(&out.stderr), full);
    // A closed pipe (`| head`) ends quietly, as before.
    let out = run_with(&generate, closed_pipe(), Stdio::piped());
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    assert!(
        !text(&out.stderr).contains("error"),
        "{}",
        text(&out.stderr)
    );
    for bench in [
        &["bench", "sampling", "--vocab", "64", "--iters", "1"][..],
        &[
            "bench", "moe", "--rows", "1", "--hidden", "8", "--iters", "1",
        ],
    ] {
        let out = run_with(bench, dev_full(), Stdio::piped());
        assert_eq!(code(&out), 1, "{bench:?}");
        assert_eq!(text(&out.stderr), full, "{bench:?}");
    }
}
