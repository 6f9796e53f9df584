//! Repetition avoidance: DRY (llama.cpp) and no-repeat-n-gram (Hugging Face).
//!
//! - [`Dry`]: "Don't Repeat Yourself" (llama.cpp `src/llama-sampler.cpp`, `llama_sampler_dry_*`,
//!   ported there from koboldcpp PR 982 by pi6am): subtracts `multiplier * base^(L - allowed_length)`
//!   from the logit of every token that would extend a repetition of length `L >= allowed_length`
//!   of the sequence's suffix.
//! - [`resolve_sequence_breakers`]: DRY's sequence breakers given as strings, turned into the
//!   token sequences llama.cpp's restart-sequence map holds (`get_overlapping_token_sequences`),
//!   from the vocabulary as data (no tokenizer dependency here).
//! - [`NoRepeatNGram`]: Hugging Face's `NoRepeatNGramLogitsProcessor` over prompt + generated ids.
//! - [`EncoderNoRepeatNGram`]: Hugging Face's `EncoderNoRepeatNGramLogitsProcessor`, with the
//!   prompt in the place of the encoder input.
//!
//! All three are stateful: they learn the sequence through [`LogitsProcessor::reset`] (the
//! prompt) and [`LogitsProcessor::accept`] (each committed token), never from the context's
//! ids, and a clone continues independently.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;

use super::{check_range, LogitsProcessor, ProcessorContext};
use crate::error::{ParamError, SampleError};

// ---------------------------------------------------------------------------------------------
// DRY
// ---------------------------------------------------------------------------------------------

/// llama.cpp's default DRY sequence breakers (`common/common.h`, `dry_sequence_breakers`):
/// newline, colon, double quote, asterisk. Strings: resolve them with
/// [`resolve_sequence_breakers`] where a tokenizer is known.
pub const DRY_DEFAULT_SEQUENCE_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

/// llama.cpp's default `dry_base`.
pub const DRY_DEFAULT_BASE: f64 = 1.75;

/// llama.cpp's default `dry_allowed_length`.
pub const DRY_DEFAULT_ALLOWED_LENGTH: i64 = 2;

/// llama.cpp's default `dry_penalty_last_n`: the whole history.
pub const DRY_DEFAULT_PENALTY_LAST_N: i64 = -1;

/// The longest breaker string, in bytes (llama.cpp's `MAX_CHAR_LEN` in `llama_sampler_init_dry`,
/// where a longer one is truncated with a warning; [`resolve_sequence_breakers`] rejects it).
pub const DRY_MAX_BREAKER_BYTES: usize = 40;

/// The most tail tokens a restart sequence keeps after its head (llama.cpp's `MAX_SEQ_LEN`, to
/// which `get_overlapping_token_sequences` truncates the tail's tokenisation). A token-id
/// breaker given to [`Dry::new`] may thus hold at most `1 + 20` tokens.
pub const DRY_MAX_BREAKER_TAIL: usize = 20;

/// The most breaker strings [`resolve_sequence_breakers`] takes (our bound; llama.cpp has none):
/// resolving costs one pass over the vocabulary per string.
pub const DRY_MAX_BREAKERS: usize = 64;

/// llama.cpp's `FLOAT_MAX_LOG` (`88.7228391f`, about `ln(f32::MAX)`), for the exponent clamp.
#[allow(clippy::excessive_precision)]
const FLOAT_MAX_LOG: f32 = 88.722_839_1;

pub(crate) fn dry_default_base() -> f64 {
    DRY_DEFAULT_BASE
}

pub(crate) fn dry_default_allowed_length() -> i64 {
    DRY_DEFAULT_ALLOWED_LENGTH
}

pub(crate) fn dry_default_penalty_last_n() -> i64 {
    DRY_DEFAULT_PENALTY_LAST_N
}

/// DRY ("Don't Repeat Yourself"): penalises the tokens that would extend a repetition of the
/// sequence's end, exactly as llama.cpp's `llama_sampler_dry_apply` / `_accept` / `_reset` /
/// `_clone` and `llama_sampler_init_dry` (`src/llama-sampler.cpp`) do.
///
/// # Algorithm
/// Let `w` be the last `N = min(len, penalty_last_n)` tokens of the history (prompt and
/// accepted tokens; `penalty_last_n = -1`: all of them).
/// 1. Nothing happens if `N <= allowed_length`.
/// 2. Restart limit (llama.cpp's step 1): walking back from the end, the first position that
///    starts a sequence breaker lying wholly inside `w` (the longest of the breakers starting
///    there) ends the search; `rep_limit` is the number of tokens after that breaker (`N` when
///    there is none). Nothing happens if `rep_limit < allowed_length`.
/// 3. For every earlier position `j` (`0 <= j <= N - 2`), `L_j` is the length of the longest
///    common suffix of `w[..=j]` and `w`, capped at `rep_limit` (llama.cpp's reverse
///    Z-algorithm, step 2; here a standard Z-function over the reversed window, then the cap,
///    which gives llama.cpp's clamped counts exactly). The token `w[j + 1]` would extend that
///    repetition: for each token `t`, `L(t)` is the largest `L_j >= allowed_length` with
///    `w[j + 1] = t` (step 3).
/// 4. Each such token that is not itself a single-token breaker (newer llama.cpp exempts
///    those) gets `l -= multiplier * base^e` with `e = L(t) - allowed_length`, clamped to
///    `max_exponent = trunc(88.7228391 / ln(base))` when `base > 1.000001` (both in f32, as
///    llama.cpp computes them). The penalty is rounded to f32 and subtracted in f32, as
///    llama.cpp does (its parameters are f32, ours f64 rounded once); a penalty beyond the f32
///    range makes the logit `-inf` (the token is removed), as llama.cpp's float arithmetic
///    does. `-inf` stays `-inf` (llama.cpp's candidates are our finite logits).
///
/// Sequence breakers are token-id sequences `[head, tail...]` (llama.cpp's
/// `llama_sampler_init_dry_testing` form; its restart-sequence map holds `head -> tail`). For
/// breakers given as strings see [`resolve_sequence_breakers`].
///
/// History: [`LogitsProcessor::reset`] takes the prompt (llama.cpp's server accepts the
/// prompt tokens into its sampler), [`LogitsProcessor::accept`] each committed token. Only the
/// last `penalty_last_n` tokens are kept (a capped buffer of at most `2 * penalty_last_n` ids);
/// with `-1` the whole history is kept: llama.cpp takes the context size there (`n_ctx` in the
/// server, `n_ctx_train` in `common`), we have none, so `-1` is the whole sequence since the
/// last reset (the same as llama.cpp while the sequence fits its context). Cloning copies the
/// history.
///
/// Off: `multiplier == 0` or `penalty_last_n == 0` (then nothing is stored either).
///
/// Place in the chain: the result depends on it. The penalty is an absolute subtraction, so a
/// temperature `T` after DRY divides it by `T` and one before does not; before a repetition
/// penalty it changes the signs that penalty sees; filters before it decide which finite
/// logits it sees (not which ids it penalises).
///
/// Cost per row: O(N) for the Z-function plus O(N * tails) worst case for the restart scan
/// (tails: the breakers sharing a head, each at most 20 long; the scan stops at the most recent
/// breaker), O(number of penalised tokens) for the row itself; no pass over the vocabulary. The
/// buffers (reversed window, Z values, per-token lengths) are kept across calls.
///
/// ```
/// use nucleus_sampling::chain::{Dry, LogitsProcessor, ProcessorContext};
///
/// // multiplier 0.8, base 1.75, allowed length 2, the whole history, no breakers.
/// let mut dry = Dry::new(0.8, 1.75, 2, -1, vec![]).unwrap();
/// dry.reset(&[1, 2, 3, 4, 1, 2, 3]); // "1 2 3" was followed by 4 before
/// let mut row = [0.0f32; 5];
/// dry.apply(&mut row, &ProcessorContext::default()).unwrap();
/// assert!((row[4] - -0.8 * 1.75).abs() < 1e-6); // repeat length 3: 0.8 * 1.75^(3 - 2)
/// assert_eq!(&row[..4], &[0.0; 4]);
/// ```
#[derive(Clone, Debug)]
pub struct Dry {
    multiplier: f64,
    base: f64,
    allowed_length: usize,
    /// `None`: the whole history (`-1`); `Some(0)`: off.
    last_n: Option<usize>,
    /// The breakers, sorted and deduplicated.
    breakers: Vec<Vec<u32>>,
    /// Head id -> tails (llama.cpp's `dry_processed_breakers`).
    restart: HashMap<u32, Vec<Vec<u32>>>,
    /// Heads with an empty tail (single-token breakers).
    single: HashSet<u32>,
    max_breaker_id: Option<u32>,
    history: Vec<u32>,
    max_prompt: Option<u32>,
    max_output: Option<u32>,
    /// The window reversed: `rev[i]` is llama.cpp's `last_tokens.rat(i)`.
    rev: Vec<u32>,
    z: Vec<usize>,
    /// Token -> longest repeat it would extend (llama.cpp's `dry_max_token_repeat`).
    best: HashMap<u32, usize>,
}

impl Dry {
    /// DRY with llama.cpp's parameters: `multiplier` (0 is off), `base`, `allowed_length`,
    /// `penalty_last_n` (-1: the whole history; 0: off) and the sequence breakers as token-id
    /// sequences `[head, tail...]` (any order, duplicates ignored; may be empty).
    ///
    /// # Errors
    /// [`ParamError`] naming the field:
    /// - `dry_multiplier` unless finite and `>= 0` (llama.cpp takes any float);
    /// - `dry_base` unless finite and `>= 1` (llama.cpp's sampler silently turns DRY off below
    ///   1 and its server silently substitutes 1.75; we reject it);
    /// - `dry_allowed_length` below 0;
    /// - `dry_penalty_last_n` below -1 (llama.cpp treats those as 0, off);
    /// - `dry_sequence_breakers` for an empty sequence (llama.cpp skips it with a warning) or
    ///   one longer than `1 + 20` tokens ([`DRY_MAX_BREAKER_TAIL`]).
    ///
    /// Breaker ids at or above the vocabulary size are reported when the chain runs
    /// ([`SampleError::TokenIdOutOfRange`]).
    pub fn new(
        multiplier: f64,
        base: f64,
        allowed_length: i64,
        penalty_last_n: i64,
        sequence_breakers: Vec<Vec<u32>>,
    ) -> Result<Self, ParamError> {
        if !(multiplier.is_finite() && multiplier >= 0.0) {
            return Err(ParamError::new(
                "dry_multiplier",
                multiplier,
                "a finite number >= 0 (0 disables DRY)",
            ));
        }
        if !(base.is_finite() && base >= 1.0) {
            return Err(ParamError::new("dry_base", base, "a finite number >= 1"));
        }
        let allowed_length = usize::try_from(allowed_length)
            .map_err(|_| ParamError::new("dry_allowed_length", allowed_length, ">= 0"))?;
        let last_n = match penalty_last_n {
            -1 => None,
            n => Some(usize::try_from(n).map_err(|_| {
                ParamError::new(
                    "dry_penalty_last_n",
                    penalty_last_n,
                    ">= -1 (-1: the whole history, 0: off)",
                )
            })?),
        };
        if let Some(s) = sequence_breakers
            .iter()
            .find(|s| s.is_empty() || s.len() > 1 + DRY_MAX_BREAKER_TAIL)
        {
            return Err(ParamError::new(
                "dry_sequence_breakers",
                format!("a sequence of {} tokens", s.len()),
                "token sequences of 1 to 21 ids (a head and at most 20 tail tokens)",
            ));
        }
        let breakers: Vec<Vec<u32>> = sequence_breakers
            .into_iter()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let mut restart: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        let mut single = HashSet::new();
        for b in &breakers {
            if b.len() == 1 {
                single.insert(b[0]);
            }
            restart.entry(b[0]).or_default().push(b[1..].to_vec());
        }
        Ok(Self {
            multiplier,
            base,
            allowed_length,
            last_n,
            max_breaker_id: breakers.iter().flatten().copied().max(),
            breakers,
            restart,
            single,
            history: Vec::new(),
            max_prompt: None,
            max_output: None,
            rev: Vec::new(),
            z: Vec::new(),
            best: HashMap::new(),
        })
    }

    /// The multiplier.
    pub fn multiplier(&self) -> f64 {
        self.multiplier
    }

    /// The base.
    pub fn base(&self) -> f64 {
        self.base
    }

    /// The allowed length.
    pub fn allowed_length(&self) -> usize {
        self.allowed_length
    }

    /// `penalty_last_n`: `None` for the whole history (-1).
    pub fn penalty_last_n(&self) -> Option<usize> {
        self.last_n
    }

    /// The breakers `[head, tail...]`, sorted, without duplicates.
    pub fn sequence_breakers(&self) -> &[Vec<u32>] {
        &self.breakers
    }

    /// Whether DRY does anything (`multiplier != 0` and `penalty_last_n != 0`).
    pub fn is_enabled(&self) -> bool {
        self.multiplier != 0.0 && self.last_n != Some(0)
    }

    /// The history DRY looks at now: the last `penalty_last_n` tokens of the prompt and the
    /// accepted tokens (empty when off).
    pub fn window(&self) -> &[u32] {
        let len = self.history.len();
        let n = self.last_n.map_or(len, |c| len.min(c));
        &self.history[len - n..]
    }

    /// DRY on `logits` for the sequence `prompt_ids ++ output_ids` given here instead of the
    /// processor's own history (which is neither read nor changed): for a caller that holds the
    /// whole sequence, as a stateless sampling path does. Same result as
    /// [`LogitsProcessor::apply`] after `reset(prompt_ids)` and `accept` of each output id.
    ///
    /// # Errors
    /// [`SampleError::TokenIdOutOfRange`] for a context or breaker id `>= logits.len()`.
    pub fn apply_to_sequence(
        &mut self,
        logits: &mut [f32],
        prompt_ids: &[u32],
        output_ids: &[u32],
    ) -> Result<(), SampleError> {
        let vocab = logits.len();
        check_range("dry_sequence_breakers", &self.max_breaker_id, vocab)?;
        check_range("prompt_ids", prompt_ids, vocab)?;
        check_range("output_ids", output_ids, vocab)?;
        if self.is_enabled() {
            self.penalize(logits, prompt_ids, output_ids);
        }
        Ok(())
    }

    fn push(&mut self, token: u32) {
        self.history.push(token);
        if let Some(cap) = self.last_n {
            if self.history.len() > cap.saturating_mul(2) {
                let excess = self.history.len() - cap;
                self.history.drain(..excess);
            }
        }
    }

    /// Steps 1-4 on the last `penalty_last_n` tokens of `a ++ b`.
    fn penalize(&mut self, logits: &mut [f32], a: &[u32], b: &[u32]) {
        let total = a.len() + b.len();
        let n = self.last_n.map_or(total, |c| total.min(c));
        if n <= self.allowed_length {
            return;
        }
        self.rev.clear();
        self.rev
            .extend(b.iter().rev().chain(a.iter().rev()).take(n).copied());
        let rep_limit = self.rep_limit();
        if rep_limit < self.allowed_length {
            return;
        }
        z_function(&self.rev, &mut self.z);
        // z[k] (k >= 1) is the longest common prefix of rev and rev[k..]: the longest common
        // suffix of the window and the window's first n - k tokens, whose end w[n - 1 - k] is
        // followed by w[n - k] = rev[k - 1]. llama.cpp stores min(z[k], rep_limit).
        self.best.clear();
        for k in 1..n {
            let len = self.z[k].min(rep_limit);
            if len >= self.allowed_length {
                let e = self.best.entry(self.rev[k - 1]).or_insert(len);
                *e = (*e).max(len);
            }
        }
        let base32 = self.base as f32;
        let max_exponent = if base32 > 1.000_001_f32 {
            (FLOAT_MAX_LOG / base32.ln()) as usize
        } else {
            0
        };
        for (&token, &len) in &self.best {
            if self.single.contains(&token) {
                continue;
            }
            let mut exponent = len - self.allowed_length;
            if max_exponent > 0 && exponent > max_exponent {
                exponent = max_exponent;
            }
            let penalty = (self.multiplier * self.base.powf(exponent as f64)) as f32;
            logits[token as usize] -= penalty;
        }
    }

    /// llama.cpp's step 1: the tokens after the most recent breaker in `rev`, or its length.
    fn rep_limit(&self) -> usize {
        let rev = &self.rev;
        for i in 0..rev.len() {
            let Some(tails) = self.restart.get(&rev[i]) else {
                continue;
            };
            // A tail of length m matches when rev[i - 1 - o] == tail[o] for o < m <= i.
            let longest = tails
                .iter()
                .filter(|t| {
                    t.len() <= i && t.iter().enumerate().all(|(o, &id)| rev[i - 1 - o] == id)
                })
                .map(Vec::len)
                .max();
            if let Some(m) = longest {
                return i - m;
            }
        }
        rev.len()
    }
}

/// `z[i]`: the length of the longest common prefix of `s` and `s[i..]` (`z[0] = s.len()`), in
/// O(len) (Gusfield's Z-algorithm).
fn z_function(s: &[u32], z: &mut Vec<usize>) {
    let n = s.len();
    z.clear();
    z.resize(n, 0);
    if n == 0 {
        return;
    }
    z[0] = n;
    let (mut l, mut r) = (0usize, 0usize); // the rightmost match box [l, r)
    for i in 1..n {
        let mut k = if i < r { (r - i).min(z[i - l]) } else { 0 };
        while i + k < n && s[k] == s[i + k] {
            k += 1;
        }
        z[i] = k;
        if i + k > r {
            l = i;
            r = i + k;
        }
    }
}

impl LogitsProcessor for Dry {
    fn name(&self) -> &str {
        "dry"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        if !self.is_enabled() {
            return Ok(());
        }
        let history = std::mem::take(&mut self.history);
        let start = history.len() - self.last_n.map_or(history.len(), |c| history.len().min(c));
        self.penalize(logits, &history[start..], &[]);
        self.history = history;
        Ok(())
    }
    fn reset(&mut self, prompt_ids: &[u32]) {
        self.history.clear();
        self.max_prompt = prompt_ids.iter().copied().max();
        self.max_output = None;
        if self.is_enabled() {
            let start = prompt_ids.len()
                - self
                    .last_n
                    .map_or(prompt_ids.len(), |c| prompt_ids.len().min(c));
            self.history.extend_from_slice(&prompt_ids[start..]);
        }
    }
    fn accept(&mut self, token: u32) {
        self.max_output = self.max_output.max(Some(token));
        if self.is_enabled() {
            self.push(token);
        }
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("dry_sequence_breakers", &self.max_breaker_id, vocab_size)?;
        check_range("prompt_ids", &self.max_prompt, vocab_size)?;
        check_range("output_ids", &self.max_output, vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// DRY's sequence breakers given as strings, resolved to the token sequences `[head, tail...]`
/// that llama.cpp's restart-sequence map holds after `llama_sampler_init_dry` (its breaker
/// preprocessing and `get_overlapping_token_sequences`, ported there from koboldcpp), for
/// [`Dry::new`].
///
/// For each breaker string `s` (bytes) and each token id `t` with text `w = token_texts[t]`:
/// - if `w` contains `s`, `[t]` is a single-token breaker;
/// - else, for every position `p` where `w[p] == s[0]` and the rest of `w` from `p` is a proper
///   prefix `s[..i]` of `s`, `[t] ++ encode(s[i..])` is a breaker (the tail's tokens truncated
///   to 20, [`DRY_MAX_BREAKER_TAIL`], as llama.cpp's `max_tail_len`).
///
/// The result is sorted and deduplicated (llama.cpp's multimap may hold a single-token entry
/// twice; the map's meaning is the set).
///
/// Arguments:
/// - `breakers`: the strings, e.g. [`DRY_DEFAULT_SEQUENCE_BREAKERS`]; each 1 to 40 bytes
///   ([`DRY_MAX_BREAKER_BYTES`]), at most 64 of them ([`DRY_MAX_BREAKERS`]).
/// - `token_texts`: one entry per token id, `vocab_size` of them: the bytes llama.cpp's
///   `llama_vocab::detokenize({id}, /*special=*/true)` gives (special tokens as their text;
///   for SentencePiece vocabularies with a space prefix, the leading space removed; a
///   byte-level token may be an incomplete UTF-8 sequence, hence bytes).
/// - `encode`: tokenises a tail without BOS/EOS and without parsing special tokens (llama.cpp's
///   `tokenize(s, /*add_special=*/false, /*parse_special=*/false)`). A tail is a byte string:
///   when a head token's text ends inside a multi-byte character of the breaker, the tail starts
///   with continuation bytes, which llama.cpp tokenises as they are (byte tokens in a byte-level
///   vocabulary). Each distinct tail is encoded once.
///
/// Cost: one pass over the vocabulary per breaker, O(sum of token text lengths * 40).
///
/// # Errors
/// [`ParamError`] for `dry_sequence_breakers`: more than 64 strings, an empty string (llama.cpp
/// skips it with a warning), one longer than 40 bytes (llama.cpp truncates it with a warning),
/// a vocabulary beyond u32 ids, or `encode` failing (its message included).
///
/// ```
/// use nucleus_sampling::chain::resolve_sequence_breakers;
///
/// let texts = ["a", "b", "x\n", "ab", "c"];
/// // "\n" is inside token 2; "ab" is token 3, and token 0 ("a") starts it, followed by "b".
/// let encode = |s: &[u8]| -> Result<Vec<u32>, String> {
///     match s {
///         b"b" => Ok(vec![1]),
///         _ => Err(format!("no tokens for {s:?}")),
///     }
/// };
/// let got = resolve_sequence_breakers(&["\n", "ab"], &texts, encode).unwrap();
/// assert_eq!(got, vec![vec![0, 1], vec![2], vec![3]]);
/// ```
pub fn resolve_sequence_breakers<S, T, E>(
    breakers: &[S],
    token_texts: &[T],
    mut encode: impl FnMut(&[u8]) -> Result<Vec<u32>, E>,
) -> Result<Vec<Vec<u32>>, ParamError>
where
    S: AsRef<str>,
    T: AsRef<[u8]>,
    E: fmt::Display,
{
    const FIELD: &str = "dry_sequence_breakers";
    const ALLOWED: &str = "at most 64 strings of 1 to 40 bytes";
    if breakers.len() > DRY_MAX_BREAKERS {
        return Err(ParamError::new(
            FIELD,
            format!("{} strings", breakers.len()),
            ALLOWED,
        ));
    }
    if token_texts.len() > u32::MAX as usize + 1 {
        return Err(ParamError::new(
            FIELD,
            format!("a vocabulary of {} tokens", token_texts.len()),
            "a vocabulary whose ids fit u32",
        ));
    }
    let mut out = BTreeSet::new();
    for breaker in breakers {
        let breaker = breaker.as_ref();
        let s = breaker.as_bytes();
        if s.is_empty() || s.len() > DRY_MAX_BREAKER_BYTES {
            return Err(ParamError::new(
                FIELD,
                format!("{breaker:?} ({} bytes)", s.len()),
                ALLOWED,
            ));
        }
        // tails[i]: the tokens of s[i..], truncated to 20.
        let mut tails: Vec<Option<Vec<u32>>> = vec![None; s.len()];
        for (id, text) in token_texts.iter().enumerate() {
            let id = id as u32;
            let w = text.as_ref();
            if w.len() >= s.len() && w.windows(s.len()).any(|x| x == s) {
                out.insert(vec![id]);
                continue;
            }
            for pos in (0..w.len()).filter(|&p| w[p] == s[0]) {
                // The loop of get_overlapping_token_sequences: compare until s or w ends.
                let mut i = 1;
                while i < s.len() && pos + i < w.len() && w[pos + i] == s[i] {
                    i += 1;
                }
                if i < s.len() && pos + i < w.len() {
                    continue; // a mismatch inside w
                }
                if i == s.len() {
                    out.insert(vec![id]); // not reached: w would contain s
                    continue;
                }
                // w[pos..] == s[..i] with i < s.len() (w does not contain s).
                if tails[i].is_none() {
                    let mut t = encode(&s[i..]).map_err(|e| {
                        ParamError::new(
                            FIELD,
                            format!(
                                "{breaker:?}: encoding its tail {:?} failed: {e}",
                                String::from_utf8_lossy(&s[i..])
                            ),
                            "strings whose tails the tokenizer can encode",
                        )
                    })?;
                    t.truncate(DRY_MAX_BREAKER_TAIL);
                    tails[i] = Some(t);
                }
                let mut seq = vec![id];
                seq.extend_from_slice(tails[i].as_deref().unwrap_or(&[]));
                out.insert(seq);
            }
        }
    }
    Ok(out.into_iter().collect())
}

// ---------------------------------------------------------------------------------------------
// No-repeat n-grams
// ---------------------------------------------------------------------------------------------

/// An incremental index of the n-grams of a sequence: for every distinct `(n - 1)`-gram, the
/// distinct tokens that followed it (Hugging Face's `_get_ngrams` dictionary, built one token
/// at a time). Keys are referred to by position in `seq` (not copied) and found by a hash whose
/// collisions are resolved by comparing the tokens, so memory is O(len) whatever `n`.
#[derive(Clone, Debug)]
struct NGramIndex {
    n: usize,
    seq: Vec<u32>,
    /// Hash of an (n - 1)-gram -> the entries with that hash.
    buckets: HashMap<u64, Vec<usize>>,
    entries: Vec<NGramEntry>,
    /// (entry, next token) pairs recorded, so that each entry's list has no duplicates.
    recorded: HashSet<(usize, u32)>,
    max_id: Option<u32>,
}

#[derive(Clone, Debug)]
struct NGramEntry {
    /// Where the key's first occurrence starts in `seq`.
    start: usize,
    /// The distinct tokens that followed the key, in first-seen order.
    next: Vec<u32>,
}

impl NGramIndex {
    fn new(n: usize) -> Self {
        Self {
            n,
            seq: Vec::new(),
            buckets: HashMap::new(),
            entries: Vec::new(),
            recorded: HashSet::new(),
            max_id: None,
        }
    }

    fn clear(&mut self) {
        self.seq.clear();
        self.buckets.clear();
        self.entries.clear();
        self.recorded.clear();
        self.max_id = None;
    }

    /// Appends `token` and indexes the n-gram it completes. O(n) expected.
    fn push(&mut self, token: u32) {
        self.max_id = self.max_id.max(Some(token));
        self.seq.push(token);
        let len = self.seq.len();
        if len < self.n {
            return;
        }
        let start = len - self.n;
        let key = &self.seq[start..len - 1];
        let hash = hash_ids(key);
        let entry = match self.find_hashed(hash, key) {
            Some(e) => e,
            None => {
                let e = self.entries.len();
                self.entries.push(NGramEntry {
                    start,
                    next: Vec::new(),
                });
                self.buckets.entry(hash).or_default().push(e);
                e
            }
        };
        if self.recorded.insert((entry, token)) {
            self.entries[entry].next.push(token);
        }
    }

    /// The entry of the `(n - 1)`-gram `key`, if it occurred followed by a token.
    fn find(&self, key: &[u32]) -> Option<usize> {
        self.find_hashed(hash_ids(key), key)
    }

    fn find_hashed(&self, hash: u64, key: &[u32]) -> Option<usize> {
        self.buckets.get(&hash)?.iter().copied().find(|&e| {
            let s = self.entries[e].start;
            self.seq[s..s + key.len()] == *key
        })
    }

    fn banned(&self, entry: Option<usize>) -> &[u32] {
        entry.map_or(&[], |e| &self.entries[e].next)
    }
}

/// A 64-bit hash of a token sequence (multiply-xorshift per id, length mixed in).
fn hash_ids(ids: &[u32]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64 ^ ids.len() as u64;
    for &x in ids {
        h = (h ^ u64::from(x)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 31;
    }
    h
}

fn ngram_size(field: &'static str, n: i64) -> Result<usize, ParamError> {
    match usize::try_from(n) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(ParamError::new(field, n, "an integer > 0")),
    }
}

/// No repeated n-grams: bans (`-inf`) every token that would complete an `ngram_size`-gram
/// already present in the sequence (Hugging Face `src/transformers/generation/logits_process.py`:
/// `NoRepeatNGramLogitsProcessor`, `_get_ngrams`, `_get_generated_ngrams`,
/// `_calc_banned_ngram_tokens`, from fairseq).
///
/// The sequence is Hugging Face's `input_ids` for a decoder-only model: the prompt
/// ([`LogitsProcessor::reset`]) followed by the accepted tokens ([`LogitsProcessor::accept`]).
/// With `cur_len` tokens, nothing is banned while `cur_len + 1 < ngram_size`; otherwise the
/// banned tokens are those that followed an earlier occurrence of the last `ngram_size - 1`
/// tokens. `ngram_size = 1` bans every token already in the sequence. The context's ids are not
/// read. Cloning copies the index; a clone continues independently.
///
/// Place in the chain: a ban is `-inf` wherever it runs, and temperature does not change it;
/// filters that look at the whole row (top-k, top-p, min-p) see a different set when they run
/// before it (e.g. top-k then a ban may leave fewer than k).
///
/// Cost: the index is built incrementally, O(n) expected per accepted token (one hash of the
/// new key, compared on collision); a row costs O(banned tokens), plus O(prompt * n) at reset.
/// Memory O(sequence length) whatever `n`.
///
/// ```
/// use nucleus_sampling::chain::{LogitsProcessor, NoRepeatNGram, ProcessorContext};
///
/// let mut p = NoRepeatNGram::new(2).unwrap();
/// p.reset(&[1, 2, 3, 1]); // bigrams (1,2) (2,3) (3,1); the last token is 1
/// let mut row = [0.0f32; 4];
/// p.apply(&mut row, &ProcessorContext::default()).unwrap();
/// assert_eq!(row, [0.0, 0.0, f32::NEG_INFINITY, 0.0]); // token 2: (1,2) would repeat
/// ```
#[derive(Clone, Debug)]
pub struct NoRepeatNGram {
    index: NGramIndex,
    /// The entry of the sequence's last n - 1 tokens.
    current: Option<usize>,
    max_prompt: Option<u32>,
}

impl NoRepeatNGram {
    /// N-grams of `ngram_size` tokens may occur once.
    ///
    /// # Errors
    /// [`ParamError`] for `no_repeat_ngram_size` unless it is `> 0` (Hugging Face raises
    /// `ValueError` too).
    pub fn new(ngram_size: i64) -> Result<Self, ParamError> {
        let n = self::ngram_size("no_repeat_ngram_size", ngram_size)?;
        Ok(Self {
            index: NGramIndex::new(n),
            current: None,
            max_prompt: None,
        })
    }

    /// `ngram_size`.
    pub fn ngram_size(&self) -> usize {
        self.index.n
    }

    /// The tokens banned at the next step, in first-seen order.
    pub fn banned_tokens(&self) -> &[u32] {
        self.index.banned(self.current)
    }

    fn update_current(&mut self) {
        let (n, len) = (self.index.n, self.index.seq.len());
        self.current = if len + 1 >= n {
            self.index.find(&self.index.seq[len + 1 - n..])
        } else {
            None
        };
    }
}

impl LogitsProcessor for NoRepeatNGram {
    fn name(&self) -> &str {
        "no_repeat_ngram"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        for &t in self.index.banned(self.current) {
            logits[t as usize] = f32::NEG_INFINITY;
        }
        Ok(())
    }
    fn reset(&mut self, prompt_ids: &[u32]) {
        self.index.clear();
        for &t in prompt_ids {
            self.index.push(t);
        }
        self.max_prompt = self.index.max_id;
        self.update_current();
    }
    fn accept(&mut self, token: u32) {
        self.index.push(token);
        self.update_current();
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("prompt_ids", &self.max_prompt, vocab_size)?;
        check_range("output_ids", &self.index.max_id, vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// No repetition of the encoder input's n-grams: bans (`-inf`) every token that, after the last
/// `encoder_ngram_size - 1` generated tokens, would complete an `encoder_ngram_size`-gram of
/// the encoder input (Hugging Face `src/transformers/generation/logits_process.py`:
/// `EncoderNoRepeatNGramLogitsProcessor`, from ParlAI).
///
/// Our reading: the encoder input is the prompt ([`LogitsProcessor::reset`]); the decoder ids
/// whose last `n - 1` tokens form the key are the tokens accepted since the reset
/// ([`LogitsProcessor::accept`]), the prompt excluded. Hugging Face refuses this processor for
/// decoder-only models ("impossible to use `encoder_no_repeat_ngram_size` with decoder-only
/// architecture"), though its docstring describes exactly this use (not repeating n-grams of
/// earlier conversation rounds, with a decoder-only example); we allow it for any model. Its
/// decoder ids start with the decoder start token, ours do not: with fewer than `n - 1`
/// generated tokens nothing is banned (Hugging Face's key is then too short to match anything
/// too). `encoder_ngram_size = 1` bans every prompt token from the first step. The n-grams
/// generated so far are not banned (that is [`NoRepeatNGram`]). The context's ids are not read.
/// Cloning copies the state.
///
/// Place in the chain: as [`NoRepeatNGram`].
///
/// Cost: O(prompt * n) at reset to index the prompt; O(n) expected per accepted token (the new
/// key's lookup); a row costs O(banned tokens). Memory O(prompt + n).
///
/// ```
/// use nucleus_sampling::chain::{EncoderNoRepeatNGram, LogitsProcessor, ProcessorContext};
///
/// let mut p = EncoderNoRepeatNGram::new(2).unwrap();
/// p.reset(&[1, 2, 3]); // the prompt's bigrams (1,2) (2,3)
/// p.accept(2);
/// let mut row = [0.0f32; 4];
/// p.apply(&mut row, &ProcessorContext::default()).unwrap();
/// assert_eq!(row, [0.0, 0.0, 0.0, f32::NEG_INFINITY]); // (2,3) is the prompt's
/// ```
#[derive(Clone, Debug)]
pub struct EncoderNoRepeatNGram {
    index: NGramIndex,
    /// The last generated tokens (at most 2 * (n - 1), at least the last n - 1 once there).
    recent: Vec<u32>,
    current: Option<usize>,
    max_output: Option<u32>,
}

impl EncoderNoRepeatNGram {
    /// The prompt's n-grams of `encoder_ngram_size` tokens may not be generated.
    ///
    /// # Errors
    /// [`ParamError`] for `encoder_no_repeat_ngram_size` unless it is `> 0` (Hugging Face
    /// raises `ValueError` too).
    pub fn new(encoder_ngram_size: i64) -> Result<Self, ParamError> {
        let n = ngram_size("encoder_no_repeat_ngram_size", encoder_ngram_size)?;
        Ok(Self {
            index: NGramIndex::new(n),
            recent: Vec::new(),
            current: None,
            max_output: None,
        })
    }

    /// `encoder_ngram_size`.
    pub fn encoder_ngram_size(&self) -> usize {
        self.index.n
    }

    /// The tokens banned at the next step, in first-seen order.
    pub fn banned_tokens(&self) -> &[u32] {
        self.index.banned(self.current)
    }

    fn update_current(&mut self) {
        let k = self.index.n - 1;
        let len = self.recent.len();
        self.current = if len >= k {
            self.index.find(&self.recent[len - k..])
        } else {
            None
        };
    }
}

impl LogitsProcessor for EncoderNoRepeatNGram {
    fn name(&self) -> &str {
        "encoder_no_repeat_ngram"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        for &t in self.index.banned(self.current) {
            logits[t as usize] = f32::NEG_INFINITY;
        }
        Ok(())
    }
    fn reset(&mut self, prompt_ids: &[u32]) {
        self.index.clear();
        for &t in prompt_ids {
            self.index.push(t);
        }
        self.recent.clear();
        self.max_output = None;
        self.update_current();
    }
    fn accept(&mut self, token: u32) {
        self.max_output = self.max_output.max(Some(token));
        let k = self.index.n - 1;
        if k > 0 {
            self.recent.push(token);
            if self.recent.len() > k.saturating_mul(2) {
                let excess = self.recent.len() - k;
                self.recent.drain(..excess);
            }
        }
        self.update_current();
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("prompt_ids", &self.index.max_id, vocab_size)?;
        check_range("output_ids", &self.max_output, vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}
