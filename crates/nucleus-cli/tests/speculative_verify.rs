//! `nucleus speculative-verify` as a user runs it: each answer is what
//! `nucleus_sampling::speculative::verify` (tested against its definition in
//! `crates/nucleus-sampling/tests/speculative.rs`) gives the same request, hand-worked greedy
//! and one-hot cases, a left-out seed that is reported and replays, the thread count, and bad
//! requests answered with their kind while the next lines go on.

mod common;

use common::{answers, run_subcommand, text};
use nucleus_sampling::speculative::{verify, TargetRows, Verifier, VerifyRequest};
use nucleus_sampling::{ProcessorConfig, SamplerChain, SamplingParams};
use serde_json::{json, Value};

fn run(args: &[&str], lines: &[String]) -> Vec<Value> {
    let input: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let got = answers(&run_subcommand("speculative-verify", args, &input));
    assert_eq!(got.len(), lines.len());
    got
}

/// A small deterministic generator (SplitMix64).
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// A request, both as the JSON line and as what the library is given.
struct Case {
    line: String,
    draft: Vec<u32>,
    draft_probs: Option<Vec<f32>>,
    target: Vec<f32>,
    probs: bool,
    params: Option<SamplingParams>,
    chain: Option<Vec<ProcessorConfig>>,
    prompt: Vec<u32>,
    output: Vec<u32>,
    vocab: usize,
}

fn rows(values: &[f32], v: usize) -> Value {
    json!(values.chunks(v).map(|r| r.to_vec()).collect::<Vec<_>>())
}

fn random_case(g: &mut Mix, i: usize) -> Case {
    let v = 3 + g.below(6) as usize;
    let k = g.below(4) as usize;
    let draft: Vec<u32> = (0..k).map(|_| g.below(v as u64) as u32).collect();
    let probs = i % 5 == 4;
    let target: Vec<f32> = (0..(k + 1) * v)
        .map(|_| {
            if probs {
                g.unit() + 0.01
            } else {
                4.0 * g.unit() - 2.0
            }
        })
        .collect();
    let draft_probs =
        (!i.is_multiple_of(3)).then(|| (0..k * v).map(|_| g.unit() + 0.05).collect::<Vec<f32>>());
    let prompt: Vec<u32> = (0..g.below(3)).map(|_| g.below(v as u64) as u32).collect();
    let output: Vec<u32> = (0..g.below(3)).map(|_| g.below(v as u64) as u32).collect();
    let seed = 1000 + i as u64;
    let mut line = json!({
        "draft_token_ids": draft,
        "prompt_ids": prompt,
        "output_ids": output,
        "position": 40 + i,
    });
    line[if probs {
        "target_probs"
    } else {
        "target_logits"
    }] = rows(&target, v);
    if let Some(q) = &draft_probs {
        line["draft_probs"] = rows(q, v);
    }
    let (params, chain) = if i % 4 == 1 && !probs {
        let chain = json!([
            {"repetition_penalty": {"penalty": 1.5}},
            {"top_k": {"k": 3}},
            {"sample": {"seed": seed}},
        ]);
        line["chain"] = chain.clone();
        (None, Some(serde_json::from_value(chain).unwrap()))
    } else {
        let p = SamplingParams {
            // Temperature and penalties are defined on logits only.
            temperature: if probs {
                1.0
            } else {
                [0.0, 0.7, 1.0, 1.3][i % 4]
            },
            top_p: if i.is_multiple_of(2) { 0.9 } else { 1.0 },
            presence_penalty: if i % 3 == 1 && !probs { 0.5 } else { 0.0 },
            seed: Some(seed),
            ..Default::default()
        };
        line["params"] = json!({
            "temperature": p.temperature,
            "top_p": p.top_p,
            "presence_penalty": p.presence_penalty,
            "seed": seed,
        });
        (Some(p), None)
    };
    Case {
        line: line.to_string(),
        draft,
        draft_probs,
        target,
        probs,
        params,
        chain,
        prompt,
        output,
        vocab: v,
    }
}

fn library(case: &Case) -> nucleus_sampling::speculative::VerifyOutput {
    let chain = case.chain.as_ref().map(|c| {
        let mut chain = SamplerChain::from_config(c).unwrap();
        chain.reset(&case.prompt);
        for &t in &case.output {
            chain.accept(t);
        }
        chain
    });
    let verifier = match (&case.params, &chain) {
        (Some(p), _) => Verifier::Params(p),
        (None, Some(c)) => Verifier::Chain(c),
        (None, None) => panic!("a case has params or a chain"),
    };
    let target = if case.probs {
        TargetRows::Probs(&case.target)
    } else {
        TargetRows::Logits(&case.target)
    };
    let line: Value = serde_json::from_str(&case.line).unwrap();
    let mut req = VerifyRequest::new(verifier, &case.draft, target, case.vocab);
    req.prompt_ids = &case.prompt;
    req.output_ids = &case.output;
    req.position = line["position"].as_u64().unwrap();
    req.draft_probs = case.draft_probs.as_deref();
    verify(&req).unwrap()
}

#[test]
fn each_answer_is_the_library_verification_of_the_same_request() {
    let mut g = Mix(5);
    let cases: Vec<Case> = (0..40).map(|i| random_case(&mut g, i)).collect();
    let lines: Vec<String> = cases.iter().map(|c| c.line.clone()).collect();
    let one = run(&["--threads", "1"], &lines);
    let two = run(&["--threads", "2"], &lines);
    assert_eq!(one, two, "the thread count changed an answer");
    let mut accepted = [0usize; 4];
    for (case, got) in cases.iter().zip(&one) {
        let want = library(case);
        assert_eq!(got["accepted"], json!(want.accepted), "{}", case.line);
        assert_eq!(got["tokens"], json!(want.tokens), "{}", case.line);
        assert_eq!(got["seed"], json!(want.seed), "{}", case.line);
        let logprobs: Vec<f64> = got["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(logprobs.len(), want.logprobs.len());
        for (a, b) in logprobs.iter().zip(&want.logprobs) {
            assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{a} vs {b}");
        }
        accepted[want.accepted] += 1;
    }
    // The cases reach every acceptance count but the rarest.
    assert!(
        accepted[0] > 0 && accepted[1] > 0 && accepted[2] > 0,
        "{accepted:?}"
    );
}

#[test]
fn hand_worked_greedy_and_certain_drafts() {
    let lines = [
        // Greedy: the argmax of row 0 is 2 (= the draft), of row 1 is 0 (not 1): accepted 1,
        // then the target's argmax 0.
        r#"{"draft_token_ids": [2, 1, 1], "target_logits": [[0, 1, 5], [4, 2, 0], [0, 9, 0], [0, 0, 1]], "params": {"temperature": 0}}"#,
        // The target is certain of each drafted token: everything accepted, then the bonus
        // token, the only one the last row allows.
        r#"{"draft_token_ids": [1, 0], "draft_probs": [[0.2, 0.8], [0.5, 0.5]], "target_probs": [[0, 1], [1, 0], [0, 1]], "params": {"seed": 3}}"#,
        // A one-hot draft the target cannot emit: rejected, and the residual is the other id.
        r#"{"draft_token_ids": [0], "target_probs": [[0, 1], [1, 1]], "params": {"seed": 4}}"#,
        // K = 0: the bonus token alone, from a chain whose bias of -100 moves id 0 below id
        // 1, over the first 2 ids of the row.
        r#"{"draft_token_ids": [], "target_logits": [[9, 1, 20]], "chain": [{"logit_bias": {"bias": {"0": -100}}}, {"greedy": {}}], "vocab_size": 2}"#,
    ];
    let got = run(&[], &lines.map(String::from));
    assert_eq!(got[0]["accepted"], 1);
    assert_eq!(got[0]["tokens"], json!([2, 0]));
    assert_eq!(got[0]["logprobs"], json!([0.0, 0.0]));
    assert_eq!(got[1]["accepted"], 2);
    assert_eq!(got[1]["tokens"], json!([1, 0, 1]));
    assert_eq!(got[1]["logprobs"], json!([0.0, 0.0, 0.0]));
    assert_eq!(got[1]["seed"], 3);
    assert_eq!(got[2]["accepted"], 0);
    assert_eq!(got[2]["tokens"], json!([1]));
    assert_eq!(got[3]["tokens"], json!([1]));
}

#[test]
fn a_seed_left_out_is_drawn_reported_and_replays() {
    let line = r#"{"draft_token_ids": [0, 1], "target_logits": [[0, 0.1, 0.2], [0.3, 0, 0], [1, 1, 1]], "draft_probs": [[0.5, 0.25, 0.25], [0.2, 0.6, 0.2]]}"#;
    let got = run(&[], &[line.to_string()]);
    let seed = got[0]["seed"].as_u64().expect("an exact u64 seed");
    let mut with_seed: Value = serde_json::from_str(line).unwrap();
    with_seed["params"] = json!({ "seed": seed });
    let again = run(&[], &[with_seed.to_string()]);
    assert_eq!(again, got);
}

#[test]
fn bad_requests_are_answered_with_their_kind_and_the_next_lines_go_on() {
    let ok = r#"{"draft_token_ids": [1], "target_logits": [[1, 3], [3, 1]], "params": {"temperature": 0}}"#;
    let cases: &[(&str, &str, &str)] = &[
        ("not json", "invalid_json", "not valid JSON"),
        (
            r#"{"target_logits": [[1, 2]]}"#,
            "invalid_row",
            "`draft_token_ids` is required",
        ),
        (
            r#"{"draft_token_ids": []}"#,
            "invalid_row",
            "neither `target_logits` nor `target_probs`",
        ),
        (
            r#"{"draft_token_ids": [], "target_logits": [[1]], "target_probs": [[1]]}"#,
            "invalid_row",
            "both `target_logits` and `target_probs`",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 2]]}"#,
            "invalid_row",
            "needs 2",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 2], [1]]}"#,
            "invalid_row",
            "`target_logits[1]` has 1 values",
        ),
        (
            r#"{"draft_token_ids": [0], "draft_probs": [], "target_logits": [[1, 2], [1, 2]]}"#,
            "invalid_row",
            "`draft_probs` has 0 rows",
        ),
        (
            r#"{"draft_token_ids": [0], "draft_probs": [[0, 1]], "target_logits": [[1, 2], [1, 2]]}"#,
            "invalid_params",
            "0 at the drafted token 0",
        ),
        (
            r#"{"draft_token_ids": [0], "draft_probs": [[-1, 1]], "target_logits": [[1, 2], [1, 2]]}"#,
            "invalid_params",
            "finite and >= 0",
        ),
        (
            r#"{"draft_token_ids": [2], "target_logits": [[1, 2], [1, 2]]}"#,
            "token_id_out_of_range",
            "draft_token_ids",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 2], [1, 2]], "output_ids": [7]}"#,
            "token_id_out_of_range",
            "output_ids",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, "nan"], [1, 2]]}"#,
            "non_finite_logits",
            "",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 1e39], [1, 2]]}"#,
            "invalid_row",
            "target_logits[0][1] = 1e39 is outside the f32 range",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 2], [1, 2]], "params": {"mirostat": 2}}"#,
            "invalid_params",
            "mirostat",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 2], [1, 2]], "params": {"n": 2}}"#,
            "invalid_params",
            "`n`",
        ),
        (
            r#"{"draft_token_ids": [0], "target_probs": [[1, 2], [1, 2]], "chain": [{"greedy": {}}]}"#,
            "invalid_row",
            "takes `target_logits`",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 2], [1, 2]], "chain": [{"top_k": {"k": 1}}]}"#,
            "invalid_row",
            "selection",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 2], [1, 2]], "vocab_size": 3}"#,
            "invalid_row",
            "vocab_size 3 must be in 1..=2",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 2], [1, 2]], "topk": 1}"#,
            "invalid_row",
            "unknown field `topk`",
        ),
        // A bad row after a coin-flip row: an error whatever the draws.
        (
            r#"{"draft_token_ids": [0], "target_logits": [[0, 0], ["-inf", "-inf"]], "params": {"seed": 1}}"#,
            "no_candidates",
            "",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[0, 0], ["-inf", "-inf"]], "params": {"seed": 2}}"#,
            "no_candidates",
            "",
        ),
        (
            r#"{"draft_token_ids": [0], "target_probs": [[1, 1], [1, -1]]}"#,
            "invalid_probability",
            "",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 2], [1, 2]], "position": 18446744073709551615}"#,
            "invalid_params",
            "`position`",
        ),
        (
            r#"{"draft_token_ids": [0], "target_logits": [[1, 2], [1, 2]], "params": {"logprobs_kind": "raw"}}"#,
            "invalid_params",
            "`logprobs_kind`",
        ),
    ];
    let mut lines = Vec::new();
    for (line, _, _) in cases {
        lines.push(line.to_string());
        lines.push(ok.to_string());
    }
    let got = run(&[], &lines);
    for (i, (line, kind, needle)) in cases.iter().enumerate() {
        let error = &got[2 * i]["error"];
        assert_eq!(error["kind"], *kind, "{line}: {error}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(needle), "{line}: {message}");
        assert_eq!(
            got[2 * i + 1]["tokens"],
            json!([1, 0]),
            "the line after {line}"
        );
    }
}

#[test]
fn an_input_file_that_cannot_be_opened_is_exit_status_1() {
    let out = run_subcommand(
        "speculative-verify",
        &["--input", "/nonexistent/x.jsonl"],
        "",
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.starts_with("error: cannot open"), "{err}");
}
