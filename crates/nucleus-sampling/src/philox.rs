//! Philox4x32-10, the counter-based generator behind every random draw.
//!
//! Source: Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC'11),
//! and its reference implementation, Random123 (`philox4x32`, 10 rounds). The same generator
//! is cuRAND's Philox, PyTorch's CUDA generator and FlashInfer's `(seed, offset)` stream, so a
//! GPU path can reproduce our draws.
//!
//! A draw depends only on (seed, position, sample index): spec/sampling.md, "Random streams".
//! No state is kept between calls, so results do not depend on batch size, order, thread count
//! or machine.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

#[inline]
fn round(c: [u32; 4], k: [u32; 2]) -> [u32; 4] {
    let (hi0, lo0) = mulhilo(M0, c[0]);
    let (hi1, lo1) = mulhilo(M1, c[2]);
    [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
}

/// Philox4x32-10: the 4 output words for a 128-bit `counter` under a 64-bit `key`.
///
/// Matches the Random123 known-answer vectors (tested), e.g. counter 0, key 0 gives
/// `[0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    c = round(c, k);
    for _ in 1..10 {
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        c = round(c, k);
    }
    c
}

/// The uniform in the open interval (0, 1) for `(seed, position, sample_index)`.
///
/// Key = (seed bits 0-31, seed bits 32-63); counter = (position bits 0-31, position bits
/// 32-63, sample_index, 0). From the output words w0, w1: `x = (w0 << 32 | w1) >> 11` (53
/// bits) and `u = (x + 0.5) / 2^53`, never 0 or 1 (spec/sampling.md, "Random streams").
pub fn uniform(seed: u64, position: u64, sample_index: u32) -> f64 {
    uniform_kind(seed, position, sample_index, draw::SELECT)
}

/// Counter word 3 of each kind of draw (spec/sampling.md, "Random streams"): no two draws of a
/// request share a counter.
pub mod draw {
    /// The selection of step 11 (and mirostat's).
    pub const SELECT: u32 = 0;
    /// XTC's coin.
    pub const XTC: u32 = 1;
    /// Speculative verification's acceptance test of a draft position.
    pub const SPEC_ACCEPT: u32 = 2;
    /// Speculative verification's residual or bonus sample.
    pub const SPEC_RESIDUAL: u32 = 3;
}

/// The uniform in (0, 1) for `(seed, position, sample_index)` and the draw kind `kind`
/// (counter word 3, [`draw`]); [`uniform`] is `kind = 0`. Same construction otherwise.
pub fn uniform_kind(seed: u64, position: u64, sample_index: u32, kind: u32) -> f64 {
    let w = philox4x32_10(
        [position as u32, (position >> 32) as u32, sample_index, kind],
        [seed as u32, (seed >> 32) as u32],
    );
    let x = ((u64::from(w[0]) << 32) | u64::from(w[1])) >> 11;
    (x as f64 + 0.5) / (1u64 << 53) as f64
}
