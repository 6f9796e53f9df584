//! ggml-quantized matrices read in place from a memory-mapped GGUF file: a candle
//! [`QuantizedType`] whose blocks are the file's bytes, so the page cache's copy of the file is
//! the only copy of the blocks (candle's own storage is a `Vec` of blocks copied out of the
//! file).
//!
//! candle multiplies them with the kernels it uses for its own storage (`k_quants::matmul`,
//! and its repacked x86 tiles where it chooses them: `candle_core::quantized::repack_x86`,
//! which keeps its tiles beside the blocks it packed). [`crate::loader`] runs one row through
//! each matrix at load, so that candle packs what it packs then, and releases the mapped pages
//! (`MADV_DONTNEED`): where candle packed, the tiles are the one copy kept resident; where it
//! did not, the pages come back from the page cache when the matrix is first used.

use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::quantized::k_quants::{self, GgmlType};
use candle_core::quantized::{GgmlDType, QStorage, QTensor, QuantizedType};
use candle_core::{CpuStorage, Result as CandleResult};
use half::f16;

/// `len` blocks of `T` at byte `offset` of `map` (aligned for `T`, within the map).
struct MappedBlocks<T> {
    map: Arc<memmap2::Mmap>,
    offset: usize,
    len: usize,
    _blocks: PhantomData<T>,
}

impl<T: GgmlType> MappedBlocks<T> {
    fn blocks(&self) -> &[T] {
        // SAFETY: `mapped_qtensor` checked that `offset..offset + len * size_of::<T>()` lies
        // within the map and that its start is aligned for `T`; ggml's block types are plain
        // old data (f16 scales and integer quants), valid for every bit pattern; the map is
        // read-only and lives as long as `self`.
        unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().add(self.offset).cast::<T>(), self.len)
        }
    }
}

impl<T: GgmlType + Send + Sync + 'static> QuantizedType for MappedBlocks<T> {
    fn dtype(&self) -> GgmlDType {
        T::DTYPE
    }

    fn matmul_t(
        &self,
        mkn: (usize, usize, usize),
        lhs: &[f32],
        dst: &mut [f32],
    ) -> CandleResult<()> {
        k_quants::matmul(mkn, lhs, self.blocks(), dst)
    }

    fn matmul_t_f16(
        &self,
        mkn: (usize, usize, usize),
        lhs: &[f16],
        dst: &mut [f16],
    ) -> CandleResult<()> {
        k_quants::matmul_f16(mkn, lhs, self.blocks(), dst)
    }

    /// candle's `Vec<T>` embedding: the rows `ids` dequantized.
    fn embedding(&self, ids: &[u32], rows: usize, hidden: usize) -> CandleResult<CpuStorage> {
        if !hidden.is_multiple_of(T::BLCK_SIZE) {
            candle_core::bail!(
                "quantized embedding hidden size {hidden} is not divisible by block size {}",
                T::BLCK_SIZE
            )
        }
        let row_blocks = hidden / T::BLCK_SIZE;
        if self.len != rows * row_blocks {
            candle_core::bail!(
                "quantized tensor has {} blocks, expected {}",
                self.len,
                rows * row_blocks
            )
        }
        let blocks = self.blocks();
        let mut out = vec![0f32; ids.len() * hidden];
        for (dst, &id) in out.chunks_exact_mut(hidden.max(1)).zip(ids) {
            let row = id as usize;
            if row >= rows {
                candle_core::bail!("embedding id {row} is out of range for {rows} rows")
            }
            T::to_float(&blocks[row * row_blocks..(row + 1) * row_blocks], dst);
        }
        Ok(CpuStorage::F32(out))
    }

    fn dequantize(&self, elem_count: usize) -> CandleResult<CpuStorage> {
        let mut ys = vec![0f32; elem_count];
        T::to_float(self.blocks(), &mut ys);
        Ok(CpuStorage::F32(ys))
    }

    fn storage_size_in_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    fn as_ptr(&self) -> *const u8 {
        self.blocks().as_ptr().cast()
    }

    fn block_size(&self) -> usize {
        T::BLCK_SIZE
    }

    fn from_float(&mut self, _xs: &[f32]) {
        // candle calls `from_float` only on storage it has just allocated itself
        // (`QTensor::quantize`), never on a loaded tensor's.
        unreachable!("a memory-mapped weight is read-only")
    }

    fn from_float_imatrix(&mut self, _xs: &[f32], _imatrix_weights: &[f32], _n_per_row: usize) {
        unreachable!("a memory-mapped weight is read-only")
    }

    fn size(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

/// The quantized matrix `dims` (`[rows, cols]`, or `[experts, rows, cols]`) of `dtype` whose
/// `bytes` blocks lie at byte `offset` of `map`, read in place; `None` for a type this does not
/// map (f32, f16, bf16, and candle's dot-product intermediates Q8_1 / Q8K), a size that does
/// not match, a range outside the map or a start not aligned for the block type (the caller
/// then copies the blocks).
pub(crate) fn mapped_qtensor(
    dtype: GgmlDType,
    map: &Arc<memmap2::Mmap>,
    offset: usize,
    bytes: usize,
    dims: &[usize],
) -> Option<QTensor> {
    fn make<T: GgmlType + Send + Sync + 'static>(
        map: &Arc<memmap2::Mmap>,
        offset: usize,
        bytes: usize,
        dims: &[usize],
    ) -> Option<QTensor> {
        let size = std::mem::size_of::<T>();
        let elems = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
        let len = elems / T::BLCK_SIZE;
        let aligned = (map.as_ptr() as usize + offset).is_multiple_of(std::mem::align_of::<T>());
        let fits = offset
            .checked_add(bytes)
            .is_some_and(|end| end <= map.len());
        if len.checked_mul(size) != Some(bytes) || !aligned || !fits {
            return None;
        }
        let storage = MappedBlocks::<T> {
            map: map.clone(),
            offset,
            len,
            _blocks: PhantomData,
        };
        QTensor::new(QStorage::Cpu(Box::new(storage)), dims.to_vec()).ok()
    }
    use k_quants::*;
    match dtype {
        GgmlDType::Q4_0 => make::<BlockQ4_0>(map, offset, bytes, dims),
        GgmlDType::Q4_1 => make::<BlockQ4_1>(map, offset, bytes, dims),
        GgmlDType::Q5_0 => make::<BlockQ5_0>(map, offset, bytes, dims),
        GgmlDType::Q5_1 => make::<BlockQ5_1>(map, offset, bytes, dims),
        GgmlDType::Q8_0 => make::<BlockQ8_0>(map, offset, bytes, dims),
        GgmlDType::Q2K => make::<BlockQ2K>(map, offset, bytes, dims),
        GgmlDType::Q3K => make::<BlockQ3K>(map, offset, bytes, dims),
        GgmlDType::Q4K => make::<BlockQ4K>(map, offset, bytes, dims),
        GgmlDType::Q5K => make::<BlockQ5K>(map, offset, bytes, dims),
        GgmlDType::Q6K => make::<BlockQ6K>(map, offset, bytes, dims),
        _ => None,
    }
}
