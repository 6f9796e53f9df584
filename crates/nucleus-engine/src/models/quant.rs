//! ggml-quantized matrices kept in their blocks ([`QuantMatrix`]): read in place from a
//! memory-mapped GGUF file ([`mapped_quant`]: the page cache's copy of the file is the only
//! copy of the blocks, and loading them costs what mapping the file costs, llama.cpp's
//! `use_mmap`, not a copy or a repacking), or copied once where the file is not mapped
//! ([`owned_quant`]). Both multiply the same way, so they give the same bits.
//!
//! They multiply as ggml does (`ggml_compute_forward_mul_mat`): each activation row is
//! quantized to the weight type's dot-product type (Q8_0 or Q8_K), then each output is the dot
//! product of a weight row and a quantized activation row, whatever the number of rows. Q8_0,
//! Q4_0, Q4_K and Q6_K by our kernels ([`crate::models::qmatmul`]: decode at the memory floor,
//! one reduction order per output), the other types by candle's `k_quants::matmul` (one
//! `vec_dot` per output); either way a row's result does not depend on the batch. candle's
//! `QMatMul` is not used for them: on x86 it repacks Q4_K (and, with AVX-512 VNNI, Q8_0; for
//! several rows, Q6_K) into tiles of its own on first use, a second resident copy of the
//! weights that costs seconds of load (BENCHMARKS.md, "Generation"). Embedding rows are
//! dequantized exactly by candle's `to_float` (ggml's `dequantize_row_*`).

use std::any::TypeId;
use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::quantized::k_quants::{self, GgmlType};
use candle_core::quantized::GgmlDType;
use candle_core::Result as CandleResult;

use crate::models::qmatmul;

/// The blocks of a [`QuantMatrix`].
enum Stored<T> {
    /// `len` blocks of `T` at byte `offset` of `map` (aligned for `T`, within the map).
    Mapped {
        map: Arc<memmap2::Mmap>,
        offset: usize,
        len: usize,
        _blocks: PhantomData<T>,
    },
    /// Blocks copied out of the file.
    Owned(Vec<T>),
}

impl<T: GgmlType> Stored<T> {
    fn blocks(&self) -> &[T] {
        match self {
            Stored::Owned(v) => v,
            // SAFETY: `mapped_quant` checked that `offset..offset + len * size_of::<T>()` lies
            // within the map and that its start is aligned for `T`; ggml's block types are
            // plain old data (f16 scales and integer quants), valid for every bit pattern; the
            // map is read-only and lives as long as `self`.
            Stored::Mapped {
                map, offset, len, ..
            } => unsafe { std::slice::from_raw_parts(map.as_ptr().add(*offset).cast::<T>(), *len) },
        }
    }
}

/// What a [`QuantMatrix`] does with its blocks, whatever their type.
trait Blocks: Send + Sync {
    /// `dst [t, rows] = lhs [t, cols] · W^T` ([`QuantMatrix::matmul`]; `mkn` = `(t, cols, rows)`).
    fn matmul_t(
        &self,
        mkn: (usize, usize, usize),
        lhs: &[f32],
        dst: &mut [f32],
    ) -> CandleResult<()>;

    /// The rows `r0..r0 + dst.len() / cols` (each `cols / BLCK_SIZE` blocks) to f32.
    fn dequantize_rows(&self, r0: usize, cols: usize, dst: &mut [f32]);
}

/// `blocks` as `&[U]` when `T` is `U`.
fn as_type<T: 'static, U: 'static>(blocks: &[T]) -> Option<&[U]> {
    // SAFETY: `T` and `U` are the same type.
    (TypeId::of::<T>() == TypeId::of::<U>())
        .then(|| unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<U>(), blocks.len()) })
}

impl<T: GgmlType + Send + Sync + 'static> Blocks for Stored<T> {
    fn matmul_t(
        &self,
        (t, cols, rows): (usize, usize, usize),
        lhs: &[f32],
        dst: &mut [f32],
    ) -> CandleResult<()> {
        use qmatmul::{matmul, Q4K, Q4_0, Q6K, Q8_0};
        let blocks = self.blocks();
        if let Some(b) = as_type(blocks) {
            matmul::<Q8_0>(b, rows, cols, lhs, t, dst)
        } else if let Some(b) = as_type(blocks) {
            matmul::<Q4_0>(b, rows, cols, lhs, t, dst)
        } else if let Some(b) = as_type(blocks) {
            matmul::<Q4K>(b, rows, cols, lhs, t, dst)
        } else if let Some(b) = as_type(blocks) {
            matmul::<Q6K>(b, rows, cols, lhs, t, dst)
        } else {
            return k_quants::matmul((t, cols, rows), lhs, blocks, dst);
        }
        Ok(())
    }

    fn dequantize_rows(&self, r0: usize, cols: usize, dst: &mut [f32]) {
        let per_row = cols / T::BLCK_SIZE;
        let rows = dst.len() / cols.max(1);
        let blocks = &self.blocks()[r0 * per_row..(r0 + rows) * per_row];
        T::to_float(blocks, dst);
    }
}

/// A row-major `[rows, cols]` matrix of ggml blocks (the module docs).
#[derive(Clone)]
pub(crate) struct QuantMatrix {
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    blocks: Arc<dyn Blocks>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantMatrix")
            .field("dtype", &self.dtype)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl QuantMatrix {
    /// `[rows, cols]`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// `y [t, rows] = x [t, cols] · W^T` (f32, row-major), ggml's semantics (each activation
    /// row quantized to the weight type's dot-product type, Q8_0 or Q8_K, then dot products),
    /// the same for every `t`: Q8_0, Q4_0, Q4_K and Q6_K by our kernels
    /// ([`crate::models::qmatmul`]), the other types by candle's `k_quants::matmul` (one
    /// `vec_dot` per output). Either way each output is computed alone, so a row's result does
    /// not depend on the batch.
    ///
    /// # Errors
    /// Lengths that do not match (a caller's bug).
    pub(crate) fn matmul(&self, x: &[f32], t: usize, y: &mut [f32]) -> CandleResult<()> {
        if x.len() != t * self.cols || y.len() != t * self.rows {
            candle_core::bail!(
                "internal: [{t}, {}] activations for a [{}, {}] weight",
                x.len() / t.max(1),
                self.rows,
                self.cols
            );
        }
        self.blocks.matmul_t((t, self.cols, self.rows), x, y)
    }

    /// The rows `ids` dequantized to f32 `[ids.len() * cols]`.
    ///
    /// # Errors
    /// An id not below `rows`.
    pub(crate) fn embedding(&self, ids: &[u32]) -> CandleResult<Vec<f32>> {
        let mut out = vec![0f32; ids.len() * self.cols];
        for (dst, &id) in out.chunks_exact_mut(self.cols.max(1)).zip(ids) {
            let row = id as usize;
            if row >= self.rows {
                candle_core::bail!("embedding id {row} is out of range for {} rows", self.rows)
            }
            self.blocks.dequantize_rows(row, self.cols, dst);
        }
        Ok(out)
    }
}

/// `$body` with `$T` the block type of the ggml type `$dtype`; `None` for a type without
/// blocks of candle's (f32, f16, bf16) or one that is only a dot-product intermediate (Q8_1,
/// Q8K).
macro_rules! with_block_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        with_block_type!(@arms $dtype, $T, $body, Q4_0 BlockQ4_0, Q4_1 BlockQ4_1,
            Q5_0 BlockQ5_0, Q5_1 BlockQ5_1, Q8_0 BlockQ8_0, Q2K BlockQ2K, Q3K BlockQ3K,
            Q4K BlockQ4K, Q5K BlockQ5K, Q6K BlockQ6K)
    };
    (@arms $dtype:expr, $T:ident, $body:expr, $($d:ident $b:ident),*) => {{
        use k_quants::*;
        match $dtype {
            $(GgmlDType::$d => {
                type $T = $b;
                $body
            })*
            _ => None,
        }
    }};
}

impl QuantMatrix {
    /// The blocks of a `[rows, cols]` matrix of `T` whose `bytes` bytes hold them; `None` when
    /// a row is not a whole number of blocks or the size does not match.
    fn block_count<T: GgmlType>(rows: usize, cols: usize, bytes: usize) -> Option<usize> {
        if !cols.is_multiple_of(T::BLCK_SIZE) {
            return None;
        }
        let len = rows.checked_mul(cols / T::BLCK_SIZE)?;
        (len.checked_mul(std::mem::size_of::<T>()) == Some(bytes)).then_some(len)
    }

    fn of<T: GgmlType + Send + Sync + 'static>(
        rows: usize,
        cols: usize,
        stored: Stored<T>,
    ) -> Self {
        Self {
            dtype: T::DTYPE,
            rows,
            cols,
            blocks: Arc::new(stored),
        }
    }
}

/// The quantized `[rows, cols]` matrix of `dtype` whose `bytes` blocks lie at byte `offset` of
/// `map`, read in place; `None` for a type this does not hold (f32, f16, bf16, and candle's
/// dot-product intermediates Q8_1 / Q8K), a size that does not match, a row length that is not
/// a multiple of the block, a range outside the map or a start not aligned for the block type
/// (the caller then copies the blocks: [`owned_quant`]).
pub(crate) fn mapped_quant(
    dtype: GgmlDType,
    map: &Arc<memmap2::Mmap>,
    offset: usize,
    bytes: usize,
    rows: usize,
    cols: usize,
) -> Option<QuantMatrix> {
    fn make<T: GgmlType + Send + Sync + 'static>(
        map: &Arc<memmap2::Mmap>,
        offset: usize,
        bytes: usize,
        rows: usize,
        cols: usize,
    ) -> Option<QuantMatrix> {
        let len = QuantMatrix::block_count::<T>(rows, cols, bytes)?;
        let aligned = (map.as_ptr() as usize + offset).is_multiple_of(std::mem::align_of::<T>());
        let fits = offset
            .checked_add(bytes)
            .is_some_and(|end| end <= map.len());
        (aligned && fits).then(|| {
            let stored = Stored::<T>::Mapped {
                map: map.clone(),
                offset,
                len,
                _blocks: PhantomData,
            };
            QuantMatrix::of(rows, cols, stored)
        })
    }
    with_block_type!(dtype, T => make::<T>(map, offset, bytes, rows, cols))
}

/// The quantized `[rows, cols]` matrix of `dtype` whose blocks are `bytes` (copied); `None` as
/// [`mapped_quant`] for a type it does not hold or a size that does not match.
pub(crate) fn owned_quant(
    dtype: GgmlDType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
) -> Option<QuantMatrix> {
    fn make<T: GgmlType + Send + Sync + 'static>(
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Option<QuantMatrix> {
        let len = QuantMatrix::block_count::<T>(rows, cols, bytes.len())?;
        let mut blocks = vec![T::zeros(); len];
        // SAFETY: ggml's block types are plain old data, valid for every bit pattern; the
        // destination holds exactly `bytes.len()` bytes (`block_count`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                blocks.as_mut_ptr().cast::<u8>(),
                bytes.len(),
            )
        };
        Some(QuantMatrix::of(rows, cols, Stored::Owned(blocks)))
    }
    with_block_type!(dtype, T => make::<T>(bytes, rows, cols))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// A `[rows, cols]` matrix quantized by candle to `dtype`, as owned blocks, and its values.
    fn quantized(dtype: GgmlDType, rows: usize, cols: usize, seed: u64) -> (QuantMatrix, Vec<f32>) {
        let mut s = seed | 1;
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| crate::models::matmul::tests::next(&mut s))
            .collect();
        let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap();
        let q = candle_core::quantized::QTensor::quantize(&t, dtype).unwrap();
        let exact = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let bytes = q.data().unwrap();
        (owned_quant(dtype, &bytes, rows, cols).unwrap(), exact)
    }

    /// Every batch size (decode's and prefill's): ggml's semantics, the activations rounded
    /// to 8 bits (Q8_0 / Q8_K), within that rounding of an f64 reference of the exact weights
    /// and f32 activations; and each activation row's outputs the same bits alone as in the
    /// batch, for our kernels' types (Q8_0, Q4_0, Q4_K, Q6_K) and candle's (Q5_K).
    #[test]
    fn every_batch_is_within_the_activations_rounding_and_invariant() {
        for (dtype, rows, cols) in [
            (GgmlDType::Q8_0, 53, 96),
            (GgmlDType::Q4_0, 50, 64),
            (GgmlDType::Q4K, 13, 512),
            (GgmlDType::Q6K, 49, 256),
            (GgmlDType::Q5K, 7, 256),
        ] {
            let (m, exact) = quantized(dtype, rows, cols, rows as u64 * 31 + cols as u64);
            for t in [1, 3, 8, 9, 21] {
                let mut s = 1000 + t as u64;
                let x: Vec<f32> = (0..t * cols)
                    .map(|_| crate::models::matmul::tests::next(&mut s))
                    .collect();
                let mut y = vec![f32::NAN; t * rows];
                m.matmul(&x, t, &mut y).unwrap();
                for i in 0..t {
                    let mut alone = vec![f32::NAN; rows];
                    m.matmul(&x[i * cols..(i + 1) * cols], 1, &mut alone)
                        .unwrap();
                    for r in 0..rows {
                        assert_eq!(
                            y[i * rows + r].to_bits(),
                            alone[r].to_bits(),
                            "{dtype:?} t={t} ({i},{r}): batch vs alone"
                        );
                        let reference: f64 = (0..cols)
                            .map(|c| exact[r * cols + c] as f64 * x[i * cols + c] as f64)
                            .sum();
                        let got = y[i * rows + r] as f64;
                        // Activations rounded to 8 bits (ggml's Q8_0 / Q8_K).
                        let bound = 1e-2 * (cols as f64).sqrt();
                        assert!(
                            (got - reference).abs() <= bound,
                            "{dtype:?} [{rows}x{cols}] t={t} ({i},{r}): {got} vs f64 {reference}"
                        );
                    }
                }
            }
        }
    }
}
