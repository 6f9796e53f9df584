//! `nucleus sample` as a user runs it: JSON lines in, one JSON answer per row out; safetensors
//! input; exit statuses. Expected values are exact: hand cases, or the library's own answer
//! for the same row and parameters.

mod common;

use common::{answers, nucleus, run_subcommand, temp_dir, text, write_tensors};
use std::io::{BufRead, BufReader, Write};
use std::process::{Output, Stdio};
use std::time::Duration;

use nucleus_sampling::{
    distribution, sample_batch, sample_row, LogitsView, LogprobsKind, SampleRequest, SamplingParams,
};
use safetensors::Dtype;
use serde_json::{json, Value};

/// Runs `nucleus sample ARGS` with `stdin` as its standard input.
fn run(args: &[&str], stdin: &str) -> Output {
    run_subcommand("sample", args, stdin)
}

/// Samples the given rows (JSON values, one line each) and returns the answers.
fn sample(args: &[&str], rows: &[Value]) -> Vec<Value> {
    let input: String = rows.iter().map(|r| format!("{r}\n")).collect();
    let got = answers(&run(args, &input));
    assert_eq!(got.len(), rows.len(), "one answer per row");
    got
}

fn sample_one(args: &[&str], row: Value) -> Value {
    sample(args, &[row]).remove(0)
}

fn tokens(answer: &Value) -> Vec<u64> {
    answer["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no tokens: {answer}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// A number of an answer: a JSON number, or "-inf" / "inf" / "nan".
fn num(v: &Value) -> f64 {
    match v {
        Value::Number(n) => n.as_f64().unwrap(),
        Value::String(s) if s == "-inf" => f64::NEG_INFINITY,
        Value::String(s) if s == "inf" => f64::INFINITY,
        Value::String(s) if s == "nan" => f64::NAN,
        other => panic!("not a number: {other}"),
    }
}

fn nums(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(num)
        .collect()
}

fn error_kind(answer: &Value) -> &str {
    answer["error"]["kind"]
        .as_str()
        .unwrap_or_else(|| panic!("not an error: {answer}"))
}

/// Exit status 2 (a bad flag: clap's message, or one `error:` line) with `needle` on stderr.
fn assert_exit_2(out: &Output, needle: &str) {
    assert_exit(out, 2, needle);
}

/// Exit status 1 (an input that cannot be used, a failure at run time) with one `error:`
/// line holding `needle`, and no answers.
fn assert_exit_1(out: &Output, needle: &str) {
    assert_exit(out, 1, needle);
    let err = text(&out.stderr);
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

fn assert_exit(out: &Output, status: i32, needle: &str) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(status), "stderr: {err}");
    assert!(err.contains(needle), "{needle:?} not in {err:?}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(!err.contains("internal error"), "internal error: {err}");
}

#[test]
fn greedy_on_1_3_2_gives_token_1() {
    let a = sample_one(
        &[],
        json!({"logits": [1, 3, 2], "params": {"temperature": 0}}),
    );
    assert_eq!(tokens(&a), [1]);
    assert_eq!(nums(&a["logprobs"]), [0.0]);
    assert_eq!(a["logprobs_kind"], "processed");
    assert_eq!(a["top_logprobs"], json!([[]]));
    assert_eq!(a["num_candidates"], 1);
    assert!(a["seed"].is_u64(), "a drawn seed is reported: {a}");
    assert!(a.get("dist").is_none(), "no dist without --dist: {a}");
}

#[test]
fn top_p_exact_boundary_gives_the_exact_dist() {
    // spec/sampling.md worked case: the prefix {3, 0} reaches 0.75 exactly and takes no more.
    let a = sample_one(
        &["--dist"],
        json!({"probs": [0.25, 0.125, 0.125, 0.5], "params": {"top_p": 0.75, "seed": 5}}),
    );
    assert_eq!(nums(&a["dist"]), [1.0 / 3.0, 0.0, 0.0, 2.0 / 3.0]);
    assert_eq!(a["num_candidates"], 2);
    let t = tokens(&a)[0];
    assert!(t == 0 || t == 3, "{a}");
}

#[test]
fn seeds_above_2_pow_53_are_echoed_exactly() {
    for seed in [
        9_007_199_254_740_993u64,
        u64::MAX,
        18_446_744_073_709_551_557,
    ] {
        let input = format!("{{\"logits\": [0.5, 0.25, 1], \"params\": {{\"seed\": {seed}}}}}\n");
        let out = run(&[], &input);
        let line = text(&out.stdout);
        assert!(line.contains(&format!("\"seed\":{seed}")), "{line}");
        assert_eq!(answers(&out)[0]["seed"].as_u64(), Some(seed));
        // The seed is the one the library would use: same token.
        let params = SamplingParams {
            seed: Some(seed),
            ..Default::default()
        };
        let expect = sample_row(&[0.5, 0.25, 1.0], &SampleRequest::new(&params, &[], &[], 0))
            .unwrap()
            .token;
        assert_eq!(tokens(&answers(&out)[0]), [u64::from(expect)]);
    }
}

#[test]
fn minus_inf_logits_in_and_out() {
    let a = sample_one(
        &["--dist"],
        json!({"logits": [0, "-inf", 0], "params": {"seed": 1, "logprobs": 3}}),
    );
    assert_eq!(nums(&a["dist"]), [0.5, 0.0, 0.5]);
    assert_eq!(a["num_candidates"], 2);
    assert_eq!(
        a["top_logprobs"],
        json!([[
            {"id": 0, "logprob": -std::f64::consts::LN_2},
            {"id": 2, "logprob": -std::f64::consts::LN_2},
            {"id": 1, "logprob": "-inf"}
        ]])
    );
    // Raw logprobs of a masked token are -inf as well.
    let raw = sample_one(
        &[],
        json!({"logits": ["-inf", 2], "params": {"logprobs": 2, "logprobs_kind": "raw"}}),
    );
    assert_eq!(tokens(&raw), [1]);
    assert_eq!(
        raw["top_logprobs"],
        json!([[{"id": 1, "logprob": 0.0}, {"id": 0, "logprob": "-inf"}]])
    );
    let text_out = run(
        &[],
        "{\"logits\": [\"-inf\", 2], \"params\": {\"logprobs\": 2}}\n",
    );
    assert!(
        text(&text_out.stdout).contains(r#"{"id":0,"logprob":"-inf"}"#),
        "{}",
        text(&text_out.stdout)
    );
}

#[test]
fn n_3_tokens_equal_sample_row_at_sample_indices_0_1_2() {
    let logits = [0.3f32, -1.0, 2.0, 1.5, 0.0, 1.9, -0.5, 0.7];
    let prompt = [1u32, 4];
    let output = [2u32];
    let a = sample_one(
        &[],
        json!({
            "logits": logits, "prompt_ids": prompt, "output_ids": output,
            "params": {"temperature": 1.3, "top_k": 6, "seed": 1234, "n": 3}
        }),
    );
    let params = SamplingParams {
        temperature: 1.3,
        top_k: 6,
        seed: Some(1234),
        ..Default::default()
    };
    // position defaults to prompt_ids.len() + output_ids.len() = 3.
    let expect: Vec<(u64, f64)> = (0..3)
        .map(|j| {
            let req = SampleRequest::new(&params, &prompt, &output, 3).with_sample_index(j);
            let out = sample_row(&logits, &req).unwrap();
            (u64::from(out.token), out.logprob)
        })
        .collect();
    assert_eq!(tokens(&a), expect.iter().map(|e| e.0).collect::<Vec<_>>());
    assert_eq!(
        nums(&a["logprobs"]),
        expect.iter().map(|e| e.1).collect::<Vec<_>>()
    );
    assert_eq!(a["top_logprobs"], json!([[], [], []]));
    assert_eq!(a["num_candidates"], 6);

    // An explicit position moves the stream: the answer is the library's at that position.
    let b = sample_one(
        &[],
        json!({"logits": logits, "position": 1000, "params": {"seed": 1234, "n": 3}}),
    );
    let params = SamplingParams {
        seed: Some(1234),
        n: 3,
        ..Default::default()
    };
    let out = sample_row(&logits, &SampleRequest::new(&params, &[], &[], 1000)).unwrap();
    assert_eq!(tokens(&b), out.tokens().map(u64::from).collect::<Vec<_>>());
}

#[test]
fn logprobs_raw_and_processed_are_labelled() {
    let logits = [1.0f32, 2.0, 0.5, 3.0, -1.0];
    for (kind, name) in [
        (LogprobsKind::Raw, "raw"),
        (LogprobsKind::Processed, "processed"),
    ] {
        let a = sample_one(
            &[],
            json!({"logits": logits, "params": {
                "temperature": 0.5, "top_k": 3, "seed": 9, "n": 2,
                "logprobs": 2, "logprobs_kind": name
            }}),
        );
        let params = SamplingParams {
            temperature: 0.5,
            top_k: 3,
            seed: Some(9),
            n: 2,
            logprobs: Some(2),
            logprobs_kind: kind,
            ..Default::default()
        };
        let out = sample_row(&logits, &SampleRequest::new(&params, &[], &[], 0)).unwrap();
        let lp = out.logprobs.unwrap();
        assert_eq!(a["logprobs_kind"], name);
        assert_eq!(nums(&a["logprobs"]), lp.sampled);
        let top: Vec<Value> = lp
            .top
            .iter()
            .map(|t| json!({"id": t.token_id, "logprob": t.logprob}))
            .collect();
        assert_eq!(a["top_logprobs"], json!([top, top]), "{name}");
    }
    // Raw and processed differ here (temperature and top-k act on processed only).
    let raw = sample_one(
        &[],
        json!({"logits": logits, "params": {"top_k": 3, "logprobs": 0, "logprobs_kind": "raw"}}),
    );
    assert_eq!(raw["top_logprobs"], json!([[]]));
    assert_eq!(raw["logprobs_kind"], "raw");
}

#[test]
fn every_params_field_reaches_the_sampler() {
    let logits = [0.5f32, 1.0, -0.25, 2.0, 0.0, 1.5, 0.75, -1.0];
    let prompt = [0u32, 3];
    let output = [3u32, 3, 5];
    let a = sample_one(
        &["--dist"],
        json!({
            "logits": logits, "prompt_ids": prompt, "output_ids": output,
            "eos_token_ids": [7], "stop_token_ids": [6],
            "params": {
                "temperature": 0.9, "top_k": 6, "top_p": 0.95, "min_p": 0.01,
                "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.2,
                "logit_bias": {"1": 0.5, "4": -100}, "allowed_token_ids": [0, 1, 2, 3, 5, 6, 7],
                "bad_words": [[5, 2]], "min_tokens": 4, "seed": 77
            }
        }),
    );
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 6,
        top_p: 0.95,
        min_p: 0.01,
        repetition_penalty: 1.2,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        logit_bias: [(1, 0.5), (4, -100.0)].into_iter().collect(),
        allowed_token_ids: Some(vec![0, 1, 2, 3, 5, 6, 7]),
        bad_words: vec![vec![5, 2]],
        min_tokens: 4,
        seed: Some(77),
        ..Default::default()
    };
    let stops = [7u32, 6];
    let req = SampleRequest::new(&params, &prompt, &output, 5).with_stop_token_ids(&stops);
    let dist = distribution(&logits, &req).unwrap();
    assert_eq!(nums(&a["dist"]), dist);
    // Banned: 2 by the bad word [5, 2] (the output ends in 5), 4 by the allowed ids, 6 and 7
    // (stop, eos) by min_tokens.
    assert_eq!(dist[2], 0.0);
    assert_eq!(dist[4], 0.0);
    assert_eq!(dist[6], 0.0);
    assert_eq!(dist[7], 0.0);
    assert_eq!(
        tokens(&a),
        [u64::from(sample_row(&logits, &req).unwrap().token)]
    );
}

#[test]
fn min_tokens_bans_eos_and_stop_ids_until_reached() {
    let row = |output: Vec<u32>| {
        json!({"logits": [5, 4, 0, 3], "eos_token_ids": [0], "stop_token_ids": [1],
               "output_ids": output, "params": {"temperature": 0, "min_tokens": 2}})
    };
    let got = sample(&[], &[row(vec![2]), row(vec![2, 2])]);
    assert_eq!(tokens(&got[0]), [3]);
    assert_eq!(tokens(&got[1]), [0]);
}

#[test]
fn vocab_size_below_the_row_length_leaves_padding_out() {
    let a = sample_one(
        &["--dist"],
        json!({"logits": [0, 1, 100, 100], "vocab_size": 2, "params": {"temperature": 0}}),
    );
    assert_eq!(tokens(&a), [1]);
    assert_eq!(nums(&a["dist"]), [0.0, 1.0, 0.0, 0.0]);
    let b = sample_one(
        &["--dist"],
        json!({"probs": [1, 1, 5], "vocab_size": 2, "params": {"seed": 3}}),
    );
    assert_eq!(nums(&b["dist"]), [0.5, 0.5, 0.0]);
}

#[test]
fn a_bad_line_between_good_ones_gets_an_error_and_the_others_answers() {
    let input = "{\"logits\": [1, 3, 2], \"params\": {\"temperature\": 0}}\n\
                 {\"logits\": [1, 3\n\
                 \n\
                 {\"probs\": [0, 0, 1]}\n";
    let got = answers(&run(&[], input));
    assert_eq!(got.len(), 3, "the empty line gets no answer: {got:?}");
    assert_eq!(tokens(&got[0]), [1]);
    assert_eq!(error_kind(&got[1]), "invalid_json");
    assert!(
        got[1]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("line 1 column"),
        "{}",
        got[1]
    );
    assert_eq!(tokens(&got[2]), [2]);
}

#[test]
fn bad_rows_get_named_error_kinds() {
    let cases: &[(&str, &str, &str)] = &[
        ("not json", "invalid_json", "not valid JSON"),
        ("{\"logits\": [1, 2]} trailing", "invalid_json", "trailing"),
        (
            r#"{"logits": [1], "probs": [1]}"#,
            "invalid_row",
            "both `logits` and `probs`",
        ),
        (
            r#"{"params": {}}"#,
            "invalid_row",
            "neither `logits` nor `probs`",
        ),
        (
            r#"{"logits": [1], "params": {}, "chain": []}"#,
            "invalid_row",
            "both `params` and `chain`",
        ),
        (
            r#"{"logits": [1], "temperature": 0}"#,
            "invalid_row",
            "unknown field `temperature`",
        ),
        (
            r#"{"logits": [1], "params": {"topk": 5}}"#,
            "invalid_row",
            "unknown field `topk`",
        ),
        (
            r#"{"logits": [1], "params": {"top_k": 1.5}}"#,
            "invalid_row",
            "invalid type",
        ),
        (r#"{"logits": [1, "big"]}"#, "invalid_row", "\"-inf\""),
        (
            r#"{"logits": [1], "params": {"seed": -1}}"#,
            "invalid_row",
            "u64",
        ),
        (
            r#"{"logits": [1], "params": {"logprobs_kind": "log"}}"#,
            "invalid_row",
            "raw",
        ),
        (
            r#"{"logits": [1], "params": {"logit_bias": {"a": 1}}}"#,
            "invalid_row",
            "number",
        ),
        (
            r#"{"logits": [1], "params": [0]}"#,
            "invalid_row",
            "JSON object",
        ),
        ("[[1, 2]]", "invalid_row", "JSON object"),
        (
            r#"{"logits": [1, 2], "vocab_size": 0}"#,
            "invalid_row",
            "vocab_size 0",
        ),
        (
            r#"{"logits": [1, 2], "vocab_size": 3}"#,
            "invalid_row",
            "vocab_size 3",
        ),
        (r#"{"logits": []}"#, "invalid_row", "empty"),
        (
            r#"{"logits": [1, "nan"]}"#,
            "non_finite_logits",
            "token id 1",
        ),
        (
            r#"{"logits": [1, "inf"]}"#,
            "non_finite_logits",
            "token id 1",
        ),
        (
            r#"{"probs": [0.5, -0.5]}"#,
            "invalid_probability",
            "token id 1",
        ),
        (
            r#"{"logits": ["-inf", "-inf"]}"#,
            "no_candidates",
            "no candidate",
        ),
        (
            r#"{"logits": [1], "params": {"top_p": 0}}"#,
            "invalid_params",
            "top_p",
        ),
        (
            r#"{"logits": [1], "params": {"temperature": "nan"}}"#,
            "invalid_params",
            "temperature",
        ),
        (
            r#"{"probs": [1], "params": {"repetition_penalty": 1.5}}"#,
            "invalid_params",
            "repetition_penalty",
        ),
        (
            r#"{"logits": [1, 2], "prompt_ids": [2]}"#,
            "token_id_out_of_range",
            "prompt_ids",
        ),
        (
            r#"{"logits": [1, 2, 3], "vocab_size": 2, "eos_token_ids": [2]}"#,
            "token_id_out_of_range",
            "eos_token_ids holds token id 2, not below vocab_size 2",
        ),
        (
            r#"{"logits": [-1e30, 0], "prompt_ids": [0], "params": {"repetition_penalty": 1e10}}"#,
            "penalty_overflow",
            "repetition_penalty",
        ),
    ];
    let input: String = cases.iter().map(|c| format!("{}\n", c.0)).collect();
    let got = answers(&run(&[], &input));
    assert_eq!(got.len(), cases.len());
    for ((line, kind, needle), answer) in cases.iter().zip(&got) {
        assert_eq!(error_kind(answer), *kind, "{line} -> {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(needle),
            "{line}: {needle:?} not in {message:?}"
        );
    }
}

#[test]
fn invalid_utf8_is_invalid_json() {
    let mut input = b"{\"logits\": [1], \"x\xff\": 1}\n".to_vec();
    input.extend_from_slice(b"{\"logits\": [1]}\n");
    let mut child = nucleus()
        .arg("sample")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    let got = answers(&out);
    assert_eq!(error_kind(&got[0]), "invalid_json");
    assert_eq!(tokens(&got[1]), [0]);
}

#[test]
fn input_file_and_many_rows_keep_their_order() {
    // More rows than one block, each with a distinct greedy answer.
    let rows = 2_500;
    let dir = temp_dir("order");
    let path = dir.join("rows.jsonl");
    let mut input = String::new();
    for i in 0..rows {
        let mut logits = vec![0.0f32; 7];
        logits[i % 7] = 1.0;
        input.push_str(&format!(
            "{}\n",
            json!({"logits": logits, "params": {"temperature": 0}})
        ));
    }
    std::fs::write(&path, input).unwrap();
    let out = nucleus()
        .args(["sample", "--input", path.to_str().unwrap()])
        .output()
        .unwrap();
    let got = answers(&out);
    assert_eq!(got.len(), rows);
    for (i, a) in got.iter().enumerate() {
        assert_eq!(tokens(a), [(i % 7) as u64], "row {i}");
    }
}

#[test]
fn answers_stream_before_the_input_ends() {
    let mut child = nucleus()
        .arg("sample")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    stdin
        .write_all(b"{\"logits\": [1, 3, 2], \"params\": {\"temperature\": 0}}\n")
        .unwrap();
    stdin.flush().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        tx.send(line).unwrap();
    });
    let line = rx.recv_timeout(Duration::from_secs(60));
    drop(stdin);
    let status = child.wait().unwrap();
    let line = line.expect("no answer while stdin was still open");
    assert!(line.starts_with("{\"tokens\":[1]"), "{line}");
    assert!(status.success());
}

#[test]
fn a_closed_stdout_ends_quietly() {
    let mut child = nucleus()
        .arg("sample")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let row = b"{\"logits\": [1, 3, 2], \"params\": {\"temperature\": 0}}\n";
    stdin.write_all(row).unwrap();
    stdin.flush().unwrap();
    let mut line = String::new();
    let mut reader = BufReader::new(stdout);
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("{\"tokens\":[1]"), "{line}");
    drop(reader);
    // Later answers meet the closed pipe (a process spawned by another test at that moment
    // may hold its read end for an instant, so write a few times); nucleus then exits, and
    // stdin closes under us.
    for _ in 0..50 {
        if stdin.write_all(row).and_then(|()| stdin.flush()).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    assert_eq!(text(&out.stderr), "");
}

// --- safetensors input ---

/// Logits `[3, 5]`, every value exact in f16 and bf16.
const LOGITS: [[f32; 5]; 3] = [
    [0.5, 2.0, -1.0, 1.5, 0.25],
    [-2.0, -0.5, 3.0, 0.0, 2.75],
    [1.0, 1.0, -4.0, 0.75, 1.25],
];

fn logits_bytes(dtype: Dtype) -> Vec<u8> {
    let flat = LOGITS.iter().flatten().copied();
    match dtype {
        Dtype::F32 => flat.flat_map(f32::to_le_bytes).collect(),
        Dtype::F16 => flat
            .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        Dtype::BF16 => flat
            .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => unreachable!(),
    }
}

fn run_tensor(args: &[&str]) -> Output {
    nucleus().arg("sample").args(args).output().unwrap()
}

#[test]
fn safetensors_f32_f16_bf16_with_one_params_object_and_a_list() {
    let dir = temp_dir("tensors");
    let one = dir.join("one.json");
    std::fs::write(
        &one,
        r#"{"temperature": 0.8, "top_k": 3, "seed": 11, "n": 2}"#,
    )
    .unwrap();
    let list = dir.join("list.json");
    std::fs::write(
        &list,
        r#"[{"temperature": 0}, {"top_p": 0.9, "seed": 5, "logprobs": 1}, {"allowed_token_ids": [2, 3], "seed": 6}]"#,
    )
    .unwrap();
    let one_params = SamplingParams {
        temperature: 0.8,
        top_k: 3,
        seed: Some(11),
        n: 2,
        ..Default::default()
    };
    let list_params = [
        SamplingParams::greedy(),
        SamplingParams {
            top_p: 0.9,
            seed: Some(5),
            logprobs: Some(1),
            ..Default::default()
        },
        SamplingParams {
            allowed_token_ids: Some(vec![2, 3]),
            seed: Some(6),
            ..Default::default()
        },
    ];
    let flat: Vec<f32> = LOGITS.iter().flatten().copied().collect();
    let view = LogitsView::dense(&flat, 3, 5).unwrap();
    for dtype in [Dtype::F32, Dtype::F16, Dtype::BF16] {
        let path = dir.join(format!("{dtype:?}.safetensors"));
        write_tensors(&path, &[("logits", dtype, vec![3, 5], logits_bytes(dtype))]);
        let path = path.to_str().unwrap();
        for (params_path, params) in [
            (&one, vec![one_params.clone(); 3]),
            (&list, list_params.to_vec()),
        ] {
            let out = run_tensor(&[
                "--logits",
                path,
                "--params",
                params_path.to_str().unwrap(),
                "--dist",
            ]);
            let got = answers(&out);
            let requests: Vec<SampleRequest<'_>> = params
                .iter()
                .map(|p| SampleRequest::new(p, &[], &[], 0))
                .collect();
            let expect = sample_batch(&view, &requests).unwrap();
            assert_eq!(got.len(), 3, "{dtype:?}");
            for (i, (a, e)) in got.iter().zip(expect).enumerate() {
                let e = e.unwrap();
                assert_eq!(
                    tokens(a),
                    e.tokens().map(u64::from).collect::<Vec<_>>(),
                    "{dtype:?} row {i}"
                );
                if params[i].seed.is_some() {
                    assert_eq!(a["seed"].as_u64(), Some(e.seed));
                }
                assert_eq!(
                    nums(&a["dist"]),
                    distribution(&LOGITS[i], &requests[i]).unwrap(),
                    "{dtype:?} row {i}"
                );
            }
        }
    }
    // Without --params: default parameters (temperature 1), seeds drawn.
    let path = dir.join("F32.safetensors");
    let got = answers(&run_tensor(&["--logits", path.to_str().unwrap()]));
    assert_eq!(got.len(), 3);
    assert!(got.iter().all(|a| a["num_candidates"] == 5));
}

#[test]
fn safetensors_row_errors_are_answers() {
    let dir = temp_dir("tensor-errors");
    let path = dir.join("nan.safetensors");
    let values = [1.0f32, f32::NAN, 0.0, 2.0];
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_tensors(&path, &[("logits", Dtype::F32, vec![2, 2], bytes)]);
    let params = dir.join("p.json");
    std::fs::write(&params, r#"[{"temperature": 0}, {"top_k": -5}]"#).unwrap();
    let got = answers(&run_tensor(&[
        "--logits",
        path.to_str().unwrap(),
        "--params",
        params.to_str().unwrap(),
    ]));
    assert_eq!(error_kind(&got[0]), "non_finite_logits");
    assert_eq!(error_kind(&got[1]), "invalid_params");
}

#[test]
fn unusable_input_exits_1_and_bad_flags_exit_2() {
    let dir = temp_dir("exit2");
    let missing = dir.join("missing.jsonl");
    let missing = missing.to_str().unwrap();
    assert_exit_1(&run_tensor(&["--input", missing]), "cannot open");
    assert_exit_1(&run_tensor(&["--logits", missing]), "cannot read --logits");
    assert_exit_2(&run_tensor(&["--bogus"]), "--bogus");
    assert_exit_2(&run_tensor(&["--params", "p.json"]), "--logits");
    assert_exit_2(
        &run_tensor(&["--input", "a", "--logits", "b"]),
        "cannot be used",
    );

    let not_st = dir.join("not.safetensors");
    std::fs::write(&not_st, b"hello").unwrap();
    assert_exit_1(
        &run_tensor(&["--logits", not_st.to_str().unwrap()]),
        "not a safetensors file",
    );

    let f64_bytes: Vec<u8> = [1.0f64, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let cases = [
        (
            "f64",
            "logits",
            Dtype::F64,
            vec![1, 2],
            f64_bytes,
            "dtype F64",
        ),
        (
            "rank3",
            "logits",
            Dtype::F32,
            vec![1, 1, 2],
            logits_bytes(Dtype::F32)[..8].to_vec(),
            "rank 2",
        ),
        (
            "rank1",
            "logits",
            Dtype::F32,
            vec![2],
            logits_bytes(Dtype::F32)[..8].to_vec(),
            "rank 2",
        ),
        (
            "name",
            "scores",
            Dtype::F32,
            vec![1, 2],
            logits_bytes(Dtype::F32)[..8].to_vec(),
            "no tensor named `logits` (it has: scores)",
        ),
        (
            "vocab0",
            "logits",
            Dtype::F32,
            vec![1, 0],
            Vec::new(),
            "the logits tensor has 0 columns: at least one token is needed",
        ),
    ];
    for (name, tensor, dtype, shape, bytes, needle) in cases {
        let path = dir.join(format!("{name}.safetensors"));
        write_tensors(&path, &[(tensor, dtype, shape, bytes)]);
        assert_exit_1(&run_tensor(&["--logits", path.to_str().unwrap()]), needle);
    }

    let good = dir.join("good.safetensors");
    write_tensors(
        &good,
        &[("logits", Dtype::F32, vec![3, 5], logits_bytes(Dtype::F32))],
    );
    let good = good.to_str().unwrap();
    let params_cases = [
        (
            "short",
            r#"[{"temperature": 0}, {"temperature": 0}]"#,
            "2 objects for 3 rows",
        ),
        ("unknown", r#"{"temp": 0}"#, "unknown field `temp`"),
        (
            "item",
            r#"[{}, {}, {"seed": "x"}]"#,
            "item.json: [2].seed: invalid type: string \"x\", expected u64\n",
        ),
        ("number", "5", "params object or a list"),
        ("broken", "{", "not valid JSON"),
    ];
    for (name, body, needle) in params_cases {
        let path = dir.join(format!("{name}.json"));
        std::fs::write(&path, body).unwrap();
        assert_exit_1(
            &run_tensor(&["--logits", good, "--params", path.to_str().unwrap()]),
            needle,
        );
    }
    assert_exit_1(
        &run_tensor(&["--logits", good, "--params", missing]),
        "cannot read --params",
    );
}

// --- chain rows ---

/// The library's answer for a chain row: reset with the prompt, accept each output id, sample.
fn chain_expect(
    config: &Value,
    logits: &[f32],
    prompt: &[u32],
    output: &[u32],
    stops: &[u32],
) -> (nucleus_sampling::SampleOutput, Vec<f64>) {
    use nucleus_sampling::{ProcessorConfig, ProcessorContext, SamplerChain};
    let config: Vec<ProcessorConfig> = serde_json::from_value(config.clone()).unwrap();
    let mut chain = SamplerChain::from_config(&config).unwrap();
    chain.reset(prompt);
    for &t in output {
        chain.accept(t);
    }
    let position = (prompt.len() + output.len()) as u64;
    let ctx = ProcessorContext::new(prompt, output, position).with_stop_token_ids(stops);
    let sampled = chain.sample(logits, &ctx, 0).unwrap();
    let dist = chain.distribution(logits, &ctx).unwrap();
    (sampled, dist)
}

#[test]
fn a_chain_row_is_sampled_as_the_library_samples_it() {
    let logits = [0.5f32, 2.0, 1.0, -1.0, 1.75, 0.0];
    let prompt = [1u32, 2];
    let output = [1u32, 4, 1];
    let config = json!([
        {"min_tokens": {"min_tokens": 5}},
        {"repetition_penalty": {"penalty": 1.3}},
        {"frequency_penalty": {"penalty": 0.25}},
        {"top_k": {"k": 4}},
        {"temperature": {"t": 0.7}},
        {"sample": {"seed": 42, "n": 3, "logprobs": 2, "logprobs_kind": "raw"}}
    ]);
    let a = sample_one(
        &["--dist"],
        json!({"logits": logits, "chain": config, "prompt_ids": prompt, "output_ids": output,
               "eos_token_ids": [5]}),
    );
    let (sampled, dist) = chain_expect(&config, &logits, &prompt, &output, &[5]);
    assert_eq!(
        tokens(&a),
        sampled.tokens().map(u64::from).collect::<Vec<_>>()
    );
    let lp = sampled.logprobs.unwrap();
    assert_eq!(a["logprobs_kind"], "raw");
    assert_eq!(nums(&a["logprobs"]), lp.sampled);
    let top: Vec<Value> = lp
        .top
        .iter()
        .map(|t| json!({"id": t.token_id, "logprob": t.logprob}))
        .collect();
    assert_eq!(a["top_logprobs"], json!([top, top, top]));
    assert_eq!(a["seed"], 42);
    assert_eq!(a["num_candidates"], sampled.num_candidates);
    assert_eq!(nums(&a["dist"]), dist);
    assert_eq!(dist[5], 0.0, "eos banned by min_tokens");

    // Greedy chain: greedy on [1, 3, 2] is token 1, as on the params path.
    let g = sample_one(
        &[],
        json!({"logits": [1, 3, 2], "chain": [{"top_k": {"k": 2}}, {"greedy": {}}]}),
    );
    assert_eq!(tokens(&g), [1]);
    assert_eq!(nums(&g["logprobs"]), [0.0]);
}

#[test]
fn bad_chain_rows_get_named_error_kinds() {
    let cases: &[(&str, &str, &str)] = &[
        (
            r#"{"probs": [1, 2], "chain": [{"greedy": {}}]}"#,
            "invalid_row",
            "not `probs`",
        ),
        (
            r#"{"logits": [1, 2], "chain": []}"#,
            "invalid_row",
            "selection step",
        ),
        (
            r#"{"logits": [1, 2], "chain": [{"top_k": {"k": 1}}]}"#,
            "invalid_row",
            "selection step",
        ),
        (
            r#"{"logits": [1, 2], "chain": [{"greedy": {}}, {"top_k": {"k": 1}}]}"#,
            "invalid_row",
            "must be the last",
        ),
        (
            r#"{"logits": [1, 2], "chain": [{"top_q": {"q": 1}}, {"greedy": {}}]}"#,
            "invalid_row",
            "top_q",
        ),
        (
            r#"{"logits": [1, 2], "chain": [{"temperature": {"t": "nan"}}, {"sample": {}}]}"#,
            "invalid_params",
            "temperature",
        ),
        (
            r#"{"logits": [1, 2], "chain": [{"top_p": {"p": 0}}, {"sample": {}}]}"#,
            "invalid_params",
            "top_p",
        ),
        (
            r#"{"logits": [1, "nan"], "chain": [{"sample": {}}]}"#,
            "non_finite_logits",
            "token id 1",
        ),
        (
            r#"{"logits": [1, 2], "output_ids": [7], "chain": [{"sample": {}}]}"#,
            "token_id_out_of_range",
            "output_ids",
        ),
        (
            r#"{"logits": ["-inf", "-inf"], "chain": [{"sample": {}}]}"#,
            "no_candidates",
            "no candidate",
        ),
    ];
    let input: String = cases.iter().map(|c| format!("{}\n", c.0)).collect();
    let got = answers(&run(&[], &input));
    assert_eq!(got.len(), cases.len());
    for ((line, kind, needle), answer) in cases.iter().zip(&got) {
        assert_eq!(error_kind(answer), *kind, "{line} -> {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(needle),
            "{line}: {needle:?} not in {message:?}"
        );
    }
}

// --- limits, messages and input conventions ---

/// The `(kind, message)` of the error answer to one input line.
fn row_error(line: &str) -> (String, String) {
    let got = answers(&run(&[], &format!("{line}\n")));
    assert_eq!(got.len(), 1, "{line}");
    let Some(kind) = got[0]["error"]["kind"].as_str() else {
        let answer = got[0].to_string();
        panic!("not an error: {}", &answer[..answer.len().min(300)]);
    };
    let kind = kind.to_owned();
    let message = got[0]["error"]["message"].as_str().unwrap().to_owned();
    (kind, message)
}

fn zeros_row(len: usize) -> String {
    serde_json::to_string(&vec![0; len]).unwrap()
}

#[test]
fn n_times_logprobs_above_the_limit_is_invalid_params() {
    // 1024 × 1025 = 1049600 entries, one list per sampled token: rejected, on every path.
    let message = "n × logprobs = 1024 × 1025 = 1049600 top_logprobs entries, more than the \
                   limit of 1048576 per row (the list of `logprobs` entries is repeated for each \
                   of the `n` tokens): lower n or logprobs";
    let logits = zeros_row(1025);
    let params = format!(r#"{{"logits": {logits}, "params": {{"n": 1024, "logprobs": 1025}}}}"#);
    assert_eq!(
        row_error(&params),
        ("invalid_params".into(), message.into())
    );
    let chain = format!(
        r#"{{"logits": {logits}, "chain": [{{"sample": {{"n": 1024, "logprobs": 1025}}}}]}}"#
    );
    assert_eq!(row_error(&chain), ("invalid_params".into(), message.into()));
    let greedy = format!(
        r#"{{"logits": {logits}, "chain": [{{"greedy": {{"n": 1024, "logprobs": 1025}}}}]}}"#
    );
    assert_eq!(
        row_error(&greedy),
        ("invalid_params".into(), message.into())
    );

    let dir = temp_dir("top-limit");
    let path = dir.join("wide.safetensors");
    write_tensors(
        &path,
        &[("logits", Dtype::F32, vec![1, 1025], vec![0; 4 * 1025])],
    );
    let params = dir.join("p.json");
    std::fs::write(&params, r#"{"n": 1024, "logprobs": 1025, "seed": 1}"#).unwrap();
    let got = answers(&run_tensor(&[
        "--logits",
        path.to_str().unwrap(),
        "--params",
        params.to_str().unwrap(),
    ]));
    assert_eq!(error_kind(&got[0]), "invalid_params");
    assert_eq!(got[0]["error"]["message"], message);

    // Exactly at the limit: answered, 1024 lists of 1024 entries.
    let at = format!(
        r#"{{"logits": {}, "params": {{"n": 1024, "logprobs": 1024, "seed": 3}}}}"#,
        zeros_row(1024)
    );
    let out = run(&[], &format!("{at}\n"));
    assert!(out.status.success());
    let line = text(&out.stdout);
    assert!(line.starts_with("{\"tokens\":["), "{}", &line[..200]);
    assert_eq!(line.matches("\"id\":").count(), 1 << 20);
}

#[test]
fn params_requires_logits_even_with_input() {
    let dir = temp_dir("params-input");
    let rows = dir.join("rows.jsonl");
    std::fs::write(&rows, "{\"logits\": [1, 2]}\n").unwrap();
    let params = dir.join("p.json");
    std::fs::write(&params, "{}").unwrap();
    let out = run_tensor(&[
        "--input",
        rows.to_str().unwrap(),
        "--params",
        params.to_str().unwrap(),
    ]);
    // clap's own message: --params goes with --logits, which --input excludes.
    assert_exit_2(
        &out,
        "the argument '--input <INPUT>' cannot be used with '--params <PARAMS>'",
    );
    assert_eq!(text(&out.stdout), "", "no row is answered");
    // Without --input, the same rule: --params requires --logits.
    assert_exit_2(
        &run_tensor(&["--params", params.to_str().unwrap()]),
        "the following required arguments were not provided:\n  --logits <LOGITS>",
    );
}

#[test]
fn eos_and_stop_ids_out_of_range_name_their_own_field() {
    let cases = [
        (
            r#"{"logits": [1, 2, 3], "eos_token_ids": [7]}"#,
            "eos_token_ids holds token id 7, not below vocab_size 3",
        ),
        (
            r#"{"logits": [1, 2, 3], "eos_token_ids": [0], "stop_token_ids": [3]}"#,
            "stop_token_ids holds token id 3, not below vocab_size 3",
        ),
        (
            r#"{"logits": [1, 2, 3], "eos_token_ids": [9], "chain": [{"sample": {}}]}"#,
            "eos_token_ids holds token id 9, not below vocab_size 3",
        ),
        (
            r#"{"probs": [1, 2, 3], "stop_token_ids": [1, 5]}"#,
            "stop_token_ids holds token id 5, not below vocab_size 3",
        ),
    ];
    for (line, message) in cases {
        assert_eq!(
            row_error(line),
            ("token_id_out_of_range".into(), message.into()),
            "{line}"
        );
    }
}

#[test]
fn duplicate_logit_bias_ids_are_invalid_rows() {
    for (line, message) in [
        (
            r#"{"logits": [1, 2], "params": {"logit_bias": {"1": 5, "1": -5}}}"#,
            "params.logit_bias: token id 1 appears more than once",
        ),
        (
            r#"{"logits": [1, 2, 3], "params": {"logit_bias": {"2": 1, "0": 1, "2": 3}}}"#,
            "params.logit_bias: token id 2 appears more than once",
        ),
    ] {
        assert_eq!(row_error(line), ("invalid_row".into(), message.into()));
    }
    let dir = temp_dir("dup-bias");
    let good = dir.join("good.safetensors");
    write_tensors(
        &good,
        &[("logits", Dtype::F32, vec![3, 5], logits_bytes(Dtype::F32))],
    );
    let params = dir.join("p.json");
    std::fs::write(&params, r#"{"logit_bias": {"2": 1, "2": 1}}"#).unwrap();
    assert_exit_1(
        &run_tensor(&[
            "--logits",
            good.to_str().unwrap(),
            "--params",
            params.to_str().unwrap(),
        ]),
        "logit_bias: token id 2 appears more than once",
    );
}

#[test]
fn invalid_row_messages_start_with_the_json_path() {
    let cases = [
        (
            r#"{"logits": [1], "params": {"n": -1}}"#,
            "params.n: invalid value: integer `-1`, expected usize",
        ),
        (
            r#"{"logits": [1], "params": {"seed": "x"}}"#,
            "params.seed: invalid type: string \"x\", expected u64",
        ),
        (
            r#"{"logits": [1], "params": {"logit_bias": {"1": "big"}}}"#,
            "params.logit_bias.1: invalid value: string \"big\", expected a number, or one of \
             the strings \"inf\", \"-inf\", \"nan\"",
        ),
        (
            r#"{"logits": [1, "big"]}"#,
            "logits[1]: invalid value: string \"big\", expected a number, or one of the \
             strings \"inf\", \"-inf\", \"nan\"",
        ),
        (
            r#"{"logits": [1], "output_ids": [0, -2]}"#,
            "output_ids[1]: invalid value: integer `-2`, expected u32",
        ),
        (
            r#"{"logits": [1, 2], "chain": [{"top_k": {"k": 1}}, {"sample": {"n": -1}}]}"#,
            "chain[1].sample.n: invalid value: integer `-1`, expected usize",
        ),
        (
            r#"{"logits": [1, 2], "chain": [{"temperature": {"t": "hot"}}, {"sample": {}}]}"#,
            "chain[0].temperature.t: invalid value: string \"hot\", expected a number, or one \
             of the strings \"inf\", \"-inf\", \"nan\"",
        ),
    ];
    for (line, message) in cases {
        assert_eq!(
            row_error(line),
            ("invalid_row".into(), message.into()),
            "{line}"
        );
    }
    // An unknown field is named with its place.
    let (kind, message) = row_error(r#"{"logits": [1], "params": {"topk": 5}}"#);
    assert_eq!(kind, "invalid_row");
    assert!(
        message.starts_with("params.topk: unknown field `topk`, expected one of `temperature`"),
        "{message}"
    );
    let (_, message) = row_error(r#"{"logits": [1], "chain": [{"sample": {"sed": 1}}]}"#);
    assert!(
        message.starts_with("chain[0].sample.sed: unknown field `sed`"),
        "{message}"
    );
}

#[test]
fn finite_numbers_beyond_f32_are_invalid_rows() {
    let cases = [
        (
            r#"{"logits": [1e39, 0]}"#,
            "logits[0] = 1e39 is outside the f32 range (about ±3.4e38)",
        ),
        (
            r#"{"logits": [0, -1e39]}"#,
            "logits[1] = -1e39 is outside the f32 range (about ±3.4e38)",
        ),
        (
            r#"{"logits": [0, 1, 3.5e38], "params": {"temperature": 0}}"#,
            "logits[2] = 3.5e38 is outside the f32 range (about ±3.4e38)",
        ),
        (
            r#"{"probs": [1, 2e300]}"#,
            "probs[1] = 2e300 is outside the f32 range (about ±3.4e38)",
        ),
    ];
    for (line, message) in cases {
        assert_eq!(
            row_error(line),
            ("invalid_row".into(), message.into()),
            "{line}"
        );
    }
    // The largest f32 is still a logit; the strings keep their meaning.
    let a = sample_one(
        &[],
        json!({"logits": [0, 3.4028235e38], "params": {"temperature": 0}}),
    );
    assert_eq!(tokens(&a), [1]);
    assert_eq!(
        row_error(r#"{"logits": ["inf", 0]}"#).0,
        "non_finite_logits"
    );
    let masked = sample_one(
        &["--dist"],
        json!({"logits": ["-inf", 0], "params": {"seed": 1}}),
    );
    assert_eq!(nums(&masked["dist"]), [0.0, 1.0]);
}

#[test]
fn lenient_number_strings_and_null_are_read_as_documented() {
    // Case-insensitive, optional sign, surrounding whitespace.
    let a = sample_one(
        &["--dist"],
        json!({"logits": ["-Infinity", " -INF ", "-inf", 0], "params": {"seed": 1}}),
    );
    assert_eq!(nums(&a["dist"]), [0.0, 0.0, 0.0, 1.0]);
    for s in ["+inf", "Infinity", " +INFINITY", "NaN", "-nan", "+nan"] {
        let row = json!({"logits": [0, s]});
        assert_eq!(row_error(&row.to_string()).0, "non_finite_logits", "{s:?}");
    }
    for s in ["infinite", "-+inf", "1e3", ""] {
        let row = json!({"logits": [0, s]});
        assert_eq!(row_error(&row.to_string()).0, "invalid_row", "{s:?}");
    }
    // null is the field absent.
    let b = sample_one(
        &[],
        json!({"logits": [1, 3, 2], "params": {"temperature": 0, "top_k": null, "seed": null},
               "prompt_ids": null, "vocab_size": null, "chain": null}),
    );
    assert_eq!(tokens(&b), [1]);
    let c = sample_one(&[], json!({"logits": [1, 3, 2], "params": null}));
    assert_eq!(c["num_candidates"], 3);
}

#[test]
fn a_token_104_nats_below_the_maximum_has_weight_0() {
    let a = sample_one(
        &["--dist"],
        json!({"logits": [0, -105, -100], "params": {"seed": 1}}),
    );
    assert_eq!(a["num_candidates"], 2);
    assert_eq!(nums(&a["dist"])[1], 0.0);
    assert!(nums(&a["dist"])[2] > 0.0);
}

#[test]
fn a_safetensors_tensor_without_columns_is_unusable() {
    let dir = temp_dir("no-columns");
    let path = dir.join("empty.safetensors");
    write_tensors(&path, &[("logits", Dtype::F32, vec![3, 0], Vec::new())]);
    let out = run_tensor(&["--logits", path.to_str().unwrap()]);
    assert_exit_1(
        &out,
        "the logits tensor has 0 columns: at least one token is needed",
    );
    assert!(
        !text(&out.stderr).contains("vocab_size"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_params_list_for_a_tensor_without_rows_says_1_object() {
    let dir = temp_dir("no-rows");
    let path = dir.join("empty.safetensors");
    write_tensors(&path, &[("logits", Dtype::F32, vec![0, 5], Vec::new())]);
    let params = dir.join("p.json");
    std::fs::write(&params, "[{}]").unwrap();
    let out = run_tensor(&[
        "--logits",
        path.to_str().unwrap(),
        "--params",
        params.to_str().unwrap(),
    ]);
    assert_exit_1(&out, "--params holds 1 object for 0 rows of logits");
    // Without --params, no rows: no answers.
    let out = run_tensor(&["--logits", path.to_str().unwrap()]);
    assert_eq!(answers(&out).len(), 0);
    let one_row = dir.join("one.safetensors");
    write_tensors(
        &one_row,
        &[(
            "logits",
            Dtype::F32,
            vec![1, 5],
            logits_bytes(Dtype::F32)[..20].to_vec(),
        )],
    );
    std::fs::write(&params, "[{}, {}]").unwrap();
    assert_exit_1(
        &run_tensor(&[
            "--logits",
            one_row.to_str().unwrap(),
            "--params",
            params.to_str().unwrap(),
        ]),
        "--params holds 2 objects for 1 row of logits",
    );
}

#[test]
fn a_write_error_exits_1_and_says_it_was_writing() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("no /dev/full here: skipped");
        return;
    };
    let mut child = nucleus()
        .arg("sample")
        .stdin(Stdio::piped())
        .stdout(full)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"{\"logits\": [1, 3, 2]}\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "error: writing the output: No space left on device (os error 28)\n"
    );
}

#[test]
fn input_dash_is_stdin_and_a_directory_is_named() {
    let got = answers(&run(
        &["--input", "-"],
        "{\"logits\": [1, 3, 2], \"params\": {\"temperature\": 0}}\n",
    ));
    assert_eq!(got.len(), 1);
    assert_eq!(tokens(&got[0]), [1]);
    let dir = temp_dir("input-dir");
    let dir = dir.to_str().unwrap();
    assert_exit_1(
        &run_tensor(&["--input", dir]),
        &format!("cannot open {dir}: is a directory"),
    );
}

#[test]
fn lines_that_trim_to_nothing_are_skipped_and_a_bom_is_stripped() {
    let row = "{\"logits\": [1, 3, 2], \"params\": {\"temperature\": 0}}";
    let input = format!("\u{feff}{row}\n\x0b\n\u{a0}\n\x0c\r\n \t \u{2003}\n\u{feff}\n{row}\r\n\n");
    let got = answers(&run(&[], &input));
    // The BOM of the first line is stripped; one on a later line is not whitespace.
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(tokens(&got[0]), [1]);
    assert_eq!(error_kind(&got[1]), "invalid_json");
    assert_eq!(tokens(&got[2]), [1]);
    // A first line that is only a BOM is blank.
    let got = answers(&run(&[], &format!("\u{feff}\n{row}\n")));
    assert_eq!(got.len(), 1);
    assert_eq!(tokens(&got[0]), [1]);
}

/// `--dist` on a 20-million-entry row (given through `--logits`) is written straight from the
/// distribution's vector: under a 750 MB address space it is answered (435 MB of JSON), where
/// building the whole answer line in memory first needed about 950 MB (and a 50-million-entry
/// row peaked at 1.9 GB of resident memory; 0.8 GB now).
#[cfg(unix)]
#[test]
fn a_dist_over_20_million_entries_is_written_without_a_copy_in_memory() {
    use std::io::Read;
    let dir = temp_dir("big-dist");
    let path = dir.join("row.safetensors");
    let n = 20_000_000usize;
    let bytes: Vec<u8> = (0..n)
        .flat_map(|i| ((((i as u64) * 2_654_435_761) % 1000) as f32 / 100.0).to_le_bytes())
        .collect();
    write_tensors(&path, &[("logits", Dtype::F32, vec![1, n], bytes)]);
    let params = dir.join("p.json");
    std::fs::write(&params, r#"{"seed": 1}"#).unwrap();
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 750000 && exec \"$0\" sample --dist --logits \"$1\" --params \"$2\"")
        .arg(env!("CARGO_BIN_EXE_nucleus"))
        .arg(&path)
        .arg(&params)
        // The threads' stacks and malloc arenas count against the address space: fixed here.
        .env("RAYON_NUM_THREADS", "2")
        .env("MALLOC_ARENA_MAX", "2")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut out).unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(child.wait().unwrap().success(), "{err}");
    assert_eq!(out.last(), Some(&b'\n'));
    let line = &out[..out.len() - 1];
    assert!(!line.contains(&b'\n'), "one answer line");
    let start = b"\"dist\":[";
    let at = line
        .windows(start.len())
        .position(|w| w == start)
        .expect("a dist");
    let dist = &line[at + start.len()..line.len() - 2];
    assert_eq!(&line[line.len() - 2..], b"]}");
    assert_eq!(dist.iter().filter(|&&b| b == b',').count(), n - 1);
    // The row's largest logits, 9.99, have the largest probability, 1 / (20,000 x mean weight).
    assert!(line.starts_with(b"{\"tokens\":["), "{}", text(&line[..100]));
}

/// A row within `--max-input-bytes` whose values the machine cannot hold is answered with kind
/// `allocation` and the next line is still answered: 60 million logits (a 120 MB line) under a
/// 400 MB address space. Before, the row's vector grew with `push` and the run aborted
/// ("memory allocation of 134217728 bytes failed").
#[cfg(unix)]
#[test]
fn a_row_the_machine_cannot_hold_is_an_allocation_answer() {
    let mut input = String::with_capacity(120_000_100);
    input.push_str("{\"logits\": [0");
    for _ in 1..60_000_000 {
        input.push_str(",0");
    }
    input.push_str("]}\n{\"logits\": [1, 3, 2], \"params\": {\"temperature\": 0}}\n");
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 400000 && exec \"$0\" sample")
        .arg(env!("CARGO_BIN_EXE_nucleus"))
        .env("RAYON_NUM_THREADS", "2")
        .env("MALLOC_ARENA_MAX", "2")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    let got = answers(&out);
    assert_eq!(got.len(), 2, "{}", text(&out.stderr));
    assert_eq!(error_kind(&got[0]), "allocation", "{}", got[0]);
    let message = got[0]["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("logits: the list could not be held in memory (after "),
        "{message}"
    );
    assert_eq!(tokens(&got[1]), [1]);
}
