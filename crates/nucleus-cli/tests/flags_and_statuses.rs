//! Exit statuses and flags that say what is true, for `nucleus generate` and `nucleus grammar
//! validate`: a flag value outside its domain, or a flag that has no effect in the given
//! combination, is exit status 2 with one `error:` line (checked before the model is loaded);
//! a failure at run time (a missing model, a prompt the model cannot take) is exit status 1;
//! `grammar validate` keeps grep's convention (0 accepted, 1 rejected, 2 any error).

use std::path::PathBuf;
use std::process::{Command, Output};

fn shared(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(path);
    p.to_str().unwrap().to_string()
}

fn nucleus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args(args)
        .env_remove("NUCLEUS_MODEL")
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

/// The exit status and the one `error:` line of a failed run.
fn failure(out: &Output) -> (i32, String) {
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    (out.status.code().expect("an exit status"), err)
}

/// Each of these is refused with exit status 2 before the model is read (the model path does
/// not exist: a run that got as far as loading it would exit 1).
#[test]
fn generate_flags_outside_their_domain_or_without_effect_exit_2() {
    let cases: [(&[&str], &str); 11] = [
        (
            &["--temperature", "-1"],
            "error: invalid sampling parameter `temperature` = -1: allowed a finite number >= 0\n",
        ),
        (&["--top-p", "2"], "top_p"),
        (&["--top-k", "-5"], "top_k"),
        (&["--n", "0"], "error: --n must be in 1..=1024, got 0\n"),
        (&["--n", "100000"], "error: --n must be in 1..=1024, got 100000\n"),
        (&["--max-tokens", "0"], "error: --max-tokens must be at least 1\n"),
        (
            &["--stop", "ok", "--stop", ""],
            "error: --stop \"\": an empty stop string never matches\n",
        ),
        (
            &["--max-whitespace", "4"],
            "error: --max-whitespace has no effect without --json-schema (it bounds the whitespace between JSON tokens)\n",
        ),
        (
            &["--regex", "a+", "--max-whitespace", "none"],
            "error: --max-whitespace has no effect without --json-schema",
        ),
        (
            &["--grammar", "g.lark", "--max-whitespace", "0"],
            "error: --max-whitespace has no effect without --json-schema",
        ),
        (
            &["--json-schema", "{nope"],
            "error: --json-schema \"{nope\" is neither an existing file nor valid JSON (",
        ),
    ];
    for (args, needle) in cases {
        let out = nucleus(
            &[
                &[
                    "generate",
                    "--prompt",
                    "x",
                    "--model",
                    "/nonexistent/m.gguf",
                ][..],
                args,
            ]
            .concat(),
        );
        let (status, err) = failure(&out);
        assert_eq!(status, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {needle:?} not in {err:?}");
    }
    // With --json-schema, --max-whitespace is taken (and the run goes on to the model: 1).
    let out = nucleus(&[
        "generate",
        "--prompt",
        "x",
        "--model",
        "/nonexistent/m.gguf",
        "--json-schema",
        "{}",
        "--max-whitespace",
        "0",
    ]);
    let (status, err) = failure(&out);
    assert_eq!(status, 1, "{err}");
    assert!(err.contains("/nonexistent/m.gguf"), "{err}");
}

/// A prompt the model's context cannot take is named by its index, counting from 0, as the
/// rest of generate's output names requests; nothing is generated (exit 1).
#[test]
fn a_prompt_that_does_not_fit_the_context_is_named_by_its_index() {
    let long = "a ".repeat(3000);
    let out = nucleus(&[
        "generate",
        "--model",
        &shared("models/stories260K.gguf"),
        "--prompt",
        "Once",
        "--prompt",
        &long,
        "--max-tokens",
        "2",
    ]);
    let (status, err) = failure(&out);
    assert_eq!(status, 1, "{err}");
    assert!(
        err.starts_with("error: --prompt 1 (request 1): ")
            && err.contains("in the model's context of 2048 tokens"),
        "{err}"
    );
}

#[test]
fn grammar_validate_refuses_max_whitespace_without_a_json_schema() {
    let dir = std::env::temp_dir().join(format!("nucleus-flags-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text_file = dir.join("t.txt");
    std::fs::write(&text_file, "yes").unwrap();
    let tokenizer = shared("models/minimind-tokenizer/tokenizer.json");
    let run = |extra: &[&str]| {
        nucleus(
            &[
                &[
                    "grammar",
                    "validate",
                    "--text",
                    text_file.to_str().unwrap(),
                    "--tokenizer",
                    &tokenizer,
                ][..],
                extra,
            ]
            .concat(),
        )
    };
    let out = run(&["--regex", "yes", "--max-whitespace", "2"]);
    let (status, err) = failure(&out);
    assert_eq!(status, 2);
    assert!(
        err.starts_with("error: --max-whitespace has no effect without --json-schema"),
        "{err}"
    );
    // Grep's convention stays: accepted 0, rejected 1.
    let out = run(&["--regex", "yes"]);
    assert_eq!(
        (out.status.code(), text(&out.stdout)),
        (Some(0), "accepted\n".into())
    );
    let out = run(&["--regex", "no"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).starts_with("rejected at token 0"));
    let out = run(&[
        "--json-schema",
        r#"{"type": "string"}"#,
        "--max-whitespace",
        "0",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
}

/// One grammar serves every prompt: its compile error is not led by a prompt's index.
#[test]
fn a_grammar_that_does_not_compile_is_not_blamed_on_a_prompt() {
    let out = nucleus(&[
        "generate",
        "--model",
        &shared("models/stories260K.gguf"),
        "--prompt",
        "a",
        "--regex",
        "(a",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: grammar: "), "{err}");
    assert!(!err.contains("--prompt"), "{err}");
}
