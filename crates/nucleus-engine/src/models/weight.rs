//! [`Weight`]: the matrix of a linear layer (and the embedding table), kept in its stored type.
//!
//! f16 and bf16 matrices ([`HalfMatrix`]) stay 16-bit in memory, memory-mapped from a GGUF
//! file where one was mapped, and are multiplied by our own kernels ([`half_matmul`]): each
//! weight is converted to f32 as it is read (exact: every f16 and bf16 value is an f32 value)
//! and products are accumulated in f32, so a decode step reads 2 bytes per weight, not the 4 of
//! an f32 copy (candle's `QMatMul` converts f16 / bf16 to f32 at load). Quantized ggml types
//! and f32 stay with candle's `QMatMul`.
//!
//! # The half-precision kernels
//! `y [T, out] = x [T, in] · W^T` for f32 activations `x` and a 16-bit `W [out, in]`:
//! - `T <= SMALL_BATCH` (decode): each output value is one dot product of a weight row and an
//!   activation row, over 32 f32 lanes (lane `l` accumulates the elements `32 c + l` with fused
//!   multiply-adds), reduced in a fixed tree, plus the row's tail (`in mod 32` elements)
//!   accumulated in order. The order depends neither on `T` nor on the row's place in the batch,
//!   nor on the thread count or the instruction set (AVX2 + FMA + F16C, or portable Rust with
//!   `f32::mul_add`: bit-identical, unit-tested), so decode logits of a sequence are the same
//!   alone and in any batch of at most `SMALL_BATCH` rows.
//! - `T > SMALL_BATCH` (prefill): blocks of `BLOCK_ROWS` weight rows are converted to f32 and
//!   multiplied by the `gemm` crate (candle's CPU matmul), one block per task; a block's result
//!   does not depend on the thread count.
//!
//! Rows are split over rayon's pool (the process's thread count, [`crate::threads`]).

use std::fmt;
use std::sync::Arc;
#[cfg(target_arch = "x86_64")]
use std::sync::OnceLock;

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};
use rayon::prelude::*;

use crate::error::{EngineError, Result};

/// The two 16-bit float formats a [`HalfMatrix`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HalfKind {
    /// IEEE 754 binary16 (GGUF `F16`, safetensors `F16`).
    F16,
    /// bfloat16: the top 16 bits of an f32 (GGUF `BF16`, safetensors `BF16`).
    Bf16,
}

/// Where a [`HalfMatrix`]'s values live.
#[derive(Clone)]
enum HalfData {
    /// `rows * cols` little-endian values at byte `offset` of a mapped file (2-aligned).
    Mapped {
        map: Arc<memmap2::Mmap>,
        offset: usize,
    },
    /// Values read into memory.
    Owned(Arc<[u16]>),
}

/// A row-major `[rows, cols]` matrix of f16 or bf16 values.
#[derive(Clone)]
pub(crate) struct HalfMatrix {
    kind: HalfKind,
    rows: usize,
    cols: usize,
    data: HalfData,
}

impl fmt::Debug for HalfMatrix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HalfMatrix")
            .field("kind", &self.kind)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("mapped", &matches!(self.data, HalfData::Mapped { .. }))
            .finish()
    }
}

impl HalfMatrix {
    /// The matrix stored at byte `offset` of `map` (`rows * cols` little-endian values);
    /// `None` when the range is not within the map, `offset` is odd, or the machine is
    /// big-endian (the caller then reads the values with [`HalfMatrix::owned`]).
    pub(crate) fn mapped(
        kind: HalfKind,
        map: Arc<memmap2::Mmap>,
        offset: usize,
        rows: usize,
        cols: usize,
    ) -> Option<Self> {
        let bytes = rows.checked_mul(cols)?.checked_mul(2)?;
        let end = offset.checked_add(bytes)?;
        let aligned = (map.as_ptr() as usize + offset).is_multiple_of(2);
        if end > map.len() || !aligned || cfg!(target_endian = "big") {
            return None;
        }
        Some(Self {
            kind,
            rows,
            cols,
            data: HalfData::Mapped { map, offset },
        })
    }

    /// The matrix of `values` (`rows * cols` of them, row-major).
    pub(crate) fn owned(kind: HalfKind, values: Vec<u16>, rows: usize, cols: usize) -> Self {
        debug_assert_eq!(values.len(), rows * cols);
        Self {
            kind,
            rows,
            cols,
            data: HalfData::Owned(values.into()),
        }
    }

    /// The matrix of little-endian `bytes` (`2 * rows * cols` of them).
    pub(crate) fn from_le_bytes(kind: HalfKind, bytes: &[u8], rows: usize, cols: usize) -> Self {
        let values = bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        Self::owned(kind, values, rows, cols)
    }

    /// The values, row-major.
    fn values(&self) -> &[u16] {
        match &self.data {
            HalfData::Owned(v) => v,
            HalfData::Mapped { map, offset } => {
                // SAFETY: `mapped` checked that `offset..offset + 2 * rows * cols` lies within
                // the map and that its start is 2-aligned; the map is read-only and lives as
                // long as `self` (the Arc).
                unsafe {
                    std::slice::from_raw_parts(
                        map.as_ptr().add(*offset).cast::<u16>(),
                        self.rows * self.cols,
                    )
                }
            }
        }
    }
}

/// The matrix of a linear layer `[out, in]`, or of an embedding table `[vocab, hidden]`.
#[derive(Debug, Clone)]
pub(crate) enum Weight {
    /// f32 or a ggml-quantized type, multiplied by candle.
    Candle(QMatMul),
    /// f16 or bf16, multiplied by [`half_matmul`].
    Half(HalfMatrix),
}

impl Weight {
    /// A weight from a candle tensor `[out, in]`: f16 and bf16 are kept 16-bit, every other
    /// dtype becomes f32.
    pub(crate) fn from_tensor(t: Tensor) -> Result<Self> {
        let (rows, cols) = t.dims2()?;
        let kind = match t.dtype() {
            DType::F16 => HalfKind::F16,
            DType::BF16 => HalfKind::Bf16,
            _ => return Ok(Weight::Candle(QMatMul::Tensor(t.to_dtype(DType::F32)?))),
        };
        use half::vec::HalfFloatVecExt;
        // One copy out of the tensor, reinterpreted in place as the values' bits.
        let flat = t.flatten_all()?;
        drop(t);
        let values: Vec<u16> = match kind {
            HalfKind::F16 => flat.to_vec1::<half::f16>()?.reinterpret_into(),
            HalfKind::Bf16 => flat.to_vec1::<half::bf16>()?.reinterpret_into(),
        };
        Ok(Weight::Half(HalfMatrix::owned(kind, values, rows, cols)))
    }

    /// `[rows, cols]`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        match self {
            Weight::Half(h) => (h.rows, h.cols),
            Weight::Candle(QMatMul::QTensor(q)) => {
                let d = q.shape().dims();
                (d[0], d.get(1).copied().unwrap_or(1))
            }
            Weight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                let d = t.dims();
                (d[0], d.get(1).copied().unwrap_or(1))
            }
        }
    }

    /// `x [.., in]` f32 times the transpose: `[.., out]` f32.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Candle(m) => Ok(m.forward(x)?),
            Weight::Half(w) => {
                let dims = x.dims().to_vec();
                let cols = *dims.last().unwrap_or(&0);
                if cols != w.cols {
                    return Err(EngineError::InvalidRequest(format!(
                        "internal: a [{}, {}] weight times activations of shape {dims:?}",
                        w.rows, w.cols
                    )));
                }
                let t = x.elem_count() / cols.max(1);
                let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let mut y = vec![0f32; t * w.rows];
                half_matmul(w, &xs, t, &mut y);
                let mut out_dims = dims;
                *out_dims.last_mut().expect("at least one dimension") = w.rows;
                Ok(Tensor::from_vec(y, out_dims, x.device())?)
            }
        }
    }

    /// The rows `ids` of the matrix as f32 `[ids.len(), cols]` (the embedding lookup). Ids are
    /// below `rows` (checked by the caller).
    pub(crate) fn embedding(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        match self {
            Weight::Candle(m) => {
                let ids = Tensor::from_slice(ids, ids.len(), device)?;
                Ok(m.embedding(&ids)?.to_dtype(DType::F32)?)
            }
            Weight::Half(w) => {
                let values = w.values();
                let mut out = vec![0f32; ids.len() * w.cols];
                for (dst, &id) in out.chunks_exact_mut(w.cols.max(1)).zip(ids) {
                    let r = id as usize;
                    convert_half(w.kind, &values[r * w.cols..(r + 1) * w.cols], dst);
                }
                Ok(Tensor::from_vec(out, (ids.len(), w.cols), device)?)
            }
        }
    }
}

/// The most activation rows multiplied by the dot-product kernel (decode); more go through
/// `gemm` block by block.
pub(crate) const SMALL_BATCH: usize = 8;

/// Weight rows converted and multiplied per `gemm` call (prefill): 512 rows of 5,632 values are
/// 11 MiB of f32 scratch per thread (measured faster than 64-row blocks and than one block per
/// thread on the 0.85 B model: BENCHMARKS.md, "Generation").
const BLOCK_ROWS: usize = 512;

/// Weight rows per task of the dot-product kernel.
const TASK_ROWS: usize = 32;

/// `y [t, rows] = x [t, cols] · w^T` (the module docs' kernels); `x` and `y` row-major f32.
pub(crate) fn half_matmul(w: &HalfMatrix, x: &[f32], t: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    debug_assert_eq!(x.len(), t * cols);
    debug_assert_eq!(y.len(), t * rows);
    if t == 0 || rows == 0 {
        return;
    }
    let values = w.values();
    let parallel = rayon::current_num_threads() > 1;
    if t <= SMALL_BATCH {
        // y^T [rows, t] by row tasks, then transposed (a copy of t * rows values).
        let mut yt = vec![0f32; rows * t];
        let task = |(i, out): (usize, &mut [f32])| {
            let r0 = i * TASK_ROWS;
            let row = |j: usize| &values[(r0 + j) * cols..(r0 + j + 1) * cols];
            for (j, o) in out.chunks_exact_mut(t).enumerate() {
                for (s, v) in o.iter_mut().enumerate() {
                    *v = dot(w.kind, row(j), &x[s * cols..(s + 1) * cols]);
                }
            }
        };
        if parallel {
            yt.par_chunks_mut(TASK_ROWS * t).enumerate().for_each(task);
        } else {
            yt.chunks_mut(TASK_ROWS * t).enumerate().for_each(task);
        }
        if t == 1 {
            y.copy_from_slice(&yt);
        } else {
            for (r, o) in yt.chunks_exact(t).enumerate() {
                for (s, v) in o.iter().enumerate() {
                    y[s * rows + r] = *v;
                }
            }
        }
        return;
    }
    let dst = SendPtr(y.as_mut_ptr());
    let block_rows = BLOCK_ROWS;
    let blocks = rows.div_ceil(block_rows);
    let block = |scratch: &mut Vec<f32>, b: usize| {
        let r0 = b * block_rows;
        let n = block_rows.min(rows - r0);
        scratch.resize(n * cols, 0.0);
        convert_half(w.kind, &values[r0 * cols..(r0 + n) * cols], scratch);
        // SAFETY: `x` is [t, cols] row-major, `scratch` [n, cols] row-major (read as the
        // [cols, n] right-hand side: row stride 1, column stride cols), and the destination is
        // columns r0..r0 + n of `y` [t, rows] (row stride rows, column stride 1), disjoint
        // between blocks, so tasks never write the same element; `y` outlives the calls.
        unsafe {
            gemm::gemm(
                t,
                n,
                cols,
                dst.get().add(r0),
                1,
                rows as isize,
                false,
                x.as_ptr(),
                1,
                cols as isize,
                scratch.as_ptr(),
                cols as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    };
    if parallel {
        (0..blocks)
            .into_par_iter()
            .for_each_init(Vec::new, |scratch, b| block(scratch, b));
    } else {
        let mut scratch = Vec::new();
        for b in 0..blocks {
            block(&mut scratch, b);
        }
    }
}

/// A pointer handed to the tasks of one `half_matmul`, each writing its own columns.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the tasks write disjoint elements (see `half_matmul`) and finish before it returns.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// The f32 value of a 16-bit float.
#[inline(always)]
fn to_f32(kind: HalfKind, v: u16) -> f32 {
    match kind {
        HalfKind::F16 => half::f16::from_bits(v).to_f32(),
        HalfKind::Bf16 => f32::from_bits((v as u32) << 16),
    }
}

/// Lanes of the dot product (four 8-lane AVX2 accumulators).
const LANES: usize = 32;

/// `sum_i w[i] * x[i]` with the module docs' fixed order (dispatched).
#[inline]
fn dot(kind: HalfKind, w: &[u16], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked once by `avx2`).
        return unsafe {
            match kind {
                HalfKind::F16 => x86::dot_f16(w, x),
                HalfKind::Bf16 => x86::dot_bf16(w, x),
            }
        };
    }
    dot_portable(kind, w, x)
}

/// The portable dot product: the same lanes, tree and tail as the AVX2 kernels.
fn dot_portable(kind: HalfKind, w: &[u16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let body = n - n % LANES;
    let mut acc = [0f32; LANES];
    for (wc, xc) in w[..body]
        .chunks_exact(LANES)
        .zip(x[..body].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] = to_f32(kind, wc[l]).mul_add(xc[l], acc[l]);
        }
    }
    let mut tail = 0f32;
    for i in body..n {
        tail = to_f32(kind, w[i]).mul_add(x[i], tail);
    }
    reduce(&acc) + tail
}

/// The fixed reduction of the 32 lanes: the four 8-lane groups as `(g0 + g1) + (g2 + g3)`,
/// then the 8 lanes as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, the order of the
/// AVX2 horizontal sum (halves, then pairs).
fn reduce(acc: &[f32; LANES]) -> f32 {
    let mut g = [0f32; 8];
    for (j, v) in g.iter_mut().enumerate() {
        *v = (acc[j] + acc[8 + j]) + (acc[16 + j] + acc[24 + j]);
    }
    let h = [g[0] + g[4], g[1] + g[5], g[2] + g[6], g[3] + g[7]];
    let q = [h[0] + h[2], h[1] + h[3]];
    q[0] + q[1]
}

/// `dst[i] = src[i]` as f32 (exact), dispatched.
pub(crate) fn convert_half(kind: HalfKind, src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 and F16C.
        unsafe { x86::convert(kind, src, dst) };
        return;
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = to_f32(kind, s);
    }
}

/// Whether the CPU runs the AVX2 kernels (AVX2, FMA and F16C), detected once.
#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{HalfKind, LANES};

    /// 8 f16 values at `p` as f32.
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }

    /// 8 bf16 values at `p` as f32.
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
    }

    /// 8 values of `kind` at `p` as f32.
    #[inline(always)]
    unsafe fn load(kind: HalfKind, p: *const u16) -> __m256 {
        match kind {
            HalfKind::F16 => load_f16(p),
            HalfKind::Bf16 => load_bf16(p),
        }
    }

    /// The dot product of `super::dot_portable`'s order; `kind` is a constant after inlining.
    #[inline(always)]
    unsafe fn dot_with(kind: HalfKind, w: &[u16], x: &[f32]) -> f32 {
        let n = w.len().min(x.len());
        let body = n - n % LANES;
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let mut a = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < body {
            for (g, acc) in a.iter_mut().enumerate() {
                let wv = load(kind, wp.add(i + 8 * g));
                *acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(i + 8 * g)), *acc);
            }
            i += LANES;
        }
        let mut tail = 0f32;
        for j in body..n {
            tail = super::to_f32(kind, w[j]).mul_add(x[j], tail);
        }
        finish(a, tail)
    }

    /// The 32 lanes of 4 accumulators reduced in `super::reduce`'s order ((g0 + g1) + (g2 +
    /// g3), then halves, then pairs), plus the tail.
    #[inline(always)]
    unsafe fn finish(a: [__m256; 4], tail: f32) -> f32 {
        let g = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
        let h = _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps::<1>(g));
        let q = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let s = _mm_add_ss(q, _mm_shuffle_ps::<0b01>(q, q));
        _mm_cvtss_f32(s) + tail
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
        dot_with(HalfKind::F16, w, x)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
        dot_with(HalfKind::Bf16, w, x)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn convert(kind: HalfKind, src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let body = n - n % 8;
        let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        match kind {
            HalfKind::F16 => {
                while i < body {
                    _mm256_storeu_ps(dp.add(i), load_f16(sp.add(i)));
                    i += 8;
                }
            }
            HalfKind::Bf16 => {
                while i < body {
                    _mm256_storeu_ps(dp.add(i), load_bf16(sp.add(i)));
                    i += 8;
                }
            }
        }
        for j in body..n {
            dst[j] = super::to_f32(kind, src[j]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random f32 in [-1, 1) (xorshift).
    fn next(state: &mut u64) -> f32 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn random_half(kind: HalfKind, n: usize, seed: u64) -> Vec<u16> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| match kind {
                HalfKind::F16 => half::f16::from_f32(next(&mut s)).to_bits(),
                HalfKind::Bf16 => half::bf16::from_f32(next(&mut s)).to_bits(),
            })
            .collect()
    }

    #[test]
    fn dispatched_dot_equals_portable_bit_for_bit() {
        for kind in [HalfKind::F16, HalfKind::Bf16] {
            for n in [0, 1, 7, 8, 31, 32, 33, 64, 95, 2048, 2049] {
                let w = random_half(kind, n, 7 + n as u64);
                let mut s = 99 + n as u64;
                let x: Vec<f32> = (0..n).map(|_| next(&mut s)).collect();
                let a = dot(kind, &w, &x);
                let b = dot_portable(kind, &w, &x);
                assert_eq!(a.to_bits(), b.to_bits(), "{kind:?} n={n}: {a} vs {b}");
                let exact: f64 = w
                    .iter()
                    .zip(&x)
                    .map(|(&w, &x)| to_f32(kind, w) as f64 * x as f64)
                    .sum();
                assert!(
                    (a as f64 - exact).abs() <= 1e-5 * (n as f64).sqrt().max(1.0),
                    "{kind:?} n={n}: {a} vs f64 {exact}"
                );
            }
        }
    }

    #[test]
    fn convert_is_exact() {
        for kind in [HalfKind::F16, HalfKind::Bf16] {
            let src = random_half(kind, 77, 5);
            let mut dst = vec![0f32; 77];
            convert_half(kind, &src, &mut dst);
            for (s, d) in src.iter().zip(&dst) {
                assert_eq!(d.to_bits(), to_f32(kind, *s).to_bits());
            }
        }
        // Specials: f16 infinity, NaN, subnormal, negative zero.
        let src = [0x7c00u16, 0x7e00, 0x0001, 0x8000];
        let mut dst = [0f32; 4];
        convert_half(HalfKind::F16, &src, &mut dst);
        assert_eq!(dst[0], f32::INFINITY);
        assert!(dst[1].is_nan());
        assert_eq!(dst[2], 2f32.powi(-24));
        assert_eq!(dst[3].to_bits(), (-0f32).to_bits());
    }

    /// Every path (1..=SMALL_BATCH rows and the gemm blocks) against an f64 reference, on
    /// shapes with partial blocks and tails.
    #[test]
    fn half_matmul_matches_f64_reference() {
        for kind in [HalfKind::F16, HalfKind::Bf16] {
            for (rows, cols) in [(1, 1), (3, 40), (65, 33), (130, 96)] {
                let w = HalfMatrix::owned(
                    kind,
                    random_half(kind, rows * cols, rows as u64 * 31 + cols as u64),
                    rows,
                    cols,
                );
                for t in [1, 2, 3, SMALL_BATCH, SMALL_BATCH + 1, 20] {
                    let mut s = 1234 + t as u64;
                    let x: Vec<f32> = (0..t * cols).map(|_| next(&mut s)).collect();
                    let mut y = vec![f32::NAN; t * rows];
                    half_matmul(&w, &x, t, &mut y);
                    let v = w.values();
                    for i in 0..t {
                        for r in 0..rows {
                            let exact: f64 = (0..cols)
                                .map(|c| {
                                    to_f32(kind, v[r * cols + c]) as f64 * x[i * cols + c] as f64
                                })
                                .sum();
                            let got = y[i * rows + r] as f64;
                            assert!(
                                (got - exact).abs() <= 1e-5 * (cols as f64).sqrt(),
                                "{kind:?} [{rows}x{cols}] t={t} ({i},{r}): {got} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Decode rows are batch-invariant: a row's result is the same alone and at any place in a
    /// batch of up to SMALL_BATCH rows.
    #[test]
    fn small_batches_are_batch_invariant() {
        let (rows, cols) = (70, 2051);
        let w = HalfMatrix::owned(
            HalfKind::F16,
            random_half(HalfKind::F16, rows * cols, 3),
            rows,
            cols,
        );
        let mut s = 42;
        let x: Vec<f32> = (0..SMALL_BATCH * cols).map(|_| next(&mut s)).collect();
        let mut all = vec![0f32; SMALL_BATCH * rows];
        half_matmul(&w, &x, SMALL_BATCH, &mut all);
        for i in 0..SMALL_BATCH {
            let mut one = vec![0f32; rows];
            half_matmul(&w, &x[i * cols..(i + 1) * cols], 1, &mut one);
            for r in 0..rows {
                assert_eq!(
                    one[r].to_bits(),
                    all[i * rows + r].to_bits(),
                    "row {i} out {r}"
                );
            }
        }
    }
}
