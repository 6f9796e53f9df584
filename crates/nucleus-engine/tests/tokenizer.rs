//! The GGUF tokenizers: stories260K's SentencePiece BPE (ids as Hugging Face's
//! `LlamaTokenizerFast` gives them, byte fallback, the dummy prefix), and synthetic metadata for
//! long pieces, gpt2-kind files and malformed metadata.

mod common;

use std::collections::HashMap;

use anyhow::Result;
use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};
use candle_core::Device;
use nucleus_engine::{load_gguf, EngineError, ModelTokenizer, TokenizerKind};

fn stories_tokenizer() -> Result<Option<ModelTokenizer>> {
    let path = common::stories260k();
    Ok(Some(load_gguf(&path, &Device::Cpu)?.tokenizer))
}

fn encode(tok: &ModelTokenizer, text: &str, special: bool) -> Result<Vec<u32>> {
    Ok(tok
        .tokenizer
        .encode(text, special)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec())
}

fn decode(tok: &ModelTokenizer, ids: &[u32]) -> Result<String> {
    tok.tokenizer.decode(ids, true).map_err(anyhow::Error::msg)
}

#[test]
fn once_upon_a_time_encodes_like_hugging_face() -> Result<()> {
    let Some(tok) = stories_tokenizer()? else {
        return Ok(());
    };
    assert_eq!(tok.kind, TokenizerKind::Llama);
    assert_eq!(
        (tok.bos_token_id, tok.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    let ids = encode(&tok, "Once upon a time", true)?;
    assert_eq!(ids, [1, 403, 407, 261, 378]);
    assert_eq!(
        encode(&tok, "Once upon a time", false)?,
        [403, 407, 261, 378]
    );
    // The dummy prefix's space is stripped, BOS is skipped.
    assert_eq!(decode(&tok, &ids)?, "Once upon a time");
    Ok(())
}

#[test]
fn empty_text_is_just_bos() -> Result<()> {
    let Some(tok) = stories_tokenizer()? else {
        return Ok(());
    };
    assert_eq!(encode(&tok, "", true)?, [1]);
    assert_eq!(encode(&tok, "", false)?, Vec::<u32>::new());
    assert_eq!(decode(&tok, &[1])?, "");
    Ok(())
}

#[test]
fn characters_outside_the_pieces_round_trip_through_byte_fallback() -> Result<()> {
    let Some(tok) = stories_tokenizer()? else {
        return Ok(());
    };
    for text in [
        "héllo 世界 🦀",
        "tabs\tand\nnewlines\r\n",
        "  two leading spaces, two trailing  ",
        "ünïcödé — «quotes» ½ ∑",
    ] {
        let ids = encode(&tok, text, true)?;
        assert_eq!(ids[0], 1);
        assert_eq!(decode(&tok, &ids)?, text, "ids {ids:?}");
    }
    // "世" is not a piece: it becomes its three UTF-8 bytes, pieces <0xE4> <0xB8> <0x96>
    // (ids 3 + byte).
    let ids = encode(&tok, "世", false)?;
    assert!(ids.ends_with(&[3 + 0xE4, 3 + 0xB8, 3 + 0x96]), "{ids:?}");
    Ok(())
}

#[test]
fn control_tokens_are_special() -> Result<()> {
    let Some(tok) = stories_tokenizer()? else {
        return Ok(());
    };
    // Skipped when decoding with skip_special_tokens, kept without.
    assert_eq!(decode(&tok, &[1, 403, 2])?, "Once");
    let kept = tok
        .tokenizer
        .decode(&[1, 403, 2], false)
        .map_err(anyhow::Error::msg)?;
    assert!(kept.contains("<s>") && kept.contains("</s>"), "{kept}");
    Ok(())
}

// ---- synthetic metadata ----

fn content(entries: Vec<(&str, Value)>) -> Content {
    Content {
        magic: VersionedMagic::GgufV3,
        metadata: entries
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect::<HashMap<_, _>>(),
        tensor_infos: HashMap::new(),
        tensor_data_offset: 0,
    }
}

fn strings(v: &[String]) -> Value {
    Value::Array(v.iter().map(|s| Value::String(s.clone())).collect())
}

/// A llama-kind vocabulary: <unk> <s> </s>, the 256 byte pieces, "▁", then "a" repeated
/// 1, 2, 4, …, 2048 times (the last ones longer than 1,024 bytes), longer pieces scoring lower.
fn long_piece_metadata() -> Vec<(&'static str, Value)> {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    tokens.push("\u{2581}".into());
    let mut scores = vec![0f32; tokens.len()];
    let mut types = vec![2i32, 3, 3];
    types.extend(std::iter::repeat_n(6, 256));
    types.push(1);
    for k in 0..=11 {
        tokens.push("a".repeat(1 << k));
        scores.push(-(k as f32));
        types.push(1);
    }
    vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&tokens)),
        (
            "tokenizer.ggml.scores",
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ("tokenizer.ggml.padding_token_id", Value::I32(-1)),
    ]
}

#[test]
fn pieces_longer_than_1024_bytes_do_not_panic() -> Result<()> {
    let tok = ModelTokenizer::from_gguf(&content(long_piece_metadata()))?;
    let longest = 259 + 1 + 11; // "a" * 2048
    let text = "a".repeat(2048 + 3);
    let ids = encode(&tok, &text, true)?;
    // BOS, "▁", then the longest piece, then "aa" and "a".
    assert_eq!(ids, [1, 259, longest, 261, 260]);
    assert_eq!(decode(&tok, &ids)?, text);
    Ok(())
}

#[test]
fn add_bos_false_and_no_space_prefix_are_honoured() -> Result<()> {
    let mut md = long_piece_metadata();
    md.push(("tokenizer.ggml.add_bos_token", Value::Bool(false)));
    md.push(("tokenizer.ggml.add_space_prefix", Value::Bool(false)));
    let tok = ModelTokenizer::from_gguf(&content(md))?;
    assert_eq!(encode(&tok, "aaa", true)?, [261, 260]);
    assert_eq!(encode(&tok, "a a", true)?, [260, 259, 260]);
    assert_eq!(decode(&tok, &[260, 259, 260])?, "a a");
    Ok(())
}

#[test]
fn negative_special_ids_mean_none() -> Result<()> {
    let mut md = long_piece_metadata();
    md.retain(|(k, _)| *k != "tokenizer.ggml.bos_token_id");
    md.push(("tokenizer.ggml.bos_token_id", Value::I32(-1)));
    let tok = ModelTokenizer::from_gguf(&content(md))?;
    assert_eq!(tok.bos_token_id, None);
    // No BOS id: nothing is prepended.
    assert_eq!(encode(&tok, "a", true)?, [259, 260]);
    Ok(())
}

/// An edit of synthetic metadata.
type Edit = Box<dyn Fn(&mut Vec<(&'static str, Value)>)>;

#[test]
fn malformed_metadata_is_an_error() {
    let cases: Vec<(&str, Edit)> = vec![
        (
            "tokenizer.ggml.tokens",
            Box::new(|md| md.retain(|(k, _)| *k != "tokenizer.ggml.tokens")),
        ),
        (
            "tokenizer.ggml.scores",
            Box::new(|md| {
                md.retain(|(k, _)| *k != "tokenizer.ggml.scores");
                md.push(("tokenizer.ggml.scores", Value::Array(vec![Value::F32(0.0)])));
            }),
        ),
        (
            "tokenizer.ggml.tokens",
            Box::new(|md| {
                md.retain(|(k, _)| *k != "tokenizer.ggml.tokens");
                md.push(("tokenizer.ggml.tokens", Value::U32(3)));
            }),
        ),
        (
            "tokenizer.ggml.model",
            Box::new(|md| md.retain(|(k, _)| *k != "tokenizer.ggml.model")),
        ),
    ];
    for (key, edit) in cases {
        let mut md = long_piece_metadata();
        edit(&mut md);
        match ModelTokenizer::from_gguf(&content(md)) {
            Err(EngineError::Tokenizer(m)) => assert!(m.contains(key), "{key}: {m}"),
            other => panic!("{key}: expected a Tokenizer error, got {other:?}"),
        }
    }
    let mut md = long_piece_metadata();
    md.retain(|(k, _)| *k != "tokenizer.ggml.model");
    md.push(("tokenizer.ggml.model", Value::String("t5".into())));
    assert!(matches!(
        ModelTokenizer::from_gguf(&content(md)),
        Err(EngineError::Unsupported(m)) if m.contains("t5")
    ));
}

#[test]
fn gpt2_kind_without_pre_is_llama_cpp_default() -> Result<()> {
    // Byte-level BPE: "Ġ" is the byte-level form of a space.
    let tokens: Vec<String> = ["a", "b", "ab", "Ġ", "Ġab", "<|endoftext|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let md = vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", strings(&tokens)),
        (
            "tokenizer.ggml.merges",
            strings(&["a b".to_string(), "Ġ ab".to_string()]),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array([1, 1, 1, 1, 1, 3].into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.eos_token_id", Value::U32(5)),
    ];
    let tok = ModelTokenizer::from_gguf(&content(md))?;
    assert_eq!(tok.kind, TokenizerKind::Gpt2);
    assert_eq!(
        (tok.bos_token_id, tok.eos_token_ids.clone()),
        (None, vec![5])
    );
    let ids = encode(&tok, "ab", false)?;
    assert!(ids == [2] || ids == [4], "{ids:?}");
    assert!(decode(&tok, &ids)?.contains("ab"));
    Ok(())
}
