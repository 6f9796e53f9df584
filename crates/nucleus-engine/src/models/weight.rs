//! [`Weight`]: the matrix of a linear layer (and the embedding table), kept in its stored type.
//!
//! f16 and bf16 matrices ([`HalfMatrix`]) stay 16-bit in memory, memory-mapped from a GGUF
//! file where one was mapped, and are multiplied by our own kernels ([`half_matmul`]): each
//! weight is converted to f32 as it is read (exact: every f16 and bf16 value is an f32 value)
//! and products are accumulated in f32, so a decode step reads 2 bytes per weight, not the 4 of
//! an f32 copy (candle's `QMatMul` converts f16 / bf16 to f32 at load). Quantized ggml types
//! stay in their blocks ([`QuantMatrix`], in place in a mapped GGUF file); f32 matrices are
//! held by candle's `QMatMul` and multiplied by our f32 kernels.
//!
//! The products are [`crate::models::matmul`]'s: one fixed order per output value, so a row's
//! result does not depend on the batch it runs in.

use std::fmt;
use std::sync::Arc;

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};

use crate::error::{EngineError, Result};
use crate::models::matmul::{self, Bf16, Elem, F16};
use crate::models::quant::QuantMatrix;

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
    /// f32 (multiplied by [`matmul::matmul`], in the same order as f16 and bf16), or a type
    /// candle keeps in its own form (multiplied by candle).
    Candle(QMatMul),
    /// f16 or bf16, multiplied by [`half_matmul`].
    Half(HalfMatrix),
    /// ggml blocks, read in place from a mapped GGUF file or copied once.
    Quant(QuantMatrix),
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
            Weight::Quant(m) => m.dims(),
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
        if let Weight::Candle(m) = self {
            if !matches!(m, QMatMul::Tensor(w) if w.dtype() == DType::F32) {
                return Ok(m.forward(x)?);
            }
        }
        let (rows, cols) = self.dims();
        let dims = x.dims().to_vec();
        if dims.last() != Some(&cols) {
            return Err(EngineError::InvalidRequest(format!(
                "internal: a [{rows}, {cols}] weight times activations of shape {dims:?}"
            )));
        }
        let t = x.elem_count() / cols.max(1);
        let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let y = self.matmul_rows(&xs, t, x.device())?;
        let mut out_dims = dims;
        *out_dims.last_mut().expect("at least one dimension") = rows;
        Ok(Tensor::from_vec(y, out_dims, x.device())?)
    }

    /// `xs [t, in]` (f32, row-major) times the transpose: `[t, out]` f32, row-major. The
    /// same products as [`Weight::forward`] without the tensors around them (the feed-forward
    /// block chains its three products and SwiGLU on these vectors). `device` is where a
    /// weight kept by candle lives (its product runs on a tensor there).
    ///
    /// # Errors
    /// `xs.len() != t * in` (`InvalidRequest`, a caller's bug); candle's errors.
    pub(crate) fn matmul_rows(&self, xs: &[f32], t: usize, device: &Device) -> Result<Vec<f32>> {
        let (rows, cols) = self.dims();
        if xs.len() != t * cols {
            return Err(EngineError::InvalidRequest(format!(
                "internal: a [{rows}, {cols}] weight times {} values as {t} rows",
                xs.len()
            )));
        }
        let mut y = vec![0f32; t * rows];
        match self {
            Weight::Candle(QMatMul::Tensor(w)) if w.dtype() == DType::F32 => {
                let (storage, layout) = w.storage_and_layout();
                match (&*storage, layout.contiguous_offsets()) {
                    (candle_core::Storage::Cpu(cpu), Some((start, end))) => {
                        let values = &cpu.as_slice::<f32>()?[start..end];
                        matmul::matmul(values, rows, cols, xs, t, &mut y);
                    }
                    // Not on the CPU or not contiguous: candle's product.
                    _ => {
                        drop(storage);
                        let w = QMatMul::Tensor(w.clone());
                        return candle_rows(&w, xs, t, cols, device);
                    }
                }
            }
            Weight::Candle(m) => return candle_rows(m, xs, t, cols, device),
            Weight::Half(w) => half_matmul(w, xs, t, &mut y),
            Weight::Quant(m) => m.matmul(xs, t, &mut y)?,
        }
        Ok(y)
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
            Weight::Quant(m) => {
                let out = m.embedding(ids)?;
                Ok(Tensor::from_vec(out, (ids.len(), m.dims().1), device)?)
            }
        }
    }
}

/// candle's product of `xs [t, cols]` (f32) and the transpose of `m`, on `device`, as f32
/// values row after row.
fn candle_rows(
    m: &QMatMul,
    xs: &[f32],
    t: usize,
    cols: usize,
    device: &Device,
) -> Result<Vec<f32>> {
    let x = Tensor::from_slice(xs, (t, cols), device)?;
    Ok(m.forward(&x)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// `y [t, rows] = x [t, cols] · w^T` ([`matmul::matmul`]); `x` and `y` row-major f32.
pub(crate) fn half_matmul(w: &HalfMatrix, x: &[f32], t: usize, y: &mut [f32]) {
    /// The bits as the element type `E` (`F16` or `Bf16`).
    fn view<E: Elem>(values: &[u16]) -> &[E] {
        assert_eq!(std::mem::size_of::<E>(), 2, "a 16-bit element type");
        // SAFETY: called with `F16` and `Bf16` only, which are `repr(transparent)` over `u16`
        // (same size, alignment and validity); the slice keeps the borrow of `values`.
        unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<E>(), values.len()) }
    }
    let values = w.values();
    match w.kind {
        HalfKind::F16 => matmul::matmul(view::<F16>(values), w.rows, w.cols, x, t, y),
        HalfKind::Bf16 => matmul::matmul(view::<Bf16>(values), w.rows, w.cols, x, t, y),
    }
}

/// The f32 value of a 16-bit float.
#[inline(always)]
fn to_f32(kind: HalfKind, v: u16) -> f32 {
    match kind {
        HalfKind::F16 => F16(v).to_f32(),
        HalfKind::Bf16 => Bf16(v).to_f32(),
    }
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
    matmul::avx2()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::HalfKind;
    use crate::models::matmul::{Bf16, Elem, F16};

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn convert(kind: HalfKind, src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let body = n - n % 8;
        let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        match kind {
            HalfKind::F16 => {
                while i < body {
                    _mm256_storeu_ps(dp.add(i), F16::load8(sp.add(i).cast()));
                    i += 8;
                }
            }
            HalfKind::Bf16 => {
                while i < body {
                    _mm256_storeu_ps(dp.add(i), Bf16::load8(sp.add(i).cast()));
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

    #[test]
    fn convert_is_exact() {
        let mut state = 5u64;
        for kind in [HalfKind::F16, HalfKind::Bf16] {
            let src: Vec<u16> = (0..77)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 48) as u16
                })
                .collect();
            let mut dst = vec![0f32; 77];
            convert_half(kind, &src, &mut dst);
            for (s, d) in src.iter().zip(&dst) {
                let want = to_f32(kind, *s);
                assert!(
                    d.to_bits() == want.to_bits() || (d.is_nan() && want.is_nan()),
                    "{kind:?} {s:#x}: {d} vs {want}"
                );
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
}
