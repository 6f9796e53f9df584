//! The server when the model panics, and with a model's generation defaults.

mod common;

use nucleus_engine::{CausalLm, Device, GenerationDefaults, KvCache, ModelConfig, SeqInput};
use serde_json::{json, Value};

/// The prompt (token ids) on which [`Flaky`] panics.
const POISON: [u32; 3] = [1, 500, 501];

/// stories260K, except that a forward pass over the prompt [`POISON`] panics.
#[derive(Debug)]
struct Flaky(Box<dyn CausalLm>);

impl CausalLm for Flaky {
    fn config(&self) -> &ModelConfig {
        self.0.config()
    }
    fn device(&self) -> &Device {
        self.0.device()
    }
    fn new_cache_of(&self, dtype: nucleus_engine::KvCacheDtype) -> KvCache {
        self.0.new_cache_of(dtype)
    }
    fn forward(&self, batch: &mut [SeqInput<'_>]) -> nucleus_engine::Result<candle_core::Tensor> {
        if batch.iter().any(|s| s.tokens == POISON) {
            panic!("the test model refuses this prompt");
        }
        self.0.forward(batch)
    }
    fn attention_calls(&self) -> u64 {
        self.0.attention_calls()
    }
}

fn start(flaky: bool, defaults: GenerationDefaults) -> String {
    common::start_with(
        |m| if flaky { Box::new(Flaky(m)) } else { m },
        defaults,
        |c| c.max_body_bytes = 1 << 20,
    )
}

fn post(base: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::blocking::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(body)
        .send()
        .expect("answered");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

#[test]
fn a_panicking_step_is_answered_500_and_the_server_goes_on() {
    let base = start(true, GenerationDefaults::default());
    let fine = json!({"prompt": "Once upon a time", "max_tokens": 5, "seed": 1});
    let (status, before) = post(&base, &fine);
    assert_eq!(status, 200, "{before}");
    let (status, v) = post(&base, &json!({"prompt": POISON, "max_tokens": 5}));
    assert_eq!(status, 500, "{v}");
    assert_eq!(v["error"]["type"], "server_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("the test model refuses this prompt")),
        "{v}"
    );
    // The same poison as a stream: the status line went out already, so the error is an
    // event, then [DONE].
    let text = reqwest::blocking::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": POISON, "max_tokens": 5, "stream": true}))
        .send()
        .expect("answered")
        .text()
        .expect("body");
    assert!(text.contains("\"server_error\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // The server goes on, and gives the same answer as before.
    let (status, after) = post(&base, &fine);
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    let health = reqwest::blocking::get(format!("{base}/health")).expect("health");
    assert_eq!(health.status().as_u16(), 200);
}

#[test]
fn generation_defaults_fill_the_fields_a_request_leaves_out() {
    // generation_config.json of {"temperature": 0, "max_new_tokens": 6}.
    let defaults = GenerationDefaults {
        temperature: Some(0.0),
        max_new_tokens: Some(6),
        ..GenerationDefaults::default()
    };
    let base = start(false, defaults);
    // Greedy: the seed does not matter; six tokens.
    let texts: Vec<Value> = (0..3)
        .map(|seed| {
            let (status, v) = post(&base, &json!({"prompt": "Once upon a time", "seed": seed}));
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
            v["choices"][0]["text"].clone()
        })
        .collect();
    assert!(texts.iter().all(|t| *t == texts[0]), "{texts:?}");
    // A field given wins: temperature 1 draws, and seeds differ.
    let drawn: Vec<Value> = (0..6)
        .map(|seed| {
            let body = json!({"prompt": "Once upon a time", "seed": seed, "temperature": 1.0,
                              "max_tokens": 12});
            post(&base, &body).1["choices"][0]["text"].clone()
        })
        .collect();
    assert!(drawn.iter().any(|t| *t != drawn[0]), "{drawn:?}");
}
