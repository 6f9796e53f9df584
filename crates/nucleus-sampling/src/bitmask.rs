//! The structured-output token bitmask (spec/sampling.md step 3) and its in-place apply kernel.
//!
//! Layout, the one XGrammar and llguidance use (so masks can be exchanged with them):
//! `[batch, ceil(row_len / 32)]` u32 words, row-major; token `t` of a row is bit `t % 32`
//! (least significant bit first) of word `t / 32`; a set bit allows the token, a clear bit
//! masks it. Bits past `row_len` in the last word are never read. A grammar fills one row per
//! request (`nucleus-grammar`); ids at or above the tokenizer's vocabulary are left clear.
//!
//! Applying a mask sets every disallowed logit to `-inf` in place
//! ([`apply_token_bitmask_inplace`]): the allowed logits are not touched, not even read.
//! [`SampleRequest::with_token_bitmask`](crate::SampleRequest::with_token_bitmask) has the
//! sampler apply a mask row at step 3 on its own copy of the row instead, leaving the caller's
//! logits as they were.

use rayon::prelude::*;

use crate::error::BitmaskError;
use crate::kernels::{self, Isa};

/// Words of one bitmask row for `row_len` token ids: `ceil(row_len / 32)`.
pub const fn bitmask_words(row_len: usize) -> usize {
    row_len.div_ceil(32)
}

/// A `[batch, ceil(row_len / 32)]` token bitmask (see the [module docs](self) for the layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBitmask {
    words: Vec<u32>,
    batch: usize,
    row_len: usize,
}

impl TokenBitmask {
    /// A mask of `batch` rows of `row_len` token ids, every token allowed (as XGrammar's
    /// `allocate_token_bitmask` starts), bits past `row_len` clear.
    pub fn new(batch: usize, row_len: usize) -> Self {
        let mut mask = Self {
            words: vec![u32::MAX; batch * bitmask_words(row_len)],
            batch,
            row_len,
        };
        for i in 0..batch {
            mask.clear_tail(i);
        }
        mask
    }

    /// A mask from its words, row-major, `ceil(row_len / 32)` per row.
    ///
    /// # Errors
    /// [`BitmaskError::Shape`] when `words.len()` is not `batch * ceil(row_len / 32)`.
    pub fn from_words(words: Vec<u32>, batch: usize, row_len: usize) -> Result<Self, BitmaskError> {
        let expected = batch.checked_mul(bitmask_words(row_len));
        if expected != Some(words.len()) {
            return Err(BitmaskError::Shape {
                words: words.len(),
                batch,
                row_len,
            });
        }
        Ok(Self {
            words,
            batch,
            row_len,
        })
    }

    /// Rows.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Token ids per row.
    pub fn row_len(&self) -> usize {
        self.row_len
    }

    /// Words per row, `ceil(row_len / 32)`.
    pub fn words_per_row(&self) -> usize {
        bitmask_words(self.row_len)
    }

    /// All words, row-major.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// The words of row `i`. Panics if `i >= batch`.
    pub fn row(&self, i: usize) -> &[u32] {
        let w = self.words_per_row();
        &self.words[i * w..(i + 1) * w]
    }

    /// The words of row `i`, to be filled (e.g. by a grammar matcher). Panics if `i >= batch`.
    pub fn row_mut(&mut self, i: usize) -> &mut [u32] {
        let w = self.words_per_row();
        &mut self.words[i * w..(i + 1) * w]
    }

    /// Every row, to be filled in parallel (`par_chunks_mut` over `words_per_row`).
    pub fn rows_mut(&mut self) -> std::slice::ChunksMut<'_, u32> {
        let w = self.words_per_row().max(1);
        self.words.chunks_mut(w)
    }

    /// Whether token `t` of row `i` is allowed (`false` for `t >= row_len`). Panics if
    /// `i >= batch`.
    pub fn is_allowed(&self, i: usize, t: usize) -> bool {
        t < self.row_len && self.row(i)[t / 32] >> (t % 32) & 1 == 1
    }

    /// Allows (`true`) or masks token `t` of row `i`. Panics if `i >= batch` or
    /// `t >= row_len`.
    pub fn set(&mut self, i: usize, t: usize, allowed: bool) {
        assert!(t < self.row_len, "token id {t} >= row_len {}", self.row_len);
        let word = &mut self.row_mut(i)[t / 32];
        if allowed {
            *word |= 1 << (t % 32);
        } else {
            *word &= !(1 << (t % 32));
        }
    }

    /// Allows every token of row `i`.
    pub fn allow_all(&mut self, i: usize) {
        self.row_mut(i).fill(u32::MAX);
        self.clear_tail(i);
    }

    /// Masks every token of row `i`.
    pub fn disallow_all(&mut self, i: usize) {
        self.row_mut(i).fill(0);
    }

    fn clear_tail(&mut self, i: usize) {
        let rem = self.row_len % 32;
        if rem != 0 {
            if let Some(last) = self.row_mut(i).last_mut() {
                *last &= (1u32 << rem) - 1;
            }
        }
    }
}

/// Sets `logits[t] = -inf` for every token `t` whose bit in `bitmask` is clear; allowed
/// logits are neither written nor read. `logits`: one row, f32, any length `n`; `bitmask`: that
/// row's words, at least `ceil(n / 32)` (a mask of a longer, padded row is fine: words past
/// the row are not read). The semantics of XGrammar's `apply_token_bitmask_inplace` for one row.
///
/// # Errors
/// [`BitmaskError::RowTooShort`] when `bitmask` has fewer than `ceil(n / 32)` words; `logits`
/// is then unchanged.
pub fn apply_token_bitmask_inplace(
    logits: &mut [f32],
    bitmask: &[u32],
) -> Result<(), BitmaskError> {
    let needed = bitmask_words(logits.len());
    if bitmask.len() < needed {
        return Err(BitmaskError::RowTooShort {
            words: bitmask.len(),
            needed,
            row_len: logits.len(),
        });
    }
    mask_row(logits, &bitmask[..needed], f32::NEG_INFINITY);
    Ok(())
}

/// [`apply_token_bitmask_inplace`] on every row of a `[batch, row_len]` f32 matrix (row-major,
/// `logits.len() == batch * row_len`), rows in parallel on the current rayon pool.
///
/// # Errors
/// [`BitmaskError::Shape`] when `logits` does not hold `bitmask.batch()` rows of
/// `bitmask.row_len()` values; nothing is changed then.
pub fn apply_token_bitmask_inplace_batch(
    logits: &mut [f32],
    bitmask: &TokenBitmask,
) -> Result<(), BitmaskError> {
    let row_len = bitmask.row_len();
    if bitmask.batch().checked_mul(row_len) != Some(logits.len()) {
        return Err(BitmaskError::LogitsShape {
            values: logits.len(),
            batch: bitmask.batch(),
            row_len,
        });
    }
    if row_len == 0 {
        return Ok(());
    }
    logits
        .par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(i, row)| mask_row(row, bitmask.row(i), f32::NEG_INFINITY));
    Ok(())
}

/// Sets `row[t] = fill` where the bit of `t` is clear. `mask.len() == ceil(row.len() / 32)`.
pub(crate) fn mask_row(row: &mut [f32], mask: &[u32], fill: f32) {
    debug_assert_eq!(mask.len(), bitmask_words(row.len()));
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        Isa::Avx512 => unsafe { mask_row_avx512(row, mask, fill) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        Isa::Avx2 => unsafe { mask_row_avx2(row, mask, fill) },
        Isa::Baseline => mask_row_portable(row, mask, fill),
    }
}

/// The portable body: whole-word fast paths (all allowed: nothing to do; none: a fill), else a
/// select per token that LLVM vectorises.
#[inline(always)]
fn mask_row_portable(row: &mut [f32], mask: &[u32], fill: f32) {
    let whole = row.len() / 32;
    let mut chunks = row.chunks_exact_mut(32);
    for (chunk, &word) in (&mut chunks).zip(mask) {
        if word == u32::MAX {
            continue;
        }
        if word == 0 {
            chunk.fill(fill);
            continue;
        }
        for (b, x) in chunk.iter_mut().enumerate() {
            if word >> b & 1 == 0 {
                *x = fill;
            }
        }
    }
    let tail = chunks.into_remainder();
    if let Some(&word) = mask.get(whole) {
        for (b, x) in tail.iter_mut().enumerate() {
            if word >> b & 1 == 0 {
                *x = fill;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn mask_row_avx2(row: &mut [f32], mask: &[u32], fill: f32) {
    mask_row_portable(row, mask, fill)
}

/// AVX-512: each half word is a lane mask; a masked store writes `fill` into the disallowed
/// lanes only, without reading the row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn mask_row_avx512(row: &mut [f32], mask: &[u32], fill: f32) {
    use std::arch::x86_64::*;
    let whole = row.len() / 32;
    let f = _mm512_set1_ps(fill);
    let p = row.as_mut_ptr();
    for (w, &word) in mask[..whole].iter().enumerate() {
        if word == u32::MAX {
            continue;
        }
        let off = !word;
        // SAFETY: word `w < whole` covers row[32 w .. 32 w + 32], inside the row.
        unsafe {
            _mm512_mask_storeu_ps(p.add(32 * w), off as u16, f);
            _mm512_mask_storeu_ps(p.add(32 * w + 16), (off >> 16) as u16, f);
        }
    }
    let tail = &mut row[whole * 32..];
    if let Some(&word) = mask.get(whole) {
        for (b, x) in tail.iter_mut().enumerate() {
            if word >> b & 1 == 0 {
                *x = fill;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched kernel equals a bit-by-bit loop on random masks, every length around the
    /// word and vector edges, all-set and all-clear words included.
    #[test]
    fn dispatched_kernel_equals_the_bit_loop() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for n in [
            0usize, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1000, 4099,
        ] {
            for kind in 0..4 {
                let mask: Vec<u32> = (0..bitmask_words(n))
                    .map(|_| match (kind, next() % 3) {
                        (0, _) => u32::MAX,
                        (1, _) => 0,
                        (_, 0) => u32::MAX,
                        (_, 1) => 0,
                        _ => next() as u32,
                    })
                    .collect();
                let row: Vec<f32> = (0..n).map(|i| i as f32 - 7.5).collect();
                let mut got = row.clone();
                apply_token_bitmask_inplace(&mut got, &mask).unwrap();
                let mut portable = row.clone();
                mask_row_portable(&mut portable, &mask, f32::NEG_INFINITY);
                for t in 0..n {
                    let allowed = mask[t / 32] >> (t % 32) & 1 == 1;
                    let want = if allowed { row[t] } else { f32::NEG_INFINITY };
                    assert_eq!(got[t].to_bits(), want.to_bits(), "n {n} kind {kind} t {t}");
                    assert_eq!(portable[t].to_bits(), want.to_bits());
                }
            }
        }
    }
}
