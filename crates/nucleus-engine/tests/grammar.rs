//! Structured output in the generation loop, on the real stories260K model: JSON Schema and
//! regex constrained generation whose every output is checked by independent oracles (the
//! `jsonschema` validator crate, the `regex` crate), rollback of the grammar state, KV cache
//! and detokeniser, `length` before the grammar may end, and typed errors.

mod common;

use std::collections::BTreeMap;

use nucleus_engine::{
    load_gguf, Device, Engine, EngineConfig, EngineError, FinishReason, GrammarSpec, Request,
    SamplingParams,
};

fn engine() -> Engine {
    let loaded = load_gguf(&common::stories260k(), &Device::Cpu).expect("stories260K loads");
    Engine::new(loaded.model, loaded.tokenizer, EngineConfig::default())
}

/// Per request id: (tokens, text, finish reason).
type Runs = BTreeMap<u64, (Vec<u32>, String, Option<FinishReason>)>;

fn run_to_end(engine: &mut Engine) -> Runs {
    let mut runs = Runs::new();
    let mut steps = 0;
    while engine.has_unfinished() {
        steps += 1;
        assert!(steps < 10_000, "the engine does not finish");
        for out in engine.step().expect("step") {
            let entry = runs.entry(out.request_id).or_default();
            entry.0.extend(out.token);
            entry.1.push_str(&out.text);
            if out.finish.is_some() {
                assert!(entry.2.is_none(), "finished twice");
                entry.2 = out.finish;
            }
        }
    }
    runs
}

/// A string with maxLength, a bounded integer, an enum and a required array with maxItems.
const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad", "sleepy"]},
    "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
  },
  "required": ["name", "age", "mood", "friends"],
  "additionalProperties": false
}"#;

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ..Default::default()
    }
}

fn with_grammar(spec: GrammarSpec, seed: u64, max_tokens: usize) -> Request {
    Request {
        params: sampled(seed),
        max_tokens,
        grammar: Some(spec),
        ..Request::new("Once upon a time")
    }
}

#[test]
fn json_schema_output_always_parses_and_validates_for_20_seeds() {
    let mut e = engine();
    for seed in 0..20 {
        e.add_request(with_grammar(
            GrammarSpec::JsonSchema(SCHEMA.into()),
            seed,
            1000,
        ))
        .unwrap();
    }
    let schema: serde_json::Value = serde_json::from_str(SCHEMA).unwrap();
    let validator = jsonschema::validator_for(&schema).expect("the oracle compiles the schema");
    let runs = run_to_end(&mut e);
    assert_eq!(runs.len(), 20);
    let mut texts = std::collections::BTreeSet::new();
    for (id, (tokens, text, finish)) in &runs {
        assert!(
            matches!(finish, Some(FinishReason::Eos | FinishReason::Stop)),
            "request {id}: {finish:?} after {} tokens: {text:?}",
            tokens.len()
        );
        let value: serde_json::Value = serde_json::from_str(text)
            .unwrap_or_else(|err| panic!("request {id}: not JSON ({err}): {text:?}"));
        let errors: Vec<String> = validator
            .iter_errors(&value)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "request {id}: {text:?}: {errors:?}");
        texts.insert(text.clone());
    }
    // Sampling at temperature 1 with 20 seeds: not one canned answer.
    assert!(texts.len() > 10, "only {} distinct outputs", texts.len());
}

#[test]
fn regex_output_always_matches() {
    let re = r"[A-Z][a-z]{1,8}( [a-z]{1,8}){1,4}\.";
    let oracle = regex::Regex::new(&format!("^(?:{re})$")).unwrap();
    let mut e = engine();
    for seed in 0..20 {
        e.add_request(with_grammar(GrammarSpec::Regex(re.into()), seed, 200))
            .unwrap();
    }
    let runs = run_to_end(&mut e);
    assert_eq!(runs.len(), 20);
    for (id, (_, text, finish)) in &runs {
        assert!(
            matches!(finish, Some(FinishReason::Eos | FinishReason::Stop)),
            "request {id}: {finish:?}: {text:?}"
        );
        assert!(oracle.is_match(text), "request {id}: {text:?}");
    }
}

/// Rolling back restores the grammar, the KV cache length and the detokeniser: the same tokens
/// come again (same logits, same Philox positions), and the output still validates.
#[test]
fn rollback_regenerates_the_same_tokens_and_keeps_the_grammar() {
    let mut e = engine();
    let info = e
        .add_request(with_grammar(
            GrammarSpec::JsonSchema(SCHEMA.into()),
            7,
            1000,
        ))
        .unwrap();
    let id = info.request_id;
    let mut tokens = Vec::new();
    for _ in 0..14 {
        let out = e.step().unwrap();
        assert_eq!(out.len(), 1);
        assert!(out[0].finish.is_none(), "{:?}", out[0]);
        tokens.extend(out[0].token);
    }
    e.rollback(id, 0, 5).unwrap();
    let mut again = Vec::new();
    for _ in 0..5 {
        again.extend(e.step().unwrap()[0].token);
    }
    assert_eq!(again, tokens[9..], "the same tokens after a rollback of 5");
    // Errors leave the sample as it was.
    assert!(matches!(
        e.rollback(id, 0, 15),
        Err(EngineError::InvalidRequest(_))
    ));
    assert!(matches!(
        e.rollback(id + 1, 0, 1),
        Err(EngineError::InvalidRequest(_))
    ));
    e.rollback(id, 0, 14).unwrap();
    let runs = run_to_end(&mut e);
    let (all, _, finish) = &runs[&id];
    assert!(matches!(
        finish,
        Some(FinishReason::Eos | FinishReason::Stop)
    ));
    assert_eq!(
        all[..14],
        tokens[..],
        "from the start again: the same 14 tokens"
    );
    let text = e.decode(all).unwrap();
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    let schema: serde_json::Value = serde_json::from_str(SCHEMA).unwrap();
    assert!(jsonschema::is_valid(&schema, &value), "{text:?}");
}

#[test]
fn max_tokens_before_the_grammar_may_end_is_length_with_the_incomplete_text() {
    let mut e = engine();
    e.add_request(with_grammar(GrammarSpec::JsonSchema(SCHEMA.into()), 3, 6))
        .unwrap();
    let runs = run_to_end(&mut e);
    let (tokens, text, finish) = &runs[&0];
    assert_eq!(finish, &Some(FinishReason::Length));
    assert_eq!(tokens.len(), 6);
    assert!(text.starts_with('{'), "{text:?}");
    assert!(serde_json::from_str::<serde_json::Value>(text).is_err());
}

/// A grammar request beside a plain one: the plain one's tokens are those it gets alone.
#[test]
fn a_grammar_request_does_not_change_its_neighbours() {
    let plain = |seed| Request {
        params: sampled(seed),
        max_tokens: 30,
        ..Request::new("Once upon a time")
    };
    let mut alone = engine();
    alone.add_request(plain(11)).unwrap();
    let alone = run_to_end(&mut alone);
    let mut mixed = engine();
    mixed
        .add_request(with_grammar(
            GrammarSpec::Regex("[a-z ]{1,40}".into()),
            5,
            30,
        ))
        .unwrap();
    mixed.add_request(plain(11)).unwrap();
    let mixed = run_to_end(&mut mixed);
    assert_eq!(mixed[&1].0, alone[&0].0);
    assert!(mixed[&0]
        .1
        .chars()
        .all(|c| c.is_ascii_lowercase() || c == ' '));
}

#[test]
fn bad_grammars_are_typed_errors_that_name_the_problem() {
    let mut e = engine();
    let err = e
        .add_request(with_grammar(
            GrammarSpec::JsonSchema(
                r#"{"type": "object", "properties": {"a": {"type": "strin"}}}"#.into(),
            ),
            1,
            10,
        ))
        .unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, EngineError::Grammar(_)), "{err:?}");
    assert!(message.contains("strin"), "{message}");
    let err = e
        .add_request(with_grammar(GrammarSpec::Regex("(ab".into()), 1, 10))
        .unwrap_err();
    assert!(matches!(err, EngineError::Grammar(_)), "{err:?}");
    let err = e
        .add_request(Request {
            ignore_eos: true,
            ..with_grammar(GrammarSpec::Regex("ab".into()), 1, 10)
        })
        .unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(_)), "{err:?}");
    assert!(!e.has_unfinished(), "failed requests are not added");
}

/// One compilation serves every request with the same grammar.
#[test]
fn one_compilation_serves_every_request_with_the_same_grammar() {
    let mut e = engine();
    for seed in 0..4 {
        e.add_request(with_grammar(
            GrammarSpec::JsonSchema(SCHEMA.into()),
            seed,
            50,
        ))
        .unwrap();
    }
    e.add_request(with_grammar(GrammarSpec::Regex("yes|no".into()), 1, 5))
        .unwrap();
    assert_eq!(e.grammar_compiler().unwrap().compilations(), 2);
}

/// A grammar completed by the last token max_tokens allows is `stop` (complete), not `length`.
#[test]
fn a_grammar_completed_at_max_tokens_is_stop_not_length() {
    let spec = GrammarSpec::Regex("(yes|no), (yes|no)".into());
    let mut e = engine();
    e.add_request(with_grammar(spec.clone(), 9, 100)).unwrap();
    let full = run_to_end(&mut e);
    let (tokens, text, finish) = &full[&0];
    assert_eq!(finish, &Some(FinishReason::Stop), "{text:?}");
    let mut e = engine();
    e.add_request(with_grammar(spec, 9, tokens.len())).unwrap();
    let exact = run_to_end(&mut e);
    assert_eq!(exact[&0], full[&0]);
}

/// A piece that is also a control token (a GGUF file marking `x`, id 444, as token type 3):
/// the tokenizer gives that id for the text `x`, so a grammar forcing `x` was offered token
/// 444 by its mask and then rejected it ("the sampled token was not committed"), on every
/// seed. Text is now tokenised into pieces whose bytes are the text, so `xx` is generated.
#[test]
fn a_control_token_that_is_also_a_piece_is_never_forced_for_text() {
    use candle_core::quantized::gguf_file::Value;
    let path = common::temp_path("control-x");
    common::rewrite_gguf(
        &common::stories260k(),
        &path,
        |md| {
            let types = md
                .iter_mut()
                .find(|(k, _)| k == "tokenizer.ggml.token_type")
                .expect("token types");
            let Value::Array(types) = &mut types.1 else {
                panic!("token types are an array")
            };
            types[444] = Value::I32(3);
        },
        |_, t| Ok(Some(t)),
    )
    .expect("rewrite");
    let loaded = load_gguf(&path, &Device::Cpu).expect("loads");
    assert_eq!(
        loaded.tokenizer.tokenizer.id_to_token(444).as_deref(),
        Some("x")
    );
    let mut e = Engine::new(loaded.model, loaded.tokenizer, EngineConfig::default());
    for seed in 0..3 {
        e.add_request(Request {
            max_tokens: 8,
            grammar: Some(GrammarSpec::Regex("xx".into())),
            params: sampled(seed),
            ..Request::new("")
        })
        .expect("request");
    }
    let runs = run_to_end(&mut e);
    assert_eq!(runs.len(), 3);
    for (tokens, text, finish) in runs.values() {
        assert_eq!(text, "xx", "{tokens:?} {finish:?}");
        assert!(!tokens.contains(&444), "{tokens:?}");
        assert_eq!(finish, &Some(FinishReason::Stop));
    }
}

/// Per (request id, sample index): the tokens, and `grammar_complete` of the finishing step.
fn run_samples(engine: &mut Engine) -> BTreeMap<(u64, u32), (Vec<u32>, Option<bool>)> {
    let mut runs = BTreeMap::new();
    while engine.has_unfinished() {
        for out in engine.step().expect("step") {
            let entry: &mut (Vec<u32>, Option<bool>) =
                runs.entry((out.request_id, out.sample_index)).or_default();
            entry.0.extend(out.token);
            if out.finish.is_some() {
                entry.1 = out.grammar_complete;
            } else {
                assert_eq!(out.grammar_complete, None, "only on the finishing step");
            }
        }
    }
    runs
}

#[test]
fn grammar_complete_says_whether_the_grammar_could_end() {
    let mut e = engine();
    // Cut by max_tokens inside the object: incomplete.
    e.add_request(with_grammar(GrammarSpec::JsonSchema(SCHEMA.into()), 3, 6))
        .unwrap();
    // Ended by the grammar: complete.
    e.add_request(with_grammar(GrammarSpec::Regex("(yes|no)".into()), 9, 100))
        .unwrap();
    // No grammar: not said.
    e.add_request(Request {
        params: sampled(4),
        max_tokens: 3,
        ..Request::new("Once upon a time")
    })
    .unwrap();
    let runs = run_samples(&mut e);
    assert_eq!(runs[&(0, 0)].1, Some(false));
    assert_eq!(runs[&(1, 0)].1, Some(true));
    assert_eq!(runs[&(2, 0)].1, None);
}

#[test]
fn a_sample_offset_draws_the_stream_of_that_sample_index() {
    let spec = GrammarSpec::JsonSchema(r#"{"type":"integer","minimum":0,"maximum":99}"#.into());
    // Samples 0..8 of one request, and samples 5..8 of another with the same seed, added with
    // offset 5: the same sample indices give the same tokens.
    let mut e = engine();
    e.add_request(Request {
        n: 8,
        ..with_grammar(spec.clone(), 21, 10)
    })
    .unwrap();
    e.add_request_with_sample_offset(
        Request {
            n: 3,
            ..with_grammar(spec.clone(), 21, 10)
        },
        5,
    )
    .unwrap();
    let runs = run_samples(&mut e);
    let first: Vec<u32> = runs.keys().filter(|k| k.0 == 1).map(|k| k.1).collect();
    assert_eq!(first, [5, 6, 7]);
    for j in 5..8 {
        assert_eq!(runs[&(1, j)], runs[&(0, j)], "sample index {j}");
    }
    let distinct: std::collections::BTreeSet<&Vec<u32>> =
        (0..8).map(|j| &runs[&(0, j)].0).collect();
    assert!(distinct.len() > 1, "sample indices draw different streams");
    // Indices past u32::MAX are refused.
    let err = e
        .add_request_with_sample_offset(
            Request {
                n: 2,
                ..with_grammar(spec, 21, 10)
            },
            u32::MAX,
        )
        .unwrap_err();
    assert!(
        matches!(&err, EngineError::InvalidRequest(m) if m.contains("do not fit in a u32")),
        "{err}"
    );
}

#[test]
fn a_text_a_stop_string_ended_is_not_grammar_complete() {
    // The grammar forces "yes"; the stop string "es" ends the text at "y", which is not what
    // the grammar matched. Without the stop string the same sample is complete.
    let spec = GrammarSpec::Regex("yes".into());
    for (stop, text, complete) in [(Some("es"), "y", false), (None, "yes", true)] {
        let mut e = engine();
        e.add_request(Request {
            stop_strings: stop.map(String::from).into_iter().collect(),
            ..with_grammar(spec.clone(), 1, 100)
        })
        .unwrap();
        let runs = run_samples(&mut e);
        assert_eq!(runs[&(0, 0)].1, Some(complete), "{stop:?}");
        let mut e = engine();
        e.add_request(Request {
            stop_strings: stop.map(String::from).into_iter().collect(),
            ..with_grammar(spec.clone(), 1, 100)
        })
        .unwrap();
        assert_eq!(run_to_end(&mut e)[&0].1, text, "{stop:?}");
    }
}
