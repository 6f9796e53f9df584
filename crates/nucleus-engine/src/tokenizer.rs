//! [`GgufTokenizer`]: a Hugging Face `tokenizers::Tokenizer` built from a GGUF file's
//! `tokenizer.ggml.*` metadata.
//!
//! Two kinds of GGUF tokenizer are supported ([`TokenizerKind`]):
//!
//! - `tokenizer.ggml.model = "llama"`: SentencePiece BPE (Llama 1/2, Mistral, TinyStories…).
//!   The file holds the pieces, their scores and types but no merges. We build the tokenizer the
//!   way Hugging Face's converter does (transformers `convert_slow_tokenizer.py`, `LlamaConverter`
//!   with `SentencePieceExtractor` / `generate_merges`), so ids and decoded text match
//!   `LlamaTokenizerFast`:
//!   - model: BPE with vocabulary piece → id and merges derived from the scores: every split
//!     of a piece into two pieces (at a character boundary) is a merge, ordered by the merged
//!     piece's score descending, then by the left and the right part's length descending, ties
//!     in id order; `byte_fallback = true` (characters outside the pieces become `<0xNN>` byte
//!     pieces), `unk` = the unknown piece, `fuse_unk = true`;
//!   - normalizer: `Prepend("▁")` (the SentencePiece dummy prefix, unless
//!     `tokenizer.ggml.add_space_prefix` is false) then `Replace(" ", "▁")`; no pre-tokenizer;
//!   - decoder: `Replace("▁", " ")`, `ByteFallback`, `Fuse`, `Strip(' ', 1, 0)` (the last one
//!     removes the dummy prefix's space, only with the prefix) — Hugging Face's Llama decoder, not
//!     `Metaspace`;
//!   - post-processor: `TemplateProcessing` adding BOS (`<s> $A`) when
//!     `tokenizer.ggml.add_bos_token` is absent or true, and EOS when
//!     `tokenizer.ggml.add_eos_token` is true;
//!   - added tokens: control pieces (`token_type` 3) and the unknown/BOS/EOS pieces as special
//!     tokens (so `decode(.., skip_special_tokens = true)` drops them), user-defined pieces
//!     (`token_type` 4) as non-special added tokens. As in Hugging Face, the text of an added
//!     token inside the input (e.g. a literal `"<s>"`) encodes to that token.
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE with merges (Llama 3, Qwen2…), built by
//!   candle's `TokenizerFromGguf`.
//!
//! Any other kind is [`EngineError::Unsupported`].
//!
//! Long pieces are fine here (no fixed-size buffers); note for consumers that some (llguidance)
//! reject pieces longer than 1,024 bytes.

use std::collections::BTreeSet;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace, Sequence as NormSequence};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::candle_message;
use crate::error::{EngineError, Result};
use crate::load::{md_array, md_bool, md_str, value_to_u64};

/// The SentencePiece word-boundary marker, U+2581.
const SPIECE_UNDERLINE: &str = "\u{2581}";

/// `token_type` values of llama.cpp's `llama_token_type`.
const TOKEN_TYPE_UNKNOWN: u64 = 2;
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// Which GGUF tokenizer a [`GgufTokenizer`] was built from (`tokenizer.ggml.model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// `"llama"`: SentencePiece BPE with scores and byte fallback.
    Llama,
    /// `"gpt2"`: byte-level BPE with merges.
    Gpt2,
}

/// A tokenizer read from GGUF metadata, with the ids a generation loop needs.
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    /// The Hugging Face tokenizer (`encode(text, add_special_tokens)`, `decode(ids, skip_special)`).
    pub tokenizer: Tokenizer,
    /// `tokenizer.ggml.bos_token_id`, `None` when absent or not a valid id (e.g. -1).
    pub bos_token_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`, `None` when absent or not a valid id.
    pub eos_token_id: Option<u32>,
    /// The tokenizer kind (`tokenizer.ggml.model`).
    pub kind: TokenizerKind,
}

impl GgufTokenizer {
    /// Builds the tokenizer described by `content`'s `tokenizer.ggml.*` metadata (see the module
    /// docs for what each kind becomes).
    ///
    /// Metadata read: `tokenizer.ggml.model`, `.tokens` (required), `.scores` (llama: one f32
    /// per token, default 0), `.token_type` (one integer per token, default 1 = normal),
    /// `.bos_token_id`, `.eos_token_id`, `.unknown_token_id` (llama: default the piece `<unk>`
    /// if present), `.add_bos_token` (llama: default true), `.add_eos_token` (default false),
    /// `.add_space_prefix` (llama: default true); gpt2 also `.merges`, `.pre`.
    ///
    /// Errors: [`EngineError::Unsupported`] for a kind other than `llama` / `gpt2`;
    /// [`EngineError::Tokenizer`] naming the key for missing or malformed metadata (array
    /// lengths that differ from the token count, wrong types) or a BOS/EOS piece that a
    /// `TemplateProcessing` cannot name (one containing `:`). [`crate::load_gguf`] reports these
    /// as `InvalidModel` with the file's path.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let kind = md_str(content, "tokenizer.ggml.model")
            .map_err(EngineError::Tokenizer)?
            .ok_or_else(|| {
                EngineError::Tokenizer("missing metadata key `tokenizer.ggml.model`".to_string())
            })?;
        match kind {
            "llama" => llama_tokenizer(content),
            "gpt2" => gpt2_tokenizer(content),
            other => Err(EngineError::Unsupported(format!(
                "tokenizer kind `{other}` (tokenizer.ggml.model); supported: llama, gpt2"
            ))),
        }
    }
}

fn tok_err(message: impl Into<String>) -> EngineError {
    EngineError::Tokenizer(message.into())
}

/// The `tokenizer.ggml.tokens` strings.
fn token_strings(content: &gguf_file::Content) -> Result<Vec<String>> {
    let key = "tokenizer.ggml.tokens";
    let values = md_array(content, key)
        .map_err(tok_err)?
        .ok_or_else(|| tok_err(format!("missing metadata key `{key}`")))?;
    if values.is_empty() {
        return Err(tok_err(format!("`{key}` is empty")));
    }
    if u32::try_from(values.len()).is_err() {
        return Err(tok_err(format!("`{key}` has {} entries", values.len())));
    }
    values
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(tok_err(format!(
                "`{key}`[{i}] is a {:?}, expected a string",
                other.value_type()
            ))),
        })
        .collect()
}

/// An optional per-token array of `n` entries converted by `f` (`None` for a bad element).
fn per_token<T>(
    content: &gguf_file::Content,
    key: &str,
    n: usize,
    f: impl Fn(&Value) -> Option<T>,
) -> Result<Option<Vec<T>>> {
    let Some(values) = md_array(content, key).map_err(tok_err)? else {
        return Ok(None);
    };
    if values.len() != n {
        return Err(tok_err(format!(
            "`{key}` has {} entries, `tokenizer.ggml.tokens` has {n}",
            values.len()
        )));
    }
    values
        .iter()
        .enumerate()
        .map(|(i, v)| f(v).ok_or_else(|| tok_err(format!("`{key}`[{i}] is {v:?}"))))
        .collect::<Result<Vec<T>>>()
        .map(Some)
}

/// A special-token id: `None` when the key is absent or the id is out of range (GGUF files use
/// -1 / 0xFFFFFFFF for "none"); an error when it is not an integer.
fn special_id(content: &gguf_file::Content, key: &str, n_tokens: usize) -> Result<Option<u32>> {
    let Some(value) = content.metadata.get(key) else {
        return Ok(None);
    };
    let id = match value {
        Value::I8(_) | Value::I16(_) | Value::I32(_) | Value::I64(_) => value_to_u64(value),
        _ => Some(value_to_u64(value).ok_or_else(|| {
            tok_err(format!(
                "metadata `{key}` is {value:?}, expected an integer"
            ))
        })?),
    };
    Ok(id
        .filter(|&id| id < n_tokens as u64)
        .and_then(|id| u32::try_from(id).ok()))
}

/// SentencePiece BPE merges from piece scores, as Hugging Face's `generate_merges`
/// (transformers `convert_slow_tokenizer.py`) derives them.
///
/// For every piece (in id order; a duplicated piece counts once, at its last id), every split
/// into a non-empty left and right part at a character boundary where both parts are pieces is a
/// merge with the piece's score; a piece's merges are ordered by (left id, right id). All merges
/// are then stably sorted by (score, left length, right length) descending, lengths in
/// characters. Earlier merges apply first. `-0.0` equals `0.0`; NaN scores sort above all others.
/// Cost: one vocabulary lookup per character boundary of every piece, then a sort.
pub(crate) fn spm_merges(
    tokens: &[String],
    scores: &[f32],
    vocab: &Vocab,
) -> Vec<(String, String)> {
    struct Merge<'a> {
        score: f32,
        left_chars: usize,
        right_chars: usize,
        left: &'a str,
        right: &'a str,
    }
    let mut merges: Vec<Merge<'_>> = Vec::new();
    let mut local: Vec<(u32, u32, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if vocab.get(piece).copied() != Some(id as u32) {
            continue;
        }
        local.clear();
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if let (Some(&l), Some(&r)) = (vocab.get(left), vocab.get(right)) {
                local.push((l, r, split));
            }
        }
        local.sort_unstable();
        // `+ 0.0` turns -0.0 into 0.0, so that total_cmp orders them as equal.
        let score = scores.get(id).copied().unwrap_or(0.0) + 0.0;
        for &(_, _, split) in &local {
            let (left, right) = piece.split_at(split);
            merges.push(Merge {
                score,
                left_chars: left.chars().count(),
                right_chars: right.chars().count(),
                left,
                right,
            });
        }
    }
    merges.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(b.left_chars.cmp(&a.left_chars))
            .then(b.right_chars.cmp(&a.right_chars))
    });
    merges
        .into_iter()
        .map(|m| (m.left.to_string(), m.right.to_string()))
        .collect()
}

/// The `tokenizer.ggml.model = "llama"` tokenizer (module docs).
fn llama_tokenizer(content: &gguf_file::Content) -> Result<GgufTokenizer> {
    let tokens = token_strings(content)?;
    let n = tokens.len();
    let scores = per_token(content, "tokenizer.ggml.scores", n, |v| match v {
        Value::F32(s) => Some(*s),
        Value::F64(s) => Some(*s as f32),
        _ => None,
    })?
    .unwrap_or_else(|| vec![0.0; n]);
    let types = per_token(content, "tokenizer.ggml.token_type", n, value_to_u64)?
        .unwrap_or_else(|| vec![1; n]);
    let bos = special_id(content, "tokenizer.ggml.bos_token_id", n)?;
    let eos = special_id(content, "tokenizer.ggml.eos_token_id", n)?;
    let unk = special_id(content, "tokenizer.ggml.unknown_token_id", n)?
        .or_else(|| tokens.iter().position(|t| t == "<unk>").map(|i| i as u32));
    let flag = |key: &str, default: bool| -> Result<bool> {
        Ok(md_bool(content, key).map_err(tok_err)?.unwrap_or(default))
    };
    let add_bos = flag("tokenizer.ggml.add_bos_token", true)?;
    let add_eos = flag("tokenizer.ggml.add_eos_token", false)?;
    let add_space_prefix = flag("tokenizer.ggml.add_space_prefix", true)?;

    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = spm_merges(&tokens, &scores, &vocab);
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(tokens[unk as usize].clone());
    }
    let bpe = builder
        .build()
        .map_err(|e| tok_err(format!("building the BPE model: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);

    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        normalizers.push(Prepend::new(SPIECE_UNDERLINE.to_string()).into());
    }
    normalizers.push(
        Replace::new(" ", SPIECE_UNDERLINE)
            .map_err(|e| tok_err(e.to_string()))?
            .into(),
    );
    tokenizer
        .with_normalizer(Some(NormSequence::new(normalizers)))
        .map_err(|e| tok_err(e.to_string()))?;

    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPIECE_UNDERLINE, " ")
            .map_err(|e| tok_err(e.to_string()))?
            .into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));

    if let Some(template) = bos_eos_template(&tokens, bos, eos, add_bos, add_eos)? {
        tokenizer.with_post_processor(Some(template));
    }

    // Added tokens, in id order, as Hugging Face's SpmConverter adds them.
    let specials: BTreeSet<u32> = [unk, bos, eos].into_iter().flatten().collect();
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter_map(|(id, (token, &ty))| {
            let special = ty == TOKEN_TYPE_CONTROL
                || ty == TOKEN_TYPE_UNKNOWN
                || specials.contains(&(id as u32));
            if special {
                Some(AddedToken::from(token.clone(), true))
            } else if ty == TOKEN_TYPE_USER_DEFINED {
                Some(AddedToken::from(token.clone(), false).normalized(false))
            } else {
                None
            }
        })
        .collect();
    tokenizer
        .add_tokens(added)
        .map_err(|e| tok_err(format!("adding special tokens: {e}")))?;

    Ok(GgufTokenizer {
        tokenizer,
        bos_token_id: bos,
        eos_token_id: eos,
        kind: TokenizerKind::Llama,
    })
}

/// Hugging Face `LlamaTokenizerFast.update_post_processor`'s template: single
/// `[<s>:0] $A:0 [</s>:0]`, pair `[<s>:0] $A:0 [</s>:0] [<s>:1] $B:1 [</s>:1]`. `None` when
/// neither BOS nor EOS is added (or the id is unknown).
fn bos_eos_template(
    tokens: &[String],
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
) -> Result<Option<TemplateProcessing>> {
    let piece = |id: u32| -> Result<(String, u32)> {
        let token = tokens[id as usize].clone();
        if token.contains(':') || token.starts_with('$') || token.is_empty() {
            return Err(tok_err(format!(
                "special token {id} `{token}` cannot be named in a post-processor template"
            )));
        }
        Ok((token, id))
    };
    let bos = match (add_bos, bos) {
        (true, Some(id)) => Some(piece(id)?),
        _ => None,
    };
    let eos = match (add_eos, eos) {
        (true, Some(id)) => Some(piece(id)?),
        _ => None,
    };
    if bos.is_none() && eos.is_none() {
        return Ok(None);
    }
    let sequence = |seq: &str, type_id: u32| -> Vec<String> {
        let mut v = Vec::new();
        if let Some((b, _)) = &bos {
            v.push(format!("{b}:{type_id}"));
        }
        v.push(format!("${seq}:{type_id}"));
        if let Some((e, _)) = &eos {
            v.push(format!("{e}:{type_id}"));
        }
        v
    };
    let single = sequence("A", 0);
    let mut pair = single.clone();
    pair.extend(sequence("B", 1));
    let special: Vec<(String, u32)> = bos.iter().chain(eos.iter()).cloned().collect();
    let template = TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| b.try_pair(pair))
        .map_err(|e| tok_err(format!("post-processor template: {e}")))?
        .special_tokens(special)
        .build()
        .map_err(|e| tok_err(format!("post-processor template: {e}")))?;
    Ok(Some(template))
}

/// The `tokenizer.ggml.model = "gpt2"` tokenizer, built by candle.
fn gpt2_tokenizer(content: &gguf_file::Content) -> Result<GgufTokenizer> {
    let n = token_strings(content)?.len();
    let tokenizer = Tokenizer::from_gguf(content).map_err(|e| tok_err(candle_message(&e)))?;
    Ok(GgufTokenizer {
        tokenizer,
        bos_token_id: special_id(content, "tokenizer.ggml.bos_token_id", n)?,
        eos_token_id: special_id(content, "tokenizer.ggml.eos_token_id", n)?,
        kind: TokenizerKind::Gpt2,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab_of(tokens: &[&str]) -> (Vec<String>, Vocab) {
        let tokens: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
        let vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        (tokens, vocab)
    }

    #[test]
    fn merges_follow_hugging_face_order() {
        // Pieces: a b c ab bc abc; scores favour "bc" over "ab".
        let (tokens, vocab) = vocab_of(&["a", "b", "c", "ab", "bc", "abc"]);
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let merges = spm_merges(&tokens, &scores, &vocab);
        let merges: Vec<(&str, &str)> = merges
            .iter()
            .map(|(l, r)| (l.as_str(), r.as_str()))
            .collect();
        // "bc" (-1), "ab" (-2), then abc's two splits (-3) by left length descending:
        // ("ab", "c") before ("a", "bc").
        assert_eq!(
            merges,
            vec![("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]
        );
    }

    #[test]
    fn merges_split_at_characters_not_bytes_and_treat_negative_zero_as_zero() {
        let (tokens, vocab) = vocab_of(&["é", "x", "éx", "xé"]);
        let scores = [0.0, 0.0, -0.0, 0.0];
        let merges = spm_merges(&tokens, &scores, &vocab);
        // Equal scores (-0.0 == 0.0) and lengths: insertion (id) order is kept.
        assert_eq!(
            merges,
            vec![
                ("é".to_string(), "x".to_string()),
                ("x".to_string(), "é".to_string())
            ]
        );
    }
}
