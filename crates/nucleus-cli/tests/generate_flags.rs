//! `nucleus generate`'s sampling flags, prompt sources, JSON output and `--quiet`, on the real
//! stories260K model from ../shared, checked against the library's own forward pass (greedy
//! argmax and an f64 log-softmax) and against each other.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use nucleus_engine::{load_model, CausalLm, Device, SeqInput};
use serde_json::Value;

fn model() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/models/stories260K.gguf")
        .to_string_lossy()
        .into_owned()
}

fn nucleus(args: &[&str], stdin: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nucleus"));
    cmd.arg("generate")
        .args(["--model", &model()])
        .args(args)
        .env_remove("NUCLEUS_MODEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("run nucleus");
    let mut input = child.stdin.take().expect("stdin");
    if let Some(s) = stdin {
        input.write_all(s.as_bytes()).expect("write stdin");
    }
    drop(input);
    child.wait_with_output().expect("wait")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The JSON completions of a successful run.
fn completions(out: &Output) -> Vec<Value> {
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// The greedy continuation of `prompt` with the library (argmax, ties to the lower id, no
/// stop): each step's token and the f64 log-softmax of its logits row.
fn greedy_oracle(prompt: &str, steps: usize) -> Vec<(u32, Vec<f64>)> {
    let loaded = load_model(Path::new(&model()), &Device::Cpu).expect("load");
    let mut pending = loaded
        .tokenizer
        .tokenizer
        .encode(prompt, true)
        .expect("encode")
        .get_ids()
        .to_vec();
    let mut cache = loaded.model.new_cache();
    let mut out = Vec::new();
    for _ in 0..steps {
        let logits: Vec<f32> = loaded
            .model
            .forward(&mut [SeqInput {
                tokens: &pending,
                cache: &mut cache,
            }])
            .and_then(|t| Ok(t.squeeze(0)?.to_vec1()?))
            .expect("forward");
        let max = logits
            .iter()
            .fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
        let lse = max
            + logits
                .iter()
                .map(|&l| (l as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let logprobs: Vec<f64> = logits.iter().map(|&l| l as f64 - lse).collect();
        let next = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .expect("a row") as u32;
        out.push((next, logprobs));
        pending = vec![next];
    }
    out
}

#[test]
fn json_output_has_exactly_the_documented_fields_in_request_and_sample_order() {
    let out = nucleus(
        &[
            "--prompt",
            "Once",
            "--prompt",
            "The dog",
            "--n",
            "2",
            "--seed",
            "7",
            "--max-tokens",
            "6",
            "--format",
            "json",
        ],
        None,
    );
    let all = completions(&out);
    let order: Vec<(u64, u64)> = all
        .iter()
        .map(|c| {
            (
                c["request"].as_u64().unwrap(),
                c["sample"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(order, [(0, 0), (0, 1), (1, 0), (1, 1)]);
    // BOS + "Once" is 2 tokens; BOS + "The dog" 3 (stories260K's tokenizer).
    let loaded = load_model(Path::new(&model()), &Device::Cpu).expect("load");
    for c in &all {
        let keys: Vec<&str> = c.as_object().unwrap().keys().map(String::as_str).collect();
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            [
                "finish_reason",
                "request",
                "sample",
                "seed",
                "text",
                "token_ids",
                "usage"
            ],
            "{c}"
        );
        assert_eq!(c["seed"], 7);
        assert_eq!(c["finish_reason"], "length");
        let prompt = ["Once", "The dog"][c["request"].as_u64().unwrap() as usize];
        let prompt_tokens = loaded
            .tokenizer
            .tokenizer
            .encode(prompt, true)
            .unwrap()
            .len();
        let t = ids(c);
        assert_eq!(t.len(), 6);
        assert_eq!(
            c["usage"],
            serde_json::json!({"prompt_tokens": prompt_tokens, "completion_tokens": 6,
                               "total_tokens": prompt_tokens + 6})
        );
        // The text is what the tokens add to the prompt's text.
        let tok = &loaded.tokenizer.tokenizer;
        let prompt_ids = tok.encode(prompt, true).unwrap().get_ids().to_vec();
        let all_ids = [prompt_ids.clone(), t.clone()].concat();
        let (before, after) = (
            tok.decode(&prompt_ids, true).unwrap(),
            tok.decode(&all_ids, true).unwrap(),
        );
        assert_eq!(
            Some(c["text"].as_str().unwrap()),
            after.strip_prefix(&before)
        );
    }
    // The same seed gives the same tokens in text output (one completion: streamed).
    let one = nucleus(
        &["--prompt", "The dog", "--seed", "7", "--max-tokens", "6"],
        None,
    );
    assert!(one.status.success());
    assert_eq!(
        text(&one.stdout),
        format!("{}\n", all[2]["text"].as_str().unwrap())
    );
}

#[test]
fn greedy_logprobs_are_the_models_log_softmax() {
    let oracle = greedy_oracle("Once upon a time", 4);
    let out = nucleus(
        &[
            "--prompt",
            "Once upon a time",
            "--temperature",
            "0",
            "--max-tokens",
            "4",
            "--logprobs",
            "3",
            "--format",
            "json",
            // The oracle runs the model with an f32 KV cache (`new_cache`).
            "--kv-cache-dtype",
            "f32",
        ],
        None,
    );
    let c = &completions(&out)[0];
    let lps = c["logprobs"].as_array().expect("logprobs");
    assert_eq!(lps.len(), 4);
    for (step, ((token, row), lp)) in oracle.iter().zip(lps).enumerate() {
        assert_eq!(lp["id"], *token, "step {step}");
        let close = |a: &Value, b: f64| (a.as_f64().unwrap() - b).abs() < 1e-9;
        assert!(
            close(&lp["logprob"], row[*token as usize]),
            "step {step}: {lp}"
        );
        // The 3 largest of the oracle's row, ties toward the lower id.
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let top = lp["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        for (t, &id) in top.iter().zip(&order[..3]) {
            assert_eq!(t["id"], id);
            assert!(close(&t["logprob"], row[id]), "step {step}: {t}");
        }
    }
    assert_eq!(ids(c), oracle.iter().map(|o| o.0).collect::<Vec<_>>());
    // SentencePiece pieces are shown as they add to the text: " upon", not "upon".
    let joined: String = lps.iter().map(|l| l["token"].as_str().unwrap()).collect();
    assert_eq!(joined, c["text"].as_str().unwrap());
}

#[test]
fn text_output_prints_logprobs_on_stderr() {
    let out = nucleus(
        &[
            "--prompt",
            "Once",
            "--temperature",
            "0",
            "--max-tokens",
            "2",
            "--logprobs",
            "1",
        ],
        None,
    );
    assert!(out.status.success());
    let err = text(&out.stderr);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("logprobs: "))
        .collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(
        lines[0].starts_with("logprobs: request 0 sample 0 token 0: "),
        "{err}"
    );
    assert!(lines[0].contains(" | top: "), "{err}");
}

/// The one JSON completion of `generate PROMPT_ARGS... EXTRA... --format json`.
fn one_json(prompt_args: &[&str], extra: &[&str]) -> Value {
    let args = [prompt_args, extra, &["--format", "json"]].concat();
    completions(&nucleus(&args, None)).remove(0)
}

#[test]
fn logit_bias_stop_token_id_min_tokens_and_ignore_eos() {
    let greedy_args = [
        "--prompt",
        "Once",
        "--temperature",
        "0",
        "--max-tokens",
        "12",
    ];
    // A +100 bias makes the biased token the argmax at every step.
    let c = one_json(&greedy_args, &["--logit-bias", "300=100"]);
    assert_eq!(ids(&c), [300; 12]);

    // Stopping at the greedy run's 4th token (its first occurrence) keeps 4 tokens.
    let greedy = greedy_oracle("Once", 12);
    let tokens: Vec<u32> = greedy.iter().map(|g| g.0).collect();
    let (at, &stop) = tokens
        .iter()
        .enumerate()
        .skip(3)
        .find(|(i, t)| !tokens[..*i].contains(t))
        .expect("a new token");
    let stop_s = stop.to_string();
    let c = one_json(&greedy_args, &["--stop-token-id", &stop_s]);
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(ids(&c), tokens[..=at]);

    // --min-tokens bans the stop id until that many tokens are out: the first `at` tokens are
    // greedy's, then the stop id cannot come before the minimum.
    let min = (at + 3).to_string();
    let got = ids(&one_json(
        &greedy_args,
        &["--stop-token-id", &stop_s, "--min-tokens", &min],
    ));
    assert_eq!(got[..at], tokens[..at]);
    assert!(!got[..at + 3].contains(&stop), "{got:?}");

    // --ignore-eos: EOS (id 2) pushed up by +100 is drawn at every step and does not end the
    // run (vLLM's ignore_eos: generation goes on after EOS); without --ignore-eos the same bias
    // ends the run at once.
    let sampled = [
        "--prompt",
        "",
        "--temperature",
        "0.9",
        "--seed",
        "3",
        "--max-tokens",
        "40",
    ];
    let c = one_json(&sampled, &["--ignore-eos", "--logit-bias", "2=100"]);
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(ids(&c), [2; 40]);
    let c = one_json(&sampled, &["--logit-bias", "2=100"]);
    assert_eq!(c["finish_reason"], "eos");
    assert_eq!(ids(&c), [2]);
}

#[test]
fn prompts_come_from_a_file_stdin_or_a_whole_file() {
    let dir = std::env::temp_dir().join(format!("nucleus-generate-flags-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file: PathBuf = dir.join("prompts.txt");
    std::fs::write(&file, "Once\r\nThe dog\n").unwrap();
    let f = file.to_str().unwrap();
    let common = [
        "--temperature",
        "0",
        "--seed",
        "5",
        "--max-tokens",
        "3",
        "--format",
        "json",
    ];
    let from_file = completions(&nucleus(
        &[&["--prompt-file", f][..], &common].concat(),
        None,
    ));
    let from_flags = completions(&nucleus(
        &[&["--prompt", "Once", "--prompt", "The dog"][..], &common].concat(),
        None,
    ));
    assert_eq!(from_file.len(), 2);
    assert_eq!(from_file, from_flags);
    let whole = completions(&nucleus(
        &[&["--prompt-file", f, "--whole-file"][..], &common].concat(),
        None,
    ));
    let literal = completions(&nucleus(
        &[&["--prompt", "Once\r\nThe dog\n"][..], &common].concat(),
        None,
    ));
    assert_eq!(whole, literal);
    let stdin = completions(&nucleus(
        &[&["--prompt", "-"][..], &common].concat(),
        Some("Once\r\nThe dog\n"),
    ));
    assert_eq!(stdin, literal);
    let stdin_lines = completions(&nucleus(
        &[&["--prompt-file", "-"][..], &common].concat(),
        Some("Once\r\nThe dog\n"),
    ));
    assert_eq!(stdin_lines, from_flags);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn quiet_leaves_stderr_empty() {
    let out = nucleus(&["--prompt", "Once", "--max-tokens", "3", "--quiet"], None);
    assert!(out.status.success());
    assert_eq!(text(&out.stderr), "");
    assert!(!out.stdout.is_empty());
}

#[test]
fn flags_without_effect_or_out_of_range_are_usage_errors() {
    for (args, says) in [
        (
            &["--prompt", "x", "--whole-file"][..],
            "--whole-file has no effect",
        ),
        (
            &["--prompt", "x", "--logprobs-mode", "raw"][..],
            "--logprobs-mode has no effect",
        ),
        (
            &["--prompt", "x", "--echo", "--format", "json"][..],
            "--echo has no effect",
        ),
        (
            &["--prompt", "x", "--logprobs", "1", "--quiet"][..],
            "--quiet silences",
        ),
        (
            &["--prompt", "x", "--min-tokens", "5", "--max-tokens", "2"][..],
            "--min-tokens 5",
        ),
        (
            &[
                "--prompt",
                "x",
                "--logit-bias",
                "3=1",
                "--logit-bias",
                "3=2",
            ][..],
            "token 3 twice",
        ),
        (&["--prompt", "x", "--logit-bias", "3"][..], "ID=BIAS"),
        (
            &["--prompt", "x", "--presence-penalty", "3"][..],
            "presence_penalty",
        ),
        (&["--prompt", "x", "--min-p", "2"][..], "min_p"),
        (&["--prompt", "x", "--typical-p", "0"][..], "typical_p"),
        (&["--prompt", "x", "--mirostat", "3"][..], "mirostat"),
        (&["--prompt", "x", "--min-keep", "0"][..], "min_keep"),
        (
            &["--prompt", "x", "--xtc-probability", "2"][..],
            "xtc_probability",
        ),
        (
            &["--prompt", "x", "--epsilon-cutoff", "1"][..],
            "epsilon_cutoff",
        ),
        (
            &[
                "--prompt",
                "x",
                "--dry-base",
                "0.5",
                "--dry-multiplier",
                "1",
            ][..],
            "dry_base",
        ),
        (
            &["--prompt", "x", "--sequence-bias", "1,x=2"][..],
            "token id `x`",
        ),
        (
            &[
                "--prompt",
                "x",
                "--dry-multiplier",
                "1",
                "--dry-sequence-breaker",
                "",
            ][..],
            "--dry-sequence-breaker",
        ),
        (
            &["--prompt", "x", "--prompt-file", "f"][..],
            "cannot be used with",
        ),
        (
            &["--prompt", "x", "--ignore-eos", "--regex", "a+"][..],
            "--ignore-eos",
        ),
        (&["--prompt", "-", "--prompt", "-"][..], "more than once"),
        (&["--max-tokens", "2"][..], "required"),
        (
            &["--prompt", "x", "--logit-bias", "512=1"][..],
            "vocabulary has 512 ids",
        ),
        (
            &["--prompt", "x", "--stop-token-id", "600"][..],
            "--stop-token-id 600",
        ),
        (
            &["--prompt", "x", "--logprobs", "513"][..],
            "--logprobs 513",
        ),
        (
            &["--prompt", "x", "--generation-config", ""][..],
            "expected auto, vllm",
        ),
    ] {
        let out = nucleus(args, Some(""));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn extended_sampling_flags_reach_the_sampler() {
    let greedy_args = [
        "--prompt",
        "Once",
        "--temperature",
        "0",
        "--max-tokens",
        "10",
    ];
    let greedy = greedy_oracle("Once", 10);
    let tokens: Vec<u32> = greedy.iter().map(|g| g.0).collect();

    // --sequence-bias: a two-token sequence (greedy's first token, 300) biased +100 fires once
    // that first token is out, so 300 follows it.
    let seq = format!("{},300=100", tokens[0]);
    let got = ids(&one_json(&greedy_args, &["--sequence-bias", &seq]));
    assert_eq!(got[..2], [tokens[0], 300], "{got:?}");

    // --no-repeat-ngram-size 1 bans every id already in the sequence: no generated id repeats
    // or occurs in the prompt.
    let c = one_json(&greedy_args, &["--no-repeat-ngram-size", "1"]);
    let got = ids(&c);
    let loaded = load_model(Path::new(&model()), &Device::Cpu).expect("load");
    let prompt = loaded
        .tokenizer
        .tokenizer
        .encode("Once", true)
        .expect("encode")
        .get_ids()
        .to_vec();
    assert_eq!(c["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(got.len(), 10);
    for (i, t) in got.iter().enumerate() {
        assert!(
            !got[..i].contains(t) && !prompt.contains(t),
            "{got:?} / {prompt:?}"
        );
    }

    // --mirostat 2 with tau 0 keeps only tokens of surprise <= mu = 0, so the most probable
    // alone (llama.cpp's keep-one rule), whose surprise under the truncated distribution is 0:
    // mu stays 0 and every step is the argmax, whatever the seed and temperature 1.
    let got = ids(&one_json(
        &["--prompt", "Once", "--max-tokens", "10", "--seed", "5"],
        &["--mirostat", "2", "--mirostat-tau", "0", "--top-k", "1"],
    ));
    assert_eq!(got, tokens);

    // DRY with llama.cpp's default breakers (resolved with the model's SentencePiece
    // vocabulary), XTC, typical-p and top-n-sigma run; the same seed gives the same tokens.
    let args = [
        "--prompt",
        "Once",
        "--max-tokens",
        "16",
        "--seed",
        "9",
        "--dry-multiplier",
        "0.8",
        "--xtc-probability",
        "0.5",
        "--typical-p",
        "0.95",
        "--top-n-sigma",
        "2",
    ];
    let a = ids(&one_json(&args, &[]));
    assert_eq!(a.len(), 16);
    assert_eq!(a, ids(&one_json(&args, &[])));
}
