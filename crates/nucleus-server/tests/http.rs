//! The server over a loopback socket, driven with reqwest: every route, the OpenAI shapes,
//! SSE, seeds alone and among concurrent requests, errors naming their field, the 503 path,
//! API keys, and disconnects (the running count back at 0).
//!
//! The model is stories260K (../shared/models), a real tiny Llama with its tokenizer.

mod common;

use std::io::Read;
use std::time::{Duration, Instant};

use nucleus_engine::GenerationDefaults;
use nucleus_server::ServerConfig;
use serde_json::{json, Value};

/// A server over stories260K with the config `tweak` changes.
fn start(tweak: impl FnOnce(&mut ServerConfig)) -> String {
    common::start_with(|m| m, GenerationDefaults::default(), tweak)
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client")
}

fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .expect("answered");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

fn completion_text(base: &str, body: &Value) -> String {
    let (status, v) = post(base, "/v1/completions", body);
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"]
        .as_str()
        .expect("a text")
        .to_string()
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

fn metric(base: &str, name: &str) -> f64 {
    let text = client()
        .get(format!("{base}/metrics"))
        .send()
        .expect("metrics")
        .text()
        .expect("text");
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} in\n{text}"))
}

#[test]
fn routes_answer_with_the_openai_shapes() {
    let base = start(|_| {});
    let health = client()
        .get(format!("{base}/health"))
        .send()
        .expect("health");
    assert_eq!(health.status().as_u16(), 200);
    let models: Value = client()
        .get(format!("{base}/v1/models"))
        .send()
        .expect("models")
        .json()
        .expect("json");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "stories");

    let prompt = "Once upon a time";
    let (_, tok) = post(&base, "/tokenize", &json!({"prompt": prompt}));
    let ids = tok["tokens"].as_array().expect("ids").clone();
    assert_eq!(tok["count"], ids.len());
    let (_, detok) = post(&base, "/detokenize", &json!({"tokens": ids}));
    assert_eq!(detok["prompt"], prompt);

    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"model": "stories", "prompt": prompt, "max_tokens": 12, "seed": 7, "logprobs": 2}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().expect("id").starts_with("cmpl-"));
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    let usage = &v["usage"];
    let completion = usage["completion_tokens"].as_u64().expect("count");
    assert!((1..=12).contains(&completion));
    assert_eq!(usage["prompt_tokens"], tok["count"]);
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(completion + tok["count"].as_u64().expect("count"))
    );
    if completion < 12 {
        assert_eq!(choice["finish_reason"], "stop");
    } else {
        assert_eq!(choice["finish_reason"], "length");
    }
    let lp = &choice["logprobs"];
    let tokens = lp["tokens"].as_array().expect("tokens");
    assert_eq!(tokens.len() as u64, completion);
    // The tokens spell the text, and their offsets add up.
    let joined: String = tokens.iter().map(|t| t.as_str().expect("str")).collect();
    assert_eq!(joined, choice["text"].as_str().expect("text"));
    for (i, (t, top)) in lp["token_logprobs"]
        .as_array()
        .expect("lps")
        .iter()
        .zip(lp["top_logprobs"].as_array().expect("tops"))
        .enumerate()
    {
        let t = t.as_f64().expect("a logprob");
        assert!(t <= 0.0, "token {i}: {t}");
        let top = top.as_object().expect("a dict");
        // The two best, and the sampled token (vLLM's form: up to logprobs + 1 entries).
        assert!(top.len() >= 2 && top.len() <= 3, "{top:?}");
        let sampled = tokens[i].as_str().expect("str");
        assert_eq!(top.get(sampled).and_then(Value::as_f64), Some(t));
        // The best alternative is at least as likely as the sampled token.
        let best = top
            .values()
            .map(|x| x.as_f64().expect("f"))
            .fold(f64::MIN, f64::max);
        assert!(best >= t - 1e-9);
    }

    // Echo puts the prompt first.
    let (_, e) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "seed": 7, "echo": true}),
    );
    let echoed = e["choices"][0]["text"].as_str().expect("text");
    let plain = completion_text(
        &base,
        &json!({"prompt": prompt, "max_tokens": 4, "seed": 7}),
    );
    assert_eq!(echoed, format!("{prompt}{plain}"));
}

#[test]
fn streaming_gives_the_same_text_and_the_usage_chunk() {
    let base = start(|_| {});
    let body = json!({"prompt": "Once upon a time", "max_tokens": 16, "seed": 11});
    let want = completion_text(&base, &body);
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let text = client()
        .post(format!("{base}/v1/completions"))
        .json(&stream_body)
        .send()
        .expect("stream")
        .text()
        .expect("body");
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    let usage = chunks.last().expect("a usage chunk");
    assert_eq!(usage["choices"], json!([]));
    let got: String = chunks[..chunks.len() - 1]
        .iter()
        .map(|c| {
            c["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(got, want);
    let finishes: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0).map(|c| &c["finish_reason"]))
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes.len(), 1);
    let n_tokens = usage["usage"]["completion_tokens"].as_u64().expect("count");
    assert!((1..=16).contains(&n_tokens));
}

#[test]
fn a_seed_gives_the_same_text_alone_and_among_16_concurrent_requests() {
    seed_alone_and_among_16(&start(|_| {}));
}

/// The same in every weight type the matrix kernels hold (batch-invariant kernels: a row's
/// logits do not depend on the batch it runs in), stories260K rewritten as each.
#[test]
fn a_seed_gives_the_same_text_alone_and_among_others_in_every_weight_type() {
    use candle_core::quantized::GgmlDType;
    for dtype in [
        GgmlDType::F16,
        GgmlDType::BF16,
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
    ] {
        let path = common::stories_as(dtype);
        let base = common::start_model(path.clone(), |m| m, GenerationDefaults::default(), |_| {});
        seed_alone_and_among_16(&base);
        let _ = std::fs::remove_file(path);
    }
}

/// Seed 42 alone, then among 15 other seeds at once: the same text; `n = 3` samples.
fn seed_alone_and_among_16(base: &str) {
    let base = base.to_string();
    let body = |seed: u64| json!({"prompt": "Once upon a time", "max_tokens": 24, "seed": seed, "temperature": 1.0});
    let alone = completion_text(&base, &body(42));
    let texts: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16u64)
            .map(|i| {
                let base = base.clone();
                let b = body(if i == 9 { 42 } else { 1000 + i });
                s.spawn(move || completion_text(&base, &b))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    assert_eq!(texts[9], alone);
    // Other seeds give other texts (15 seeds: at least a few differ from seed 42's).
    let differ = texts.iter().filter(|t| **t != alone).count();
    assert!(differ >= 10, "{differ} of 16 differ from seed 42's text");
    // n = 3 samples share one prefill; each is the stream of its sample index.
    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 24, "seed": 42, "n": 3}),
    );
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3);
    assert_eq!(choices[0]["text"].as_str(), Some(alone.as_str()));
    let total: u64 = v["usage"]["completion_tokens"].as_u64().expect("count");
    assert!(total > 24, "three samples: {total} tokens");
}

#[test]
fn bad_requests_are_400s_naming_the_field() {
    let base = start(|c| c.max_body_bytes = 4096);
    for (body, param) in [
        (
            json!({"prompt": "a", "temperature": -1}),
            Some("temperature"),
        ),
        (json!({"prompt": "a", "top_p": 0}), Some("top_p")),
        (json!({"prompt": "a", "n": 0}), Some("n")),
        (json!({"prompt": "a", "bogus": 1}), Some("bogus")),
        (json!({"prompt": "a", "tools": []}), Some("tools")),
        (json!({"prompt": "a", "best_of": 2}), Some("best_of")),
        (
            json!({"prompt": "a", "logit_bias": {"999999": 1}}),
            Some("logit_bias"),
        ),
        (json!({"prompt": [999999]}), Some("prompt")),
        (json!({"max_tokens": 3}), Some("prompt")),
        (
            json!({"prompt": "a", "max_tokens": 100000}),
            Some("max_tokens"),
        ),
        (
            json!({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no such type"}}}}),
            Some("response_format"),
        ),
        (
            json!({"prompt": "a", "structured_outputs": {"grammar": "root ::= \"a\""}}),
            Some("structured_outputs"),
        ),
    ] {
        let (status, v) = post(&base, "/v1/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"].as_str(), param, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    // Malformed JSON, a body over --max-body-bytes, a wrong model, chat without a template.
    let r = client()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body("{\"prompt\":")
        .send()
        .expect("answered");
    assert_eq!(r.status().as_u16(), 400);
    let big = json!({"prompt": "a ".repeat(5000)});
    assert_eq!(post(&base, "/v1/completions", &big).0, 400);
    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "a", "model": "gpt-9"}),
    );
    assert_eq!((status, v["error"]["param"].as_str()), (404, Some("model")));
    let (status, _) = post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(status, 400);
    // A prompt as long as the context.
    let base2 = start(|c| c.max_model_len = 8);
    let (status, v) = post(
        &base2,
        "/v1/completions",
        &json!({"prompt": "Once upon a time there was a little girl"}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("prompt")),
        "{v}"
    );
}

#[test]
fn an_api_key_guards_everything_but_health_and_models() {
    let base = start(|c| c.api_key = Some("secret".into()));
    assert_eq!(
        client()
            .get(format!("{base}/health"))
            .send()
            .expect("r")
            .status()
            .as_u16(),
        200
    );
    assert_eq!(
        client()
            .get(format!("{base}/v1/models"))
            .send()
            .expect("r")
            .status()
            .as_u16(),
        200
    );
    let body = json!({"prompt": "a", "max_tokens": 2});
    assert_eq!(post(&base, "/v1/completions", &body).0, 401);
    let metrics = client().get(format!("{base}/metrics")).send().expect("r");
    assert_eq!(metrics.status().as_u16(), 401);
    let ok = client()
        .post(format!("{base}/v1/completions"))
        .bearer_auth("secret")
        .json(&body)
        .send()
        .expect("r");
    assert_eq!(ok.status().as_u16(), 200);
    let wrong = client()
        .post(format!("{base}/v1/completions"))
        .bearer_auth("secreT")
        .json(&body)
        .send()
        .expect("r");
    assert_eq!(wrong.status().as_u16(), 401);
}

#[test]
fn a_full_queue_refuses_with_503_and_every_request_is_answered() {
    let base = start(|c| {
        c.max_num_seqs = 1;
        c.max_queue = 1;
    });
    let statuses: Vec<(u16, bool)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let base = base.clone();
                s.spawn(move || {
                    let r = client()
                        .post(format!("{base}/v1/completions"))
                        .json(&json!({"prompt": "Once upon a time", "max_tokens": 400,
                                      "ignore_eos": true, "seed": i}))
                        .send()
                        .expect("answered");
                    let retry = r.headers().contains_key("retry-after");
                    (r.status().as_u16(), retry)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    assert_eq!(statuses.len(), 8);
    let ok = statuses.iter().filter(|s| s.0 == 200).count();
    let refused = statuses.iter().filter(|s| s.0 == 503 && s.1).count();
    assert_eq!(ok + refused, 8, "{statuses:?}");
    assert!(ok >= 1 && refused >= 1, "{statuses:?}");
    assert!(metric(&base, "nucleus:admission_rejections_total") >= refused as f64);
}

#[test]
fn closed_streams_are_aborted_and_running_returns_to_0() {
    let base = start(|_| {});
    for i in 0..10 {
        let mut r = client()
            .post(format!("{base}/v1/completions"))
            .json(
                &json!({"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": true,
                          "stream": true, "seed": i}),
            )
            .send()
            .expect("a stream");
        assert_eq!(r.status().as_u16(), 200);
        // The first chunk, then the connection is dropped.
        let mut buf = [0u8; 64];
        let n = r.read(&mut buf).expect("a first chunk");
        assert!(n > 0);
        drop(r);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let running = metric(&base, "nucleus:num_requests_running");
        let waiting = metric(&base, "nucleus:num_requests_waiting");
        if running == 0.0 && waiting == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {running} running, {waiting} waiting"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(metric(&base, "nucleus:request_aborted_total") >= 10.0);
    // The server still answers.
    assert!(!completion_text(&base, &json!({"prompt": "Once", "max_tokens": 3})).is_empty());
}

#[test]
fn samplers_set_the_order_and_the_fixed_order_matches_the_fixed_path() {
    let base = start(|_| {});
    let text = |extra: Value| {
        let mut body = json!({"prompt": "Once upon a time", "max_tokens": 24, "seed": 5,
                              "top_k": 20, "top_p": 0.9, "min_p": 0.02, "temperature": 1.3});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        completion_text(&base, &body)
    };
    // spec/sampling.md's order (penalties, temperature, min_p, top_k, top_p) as a chain gives
    // what the fixed path gives.
    let fixed = text(json!({}));
    let as_chain =
        text(json!({"samplers": ["penalties", "temperature", "min_p", "top_k", "top_p"]}));
    assert_eq!(as_chain, fixed);
    // Another order is another distribution: over 8 seeds, min-p before or after a high
    // temperature keeps other tokens.
    let mut differ = 0;
    for seed in 0..8 {
        let body = |order: Value| {
            json!({"prompt": "Once upon a time", "max_tokens": 24, "seed": seed,
                   "temperature": 3.0, "min_p": 0.3, "samplers": order})
        };
        let a = completion_text(&base, &body(json!(["temperature", "min_p"])));
        let b = completion_text(&base, &body(json!(["min_p", "temperature"])));
        differ += usize::from(a != b);
    }
    assert!(differ >= 1, "the order changed nothing over 8 seeds");
    for (order, param) in [
        (json!(["top_k", "bogus"]), "samplers"),
        (json!(["top_k", "top_k"]), "samplers"),
        (json!("top_k"), "samplers"),
    ] {
        let (status, v) = post(
            &base,
            "/v1/completions",
            &json!({"prompt": "a", "samplers": order, "max_tokens": 2}),
        );
        if order == json!("top_k") {
            // One name as a string is a valid order.
            assert_eq!(status, 200, "{v}");
            continue;
        }
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{v}"
        );
    }
}

#[test]
fn stop_strings_end_the_text_and_can_be_kept() {
    let base = start(|_| {});
    let body = |extra: Value| {
        let mut b = json!({"prompt": "Once upon a time", "max_tokens": 40, "seed": 3});
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b
    };
    let free = completion_text(&base, &body(json!({})));
    let stop = " was";
    let at = free.find(stop).expect("seed 3's text has \" was\"");
    let (_, v) = post(&base, "/v1/completions", &body(json!({"stop": [stop]})));
    assert_eq!(v["choices"][0]["text"], free[..at]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (_, v) = post(
        &base,
        "/v1/completions",
        &body(json!({"stop": [stop], "include_stop_str_in_output": true})),
    );
    assert_eq!(v["choices"][0]["text"], free[..at + stop.len()]);
}

#[test]
fn an_abandoned_request_is_aborted() {
    let base = start(|_| {});
    let quick = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("client");
    let r = quick
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": true}))
        .send();
    assert!(r.is_err(), "the client gave up");
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&base, "nucleus:num_requests_running") != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the abandoned request still runs"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(metric(&base, "nucleus:request_aborted_total") >= 1.0);
}

#[test]
fn errors_found_by_review_are_400s_and_405s_with_the_error_shape() {
    let base = start(|_| {});
    // A penalty that takes a prompt token's logit out of the f32 range: a 400 on the field,
    // not a 500 (the sampler finds it when the first row is sampled).
    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "repetition_penalty": 1e38, "max_tokens": 4}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("repetition_penalty")),
        "{v}"
    );
    // A grammar error names the field it came from.
    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "a", "structured_outputs": {"regex": "(unclosed"}}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("structured_outputs")),
        "{v}"
    );
    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("in structured_outputs")));
    // Another method: 405 with the error shape.
    let r = client()
        .get(format!("{base}/v1/completions"))
        .send()
        .expect("r");
    assert_eq!(r.status().as_u16(), 405);
    let v: Value = r.json().expect("a JSON body");
    assert_eq!(v["error"]["code"], "method_not_allowed");
    // /tokenize names the model too.
    let (status, _) = post(&base, "/tokenize", &json!({"prompt": "a", "model": "nope"}));
    assert_eq!(status, 404);
    // Unknown keys inside response_format; hostile input is not echoed whole.
    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "a", "response_format": {"type": "text", "foo": 1}}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("response_format")),
        "{v}"
    );
    let long = "x".repeat(100_000);
    let mut body = json!({"prompt": "a"});
    body[long.as_str()] = json!(1);
    let (status, v) = post(&base, "/v1/completions", &body);
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().expect("message").len() <= 1024 + 3);
    assert!(v["error"]["param"].as_str().expect("param").len() <= 256 + 3);
}

#[test]
fn stop_strings_wait_for_min_tokens() {
    let base = start(|_| {});
    let body = |min: usize| {
        json!({"prompt": "Once upon a time", "temperature": 0, "max_tokens": 20, "stop": [","],
               "min_tokens": min})
    };
    let (_, free) = post(&base, "/v1/completions", &body(0));
    // Greedy stories260K continues "Once upon a time" with ", there was ...": the stop string
    // comes first.
    assert_eq!(free["choices"][0]["text"], "", "{free}");
    let (_, held) = post(&base, "/v1/completions", &body(5));
    let n = held["usage"]["completion_tokens"].as_u64().expect("count");
    assert!(n >= 5, "{held}");
    assert!(
        held["choices"][0]["text"]
            .as_str()
            .expect("text")
            .starts_with(','),
        "{held}"
    );
}

#[test]
fn sizes_at_the_top_of_their_type_are_400s_or_work_not_overflows() {
    // --max-queue as large as a usize: admission saturates instead of overflowing (a 500).
    let base = start(|c| c.max_queue = usize::MAX);
    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
    // max_tokens near 2^64: the prompt and it are added without overflowing, a 400 on the field.
    for m in [u64::MAX, u64::MAX - 4] {
        let (status, v) = post(
            &base,
            "/v1/completions",
            &json!({"prompt": "Once upon a time", "max_tokens": m}),
        );
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some("max_tokens")),
            "{v}"
        );
    }
}

/// An integer from 0 to 9 that is neither 2 nor 5: llguidance does not implement `not`, so
/// relaxed mode (the default) drops it from the mask and the validator catches 2 and 5.
const NOT_2_OR_5: &str = r#"{"type":"integer","minimum":0,"maximum":9,"not":{"enum":[2,5]}}"#;

/// The `nucleus_schema` object the hand-worked verdict gives for `text` under [`NOT_2_OR_5`].
fn not_2_or_5_report(text: &str) -> Value {
    let v: i64 = text.parse().expect("an integer");
    assert!((0..=9).contains(&v), "the mask keeps 0..=9: {text}");
    if v == 2 || v == 5 {
        json!({"valid": false, "relaxed": ["not"], "error": {"instance_path": "",
               "message": format!("{{\"enum\":[2,5]}} is not allowed for {v}")}})
    } else {
        json!({"valid": true, "error": null, "relaxed": ["not"]})
    }
}

#[test]
fn each_choice_under_a_json_schema_carries_the_validators_verdict() {
    let base = start(|_| {});
    let format = json!({"type": "json_schema", "json_schema": {"name": "digit",
                        "schema": serde_json::from_str::<Value>(NOT_2_OR_5).unwrap()}});
    let body = json!({"prompt": "Once", "max_tokens": 8, "seed": 7, "n": 12,
                      "response_format": format});
    let (status, v) = post(&base, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 12);
    let mut invalid = 0;
    for c in choices {
        let text = c["text"].as_str().unwrap();
        assert_eq!(c["nucleus_schema"], not_2_or_5_report(text), "{c}");
        invalid += usize::from(c["nucleus_schema"]["valid"] == false);
    }
    assert!(invalid > 0, "seed 7 draws a 2 or a 5 among 12");

    // Streaming: the last chunk of each choice carries the same verdict.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let text = client()
        .post(format!("{base}/v1/completions"))
        .json(&stream_body)
        .send()
        .expect("stream")
        .text()
        .expect("body");
    let data = sse_data(&text);
    let mut reports = vec![Value::Null; 12];
    for d in &data[..data.len() - 1] {
        let chunk: Value = serde_json::from_str(d).expect("a JSON chunk");
        for c in chunk["choices"].as_array().unwrap() {
            if let Some(r) = c.get("nucleus_schema") {
                assert!(!c["finish_reason"].is_null(), "only on the last chunk: {c}");
                reports[c["index"].as_u64().unwrap() as usize] = r.clone();
            }
        }
    }
    for (c, r) in choices.iter().zip(&reports) {
        assert_eq!(&c["nucleus_schema"], r);
    }

    // A choice cut by max_tokens before its grammar could end is incomplete.
    let object = json!({"type": "json_schema", "json_schema": {"name": "o", "schema":
        {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}}});
    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 3, "seed": 1, "response_format": object}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["choices"][0]["nucleus_schema"],
        json!({"valid": false, "relaxed": [],
               "error": {"instance_path": "", "message": "incomplete"}})
    );
    // No JSON Schema, no verdict.
    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 3, "structured_outputs": {"regex": "[ab]+"}}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0].get("nucleus_schema").is_none(), "{v}");
}

#[test]
fn a_strict_server_refuses_a_schema_llguidance_cannot_compile_exactly() {
    let base = start(|c| c.json_schema_mode = nucleus_engine::JsonSchemaMode::Strict);
    let format = json!({"type": "json_schema", "json_schema": {"name": "digit",
                        "schema": serde_json::from_str::<Value>(NOT_2_OR_5).unwrap()}});
    let (status, v) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 8, "response_format": format}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "response_format", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("the grammar does not compile: "),
        "{message}"
    );
}
