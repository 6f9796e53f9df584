//! [`TokenEnv`]: the token bytes, EOS ids and tokenizer that llguidance works with, built from
//! a Hugging Face `tokenizers::Tokenizer` (or from raw token bytes).
//!
//! llguidance matches bytes, so it needs every token's bytes (a [`toktrie::TokTrie`]) and a way
//! to tokenise bytes that the grammar forces (a [`toktrie::TokenizerEnv`]). We build both from
//! the tokenizer the engine already has instead of using `toktrie_hf_tokenizers`, which pins
//! another `tokenizers` version:
//!
//! - token bytes: [`llguidance::token_bytes_from_tokenizer_json`] over the tokenizer's JSON
//!   (`Tokenizer::to_string`). It reads byte-level BPE (GPT-2 / Qwen / MiniMind style) and
//!   byte-fallback SentencePiece with Hugging Face's Llama decoder (`Replace ▁→space`,
//!   `ByteFallback`, `Fuse`, `Strip`), which is what `nucleus_engine::ModelTokenizer` builds.
//!   Special added tokens get llguidance's 0xFF marker byte, so a grammar never produces them
//!   from text;
//! - forced tokens: the same tokenizer with its dummy prefix removed (below), so a forced
//!   `"name"` is tokenised exactly as the model would write it mid-text (with canonical
//!   forcing on, the default: [`TokenEnv::with_canonical_forcing`]).
//!
//! **Dummy prefix.** SentencePiece tokenizers prepend `▁` (a space) to the text they encode
//! (the GGUF `llama` tokenizer's `Prepend("▁")` normalizer, a `Metaspace` pre-tokenizer's
//! prepend scheme), and byte-level BPE with `add_prefix_space` prepends a space. A generated
//! continuation has no such space, so [`TokenEnv::encode`] and the forced-token tokenizer use a
//! copy of the tokenizer with those prefixes switched off: `Prepend` normalizers are dropped,
//! `Metaspace` gets `prepend_scheme: never`, `ByteLevel` gets `add_prefix_space: false`.

use std::sync::Arc;

use serde_json::Value;
use tokenizers::Tokenizer;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::error::{GrammarError, Result};

/// The longest token, in bytes, that llguidance's token trie can hold. Longer tokens make its
/// construction panic (its nodes count their parents in 10 bits), so [`TokenEnv`] refuses them
/// with [`GrammarError::TokenTooLong`].
pub const MAX_TOKEN_BYTES: usize = 1024;

/// The largest vocabulary [`TokenEnv`] accepts: the trie stores a subtree's size in 22 bits,
/// "up to ~2M tokens" in toktrie's words.
pub const MAX_VOCAB_SIZE: usize = 1 << 21;

/// The marker byte that llguidance puts before the bytes of a special token
/// ([`TokTrie::SPECIAL_TOKEN_MARKER`]).
pub const SPECIAL_TOKEN_MARKER: u8 = TokTrie::SPECIAL_TOKEN_MARKER;

/// Everything a grammar needs to know about a model's tokens: the bytes of every id, the
/// vocabulary size (the width of a logits row), the EOS ids, and a tokenizer for text.
///
/// Built once per tokenizer; cheap to clone (an `Arc`). A [`crate::GrammarCompiler`] owns one.
///
/// Ids from the tokenizer's own count up to `vocab_size` (padding of a model's LM head) have no
/// bytes: a grammar never allows them.
#[derive(Clone)]
pub struct TokenEnv {
    inner: Arc<EnvInner>,
}

struct EnvInner {
    tok_env: TokEnv,
    /// The tokenizer without a dummy prefix (`None` for [`TokenEnv::from_token_bytes`]).
    tokenizer: Option<Arc<Tokenizer>>,
    vocab_size: usize,
    tokenizer_vocab: usize,
    eos: Vec<u32>,
}

impl std::fmt::Debug for TokenEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenEnv")
            .field("vocab_size", &self.inner.vocab_size)
            .field("tokenizer_vocab", &self.inner.tokenizer_vocab)
            .field("eos_token_ids", &self.inner.eos)
            .field("hf_tokenizer", &self.inner.tokenizer.is_some())
            .field("canonical_forcing", &self.canonical_forcing())
            .finish()
    }
}

impl TokenEnv {
    /// Builds the environment of a Hugging Face tokenizer.
    ///
    /// Arguments:
    /// - `tokenizer`: byte-level BPE or byte-fallback SentencePiece with the Llama decoder (see
    ///   the module docs); it is copied, with its dummy prefix switched off;
    /// - `eos_token_ids`: the ids that end a generation (at least one, each below
    ///   `vocab_size`), e.g. MiniMind's `<|im_end|>` and `<|endoftext|>`. They are set
    ///   explicitly because llguidance only recognises a few EOS names by itself. The first is
    ///   the one llguidance reports as *the* EOS;
    /// - `vocab_size`: the number of ids of a logits row (the model's LM head), at least the
    ///   tokenizer's largest id + 1. Bitmask rows have ceil(vocab_size / 32) words.
    ///
    /// Errors: [`GrammarError::Tokenizer`] when the tokenizer's JSON cannot be produced or its
    /// token bytes cannot be derived (unsupported decoder, malformed byte pieces);
    /// [`GrammarError::VocabTooSmall`] (also for a tokenizer with an id at or above
    /// [`MAX_VOCAB_SIZE`], checked before its JSON is made); [`GrammarError::NoEosToken`];
    /// [`GrammarError::TokenOutOfRange`] for an EOS id; [`GrammarError::TokenTooLong`].
    pub fn from_tokenizer(
        tokenizer: &Tokenizer,
        eos_token_ids: &[u32],
        vocab_size: usize,
    ) -> Result<Self> {
        // Serialising lists the vocabulary by id, holes included: a tokenizer.json naming one
        // id 1,000,000,000 would make it allocate gigabytes. Refuse ids the trie cannot hold
        // before that.
        let tokenizer_vocab = tokenizer
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&id| id as usize + 1);
        if tokenizer_vocab > MAX_VOCAB_SIZE {
            return Err(GrammarError::VocabTooSmall {
                vocab_size,
                tokenizer_vocab,
                max: MAX_VOCAB_SIZE,
            });
        }
        let json = tokenizer
            .to_string(false)
            .map_err(|e| GrammarError::Tokenizer(format!("serialising the tokenizer: {e}")))?;
        let mut value: Value = serde_json::from_str(&json)
            .map_err(|e| GrammarError::Tokenizer(format!("reading the tokenizer's JSON: {e}")))?;
        check_byte_pieces(&value)?;
        let words = catch_panic("deriving token bytes", || {
            llguidance::token_bytes_from_tokenizer_json(&value)
        })?
        .map_err(|e| GrammarError::Tokenizer(format!("deriving token bytes: {e}")))?;

        remove_dummy_prefix(&mut value);
        let mut text_tokenizer: Tokenizer = serde_json::to_string(&value)
            .map_err(|e| e.to_string())
            .and_then(|s| s.parse::<Tokenizer>().map_err(|e| e.to_string()))
            .map_err(|e| {
                GrammarError::Tokenizer(format!(
                    "rebuilding the tokenizer without its dummy prefix: {e}"
                ))
            })?;
        // Text that spells a special token (`</s>`, `<|im_end|>`) is text to a grammar: it is
        // tokenised into ordinary pieces, never into the special token, whose bytes a grammar
        // cannot produce. Otherwise forced text such as a regex's literal `</s>` would be
        // tokenised into a token the grammar then rejects.
        text_tokenizer.set_encode_special_tokens(true);
        Self::build(
            words,
            eos_token_ids,
            vocab_size,
            Some(Arc::new(text_tokenizer)),
        )
    }

    /// Builds an environment from the bytes of every token id (`tokens[id]`), for vocabularies
    /// that have no Hugging Face tokenizer (e.g. a tiktoken rank file). Special tokens are
    /// written with a leading [`SPECIAL_TOKEN_MARKER`] byte (`b"\xFF<|endoftext|>"`), so that
    /// grammars never produce them from text; an empty entry is an id without bytes.
    ///
    /// Forced text is tokenised greedily (longest token first), which llguidance treats as a
    /// non-canonical tokenizer: masks stay exact, only forced-token shortcuts are off.
    /// [`TokenEnv::encode`] tokenises greedily too.
    ///
    /// Errors: as [`TokenEnv::from_tokenizer`], without `Tokenizer`.
    pub fn from_token_bytes(
        tokens: Vec<Vec<u8>>,
        eos_token_ids: &[u32],
        vocab_size: usize,
    ) -> Result<Self> {
        Self::build(tokens, eos_token_ids, vocab_size, None)
    }

    fn build(
        mut words: Vec<Vec<u8>>,
        eos_token_ids: &[u32],
        vocab_size: usize,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Result<Self> {
        let tokenizer_vocab = words.len();
        if vocab_size == 0 || vocab_size < tokenizer_vocab || vocab_size > MAX_VOCAB_SIZE {
            return Err(GrammarError::VocabTooSmall {
                vocab_size,
                tokenizer_vocab,
                max: MAX_VOCAB_SIZE,
            });
        }
        if let Some((id, w)) = words
            .iter()
            .enumerate()
            .find(|(_, w)| w.len() > MAX_TOKEN_BYTES)
        {
            return Err(GrammarError::TokenTooLong {
                token: id as u32,
                len: w.len(),
                max: MAX_TOKEN_BYTES,
            });
        }
        if eos_token_ids.is_empty() {
            return Err(GrammarError::NoEosToken);
        }
        if let Some(&bad) = eos_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(GrammarError::TokenOutOfRange {
                token: bad,
                vocab_size,
            });
        }
        words.resize(vocab_size, Vec::new());
        let info = TokRxInfo::new(vocab_size as u32, eos_token_ids[0]);
        let trie = catch_panic("building the token trie", || {
            TokTrie::from(&info, &words).with_eos_tokens(eos_token_ids)
        })?;
        let canonical = tokenizer.is_some();
        let env = HfTokEnv {
            trie,
            tokenizer: tokenizer.clone(),
            canonical,
        };
        Ok(TokenEnv {
            inner: Arc::new(EnvInner {
                tok_env: Arc::new(env),
                tokenizer,
                vocab_size,
                tokenizer_vocab,
                eos: eos_token_ids.to_vec(),
            }),
        })
    }

    /// This environment with llguidance's canonical forcing switched on or off (default: on,
    /// for environments built by [`from_tokenizer`](Self::from_tokenizer)).
    ///
    /// Where the grammar forces a fixed text (the rest of a keyword, a required key, the `es`
    /// of `yes` after `y`), llguidance with forcing on allows only the first token of that
    /// text's canonical tokenisation by this tokenizer, as the model would have written it in
    /// training text: a mask is then a subset of the legal tokens. With forcing off, a mask
    /// is exactly the set of legal tokens (every token whose bytes keep the output a prefix of
    /// the grammar's language, seed 001 §05; e.g. both `e` and `es` after `y`), so
    /// `mask[t] == (validate_tokens(&[t]) == 1)` for every `t`. Validation accepts any
    /// tokenisation either way. Environments from [`from_token_bytes`](Self::from_token_bytes)
    /// have no canonical tokenizer and stay off.
    ///
    /// Builds a new environment (a copy of the token trie); grammars must be compiled with it
    /// (a new [`crate::GrammarCompiler`]) to take effect.
    pub fn with_canonical_forcing(&self, on: bool) -> Self {
        let trie = self.trie().clone();
        let tokenizer = self.inner.tokenizer.clone();
        let canonical = on && tokenizer.is_some();
        TokenEnv {
            inner: Arc::new(EnvInner {
                tok_env: Arc::new(HfTokEnv {
                    trie,
                    tokenizer: tokenizer.clone(),
                    canonical,
                }),
                tokenizer,
                vocab_size: self.inner.vocab_size,
                tokenizer_vocab: self.inner.tokenizer_vocab,
                eos: self.inner.eos.clone(),
            }),
        }
    }

    /// Whether llguidance's canonical forcing is on ([`with_canonical_forcing`](Self::with_canonical_forcing)).
    pub fn canonical_forcing(&self) -> bool {
        self.inner.tok_env.tokenize_is_canonical()
    }

    /// The vocabulary size: ids of a logits row, and bits of a bitmask row in use.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// The tokenizer's number of ids (its largest id + 1); ids from here to
    /// [`vocab_size`](Self::vocab_size) are never allowed.
    pub fn tokenizer_vocab_size(&self) -> usize {
        self.inner.tokenizer_vocab
    }

    /// The EOS ids, as given.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos
    }

    /// Whether `token` is one of the EOS ids.
    pub fn is_eos(&self, token: u32) -> bool {
        self.inner.eos.contains(&token)
    }

    /// Words of a bitmask row: ceil(vocab_size / 32).
    pub fn bitmask_words(&self) -> usize {
        self.inner.vocab_size.div_ceil(32)
    }

    /// The bytes of `token` as the grammar sees them: empty for an id without bytes, with a
    /// leading [`SPECIAL_TOKEN_MARKER`] for a special token. `None` at or above the vocabulary
    /// size.
    pub fn token_bytes(&self, token: u32) -> Option<&[u8]> {
        ((token as usize) < self.inner.vocab_size).then(|| self.trie().token(token))
    }

    /// The text of `token` for messages: its bytes without the special-token marker, each
    /// byte that is not part of valid UTF-8 written `<0xE7>` (SentencePiece's name for a byte
    /// token: a token holding one byte of a multi-byte character is shown as that byte, not as
    /// U+FFFD); `""` for an id without bytes or out of range.
    pub fn token_text(&self, token: u32) -> String {
        let bytes = self.token_bytes(token).unwrap_or(&[]);
        let bytes = bytes.strip_prefix(&[SPECIAL_TOKEN_MARKER]).unwrap_or(bytes);
        let mut text = String::new();
        for chunk in bytes.utf8_chunks() {
            text.push_str(chunk.valid());
            for b in chunk.invalid() {
                text.push_str(&format!("<0x{b:02X}>"));
            }
        }
        text
    }

    /// Tokenises `text` as a model would generate it after a prompt: no special tokens added
    /// (no BOS), no dummy prefix space (see the module docs). Text that spells a special token
    /// (`<|im_end|>`) is text: it becomes ordinary pieces, never a special or control token,
    /// whose bytes no grammar produces (where the tokenizer would give one, the text is
    /// tokenised greedily by the token trie instead). Environments built with
    /// [`from_token_bytes`](Self::from_token_bytes) tokenise greedily.
    ///
    /// Errors: [`GrammarError::Tokenizer`] when the tokenizer fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.inner.tokenizer {
            Some(tokenizer) => text_ids(tokenizer, self.trie(), text),
            None => Ok(self.trie().greedy_tokenize(text.as_bytes())),
        }
    }

    /// The llguidance token environment (trie and tokenizer).
    pub(crate) fn tok_env(&self) -> &TokEnv {
        &self.inner.tok_env
    }

    pub(crate) fn trie(&self) -> &TokTrie {
        self.inner.tok_env.tok_trie()
    }
}

/// Our [`TokenizerEnv`]: the trie plus the Hugging Face tokenizer (without dummy prefix) for
/// bytes that the grammar forces.
struct HfTokEnv {
    trie: TokTrie,
    tokenizer: Option<Arc<Tokenizer>>,
    canonical: bool,
}

impl TokenizerEnv for HfTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match &self.tokenizer {
            // Valid UTF-8 runs go through the tokenizer, stray bytes greedily through the trie.
            Some(tokenizer) => self.trie.tokenize_with_greedy_fallback(s, |text| {
                text_ids(tokenizer, &self.trie, text)
                    .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
            }),
            None => self.trie.greedy_tokenize(s),
        }
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

/// The ids of `text` as text: the tokenizer's encoding, unless it holds an id whose bytes
/// are not the text's (a special or control token that is also an ordinary piece of the
/// model's vocabulary, such as a GGUF piece `x` of token type control, which the tokenizer
/// gives for `x` but whose bytes in the trie carry the special-token marker): then the
/// greedy tokenisation by the trie, which never yields such a token. Otherwise a grammar
/// forcing `x` would be offered a token it then rejects.
fn text_ids(tokenizer: &Tokenizer, trie: &TokTrie, text: &str) -> Result<Vec<u32>> {
    let ids = hf_encode(tokenizer, text)?;
    let is_text = |&id: &u32| {
        (id as usize) < trie.vocab_size()
            && trie
                .token(id)
                .first()
                .is_some_and(|&b| b != SPECIAL_TOKEN_MARKER)
    };
    if ids.iter().all(is_text) {
        Ok(ids)
    } else {
        Ok(trie.greedy_tokenize(text.as_bytes()))
    }
}

fn hf_encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    tokenizer
        .encode(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| GrammarError::Tokenizer(format!("encoding text: {e}")))
}

/// Runs `f`, turning a panic inside llguidance / toktrie into [`GrammarError::Tokenizer`] (a
/// backstop: the inputs that are known to panic are checked before).
fn catch_panic<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("panic");
        GrammarError::Tokenizer(format!("{what}: {message}"))
    })
}

/// `token_bytes_from_tokenizer_json` panics on a byte-fallback vocabulary entry that starts
/// with `<0x` but is not exactly `<0xHH>`; refuse such a tokenizer with a message instead.
fn check_byte_pieces(json: &Value) -> Result<()> {
    let decoder = &json["decoder"];
    let byte_fallback = decoder["type"].as_str() == Some("Sequence")
        && decoder["decoders"]
            .as_array()
            .is_some_and(|ds| ds.iter().any(|d| d["type"] == "ByteFallback"));
    if !byte_fallback {
        return Ok(());
    }
    let Some(vocab) = json["model"]["vocab"].as_object() else {
        return Ok(());
    };
    for piece in vocab.keys() {
        if piece.starts_with("<0x") {
            let ok = piece.len() == 6
                && piece.ends_with('>')
                && u8::from_str_radix(&piece[3..5], 16).is_ok();
            if !ok {
                return Err(GrammarError::Tokenizer(format!(
                    "byte-fallback piece {piece:?} is not of the form <0xHH>"
                )));
            }
        }
    }
    Ok(())
}

/// Switches off every dummy prefix in a tokenizer's JSON (see the module docs).
fn remove_dummy_prefix(json: &mut Value) {
    if let Some(normalizer) = json.get_mut("normalizer") {
        if normalizer["type"] == "Prepend" {
            *normalizer = Value::Null;
        } else if normalizer["type"] == "Sequence" {
            if let Some(list) = normalizer
                .get_mut("normalizers")
                .and_then(Value::as_array_mut)
            {
                list.retain(|n| n["type"] != "Prepend");
            }
        }
    }
    if let Some(pre) = json.get_mut("pre_tokenizer") {
        no_prefix_pre_tokenizer(pre);
    }
}

fn no_prefix_pre_tokenizer(pre: &mut Value) {
    match pre["type"].as_str() {
        Some("ByteLevel") => {
            pre["add_prefix_space"] = Value::Bool(false);
        }
        Some("Metaspace") => {
            pre["prepend_scheme"] = Value::String("never".to_string());
            if pre.get("add_prefix_space").is_some() {
                pre["add_prefix_space"] = Value::Bool(false);
            }
        }
        Some("Sequence") => {
            if let Some(list) = pre.get_mut("pretokenizers").and_then(Value::as_array_mut) {
                list.iter_mut().for_each(no_prefix_pre_tokenizer);
            }
        }
        _ => {}
    }
}
