//! [`ModelTokenizer`]: a Hugging Face `tokenizers::Tokenizer` with the ids a generation loop
//! needs, read from a Hugging Face folder's `tokenizer.json` ([`TokenizerKind::HuggingFace`],
//! see [`crate::loader::hf`]) or built from a GGUF file's `tokenizer.ggml.*` metadata.
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
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE with merges (Llama 3, Qwen2, GPT-2,
//!   DeepSeek…), built as llama.cpp's `llm_tokenizer_bpe` (`src/llama-vocab.cpp`) tokenizes and
//!   as Hugging Face's own `tokenizer.json` files of these families are laid out:
//!   - pre-tokenizer: chosen by `tokenizer.ggml.pre` from llama.cpp's table (see
//!     [`supported_pre_types`]): a `Sequence` of `Split` pre-tokenizers, one per regular
//!     expression of the type in `llm_tokenizer_bpe`'s constructor, each with `Isolated`
//!     behaviour, then `ByteLevel(add_prefix_space = false, use_regex = false)`. A file without
//!     the key gets llama.cpp's `default` type and a warning; an unknown value is
//!     [`EngineError::Unsupported`] naming it and the supported list, as llama.cpp throws
//!     "unknown pre-tokenizer type" (recent versions; older ones fell back to `default`, which
//!     silently tokenizes a family wrong);
//!   - model: BPE with `tokenizer.ggml.merges` (each split at its first space after the first
//!     byte, as llama.cpp's `load` does), no unknown token, no byte fallback, `ignore_merges`
//!     for the types where llama.cpp sets it (Llama 3);
//!   - decoder: `ByteLevel`; post-processor: BOS / EOS by `add_bos_token` / `add_eos_token`,
//!     whose defaults when the file lacks them are llama.cpp's per-type ones (true / false for
//!     `llama-bpe`, false / false for `default`, `qwen2`, `gpt-2`, `deepseek-llm`);
//!   - added tokens: as for `llama` below: control (3) and unknown (2) pieces and the BOS / EOS
//!     pieces special, user-defined (4) non-special.
//!
//! Any other kind is [`EngineError::Unsupported`].
//!
//! Special tokens in the text: [`ModelTokenizer::encode`] with `parse_special = true` turns the
//! spelling of an added token into that token; with `false` (llama.cpp's
//! `llama_tokenize(.., parse_special = false)`, `tokenizer_st_partition`) control and unknown
//! tokens are plain text, while user-defined tokens still match (llama.cpp partitions them
//! always), which is Hugging Face's `encode_special_tokens = true`.
//!
//! End of generation ([`ModelTokenizer::eos_token_ids`]): the EOS, EOT and EOM ids of the
//! metadata and every token whose text is in [`EOG_TOKEN_TEXTS`], llama.cpp's list.
//!
//! Long pieces are fine here (no fixed-size buffers); note for consumers that some (llguidance)
//! reject pieces longer than 1,024 bytes.

mod pre;

use std::collections::BTreeSet;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file::{self, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace, Sequence as NormSequence};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::SplitDelimiterBehavior;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{bounded, quote, EngineError, Result};
use crate::gguf::describe;
use crate::gguf::{md_array, md_bool, md_str, value_to_u64};

/// The SentencePiece word-boundary marker, U+2581.
const SPIECE_UNDERLINE: &str = "\u{2581}";

/// `token_type` values of llama.cpp's `llama_token_type`.
const TOKEN_TYPE_UNKNOWN: u64 = 2;
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// The special ids that must lie inside the vocabulary: a file whose BOS or EOS id does not is
/// refused (a generation loop cannot run without them right).
const BOS_KEY: &str = "tokenizer.ggml.bos_token_id";
const EOS_KEY: &str = "tokenizer.ggml.eos_token_id";
/// The llama kind's unknown-token id (llama.cpp's key).
const UNKNOWN_KEY: &str = "tokenizer.ggml.unknown_token_id";
/// The end-of-turn and end-of-message ids (llama.cpp's `LLM_KV_TOKENIZER_EOT_ID` / `EOM_ID`).
const EOT_KEY: &str = "tokenizer.ggml.eot_token_id";
const EOM_KEY: &str = "tokenizer.ggml.eom_token_id";

/// The texts of the tokens that end a generation whatever the metadata says, copied in order
/// from llama.cpp's `llama_vocab::impl::load` (`src/llama-vocab.cpp`, the loop that fills
/// `special_eog_ids` "based on the token text"). llama.cpp also ends at the fill-in-the-middle
/// pad / repo / file-separator tokens it detects; we do not (they matter to FIM prompts only).
pub const EOG_TOKEN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "[e~[",
];

/// The `tokenizer.ggml.pre` values [`ModelTokenizer::from_gguf`] supports, as llama.cpp's
/// `llama_vocab::impl::load` names them (aliases included).
pub fn supported_pre_types() -> Vec<&'static str> {
    pre::TABLE.iter().map(|(n, _)| *n).collect()
}
/// The most warnings one tokenizer reports; the rest are counted in one more.
const MAX_WARNINGS: usize = 16;

/// What a [`ModelTokenizer`] was built from: a GGUF file's `tokenizer.ggml.model`, or a Hugging
/// Face `tokenizer.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// A Hugging Face folder's `tokenizer.json`, read as it is by the `tokenizers` crate.
    HuggingFace,
    /// `"llama"`: SentencePiece BPE with scores and byte fallback.
    Llama,
    /// `"gpt2"`: byte-level BPE with merges.
    Gpt2,
}

/// A tokenizer with the ids a generation loop needs (from GGUF metadata or a Hugging Face
/// folder).
#[derive(Debug, Clone)]
pub struct ModelTokenizer {
    /// The Hugging Face tokenizer (`encode(text, add_special_tokens)`, `decode(ids, skip_special)`).
    /// Special-token spellings in the text are parsed; see [`ModelTokenizer::encode`] for the
    /// choice. Changing it after [`ModelTokenizer::encode`] ran with `parse_special = false` is
    /// not seen by that path (it keeps its own copy).
    pub tokenizer: Tokenizer,
    /// The BOS id: `tokenizer.ggml.bos_token_id` (`None` when absent or "no token", -1, see
    /// [`ModelTokenizer::from_gguf`]); for Hugging Face folders `bos_token_id` of config.json,
    /// else `bos_token` of tokenizer_config.json.
    pub bos_token_id: Option<u32>,
    /// The BOS token's text (for chat templates), `None` without a BOS id.
    pub bos_token: Option<String>,
    /// Whether encoding with special tokens adds BOS: GGUF `tokenizer.ggml.add_bos_token`, else
    /// llama.cpp's default for the kind and pre-tokenizer type (`llama_vocab::impl::load`);
    /// for Hugging Face folders, whether tokenizer.json's post-processor (as transformers would
    /// set it up) puts BOS first. Always false without a BOS id.
    pub add_bos_token: bool,
    /// The ids that end a completion, sorted ascending, without duplicates. GGUF:
    /// `tokenizer.ggml.eos_token_id` ∪ `.eot_token_id` ∪ `.eom_token_id` ∪ every token whose
    /// text is in [`EOG_TOKEN_TEXTS`] (llama.cpp's `special_eog_ids`). Hugging Face folders:
    /// generation_config.json's `eos_token_id` (a number or a list) ∪ config.json's ∪
    /// tokenizer_config.json's `eos_token` ∪ the same text list.
    pub eos_token_ids: Vec<u32>,
    /// The EOS token's text (GGUF `eos_token_id`; Hugging Face tokenizer_config.json's
    /// `eos_token`, else the first of generation_config / config ids), for chat templates.
    pub eos_token: Option<String>,
    /// The tokenizer kind (`tokenizer.ggml.model`).
    pub kind: TokenizerKind,
    /// What was wrong in the metadata but ignored, one message each (at most 17): special ids
    /// other than BOS / EOS outside the vocabulary, as llama.cpp ignores them; a missing
    /// `tokenizer.ggml.pre`. For the caller to show; [`crate::load_gguf`] passes them on in
    /// [`crate::LoadedModel::warnings`].
    pub warnings: Vec<String>,
    /// `tokenizer` with `encode_special_tokens = true`, made on first use.
    pub(crate) plain: OnceLock<Tokenizer>,
}

impl ModelTokenizer {
    /// Encodes `text` to ids.
    ///
    /// - `add_special_tokens`: add BOS (when [`ModelTokenizer::add_bos_token`]) and EOS (GGUF
    ///   `add_eos_token`) around the text, as llama.cpp's `llama_tokenize(.., add_special)`.
    /// - `parse_special`: whether the spelling of a control token in `text` (`"<|im_end|>"`,
    ///   `"<s>"`) is that token (true) or plain text (false), as llama.cpp's `parse_special`
    ///   (`tokenizer_st_partition`); user-defined added tokens match either way, as there.
    ///   False is Hugging Face's `Tokenizer::set_encode_special_tokens(true)`.
    ///
    /// # Errors
    /// [`EngineError::Tokenizer`] when the tokenizers crate fails (it does not on valid UTF-8
    /// with the tokenizers built here).
    pub fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>> {
        let tokenizer = if parse_special {
            &self.tokenizer
        } else {
            self.plain.get_or_init(|| {
                let mut t = self.tokenizer.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        tokenizer
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| tok_err(format!("encoding {} bytes of text: {e}", text.len())))
    }

    /// Token `id`'s text as it continues the text after the token `before` (the one generated
    /// before it, or the prompt's last), as vLLM's incremental detokenizer gives it for
    /// logprobs (a SentencePiece `▁upon` is " upon", not "upon"); special tokens spelled out.
    /// Without a token before, or when the pair does not decode to an extension of `before`
    /// alone, the token decoded alone; `<id N>` when even that fails (an id outside the
    /// vocabulary).
    pub fn token_text_after(&self, before: Option<u32>, id: u32) -> String {
        let decode = |ids: &[u32]| self.decode(ids, false).ok();
        if let Some(b) = before {
            if let (Some(pair), Some(first)) = (decode(&[b, id]), decode(&[b])) {
                if let Some(rest) = pair.strip_prefix(first.as_str()) {
                    return rest.to_string();
                }
            }
        }
        decode(&[id]).unwrap_or_else(|| format!("<id {id}>"))
    }

    /// Decodes `ids` to text with the tokenizer's decoder, dropping special (control) tokens
    /// when `skip_special_tokens` is true. No clean-up of spaces is done (llama.cpp's
    /// `clean_spaces` / transformers' `clean_up_tokenization_spaces` are not applied), so
    /// `decode(encode(s)) == s` except for the SentencePiece dummy-prefix rule (see the module
    /// docs).
    ///
    /// Byte-level BPE ([`TokenizerKind::Gpt2`]): an added token's text is its text, not byte-level
    /// symbols, so added tokens are written as they are and only the runs of model tokens
    /// between them go through the `ByteLevel` decoder, as llama.cpp's `token_to_piece` does
    /// (`LLAMA_TOKEN_ATTR_USER_DEFINED` / `CONTROL` pieces are copied, normal ones byte-decoded).
    /// (Hugging Face's decoder would turn DeepSeek's user-defined `ø` into `�`.)
    ///
    /// # Errors
    /// [`EngineError::Tokenizer`] naming the first id that is not in the vocabulary and its
    /// position.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some((i, &bad)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| self.tokenizer.id_to_token(id).is_none())
        {
            return Err(tok_err(format!(
                "id {bad} at position {i} is not in the vocabulary of {} ids",
                self.tokenizer.get_vocab_size(true)
            )));
        }
        let decode = |run: &[u32]| {
            self.tokenizer
                .decode(run, skip_special_tokens)
                .map_err(|e| tok_err(format!("decoding {} ids: {e}", run.len())))
        };
        if self.kind != TokenizerKind::Gpt2 {
            return decode(ids);
        }
        let added = self.tokenizer.get_added_vocabulary();
        let mut text = String::new();
        let mut run_start = 0;
        for (i, &id) in ids.iter().enumerate() {
            let Some(token) = added.simple_id_to_token(id) else {
                continue;
            };
            text.push_str(&decode(&ids[run_start..i])?);
            run_start = i + 1;
            if !(skip_special_tokens && added.is_special_token(&token)) {
                text.push_str(&token);
            }
        }
        text.push_str(&decode(&ids[run_start..])?);
        Ok(text)
    }

    /// The number of ids of the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The bytes token `id` stands for, as llama.cpp's `token_to_piece` / `detokenize({id},
    /// true)` gives them: a byte-level BPE token's bytes (GPT-2's byte-to-unicode table
    /// inverted, so a token holding half of a UTF-8 character gives that half), an added
    /// token's text, a SentencePiece byte token `<0xHH>`'s byte, else the decoded text of the
    /// token alone. `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.tokenizer.id_to_token(id)?;
        let added = self.tokenizer.get_added_vocabulary();
        if added.simple_id_to_token(id).is_some() {
            return Some(piece.into_bytes());
        }
        if self.kind == TokenizerKind::Gpt2 {
            return piece.chars().map(gpt2_char_byte).collect();
        }
        if let Some(hex) = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
            if let (2, Ok(b)) = (hex.len(), u8::from_str_radix(hex, 16)) {
                return Some(vec![b]);
            }
        }
        self.decode(&[id], false).ok().map(String::into_bytes)
    }

    /// DRY's sequence breakers (llama.cpp `dry_sequence_breakers`, default
    /// [`nucleus_sampling::chain::DRY_DEFAULT_SEQUENCE_BREAKERS`]) resolved to token-id
    /// sequences against this vocabulary as llama.cpp's `get_overlapping_token_sequences`
    /// resolves them ([`nucleus_sampling::chain::resolve_sequence_breakers`]): every token whose
    /// bytes ([`Self::token_bytes`]) contain a breaker, or end with a prefix of it followed by
    /// the encoding of the rest (plain text: no BOS, special spellings not parsed). One pass
    /// over the vocabulary per call.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] for a breaker that is empty or longer than 40 bytes, more
    /// than 64 breakers, or a tail that is not valid UTF-8 on its own.
    pub fn dry_sequence_breakers(&self, breakers: &[impl AsRef<str>]) -> Result<Vec<Vec<u32>>> {
        let n = self.tokenizer.get_vocab_size(true) as u32;
        let texts: Vec<Vec<u8>> = (0..n)
            .map(|id| self.token_bytes(id).unwrap_or_default())
            .collect();
        let encode = |bytes: &[u8]| -> std::result::Result<Vec<u32>, String> {
            let text = std::str::from_utf8(bytes)
                .map_err(|_| format!("the tail {bytes:?} is not valid UTF-8"))?;
            self.encode(text, false, false).map_err(|e| e.to_string())
        };
        nucleus_sampling::chain::resolve_sequence_breakers(breakers, &texts, encode)
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))
    }

    /// Builds the tokenizer described by `content`'s `tokenizer.ggml.*` metadata (see the module
    /// docs for what each kind becomes).
    ///
    /// Metadata read: `tokenizer.ggml.model`, `.tokens` (required), `.scores` (llama: one f32
    /// per token, default 0), `.token_type` (one integer per token, default 1 = normal),
    /// `.bos_token_id`, `.eos_token_id`, `.unknown_token_id` (llama: default the piece `<unk>`
    /// if present), `.add_bos_token` (llama: default true), `.add_eos_token` (default false),
    /// `.add_space_prefix` (llama: default true), `.eot_token_id`, `.eom_token_id`; gpt2 also
    /// `.merges` (required) and `.pre` (the pre-tokenizer type, see the module docs), whose
    /// `add_bos_token` default is llama.cpp's for the type. A llama-kind file's `.pre` is
    /// ignored, as llama.cpp ignores it for SentencePiece vocabularies.
    ///
    /// Special token ids (every `tokenizer.ggml.*_token_id` key) are integers of any GGUF
    /// integer type. -1 in a signed type, or the largest value of an unsigned type (the bits of
    /// llama.cpp's `LLAMA_TOKEN_NULL` = -1), means "no such token". Any other value outside
    /// `0..n_tokens`:
    /// - for `bos_token_id` and `eos_token_id` is an error: the file is corrupt (a generation
    ///   loop needs them right; we do not run such a file);
    /// - for every other key (`unknown_token_id`, `padding_token_id`, `seperator_token_id` (sic,
    ///   llama.cpp's spelling), `separator_token_id`, `unk` / `pad` / `sep`, `cls`,
    ///   `mask`, ...) is one warning in [`ModelTokenizer::warnings`] naming the key and the value,
    ///   and the id is ignored (the unknown token then defaults to the piece `<unk>`), as
    ///   llama.cpp's `llama_vocab::impl::load` (`src/llama-vocab.cpp`) does: "bad special token:
    ///   ... using default id". So files llama.cpp runs still load.
    ///
    /// A special id that is not an integer is an error for the keys this tokenizer reads
    /// (BOS, EOS, llama's `unknown_token_id`) and a warning for the others.
    ///
    /// Errors: [`EngineError::Unsupported`] for a kind other than `llama` / `gpt2`, or a
    /// `tokenizer.ggml.pre` not in [`supported_pre_types`] (naming it and the list);
    /// [`EngineError::Tokenizer`] naming the key and describing the value for missing or
    /// malformed metadata (array lengths that differ from the token count, wrong types), a BOS or
    /// EOS id outside the vocabulary, or a BOS/EOS piece that a `TemplateProcessing` cannot name
    /// (one containing `:`). Messages escape text from the file and are at most
    /// [`crate::error::MAX_MESSAGE_BYTES`] long, except the unknown-pre message, whose list of
    /// supported values (about 400 bytes) is whole. [`crate::load_gguf`] reports these as
    /// `InvalidModel` with the file's path.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let kind = md_str(content, "tokenizer.ggml.model")
            .map_err(EngineError::Tokenizer)?
            .ok_or_else(|| {
                EngineError::Tokenizer("missing metadata key `tokenizer.ggml.model`".to_string())
            })?;
        match kind {
            "llama" => llama_tokenizer(content),
            "gpt2" => gpt2_tokenizer(content),
            other => Err(EngineError::Unsupported(bounded(format!(
                "tokenizer kind {} (tokenizer.ggml.model); supported: llama, gpt2",
                quote(other.as_bytes())
            )))),
        }
    }
}

/// A tokenizer error, its message [`bounded`].
fn tok_err(message: impl Into<String>) -> EngineError {
    EngineError::Tokenizer(bounded(message))
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
                "`{key}`[{i}] is {}, expected a string",
                describe(other)
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
        .map(|(i, v)| f(v).ok_or_else(|| tok_err(format!("`{key}`[{i}] is {}", describe(v)))))
        .collect::<Result<Vec<T>>>()
        .map(Some)
}

/// What a special-token id key holds (see [`ModelTokenizer::from_gguf`]).
enum SpecialId {
    /// The key is absent or says "no such token" (-1, or an unsigned type's largest value).
    Absent,
    /// A token id below the vocabulary size.
    Id(u32),
    /// Any other integer: outside the vocabulary.
    OutOfRange(i128),
}

/// The special-token id at `key` for a vocabulary of `n_tokens` (at most `u32::MAX`, checked by
/// [`token_strings`]); `Err` (a message naming the key) when it is not an integer.
fn special_id(
    content: &gguf_file::Content,
    key: &str,
    n_tokens: usize,
) -> std::result::Result<SpecialId, String> {
    let Some(value) = content.metadata.get(key) else {
        return Ok(SpecialId::Absent);
    };
    let (v, none): (i128, bool) = match *value {
        Value::U8(v) => (v.into(), v == u8::MAX),
        Value::U16(v) => (v.into(), v == u16::MAX),
        Value::U32(v) => (v.into(), v == u32::MAX),
        Value::U64(v) => (v.into(), v == u64::MAX),
        Value::I8(v) => (v.into(), v == -1),
        Value::I16(v) => (v.into(), v == -1),
        Value::I32(v) => (v.into(), v == -1),
        Value::I64(v) => (v.into(), v == -1),
        _ => {
            return Err(format!(
                "metadata {} is {}, expected an integer token id",
                quote(key.as_bytes()),
                describe(value)
            ))
        }
    };
    Ok(match u32::try_from(v) {
        Ok(id) if (id as usize) < n_tokens => SpecialId::Id(id),
        _ if none => SpecialId::Absent,
        _ => SpecialId::OutOfRange(v),
    })
}

/// The BOS or EOS id at `key`: an error when it is not an integer or lies outside the
/// vocabulary of `n_tokens`.
fn strict_special_id(
    content: &gguf_file::Content,
    key: &str,
    n_tokens: usize,
) -> Result<Option<u32>> {
    match special_id(content, key, n_tokens).map_err(tok_err)? {
        SpecialId::Absent => Ok(None),
        SpecialId::Id(id) => Ok(Some(id)),
        SpecialId::OutOfRange(v) => Err(tok_err(format!(
            "metadata `{key}` is {v}, outside the vocabulary of {n_tokens} tokens \
             (`tokenizer.ggml.tokens`)"
        ))),
    }
}

/// Checks every `tokenizer.ggml.*_token_id` key other than BOS and EOS, in key order: one
/// warning (llama.cpp's "bad special token") for each whose id lies outside the vocabulary, and
/// for each that is not an integer unless it is one of `read` (the keys the tokenizer uses),
/// which is then an error. At most [`MAX_WARNINGS`] warnings, then one that counts the rest.
fn check_special_ids(
    content: &gguf_file::Content,
    n_tokens: usize,
    read: &[&str],
    warnings: &mut Vec<String>,
) -> Result<()> {
    let mut keys: Vec<&str> = content
        .metadata
        .keys()
        .map(String::as_str)
        .filter(|k| {
            k.starts_with("tokenizer.ggml.")
                && k.ends_with("_token_id")
                && *k != BOS_KEY
                && *k != EOS_KEY
        })
        .collect();
    keys.sort_unstable();
    let mut found = Vec::new();
    for key in keys {
        match special_id(content, key, n_tokens) {
            Ok(SpecialId::OutOfRange(v)) => found.push(format!(
                "bad special token: metadata {} is {v}, outside the vocabulary of {n_tokens} \
                 tokens; ignored, as llama.cpp does",
                quote(key.as_bytes())
            )),
            Ok(_) => {}
            Err(message) if read.contains(&key) => return Err(tok_err(message)),
            Err(message) => found.push(format!("{message}; ignored")),
        }
    }
    let more = found.len().saturating_sub(MAX_WARNINGS);
    found.truncate(MAX_WARNINGS);
    warnings.extend(found.into_iter().map(bounded));
    if more > 0 {
        warnings.push(format!("... and {more} more bad special tokens, ignored"));
    }
    Ok(())
}

/// The most work `spm_merges` may do, in bytes hashed: the sum over pieces of their length
/// squared (each character boundary of a piece looks up its two parts). Real vocabularies
/// need under 10^8 (their longest pieces are 48 to 256 bytes: Llama 2, Phi-3, Llama 3, Qwen2,
/// DeepSeek); one piece of 10 MB would need 10^14, hours of work.
pub const MAX_SPM_MERGE_WORK: u64 = 1 << 31;

/// Refuses a SentencePiece vocabulary whose merges would take more than
/// [`MAX_SPM_MERGE_WORK`] to derive, naming its longest piece.
fn check_spm_work(tokens: &[String]) -> Result<()> {
    let work = tokens.iter().fold(0u64, |w, t| {
        let n = t.len() as u64;
        w.saturating_add(n.saturating_mul(n))
    });
    if work <= MAX_SPM_MERGE_WORK {
        return Ok(());
    }
    let (id, longest) = tokens
        .iter()
        .enumerate()
        .max_by_key(|(_, t)| t.len())
        .map_or((0, 0), |(i, t)| (i, t.len()));
    Err(tok_err(format!(
        "the pieces of `tokenizer.ggml.tokens` are too long to derive SentencePiece merges \
         from: their squared lengths add up to {work} bytes, more than {MAX_SPM_MERGE_WORK} \
         (the longest, token {id}, is {longest} bytes; real vocabularies add up to less than \
         10^8)"
    )))
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
fn llama_tokenizer(content: &gguf_file::Content) -> Result<ModelTokenizer> {
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
    let bos = strict_special_id(content, BOS_KEY, n)?;
    let eos = strict_special_id(content, EOS_KEY, n)?;
    let mut warnings = Vec::new();
    check_special_ids(content, n, &[UNKNOWN_KEY], &mut warnings)?;
    let unk = match special_id(content, UNKNOWN_KEY, n).map_err(tok_err)? {
        SpecialId::Id(id) => Some(id),
        // Absent, or out of range (warned about above): llama.cpp's default, the `<unk>` piece.
        SpecialId::Absent | SpecialId::OutOfRange(_) => {
            tokens.iter().position(|t| t == "<unk>").map(|i| i as u32)
        }
    };
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
    check_spm_work(&tokens)?;
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

    if let Some(template) = bos_eos_template(
        &|id| tokens.get(id as usize).cloned(),
        bos,
        eos,
        add_bos,
        add_eos,
    )? {
        tokenizer.with_post_processor(Some(template));
    }

    // Added tokens, in id order, as Hugging Face's SpmConverter adds them.
    add_gguf_tokens(&mut tokenizer, &tokens, &types, &[unk, bos, eos])?;
    gguf_model_tokenizer(
        content,
        tokenizer,
        &tokens,
        (bos, eos),
        add_bos,
        TokenizerKind::Llama,
        warnings,
    )
}

/// The GGUF end-of-generation ids: `eos` ∪ the EOT / EOM ids (ignored when absent or outside
/// the vocabulary, as llama.cpp ignores bad special ids) ∪ the tokens of [`EOG_TOKEN_TEXTS`],
/// sorted.
fn gguf_eog_ids(
    content: &gguf_file::Content,
    tokens: &[String],
    eos: Option<u32>,
) -> Result<Vec<u32>> {
    let mut ids: BTreeSet<u32> = eos.into_iter().collect();
    for key in [EOT_KEY, EOM_KEY] {
        if let Ok(SpecialId::Id(id)) = special_id(content, key, tokens.len()) {
            ids.insert(id);
        }
    }
    ids.extend(
        tokens
            .iter()
            .enumerate()
            .filter(|(_, t)| EOG_TOKEN_TEXTS.contains(&t.as_str()))
            .map(|(i, _)| i as u32),
    );
    Ok(ids.into_iter().collect())
}

/// The ids of [`EOG_TOKEN_TEXTS`] in a tokenizer (added tokens included), for Hugging Face
/// folders.
pub(crate) fn eog_ids_by_text(tokenizer: &Tokenizer) -> Vec<u32> {
    EOG_TOKEN_TEXTS
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .collect()
}

/// The [`ModelTokenizer`] of a GGUF vocabulary built as `tokenizer`: BOS / EOS ids and texts,
/// whether BOS is added, and the end-of-generation set ([`gguf_eog_ids`]).
fn gguf_model_tokenizer(
    content: &gguf_file::Content,
    tokenizer: Tokenizer,
    tokens: &[String],
    (bos, eos): (Option<u32>, Option<u32>),
    add_bos: bool,
    kind: TokenizerKind,
    warnings: Vec<String>,
) -> Result<ModelTokenizer> {
    let eos_token_ids = gguf_eog_ids(content, tokens, eos)?;
    let text = |id: Option<u32>| id.map(|id| tokens[id as usize].clone());
    Ok(ModelTokenizer {
        tokenizer,
        bos_token_id: bos,
        bos_token: text(bos),
        add_bos_token: add_bos && bos.is_some(),
        eos_token_ids,
        eos_token: text(eos),
        kind,
        warnings,
        plain: OnceLock::new(),
    })
}

/// Adds a GGUF vocabulary's added tokens, in id order, as Hugging Face's converters add them:
/// control (`token_type` 3) and unknown (2) pieces and the ids of `specials` (unknown, BOS,
/// EOS) as special tokens, user-defined pieces (4) as non-special, unnormalised ones.
fn add_gguf_tokens(
    tokenizer: &mut Tokenizer,
    tokens: &[String],
    types: &[u64],
    specials: &[Option<u32>],
) -> Result<()> {
    let specials: BTreeSet<u32> = specials.iter().flatten().copied().collect();
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter_map(|(id, (token, &ty))| {
            if ty == TOKEN_TYPE_CONTROL
                || ty == TOKEN_TYPE_UNKNOWN
                || specials.contains(&(id as u32))
            {
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
    Ok(())
}

/// Hugging Face `LlamaTokenizerFast.update_post_processor`'s template: single
/// `[<s>:0] $A:0 [</s>:0]`, pair `[<s>:0] $A:0 [</s>:0] [<s>:1] $B:1 [</s>:1]`. `None` when
/// neither BOS nor EOS is added (or the id is unknown).
pub(crate) fn bos_eos_template(
    piece_of: &dyn Fn(u32) -> Option<String>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
) -> Result<Option<TemplateProcessing>> {
    let piece = |id: u32| -> Result<(String, u32)> {
        let token = piece_of(id).unwrap_or_default();
        if token.contains(':') || token.starts_with('$') || token.is_empty() {
            return Err(tok_err(format!(
                "special token {id} {} cannot be named in a post-processor template",
                quote(token.as_bytes())
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

/// The `tokenizer.ggml.model = "gpt2"` tokenizer: byte-level BPE (module docs).
fn gpt2_tokenizer(content: &gguf_file::Content) -> Result<ModelTokenizer> {
    let tokens = token_strings(content)?;
    let n = tokens.len();
    let bos = strict_special_id(content, BOS_KEY, n)?;
    let eos = strict_special_id(content, EOS_KEY, n)?;
    let mut warnings = Vec::new();
    check_special_ids(content, n, &[], &mut warnings)?;
    let types = per_token(content, "tokenizer.ggml.token_type", n, value_to_u64)?
        .unwrap_or_else(|| vec![1; n]);

    let pre_key = "tokenizer.ggml.pre";
    let pre_type = match md_str(content, pre_key).map_err(tok_err)? {
        None => {
            warnings.push(
                "missing pre-tokenizer type `tokenizer.ggml.pre`, using `default` as llama.cpp \
                 does; generation quality may be degraded"
                    .to_string(),
            );
            pre::MISSING
        }
        Some(value) => pre::lookup(value).ok_or_else(|| {
            // The value is bounded, the list (our own text, about 400 bytes) is not.
            EngineError::Unsupported(format!(
                "pre-tokenizer type {} (tokenizer.ggml.pre); supported: {}",
                bounded(quote(value.as_bytes())),
                pre::supported()
            ))
        })?,
    };

    let key = "tokenizer.ggml.merges";
    let values = md_array(content, key)
        .map_err(tok_err)?
        .ok_or_else(|| tok_err(format!("missing metadata key `{key}`")))?;
    let mut merges = Vec::with_capacity(values.len());
    for (i, merge) in values.iter().enumerate() {
        // llama.cpp's `load`: split at the first space after the first byte.
        let split = match merge {
            Value::String(m) => m
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(at, _)| (m[..at].to_string(), m[at + 1..].to_string())),
            _ => None,
        };
        let Some(split) = split else {
            return Err(tok_err(format!(
                "`{key}`[{i}] is {}, expected a string of two pieces separated by a space",
                describe(merge)
            )));
        };
        merges.push(split);
    }

    let flag = |key: &str, default: bool| -> Result<bool> {
        Ok(md_bool(content, key).map_err(tok_err)?.unwrap_or(default))
    };
    let add_bos = flag("tokenizer.ggml.add_bos_token", pre_type.add_bos)?;
    let add_eos = flag("tokenizer.ggml.add_eos_token", false)?;

    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre_type.ignore_merges)
        .build()
        .map_err(|e| tok_err(format!("building the BPE model: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);

    let mut pre_tokenizers: Vec<PreTokenizerWrapper> = Vec::new();
    for regex in pre_type.regexes {
        let split = Split::new(
            SplitPattern::Regex((*regex).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| {
            tok_err(format!(
                "pre-tokenizer type `{}`: regular expression {}: {e}",
                pre_type.name,
                quote(regex.as_bytes())
            ))
        })?;
        pre_tokenizers.push(split.into());
    }
    pre_tokenizers.push(ByteLevel::new(false, true, false).into());
    tokenizer.with_pre_tokenizer(Some(PreSequence::new(pre_tokenizers)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, false)));

    if let Some(template) = bos_eos_template(
        &|id| tokens.get(id as usize).cloned(),
        bos,
        eos,
        add_bos,
        add_eos,
    )? {
        tokenizer.with_post_processor(Some(template));
    }

    add_gguf_tokens(&mut tokenizer, &tokens, &types, &[bos, eos])?;
    gguf_model_tokenizer(
        content,
        tokenizer,
        &tokens,
        (bos, eos),
        add_bos,
        TokenizerKind::Gpt2,
        warnings,
    )
}

/// The byte GPT-2's byte-level alphabet writes as `c` (`bytes_to_unicode` inverted: the
/// printable bytes 33-126, 161-172 and 174-255 stand for themselves, the other 68 bytes for
/// U+0100 onwards in byte order).
fn gpt2_char_byte(c: char) -> Option<u8> {
    let c = c as u32;
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    if c < 256 && printable(c) {
        return Some(c as u8);
    }
    let k = c.checked_sub(256)?;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(k as usize)
        .map(|b| b as u8)
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
