//! `nucleus generate` with structured output, as a user runs it on stories260K: every
//! completion obeys its JSON Schema, regular expression or Lark grammar (checked here by
//! parsing, not by the grammar engine), and bad grammars or flags fail with the documented
//! exit statuses.

use std::path::PathBuf;
use std::process::Command;

fn stories() -> String {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K.gguf");
    p.to_str().unwrap().to_string()
}

/// (exit status, stdout, stderr) of `nucleus generate --model stories260K ARGS`.
fn generate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .arg("generate")
        .arg("--model")
        .arg(stories())
        .args(args)
        .output()
        .expect("run nucleus");
    (
        out.status.code().expect("exit status"),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

const SCHEMA: &str = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":10},"mood":{"enum":["happy","sad"]}},"required":["name","mood"],"additionalProperties":false}"#;

/// The completion is exactly `{"name":<string of at most 10 chars>,"mood":"happy"|"sad"}`.
fn check_object(text: &str) {
    let v: serde_json::Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let obj = v.as_object().expect("an object");
    assert_eq!(obj.len(), 2, "{text:?}");
    let name = obj["name"].as_str().expect("name is a string");
    assert!(name.chars().count() <= 10, "{text:?}");
    assert!(
        ["happy", "sad"].contains(&obj["mood"].as_str().unwrap()),
        "{text:?}"
    );
}

/// Whether JSON text has whitespace outside its strings.
fn whitespace_outside_strings(text: &str) -> bool {
    let (mut in_string, mut escaped) = (false, false);
    for c in text.chars() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if c.is_whitespace() {
            return true;
        }
    }
    false
}

#[test]
fn json_schema_inline_and_from_a_file() {
    for seed in ["1", "2", "3"] {
        let (code, out, err) = generate(&[
            "--prompt",
            "",
            "--json-schema",
            SCHEMA,
            "--max-whitespace",
            "0",
            "--seed",
            seed,
        ]);
        assert_eq!(code, 0, "{err}");
        let text = out.strip_suffix('\n').unwrap();
        assert!(!whitespace_outside_strings(text), "compact JSON: {text:?}");
        check_object(text);
        assert!(
            err.contains("finish reason stop") || err.contains("finish reason eos"),
            "{err}"
        );
    }
    let dir = std::env::temp_dir().join(format!("nucleus-generate-grammar-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("schema.json");
    std::fs::write(&path, SCHEMA).unwrap();
    let (code, out, err) = generate(&[
        "--prompt",
        "Once",
        "--json-schema",
        path.to_str().unwrap(),
        "--seed",
        "4",
    ]);
    assert_eq!(code, 0, "{err}");
    check_object(out.trim_end_matches('\n'));
}

#[test]
fn regex_and_lark_outputs_match() {
    for seed in ["1", "2", "5"] {
        let (code, out, err) = generate(&[
            "--prompt",
            "Tom",
            "--regex",
            "(yes|no)( [a-z]{1,6}){0,2}",
            "--seed",
            seed,
        ]);
        assert_eq!(code, 0, "{err}");
        let text = out.strip_suffix('\n').unwrap();
        let mut words = text.split(' ');
        assert!(["yes", "no"].contains(&words.next().unwrap()), "{text:?}");
        let rest: Vec<&str> = words.collect();
        assert!(rest.len() <= 2, "{text:?}");
        assert!(
            rest.iter()
                .all(|w| (1..=6).contains(&w.len()) && w.chars().all(|c| c.is_ascii_lowercase())),
            "{text:?}"
        );
    }
    let dir = std::env::temp_dir().join(format!("nucleus-generate-lark-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("g.lark");
    std::fs::write(&path, "start: \"a\" \"b\"+\n").unwrap();
    let (code, out, err) = generate(&[
        "--prompt",
        "x",
        "--grammar",
        path.to_str().unwrap(),
        "--max-tokens",
        "12",
        "--seed",
        "1",
    ]);
    assert_eq!(code, 0, "{err}");
    let text = out.strip_suffix('\n').unwrap();
    assert!(
        text.starts_with("ab") && text[1..].chars().all(|c| c == 'b'),
        "{text:?}"
    );
}

#[test]
fn bad_grammars_and_flags_fail() {
    let (code, _, err) = generate(&["--prompt", "x", "--json-schema", r#"{"type":"nope"}"#]);
    assert_eq!(code, 1);
    assert!(err.contains("grammar") && err.contains("nope"), "{err}");
    let (code, _, err) = generate(&["--prompt", "x", "--regex", "(ab"]);
    assert_eq!(code, 1, "{err}");
    let (code, _, err) = generate(&["--prompt", "x", "--regex", "a", "--json-schema", "{}"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = generate(&["--prompt", "x", "--grammar", "/nonexistent/g.lark"]);
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent/g.lark"), "{err}");
}

/// Found by a new user: a regex starting with `-`, forced text spelling `</s>`, a schema path
/// that does not exist, an oversized whitespace bound, a missing grammar file's cause.
#[test]
fn new_user_findings_stay_fixed() {
    let (code, out, err) = generate(&["--prompt", "", "--regex", "-?[0-9]{1,3}", "--seed", "2"]);
    assert_eq!(code, 0, "{err}");
    let text = out.strip_suffix('\n').unwrap();
    let digits = text.strip_prefix('-').unwrap_or(text);
    assert!(
        (1..=3).contains(&digits.len()) && digits.chars().all(|c| c.is_ascii_digit()),
        "{text:?}"
    );

    let (code, out, err) = generate(&["--prompt", "", "--regex", "</s>", "--seed", "1"]);
    assert_eq!((code, out.as_str()), (0, "</s>\n"), "{err}");
    assert!(err.contains("finish reason stop"), "{err}");

    let (code, _, err) = generate(&["--prompt", "x", "--json-schema", "/nonexistent/schema.json"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("neither an existing file nor valid JSON"),
        "{err}"
    );
    let (code, _, err) = generate(&[
        "--prompt",
        "x",
        "--json-schema",
        "{}",
        "--max-whitespace",
        "4294967296",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("at most 1000"), "{err}");
    let (code, _, err) = generate(&["--prompt", "x", "--grammar", "/nonexistent/g.lark"]);
    assert_eq!(code, 1);
    assert!(err.contains("No such file"), "{err}");
}

/// A grammar's compile error is printed once (the engine's message quotes llguidance's, and
/// the whole chain of causes was printed, repeating it), and grammars that used to abort the
/// process with a stack overflow or fail at the first step are compile errors that say why.
#[test]
fn grammar_errors_are_one_line_that_says_why() {
    let (code, _, err) = generate(&["--prompt", "", "--json-schema", "false"]);
    assert_eq!(code, 1);
    assert_eq!(
        err,
        "error: grammar: JSON Schema does not compile: Unsatisfiable schema: schema is false\n"
    );
    let chain: String = (0..2799).map(|i| format!("r{i}: r{}\n", i + 1)).collect();
    let path = std::env::temp_dir().join(format!("nucleus-chain-{}.lark", std::process::id()));
    std::fs::write(&path, format!("start: r0\n{chain}r2799: \"x\"\n")).unwrap();
    let (code, _, err) = generate(&["--prompt", "", "--grammar", path.to_str().unwrap()]);
    std::fs::remove_file(&path).ok();
    assert_eq!(code, 1);
    assert_eq!(
        err,
        "error: grammar: Lark grammar does not compile: it nests too deeply, up to 2801 levels \
         of rule references; the limit is 1000\n"
    );
    let (code, _, err) = generate(&["--prompt", "", "--json-schema", r##"{"$ref": "#"}"##]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with(
            "error: grammar: JSON Schema does not compile: the grammar matches no text"
        ),
        "{err}"
    );
    let (code, _, err) = generate(&["--prompt", "", "--regex", "a{1000}{1000}"]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with(
            "error: grammar: regular expression does not compile: the grammar is too large for \
             llguidance's lexer"
        ),
        "{err}"
    );
}
