//! Grammars built to break the grammar engine: each is refused at compile time with a message
//! that says why, or compiles and works, and none overflows a stack, whatever thread it is
//! compiled or used on. (Before the depth checks, the deep ones aborted the process with
//! "stack overflow".)

mod common;

use common::{allowed_ids, minimind_compiler};
use nucleus_grammar::{
    GrammarCompiler, GrammarError, GrammarKind, GrammarOptions, GrammarSpec, MAX_GRAMMAR_DEPTH,
    MAX_MESSAGE_LINE,
};
use serde_json::{json, Value};

/// Runs `f` on a thread with a `kib` KiB stack: smaller than any thread a caller would give
/// (tokio's blocking threads and Python's threads have 2 MiB).
fn on_small_stack<T: Send>(kib: usize, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .stack_size(kib << 10)
            .spawn_scoped(s, f)
            .expect("spawn")
            .join()
            .expect("no panic")
    })
}

fn lark_chain(n: usize) -> GrammarSpec {
    let mut text = String::from("start: r0\n");
    for i in 0..n - 1 {
        text.push_str(&format!("r{i}: r{}\n", i + 1));
    }
    text.push_str(&format!("r{}: \"x\"\n", n - 1));
    GrammarSpec::Lark(text)
}

fn schema(value: Value) -> GrammarSpec {
    GrammarSpec::JsonSchema(value.to_string())
}

/// `d0 -> d1 -> ... -> d(n-1)` under `$defs`, each one a `$ref` to the next.
fn ref_chain(n: usize) -> GrammarSpec {
    let mut defs = serde_json::Map::new();
    for i in 0..n - 1 {
        defs.insert(
            format!("d{i}"),
            json!({"$ref": format!("#/$defs/d{}", i + 1)}),
        );
    }
    defs.insert(format!("d{}", n - 1), json!({"type": "string"}));
    schema(json!({"$ref": "#/$defs/d0", "$defs": defs}))
}

/// Objects nested `n` deep through `$defs`: each definition's property `a` is the next.
fn ref_nesting(n: usize) -> GrammarSpec {
    let mut defs = serde_json::Map::new();
    for i in 0..n - 1 {
        defs.insert(
            format!("d{i}"),
            json!({"type": "object", "properties": {"a": {"$ref": format!("#/$defs/d{}", i + 1)}},
                   "required": ["a"], "additionalProperties": false}),
        );
    }
    defs.insert(format!("d{}", n - 1), json!({"type": "integer"}));
    schema(json!({"$ref": "#/$defs/d0", "$defs": defs}))
}

/// Objects nested `n` deep inline: `{"a": {"a": ... 1 ...}}`.
fn inline_nesting(n: usize) -> GrammarSpec {
    let mut s = json!({"type": "integer"});
    for _ in 0..n {
        s = json!({"type": "object", "properties": {"a": s}, "required": ["a"],
                   "additionalProperties": false});
    }
    schema(s)
}

fn too_deep(result: Result<impl std::fmt::Debug, GrammarError>) -> (GrammarKind, u64, String) {
    match result {
        Err(e @ GrammarError::TooDeep { .. }) => {
            let message = e.to_string();
            let GrammarError::TooDeep {
                kind, depth, limit, ..
            } = e
            else {
                unreachable!()
            };
            assert_eq!(limit, MAX_GRAMMAR_DEPTH);
            (kind, depth, message)
        }
        other => panic!("expected TooDeep, got {other:?}"),
    }
}

fn compile(
    compiler: &GrammarCompiler,
    spec: &GrammarSpec,
) -> Result<std::sync::Arc<nucleus_grammar::CompiledGrammar>, GrammarError> {
    compiler.compile(spec, &GrammarOptions::default())
}

#[test]
fn a_lark_chain_of_2800_rules_is_too_deep() {
    let compiler = minimind_compiler();
    let (kind, depth, message) = too_deep(compile(&compiler, &lark_chain(2800)));
    assert_eq!(kind, GrammarKind::Lark);
    // start + r0 .. r2799.
    assert_eq!(depth, 2801);
    assert_eq!(
        message,
        "Lark grammar does not compile: it nests too deeply, up to 2801 levels of rule \
         references; the limit is 1000"
    );
}

#[test]
fn json_schema_ref_chains_and_nesting_past_the_limit_are_too_deep() {
    let compiler = minimind_compiler();
    let (kind, depth, message) = too_deep(compile(&compiler, &ref_chain(3000)));
    assert_eq!(kind, GrammarKind::JsonSchema);
    // root, `$defs`, d0 .. d2999.
    assert_eq!(depth, 3002);
    assert!(
        message.contains("nested subschemas and `$ref`s; the limit is 1000"),
        "{message}"
    );
    // 1,000 objects through $defs: each is the definition, its `properties` and `a`.
    let (_, depth, _) = too_deep(compile(&compiler, &ref_nesting(1000)));
    assert_eq!(depth, 2 + 3 * 999 + 1);
    // The same chains through anchors and through `$id`s.
    let mut defs = serde_json::Map::new();
    for i in 0..2999 {
        defs.insert(
            format!("d{i}"),
            json!({"$anchor": format!("a{i}"), "$ref": format!("#a{}", i + 1)}),
        );
    }
    defs.insert(
        "d2999".into(),
        json!({"$anchor": "a2999", "type": "string"}),
    );
    let (_, depth, _) = too_deep(compile(
        &compiler,
        &schema(json!({"$ref": "#a0", "$defs": defs})),
    ));
    assert_eq!(depth, 3002);
    let mut defs = serde_json::Map::new();
    for i in 0..2999 {
        defs.insert(
            format!("d{i}"),
            json!({"$id": format!("http://example.com/d{i}.json"),
                   "$ref": format!("d{}.json", i + 1)}),
        );
    }
    defs.insert(
        "d2999".into(),
        json!({"$id": "http://example.com/d2999.json", "type": "string"}),
    );
    let (_, depth, _) = too_deep(compile(
        &compiler,
        &schema(json!({"$ref": "http://example.com/d0.json", "$defs": defs})),
    ));
    assert_eq!(depth, 3002);
}

#[test]
fn json_text_nested_past_the_limit_is_too_deep_not_invalid_json() {
    let compiler = minimind_compiler();
    let text = format!(
        "{{\"const\": {}1{}}}",
        "[".repeat(MAX_GRAMMAR_DEPTH),
        "]".repeat(MAX_GRAMMAR_DEPTH)
    );
    let (_, depth, message) = too_deep(compile(&compiler, &GrammarSpec::JsonSchema(text)));
    assert_eq!(depth, MAX_GRAMMAR_DEPTH as u64 + 1);
    assert!(
        message.contains("levels of nested JSON arrays and objects"),
        "{message}"
    );
}

#[test]
fn a_lark_grammar_embedding_a_deep_json_schema_is_too_deep() {
    let compiler = minimind_compiler();
    let mut defs = serde_json::Map::new();
    for i in 0..1199 {
        defs.insert(
            format!("d{i}"),
            json!({"$ref": format!("#/$defs/d{}", i + 1)}),
        );
    }
    defs.insert("d1199".into(), json!({"type": "string"}));
    let embedded = json!({"$ref": "#/$defs/d0", "$defs": defs});
    let spec = GrammarSpec::Lark(format!("start: j\nj: %json {embedded}\n"));
    let (kind, depth, _) = too_deep(compile(&compiler, &spec));
    assert_eq!(kind, GrammarKind::Lark);
    // start, j (1 + the schema's 1,202).
    assert_eq!(depth, 1 + 1 + 1202);
}

/// Grammars just within the limit compile and give masks, compiled and used on threads with
/// 256 KiB of stack: compilation runs on a thread of its own and matcher calls grow the stack
/// when they need to.
#[test]
fn grammars_at_the_limit_compile_and_run_on_a_small_stack() {
    let compiler = minimind_compiler();
    // 998 rules + start = 999 levels.
    let cases = [
        (lark_chain(998), "x".to_string()),
        (ref_chain(997), "\"x\"".to_string()),
        // 332 objects through $defs: 2 + 3 * 331 + 1 = 996.
        (
            ref_nesting(332),
            format!("{}1{}", "{\"a\":".repeat(331), "}".repeat(331)),
        ),
        // Inline: 498 objects, each an object and its `properties`, then the integer: 997.
        (
            inline_nesting(498),
            format!("{}1{}", "{\"a\":".repeat(498), "}".repeat(498)),
        ),
    ];
    for (spec, text) in &cases {
        let compiled = on_small_stack(256, || compile(&compiler, spec))
            .unwrap_or_else(|e| panic!("{:.60}: {e}", spec.text()));
        let env = compiler.token_env().clone();
        let tokens = env.encode(text).expect("encode");
        let verdict = on_small_stack(256, || {
            let mut m = compiled.matcher();
            let mut row = vec![0u32; env.bitmask_words()];
            for &t in &tokens {
                m.fill_bitmask(&mut row).expect("mask");
                assert!(common::allowed(&row, t), "token {t} not allowed");
                m.commit(t).expect("commit");
            }
            m.fill_bitmask(&mut row).expect("mask");
            (m.may_end(), allowed_ids(&row))
        });
        assert!(verdict.0, "{:.60} should accept {text:.60}", spec.text());
        assert_eq!(verdict.1, vec![0, 2], "only EOS after a complete text");
    }
}

#[test]
fn a_schema_nested_64_deep_inline_is_valid_json_and_compiles() {
    // serde_json's own limit (128 levels) refused this as "recursion limit exceeded".
    let compiler = minimind_compiler();
    let spec = inline_nesting(70);
    let m = compile(&compiler, &spec).expect("compiles");
    assert_eq!(m.kind(), GrammarKind::JsonSchema);
}

#[test]
fn a_self_referencing_schema_is_a_compile_error_that_says_it_matches_nothing() {
    let compiler = minimind_compiler();
    for text in [
        r##"{"$ref": "#"}"##,
        r##"{"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}"##,
    ] {
        match compile(&compiler, &GrammarSpec::JsonSchema(text.into())) {
            Err(GrammarError::Compile { kind, message }) => {
                assert_eq!(kind, GrammarKind::JsonSchema);
                assert!(
                    message.starts_with("the grammar matches no text"),
                    "{message}"
                );
            }
            other => panic!("{text}: expected a compile error, got {other:?}"),
        }
    }
    match compile(&compiler, &GrammarSpec::Lark("start: start\n".into())) {
        Err(GrammarError::Compile { message, .. }) => {
            assert!(
                message.starts_with("the grammar matches no text"),
                "{message}"
            )
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn nested_repetition_counts_are_a_compile_error_that_says_the_grammar_is_too_large() {
    let compiler = minimind_compiler();
    match compile(&compiler, &GrammarSpec::Regex("a{1000}{1000}".into())) {
        Err(GrammarError::Compile { kind, message }) => {
            assert_eq!(kind, GrammarKind::Regex);
            assert!(
                message.starts_with("the grammar is too large for llguidance's lexer"),
                "{message}"
            );
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

/// llguidance's own messages are made one line fit for a terminal: a panic's backtrace
/// dropped, the quoted lines of the grammar dropped, control characters escaped, the length cut.
#[test]
fn compile_messages_are_short_and_have_no_backtrace_or_control_characters() {
    let compiler = minimind_compiler();
    // 70,000 symbols overflow llguidance's u16 symbol ids: an assertion inside llguidance.
    let seq = format!("start: {}\n", "\"a\" ".repeat(70_000));
    // A syntax error on a 300,000-character line with an escape character in it, and one on a
    // line of 300 control characters (each written as 6 characters, `\u{7}`).
    let long = format!("start: \"\x1b\" {}\n", "(".repeat(300_000));
    let bells = format!("start: \"ye{}\n", "\x07".repeat(300));
    for text in [seq, long, bells] {
        let e = compile(&compiler, &GrammarSpec::Lark(text)).expect_err("does not compile");
        let GrammarError::Compile { message, .. } = &e else {
            panic!("{e:?}")
        };
        assert!(!message.contains("backtrace"), "{message}");
        assert!(
            !message.contains('\x1b') && !message.contains('\x07'),
            "{message}"
        );
        assert!(!message.contains('\n'), "one line: {message}");
        assert!(
            message.chars().count() <= MAX_MESSAGE_LINE + 3,
            "{message:.400}"
        );
    }
    // The assertion llguidance fails is said in words.
    let e = compile(
        &compiler,
        &GrammarSpec::Lark(format!("start: {}\n", "\"a\" ".repeat(70_000))),
    )
    .expect_err("does not compile");
    assert!(
        e.to_string().starts_with(
            "Lark grammar does not compile: the grammar has more symbols than llguidance can number"
        ),
        "{e}"
    );
    // A regex syntax error: the report's first line and its `error:` line, on one line.
    let e = compile(&compiler, &GrammarSpec::Regex("[".into())).expect_err("does not compile");
    assert_eq!(
        e.to_string(),
        "regular expression does not compile: at 1(8): invalid regex \"[\" (in regex): regex \
         parse error: unclosed character class"
    );
}

/// The bounds over-approximate: real schemas are far inside them. Every schema of the
/// JSONSchemaBench sample that compiled before the depth checks still compiles.
#[test]
fn real_schemas_are_far_inside_the_depth_limit() {
    let dir = common::shared("data/jsonschema-sample");
    let mut deepest = 0;
    let mut files = 0;
    let paths = std::fs::read_dir(&dir)
        .expect("sample dir")
        .filter_map(|d| std::fs::read_dir(d.ok()?.path()).ok())
        .flatten()
        .filter_map(|f| Some(f.ok()?.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"));
    for path in paths {
        let text = std::fs::read_to_string(&path).expect("read");
        let value: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(_) => continue,
        };
        let schema = value.get("schema").cloned().unwrap_or(value);
        deepest = deepest.max(nucleus_grammar::schema_depth(&schema));
        files += 1;
    }
    assert!(files > 0, "no schemas read from {}", dir.display());
    println!("deepest bound over {files} schemas: {deepest}");
    assert!(deepest < MAX_GRAMMAR_DEPTH as u64 / 10, "{deepest}");
}

#[test]
fn a_grammar_llguidance_never_settles_is_refused_within_the_first_step_limit() {
    // Two greedy lexemes matching the same text in a row: llguidance forces `a` bytes forever
    // (and its memory grows) in the first mask. The compiler's watchdog cancels it.
    let compiler = minimind_compiler();
    // (`start: A "a"` with `A: /a+/` does the same; one grammar keeps the test at 10 s.)
    let text = "start: A B\nA: /a+/\nB: /a+/";
    let t0 = std::time::Instant::now();
    let err = compiler
        .compile(&GrammarSpec::Lark(text.into()), &GrammarOptions::default())
        .expect_err("refused");
    let elapsed = t0.elapsed();
    assert!(
        elapsed < nucleus_grammar::FIRST_STEP_LIMIT + std::time::Duration::from_secs(5),
        "{elapsed:?}"
    );
    let message = err.to_string();
    assert!(message.contains("did not settle"), "{message}");
    // A grammar that settles is not affected.
    compiler
        .compile(
            &GrammarSpec::Lark("start: A B\nA: /a+/\nB: /b+/".into()),
            &GrammarOptions::default(),
        )
        .expect("compiles");
}
