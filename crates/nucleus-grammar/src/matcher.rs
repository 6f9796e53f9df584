//! [`GrammarMatcher`]: one request's grammar state (bitmask, commit, rollback, termination),
//! and [`fill_bitmasks`] for a batch.

use rayon::prelude::*;

use crate::depth::{MATCHER_RED_ZONE_BYTES, MATCHER_STACK_BYTES};
use crate::error::{GrammarError, Result};
use crate::tokenizer::TokenEnv;

/// Runs `f` (an llguidance call) where at least 1 MiB of stack is left: on the caller's stack
/// when it has that much, else on a fresh 8 MiB one (stacker), so a matcher works on any
/// thread whatever its stack size. Costs a comparison of the stack pointer when there is room.
pub(crate) fn on_stack<R>(f: impl FnOnce() -> R) -> R {
    stacker::maybe_grow(MATCHER_RED_ZONE_BYTES, MATCHER_STACK_BYTES, f)
}

/// One request's position in a compiled grammar (a wrapper of llguidance's `Matcher`).
///
/// The decode loop of seed 001 §05: [`fill_bitmask`](Self::fill_bitmask) → set the logits of
/// disallowed ids to -inf → sample → [`commit`](Self::commit) the sampled token → repeat; EOS is
/// allowed only when the text so far is a complete match ([`may_end`](Self::may_end)).
///
/// Differences from llguidance's `Matcher`, so that bad input never breaks a request:
/// - `commit` validates first and returns [`GrammarError::TokenRejected`] for an illegal token,
///   leaving the matcher as it was (llguidance's `consume_token` would put it in a permanent
///   error state);
/// - EOS is handled here, never passed to llguidance: committing EOS ends the matcher
///   ([`is_ended`](Self::is_ended)), and `rollback` over it re-opens it;
/// - ids at or above the vocabulary size are typed errors, not an llguidance error state.
///
/// Obtained from [`crate::CompiledGrammar::matcher`] or [`crate::GrammarCompiler::matcher`];
/// `Send`, so batches can be filled on worker threads ([`fill_bitmasks`]).
pub struct GrammarMatcher {
    inner: llguidance::Matcher,
    env: TokenEnv,
    /// Tokens given to llguidance (EOS excluded).
    consumed: usize,
    /// The EOS id committed last, if any (the matcher then takes nothing more).
    eos: Option<u32>,
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher")
            .field("committed", &self.committed_len())
            .field("eos", &self.eos)
            .field("error", &self.inner.get_error())
            .finish_non_exhaustive()
    }
}

impl GrammarMatcher {
    pub(crate) fn new(inner: llguidance::Matcher, env: TokenEnv) -> Self {
        GrammarMatcher {
            inner,
            env,
            consumed: 0,
            eos: None,
        }
    }

    /// The token environment (vocabulary size, EOS ids, token texts).
    pub fn token_env(&self) -> &TokenEnv {
        &self.env
    }

    /// Fills `row` with the set of tokens the grammar allows next, as a bitmask.
    ///
    /// Layout (XGrammar's and llguidance's): token `t` is bit `t % 32` (LSB first) of word
    /// `t / 32`; 1 = allowed. `row` must have at least ceil(vocab_size / 32) words; it may be
    /// longer (a padded LM head): every bit at or above the vocabulary size is set to 0, and so
    /// is every id without bytes (ids past the tokenizer's own vocabulary).
    ///
    /// What is allowed: every token whose bytes keep the text a prefix of some string of the
    /// grammar (a token may span several grammar symbols); the EOS ids exactly when
    /// [`may_end`](Self::may_end); only the EOS ids once the grammar cannot be extended; nothing
    /// (all zero) after an EOS was committed. Where the grammar forces a fixed text (e.g. a
    /// required key) and canonical forcing is on (the default), llguidance allows only the
    /// first token of its canonical tokenisation; with it off
    /// ([`TokenEnv::with_canonical_forcing`]), every legal token.
    ///
    /// Errors: [`GrammarError::BitmaskTooShort`]; [`GrammarError::Matcher`] when llguidance
    /// fails (e.g. no token at all can continue the grammar with this vocabulary, or a lexer
    /// limit was hit); the row is then all zero and the matcher unusable.
    pub fn fill_bitmask(&mut self, row: &mut [u32]) -> Result<()> {
        let _span = tracing::trace_span!("grammar_fill_bitmask").entered();
        let vocab = self.env.vocab_size();
        let needed = self.env.bitmask_words();
        if row.len() < needed {
            return Err(GrammarError::BitmaskTooShort {
                len: row.len(),
                needed,
                vocab_size: vocab,
            });
        }
        if self.eos.is_some() {
            row.fill(0);
            return Ok(());
        }
        let mask = match on_stack(|| self.inner.compute_mask_or_eos()) {
            Ok(mask) => mask,
            Err(e) => {
                row.fill(0);
                return Err(GrammarError::matcher(&e.to_string()));
            }
        };
        let words = mask.as_slice();
        let n = words.len().min(needed);
        row[..n].copy_from_slice(&words[..n]);
        row[n..].fill(0);
        if !vocab.is_multiple_of(32) {
            row[needed - 1] &= (1u32 << (vocab % 32)) - 1;
        }
        Ok(())
    }

    /// How many of `tokens`, from the start, the grammar accepts in a row from the current
    /// state (0 to `tokens.len()`); commits nothing.
    ///
    /// An EOS id counts as accepted where [`may_end`](Self::may_end) would hold, and nothing
    /// after an accepted EOS is accepted. An id at or above the vocabulary size stops the count
    /// there. After a committed EOS, and for a matcher in the error state, the answer is 0.
    /// Non-canonical tokenisations of allowed text are accepted.
    pub fn validate_tokens(&mut self, tokens: &[u32]) -> usize {
        if self.eos.is_some() || self.inner.is_error() {
            return 0;
        }
        let vocab = self.env.vocab_size();
        let in_range = tokens
            .iter()
            .position(|&t| t as usize >= vocab)
            .unwrap_or(tokens.len());
        let tokens = &tokens[..in_range];
        if tokens.is_empty() {
            return 0;
        }
        if self.inner.is_stopped() {
            // Stopped without error: the text is complete and cannot grow; only EOS follows.
            return usize::from(self.env.is_eos(tokens[0]));
        }
        // llguidance counts an EOS when the parser accepts there, and stops after it.
        on_stack(|| self.inner.validate_tokens(tokens)).unwrap_or(0)
    }

    /// Commits `token`, the token sampled for this request, advancing the grammar.
    ///
    /// The token is validated first ([`validate_tokens`](Self::validate_tokens)); a rejected
    /// one changes nothing. Committing an EOS id ends the matcher ([`is_ended`](Self::is_ended));
    /// [`rollback`](Self::rollback) re-opens it.
    ///
    /// Errors: [`GrammarError::TokenOutOfRange`]; [`GrammarError::Ended`] after an EOS;
    /// [`GrammarError::TokenRejected`] naming the id and its text; [`GrammarError::Matcher`]
    /// when the matcher is in the error state or llguidance fails while consuming.
    pub fn commit(&mut self, token: u32) -> Result<()> {
        let vocab_size = self.env.vocab_size();
        if token as usize >= vocab_size {
            return Err(GrammarError::TokenOutOfRange { token, vocab_size });
        }
        if self.eos.is_some() {
            return Err(GrammarError::Ended);
        }
        if let Some(message) = self.inner.get_error() {
            return Err(GrammarError::matcher(&message));
        }
        if self.validate_tokens(&[token]) != 1 {
            return Err(GrammarError::TokenRejected {
                token,
                text: self.env.token_text(token),
            });
        }
        if self.env.is_eos(token) {
            self.eos = Some(token);
            return Ok(());
        }
        on_stack(|| self.inner.consume_token(token))
            .map_err(|e| GrammarError::matcher(&e.to_string()))?;
        self.consumed += 1;
        Ok(())
    }

    /// Commits `tokens` in order, stopping at the first error; returns how many were
    /// committed before it along with the error.
    ///
    /// Errors: as [`commit`](Self::commit), as `(committed, error)`.
    pub fn commit_tokens(
        &mut self,
        tokens: &[u32],
    ) -> std::result::Result<(), (usize, GrammarError)> {
        for (i, &t) in tokens.iter().enumerate() {
            self.commit(t).map_err(|e| (i, e))?;
        }
        Ok(())
    }

    /// Undoes the last `n` committed tokens (speculative decoding, a caller's retry), including
    /// a committed EOS: rolling back over it re-opens the matcher. `rollback(0)` does nothing.
    ///
    /// Errors: [`GrammarError::RollbackTooFar`] when `n` is above
    /// [`committed_len`](Self::committed_len) (nothing is undone); [`GrammarError::Matcher`]
    /// for a matcher in the error state.
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        let committed = self.committed_len();
        if n > committed {
            return Err(GrammarError::RollbackTooFar {
                requested: n,
                committed,
            });
        }
        if n == 0 {
            return Ok(());
        }
        if let Some(message) = self.inner.get_error() {
            return Err(GrammarError::matcher(&message));
        }
        let mut n = n;
        if self.eos.take().is_some() {
            n -= 1;
        }
        if n > 0 {
            on_stack(|| self.inner.rollback(n))
                .map_err(|e| GrammarError::matcher(&e.to_string()))?;
            self.consumed -= n;
        }
        Ok(())
    }

    /// Whether the grammar may end here: the committed text is a complete match, so EOS is
    /// allowed (llguidance's `is_accepting`). True after a committed EOS; false in the error
    /// state.
    pub fn may_end(&mut self) -> bool {
        if self.eos.is_some() {
            return true;
        }
        if self.inner.is_error() {
            return false;
        }
        if self.inner.is_stopped() {
            // Stopped without error: complete and not extensible.
            return true;
        }
        on_stack(|| self.inner.is_accepting()).unwrap_or(false)
    }

    /// Whether the grammar can take no more text: an EOS was committed, or the committed text
    /// is complete and no token can extend it (llguidance's `is_stopped`; then only EOS is
    /// allowed). Also true in the error state ([`error`](Self::error)).
    pub fn is_ended(&self) -> bool {
        self.eos.is_some() || self.inner.is_stopped()
    }

    /// Tokens committed so far, including a committed EOS: the most [`rollback`](Self::rollback)
    /// can undo.
    pub fn committed_len(&self) -> usize {
        self.consumed + usize::from(self.eos.is_some())
    }

    /// llguidance's message when the matcher is in the error state (after a
    /// [`GrammarError::Matcher`]); `None` otherwise.
    pub fn error(&self) -> Option<String> {
        self.inner.get_error()
    }
}

/// Fills one bitmask row per matcher, in parallel (rayon), as
/// [`GrammarMatcher::fill_bitmask`] does for each.
///
/// `bitmask` is `[matchers.len(), row_words]` row-major u32 words; row `i` belongs to
/// `matchers[i]`. Returns one result per matcher, in order: a request's error does not affect
/// the others. A `bitmask` whose length is not `matchers.len() × row_words` gives every
/// request [`GrammarError::BitmaskShape`] and fills nothing.
pub fn fill_bitmasks(
    matchers: &mut [&mut GrammarMatcher],
    bitmask: &mut [u32],
    row_words: usize,
) -> Vec<Result<()>> {
    let rows = matchers.len();
    if row_words == 0 || bitmask.len() != rows * row_words {
        let e = GrammarError::BitmaskShape {
            len: bitmask.len(),
            rows,
            row_words,
        };
        return vec![Err(e); rows];
    }
    let _span = tracing::debug_span!("grammar_fill_bitmasks", rows).entered();
    matchers
        .par_iter_mut()
        .zip(bitmask.par_chunks_mut(row_words))
        .map(|(m, row)| m.fill_bitmask(row))
        .collect()
}
