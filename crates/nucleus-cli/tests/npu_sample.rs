//! `nucleus top-k-top-p-sample` and `nucleus bench npu-sample` as a user runs them: JSON lines
//! and safetensors in, one JSON answer per call out, error answers, exit statuses. Expected
//! values are the spec's worked cases or the library's own answer for the same call.

mod common;

use common::{
    answers, bf16_bytes, f16_bytes, f32_bytes, i32_bytes, i64_bytes, nucleus, run_subcommand,
    temp_dir, text, write_tensors, TensorSpec,
};
use std::path::Path;
use std::process::Output;

use half::bf16;
use nucleus_sampling::npu::{top_k_top_p_sample, QIndexing, TopKTopPSampleOptions};
use nucleus_sampling::{InputKind, LogitsView};
use safetensors::Dtype;
use serde_json::{json, Value};

/// Runs `nucleus top-k-top-p-sample ARGS` with `stdin` as its standard input.
fn run(args: &[&str], stdin: &str) -> Output {
    run_subcommand("top-k-top-p-sample", args, stdin)
}

fn calls(lines: &[Value]) -> Vec<Value> {
    let input: String = lines.iter().map(|l| format!("{l}\n")).collect();
    answers(&run(&[], &input))
}

/// The raw stdout of one call line (to check the exact spelling).
fn raw(line: &str) -> String {
    let out = run(&[], &format!("{line}\n"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
}

fn error_of(answer: &Value) -> (String, String) {
    let e = &answer["error"];
    (
        e["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("not an error: {answer}"))
            .to_owned(),
        e["message"].as_str().unwrap().to_owned(),
    )
}

// ---- The spec's worked cases through the CLI ----

#[test]
fn worked_cases_give_the_spec_answers_spelled_exactly() {
    assert_eq!(
        raw(r#"{"logits": [[1, 3, 2, 3]], "top_k": [2], "top_p": [1], "is_need_logits": true}"#),
        "{\"logits_select_idx\":[1],\"logits_top_kp_select\":[[\"-inf\",3.0,\"-inf\",3.0]],\"row_errors\":[null]}\n"
    );
    let probs = r#""logits": [[0.25, 0.125, 0.125, 0.5]], "input_is_logits": false, "top_k": [0], "top_p": [0.75], "is_need_logits": true"#;
    assert_eq!(
        raw(&format!("{{{probs}}}")),
        "{\"logits_select_idx\":[3],\"logits_top_kp_select\":[[0.25,0.125,0.0,0.5]],\"row_errors\":[null]}\n"
    );
    let got = calls(&[
        serde_json::from_str(&format!("{{{probs}, \"q\": [[1, 1, 0.01, 1]]}}")).unwrap(),
        serde_json::from_str(&format!("{{{probs}, \"q\": [[1, 0.1, 1, 1]]}}")).unwrap(),
    ]);
    assert_eq!(got[0]["logits_select_idx"], json!([3]));
    assert_eq!(got[1]["logits_select_idx"], json!([1]));
    // Without is_need_logits, no select output.
    assert_eq!(
        raw(r#"{"logits": [[1, 3, 2, 3], [5, 1, 1, 1]], "top_k": [0, 2000], "top_p": [1, 0]}"#),
        "{\"logits_select_idx\":[1,0],\"logits_top_kp_select\":null,\"row_errors\":[null,null]}\n"
    );
}

// ---- Answers equal the library's ----

/// The library's answer for a call of f32 rows, as the CLI would write it.
fn library_answer(call: &Value) -> Value {
    let rows: Vec<Vec<f32>> = serde_json::from_value(call["logits"].clone()).unwrap();
    let (batch, vocab) = (rows.len(), rows[0].len());
    let data: Vec<f32> = rows.concat();
    let kind = if call["input_is_logits"] == json!(false) {
        InputKind::Probs
    } else {
        InputKind::Logits
    };
    let view = LogitsView::dense(&data, batch, vocab)
        .unwrap()
        .with_kind(kind);
    let top_k: Vec<i32> = serde_json::from_value(call["top_k"].clone()).unwrap();
    let top_p: Vec<f32> = serde_json::from_value(call["top_p"].clone()).unwrap();
    let q: Option<Vec<Vec<f32>>> = serde_json::from_value(call["q"].clone()).unwrap();
    let q = q.map(|q| q.concat());
    let min_ps: Option<Vec<f32>> = serde_json::from_value(call["min_ps"].clone()).unwrap();
    let options = TopKTopPSampleOptions {
        is_need_logits: call["is_need_logits"] == json!(true),
        q_indexing: if call["q_indexing"] == json!("sorted_rank") {
            QIndexing::SortedRank
        } else {
            QIndexing::TokenId
        },
        ks_max: call["ks_max"].as_i64().unwrap_or(1024),
        eps: call["eps"].as_f64().unwrap_or(1e-8),
        ..Default::default()
    };
    let out = top_k_top_p_sample(
        &view,
        &top_k,
        &top_p,
        q.as_deref(),
        min_ps.as_deref(),
        &options,
    )
    .unwrap();
    // The CLI writes an f32 as serde_json spells it (shortest form), read back as an f64.
    let cell = |v: f32| {
        if v == f32::NEG_INFINITY {
            json!("-inf")
        } else {
            serde_json::from_str::<Value>(&serde_json::to_string(&v).unwrap()).unwrap()
        }
    };
    json!({
        "logits_select_idx": out.logits_select_idx,
        "logits_top_kp_select": out.logits_top_kp_select.map(|s| {
            s.chunks(vocab).map(|r| r.iter().map(|&v| cell(v)).collect::<Vec<_>>()).collect::<Vec<_>>()
        }),
        "row_errors": vec![Value::Null; batch],
    })
}

#[test]
fn answers_equal_the_librarys_for_every_stage_and_option() {
    // A small deterministic generator.
    let mut s = 0x1234_5678_u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut lines = Vec::new();
    for i in 0..40 {
        let batch = 1 + (next() % 3) as usize;
        let vocab = 1 + (next() % 60) as usize;
        let probs = i % 4 == 3;
        let rows: Vec<Vec<f32>> = (0..batch)
            .map(|_| {
                (0..vocab)
                    .map(|_| {
                        let r = (next() % 1000) as f32 / 100.0;
                        if probs {
                            r / 10.0
                        } else {
                            r - 5.0
                        }
                    })
                    .collect()
            })
            .collect();
        let mut call = json!({
            "logits": rows,
            "top_k": (0..batch).map(|_| (next() % 12) as i32 - 1).collect::<Vec<_>>(),
            "top_p": (0..batch).map(|_| [0.0f32, 0.3, 0.75, 0.9, 1.0][(next() % 5) as usize]).collect::<Vec<_>>(),
            "is_need_logits": i % 2 == 0,
            "input_is_logits": !probs,
        });
        if i % 3 != 0 {
            call["q"] = json!((0..batch)
                .map(|_| (0..vocab)
                    .map(|_| (next() % 100 + 1) as f32 / 37.0)
                    .collect::<Vec<_>>())
                .collect::<Vec<_>>());
        }
        if i % 5 == 1 {
            call["min_ps"] = json!((0..batch)
                .map(|_| (next() % 4) as f32 / 8.0)
                .collect::<Vec<_>>());
        }
        if i % 7 == 2 {
            call["q_indexing"] = json!("sorted_rank");
        }
        if i % 6 == 5 {
            call["ks_max"] = json!(4);
            call["eps"] = json!(0.5);
        }
        lines.push(call);
    }
    let got = calls(&lines);
    assert_eq!(got.len(), lines.len());
    for (call, answer) in lines.iter().zip(&got) {
        assert_eq!(answer, &library_answer(call), "{call}");
    }
}

#[test]
fn number_strings_are_read_and_non_finite_values_written_as_strings() {
    let got = calls(&[json!({
        "logits": [["-inf", 2, " -INF ", "1e0"]],
        "top_k": [0], "top_p": ["inf"], "is_need_logits": true
    })]);
    // "1e0" is not a number spelling: an invalid_call naming the place.
    assert_eq!(error_of(&got[0]).0, "invalid_call");
    let got = calls(&[json!({
        "logits": [["-inf", 2, " -INF ", 1]],
        "top_k": [0], "top_p": ["inf"], "q": [[1, 1, 1, "inf"]], "is_need_logits": true
    })]);
    assert_eq!(
        got[0],
        json!({"logits_select_idx": [1], "logits_top_kp_select": [["-inf", 2.0, "-inf", 1.0]], "row_errors": [null]})
    );
}

// ---- Errors ----

#[test]
fn an_invalid_call_gets_an_error_answer_and_the_next_lines_are_answered() {
    let ok = r#"{"logits": [[1, 3]], "top_k": [1], "top_p": [1]}"#;
    let cases = [
        (r#"{"logits": [[1, 2"#, "invalid_json", "not valid JSON"),
        ("[1, 2]", "invalid_call", "a JSON object"),
        (
            r#"{"logits": [[1, 2]], "top_p": [1]}"#,
            "invalid_call",
            "missing field `top_k`",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [1], "top_p": [1], "topk": 1}"#,
            "invalid_call",
            "unknown field `topk`",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [1.5], "top_p": [1]}"#,
            "invalid_call",
            "top_k[0]",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [3000000000], "top_p": [1]}"#,
            "invalid_call",
            "top_k[0]",
        ),
        (
            r#"{"logits": [[1, 1e39]], "top_k": [1], "top_p": [1]}"#,
            "invalid_call",
            "logits[0][1] = 1e39 is outside the f32 range",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [1], "top_p": [1e39]}"#,
            "invalid_call",
            "top_p[0] = 1e39",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [1], "top_p": [1], "q_indexing": "rank"}"#,
            "invalid_call",
            "q_indexing",
        ),
        (
            r#"{"logits": [], "top_k": [], "top_p": []}"#,
            "invalid_call",
            "no rows",
        ),
        (
            r#"{"logits": [[]], "top_k": [1], "top_p": [1]}"#,
            "invalid_call",
            "empty",
        ),
        (
            r#"{"logits": [[1, 2], [3]], "top_k": [1, 1], "top_p": [1, 1]}"#,
            "shape_mismatch",
            "`logits[1]` has 1 values",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [1, 2], "top_p": [1]}"#,
            "shape_mismatch",
            "`top_k` has 2 values for 1 logits rows",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [1], "top_p": [1], "min_ps": []}"#,
            "shape_mismatch",
            "`min_ps`",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [1], "top_p": [1], "q": [[1, 2, 3]]}"#,
            "shape_mismatch",
            "`q[0]` has 3 values",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [1], "top_p": [1], "q": [[1, 2], [1, 2]]}"#,
            "shape_mismatch",
            "`q` has 2 rows",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [1], "top_p": [1], "eps": -1}"#,
            "invalid_attribute",
            "`eps`",
        ),
        (
            r#"{"logits": [[1, 2]], "top_k": [1], "top_p": [1], "ks_max": 0}"#,
            "invalid_attribute",
            "`ks_max`",
        ),
    ];
    let input: String = cases
        .iter()
        .flat_map(|c| [c.0, ok])
        .map(|l| format!("{l}\n"))
        .collect();
    let got = answers(&run(&[], &input));
    assert_eq!(got.len(), 2 * cases.len());
    for (i, (line, kind, needle)) in cases.iter().enumerate() {
        let (k, m) = error_of(&got[2 * i]);
        assert_eq!(k, *kind, "{line}: {m}");
        assert!(m.contains(needle), "{line}: {needle:?} not in {m:?}");
        assert_eq!(
            got[2 * i + 1]["logits_select_idx"],
            json!([1]),
            "after {line}"
        );
    }
}

#[test]
fn a_bad_row_fails_alone() {
    let got = calls(&[json!({
        "logits": [[1, "nan", 2], [1, 2, 3], ["-inf", "-inf", "-inf"], [1, 2, 3], [1, 2, 3]],
        "top_k": [1, 1, 1, 1, 1], "top_p": [1, 1, 1, "nan", 1],
        "q": [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, -1, -1]],
        "is_need_logits": true
    })]);
    let a = &got[0];
    assert_eq!(a["logits_select_idx"], json!([-1, 2, -1, -1, -1]));
    let kinds: Vec<Value> = a["row_errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.get("kind").cloned().unwrap_or(Value::Null))
        .collect();
    assert_eq!(
        kinds,
        vec![
            json!("non_finite_logits"),
            Value::Null,
            json!("no_candidates"),
            json!("invalid_top_p"),
            json!("invalid_q")
        ]
    );
    assert_eq!(a["logits_top_kp_select"][1], json!(["-inf", "-inf", 3.0]));
    assert_eq!(
        a["logits_top_kp_select"][0],
        json!(["-inf", "-inf", "-inf"])
    );
    let probs = calls(&[json!({
        "logits": [[0.5, -0.5], [0.5, 0.5]], "input_is_logits": false,
        "top_k": [0, 0], "top_p": [1, 1], "min_ps": [0.1, "nan"]
    })]);
    assert_eq!(
        probs[0]["row_errors"][0]["kind"],
        json!("invalid_probability")
    );
    assert_eq!(probs[0]["row_errors"][1]["kind"], json!("invalid_min_p"));
}

#[test]
fn blank_lines_are_skipped_and_a_byte_order_mark_is_ignored() {
    let ok = r#"{"logits": [[1, 3]], "top_k": [1], "top_p": [1]}"#;
    let input = format!("\u{feff}{ok}\n\n  \t\r\n{ok}\r\n\u{a0}\n");
    let got = answers(&run(&[], &input));
    assert_eq!(got.len(), 2);
}

#[test]
fn input_files_and_exit_statuses() {
    let dir = temp_dir("input");
    let file = dir.join("calls.jsonl");
    std::fs::write(
        &file,
        "{\"logits\": [[1, 3]], \"top_k\": [1], \"top_p\": [1]}\n",
    )
    .unwrap();
    let got = answers(&run(&["--input", file.to_str().unwrap()], ""));
    assert_eq!(got[0]["logits_select_idx"], json!([1]));
    // Unreadable input, a failure at run time: exit 1 with one error line.
    for path in [dir.join("missing.jsonl"), dir.clone()] {
        let out = run(&["--input", path.to_str().unwrap()], "");
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        assert!(text(&out.stderr).starts_with("error: cannot open"));
        assert_eq!(text(&out.stderr).lines().count(), 1);
    }
    // Bad flags: clap's usage message, exit 2.
    for args in [
        &["--attrs", "{}"][..],
        &["--bogus"],
        &["--input", "x", "--tensors", "y"],
    ] {
        let out = run(args, "");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}

// ---- Safetensors ----

fn run_tensors(path: &Path, attrs: Option<&str>) -> Output {
    let mut args = vec!["--tensors", path.to_str().unwrap()];
    if let Some(a) = attrs {
        args.extend(["--attrs", a]);
    }
    run(&args, "")
}

#[test]
fn safetensors_calls_equal_the_library() {
    let dir = temp_dir("tensors");
    let logits: Vec<f32> = (0..3 * 40)
        .map(|i| ((i * 37) % 23) as f32 * 0.3 - 2.0)
        .collect();
    let q: Vec<f32> = (0..3 * 40)
        .map(|i| 0.05 + ((i * 11) % 13) as f32 * 0.2)
        .collect();
    let (top_k, top_p, min_ps) = ([5, 0, 30], [0.8f32, 0.6, 1.0], [0.0f32, 0.1, 0.5]);
    let path = dir.join("call.safetensors");
    write_tensors(
        &path,
        &[
            ("logits", Dtype::F32, vec![3, 40], f32_bytes(&logits)),
            ("top_k", Dtype::I32, vec![3], i32_bytes(&top_k)),
            ("top_p", Dtype::F32, vec![3], f32_bytes(&top_p)),
            ("q", Dtype::F32, vec![3, 40], f32_bytes(&q)),
            ("min_ps", Dtype::F32, vec![3], f32_bytes(&min_ps)),
        ],
    );
    let attrs = r#"{"is_need_logits": true, "q_indexing": "sorted_rank", "eps": 0.001}"#;
    let got = answers(&run_tensors(&path, Some(attrs)));
    let call = json!({
        "logits": logits.chunks(40).collect::<Vec<_>>(), "top_k": top_k, "top_p": top_p,
        "q": q.chunks(40).collect::<Vec<_>>(), "min_ps": min_ps,
        "is_need_logits": true, "q_indexing": "sorted_rank", "eps": 0.001
    });
    assert_eq!(got, vec![library_answer(&call)]);
    // The attributes from a file.
    let attrs_file = dir.join("attrs.json");
    std::fs::write(&attrs_file, attrs).unwrap();
    let from_file = answers(&run_tensors(&path, Some(attrs_file.to_str().unwrap())));
    assert_eq!(from_file, got);

    // bf16 logits with f32 top_p, and with bf16 top_p: the results of the widened values.
    let widened: Vec<f32> = logits.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
    let want = library_answer(&json!({
        "logits": widened.chunks(40).collect::<Vec<_>>(), "top_k": top_k, "top_p": top_p,
        "is_need_logits": true
    }));
    for (p_dtype, p_bytes) in [
        (Dtype::F32, f32_bytes(&top_p)),
        (Dtype::BF16, bf16_bytes(&top_p)),
    ] {
        let path = dir.join("bf16.safetensors");
        write_tensors(
            &path,
            &[
                ("logits", Dtype::BF16, vec![3, 40], bf16_bytes(&logits)),
                ("top_k", Dtype::I32, vec![3], i32_bytes(&top_k)),
                ("top_p", p_dtype, vec![3], p_bytes),
            ],
        );
        // 0.8, 0.6 and 1.0 round to other bf16 values: compare with them for bf16 top_p.
        let got = answers(&run_tensors(&path, Some(r#"{"is_need_logits": true}"#)));
        if p_dtype == Dtype::F32 {
            assert_eq!(got, vec![want.clone()]);
        } else {
            let p: Vec<f32> = top_p.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
            let want = library_answer(&json!({
                "logits": widened.chunks(40).collect::<Vec<_>>(), "top_k": top_k, "top_p": p,
                "is_need_logits": true
            }));
            assert_eq!(got, vec![want]);
        }
    }
}

#[test]
fn safetensors_call_errors_are_answers_and_unreadable_files_exit_1() {
    let dir = temp_dir("tensor-errors");
    let logits = f32_bytes(&[1.0, 2.0, 3.0, 4.0]);
    let base = || {
        vec![
            ("logits", Dtype::F32, vec![2, 2], logits.clone()),
            ("top_k", Dtype::I32, vec![2], i32_bytes(&[1, 1])),
            ("top_p", Dtype::F32, vec![2], f32_bytes(&[1.0, 1.0])),
        ]
    };
    let mut cases: Vec<(Vec<TensorSpec<'_>>, &str, &str)> = Vec::new();
    let mut c = base();
    c.remove(2);
    cases.push((c, "invalid_call", "no tensor named `top_p`"));
    let mut c = base();
    c.push(("min_p", Dtype::F32, vec![2], f32_bytes(&[0.1, 0.1])));
    cases.push((c, "invalid_call", "unknown tensor `min_p`"));
    // Each dtype message names every accepted dtype once (never "F32 ... or F32").
    let mut c = base();
    c[1] = ("top_k", Dtype::U8, vec![2], vec![0; 2]);
    cases.push((
        c,
        "dtype_mismatch",
        "tensor `top_k` is U8: expected I32 or I64",
    ));
    let mut c = base();
    c[1] = ("top_k", Dtype::I64, vec![2], i64_bytes(&[1, 1 << 31]));
    cases.push((
        c,
        "invalid_call",
        "tensor `top_k` (I64) holds 2147483648 at index 1: top_k values must fit in i32",
    ));
    let mut c = base();
    c[0] = (
        "logits",
        Dtype::BF16,
        vec![2, 2],
        bf16_bytes(&[1.0, 2.0, 3.0, 4.0]),
    );
    c[2] = ("top_p", Dtype::F16, vec![2], f16_bytes(&[1.0, 1.0]));
    cases.push((
        c,
        "dtype_mismatch",
        "tensor `top_p` is F16: expected BF16 (the dtype of `logits`) or F32",
    ));
    let mut c = base();
    c[2] = ("top_p", Dtype::F16, vec![2], f16_bytes(&[1.0, 1.0]));
    cases.push((
        c,
        "dtype_mismatch",
        "tensor `top_p` is F16: expected F32 (the dtype of `logits`)",
    ));
    let mut c = base();
    c[2] = ("top_p", Dtype::I32, vec![2], i32_bytes(&[1, 1]));
    cases.push((
        c,
        "dtype_mismatch",
        "tensor `top_p` is I32: expected F32 (the dtype of `logits`)",
    ));
    let mut c = base();
    c.push(("min_ps", Dtype::F16, vec![2], f16_bytes(&[0.1, 0.1])));
    cases.push((
        c,
        "dtype_mismatch",
        "tensor `min_ps` is F16: expected F32, the dtype of `top_p`",
    ));
    let mut c = base();
    c.push(("q", Dtype::F16, vec![2, 2], f16_bytes(&[1.0; 4])));
    cases.push((c, "dtype_mismatch", "tensor `q` is F16: expected F32"));
    let mut c = base();
    c.push(("q", Dtype::F32, vec![2, 3], f32_bytes(&[1.0; 6])));
    cases.push((c, "shape_mismatch", "tensor `q` has shape [2, 3]"));
    let mut c = base();
    c[0] = ("logits", Dtype::F32, vec![4], logits.clone());
    cases.push((c, "shape_mismatch", "rank 2"));
    let mut c = base();
    c[1] = ("top_k", Dtype::I32, vec![3], i32_bytes(&[1, 1, 1]));
    cases.push((
        c,
        "shape_mismatch",
        "`top_k` has 3 values for 2 logits rows",
    ));
    for (i, (tensors, kind, needle)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("case{i}.safetensors"));
        write_tensors(&path, &tensors);
        let got = answers(&run_tensors(&path, None));
        let (k, m) = error_of(&got[0]);
        assert_eq!(k, kind, "case {i}: {m}");
        assert!(m.contains(needle), "case {i}: {needle:?} not in {m:?}");
        assert!(!m.contains("F32 (the dtype of `logits`) or F32"), "{m}");
    }
    // Exit 1: not a file, not safetensors; exit 2: a bad inline --attrs.
    let good = dir.join("good.safetensors");
    write_tensors(&good, &base());
    let junk = dir.join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    for (path, attrs, status, needle) in [
        (
            dir.join("missing.safetensors"),
            None,
            1,
            "cannot read --tensors",
        ),
        (junk, None, 1, "not a safetensors file"),
        (
            good.clone(),
            Some("{\"ks_max\": \"big\"}"),
            2,
            "--attrs: ks_max",
        ),
        (
            good.clone(),
            Some("{\"kmax\": 3}"),
            2,
            "unknown field `kmax`",
        ),
        (
            good.clone(),
            Some("nonsense"),
            1,
            "neither a readable file nor a JSON object",
        ),
        (
            good,
            Some("{\"ks_max\": 3"),
            2,
            "neither a readable file nor a JSON object",
        ),
    ] {
        let out = run_tensors(&path, attrs);
        assert_eq!(out.status.code(), Some(status), "{path:?} {attrs:?}");
        let err = text(&out.stderr);
        assert!(err.starts_with("error: ") && err.contains(needle), "{err}");
    }
}

// ---- The benchmark command ----

#[test]
fn bench_npu_sample_prints_every_scenario() {
    let out = nucleus()
        .args([
            "bench",
            "npu-sample",
            "--vocab",
            "1000",
            "--batch",
            "2",
            "--iters",
            "2",
        ])
        .output()
        .expect("run nucleus");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stdout.starts_with("nucleus bench npu-sample: vocab 1000, batch 2, threads 1; µs per row, median of 2 timed runs"),
        "{stdout}"
    );
    assert!(stdout.contains("floor ("), "{stdout}");
    for label in [
        "| (a) top-k 50 |",
        "| (b) top-p 0.9 |",
        "| (c) top-k 50 + top-p 0.9 + q |",
        "| (d) top-p 0.9, rows without spikes |",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no row {label} in\n{stdout}"));
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 5, "{line}");
        for cell in &cells[1..] {
            assert!(
                cell.trim_end_matches('x')
                    .parse::<f64>()
                    .is_ok_and(|v| v > 0.0),
                "{line}"
            );
        }
    }
}

/// Flags outside their domain are exit status 2, sizes that cannot be allocated exit status
/// 1; either way one `error:` line and no table. (Before, `--vocab 100000 --batch 1000000`
/// aborted: "memory allocation of 400000000000 bytes failed".)
#[test]
fn bench_npu_sample_checks_flags_and_sizes_before_the_table() {
    for (args, status, message) in [
        (
            &["--vocab", "10", "--iters", "1"][..],
            2,
            "error: --vocab 10: must be in 64..=4294967295\n",
        ),
        (&["--batch", "0"], 2, "error: --batch must be at least 1\n"),
        (&["--threads", "0"], 2, "error: --threads must be at least 1\n"),
        (&["--iters", "0"], 2, "error: --iters must be at least 1\n"),
        (
            &["--vocab", "100000", "--batch", "1000000"],
            1,
            "error: --vocab 100000 x --batch 1000000 on 1 thread(s) need 1201026400000 bytes (1118.5 GiB) of buffers, which cannot be allocated here\n",
        ),
    ] {
        let out = nucleus()
            .args(["bench", "npu-sample"])
            .args(args)
            .output()
            .expect("run nucleus");
        assert_eq!(out.status.code(), Some(status), "{args:?}");
        assert_eq!(text(&out.stderr), message);
        assert!(out.stdout.is_empty());
    }
    // The largest vocabulary: 17 GB per matrix; under a 3 GB address space it cannot fit on
    // any machine.
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 3000000 && exec \"$0\" bench npu-sample --vocab 4294967295")
        .arg(env!("CARGO_BIN_EXE_nucleus"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("error: --vocab 4294967295 x --batch 1 on 1 thread(s) need ")
            && err.ends_with("of buffers, which cannot be allocated here\n"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

/// PyTorch's default integer type: an I64 `top_k` gives the answer of the same I32 values.
#[test]
fn an_i64_top_k_tensor_gives_the_answer_of_its_i32_values() {
    let dir = temp_dir("i64-top-k");
    let logits: Vec<f32> = (0..3 * 8).map(|i| ((i * 5) % 7) as f32).collect();
    let mut got = Vec::new();
    for (dtype, bytes) in [
        (Dtype::I32, i32_bytes(&[2, 0, 9])),
        (Dtype::I64, i64_bytes(&[2, 0, 9])),
    ] {
        let path = dir.join(format!("{dtype:?}.safetensors"));
        write_tensors(
            &path,
            &[
                ("logits", Dtype::F32, vec![3, 8], f32_bytes(&logits)),
                ("top_k", dtype, vec![3], bytes),
                ("top_p", Dtype::F32, vec![3], f32_bytes(&[1.0, 0.5, 1.0])),
            ],
        );
        got.push(answers(&run_tensors(
            &path,
            Some(r#"{"is_need_logits": true}"#),
        )));
    }
    assert_eq!(got[0], got[1]);
    assert!(got[0][0].get("error").is_none(), "{:?}", got[0]);
}
