//! Hard constraints (spec/sampling.md step 3): processors that remove tokens by writing `-inf`.

use super::{check_range, LogitsProcessor, ProcessorContext};
use crate::error::{ParamError, SampleError};

/// Only these ids may be chosen: every other logit becomes `-inf` (spec step 3; vLLM's
/// `allowed_token_ids`). Stateless. O(vocab) per row.
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
