//! [`Transformer`]: the decoder-only transformer of the dense families, batched over sequences
//! that each bring their own [`KvCache`].
//!
//! # The computation (per token)
//! ```text
//! x = embed[id]                                                     [hidden]
//! for each layer:
//!     h = rms_norm(x) * input_layernorm                             eps = rms_norm_eps
//!     q, k, v = h @ Wq^T (+ bq), h @ Wk^T (+ bk), h @ Wv^T (+ bv)    [n_head|n_kv_head, head_dim]
//!     q, k = rms_norm(q) * q_norm, rms_norm(k) * k_norm             per head; Qwen3 only
//!     q, k = rope(q, pos), rope(k, pos)                             the model's layout and scaling
//!     cache.append(k, v)
//!     a = softmax(q k_cache^T / sqrt(head_dim), causal) v_cache     query head h reads kv head h / (n_head / n_kv_head)
//!     x = x + a @ Wo^T (+ bo)
//!     h = rms_norm(x) * post_attention_layernorm
//!     x = x + (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T                dense layers
//!     x = x + moe(h)                          MoE layers: crate::models::moe::SparseMoe
//! logits = (rms_norm(x) * norm) @ lm_head^T                         lm_head = embed when tied
//! ```
//! This is transformers' `LlamaForCausalLM` (`src/transformers/models/llama/modeling_llama.py`:
//! `LlamaAttention.forward`, `LlamaMLP`, `LlamaRMSNorm`, `apply_rotary_pos_emb` with
//! `rotate_half`), `Qwen2ForCausalLM` (`models/qwen2/modeling_qwen2.py`: the same with
//! `bias=True` on q/k/v and none on o) and `Qwen3ForCausalLM` (`models/qwen3/modeling_qwen3.py`:
//! `self.q_norm` / `self.k_norm`, `Qwen3RMSNorm` over `head_dim`, applied before RoPE, and an
//! explicit `head_dim`), and llama.cpp's `llm_build_llama` for GGUF arch `llama` (adjacent-pair
//! RoPE). RMSNorm is `x / sqrt(mean(x^2) + eps) * w` in f32.
//!
//! # Batching and attention
//! [`Transformer::forward`] takes several sequences at once, each with any number of new tokens
//! (prefill) or one (decode). Their rows are concatenated into one `[T_total, hidden]` matrix, so
//! every linear layer runs once for the whole batch. Attention runs once per sequence per layer,
//! over that sequence's own cache: the keys and values of the new tokens are written in place
//! into the cache ([`KvCache`]), whose valid prefix is then read as a view, and the scores are
//! two matrix products and a causal softmax ([`CausalSoftmax`]: each query's weights over the
//! keys it may see, no mask tensor). A prompt's whole prefill is one attention computation per layer
//! (queries tiled in blocks of about 256 Ki scores, each reading only the keys it may see, so the
//! causal upper triangle is skipped and memory stays bounded on long prompts).
//! Only each sequence's last row goes through the LM head.
//!
//! # Weights
//! Matrices stay in their stored type ([`crate::models::weight`]): f16 and bf16 (GGUF or
//! safetensors) as 16-bit values, memory-mapped from a GGUF file, multiplied by our own kernels
//! that convert each value to f32 as they read it and accumulate in f32; the ggml
//! block-quantized types kept quantized and multiplied by candle's kernels; f32 as f32. Norm
//! weights, biases, activations and the logits are f32; the KV cache is f16 or f32
//! ([`crate::KvCacheDtype`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};

use crate::error::{EngineError, Result};
use crate::kv_cache::{KvCache, KvCacheDtype};
use crate::models::elementwise::{self, CausalSoftmax};
use crate::models::moe::{MoeConfig, MoeScratch, SparseMoe};
use crate::models::rope::{RopeConfig, RopeLayout};
use crate::models::weight::Weight;
use crate::models::CausalLm;

/// The hyper-parameters and special ids of a model, as its loader read them (GGUF metadata and
/// tensor shapes, or a Hugging Face `config.json` and `generation_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The family: `model_type` of config.json (`llama`, `qwen2`, `qwen3`) or GGUF's
    /// `general.architecture`.
    pub architecture: String,
    /// Vocabulary size: rows of the embedding, columns of the logits (may exceed the
    /// tokenizer's ids: padded vocabularies).
    pub vocab_size: usize,
    /// Model width (`hidden_size`, GGUF `embedding_length`).
    pub hidden_size: usize,
    /// Number of transformer blocks (`num_hidden_layers`, GGUF `block_count`).
    pub n_layer: usize,
    /// Query heads per layer (`num_attention_heads`).
    pub n_head: usize,
    /// Key/value heads per layer (`num_key_value_heads`, default `n_head`); grouped-query
    /// attention when smaller than `n_head`, which it divides.
    pub n_kv_head: usize,
    /// Values per head: `head_dim` when the config gives it (Qwen3-0.6B: 128, not
    /// hidden / heads = 64), else `hidden_size / n_head`. Even.
    pub head_dim: usize,
    /// Inner width of the SwiGLU feed-forward block (`intermediate_size`).
    pub ffn_size: usize,
    /// The RMSNorm epsilon (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// The rotary embedding: base, layout, scaling.
    pub rope: RopeConfig,
    /// The most positions a sequence may have (`max_position_embeddings`, GGUF
    /// `context_length`); also the most a [`KvCache`] of this model holds.
    pub context_length: usize,
    /// Whether q, k and v have biases (Qwen2; Llama / Qwen3 with `attention_bias: true`).
    pub qkv_bias: bool,
    /// Whether the attention output projection has a bias (Llama / Qwen3 `attention_bias`).
    pub o_bias: bool,
    /// Whether q and k are RMS-normalised per head before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Whether the LM head is the embedding matrix (`tie_word_embeddings`; GGUF: no
    /// `output.weight`).
    pub tie_word_embeddings: bool,
    /// The dtype of the weights as stored (`f32`, `f16`, `bf16`, or a ggml type such as
    /// `q8_0`); they are kept in that type and multiplied with f32 accumulation.
    pub weight_dtype: String,
    /// The beginning-of-sequence id, if the model has one.
    pub bos_token_id: Option<u32>,
    /// The ids that end generation (generation_config.json's `eos_token_id`, a number or a
    /// list; GGUF's `tokenizer.ggml.eos_token_id`). May be empty.
    pub eos_token_ids: Vec<u32>,
    /// The mixture-of-experts layers (Qwen3-MoE, MiniMind MoE, GGUF `qwen3moe`); `None` for a
    /// dense model.
    pub moe: Option<MoeConfig>,
}

/// A linear layer `y = x W^T + b`: `weight` `[out, in]` (in its stored type), `bias` `[out]`
/// f32.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    pub weight: Weight,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.weight.forward(x)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// [`Linear::forward`] on `xs [t, in]` (f32, row-major): `[t, out]` f32, the bias added
    /// to each row (the same f32 sums as `broadcast_add`).
    pub(crate) fn forward_rows(&self, xs: &[f32], t: usize, device: &Device) -> Result<Vec<f32>> {
        let mut y = self.weight.matmul_rows(xs, t, device)?;
        if let Some(b) = &self.bias {
            let b = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let out = self.weight.dims().0;
            if b.len() != out {
                return Err(EngineError::InvalidRequest(format!(
                    "internal: a bias of {} values for a layer of {out} outputs",
                    b.len()
                )));
            }
            if out > 0 {
                for row in y.chunks_exact_mut(out) {
                    row.iter_mut().zip(&b).for_each(|(y, b)| *y += b);
                }
            }
        }
        Ok(y)
    }
}

/// The weights of one transformer block (f32 norms `[hidden]`, `[head_dim]` for q/k norms).
#[derive(Debug, Clone)]
pub(crate) struct LayerWeights {
    pub attn_norm: Tensor,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub ffn_norm: Tensor,
    pub ffn: FeedForward,
}

/// A SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`; `gate`, `up` `[inter, hidden]`,
/// `down` `[hidden, inter]`.
#[derive(Debug, Clone)]
pub(crate) struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    /// The inner width (the gate's rows).
    pub(crate) fn inner_size(&self) -> usize {
        self.gate.weight.dims().0
    }

    /// `x` `[T, hidden]` to `[T, hidden]` ([`Mlp::forward_rows`]).
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (t, hidden) = x.dims2()?;
        let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let y = self.forward_rows(&xs, t, x.device())?;
        Ok(Tensor::from_vec(y, (t, hidden), x.device())?)
    }

    /// `xs` `[t, hidden]` (f32, row-major) to `[t, hidden]`: the three products on vectors,
    /// `silu(gate) * up` fused in place ([`elementwise::silu_mul`]) between them.
    pub(crate) fn forward_rows(&self, xs: &[f32], t: usize, device: &Device) -> Result<Vec<f32>> {
        let mut gate = self.gate.forward_rows(xs, t, device)?;
        let up = self.up.forward_rows(xs, t, device)?;
        if gate.len() != up.len() {
            return Err(EngineError::InvalidRequest(format!(
                "internal: gate of {} and up of {} values",
                gate.len(),
                up.len()
            )));
        }
        elementwise::silu_mul(&mut gate, &up);
        drop(up);
        self.down.forward_rows(&gate, t, device)
    }
}

/// The feed-forward block of a layer: dense, or a mixture of experts.
#[derive(Debug, Clone)]
pub(crate) enum FeedForward {
    Dense(Mlp),
    Moe(SparseMoe),
}

/// Every weight of a model, as a loader produced them, shapes already checked against the
/// config.
#[derive(Debug, Clone)]
pub(crate) struct Weights {
    /// `[vocab, hidden]`: the embedding table, and the LM head when `lm_head` is `None`.
    pub embed: Weight,
    pub layers: Vec<LayerWeights>,
    /// `[hidden]` f32.
    pub norm: Tensor,
    /// `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<Weight>,
}

/// The new tokens of one sequence and its cache, for [`Transformer::forward`].
#[derive(Debug)]
pub struct SeqInput<'a> {
    /// The sequence's new token ids, at positions `cache.len()..cache.len() + tokens.len()`.
    /// At least one; each below the vocabulary size.
    pub tokens: &'a [u32],
    /// The sequence's cache; `forward` appends the new tokens' keys and values.
    pub cache: &'a mut KvCache,
}

/// A decoder-only transformer: the batched forward pass of the module docs.
///
/// Immutable after loading, `Send + Sync`: several threads may run `forward` at once on disjoint
/// caches. All per-sequence state lives in the [`KvCache`]s passed to [`Transformer::forward`].
#[derive(Debug)]
pub struct Transformer {
    config: ModelConfig,
    device: Device,
    weights: Weights,
    /// `[1, head_dim / 2]` f32: the RoPE angle per position of each pair.
    inv_freq: Tensor,
    /// What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
    rope_attention_factor: f64,
    /// Attention computations run so far (one per sequence per layer per forward).
    attention_calls: AtomicU64,
    /// The MoE layers' routing buffers, reused from step to step (a forward that finds them
    /// in use by another thread's forward takes fresh ones).
    moe_scratch: Mutex<MoeScratch>,
}

/// The most bytes of MoE routing buffers kept between steps (a long prefill's are dropped).
const MOE_SCRATCH_KEEP_BYTES: usize = 64 << 20;

impl Transformer {
    /// A model from its config and weights (on `device`).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] when the config is inconsistent with itself (a loader
    /// bug: loaders check every field against the file first) or the layer count differs from
    /// the weights'.
    pub(crate) fn new(config: ModelConfig, weights: Weights, device: &Device) -> Result<Self> {
        if weights.layers.len() != config.n_layer
            || config.n_kv_head == 0
            || !config.n_head.is_multiple_of(config.n_kv_head)
        {
            return Err(EngineError::InvalidRequest(format!(
                "internal: {} layers of weights for a {}-layer config with {} heads and {} kv heads",
                weights.layers.len(),
                config.n_layer,
                config.n_head,
                config.n_kv_head
            )));
        }
        let (inv_freq, rope_attention_factor) = config.rope.inv_freq(config.head_dim)?;
        let inv_freq = Tensor::from_vec(inv_freq, (1, config.head_dim / 2), device)?;
        tracing::debug!(?config, "built the transformer");
        Ok(Self {
            config,
            device: device.clone(),
            weights,
            inv_freq,
            rope_attention_factor,
            attention_calls: AtomicU64::new(0),
            moe_scratch: Mutex::new(MoeScratch::default()),
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Sets the BOS and EOS ids of the config (loaders read them from the tokenizer's files
    /// after the weights).
    pub(crate) fn set_special_ids(&mut self, bos: Option<u32>, eos: Vec<u32>) {
        self.config.bos_token_id = bos;
        self.config.eos_token_ids = eos;
    }

    /// The device the weights (and new caches) live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The attention computations this model has run so far: one per sequence per layer per
    /// [`Transformer::forward`], whatever the number of new tokens (a prompt's prefill is one
    /// per layer). For tests and profiling.
    pub fn attention_calls(&self) -> u64 {
        self.attention_calls.load(Ordering::Relaxed)
    }

    /// An empty f32 [`KvCache`] for one sequence of this model (exact keys and values; the
    /// engine's default is f16: [`Transformer::new_cache_of`]).
    pub fn new_cache(&self) -> KvCache {
        self.new_cache_of(KvCacheDtype::F32)
    }

    /// An empty [`KvCache`] for one sequence of this model: `n_layer` layers of
    /// `[n_kv_head, capacity, head_dim]` keys and values of `dtype` on the model's device,
    /// holding at most `context_length` positions. Allocates nothing until the first `forward`.
    pub fn new_cache_of(&self, dtype: KvCacheDtype) -> KvCache {
        KvCache::new(
            self.config.n_layer,
            self.config.n_kv_head,
            self.config.head_dim,
            self.config.context_length,
            dtype,
            &self.device,
        )
    }

    /// Runs the new tokens of several sequences in one pass and returns each sequence's
    /// next-token logits.
    ///
    /// Algorithm: the module docs' computation. The new tokens of all sequences are
    /// concatenated into one `[T_total, hidden]` matrix, so every linear layer runs once on all
    /// rows; attention runs per sequence over that sequence's own cache, with positions starting
    /// at `cache.len()`, causal among its new tokens. The keys and values of the new tokens are
    /// appended to each cache. The LM head runs only on each sequence's last new row.
    ///
    /// Arguments: `batch`, one [`SeqInput`] per sequence, in any mix of prefill (many tokens)
    /// and decode (one token). Each cache must come from this model's
    /// [`Transformer::new_cache`] (or match its layer count, kv heads, head dim and device).
    ///
    /// Returns: f32 logits `[batch.len(), vocab_size]` on the model's device; row `i` is the
    /// distribution (before softmax) over the token after `batch[i].tokens`' last one.
    ///
    /// Numerics: a sequence's logits equal running it alone, and running its tokens one by one,
    /// up to f32 rounding (attention is computed per sequence, so batching changes only the
    /// row count of the matrix products, whose kernels may then accumulate in another order).
    /// Positions are f32 in the RoPE angle, exact up to 2^24.
    ///
    /// Errors, all checked before any cache changes (`InvalidRequest`, naming the sequence):
    /// an empty batch, a sequence without tokens, a token id `>= vocab_size`, `cache.len() +
    /// tokens.len() > context_length`, a cache of another model's shape or device. A `Candle`
    /// error during the computation (a bug or out of memory) leaves every cache's length
    /// unchanged.
    pub fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Tensor> {
        let cfg = &self.config;
        if batch.is_empty() {
            return Err(EngineError::InvalidRequest(
                "forward: empty batch (no sequences)".to_string(),
            ));
        }
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut last_rows = Vec::with_capacity(batch.len());
        for (s, seq) in batch.iter().enumerate() {
            self.check_seq(s, seq)?;
            let past = seq.cache.len();
            ids.extend_from_slice(seq.tokens);
            positions.extend((past..past + seq.tokens.len()).map(|p| p as f32));
            last_rows.push((ids.len() - 1) as u32);
        }
        let t_total = ids.len();
        let _span = tracing::trace_span!("forward", seqs = batch.len(), tokens = t_total).entered();
        for seq in batch.iter_mut() {
            seq.cache.prepare_append(seq.tokens.len())?;
        }

        let mut x = self.weights.embed.embedding(&ids, &self.device)?; // [T, hidden] f32
        let positions = Tensor::from_vec(positions, (t_total, 1), &self.device)?;
        let angles = positions.broadcast_mul(&self.inv_freq)?; // [T, head_dim / 2]
        let (mut cos, mut sin) = (angles.cos()?, angles.sin()?);
        if self.rope_attention_factor != 1.0 {
            cos = (cos * self.rope_attention_factor)?;
            sin = (sin * self.rope_attention_factor)?;
        }
        let mut shared_scratch = self.moe_scratch.try_lock().ok();
        let mut own_scratch = MoeScratch::default();
        let scratch = shared_scratch.as_deref_mut().unwrap_or(&mut own_scratch);
        for (l, layer) in self.weights.layers.iter().enumerate() {
            x = self.block(l, layer, &x, &cos, &sin, batch, scratch)?;
        }
        if scratch.bytes() > MOE_SCRATCH_KEEP_BYTES {
            *scratch = MoeScratch::default();
        }
        drop(shared_scratch);

        let _span = tracing::trace_span!("lm_head").entered();
        let last_rows = Tensor::from_vec(last_rows, batch.len(), &self.device)?;
        let x = x.index_select(&last_rows, 0)?; // [B, hidden]
        let x = candle_nn::ops::rms_norm(&x, &self.weights.norm, cfg.rms_norm_eps as f32)?;
        let lm_head = self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed);
        let logits = lm_head.forward(&x)?.to_dtype(DType::F32)?;
        for seq in batch.iter_mut() {
            seq.cache.commit(seq.tokens.len());
        }
        Ok(logits)
    }

    /// The request checks of `forward` for sequence `s`.
    fn check_seq(&self, s: usize, seq: &SeqInput<'_>) -> Result<()> {
        let cfg = &self.config;
        let bad = |m: String| Err(EngineError::InvalidRequest(format!("sequence {s}: {m}")));
        let cache = &*seq.cache;
        if cache.n_layer() != cfg.n_layer
            || cache.n_kv_head() != cfg.n_kv_head
            || cache.head_dim() != cfg.head_dim
            || !cache.device().same_device(&self.device)
        {
            return bad(format!(
                "the cache ({} layers, {} kv heads, head dim {}) was not made for this model \
                 ({} layers, {} kv heads, head dim {}) or lives on another device",
                cache.n_layer(),
                cache.n_kv_head(),
                cache.head_dim(),
                cfg.n_layer,
                cfg.n_kv_head,
                cfg.head_dim
            ));
        }
        if seq.tokens.is_empty() {
            return bad("no new tokens".to_string());
        }
        if let Some((j, &t)) = seq
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= cfg.vocab_size)
        {
            return bad(format!(
                "token {j} has id {t}, not below the vocabulary size {}",
                cfg.vocab_size
            ));
        }
        let limit = cfg.context_length.min(cache.max_len());
        if cache.len() + seq.tokens.len() > limit {
            return bad(format!(
                "{} cached + {} new tokens exceed the context length {limit}",
                cache.len(),
                seq.tokens.len()
            ));
        }
        Ok(())
    }

    /// Rotates `x` `[1, heads, T, head_dim]` (contiguous) by the rows' angles; same shape out.
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        Ok(match self.config.rope.layout {
            RopeLayout::RotateHalf => candle_nn::rotary_emb::rope(x, cos, sin)?,
            RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin)?,
        })
    }

    /// One transformer block on the concatenated rows `x` `[T, hidden]`; `cos`, `sin`
    /// `[T, head_dim / 2]` are the RoPE tables of the rows' positions.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        l: usize,
        layer: &LayerWeights,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        batch: &mut [SeqInput<'_>],
        scratch: &mut MoeScratch,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (t_total, _) = x.dims2()?;
        let (n_head, n_kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let eps = cfg.rms_norm_eps as f32;

        let h = candle_nn::ops::rms_norm(x, &layer.attn_norm, eps)?;
        // One copy of the normed rows for the three products.
        let hs = h.flatten_all()?.to_vec1::<f32>()?;
        let dev = &self.device;
        let q = Tensor::from_vec(
            layer.q.forward_rows(&hs, t_total, dev)?,
            (t_total, n_head, hd),
            dev,
        )?;
        let k = Tensor::from_vec(
            layer.k.forward_rows(&hs, t_total, dev)?,
            (t_total, n_kv, hd),
            dev,
        )?;
        let v = Tensor::from_vec(
            layer.v.forward_rows(&hs, t_total, dev)?,
            (t_total, n_kv, hd),
            dev,
        )?;
        drop(hs);
        let (q, k) = match (&layer.q_norm, &layer.k_norm) {
            (Some(qn), Some(kn)) => (
                candle_nn::ops::rms_norm(&q, qn, eps)?,
                candle_nn::ops::rms_norm(&k, kn, eps)?,
            ),
            _ => (q, k),
        };
        // Head-major for RoPE and attention: [1, heads, T, hd].
        let q = q.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        let k = k.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        let q = self.rope(&q, cos, sin)?.squeeze(0)?; // [n_head, T, hd]
        let k = self.rope(&k, cos, sin)?.squeeze(0)?; // [n_kv, T, hd]
        let v = v.transpose(0, 1)?; // [n_kv, T, hd]

        let mut outputs = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for seq in batch.iter_mut() {
            let n = seq.tokens.len();
            let (k_all, v_all) =
                seq.cache
                    .write(l, &k.narrow(1, offset, n)?, &v.narrow(1, offset, n)?)?;
            let q_s = q.narrow(1, offset, n)?;
            outputs.push(self.attention(&q_s, &k_all, &v_all)?);
            offset += n;
        }
        let y = if outputs.len() == 1 {
            outputs.pop().expect("one output")
        } else {
            Tensor::cat(&outputs, 0)? // [T, n_head * hd]
        };
        let x = (x + layer.o.forward(&y)?)?;

        let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
        let ff = match &layer.ffn {
            FeedForward::Dense(mlp) => mlp.forward(&h)?,
            FeedForward::Moe(moe) => moe.forward_with(&h, scratch)?,
        };
        Ok((x + ff)?)
    }

    /// Causal attention of one sequence's `n` new queries `q` `[n_head, n, hd]` over its cache
    /// `k_all`, `v_all` `[n_kv, total, hd]` (views of the cache, not copied; `total = past + n`);
    /// query `i` sees keys `0..=past + i`. Returns `[n, n_head * hd]`.
    ///
    /// Query heads `r * n_rep ..` share kv head `r` (grouped-query attention): they are grouped
    /// as `[n_kv, n_rep * rows, hd]` so that each kv head's keys are multiplied once. Queries run
    /// in blocks of rows whose scores fit in about [`BLOCK_SCORES`] values (cache-sized, and
    /// memory bounded on long prompts), and a block reads only the keys its last row may see
    /// (`past + end`): the causal upper triangle is not computed.
    fn attention(&self, q: &Tensor, k_all: &Tensor, v_all: &Tensor) -> Result<Tensor> {
        self.attention_calls.fetch_add(1, Ordering::Relaxed);
        let cfg = &self.config;
        let (n_head, n_kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let n_rep = n_head / n_kv;
        let (_, n, _) = q.dims3()?;
        let total = k_all.dim(1)?;
        let past = total - n;
        let scale = (1.0 / (hd as f64).sqrt()) as f32;
        let rows = (BLOCK_SCORES / (n_head * total).max(1))
            .max(MIN_BLOCK_ROWS)
            .min(n.max(1));
        let q = q.reshape((n_kv, n_rep, n, hd))?;
        let mut blocks = Vec::with_capacity(n.div_ceil(rows));
        let mut start = 0;
        while start < n {
            let r = rows.min(n - start);
            // The last row of the block, position past + start + r - 1, sees keys 0..kv.
            let kv = past + start + r;
            let q_b = q
                .narrow(2, start, r)?
                .contiguous()?
                .reshape((n_kv, n_rep * r, hd))?;
            let k_t = k_all.narrow(1, 0, kv)?.t()?; // [n_kv, hd, kv]

            // [n_kv, n_rep * r, kv]; query `start + i` sees keys `0..past + start + i + 1`.
            let att = q_b.matmul(&k_t)?.apply_op1_no_bwd(&CausalSoftmax {
                scale,
                rows: r,
                first_visible: past + start + 1,
            })?;
            let y = att.matmul(&v_all.narrow(1, 0, kv)?)?; // [n_kv, n_rep * r, hd]
            blocks.push(
                y.reshape((n_head, r, hd))?
                    .transpose(0, 1)?
                    .reshape((r, n_head * hd))?,
            );
            start += r;
        }
        Ok(if blocks.len() == 1 {
            blocks.pop().expect("one block")
        } else {
            Tensor::cat(&blocks, 0)?
        })
    }
}

/// About the most attention scores (f32) one block of queries holds: 256 Ki values, 1 MiB
/// (within a core's L2). Smaller blocks compute less of the causal upper triangle (each block
/// reads the keys its last row sees): 32-row blocks of a 256-token prompt (32 heads) compute
/// 12% more scores than the triangle, 128-row blocks (1 Mi) 50% more. Measured on the 0.85 B
/// model's 256-token prefill: the work outside the weight products 0.52 -> 0.43-0.48 s.
const BLOCK_SCORES: usize = 1 << 18;

/// The fewest query rows of a block (smaller blocks make the matrix products inefficient).
const MIN_BLOCK_ROWS: usize = 32;

impl CausalLm for Transformer {
    fn config(&self) -> &ModelConfig {
        Transformer::config(self)
    }

    fn device(&self) -> &Device {
        Transformer::device(self)
    }

    fn new_cache_of(&self, dtype: KvCacheDtype) -> KvCache {
        Transformer::new_cache_of(self, dtype)
    }

    fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Tensor> {
        Transformer::forward(self, batch)
    }

    fn attention_calls(&self) -> u64 {
        Transformer::attention_calls(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_and_cache_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Transformer>();
        check::<KvCache>();
        check::<ModelConfig>();
    }
}
