//! Seed 001 §05's example: a grammar whose only strings are "yes" and "no". The first mask
//! allows exactly the tokens whose bytes start one of the words ("y", "ye", "yes", "n", "no"),
//! after "y" exactly those that continue it ("e", "es"; with llguidance's canonical forcing,
//! only the canonical "es"), after a whole word only EOS; rollback
//! restores earlier masks; "yes!" is rejected. Run with MiniMind's byte-level BPE and with the
//! SentencePiece tokenizer of the stories260K GGUF file.

mod common;

use common::*;
use nucleus_grammar::{
    validate_text, GrammarCompiler, GrammarError, GrammarOptions, GrammarSpec, TokenEnv, Validation,
};

/// The ids whose bytes, by the oracle `bytes_of`, are one of `words`.
fn ids_spelling(
    vocab: usize,
    bytes_of: &dyn Fn(u32) -> Option<Vec<u8>>,
    words: &[&str],
) -> Vec<u32> {
    (0..vocab as u32)
        .filter(|&t| bytes_of(t).is_some_and(|b| words.iter().any(|w| w.as_bytes() == b)))
        .collect()
}

fn run_yes_no(env: TokenEnv, bytes_of: &dyn Fn(u32) -> Option<Vec<u8>>, eos: &[u32]) {
    let vocab = env.vocab_size();
    let compiler = GrammarCompiler::new(env.clone()).unwrap();
    // The same language three ways; each gives the same masks.
    let specs = [
        GrammarSpec::Regex("yes|no".into()),
        GrammarSpec::Lark("start: \"yes\" | \"no\"".into()),
        GrammarSpec::JsonSchema(r#"{"const": "yes"}"#.into()), // only for the rejection below
    ];
    let start = ids_spelling(vocab, bytes_of, &["y", "ye", "yes", "n", "no"]);
    let after_y = ids_spelling(vocab, bytes_of, &["e", "es"]);
    let y = ids_spelling(vocab, bytes_of, &["y"])[0];
    let e = ids_spelling(vocab, bytes_of, &["e"])[0];
    let s = ids_spelling(vocab, bytes_of, &["s"])[0];
    let bang = ids_spelling(vocab, bytes_of, &["!"])[0];
    assert!(start.contains(&y) && !start.contains(&e), "{start:?}");

    // With canonical forcing (the default), "es" is forced after "y" and llguidance allows
    // only its canonical first token: the piece "es" where the vocabulary has one.
    let es = ids_spelling(vocab, bytes_of, &["es"]);
    let forced_after_y = if es.is_empty() { vec![e] } else { es };
    assert!(env.canonical_forcing());
    let exact = GrammarCompiler::new(env.with_canonical_forcing(false)).unwrap();

    for spec in &specs[..2] {
        // Forcing off: every mask is exactly the legal set, token by token.
        let mut m = exact.matcher(spec, &GrammarOptions::default()).unwrap();
        let mut row = vec![0u32; env.bitmask_words()];
        for (prefix, expected) in [(&[][..], &start), (&[y][..], &after_y)] {
            for &t in prefix {
                m.commit(t).unwrap();
            }
            m.fill_bitmask(&mut row).unwrap();
            assert_eq!(&allowed_ids(&row), expected, "{spec:?} without forcing");
            for t in 0..vocab as u32 {
                assert_eq!(allowed(&row, t), m.validate_tokens(&[t]) == 1, "token {t}");
            }
        }

        let mut m = compiler.matcher(spec, &GrammarOptions::default()).unwrap();
        m.fill_bitmask(&mut row).unwrap();
        assert_eq!(allowed_ids(&row), start, "{spec:?}: first mask");
        assert!(!m.may_end() && !m.is_ended());

        m.commit(y).unwrap();
        m.fill_bitmask(&mut row).unwrap();
        assert_eq!(allowed_ids(&row), forced_after_y, "{spec:?}: after y");
        // Validation is by bytes: both continuations are legal.
        for &t in &after_y {
            assert_eq!(m.validate_tokens(&[t]), 1);
        }

        // A rejected token names itself and changes nothing.
        let err = m.commit(s).unwrap_err();
        assert_eq!(
            err,
            GrammarError::TokenRejected {
                token: s,
                text: "s".into()
            }
        );
        m.fill_bitmask(&mut row).unwrap();
        assert_eq!(
            allowed_ids(&row),
            forced_after_y,
            "{spec:?}: after a rejected token"
        );

        m.commit(e).unwrap();
        m.commit(s).unwrap();
        assert!(
            m.may_end() && m.is_ended(),
            "yes is complete and cannot grow"
        );
        m.fill_bitmask(&mut row).unwrap();
        let mut eos_sorted = eos.to_vec();
        eos_sorted.sort();
        assert_eq!(
            allowed_ids(&row),
            eos_sorted,
            "{spec:?}: only EOS after yes"
        );
        assert_eq!(m.validate_tokens(&[bang]), 0);
        assert!(
            matches!(m.commit(bang), Err(GrammarError::TokenRejected { token, .. }) if token == bang)
        );
        assert_eq!(m.validate_tokens(&[eos[0], y]), 1, "EOS, then nothing");

        // Rollback restores the earlier masks.
        m.rollback(2).unwrap();
        m.fill_bitmask(&mut row).unwrap();
        assert_eq!(
            allowed_ids(&row),
            forced_after_y,
            "{spec:?}: rolled back to y"
        );
        m.rollback(1).unwrap();
        m.fill_bitmask(&mut row).unwrap();
        assert_eq!(
            allowed_ids(&row),
            start,
            "{spec:?}: rolled back to the start"
        );
        assert_eq!(
            m.rollback(1),
            Err(GrammarError::RollbackTooFar {
                requested: 1,
                committed: 0
            })
        );

        // yes + EOS ends the matcher; nothing is allowed after it.
        for t in [y, e, s, eos[0]] {
            m.commit(t).unwrap();
        }
        assert!(m.is_ended());
        m.fill_bitmask(&mut row).unwrap();
        assert_eq!(allowed_ids(&row), Vec::<u32>::new());
        assert_eq!(m.commit(eos[0]), Err(GrammarError::Ended));

        // Whole texts.
        let v =
            |text: &str| validate_text(&compiler, spec, &GrammarOptions::default(), text).unwrap();
        assert!(v("yes").is_accepted());
        assert!(v("no").is_accepted());
        assert_eq!(
            v("ye"),
            Validation::Incomplete {
                tokens: env.encode("ye").unwrap().len()
            }
        );
        match v("yes!") {
            Validation::Rejected { index, token, text } => {
                let tokens = env.encode("yes!").unwrap();
                assert_eq!(tokens[index], token);
                assert!(text.contains('!'), "{text:?}");
                // Every token before it is inside "yes".
                let before: Vec<u8> = tokens[..index]
                    .iter()
                    .flat_map(|&t| bytes_of(t).unwrap())
                    .collect();
                assert!(b"yes".starts_with(&before), "{before:?}");
            }
            other => panic!("yes! must be rejected, got {other:?}"),
        }
    }
    // "yes" is not JSON: the JSON string "\"yes\"" is.
    assert!(matches!(
        validate_text(&compiler, &specs[2], &GrammarOptions::default(), "yes").unwrap(),
        Validation::Rejected { index: 0, .. }
    ));
    assert!(
        validate_text(&compiler, &specs[2], &GrammarOptions::default(), "\"yes\"")
            .unwrap()
            .is_accepted()
    );
}

#[test]
fn yes_no_with_minimind_byte_level_bpe() {
    let tokenizer = minimind_tokenizer();
    // Oracle: the byte-level decoder applied to one token (special tokens are not words).
    let bytes_of = |t: u32| -> Option<Vec<u8>> {
        let piece = tokenizer.id_to_token(t)?;
        if piece.starts_with("<|") {
            return None;
        }
        Some(tokenizer.decode(&[t], false).ok()?.into_bytes())
    };
    run_yes_no(minimind_env(), &bytes_of, &MINIMIND_EOS);
}

#[test]
fn yes_no_with_stories260k_sentencepiece() {
    let (tokenizer, eos, vocab) = stories_tokenizer();
    assert_eq!((eos, vocab), (2, 512));
    // Oracle: SentencePiece pieces, ▁ is a space, <0xHH> is one byte, control pieces are not
    // text.
    let bytes_of = |t: u32| -> Option<Vec<u8>> {
        let piece = tokenizer.id_to_token(t)?;
        if matches!(piece.as_str(), "<s>" | "</s>" | "<unk>") {
            return None;
        }
        if piece.len() == 6 && piece.starts_with("<0x") {
            return Some(vec![u8::from_str_radix(&piece[3..5], 16).unwrap()]);
        }
        Some(piece.replace('\u{2581}', " ").into_bytes())
    };
    let env = TokenEnv::from_tokenizer(&tokenizer, &[eos], vocab).unwrap();
    // No dummy prefix: "yes" is encoded without a leading space.
    let ids = env.encode("yes").unwrap();
    let text: Vec<u8> = ids.iter().flat_map(|&t| bytes_of(t).unwrap()).collect();
    assert_eq!(text, b"yes");
    run_yes_no(env, &bytes_of, &[eos]);
}
