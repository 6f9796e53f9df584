//! Hard constraints (spec/sampling.md step 3): processors that remove tokens by writing `-inf`.

use super::{check_range, LogitsProcessor, ProcessorContext};
use crate::error::{ParamError, SampleError};

/// Only these ids may be chosen: every other logit becomes `-inf` (spec step 3; vLLM's
/// `allowed_token_ids`). Stateless. O(vocab) per row.
///
/// Place in the chain: a hard constraint: `-inf` stays `-inf` through every later processor, so it commutes
/// with everything after it; a processor that writes finite values over `-inf` (forced BOS/EOS,
/// `inf_nan_remove`) undoes it when placed after it.
#[derive(Clone, Debug, PartialEq)]
pub struct AllowedTokenIds {
    /// Sorted, without duplicates.
    ids: Vec<u32>,
}

impl AllowedTokenIds {
    /// Allows exactly `ids` (any order, duplicates ignored).
    ///
    /// # Errors
    /// [`ParamError`] for `allowed_token_ids` when `ids` is empty. Ids at or above the
    /// vocabulary size are reported when the chain runs ([`SampleError::TokenIdOutOfRange`]).
    pub fn new(mut ids: Vec<u32>) -> Result<Self, ParamError> {
        if ids.is_empty() {
            return Err(ParamError::new(
                "allowed_token_ids",
                "[]",
                "at least one token id, or none (all allowed)",
            ));
        }
        ids.sort_unstable();
        ids.dedup();
        Ok(Self { ids })
    }

    /// The allowed ids, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

impl LogitsProcessor for AllowedTokenIds {
    fn name(&self) -> &str {
        "allowed_token_ids"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        let mut next = self.ids.iter().peekable();
        for (i, l) in logits.iter_mut().enumerate() {
            if next.peek() == Some(&&(i as u32)) {
                next.next();
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("allowed_token_ids", self.ids.last(), vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Banned token sequences (spec step 3; vLLM's `bad_words` as token ids): the last token of a
/// sequence becomes `-inf` when the generated ids ([`ProcessorContext::output_ids`]) end with
/// the rest of it; a one-token sequence is always banned. Stateless.
///
/// Place in the chain: as [`AllowedTokenIds`].
#[derive(Clone, Debug, PartialEq)]
pub struct BadWords {
    words: Vec<Vec<u32>>,
}

impl BadWords {
    /// Bans `words`.
    ///
    /// # Errors
    /// [`ParamError`] for `bad_words` when a sequence is empty.
    pub fn new(words: Vec<Vec<u32>>) -> Result<Self, ParamError> {
        if words.iter().any(Vec::is_empty) {
            return Err(ParamError::new(
                "bad_words",
                "an empty sequence",
                "non-empty token sequences",
            ));
        }
        Ok(Self { words })
    }

    /// The banned sequences.
    pub fn words(&self) -> &[Vec<u32>] {
        &self.words
    }
}

impl LogitsProcessor for BadWords {
    fn name(&self) -> &str {
        "bad_words"
    }
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        for word in &self.words {
            if let Some((&last, prefix)) = word.split_last() {
                if ctx.output_ids.ends_with(prefix) {
                    logits[last as usize] = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("bad_words", self.words.iter().flatten(), vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Bans the EOS and stop ids ([`ProcessorContext::stop_token_ids`]) while fewer than
/// `min_tokens` tokens have been generated (`ctx.output_ids.len() < min_tokens`; spec step 3,
/// vLLM's `min_tokens`). Stateless. 0 is off.
///
/// Place in the chain: as [`AllowedTokenIds`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MinTokens {
    min_tokens: usize,
}

impl MinTokens {
    /// Bans the stop ids until `min_tokens` tokens were generated. Every value is valid.
    pub fn new(min_tokens: usize) -> Self {
        Self { min_tokens }
    }

    /// The minimum number of generated tokens.
    pub fn min_tokens(&self) -> usize {
        self.min_tokens
    }
}

impl LogitsProcessor for MinTokens {
    fn name(&self) -> &str {
        "min_tokens"
    }
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        if ctx.output_ids.len() < self.min_tokens {
            check_range("stop_token_ids", ctx.stop_token_ids, logits.len())?;
            for &id in ctx.stop_token_ids {
                logits[id as usize] = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Forces one token as the first generated token (Hugging Face's
/// `ForcedBOSTokenLogitsProcessor`, src/transformers/generation/logits_process.py): while no
/// token has been generated ([`ProcessorContext::output_ids`] empty), every logit becomes
/// `-inf` and the logit of `bos_token_id` becomes `0`, as Hugging Face writes it
/// (`torch.full_like(scores, -inf)`, then `scores[:, bos_token_id] = 0`). From the second
/// generated token on it does nothing. Stateless.
///
/// Position: Hugging Face fires at `input_ids.shape[-1] == 1`, the decoder's start token
/// alone of an encoder-decoder, i.e. the step that chooses the first generated token; here
/// the count comes from the context's `output_ids` (`output_ids.len() == 0`), whatever the
/// prompt's length, so that a decoder-only prompt of any length forces its first token too.
///
/// Place in the chain: the forced row overrides everything before it, masks included (a BOS
/// banned by the token bitmask, `bad_words` or `suppress_tokens` earlier becomes `0` again, as
/// in Hugging Face, which applies its processors to the scores in order); a processor after it
/// sees one finite logit (0), and a later ban of the BOS leaves no candidate
/// ([`SampleError::NoCandidates`]). O(vocab) on the first step, O(1) after.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForcedBos {
    bos_token_id: u32,
}

impl ForcedBos {
    /// Forces `bos_token_id` as the first generated token. Every id is valid here; one at or
    /// above the vocabulary size is reported when the chain runs
    /// ([`SampleError::TokenIdOutOfRange`] for `bos_token_id`).
    pub fn new(bos_token_id: u32) -> Self {
        Self { bos_token_id }
    }

    /// The forced id.
    pub fn bos_token_id(&self) -> u32 {
        self.bos_token_id
    }
}

impl LogitsProcessor for ForcedBos {
    fn name(&self) -> &str {
        "forced_bos_token"
    }
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        if ctx.output_ids.is_empty() {
            logits.fill(f32::NEG_INFINITY);
            logits[self.bos_token_id as usize] = 0.0;
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("bos_token_id", [&self.bos_token_id], vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Forces an EOS token as the last token when the maximum length is reached (Hugging Face's
/// `ForcedEOSTokenLogitsProcessor`, src/transformers/generation/logits_process.py): when the
/// whole sequence so far, prompt included, has `max_length - 1` tokens
/// (`ctx.prompt_ids.len() + ctx.output_ids.len() == max_length - 1`, Hugging Face's
/// `input_ids.shape[-1] == max_length - 1`), every logit becomes `-inf` and the logit of every
/// id of `eos_token_id` becomes `0` (several EOS ids stay equally likely, as Hugging Face
/// writes them). At any other length it does nothing, past `max_length` included. Stateless.
///
/// Position: the length comes from the context's `prompt_ids` and `output_ids` (not
/// [`ProcessorContext::position`]); `max_length` counts the prompt, as Hugging Face's does.
///
/// Place in the chain: as [`ForcedBos`], the forced row overrides everything before it, masks
/// included. O(vocab) on the forcing step, O(1) otherwise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForcedEos {
    max_length: usize,
    /// Sorted, without duplicates.
    eos_token_id: Vec<u32>,
}

impl ForcedEos {
    /// Forces one of `eos_token_id` (any order, duplicates ignored) at length `max_length`.
    ///
    /// # Errors
    /// [`ParamError`] for `max_length` when it is 0 (no sequence ever has length -1: Hugging
    /// Face's processor would silently never fire) and for `eos_token_id` when it is empty
    /// (Hugging Face rejects it: `torch.tensor([])` is a float tensor). Ids at or above the
    /// vocabulary size are reported when the chain runs ([`SampleError::TokenIdOutOfRange`]).
    pub fn new(max_length: usize, mut eos_token_id: Vec<u32>) -> Result<Self, ParamError> {
        if max_length == 0 {
            return Err(ParamError::new(
                "max_length",
                0,
                ">= 1 (the whole sequence's length, prompt included)",
            ));
        }
        if eos_token_id.is_empty() {
            return Err(ParamError::new(
                "eos_token_id",
                "[]",
                "at least one token id",
            ));
        }
        eos_token_id.sort_unstable();
        eos_token_id.dedup();
        Ok(Self {
            max_length,
            eos_token_id,
        })
    }

    /// The maximum length, prompt included.
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// The EOS ids, ascending.
    pub fn eos_token_id(&self) -> &[u32] {
        &self.eos_token_id
    }
}

impl LogitsProcessor for ForcedEos {
    fn name(&self) -> &str {
        "forced_eos_token"
    }
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        if ctx.prompt_ids.len() + ctx.output_ids.len() + 1 == self.max_length {
            logits.fill(f32::NEG_INFINITY);
            for &id in &self.eos_token_id {
                logits[id as usize] = 0.0;
            }
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("eos_token_id", self.eos_token_id.last(), vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Bans some ids at every step (Hugging Face's `SuppressTokensLogitsProcessor`,
/// src/transformers/generation/logits_process.py, made for Whisper): their logits become
/// `-inf`. An empty list suppresses nothing (Hugging Face accepts it). Stateless; O(ids).
///
/// Place in the chain: a hard constraint; it commutes with every processor that keeps `-inf`
/// as `-inf` (all but [`ForcedBos`], [`ForcedEos`] and [`InfNanRemove`], which write over it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuppressTokens {
    /// Sorted, without duplicates.
    suppress_tokens: Vec<u32>,
}

impl SuppressTokens {
    /// Suppresses `suppress_tokens` (any order, duplicates ignored). Every list is valid; ids
    /// at or above the vocabulary size are reported when the chain runs
    /// ([`SampleError::TokenIdOutOfRange`] for `suppress_tokens`).
    pub fn new(mut suppress_tokens: Vec<u32>) -> Self {
        suppress_tokens.sort_unstable();
        suppress_tokens.dedup();
        Self { suppress_tokens }
    }

    /// The suppressed ids, ascending.
    pub fn suppress_tokens(&self) -> &[u32] {
        &self.suppress_tokens
    }
}

impl LogitsProcessor for SuppressTokens {
    fn name(&self) -> &str {
        "suppress_tokens"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        for &id in &self.suppress_tokens {
            logits[id as usize] = f32::NEG_INFINITY;
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("suppress_tokens", self.suppress_tokens.last(), vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Bans some ids at one step only, by default the first generated token (Hugging Face's
/// `SuppressTokensAtBeginLogitsProcessor`, src/transformers/generation/logits_process.py,
/// made for Whisper, whose `begin_suppress_tokens` keep a blank or EOS from opening the
/// transcript): their logits become `-inf` when exactly `begin_index` tokens have been
/// generated (`ctx.output_ids.len() == begin_index`), at no other step. Stateless; O(ids).
///
/// Position: Hugging Face's `begin_index` is a length of the whole sequence
/// (`input_ids.shape[-1] == begin_index`), which `generate` sets to the prompt's length (one
/// more when an encoder-decoder also forces a BOS): the step choosing the first token it
/// generates freely. Here `begin_index` counts generated tokens, from the context's
/// `output_ids`, so the default 0 is that same step for every prompt; with a [`ForcedBos`]
/// before it, use `begin_index` 1, as `generate` does.
///
/// Place in the chain: as [`SuppressTokens`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuppressTokensAtBegin {
    /// Sorted, without duplicates.
    begin_suppress_tokens: Vec<u32>,
    begin_index: usize,
}

impl SuppressTokensAtBegin {
    /// Suppresses `begin_suppress_tokens` (any order, duplicates ignored) when `begin_index`
    /// tokens have been generated. Every value is valid; ids at or above the vocabulary size
    /// are reported when the chain runs ([`SampleError::TokenIdOutOfRange`] for
    /// `begin_suppress_tokens`).
    pub fn new(mut begin_suppress_tokens: Vec<u32>, begin_index: usize) -> Self {
        begin_suppress_tokens.sort_unstable();
        begin_suppress_tokens.dedup();
        Self {
            begin_suppress_tokens,
            begin_index,
        }
    }

    /// The suppressed ids, ascending.
    pub fn begin_suppress_tokens(&self) -> &[u32] {
        &self.begin_suppress_tokens
    }

    /// The number of generated tokens at which they are suppressed.
    pub fn begin_index(&self) -> usize {
        self.begin_index
    }
}

impl LogitsProcessor for SuppressTokensAtBegin {
    fn name(&self) -> &str {
        "suppress_tokens_at_begin"
    }
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        if ctx.output_ids.len() == self.begin_index {
            for &id in &self.begin_suppress_tokens {
                logits[id as usize] = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range(
            "begin_suppress_tokens",
            self.begin_suppress_tokens.last(),
            vocab_size,
        )
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Replaces NaN and infinite logits by finite ones (Hugging Face's
/// `InfNanRemoveLogitsProcessor`, src/transformers/generation/logits_process.py, its current
/// form): NaN becomes `0`, `+inf` becomes `f32::MAX` and `-inf` becomes `f32::MIN`
/// (`torch.finfo(float32).max` / `.min`; older versions of the class left `-inf` as it was).
/// Finite logits are unchanged. Stateless; one pass over the row.
///
/// It is the one built-in processor that takes rows holding NaN or `+inf`
/// ([`LogitsProcessor::accepts_non_finite`] is `true`). Its place in the chain decides what it
/// does:
/// - First in a chain (alone or with other such processors before it), it runs on the row as
///   given, before the token bitmask and the row check of spec step 1 (see
///   [`super::SamplerChain`]): a row holding NaN or `+inf`, which the chain otherwise rejects
///   ([`SampleError::NonFiniteLogits`]), is sampled. A `+inf` becomes the largest logit (one
///   `+inf` takes all the mass, several share it equally); a `-inf` turned into `f32::MIN` is
///   a candidate again, with weight `exp(f32::MIN - max)`: 0 unless every token was `-inf`,
///   in which case every token has weight 1 and the distribution is uniform, as in Hugging
///   Face (where such a row would otherwise give NaN probabilities). Tokens masked by the
///   token bitmask stay removed: the bitmask comes after it.
/// - Anywhere else it sees a row the chain already checked (no NaN, no `+inf`), so its one
///   effect is to turn every `-inf` (every token removed by the processors before it) into
///   `f32::MIN`: a candidate of weight 0 unless every token was removed.
///
/// The fixed `SamplingParams` path has no such step: a NaN or `+inf` there stays the typed
/// error [`SampleError::NonFiniteLogits`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InfNanRemove;

impl InfNanRemove {
    /// The processor; it has no parameters.
    pub fn new() -> Self {
        Self
    }
}

impl LogitsProcessor for InfNanRemove {
    fn name(&self) -> &str {
        "inf_nan_remove"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        // Branch-free (vectorises): clamp takes ±inf to MAX / MIN and keeps NaN, then NaN -> 0.
        for l in logits.iter_mut() {
            let c = l.clamp(f32::MIN, f32::MAX);
            *l = if c.is_nan() { 0.0 } else { c };
        }
        Ok(())
    }
    fn accepts_non_finite(&self) -> bool {
        true
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(*self)
    }
}

/// Serde helpers for Hugging Face's `eos_token_id`: one id or a list of ids (read), always a
/// list (written, the default `Vec<u32>` form).
pub(crate) mod token_ids {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(u32),
        Many(Vec<u32>),
    }

    impl From<OneOrMany> for Vec<u32> {
        fn from(ids: OneOrMany) -> Self {
            match ids {
                OneOrMany::One(id) => vec![id],
                OneOrMany::Many(ids) => ids,
            }
        }
    }

    /// An id or a list of ids.
    pub fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        OneOrMany::deserialize(d).map(Vec::from)
    }

    /// An id, a list of ids, or `null` (`None`); use with `#[serde(default)]`.
    pub fn optional<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u32>>, D::Error> {
        Option::<OneOrMany>::deserialize(d).map(|ids| ids.map(Vec::from))
    }
}
