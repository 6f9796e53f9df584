//! [`KvCache`]: the attention keys and values of one sequence, per layer.
//!
//! One cache belongs to one sequence. [`crate::Transformer::forward`] appends the keys and values of
//! the sequence's new tokens to it and attends over everything it holds, so the cache length is the
//! position of the next token. The scheduler owns the caches; the model owns none.
//!
//! # Layout
//! Per layer, one key and one value tensor, shape `[n_kv_head, capacity, head_dim]`, of which
//! positions `0..len()` are valid, in the cache's [`KvCacheDtype`]: f16 (the engine's default,
//! as llama.cpp's `--cache-type-k/v f16`: half the memory) or f32 (exact). Keys are stored after RoPE (as llama.cpp stores them). New
//! entries are written in place (`Tensor::slice_set`); when the capacity is reached the storage is
//! reallocated at twice the capacity (at least the needed length, at most the model's context
//! length), so appending `n` tokens costs `O(n)` amortised and the cache is never re-concatenated.
//! Attention reads the valid prefix of an f32 cache as a view (`narrow`), without a copy, and
//! that of an f16 cache converted to f32 in one pass per layer and step (exact: every f16 value
//! is an f32 value; a temporary f32 copy of one layer's keys and values, which attention then
//! reads);
//! new f32 keys and values are rounded to the nearest f16 when written (`half`'s `from_f32`,
//! round to nearest even; beyond the f16 range they become infinities).
//! [`KvCache::copies`] counts the times valid positions were copied (growth, copy-on-write).
//!
//! # Clones are independent (copy-on-write)
//! `clone()` is cheap: the clone shares the storage with the original. The first write into a cache
//! whose storage is shared copies the valid prefix into fresh storage first, so a write into one
//! clone never changes another. This is what forking `n` samples from one prefilled prompt needs:
//! clone the prompt's cache `n` times; each fork pays for its copy when it first decodes.
//!
//! # Rollback
//! [`KvCache::truncate`] shortens the valid length (speculative tokens that were rejected); the next
//! append overwrites the dropped positions.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::error::{EngineError, Result};
use crate::models::weight::{convert_half, HalfKind};

/// The element type of a [`KvCache`]'s keys and values.
///
/// `F16` is the default of [`crate::EngineConfig`] and of the CLI's `--kv-cache-dtype`, as
/// llama.cpp's (`--cache-type-k f16 --cache-type-v f16`, `llama_context_params.type_k`); `F32`
/// keeps the keys and values exactly as computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// IEEE binary16: 2 bytes per value.
    #[default]
    F16,
    /// f32: 4 bytes per value.
    F32,
}

impl KvCacheDtype {
    /// The name used by the CLI and the server: `f16` or `f32`.
    pub fn as_str(self) -> &'static str {
        match self {
            KvCacheDtype::F16 => "f16",
            KvCacheDtype::F32 => "f32",
        }
    }

    /// Bytes per stored value: 2 or 4.
    pub fn size_in_bytes(self) -> usize {
        match self {
            KvCacheDtype::F16 => 2,
            KvCacheDtype::F32 => 4,
        }
    }

    fn dtype(self) -> DType {
        match self {
            KvCacheDtype::F16 => DType::F16,
            KvCacheDtype::F32 => DType::F32,
        }
    }
}

impl std::fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    /// `f16` or `f32` (exactly); anything else is an error naming the two.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f16" => Ok(KvCacheDtype::F16),
            "f32" => Ok(KvCacheDtype::F32),
            other => Err(format!(
                "unknown KV cache dtype {other:?}: expected f16 or f32"
            )),
        }
    }
}

/// Smallest capacity (positions) allocated on the first append.
const MIN_CAPACITY: usize = 16;

/// Key and value storage of all layers, shared between clones until one of them writes.
#[derive(Debug)]
struct Storage {
    /// Per layer: `[n_kv_head, capacity, head_dim]` in the cache's dtype.
    k: Vec<Tensor>,
    /// Per layer: `[n_kv_head, capacity, head_dim]` in the cache's dtype.
    v: Vec<Tensor>,
    /// Positions allocated per layer.
    capacity: usize,
}

/// The key/value cache of one sequence: per layer, keys and values of positions `0..len()`.
///
/// Create one with [`crate::Transformer::new_cache`] (or [`KvCache::new`] with the model's
/// dimensions). `Clone` gives an independent copy (copy-on-write, see the module docs). Storage is
/// allocated lazily on the first append. `Send + Sync`.
#[derive(Debug, Clone)]
pub struct KvCache {
    n_layer: usize,
    n_kv_head: usize,
    head_dim: usize,
    max_len: usize,
    dtype: KvCacheDtype,
    device: Device,
    len: usize,
    storage: Option<Arc<Storage>>,
    /// Times the valid positions were copied into new storage.
    copies: u64,
}

impl KvCache {
    /// An empty cache for a model with `n_layer` layers, `n_kv_head` key/value heads of
    /// `head_dim` values each, holding at most `max_len` positions (the model's context length),
    /// with values of `dtype` stored on `device`. Allocates nothing until the first append.
    pub fn new(
        n_layer: usize,
        n_kv_head: usize,
        head_dim: usize,
        max_len: usize,
        dtype: KvCacheDtype,
        device: &Device,
    ) -> Self {
        Self {
            dtype,
            n_layer,
            n_kv_head,
            head_dim,
            max_len,
            device: device.clone(),
            len: 0,
            storage: None,
            copies: 0,
        }
    }

    /// Number of valid positions: the tokens this sequence has run through the model, and the
    /// position (0-based) of its next token.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no position is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions allocated per layer (0 before the first append). Grows by doubling.
    pub fn capacity(&self) -> usize {
        self.storage.as_ref().map_or(0, |s| s.capacity)
    }

    /// The most positions this cache can hold (the model's context length).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Number of layers.
    pub fn n_layer(&self) -> usize {
        self.n_layer
    }

    /// Key/value heads per layer.
    pub fn n_kv_head(&self) -> usize {
        self.n_kv_head
    }

    /// Values per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The device the storage lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The element type of the stored keys and values.
    pub fn dtype(&self) -> KvCacheDtype {
        self.dtype
    }

    /// How many times this cache copied its valid positions into new storage: on growth past
    /// its capacity (doubling, so `O(log n)` times for `n` positions) and on the first write
    /// after a clone (copy-on-write). Appending never copies otherwise. Clones start with the
    /// original's count. For tests and profiling.
    pub fn copies(&self) -> u64 {
        self.copies
    }

    /// Keeps the first `len` positions and drops the rest (rollback of rejected speculative
    /// tokens). `len >= self.len()` is a no-op, as for `Vec::truncate`. Keeps the storage.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Empties the cache (length 0), keeping its storage for reuse.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Makes room for `n` more positions and makes the storage exclusively this cache's (copying
    /// it if a clone shares it), so the following [`KvCache::write`] calls write in place.
    ///
    /// Errors: `InvalidRequest` when `len() + n` exceeds `max_len()`; `Candle` on allocation
    /// failure.
    pub(crate) fn prepare_append(&mut self, n: usize) -> Result<()> {
        let needed = self
            .len
            .checked_add(n)
            .filter(|&needed| needed <= self.max_len)
            .ok_or_else(|| {
                EngineError::InvalidRequest(format!(
                    "sequence of {} cached + {n} new tokens exceeds the context length {}",
                    self.len, self.max_len
                ))
            })?;
        let (capacity, shared) = match self.storage.as_mut() {
            None => (0, false),
            Some(storage) => (storage.capacity, Arc::get_mut(storage).is_none()),
        };
        if needed <= capacity && !shared {
            return Ok(());
        }
        let new_capacity = if needed <= capacity {
            capacity
        } else {
            needed
                .max(capacity.saturating_mul(2))
                .max(MIN_CAPACITY)
                .min(self.max_len)
        };
        self.reallocate(new_capacity)
    }

    /// Replaces the storage by fresh storage of `capacity` positions holding a copy of the valid
    /// prefix.
    fn reallocate(&mut self, capacity: usize) -> Result<()> {
        let shape = (self.n_kv_head, capacity, self.head_dim);
        let mut k = Vec::with_capacity(self.n_layer);
        let mut v = Vec::with_capacity(self.n_layer);
        for layer in 0..self.n_layer {
            let new_k = Tensor::zeros(shape, self.dtype.dtype(), &self.device)?;
            let new_v = Tensor::zeros(shape, self.dtype.dtype(), &self.device)?;
            if let (Some(old), true) = (self.storage.as_ref(), self.len > 0) {
                let old_k = old.k[layer].narrow(1, 0, self.len)?.contiguous()?;
                let old_v = old.v[layer].narrow(1, 0, self.len)?.contiguous()?;
                new_k.slice_set(&old_k, 1, 0)?;
                new_v.slice_set(&old_v, 1, 0)?;
            }
            k.push(new_k);
            v.push(new_v);
        }
        if self.storage.is_some() && self.len > 0 {
            self.copies += 1;
        }
        self.storage = Some(Arc::new(Storage { k, v, capacity }));
        Ok(())
    }

    /// Writes the keys and values of `n` new positions of layer `layer` at positions
    /// `len()..len() + n` and returns positions `0..len() + n` as f32, each
    /// `[n_kv_head, len() + n, head_dim]`: views of an f32 cache (not contiguous across heads;
    /// fine for `matmul`), a converted copy of an f16 one.
    ///
    /// `k_new`, `v_new`: `[n_kv_head, n, head_dim]` f32 (rounded to f16 in an f16 cache). Call [`KvCache::prepare_append`]`(n)`
    /// first and [`KvCache::commit`]`(n)` after the last layer. The returned views alias the
    /// storage: drop them before the next write.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        k_new: &Tensor,
        v_new: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let n = k_new.dim(1)?;
        let storage = self
            .storage
            .as_mut()
            .and_then(Arc::get_mut)
            .filter(|s| s.capacity >= self.len + n && layer < s.k.len())
            .ok_or_else(|| {
                EngineError::InvalidRequest(
                    "internal: KvCache::write without prepare_append".to_string(),
                )
            })?;
        let dtype = self.dtype.dtype();
        let k_new = k_new.to_dtype(dtype)?.contiguous()?;
        let v_new = v_new.to_dtype(dtype)?.contiguous()?;
        storage.k[layer].slice_set(&k_new, 1, self.len)?;
        storage.v[layer].slice_set(&v_new, 1, self.len)?;
        let total = self.len + n;
        match self.dtype {
            KvCacheDtype::F32 => Ok((
                storage.k[layer].narrow(1, 0, total)?,
                storage.v[layer].narrow(1, 0, total)?,
            )),
            KvCacheDtype::F16 => Ok((
                f16_prefix_to_f32(&storage.k[layer], total)?,
                f16_prefix_to_f32(&storage.v[layer], total)?,
            )),
        }
    }

    /// Marks `n` written positions as valid (after all layers were written).
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Copies the valid keys and values of layer `layer` out of the cache: two f32 tensors
    /// `[n_kv_head, len(), head_dim]` (keys after RoPE), or `None` when the cache is empty or
    /// `layer >= n_layer()`. For inspection and tests; the copies do not alias the cache.
    pub fn layer_kv(&self, layer: usize) -> Result<Option<(Tensor, Tensor)>> {
        let Some(storage) = self.storage.as_ref() else {
            return Ok(None);
        };
        if self.len == 0 || layer >= storage.k.len() {
            return Ok(None);
        }
        let k = storage.k[layer].narrow(1, 0, self.len)?.contiguous()?;
        let v = storage.v[layer].narrow(1, 0, self.len)?.contiguous()?;
        // `contiguous` returns the same storage when the view is already contiguous (one head).
        Ok(Some((
            k.to_dtype(DType::F32)?.copy()?,
            v.to_dtype(DType::F32)?.copy()?,
        )))
    }
}

/// Positions `0..total` of an f16 cache tensor `[n_kv_head, capacity, head_dim]` as a
/// contiguous f32 tensor `[n_kv_head, total, head_dim]` (exact), converted head by head with
/// the weights' vectorised f16 conversion.
fn f16_prefix_to_f32(t: &Tensor, total: usize) -> Result<Tensor> {
    let (n_kv, capacity, hd) = t.dims3()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        drop(storage);
        return Ok(t.narrow(1, 0, total)?.to_dtype(DType::F32)?);
    };
    let values: &[half::f16] = cpu.as_slice()?;
    let start = layout.start_offset();
    let values = &values[start..start + n_kv * capacity * hd];
    let bits: &[u16] = half::slice::HalfFloatSliceExt::reinterpret_cast(values);
    let mut out = vec![0f32; n_kv * total * hd];
    for (h, dst) in out.chunks_exact_mut((total * hd).max(1)).enumerate() {
        let from = h * capacity * hd;
        convert_half(HalfKind::F16, &bits[from..from + total * hd], dst);
    }
    drop(storage);
    Ok(Tensor::from_vec(out, (n_kv, total, hd), t.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(n_kv: usize, n: usize, hd: usize, start: f32) -> Tensor {
        let data: Vec<f32> = (0..n_kv * n * hd).map(|i| start + i as f32).collect();
        Tensor::from_vec(data, (n_kv, n, hd), &Device::Cpu).expect("tensor")
    }

    fn append(cache: &mut KvCache, n: usize, start: f32) -> Result<()> {
        cache.prepare_append(n)?;
        for layer in 0..cache.n_layer() {
            let k = filled(cache.n_kv_head(), n, cache.head_dim(), start);
            let v = filled(cache.n_kv_head(), n, cache.head_dim(), -start);
            cache.write(layer, &k, &v)?;
        }
        cache.commit(n);
        Ok(())
    }

    fn keys(cache: &KvCache, layer: usize) -> Vec<f32> {
        match cache.layer_kv(layer).expect("layer_kv") {
            None => vec![],
            Some((k, _)) => k.flatten_all().and_then(|t| t.to_vec1()).expect("vec"),
        }
    }

    #[test]
    fn grows_by_doubling_and_keeps_contents() -> Result<()> {
        let mut cache = KvCache::new(2, 2, 4, 100, KvCacheDtype::F32, &Device::Cpu);
        assert_eq!(cache.capacity(), 0);
        append(&mut cache, 3, 0.0)?;
        assert_eq!(cache.capacity(), MIN_CAPACITY);
        let before = keys(&cache, 1);
        append(&mut cache, 14, 1000.0)?;
        assert_eq!(cache.len(), 17);
        assert_eq!(cache.capacity(), 32);
        let after = keys(&cache, 1);
        // Head 0's first 3 positions are unchanged by the reallocation.
        assert_eq!(&after[..12], &before[..12]);
        append(&mut cache, 60, 5.0)?;
        // 77 needed > 2 * 32: the new capacity is the needed length.
        assert_eq!(cache.capacity(), 77);
        Ok(())
    }

    #[test]
    fn capacity_is_capped_at_max_len_and_overflow_is_an_error() -> Result<()> {
        let mut cache = KvCache::new(1, 1, 2, 20, KvCacheDtype::F32, &Device::Cpu);
        append(&mut cache, 17, 0.0)?;
        assert_eq!(cache.capacity(), 17);
        // Doubling would give 34; the cap is max_len.
        append(&mut cache, 3, 0.0)?;
        assert_eq!(cache.capacity(), 20);
        assert!(matches!(
            cache.prepare_append(1),
            Err(EngineError::InvalidRequest(_))
        ));
        Ok(())
    }

    #[test]
    fn write_into_clone_does_not_change_original() -> Result<()> {
        let mut a = KvCache::new(2, 2, 4, 64, KvCacheDtype::F32, &Device::Cpu);
        append(&mut a, 5, 0.0)?;
        let mut b = a.clone();
        let a_before = keys(&a, 0);
        // Same capacity, so without copy-on-write this would write into a's storage.
        b.truncate(2);
        append(&mut b, 3, 777.0)?;
        assert_eq!(keys(&a, 0), a_before);
        assert_eq!(a.len(), 5);
        assert_ne!(keys(&b, 0), a_before);
        // And the other way round.
        let b_before = keys(&b, 0);
        append(&mut a, 1, 9.0)?;
        assert_eq!(keys(&b, 0), b_before);
        Ok(())
    }

    #[test]
    fn truncate_and_reset() -> Result<()> {
        let mut cache = KvCache::new(1, 1, 2, 64, KvCacheDtype::F32, &Device::Cpu);
        append(&mut cache, 5, 0.0)?;
        cache.truncate(10);
        assert_eq!(cache.len(), 5);
        cache.truncate(3);
        assert_eq!(cache.len(), 3);
        append(&mut cache, 1, 100.0)?;
        assert_eq!(
            keys(&cache, 0),
            vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 100.0, 101.0]
        );
        cache.reset();
        assert!(cache.is_empty());
        assert_eq!(cache.layer_kv(0)?.map(|_| ()), None);
        Ok(())
    }
}
