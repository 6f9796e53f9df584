//! ggml blocks to f32 ([`dequantize`]), for the prefill matrix products of quantized weights
//! (`crate::models::mapped_quant`): the same values, bit for bit, as candle's
//! `GgmlType::to_float` (ggml's `dequantize_row_*` in `ggml/src/ggml-quants.c`), several times
//! faster for the types of the common GGUF files (Q8_0, Q4_0, Q4_K, Q6_K: one plain loop per
//! block that the compiler vectorises, built for AVX2 where the CPU has it); other types go
//! through candle's own.
//!
//! The block layouts are ggml's (`ggml/src/ggml-common.h`), little-endian, as in a GGUF file
//! (candle's block structs are `repr(C)` copies of them, and the blocks here are read in place
//! from the file's map):
//! - `block_q8_0` (34 bytes, 32 values): `d` f16, `qs` 32 × i8; `y = qs * d`.
//! - `block_q4_0` (18 bytes, 32 values): `d` f16, `qs` 16 × u8; `y[j] = (lo(qs[j]) - 8) * d`,
//!   `y[j + 16] = (hi(qs[j]) - 8) * d`.
//! - `block_q4_K` (144 bytes, 256 values): `d`, `dmin` f16, `scales` 12 × u8 (eight 6-bit
//!   scales and mins), `qs` 128 × u8; `y = d * sc * q - dmin * m` per 32 values.
//! - `block_q6_K` (210 bytes, 256 values): `ql` 128 × u8, `qh` 64 × u8, `scales` 16 × i8, `d`
//!   f16; `y = d * sc * (q - 32)` with 6-bit `q`.

use candle_core::quantized::k_quants::GgmlType;
use candle_core::quantized::GgmlDType;

/// `dst` (`blocks.len() * T::BLCK_SIZE` values) = the values of `blocks`, as candle's
/// `T::to_float` computes them (bit for bit; unit-tested).
pub(crate) fn dequantize<T: GgmlType>(blocks: &[T], dst: &mut [f32]) {
    debug_assert_eq!(dst.len(), blocks.len() * T::BLCK_SIZE);
    // SAFETY: ggml's block types are plain old data (integers and f16 bits) with no padding
    // (`repr(C)`, sizes a multiple of their 2-byte alignment); reading them as bytes is sound.
    let bytes = unsafe {
        std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks))
    };
    let kind = match T::DTYPE {
        GgmlDType::Q8_0 => Kind::Q8_0,
        GgmlDType::Q4_0 => Kind::Q4_0,
        GgmlDType::Q4K => Kind::Q4K,
        GgmlDType::Q6K => Kind::Q6K,
        _ => return T::to_float(blocks, dst),
    };
    debug_assert_eq!(kind.bytes(), std::mem::size_of::<T>());
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked once by `avx2`).
        unsafe { x86_dequantize(kind, bytes, dst) };
        return;
    }
    dequantize_with(kind, bytes, dst);
}

/// The block types with a path of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Q8_0,
    Q4_0,
    Q4K,
    Q6K,
}

impl Kind {
    /// Bytes per block.
    fn bytes(self) -> usize {
        match self {
            Kind::Q8_0 => 34,
            Kind::Q4_0 => 18,
            Kind::Q4K => 144,
            Kind::Q6K => 210,
        }
    }

    /// Values per block.
    fn values(self) -> usize {
        match self {
            Kind::Q8_0 | Kind::Q4_0 => 32,
            Kind::Q4K | Kind::Q6K => 256,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x86_dequantize(kind: Kind, bytes: &[u8], dst: &mut [f32]) {
    dequantize_with(kind, bytes, dst)
}

/// The f32 value of the little-endian f16 at `b[i..i + 2]`.
#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min `j` (0..8) of a Q4_K block's 12 bytes.
#[inline(always)]
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The loops of each type, with candle's `to_float` expressions (same operations in the same
/// order, so the same bits); inlined into the dispatched callers.
#[inline(always)]
fn dequantize_with(kind: Kind, bytes: &[u8], dst: &mut [f32]) {
    let (bb, bv) = (kind.bytes(), kind.values());
    for (b, y) in bytes.chunks_exact(bb).zip(dst.chunks_exact_mut(bv)) {
        match kind {
            Kind::Q8_0 => {
                let d = f16_at(b, 0);
                for (y, &q) in y.iter_mut().zip(&b[2..34]) {
                    *y = (q as i8) as f32 * d;
                }
            }
            Kind::Q4_0 => {
                let d = f16_at(b, 0);
                let (lo, hi) = y.split_at_mut(16);
                for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..18]) {
                    *l = ((q & 0x0F) as i16 - 8) as f32 * d;
                    *h = ((q >> 4) as i16 - 8) as f32 * d;
                }
            }
            Kind::Q4K => {
                let d = f16_at(b, 0);
                let min = f16_at(b, 2);
                let scales = &b[4..16];
                let qs = &b[16..144];
                for (c, y) in y.chunks_exact_mut(64).enumerate() {
                    let q = &qs[32 * c..32 * c + 32];
                    let (sc, m) = scale_min_k4(2 * c, scales);
                    let (d1, m1) = (d * sc as f32, min * m as f32);
                    let (sc, m) = scale_min_k4(2 * c + 1, scales);
                    let (d2, m2) = (d * sc as f32, min * m as f32);
                    let (lo, hi) = y.split_at_mut(32);
                    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(q) {
                        *l = d1 * (q & 0xF) as f32 - m1;
                        *h = d2 * (q >> 4) as f32 - m2;
                    }
                }
            }
            Kind::Q6K => {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = f16_at(b, 208);
                for (n, y) in y.chunks_exact_mut(128).enumerate() {
                    let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants::{BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ6K, BlockQ8_0};

    /// Random blocks of `T`: random bytes (every scale, min and quant pattern), with the f16
    /// fields made finite (a NaN or infinite scale gives NaN either way).
    fn random_blocks<T: GgmlType>(n: usize, seed: u64) -> Vec<T> {
        let mut blocks = vec![T::zeros(); n];
        let size = std::mem::size_of::<T>();
        // SAFETY: plain old data, as in `dequantize`.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(blocks.as_mut_ptr().cast::<u8>(), n * size) };
        let mut s = seed | 1;
        for b in bytes.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *b = (s >> 32) as u8;
        }
        // Finite f16 scales: clear the top exponent bit of each f16 field.
        let f16_fields: &[usize] = match T::DTYPE {
            GgmlDType::Q8_0 | GgmlDType::Q4_0 => &[0],
            GgmlDType::Q4K | GgmlDType::Q5K => &[0, 2],
            GgmlDType::Q6K => &[208],
            _ => &[],
        };
        for block in bytes.chunks_exact_mut(size) {
            for &f in f16_fields {
                block[f + 1] &= 0b1011_1111;
            }
        }
        blocks
    }

    fn same_as_candle<T: GgmlType>() {
        let blocks = random_blocks::<T>(37, T::BLCK_SIZE as u64 * 7 + 3);
        let mut ours = vec![f32::NAN; blocks.len() * T::BLCK_SIZE];
        let mut theirs = vec![f32::NAN; ours.len()];
        dequantize(&blocks, &mut ours);
        T::to_float(&blocks, &mut theirs);
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{:?} value {i}: {a} vs {b}",
                T::DTYPE
            );
        }
        // The portable loop too (the dispatched one may be the AVX2 build).
        let kind = match T::DTYPE {
            GgmlDType::Q8_0 => Kind::Q8_0,
            GgmlDType::Q4_0 => Kind::Q4_0,
            GgmlDType::Q4K => Kind::Q4K,
            GgmlDType::Q6K => Kind::Q6K,
            _ => return,
        };
        let bytes = unsafe {
            std::slice::from_raw_parts(
                blocks.as_ptr().cast::<u8>(),
                std::mem::size_of_val(&blocks[..]),
            )
        };
        let mut portable = vec![f32::NAN; ours.len()];
        dequantize_with(kind, bytes, &mut portable);
        assert_eq!(
            portable.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            theirs.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn every_path_gives_candles_bits() {
        same_as_candle::<BlockQ8_0>();
        same_as_candle::<BlockQ4_0>();
        same_as_candle::<BlockQ4K>();
        same_as_candle::<BlockQ6K>();
        // A type without a path of its own goes through candle's.
        same_as_candle::<BlockQ5K>();
    }

    /// Hand-worked blocks: a Q8_0 block with d = 0.5, and a Q4_K block with d = 1, dmin = 0.25,
    /// scale 3 and min 2 for the first 32 values.
    #[test]
    fn hand_worked_blocks() {
        let mut q8 = vec![BlockQ8_0::zeros(); 1];
        let b = unsafe { std::slice::from_raw_parts_mut(q8.as_mut_ptr().cast::<u8>(), 34) };
        b[0..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        b[2] = 4;
        b[3] = (-6i8) as u8;
        let mut y = vec![0f32; 32];
        dequantize(&q8, &mut y);
        assert_eq!(&y[..3], &[2.0, -3.0, 0.0]);

        let mut q4k = vec![BlockQ4K::zeros(); 1];
        let b = unsafe { std::slice::from_raw_parts_mut(q4k.as_mut_ptr().cast::<u8>(), 144) };
        b[0..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
        b[4] = 3; // scale 0
        b[8] = 2; // min 0
        b[16] = 0x5A; // value 0: low nibble 10; value 32: high nibble 5 (scale 1 = 0, min 1 = 0)
        let mut y = vec![0f32; 256];
        dequantize(&q4k, &mut y);
        assert_eq!(y[0], 3.0 * 10.0 - 0.5);
        assert_eq!(y[1], -0.5);
        assert_eq!(y[32], 0.0);
    }
}
