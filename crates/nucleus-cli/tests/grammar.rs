//! `nucleus grammar validate` as a user runs it: verdict lines, exit statuses (0 accepted,
//! 1 rejected, 2 error), tokenizers from a tokenizer.json and from a GGUF model.

use std::path::PathBuf;
use std::process::{Command, Output};

fn shared(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(path);
    p.to_str().unwrap().to_string()
}

fn minimind() -> String {
    shared("models/minimind-tokenizer/tokenizer.json")
}

fn stories() -> String {
    shared("models/stories260K.gguf")
}

/// A file in a fresh temporary directory of this test binary.
fn file(name: &str, contents: &str) -> String {
    let dir = std::env::temp_dir().join(format!("nucleus-grammar-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path.to_str().unwrap().to_string()
}

fn run(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nucleus"));
    cmd.arg("grammar")
        .arg("validate")
        .args(args)
        .env_remove("NUCLEUS_MODEL")
        .env(
            "HF_HOME",
            std::env::temp_dir().join("nucleus-cli-test-no-hub"),
        )
        .env("HF_HUB_OFFLINE", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("run nucleus")
}

/// (exit status, stdout, stderr).
fn validate(args: &[&str]) -> (i32, String, String) {
    let out = run(args, &[]);
    (
        out.status.code().expect("exit status"),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn yes_no_with_the_minimind_tokenizer() {
    let tk = minimind();
    let v = |text: &str| {
        validate(&[
            "--regex",
            "yes|no",
            "--text",
            &file("t.txt", text),
            "--tokenizer",
            &tk,
        ])
    };
    assert_eq!(v("yes\n"), (0, "accepted\n".into(), String::new()));
    assert_eq!(v("no").0, 0);
    // yes! is y (124) es (329) ! (36) in MiniMind's vocabulary.
    assert_eq!(
        v("yes!"),
        (
            1,
            "rejected at token 2 (id 36, text \"!\")\n".into(),
            String::new()
        )
    );
    assert_eq!(
        v("ye"),
        (
            1,
            "rejected at end of text (the grammar cannot end here)\n".into(),
            String::new()
        )
    );
    // Only one trailing newline is dropped; the second is token 2, "\n" (Ċ, 234).
    let (code, out, _) = v("yes\n\n");
    assert_eq!(
        (code, out.as_str()),
        (1, "rejected at token 2 (id 234, text \"\\n\")\n")
    );
}

#[test]
fn yes_no_with_the_stories260k_gguf_tokenizer_has_no_dummy_prefix() {
    let m = stories();
    let yes = file("yes.txt", "yes");
    // With the SentencePiece dummy prefix, "yes" would start with a space and be rejected.
    assert_eq!(
        validate(&["--regex", "yes|no", "--text", &yes, "--model", &m]).1,
        "accepted\n"
    );
    let (code, out, _) = validate(&[
        "--regex",
        "yes|no",
        "--text",
        &file("b.txt", "yes!"),
        "--model",
        &m,
    ]);
    assert_eq!(code, 1);
    assert!(
        out.starts_with("rejected at token ") && out.ends_with(", text \"!\")\n"),
        "{out}"
    );
    // The default model: $NUCLEUS_MODEL, as `generate` does.
    let out = run(
        &["--regex", "yes|no", "--text", &yes],
        &[("NUCLEUS_MODEL", &m)],
    );
    assert_eq!(
        (out.status.code(), out.stdout),
        (Some(0), b"accepted\n".to_vec())
    );
    // No model anywhere (offline hub): an error, exit 2.
    let (code, out, err) = validate(&["--regex", "yes|no", "--text", &yes]);
    assert_eq!((code, out.as_str()), (2, ""));
    assert!(
        err.starts_with("error: ") && err.contains("pass --model"),
        "{err}"
    );
}

#[test]
fn json_schemas_inline_and_from_files_and_lark_grammars() {
    let tk = minimind();
    let schema =
        r#"{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}"#;
    let schema_file = file("schema.json", schema);
    let good = file("good.json", "{\"a\": 1}\n");
    let bad = file("bad.json", "{\"a\": \"x\"}");
    for s in [schema, schema_file.as_str()] {
        assert_eq!(
            validate(&["--json-schema", s, "--text", &good, "--tokenizer", &tk]).0,
            0
        );
        let (code, out, _) = validate(&["--json-schema", s, "--text", &bad, "--tokenizer", &tk]);
        assert_eq!(code, 1);
        assert!(out.starts_with("rejected at token "), "{out}");
        assert!(
            out.ends_with("\nschema: invalid at /a: \"x\" is not of type \"integer\"\n"),
            "{out}"
        );
    }
    // Whitespace: unbounded in validation unless --max-whitespace says otherwise (generation
    // keeps its bound of 8).
    let spaced = file("spaced.json", "{\"a\":         1}");
    let args = [
        "--json-schema",
        schema,
        "--text",
        &spaced,
        "--tokenizer",
        &tk,
    ];
    assert_eq!(validate(&args).0, 0);
    assert_eq!(
        validate(&[&args[..], &["--max-whitespace", "8"]].concat()).0,
        1
    );
    assert_eq!(
        validate(&[&args[..], &["--max-whitespace", "none"]].concat()).0,
        0
    );
    assert_eq!(
        validate(&[&args[..], &["--max-whitespace", "9"]].concat()).0,
        0
    );

    let lark = file("yn.lark", "start: \"yes\" | \"no\"\n");
    assert_eq!(
        validate(&[
            "--grammar",
            &lark,
            "--text",
            &file("no.txt", "no"),
            "--tokenizer",
            &tk
        ])
        .0,
        0
    );
}

#[test]
fn errors_exit_2_with_one_line() {
    let tk = minimind();
    let text = file("x.txt", "x");
    let (code, out, err) = validate(&[
        "--json-schema",
        r#"{"type": "foo"}"#,
        "--text",
        &text,
        "--tokenizer",
        &tk,
    ]);
    assert_eq!(
        (code, out.as_str(), err.as_str()),
        (
            2,
            "",
            "error: JSON Schema does not compile: Invalid type: foo\n"
        )
    );
    let (code, _, err) = validate(&[
        "--json-schema",
        "{nope",
        "--text",
        &text,
        "--tokenizer",
        &tk,
    ]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with(
            "error: --json-schema \"{nope\" is neither an existing file nor valid JSON ("
        ),
        "{err}"
    );
    let (code, _, err) = validate(&["--regex", "(a", "--text", &text, "--tokenizer", &tk]);
    assert_eq!(code, 2);
    assert!(err.contains("unclosed group"), "{err}");
    let (code, _, err) = validate(&[
        "--regex",
        "x",
        "--text",
        "/nonexistent/t.txt",
        "--tokenizer",
        &tk,
    ]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with("error: cannot read --text /nonexistent/t.txt: No such file"),
        "{err}"
    );
    let (code, _, err) = validate(&[
        "--grammar",
        "/nonexistent/g.lark",
        "--text",
        &text,
        "--tokenizer",
        &tk,
    ]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with("error: cannot read --grammar /nonexistent/g.lark"),
        "{err}"
    );
    let (code, _, err) = validate(&[
        "--regex",
        "x",
        "--text",
        &text,
        "--tokenizer",
        "/nonexistent/tokenizer.json",
    ]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with("error: cannot read --tokenizer /nonexistent/tokenizer.json"),
        "{err}"
    );
    // Flags: two grammars, no grammar, --model with --tokenizer.
    assert_eq!(
        validate(&["--regex", "x", "--json-schema", "{}", "--text", &text]).0,
        2
    );
    assert_eq!(validate(&["--text", &text, "--tokenizer", &tk]).0, 2);
    assert_eq!(
        validate(&[
            "--regex",
            "x",
            "--text",
            &text,
            "--tokenizer",
            &tk,
            "--model",
            &stories()
        ])
        .0,
        2
    );
    assert_eq!(
        validate(&["--regex", "x", "--text", &text, "--max-whitespace", "lots"]).0,
        2
    );
}

/// Grammars that aborted the process with a stack overflow: a Lark chain of 2,800 rules, a
/// `$ref` chain of 3,000, objects nested 1,000 deep through `$defs`, are errors (exit 2) that
/// give the limit; a schema nested 70 deep inline, which serde_json's own limit refused as
/// invalid JSON, is checked; a byte token is shown as its byte.
#[test]
fn deep_grammars_are_errors_that_give_the_limit_and_byte_tokens_show_their_byte() {
    let text = file("x.txt", "x");
    let chain: String = (0..2799).map(|i| format!("r{i}: r{}\n", i + 1)).collect();
    let lark = file("chain.lark", &format!("start: r0\n{chain}r2799: \"x\"\n"));
    let (code, out, err) = validate(&[
        "--grammar",
        &lark,
        "--text",
        &text,
        "--tokenizer",
        &minimind(),
    ]);
    assert_eq!((code, out.as_str()), (2, ""));
    assert_eq!(
        err,
        "error: Lark grammar does not compile: it nests too deeply, up to 2801 levels of rule \
         references; the limit is 1000\n"
    );
    let defs: Vec<String> = (0..2999)
        .map(|i| format!("\"d{i}\": {{\"$ref\": \"#/$defs/d{}\"}}", i + 1))
        .collect();
    let refs = file(
        "refs.json",
        &format!(
            "{{\"$ref\": \"#/$defs/d0\", \"$defs\": {{{}, \"d2999\": {{}}}}}}",
            defs.join(", ")
        ),
    );
    let nested: Vec<String> = (0..999)
        .map(|i| format!("\"d{i}\": {{\"type\": \"object\", \"properties\": {{\"a\": {{\"$ref\": \"#/$defs/d{}\"}}}}}}", i + 1))
        .collect();
    let nested = file(
        "nested.json",
        &format!(
            "{{\"$ref\": \"#/$defs/d0\", \"$defs\": {{{}, \"d999\": {{}}}}}}",
            nested.join(", ")
        ),
    );
    for schema in [refs, nested] {
        let (code, _, err) = validate(&[
            "--json-schema",
            &schema,
            "--text",
            &text,
            "--tokenizer",
            &minimind(),
        ]);
        assert_eq!(code, 2, "{err}");
        assert!(
            err.starts_with("error: JSON Schema does not compile: it nests too deeply"),
            "{err}"
        );
        assert!(
            err.ends_with("levels of nested subschemas and `$ref`s; the limit is 1000\n"),
            "{err}"
        );
    }
    let mut inline = String::from("{\"type\": \"integer\"}");
    for _ in 0..70 {
        inline = format!(
            "{{\"type\": \"object\", \"properties\": {{\"a\": {inline}}}, \"required\": [\"a\"]}}"
        );
    }
    let value = format!("{}1{}", "{\"a\": ".repeat(70), "}".repeat(70));
    let (code, out, err) = validate(&[
        "--json-schema",
        &inline,
        "--text",
        &file("v.json", &value),
        "--tokenizer",
        &minimind(),
    ]);
    assert_eq!(
        (code, out.as_str(), err.as_str()),
        (0, "accepted\nschema: valid\n", "")
    );
    let (code, out, _) = validate(&[
        "--regex",
        "x",
        "--text",
        &file("cat.txt", "猫"),
        "--model",
        &stories(),
    ]);
    assert_eq!(
        (code, out.as_str()),
        (1, "rejected at token 0 (id 234, text \"<0xE7>\")\n")
    );
}
