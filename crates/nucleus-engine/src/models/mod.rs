//! The models the engine runs, behind one interface: [`CausalLm`].
//!
//! The engine needs three things from a model: its [`ModelConfig`] (vocabulary size, context
//! length, BOS / EOS ids, dtype), an empty [`KvCache`] per sequence, and a forward pass over the
//! new tokens of many sequences at once ([`CausalLm::forward`]). It knows nothing about files:
//! loaders ([`crate::loader`]) turn a GGUF file or a Hugging Face folder into weights, a config
//! and a tokenizer.
//!
//! One decoder-only [`Transformer`], parameterised by its [`ModelConfig`], covers the dense
//! families (Llama 2 / 3, Qwen2 / 2.5, Qwen3, and GGUF arch `llama`): attention with or without
//! q/k/v (and o) biases, per-head q/k RMSNorm, an explicit head dimension, grouped-query
//! attention, both RoPE layouts and the `rope_scaling` types of [`rope`], a tied or untied LM
//! head, and a SwiGLU feed-forward block, dense or a mixture of experts ([`moe`]: Qwen3-MoE,
//! MiniMind-3 and MiniMind2, GGUF `qwen3moe`, routed through nucleus-moe's operators). A new
//! family is a config mapping in a loader.

pub(crate) mod elementwise;
pub(crate) mod matmul;
pub mod moe;
pub(crate) mod qmatmul;
pub(crate) mod quant;
pub mod rope;
pub mod transformer;
pub(crate) mod weight;

use candle_core::{Device, Tensor};

use crate::error::Result;
use crate::kv_cache::{KvCache, KvCacheDtype};

pub use moe::{moe_routing_bytes, ExpertWeights, MoeConfig, MoeScratch, SparseMoe};
pub use rope::{RopeConfig, RopeLayout, RopeScaling};
pub use transformer::{ModelConfig, SeqInput, Transformer};

/// What the engine needs of a model: a batched forward pass over per-sequence KV caches.
///
/// Implementations are immutable after loading and `Send + Sync`: several threads may run
/// `forward` at once on disjoint caches.
pub trait CausalLm: Send + Sync + std::fmt::Debug {
    /// The model's hyper-parameters and special ids.
    fn config(&self) -> &ModelConfig;

    /// The device the weights (and new caches) live on.
    fn device(&self) -> &Device;

    /// An empty f32 [`KvCache`] for one sequence of this model (exact keys and values).
    fn new_cache(&self) -> KvCache {
        self.new_cache_of(KvCacheDtype::F32)
    }

    /// An empty [`KvCache`] of `dtype` for one sequence of this model (the engine's is
    /// [`crate::EngineConfig::kv_cache_dtype`]).
    fn new_cache_of(&self, dtype: KvCacheDtype) -> KvCache;

    /// Runs the new tokens of several sequences in one pass and returns each sequence's
    /// next-token logits: f32 `[batch.len(), vocab_size]`, row `i` after `batch[i]`'s last new
    /// token. Each cache gets the new tokens' keys and values appended. See
    /// [`Transformer::forward`] for the contract and its errors.
    fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Tensor>;

    /// The attention computations run so far: one per sequence per layer per `forward`,
    /// whatever the number of new tokens (a prompt's prefill is one per layer). For tests and
    /// profiling.
    fn attention_calls(&self) -> u64;
}

/// A boxed model is a model (what [`crate::LoadedModel::model`] holds).
impl<M: CausalLm + ?Sized> CausalLm for Box<M> {
    fn config(&self) -> &ModelConfig {
        (**self).config()
    }

    fn device(&self) -> &Device {
        (**self).device()
    }

    fn new_cache_of(&self, dtype: KvCacheDtype) -> KvCache {
        (**self).new_cache_of(dtype)
    }

    fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Tensor> {
        (**self).forward(batch)
    }

    fn attention_calls(&self) -> u64 {
        (**self).attention_calls()
    }
}
