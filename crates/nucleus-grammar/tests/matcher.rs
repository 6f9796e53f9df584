//! The matcher's contract with MiniMind's tokenizer (6,400 ids): EOS and rollback, typed
//! errors for bad grammars, tokens and rows, the JSON whitespace bound in masks and
//! validation, padded bitmask rows, the grammar cache, batch fills.

mod common;

use std::sync::Arc;

use common::*;
use nucleus_grammar::{
    fill_bitmasks, validate_text, GrammarCompiler, GrammarError, GrammarKind, GrammarMatcher,
    GrammarOptions, GrammarSpec, TokenEnv, Validation,
};

const A: u32 = 100; // "a"
const SPACE: u32 = 256; // "Ġ", one space
const IM_END: u32 = 2;
const ENDOFTEXT: u32 = 0;

fn opts() -> GrammarOptions {
    GrammarOptions::default()
}

#[test]
fn token_ids_used_here_are_minimind_s() {
    let tok = minimind_tokenizer();
    assert_eq!(tok.token_to_id("a"), Some(A));
    assert_eq!(tok.token_to_id("Ġ"), Some(SPACE));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(IM_END));
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(ENDOFTEXT));
}

#[test]
fn types_are_send_and_sync_as_documented() {
    fn send<T: Send>() {}
    fn sync<T: Send + Sync>() {}
    send::<GrammarMatcher>();
    sync::<GrammarCompiler>();
    sync::<TokenEnv>();
    sync::<nucleus_grammar::CompiledGrammar>();
}

#[test]
fn rollback_over_a_committed_eos_reopens_the_matcher() {
    let c = minimind_compiler();
    let mut m = c
        .matcher(&GrammarSpec::Regex("a+".into()), &opts())
        .unwrap();
    let mut row = vec![0u32; 200];
    m.fill_bitmask(&mut row).unwrap();
    assert!(
        allowed(&row, A) && !allowed(&row, IM_END),
        "a+ cannot be empty"
    );
    assert_eq!(m.validate_tokens(&[IM_END]), 0);
    assert!(matches!(
        m.commit(IM_END),
        Err(GrammarError::TokenRejected { token: IM_END, .. })
    ));

    m.commit(A).unwrap();
    assert!(
        m.may_end() && !m.is_ended(),
        "a is complete, more a's may follow"
    );
    m.fill_bitmask(&mut row).unwrap();
    assert!(allowed(&row, A) && allowed(&row, IM_END) && allowed(&row, ENDOFTEXT));
    assert!(!allowed(&row, SPACE));

    m.commit(IM_END).unwrap();
    assert!(m.is_ended() && m.may_end());
    assert_eq!(m.committed_len(), 2);
    m.fill_bitmask(&mut row).unwrap();
    assert!(row.iter().all(|&w| w == 0), "nothing after EOS");
    assert_eq!(m.validate_tokens(&[A]), 0);
    assert_eq!(m.commit(A), Err(GrammarError::Ended));

    m.rollback(1).unwrap();
    assert!(!m.is_ended() && m.may_end());
    m.fill_bitmask(&mut row).unwrap();
    assert!(
        allowed(&row, A) && allowed(&row, IM_END),
        "re-opened after a"
    );
    m.commit(A).unwrap();
    m.commit(ENDOFTEXT).unwrap(); // the second EOS id ends it too
    assert!(m.is_ended());
    // Rolling back over EOS and a token at once.
    m.rollback(2).unwrap();
    assert_eq!(m.committed_len(), 1);
    assert_eq!(
        m.validate_tokens(&[A, A, IM_END, A]),
        3,
        "EOS, then nothing"
    );
    assert_eq!(
        m.rollback(2),
        Err(GrammarError::RollbackTooFar {
            requested: 2,
            committed: 1
        })
    );
    assert_eq!(m.rollback(0), Ok(()));
    assert_eq!(m.committed_len(), 1);
}

#[test]
fn rollback_over_eos_in_json_reopens_the_number() {
    let c = minimind_compiler();
    let env = c.token_env().clone();
    let mut m = c
        .matcher(
            &GrammarSpec::JsonSchema(r#"{"type": "integer"}"#.into()),
            &opts(),
        )
        .unwrap();
    let one = env.encode("1").unwrap();
    let two = env.encode("2").unwrap();
    assert_eq!((one.len(), two.len()), (1, 1));
    m.commit(one[0]).unwrap();
    assert!(m.may_end());
    m.commit(IM_END).unwrap();
    m.rollback(1).unwrap();
    m.commit(two[0]).unwrap(); // "12"
    m.commit(IM_END).unwrap();
    assert!(m.is_ended());
    assert!(validate_text(
        &c,
        &GrammarSpec::JsonSchema(r#"{"type": "integer"}"#.into()),
        &opts(),
        "12"
    )
    .unwrap()
    .is_accepted());
}

#[test]
fn a_schema_that_fails_to_compile_is_a_typed_error_naming_the_problem() {
    let c = minimind_compiler();
    let compile = |spec: GrammarSpec| c.compile(&spec, &opts()).unwrap_err();

    let e = compile(GrammarSpec::JsonSchema(r#"{"type": "foo"}"#.into()));
    assert_eq!(
        e,
        GrammarError::Compile {
            kind: GrammarKind::JsonSchema,
            message: "Invalid type: foo".into()
        }
    );
    assert_eq!(
        e.to_string(),
        "JSON Schema does not compile: Invalid type: foo"
    );

    let e = compile(GrammarSpec::JsonSchema(
        r#"{"type": "string", "pattern": "(["}"#.into(),
    ));
    assert!(
        matches!(&e, GrammarError::Compile { kind: GrammarKind::JsonSchema, message } if message.contains("unclosed character class")),
        "{e}"
    );
    let e = compile(GrammarSpec::JsonSchema(
        r##"{"$ref": "#/definitions/x"}"##.into(),
    ));
    assert!(
        e.to_string().contains("'/definitions/x' does not exist"),
        "{e}"
    );
    let e = compile(GrammarSpec::JsonSchema("false".into()));
    assert!(e.to_string().contains("Unsatisfiable schema"), "{e}");

    let e = compile(GrammarSpec::JsonSchema("{not json".into()));
    assert_eq!(
        e,
        GrammarError::InvalidSchemaJson("key must be a string at line 1 column 2".into())
    );

    let e = compile(GrammarSpec::Regex("(a".into()));
    assert!(
        matches!(&e, GrammarError::Compile { kind: GrammarKind::Regex, message } if message.contains("unclosed group")),
        "{e}"
    );
    let e = compile(GrammarSpec::Lark("start: foo".into()));
    assert!(
        matches!(&e, GrammarError::Compile { kind: GrammarKind::Lark, message } if message.contains("unknown name: \"foo\"")),
        "{e}"
    );
}

/// The whitespace-only tokens of MiniMind and their lengths, from the tokenizer's own decoder.
fn whitespace_tokens() -> Vec<(u32, usize)> {
    let tok = minimind_tokenizer();
    (0..6400u32)
        .filter_map(|t| {
            let s = tok.decode(&[t], false).ok()?;
            (!s.is_empty() && s.chars().all(|c| matches!(c, ' ' | '\n' | '\r' | '\t')))
                .then_some((t, s.len()))
        })
        .collect()
}

#[test]
fn json_whitespace_is_bounded_at_8_in_validation() {
    let c = minimind_compiler();
    let schema = GrammarSpec::JsonSchema(
        r#"{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}}, "required": ["a"]}"#
            .into(),
    );
    let v = |text: &str, o: &GrammarOptions| validate_text(&c, &schema, o, text).unwrap();
    let ws = |n: usize| " ".repeat(n);
    for n in [0, 1, 8, 9] {
        let texts = [
            format!("{{{}\"a\": 1}}", ws(n)),
            format!("{{\"a\"{}: 1}}", ws(n)),
            format!("{{\"a\":{}1}}", ws(n)),
            format!("{{\"a\": 1{}}}", ws(n)),
            format!("{{\"a\": 1,{}\"b\": []}}", ws(n)),
            format!("{{\"a\": 1, \"b\": [{}]}}", ws(n)),
            format!("{{\n{}\"a\": 1}}", ws(n.saturating_sub(1))), // a newline counts too
        ];
        for text in &texts {
            let verdict = v(text, &opts());
            if n <= 8 {
                assert!(verdict.is_accepted(), "{text:?}: {verdict}");
            } else {
                assert!(
                    matches!(verdict, Validation::Rejected { .. }),
                    "{text:?}: {verdict}"
                );
                // Unbounded, it is fine.
                let verdict = v(
                    text,
                    &GrammarOptions {
                        max_whitespace: None,
                        ..GrammarOptions::default()
                    },
                );
                assert!(verdict.is_accepted(), "{text:?} unbounded: {verdict}");
            }
        }
    }
    // Nothing before or after the top-level value.
    assert!(!v(" {\"a\": 1}", &opts()).is_accepted());
    assert!(!v("{\"a\": 1}\n", &opts()).is_accepted());
    // Other bounds.
    let three = GrammarOptions {
        max_whitespace: Some(3),
        ..GrammarOptions::default()
    };
    assert!(v("{\"a\":   1}", &three).is_accepted());
    assert!(!v("{\"a\":    1}", &three).is_accepted());
    let zero = GrammarOptions {
        max_whitespace: Some(0),
        ..GrammarOptions::default()
    };
    assert!(v("{\"a\":1,\"b\":[]}", &zero).is_accepted());
    assert!(!v("{\"a\": 1}", &zero).is_accepted());
    // A schema's own x-guidance whitespace setting wins.
    let own = GrammarSpec::JsonSchema(
        r#"{"x-guidance": {"whitespace_flexible": false}, "type": "array"}"#.into(),
    );
    assert!(validate_text(&c, &own, &opts(), "[1,2]")
        .unwrap()
        .is_accepted());
    assert!(!validate_text(&c, &own, &opts(), "[1, 2]")
        .unwrap()
        .is_accepted());
}

#[test]
fn json_whitespace_is_bounded_at_8_in_the_mask() {
    let c = minimind_compiler();
    let ws_tokens = whitespace_tokens();
    // MiniMind has whitespace tokens of 1 to 12 characters, 8 spaces (6065) among them.
    assert!(ws_tokens.contains(&(6065, 8)) && ws_tokens.iter().any(|&(_, n)| n > 8));
    let schema = GrammarSpec::JsonSchema(
        r#"{"type": "object", "properties": {"a": {"type": "integer"}}}"#.into(),
    );
    let brace = c.token_env().encode("{").unwrap();
    assert_eq!(brace.len(), 1);
    for (options, bound) in [
        (opts(), 8),
        (
            GrammarOptions {
                max_whitespace: Some(3),
                ..GrammarOptions::default()
            },
            3,
        ),
    ] {
        let mut m = c.matcher(&schema, &options).unwrap();
        let mut row = vec![0u32; 200];
        m.commit(brace[0]).unwrap();
        for spaces in 0..=bound {
            m.fill_bitmask(&mut row).unwrap();
            let got: Vec<u32> = ws_tokens
                .iter()
                .filter(|&&(t, _)| allowed(&row, t))
                .map(|&(t, _)| t)
                .collect();
            let want: Vec<u32> = ws_tokens
                .iter()
                .filter(|&&(_, n)| n <= bound - spaces)
                .map(|&(t, _)| t)
                .collect();
            assert_eq!(got, want, "bound {bound}, after {{ and {spaces} spaces");
            if spaces < bound {
                m.commit(SPACE).unwrap();
            }
        }
        // At the bound: a 9th space is rejected, the key or } goes on.
        assert!(matches!(
            m.commit(SPACE),
            Err(GrammarError::TokenRejected { token: SPACE, .. })
        ));
        let close = c.token_env().encode("}").unwrap();
        m.commit(close[0]).unwrap();
        assert!(m.may_end());
    }
}

#[test]
fn a_row_longer_than_the_vocabulary_leaves_the_extra_ids_disallowed() {
    let tokenizer = minimind_tokenizer();
    // Any text: most tokens are allowed, so stray bits would show.
    let spec = GrammarSpec::Regex("(?s:.*)".into());
    // A model whose LM head is padded to 6,419 ids (not a multiple of 32) and a row of 210
    // words (6,720 ids).
    for vocab in [6400usize, 6419] {
        let env = TokenEnv::from_tokenizer(&tokenizer, &MINIMIND_EOS, vocab).unwrap();
        assert_eq!(env.tokenizer_vocab_size(), 6400);
        assert_eq!(env.bitmask_words(), vocab.div_ceil(32));
        let c = GrammarCompiler::new(env).unwrap();
        let mut m = c.matcher(&spec, &opts()).unwrap();
        let mut row = vec![u32::MAX; 210];
        m.fill_bitmask(&mut row).unwrap();
        let ids = allowed_ids(&row);
        assert!(ids.len() > 6000, "{} allowed", ids.len());
        assert!(
            ids.iter().all(|&t| t < 6400),
            "ids at or above the tokenizer's vocabulary"
        );
        assert!(allowed(&row, IM_END) && allowed(&row, ENDOFTEXT) && !allowed(&row, 1));
        assert!(row[201..].iter().all(|&w| w == 0));
        // Ids past the tokenizer are out of range for commits only past vocab_size.
        assert_eq!(m.validate_tokens(&[6400]), 0);
        let past = vocab as u32;
        assert_eq!(
            m.commit(past),
            Err(GrammarError::TokenOutOfRange {
                token: past,
                vocab_size: vocab
            })
        );
        assert_eq!(m.validate_tokens(&[A, past, A]), 1);

        let needed = vocab.div_ceil(32);
        let mut short = vec![0u32; needed - 1];
        assert_eq!(
            m.fill_bitmask(&mut short),
            Err(GrammarError::BitmaskTooShort {
                len: needed - 1,
                needed,
                vocab_size: vocab
            })
        );
    }
}

#[test]
fn the_grammar_cache_compiles_once() {
    let c = minimind_compiler();
    let schema = GrammarSpec::JsonSchema(r#"{"type": "string"}"#.into());
    let g1 = c.compile(&schema, &opts()).unwrap();
    let g2 = c.compile(&schema.clone(), &opts()).unwrap();
    assert!(Arc::ptr_eq(&g1, &g2));
    assert_eq!(c.compilations(), 1);
    // Matchers from one compiled grammar are independent.
    let mut m1 = g1.matcher();
    let mut m2 = c.matcher(&schema, &opts()).unwrap();
    assert_eq!(c.compilations(), 1);
    let quote = c.token_env().encode("\"").unwrap()[0];
    m1.commit(quote).unwrap();
    assert_eq!(m1.committed_len(), 1);
    assert_eq!(m2.committed_len(), 0);
    assert_eq!(m2.validate_tokens(&[quote, quote, IM_END]), 3);
    assert_eq!(m1.validate_tokens(&[quote, IM_END]), 2);

    // Other options, another entry; options do not split regex entries.
    let g3 = c
        .compile(
            &schema,
            &GrammarOptions {
                max_whitespace: None,
                ..GrammarOptions::default()
            },
        )
        .unwrap();
    assert!(!Arc::ptr_eq(&g1, &g3));
    assert_eq!(c.compilations(), 2);
    let rx = GrammarSpec::Regex("a+".into());
    let r1 = c.compile(&rx, &opts()).unwrap();
    let r2 = c
        .compile(
            &rx,
            &GrammarOptions {
                max_whitespace: Some(2),
                ..GrammarOptions::default()
            },
        )
        .unwrap();
    assert!(Arc::ptr_eq(&r1, &r2));
    assert_eq!(c.compilations(), 3);

    // A failure is cached too.
    let bad = GrammarSpec::JsonSchema(r#"{"type": "foo"}"#.into());
    assert_eq!(
        c.compile(&bad, &opts()).unwrap_err(),
        c.compile(&bad, &opts()).unwrap_err()
    );
    assert_eq!(c.compilations(), 4);
    assert_eq!(c.cached_grammars(), 4);

    // Eight threads asking for one new grammar at once compile it once.
    let new = GrammarSpec::JsonSchema(r#"{"type": "array", "items": {"type": "integer"}}"#.into());
    let grammars: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| s.spawn(|| c.compile(&new, &opts()).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(grammars.iter().all(|g| Arc::ptr_eq(g, &grammars[0])));
    assert_eq!(c.compilations(), 5);

    c.clear_cache();
    assert_eq!(c.cached_grammars(), 0);
    let g4 = c.compile(&schema, &opts()).unwrap();
    assert!(!Arc::ptr_eq(&g1, &g4));
    assert_eq!(c.compilations(), 6);
}

#[test]
fn the_cache_drops_the_least_recently_used_grammar_beyond_its_capacity() {
    let c = GrammarCompiler::with_capacity(minimind_env(), 2).unwrap();
    let spec = |s: &str| GrammarSpec::Regex(s.into());
    let a = c.compile(&spec("a"), &opts()).unwrap();
    c.compile(&spec("b"), &opts()).unwrap();
    c.compile(&spec("a"), &opts()).unwrap(); // a is now the most recent
    c.compile(&spec("c"), &opts()).unwrap(); // drops b
    assert_eq!((c.cached_grammars(), c.compilations()), (2, 3));
    assert!(Arc::ptr_eq(&a, &c.compile(&spec("a"), &opts()).unwrap()));
    assert_eq!(c.compilations(), 3);
    c.compile(&spec("b"), &opts()).unwrap();
    assert_eq!(c.compilations(), 4);
}

#[test]
fn batch_fills_equal_single_fills_and_errors_stay_per_row() {
    let c = minimind_compiler();
    let env = c.token_env().clone();
    let schema = GrammarSpec::JsonSchema(
        r#"{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}"#.into(),
    );
    let text = env.encode(r#"{"name": "Bob", "age": 42}"#).unwrap();
    let mut matchers: Vec<GrammarMatcher> = (0..5)
        .map(|_| c.matcher(&schema, &opts()).unwrap())
        .collect();
    for (i, m) in matchers.iter_mut().enumerate() {
        for &t in &text[..i * text.len() / 5] {
            m.commit(t).unwrap();
        }
    }
    let words = env.bitmask_words();
    let mut singles = vec![0u32; 5 * words];
    for (m, row) in matchers.iter_mut().zip(singles.chunks_mut(words)) {
        m.fill_bitmask(row).unwrap();
    }
    let mut batch = vec![u32::MAX; 5 * words];
    let mut refs: Vec<&mut GrammarMatcher> = matchers.iter_mut().collect();
    let results = fill_bitmasks(&mut refs, &mut batch, words);
    assert!(results.iter().all(Result::is_ok));
    assert_eq!(batch, singles);
    assert_ne!(batch[..words], batch[words..2 * words]);

    // One row too short for the vocabulary: that row alone fails.
    let mut short = vec![0u32; 5 * 10];
    let results = fill_bitmasks(&mut refs, &mut short, 10);
    assert!(results
        .iter()
        .all(|r| matches!(r, Err(GrammarError::BitmaskTooShort { len: 10, .. }))));
    // A bitmask of the wrong shape: every row gets the error, nothing is written.
    let mut odd = vec![7u32; 5 * words - 1];
    let results = fill_bitmasks(&mut refs, &mut odd, words);
    assert_eq!(results.len(), 5);
    assert!(results.iter().all(|r| *r
        == Err(GrammarError::BitmaskShape {
            len: 5 * words - 1,
            rows: 5,
            row_words: words
        })));
    assert!(odd.iter().all(|&w| w == 7));
}

#[test]
fn a_grammar_the_vocabulary_cannot_spell_is_an_error_not_a_panic() {
    // Only the bytes a and b, plus EOS.
    let env = TokenEnv::from_token_bytes(
        vec![b"a".to_vec(), b"b".to_vec(), b"\xFF</s>".to_vec()],
        &[2],
        3,
    )
    .unwrap();
    let c = GrammarCompiler::new(env).unwrap();
    // No token can begin `c`: found when compiling (the grammar's first mask).
    match c.matcher(&GrammarSpec::Regex("c".into()), &opts()) {
        Err(GrammarError::Compile { message, .. }) => {
            assert!(
                message.starts_with("the grammar matches no text"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    // `ac|b` compiles (`b` can be spelt); after `a` the vocabulary is stuck: a matcher error.
    let mut m = c
        .matcher(&GrammarSpec::Regex("ac|b".into()), &opts())
        .unwrap();
    let mut row = vec![u32::MAX; 1];
    m.fill_bitmask(&mut row).unwrap();
    assert_eq!(row, [0b011]);
    m.commit(0).unwrap();
    let e = m.fill_bitmask(&mut row).unwrap_err();
    assert!(matches!(e, GrammarError::Matcher(_)), "{e}");
    assert_eq!(row, [0]);
    assert!(m.error().is_some() && m.is_ended() && !m.may_end());
    assert!(matches!(m.commit(0), Err(GrammarError::Matcher(_))));
    assert!(matches!(m.rollback(0), Ok(())));
    assert_eq!(m.validate_tokens(&[0]), 0);
    // Other grammars of the same compiler are unaffected.
    let mut other = c
        .matcher(&GrammarSpec::Regex("a|c".into()), &opts())
        .unwrap();
    other.fill_bitmask(&mut row).unwrap();
    assert_eq!(row, [0b001]);
}

#[test]
fn token_environment_errors_are_typed() {
    let tok = minimind_tokenizer();
    assert_eq!(
        TokenEnv::from_tokenizer(&tok, &MINIMIND_EOS, 6399).unwrap_err(),
        GrammarError::VocabTooSmall {
            vocab_size: 6399,
            tokenizer_vocab: 6400,
            max: nucleus_grammar::MAX_VOCAB_SIZE
        }
    );
    assert_eq!(
        TokenEnv::from_tokenizer(&tok, &[], 6400).unwrap_err(),
        GrammarError::NoEosToken
    );
    assert_eq!(
        TokenEnv::from_tokenizer(&tok, &[2, 6400], 6400).unwrap_err(),
        GrammarError::TokenOutOfRange {
            token: 6400,
            vocab_size: 6400
        }
    );
    // Tokens longer than the trie can hold: refused, never a panic; 1,024 bytes is fine.
    let eos = b"\xFF</s>".to_vec();
    let ok = TokenEnv::from_token_bytes(vec![vec![b'x'; 1024], eos.clone()], &[1], 2).unwrap();
    assert_eq!(ok.token_bytes(0).map(<[u8]>::len), Some(1024));
    assert_eq!(
        TokenEnv::from_token_bytes(vec![b"a".to_vec(), vec![b' '; 1025], eos], &[2], 3)
            .unwrap_err(),
        GrammarError::TokenTooLong {
            token: 1,
            len: 1025,
            max: 1024
        }
    );
}

/// A minimal tokenizer.json with the given decoder and vocabulary (a WordLevel model).
fn tiny_tokenizer(decoder: &str, vocab: &[&str]) -> tokenizers::Tokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, p)| (p.to_string(), i.into()))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null,
        "decoder": serde_json::from_str::<serde_json::Value>(decoder).unwrap(),
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    json.to_string().parse().unwrap()
}

#[test]
fn tokenizers_whose_bytes_are_unknown_are_refused_with_a_message() {
    let metaspace = tiny_tokenizer(
        r#"{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}"#,
        &["<unk>", "a"],
    );
    let e = TokenEnv::from_tokenizer(&metaspace, &[0], 2).unwrap_err();
    assert!(
        matches!(&e, GrammarError::Tokenizer(m) if m.contains("can't determine decoder type")),
        "{e}"
    );

    let fallback = r#"{"type": "Sequence", "decoders": [{"type": "ByteFallback"}]}"#;
    let bad_byte = tiny_tokenizer(fallback, &["<unk>", "<0xZZ>"]);
    let e = TokenEnv::from_tokenizer(&bad_byte, &[0], 2).unwrap_err();
    assert_eq!(
        e,
        GrammarError::Tokenizer(
            "byte-fallback piece \"<0xZZ>\" is not of the form <0xHH>".to_string()
        )
    );
    let good = tiny_tokenizer(fallback, &["<unk>", "<0x41>", "b"]);
    let env = TokenEnv::from_tokenizer(&good, &[0], 3).unwrap();
    assert_eq!(env.token_bytes(1), Some(&b"A"[..]));
}

#[test]
fn text_is_encoded_without_a_dummy_prefix() {
    // MiniMind: byte-level BPE, "yes" is y + es, " yes" is Ġy + es.
    let tok = minimind_tokenizer();
    let env = minimind_env();
    let ids = env.encode("yes").unwrap();
    assert_eq!(ids, [124, 329]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "yes");
    let ids = env.encode(" yes").unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), " yes");
    // Text spelling a special token is text: ordinary pieces, never the special token, whose
    // bytes no grammar can produce.
    let ids = env.encode("<|im_end|>").unwrap();
    assert!(!ids.contains(&IM_END) && ids.len() > 1, "{ids:?}");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_end|>");

    // SentencePiece (GGUF): the normalizer prepends ▁.
    let (tok, eos, vocab) = stories_tokenizer();
    let env = TokenEnv::from_tokenizer(&tok, &[eos], vocab).unwrap();
    let piece = |ids: &[u32]| {
        ids.iter()
            .map(|&t| tok.id_to_token(t).unwrap())
            .collect::<String>()
    };
    let hf = tok.encode("Once upon", false).unwrap();
    assert_eq!(piece(hf.get_ids()), "▁Once▁upon");
    let ids = env.encode("Once upon").unwrap();
    assert!(!piece(&ids).starts_with('▁'), "{}", piece(&ids));
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&t| env.token_bytes(t).unwrap().to_vec())
        .collect();
    assert_eq!(bytes, b"Once upon");
    assert_eq!(piece(&env.encode(" Once").unwrap()), "▁Once");
    assert_eq!(env.token_text(eos), "</s>");
    assert_eq!(env.token_bytes(eos), Some(&b"\xFF</s>"[..]));
}

#[test]
fn json_properties_are_accepted_in_the_schema_s_order_only() {
    // llguidance's rule (documented in the crate docs): JSON Schema does not order
    // properties, llguidance generates and accepts them in the schema's order.
    let c = minimind_compiler();
    let schema = GrammarSpec::JsonSchema(
        r#"{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}"#
            .into(),
    );
    let v = |text: &str| validate_text(&c, &schema, &opts(), text).unwrap();
    assert!(v(r#"{"a": 1, "b": 2}"#).is_accepted());
    assert!(matches!(
        v(r#"{"b": 2, "a": 1}"#),
        Validation::Rejected { .. }
    ));
}

/// Walks the grammar as generation does: fill the mask, commit its lowest allowed non-EOS
/// token, until the grammar may end. Every allowed token must commit.
fn generate_lowest(compiler: &GrammarCompiler, spec: &GrammarSpec, steps: usize) -> Vec<u32> {
    let mut m = compiler.matcher(spec, &opts()).unwrap();
    let env = compiler.token_env().clone();
    let mut row = vec![0u32; env.bitmask_words()];
    let mut out = Vec::new();
    for _ in 0..steps {
        if m.may_end() {
            return out;
        }
        m.fill_bitmask(&mut row).unwrap();
        let t = allowed_ids(&row)
            .into_iter()
            .find(|&t| !env.is_eos(t))
            .expect("a non-EOS token is allowed before the grammar may end");
        m.commit(t)
            .unwrap_or_else(|e| panic!("the mask allowed {t}, commit said {e}"));
        out.push(t);
    }
    panic!("the grammar did not end in {steps} steps");
}

/// Forced text that spells a special token (a regex literal, a JSON key) is produced as text:
/// the mask never offers the special token, which commit would reject.
#[test]
fn forced_text_spelling_a_special_token_is_written_as_text() {
    let compiler = minimind_compiler();
    let tok = minimind_tokenizer();
    for (spec, want) in [
        (GrammarSpec::Regex(r"<\|im_end\|>".into()), "<|im_end|>".to_string()),
        (
            GrammarSpec::JsonSchema(
                r#"{"type":"object","properties":{"<|im_start|>":{"const":1}},"required":["<|im_start|>"],"additionalProperties":false}"#
                    .into(),
            ),
            r#"{"<|im_start|>":1}"#.to_string(),
        ),
    ] {
        let ids = generate_lowest(&compiler, &spec, 200);
        assert!(!ids.contains(&IM_END) && !ids.contains(&1), "{ids:?}");
        let text = tok.decode(&ids, false).unwrap();
        let compact: String = text.split_whitespace().collect();
        assert_eq!(compact, want);
        assert!(validate_text(&compiler, &spec, &opts(), &want)
            .unwrap()
            .is_accepted());
    }
}

/// llguidance hitting one of its limits is an error, never a "rejected" verdict, and its
/// message is one line (no parser state dump).
#[test]
fn a_grammar_engine_limit_is_an_error_not_a_verdict() {
    let compiler = minimind_compiler();
    // llguidance's lexer runs out of states on the first `a` of `a{300000}`: found when
    // compiling (the grammar's first step), so never a verdict on the text.
    let spec = GrammarSpec::Regex("a{300000}".into());
    match validate_text(&compiler, &spec, &opts(), &"a".repeat(300_000)) {
        Err(GrammarError::Compile { message, .. }) => {
            assert!(
                !message.contains('\n') && !message.contains("<state>"),
                "{message}"
            );
            assert!(
                message.starts_with("the grammar is too large for llguidance's lexer"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    // A Lark grammar whose rules only lead to each other matches nothing.
    let unsatisfiable = GrammarSpec::Lark("start: a\na: b\nb: a\n".into());
    match compiler.matcher(&unsatisfiable, &opts()) {
        Err(GrammarError::Compile { message, .. }) => {
            assert!(
                message.starts_with("the grammar matches no text"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
}

/// A byte token of a multi-byte character is shown as the byte it holds, `<0xE7>`, not as
/// U+FFFD: `猫` is E7 8C AB, three byte tokens in stories260K's SentencePiece vocabulary.
#[test]
fn a_rejected_byte_token_is_shown_as_its_byte() {
    let (tok, eos, vocab) = stories_tokenizer();
    let env = TokenEnv::from_tokenizer(&tok, &[eos], vocab).unwrap();
    let compiler = GrammarCompiler::new(env).unwrap();
    let verdict = validate_text(&compiler, &GrammarSpec::Regex("x".into()), &opts(), "猫").unwrap();
    let Validation::Rejected { index, text, .. } = &verdict else {
        panic!("{verdict:?}")
    };
    assert_eq!((*index, text.as_str()), (0, "<0xE7>"));
    assert!(
        verdict.to_string().ends_with("text \"<0xE7>\")"),
        "{verdict}"
    );
    // Whole characters and ASCII are themselves.
    let verdict = validate_text(&compiler, &GrammarSpec::Regex("x".into()), &opts(), "a").unwrap();
    assert!(
        matches!(&verdict, Validation::Rejected { text, .. } if text == "a"),
        "{verdict:?}"
    );
}

/// README's "Known limits": an object with more than 500 optional properties fails as soon as a
/// property name starts, in validation as in generation (llguidance's Earley row limit of
/// 2,000 items, four per optional property); 500 work.
#[test]
fn more_than_500_optional_properties_fail_when_a_name_starts() {
    let compiler = minimind_compiler();
    let object = |n: usize| {
        let props: serde_json::Map<String, serde_json::Value> = (0..n)
            .map(|i| (format!("p{i}"), serde_json::json!({"type": "integer"})))
            .collect();
        let schema = serde_json::json!({"type": "object", "properties": props, "additionalProperties": false});
        GrammarSpec::JsonSchema(schema.to_string())
    };
    let verdict = validate_text(&compiler, &object(500), &opts(), r#"{"p1": 1}"#).unwrap();
    assert!(verdict.is_accepted(), "{verdict}");
    match validate_text(&compiler, &object(501), &opts(), r#"{"p1": 1}"#) {
        Err(GrammarError::Matcher(message)) => {
            assert!(
                message.contains("Current row has 2003 items; max is 2000"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    // Compiling (and the first step) still works: the limit is met inside the object.
    assert!(compiler.compile(&object(600), &opts()).is_ok());
}

/// A tokenizer.json of 380 KB naming one id 1,000,000,000 made serialising it (to read its
/// token bytes) allocate 4 GB; it is refused first, with a message that says which rule it
/// breaks, and so is a vocabulary size out of range.
#[test]
fn a_tokenizer_with_an_id_past_the_trie_is_refused_before_it_is_serialised() {
    let path = shared("models/minimind-tokenizer/tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    let (piece, _) = vocab
        .iter()
        .nth(300)
        .map(|(k, v)| (k.clone(), v.clone()))
        .unwrap();
    vocab.insert(piece, serde_json::json!(1_000_000_000u64));
    let sparse: tokenizers::Tokenizer = json.to_string().parse().unwrap();
    let started = std::time::Instant::now();
    let e = TokenEnv::from_tokenizer(&sparse, &MINIMIND_EOS, 6400).unwrap_err();
    assert!(started.elapsed().as_secs() < 5, "{:?}", started.elapsed());
    assert_eq!(
        e.to_string(),
        "the tokenizer's ids go up to 1000000000: the grammar engine takes at most 2097152 ids"
    );
    let tok = minimind_tokenizer();
    let e = TokenEnv::from_tokenizer(&tok, &MINIMIND_EOS, 100).unwrap_err();
    assert_eq!(
        e.to_string(),
        "vocabulary size 100 is smaller than the tokenizer's 6400 ids (its largest id + 1)"
    );
    let e = TokenEnv::from_tokenizer(&tok, &MINIMIND_EOS, 3_000_000).unwrap_err();
    assert_eq!(
        e.to_string(),
        "vocabulary size 3000000 is more than the 2097152 ids the grammar engine takes"
    );
}
