//! [`LlamaModel`]: the Llama-architecture forward pass over GGUF weights, batched over sequences
//! that each bring their own [`KvCache`].
//!
//! # The computation (per token, as llama.cpp's `llm_build_llama` and candle-transformers'
//! `quantized_llama`)
//! ```text
//! x = token_embd[id]                                               [hidden]
//! for each layer:
//!     h = rms_norm(x) * attn_norm                                  eps = layer_norm_rms_epsilon
//!     q, k, v = h @ attn_q^T, h @ attn_k^T, h @ attn_v^T           [n_head|n_kv_head, head_dim]
//!     q, k = rope(q, pos), rope(k, pos)                            adjacent pairs (2i, 2i+1)
//!     cache.append(k, v)
//!     a = softmax(q k_cache^T / sqrt(head_dim) + causal mask) v_cache   head h uses kv head h / (n_head / n_kv_head)
//!     x = x + a @ attn_output^T
//!     h = rms_norm(x) * ffn_norm
//!     x = x + (silu(h @ ffn_gate^T) * (h @ ffn_up^T)) @ ffn_down^T
//! logits = (rms_norm(x) * output_norm) @ output^T                  output = token_embd when absent
//! ```
//! RoPE rotates the adjacent pairs `(x[2i], x[2i+1])` of each head by the angle
//! `pos * freq_base^(-2i / head_dim)` (llama.cpp's "normal" RoPE, `candle_nn::rotary_emb::rope_i`),
//! which is how GGUF stores Llama's q/k weights (the converter permutes Hugging Face's
//! rotate-half layout into this one).
//!
//! # Batching
//! [`LlamaModel::forward`] takes several sequences at once, each with any number of new tokens
//! (prefill) or one (decode). Their rows are concatenated into one `[T_total, hidden]` matrix, so
//! every linear layer runs once for the whole batch; attention runs per sequence over that
//! sequence's own cache. Only each sequence's last row goes through the LM head.
//!
//! # Weights
//! Any tensor type candle reads from GGUF: f32, f16, bf16 (converted to f32 at load) and the
//! ggml block-quantized types (Q4_0 … Q8_K, kept quantized and multiplied by
//! `candle_core::quantized::QMatMul`, which quantizes the activations to the matching 8-bit
//! type). Norm weights are used as f32. Activations, the cache and the logits are f32.

use std::io::{Read, Seek};
use std::path::Path;

use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::error::{candle_message, quote, EngineError, Result};
use crate::kv_cache::KvCache;
use crate::load::{invalid, md_f64, md_str, md_u64, md_usize};

/// Also here, next to the model it loads: [`crate::load::load_gguf`] and its result.
pub use crate::load::{load_gguf, LoadedModel};

/// The hyper-parameters of a Llama-architecture model, read from GGUF metadata (`llama.*`) and
/// tensor shapes by [`LlamaModel::from_gguf`].
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size: rows of `token_embd.weight`, columns of the logits.
    pub vocab_size: usize,
    /// Model width (`llama.embedding_length`).
    pub hidden_size: usize,
    /// Number of transformer blocks (`llama.block_count`).
    pub n_layer: usize,
    /// Query heads per layer (`llama.attention.head_count`).
    pub n_head: usize,
    /// Key/value heads per layer (`llama.attention.head_count_kv`, default `n_head`); grouped-query
    /// attention when smaller than `n_head`, which it divides.
    pub n_kv_head: usize,
    /// Values per head: `hidden_size / n_head`.
    pub head_dim: usize,
    /// Inner width of the SwiGLU feed-forward block (`llama.feed_forward_length`).
    pub ffn_size: usize,
    /// The RMSNorm epsilon (`llama.attention.layer_norm_rms_epsilon`).
    pub rms_norm_eps: f64,
    /// The RoPE base (`llama.rope.freq_base`, default 10000).
    pub rope_theta: f32,
    /// The most positions a sequence may have (`llama.context_length`); also the most a
    /// [`KvCache`] of this model holds.
    pub context_length: usize,
}

/// The weights of one transformer block.
#[derive(Debug, Clone)]
struct Layer {
    attn_norm: Tensor,
    attn_q: QMatMul,
    attn_k: QMatMul,
    attn_v: QMatMul,
    attn_output: QMatMul,
    ffn_norm: Tensor,
    ffn_gate: QMatMul,
    ffn_up: QMatMul,
    ffn_down: QMatMul,
}

/// A Llama-architecture model loaded from GGUF: the batched forward pass of the module docs.
///
/// Immutable after loading, `Send + Sync`: several threads may run `forward` at once on disjoint
/// caches. All per-sequence state lives in the [`KvCache`]s passed to [`LlamaModel::forward`].
#[derive(Debug, Clone)]
pub struct LlamaModel {
    config: LlamaConfig,
    device: Device,
    /// `[vocab, hidden]`; the embedding table, and the LM head when `output` is `None`.
    token_embd: QMatMul,
    layers: Vec<Layer>,
    /// `[hidden]` f32.
    output_norm: Tensor,
    /// `[vocab, hidden]`; `None` when tied to `token_embd`.
    output: Option<QMatMul>,
    /// `[1, head_dim / 2]` f32: the RoPE angle per position of each pair.
    inv_freq: Tensor,
}

/// The new tokens of one sequence and its cache, for [`LlamaModel::forward`].
#[derive(Debug)]
pub struct SeqInput<'a> {
    /// The sequence's new token ids, at positions `cache.len()..cache.len() + tokens.len()`.
    /// At least one; each below the vocabulary size.
    pub tokens: &'a [u32],
    /// The sequence's cache; `forward` appends the new tokens' keys and values.
    pub cache: &'a mut KvCache,
}

impl LlamaModel {
    /// Builds the model from a parsed GGUF file: `content` from
    /// [`crate::gguf::read_content`] (whose checks the tensor reads rely on: offsets, sizes and
    /// types of the tensor descriptions), `reader` the same file (tensor data is read from it),
    /// `path` only for error messages, weights placed on `device`.
    ///
    /// Metadata read (required unless a default is given): `general.architecture` (must be
    /// `llama`), `llama.embedding_length`, `llama.block_count`, `llama.attention.head_count`,
    /// `llama.attention.head_count_kv` (default: head_count), `llama.feed_forward_length`,
    /// `llama.context_length`, `llama.attention.layer_norm_rms_epsilon`,
    /// `llama.rope.freq_base` (default 10000), `llama.rope.dimension_count` (default and only
    /// supported value: head_dim). Linear RoPE scaling (`llama.rope.scaling.type = linear`,
    /// `llama.rope.scaling.factor`) divides positions by the factor, and a `rope_freqs.weight`
    /// tensor divides each pair's frequency by its entry, as llama.cpp does.
    ///
    /// Tensors (shapes as candle reports them, `[rows, row length]`, ggml's `ne` reversed):
    /// `token_embd.weight [vocab, hidden]`, per block `i` `blk.{i}.attn_norm.weight [hidden]`,
    /// `attn_q [n_head*head_dim, hidden]`, `attn_k`/`attn_v [n_kv_head*head_dim, hidden]`,
    /// `attn_output [hidden, n_head*head_dim]`, `ffn_norm [hidden]`, `ffn_gate`/`ffn_up
    /// [ffn, hidden]`, `ffn_down [hidden, ffn]`, then `output_norm.weight [hidden]` and the
    /// optional `output.weight [vocab, hidden]` (tied to `token_embd.weight` when absent).
    ///
    /// Errors: [`EngineError::Unsupported`] for another architecture or a feature we do not run
    /// (MoE, partial or non-linear-scaled RoPE, per-head key/value lengths other than head_dim);
    /// [`EngineError::InvalidModel`] naming `path` and the key or tensor for a missing or
    /// mistyped key, inconsistent hyper-parameters, a missing tensor, a wrong shape, a quantized
    /// row length not divisible by its block size, or tensor data beyond the end of the file.
    pub fn from_gguf<R: Read + Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        path: &Path,
        device: &Device,
    ) -> Result<Self> {
        let _span = tracing::debug_span!("LlamaModel::from_gguf").entered();
        let required = |key: &str| -> Result<usize> {
            md_result(path, md_usize(content, key))?
                .ok_or_else(|| invalid(path, format!("missing metadata key `{key}`")))
        };

        let arch = md_result(path, md_str(content, "general.architecture"))?
            .ok_or_else(|| invalid(path, "missing metadata key `general.architecture`"))?;
        if arch != "llama" {
            return Err(EngineError::Unsupported(format!(
                "{}: architecture {} (general.architecture); only `llama` is supported",
                crate::error::shown_path(path),
                quote(arch.as_bytes())
            )));
        }
        if md_result(path, md_u64(content, "llama.expert_count"))?.unwrap_or(0) > 1 {
            return Err(EngineError::Unsupported(format!(
                "{}: mixture-of-experts llama (llama.expert_count > 1)",
                crate::error::shown_path(path)
            )));
        }

        let hidden_size = required("llama.embedding_length")?;
        let n_layer = required("llama.block_count")?;
        let n_head = required("llama.attention.head_count")?;
        let n_kv_head =
            md_result(path, md_usize(content, "llama.attention.head_count_kv"))?.unwrap_or(n_head);
        let ffn_size = required("llama.feed_forward_length")?;
        let context_length = required("llama.context_length")?;
        let rms_norm_eps = md_result(
            path,
            md_f64(content, "llama.attention.layer_norm_rms_epsilon"),
        )?
        .ok_or_else(|| {
            invalid(
                path,
                "missing metadata key `llama.attention.layer_norm_rms_epsilon`",
            )
        })?;
        let rope_theta =
            md_result(path, md_f64(content, "llama.rope.freq_base"))?.unwrap_or(10_000.0) as f32;

        for (key, v) in [
            ("llama.embedding_length", hidden_size),
            ("llama.block_count", n_layer),
            ("llama.attention.head_count", n_head),
            ("llama.attention.head_count_kv", n_kv_head),
            ("llama.feed_forward_length", ffn_size),
            ("llama.context_length", context_length),
        ] {
            if v == 0 {
                return Err(invalid(path, format!("metadata `{key}` is 0")));
            }
        }
        if hidden_size % n_head != 0 {
            return Err(invalid(
                path,
                format!(
                    "llama.embedding_length {hidden_size} is not a multiple of \
                     llama.attention.head_count {n_head}"
                ),
            ));
        }
        if n_head % n_kv_head != 0 {
            return Err(invalid(
                path,
                format!(
                    "llama.attention.head_count {n_head} is not a multiple of \
                     llama.attention.head_count_kv {n_kv_head}"
                ),
            ));
        }
        let head_dim = hidden_size / n_head;
        if head_dim % 2 != 0 {
            return Err(invalid(path, format!("head dimension {head_dim} is odd")));
        }
        for key in ["llama.attention.key_length", "llama.attention.value_length"] {
            if let Some(v) = md_result(path, md_usize(content, key))? {
                if v != head_dim {
                    return Err(EngineError::Unsupported(format!(
                        "{}: `{key}` = {v} differs from embedding_length / head_count = {head_dim}",
                        crate::error::shown_path(path)
                    )));
                }
            }
        }
        let rope_dim =
            md_result(path, md_usize(content, "llama.rope.dimension_count"))?.unwrap_or(head_dim);
        if rope_dim != head_dim {
            return Err(EngineError::Unsupported(format!(
                "{}: partial RoPE (llama.rope.dimension_count {rope_dim} != head_dim {head_dim})",
                crate::error::shown_path(path)
            )));
        }
        if !(rms_norm_eps.is_finite() && rms_norm_eps >= 0.0) {
            return Err(invalid(
                path,
                format!("llama.attention.layer_norm_rms_epsilon is {rms_norm_eps}"),
            ));
        }
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(invalid(
                path,
                format!("llama.rope.freq_base is {rope_theta}"),
            ));
        }
        let freq_scale = match md_result(path, md_str(content, "llama.rope.scaling.type"))? {
            None | Some("none") => 1.0,
            Some("linear") => {
                let factor =
                    md_result(path, md_f64(content, "llama.rope.scaling.factor"))?.unwrap_or(1.0);
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(invalid(
                        path,
                        format!("llama.rope.scaling.factor is {factor}"),
                    ));
                }
                (1.0 / factor) as f32
            }
            Some(other) => {
                return Err(EngineError::Unsupported(format!(
                    "{}: RoPE scaling {} (llama.rope.scaling.type)",
                    crate::error::shown_path(path),
                    quote(other.as_bytes())
                )))
            }
        };

        let loader = TensorLoader {
            content,
            path,
            device,
            used: Default::default(),
        };
        // The embedding fixes the vocabulary size.
        let token_embd_q = loader.load(reader, "token_embd.weight", None, hidden_size)?;
        let vocab_size = token_embd_q.shape().dims()[0];
        let token_embd = loader.matmul(token_embd_q, "token_embd.weight")?;

        let q_rows = n_head * head_dim;
        let kv_rows = n_kv_head * head_dim;
        let mut layers = Vec::with_capacity(n_layer.min(1024));
        for i in 0..n_layer {
            let name = |t: &str| format!("blk.{i}.{t}.weight");
            let mut linear = |t: &str, rows: usize, cols: usize| -> Result<QMatMul> {
                let name = name(t);
                let q = loader.load(reader, &name, Some(rows), cols)?;
                loader.matmul(q, &name)
            };
            let attn_q = linear("attn_q", q_rows, hidden_size)?;
            let attn_k = linear("attn_k", kv_rows, hidden_size)?;
            let attn_v = linear("attn_v", kv_rows, hidden_size)?;
            let attn_output = linear("attn_output", hidden_size, q_rows)?;
            let ffn_gate = linear("ffn_gate", ffn_size, hidden_size)?;
            let ffn_up = linear("ffn_up", ffn_size, hidden_size)?;
            let ffn_down = linear("ffn_down", hidden_size, ffn_size)?;
            let attn_norm = loader.norm(reader, &name("attn_norm"), hidden_size)?;
            let ffn_norm = loader.norm(reader, &name("ffn_norm"), hidden_size)?;
            layers.push(Layer {
                attn_norm,
                attn_q,
                attn_k,
                attn_v,
                attn_output,
                ffn_norm,
                ffn_gate,
                ffn_up,
                ffn_down,
            });
        }
        let output_norm = loader.norm(reader, "output_norm.weight", hidden_size)?;
        let output = if content.tensor_infos.contains_key("output.weight") {
            let q = loader.load(reader, "output.weight", Some(vocab_size), hidden_size)?;
            Some(loader.matmul(q, "output.weight")?)
        } else {
            None
        };

        // llama.cpp refuses a file holding tensors its model does not use ("wrong number of
        // tensors"): they are a sign of a corrupt or mislabelled file (`llama.block_count`
        // below the file's layers). The first of them, in name order, is named.
        {
            let used = loader.used.borrow();
            let mut unused: Vec<&String> = content
                .tensor_infos
                .keys()
                // `rope_freqs.weight` is read below.
                .filter(|n| !used.contains(*n) && *n != "rope_freqs.weight")
                .collect();
            unused.sort();
            if let Some(first) = unused.first() {
                return Err(invalid(
                    path,
                    format!(
                        "tensor {} is not part of a {n_layer}-layer llama model \
                         (`llama.block_count` {n_layer}); {} of the file's {} tensors are \
                         unused, which llama.cpp refuses too",
                        quote(first.as_bytes()),
                        unused.len(),
                        content.tensor_infos.len()
                    ),
                ));
            }
        }
        // RoPE frequencies, computed as candle-transformers' `precomput_freqs_cis` does (f32),
        // with llama.cpp's optional per-pair factors and linear position scaling.
        let factors = if content.tensor_infos.contains_key("rope_freqs.weight") {
            let t = loader.load_1d(reader, "rope_freqs.weight", head_dim / 2)?;
            Some(t.to_vec1::<f32>()?)
        } else {
            None
        };
        let inv_freq: Vec<f32> = (0..head_dim)
            .step_by(2)
            .map(|i| {
                let f = 1f32 / rope_theta.powf(i as f32 / head_dim as f32);
                let f = match &factors {
                    Some(factors) => f / factors[i / 2],
                    None => f,
                };
                f * freq_scale
            })
            .collect();
        let inv_freq = Tensor::from_vec(inv_freq, (1, head_dim / 2), device)?;

        let config = LlamaConfig {
            vocab_size,
            hidden_size,
            n_layer,
            n_head,
            n_kv_head,
            head_dim,
            ffn_size,
            rms_norm_eps,
            rope_theta,
            context_length,
        };
        tracing::debug!(?config, tied = output.is_none(), "loaded llama model");
        Ok(Self {
            config,
            device: device.clone(),
            token_embd,
            layers,
            output_norm,
            output,
            inv_freq,
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The device the weights (and new caches) live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An empty [`KvCache`] for one sequence of this model: `n_layer` layers of
    /// `[n_kv_head, capacity, head_dim]` f32 keys and values on the model's device, holding at
    /// most `context_length` positions. Allocates nothing until the first `forward`.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(
            self.config.n_layer,
            self.config.n_kv_head,
            self.config.head_dim,
            self.config.context_length,
            &self.device,
        )
    }

    /// Runs the new tokens of several sequences in one pass and returns each sequence's
    /// next-token logits.
    ///
    /// Algorithm: the module docs' computation. The new tokens of all sequences are
    /// concatenated into one `[T_total, hidden]` matrix, so every linear layer (`QMatMul`) runs
    /// once on all rows; attention runs per sequence over that sequence's own cache, with
    /// positions starting at `cache.len()` and a causal mask among its new tokens. The keys and
    /// values of the new tokens are appended to each cache. The LM head runs only on each
    /// sequence's last new row.
    ///
    /// Arguments: `batch`, one [`SeqInput`] per sequence, in any mix of prefill (many tokens)
    /// and decode (one token). Each cache must come from this model's [`LlamaModel::new_cache`]
    /// (or match its layer count, kv heads, head dim and device).
    ///
    /// Returns: f32 logits `[batch.len(), vocab_size]` on the model's device; row `i` is the
    /// distribution (before softmax) over the token after `batch[i].tokens`' last one.
    ///
    /// Numerics: a sequence's logits equal running it alone, and running its tokens one by one,
    /// up to f32 rounding, not bitwise: the matrix kernels accumulate in a different order for a
    /// different number of rows (on stories260K the differences are below 1e-5). Decoding one
    /// token at a time reproduces candle-transformers' `quantized_llama` bitwise there, and a
    /// prefill agrees with its prefill within 1e-5. Positions are f32 in the RoPE angle, exact
    /// up to 2^24.
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
        let _span =
            tracing::trace_span!("llama_forward", seqs = batch.len(), tokens = t_total).entered();
        for seq in batch.iter_mut() {
            seq.cache.prepare_append(seq.tokens.len())?;
        }

        let ids = Tensor::from_vec(ids, t_total, &self.device)?;
        let mut x = self.token_embd.embedding(&ids)?.to_dtype(DType::F32)?; // [T, hidden]
        let positions = Tensor::from_vec(positions, (t_total, 1), &self.device)?;
        let angles = positions.broadcast_mul(&self.inv_freq)?; // [T, head_dim / 2]
        let cos = angles.cos()?;
        let sin = angles.sin()?;
        for (l, layer) in self.layers.iter().enumerate() {
            x = self.block(l, layer, &x, &cos, &sin, batch)?;
        }

        let _span = tracing::trace_span!("lm_head").entered();
        let last_rows = Tensor::from_vec(last_rows, batch.len(), &self.device)?;
        let x = x.index_select(&last_rows, 0)?; // [B, hidden]
        let x = candle_nn::ops::rms_norm(&x, &self.output_norm, cfg.rms_norm_eps as f32)?;
        let lm_head = self.output.as_ref().unwrap_or(&self.token_embd);
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

    /// One transformer block on the concatenated rows `x` `[T, hidden]`; `cos`, `sin`
    /// `[T, head_dim / 2]` are the RoPE tables of the rows' positions.
    fn block(
        &self,
        l: usize,
        layer: &Layer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        batch: &mut [SeqInput<'_>],
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (t_total, _) = x.dims2()?;
        let (n_head, n_kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let n_rep = n_head / n_kv;
        let eps = cfg.rms_norm_eps as f32;

        let h = candle_nn::ops::rms_norm(x, &layer.attn_norm, eps)?;
        let q = layer.attn_q.forward(&h)?; // [T, n_head * hd]
        let k = layer.attn_k.forward(&h)?; // [T, n_kv * hd]
        let v = layer.attn_v.forward(&h)?;
        let q = q
            .reshape((1, t_total, n_head, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = k
            .reshape((1, t_total, n_kv, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let q = candle_nn::rotary_emb::rope_i(&q, cos, sin)?.squeeze(0)?; // [n_head, T, hd]
        let k = candle_nn::rotary_emb::rope_i(&k, cos, sin)?.squeeze(0)?; // [n_kv, T, hd]
        let v = v.reshape((t_total, n_kv, hd))?.transpose(0, 1)?; // [n_kv, T, hd]

        let mut outputs = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for seq in batch.iter_mut() {
            let n = seq.tokens.len();
            let past = seq.cache.len();
            let (k_all, v_all) =
                seq.cache
                    .write(l, &k.narrow(1, offset, n)?, &v.narrow(1, offset, n)?)?;
            let total = past + n;
            // Query heads r * n_kv .. share kv head r / n_rep: group them as [n_kv, n_rep * n, hd].
            let q_s = q
                .narrow(1, offset, n)?
                .contiguous()?
                .reshape((n_kv, n_rep * n, hd))?;
            let att = (q_s.matmul(&k_all.t()?)? / (hd as f64).sqrt())?; // [n_kv, n_rep * n, total]
            let att = if n > 1 {
                let mask: Vec<f32> = (0..n)
                    .flat_map(|i| {
                        (0..total).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 })
                    })
                    .collect();
                let mask = Tensor::from_vec(mask, (n, total), &self.device)?;
                att.reshape((n_kv, n_rep, n, total))?
                    .broadcast_add(&mask)?
                    .reshape((n_kv, n_rep * n, total))?
            } else {
                att
            };
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let y = att.matmul(&v_all)?; // [n_kv, n_rep * n, hd]
            let y = y
                .reshape((n_head, n, hd))?
                .transpose(0, 1)?
                .reshape((n, n_head * hd))?;
            outputs.push(y);
            offset += n;
        }
        let y = Tensor::cat(&outputs, 0)?; // [T, n_head * hd]
        let x = (x + layer.attn_output.forward(&y)?)?;

        let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
        let gate = layer.ffn_gate.forward(&h)?;
        let up = layer.ffn_up.forward(&h)?;
        let ff = layer
            .ffn_down
            .forward(&(candle_nn::ops::silu(&gate)? * up)?)?;
        Ok((x + ff)?)
    }
}

/// A metadata helper's result with its message turned into `InvalidModel` for `path`.
fn md_result<T>(path: &Path, r: std::result::Result<T, String>) -> Result<T> {
    r.map_err(|m| invalid(path, m))
}

/// Reads tensors with the checks of [`LlamaModel::from_gguf`].
struct TensorLoader<'a> {
    content: &'a gguf_file::Content,
    path: &'a Path,
    device: &'a Device,
    /// The tensors read so far: every tensor of the file must be one of the model's.
    used: std::cell::RefCell<std::collections::HashSet<String>>,
}

impl TensorLoader<'_> {
    /// Reads the 2-D tensor `name`, checking it has `rows` rows (any when `None`, but at least
    /// one) of `cols` values, that quantized rows are whole blocks, and that its data lies
    /// within the file.
    fn load<R: Read + Seek>(
        &self,
        reader: &mut R,
        name: &str,
        rows: Option<usize>,
        cols: usize,
    ) -> Result<QTensor> {
        let info = self.info(name)?;
        let dims = info.shape.dims();
        let ok = matches!(dims, [r, c] if *c == cols && rows.map_or(*r > 0, |rows| *r == rows));
        if !ok {
            let expected = match rows {
                Some(rows) => format!("[{rows}, {cols}]"),
                None => format!("[vocab, {cols}]"),
            };
            return Err(invalid(
                self.path,
                format!("tensor `{name}` has shape {dims:?}, expected {expected}"),
            ));
        }
        let block = info.ggml_dtype.block_size();
        if !cols.is_multiple_of(block) {
            return Err(invalid(
                self.path,
                format!(
                    "tensor `{name}`: row length {cols} is not a multiple of the {:?} block size \
                     {block}",
                    info.ggml_dtype
                ),
            ));
        }
        self.read(reader, name, dims)
    }

    /// Reads the 1-D tensor `name` of `len` values as an f32 tensor.
    fn load_1d<R: Read + Seek>(&self, reader: &mut R, name: &str, len: usize) -> Result<Tensor> {
        let info = self.info(name)?;
        let dims = info.shape.dims();
        if dims != [len] {
            return Err(invalid(
                self.path,
                format!("tensor `{name}` has shape {dims:?}, expected [{len}]"),
            ));
        }
        let q = self.read(reader, name, dims)?;
        q.dequantize(self.device)?
            .to_dtype(DType::F32)
            .map_err(EngineError::from)
    }

    /// A norm weight `[hidden]`, as f32.
    fn norm<R: Read + Seek>(&self, reader: &mut R, name: &str, hidden: usize) -> Result<Tensor> {
        self.load_1d(reader, name, hidden)
    }

    fn info(&self, name: &str) -> Result<&gguf_file::TensorInfo> {
        self.content
            .tensor_infos
            .get(name)
            .ok_or_else(|| invalid(self.path, format!("missing tensor `{name}`")))
    }

    /// Reads tensor data after checking that its byte size does not overflow (candle then checks
    /// it against the file's length).
    fn read<R: Read + Seek>(&self, reader: &mut R, name: &str, dims: &[usize]) -> Result<QTensor> {
        let info = self.info(name)?;
        self.used.borrow_mut().insert(name.to_string());
        let elems = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        let fits = elems
            .and_then(|e| {
                (e / info.ggml_dtype.block_size()).checked_mul(info.ggml_dtype.type_size())
            })
            .is_some();
        if !fits {
            return Err(invalid(
                self.path,
                format!("tensor `{name}` of shape {dims:?} is too large"),
            ));
        }
        self.content.tensor(reader, name, self.device).map_err(|e| {
            invalid(
                self.path,
                format!("tensor `{name}`: {}", candle_message(&e)),
            )
        })
    }

    fn matmul(&self, q: QTensor, name: &str) -> Result<QMatMul> {
        QMatMul::from_qtensor(q).map_err(|e| {
            invalid(
                self.path,
                format!("tensor `{name}`: {}", candle_message(&e)),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_and_cache_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<LlamaModel>();
        check::<KvCache>();
        check::<LlamaConfig>();
    }
}
