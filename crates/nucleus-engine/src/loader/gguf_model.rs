//! GGUF archs `llama`, `qwen2`, `qwen3` and `qwen3moe` onto the [`Transformer`]: hyper-parameters from the
//! `{arch}.*` metadata, weights from the tensors (llama.cpp's names, `llama-arch.cpp`), and the
//! RoPE layout llama.cpp's converter leaves: it permutes q/k into adjacent pairs for arch
//! `llama` only (`convert_hf_to_gguf.py`, `LlamaModel.permute`); `qwen2` / `qwen3` keep Hugging
//! Face's order and use rotate-half ("neox") RoPE (`llama_model_rope_type`).

use std::io::{Read, Seek};
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::error::{candle_message, invalid, quote, EngineError, Result};
use crate::gguf::{md_f64, md_str, md_usize};
use crate::models::quant::{mapped_quant, owned_quant};
use crate::models::transformer::{FeedForward, LayerWeights, Linear, Mlp, ModelConfig, Weights};
use crate::models::weight::{HalfKind, HalfMatrix, Weight};
use crate::models::{MoeConfig, RopeConfig, RopeLayout, RopeScaling, SparseMoe, Transformer};

/// The GGUF architectures [`transformer_from_gguf`] maps onto the transformer.
pub const SUPPORTED_ARCHS: [&str; 4] = ["llama", "qwen2", "qwen3", "qwen3moe"];

/// Builds the model from a parsed GGUF file: `content` from
/// [`crate::gguf::read_content`] (whose checks the tensor reads rely on: offsets, sizes and
/// types of the tensor descriptions), `reader` the same file (tensor data is read from it),
/// `path` only for error messages, weights placed on `device`.
///
/// Metadata read (required unless a default is given; `A` is the architecture):
/// `general.architecture` (`llama`, `qwen2`, `qwen3` or `qwen3moe`), `A.embedding_length`,
/// `A.block_count`, `A.attention.head_count`, `A.attention.head_count_kv` (default:
/// head_count), `A.feed_forward_length`, `A.context_length`,
/// `A.attention.layer_norm_rms_epsilon`, `A.rope.freq_base` (default 10000),
/// `A.attention.key_length` / `value_length` (the head dimension, default
/// embedding_length / head_count; Qwen3-0.6B's is 128, not 64), `A.rope.dimension_count`
/// (default and only supported value: head_dim). Linear RoPE scaling (`llama.rope.scaling.type = linear`,
/// `llama.rope.scaling.factor`) divides positions by the factor, and a `rope_freqs.weight`
/// tensor divides each pair's frequency by its entry, as llama.cpp does.
///
/// Tensors (shapes as candle reports them, `[rows, row length]`, ggml's `ne` reversed):
/// `token_embd.weight [vocab, hidden]`, per block `i` `blk.{i}.attn_norm.weight [hidden]`,
/// `attn_q [n_head*head_dim, hidden]`, `attn_k`/`attn_v [n_kv_head*head_dim, hidden]`,
/// `attn_output [hidden, n_head*head_dim]`, `ffn_norm [hidden]`, `ffn_gate`/`ffn_up
/// [ffn, hidden]`, `ffn_down [hidden, ffn]`, then `output_norm.weight [hidden]` and the
/// optional `output.weight [vocab, hidden]` (tied to `token_embd.weight` when absent).
/// `qwen2` also `blk.{i}.attn_{q,k,v}.bias`; `qwen3` also `blk.{i}.attn_{q,k}_norm.weight
/// [head_dim]`; `llama` the optional `attn_{q,k,v,output}.bias` (all layers or none).
/// `qwen3moe` is `qwen3` with MoE blocks (`A.expert_count`, `A.expert_used_count`,
/// `A.expert_feed_forward_length` required; `A.feed_forward_length` only for a dense block):
/// a block with `blk.{i}.ffn_gate_inp.weight [E, hidden]` (the router) has the 3-D
/// `ffn_gate_exps`, `ffn_up_exps [E, I, hidden]` and `ffn_down_exps [E, hidden, I]`, split per
/// expert in their stored type; the top-k weights are always renormalised (GGUF has no
/// `norm_topk_prob`; llama.cpp's `llm_build_qwen3moe`).
///
/// Errors: [`EngineError::Unsupported`] for another architecture or a feature we do not run
/// (MoE outside `qwen3moe`, more than 10240 experts, partial or non-linear-scaled RoPE, per-head key/value lengths other than head_dim);
/// [`EngineError::InvalidModel`] naming `path` and the key or tensor for a missing or
/// mistyped key, inconsistent hyper-parameters, a missing tensor, a wrong shape, a quantized
/// row length not divisible by its block size, or tensor data beyond the end of the file.
pub(crate) fn transformer_from_gguf<R: Read + Seek>(
    content: &gguf_file::Content,
    reader: &mut R,
    mapped: Option<&MappedFiles>,
    path: &Path,
    device: &Device,
) -> Result<Transformer> {
    let _span = tracing::debug_span!("transformer_from_gguf").entered();
    let required = |key: &str| -> Result<usize> {
        md_result(path, md_usize(content, key))?
            .ok_or_else(|| invalid(path, format!("missing metadata key `{key}`")))
    };

    let arch = md_result(path, md_str(content, "general.architecture"))?
        .ok_or_else(|| invalid(path, "missing metadata key `general.architecture`"))?;
    if !SUPPORTED_ARCHS.contains(&arch) {
        return Err(EngineError::Unsupported(format!(
            "{}: architecture {} (general.architecture); supported: {}",
            crate::error::shown_path(path),
            quote(arch.as_bytes()),
            SUPPORTED_ARCHS.join(", ")
        )));
    }
    let key = |k: &str| format!("{arch}.{k}");
    let expert_count = md_result(path, md_usize(content, &key("expert_count")))?.unwrap_or(0);
    if arch != "qwen3moe" && expert_count > 1 {
        return Err(EngineError::Unsupported(format!(
            "{}: mixture-of-experts {arch} ({arch}.expert_count > 1)",
            crate::error::shown_path(path)
        )));
    }

    let hidden_size = required(&key("embedding_length"))?;
    let n_layer = required(&key("block_count"))?;
    let n_head = required(&key("attention.head_count"))?;
    let n_kv_head =
        md_result(path, md_usize(content, &key("attention.head_count_kv")))?.unwrap_or(n_head);
    // qwen3moe files of MoE-only models may carry no dense width (no layer uses it).
    let ffn_size = if arch == "qwen3moe" {
        md_result(path, md_usize(content, &key("feed_forward_length")))?.unwrap_or(0)
    } else {
        required(&key("feed_forward_length"))?
    };
    let context_length = required(&key("context_length"))?;
    let eps_key = key("attention.layer_norm_rms_epsilon");
    let rms_norm_eps = md_result(path, md_f64(content, &eps_key))?
        .ok_or_else(|| invalid(path, format!("missing metadata key `{eps_key}`")))?;
    let rope_theta = md_result(path, md_f64(content, &key("rope.freq_base")))?.unwrap_or(10_000.0);

    for (k, v) in [
        ("embedding_length", hidden_size),
        ("block_count", n_layer),
        ("attention.head_count", n_head),
        ("attention.head_count_kv", n_kv_head),
        ("context_length", context_length),
    ] {
        if v == 0 {
            return Err(invalid(path, format!("metadata `{arch}.{k}` is 0")));
        }
    }
    if !n_head.is_multiple_of(n_kv_head) {
        return Err(invalid(
            path,
            format!(
                "{arch}.attention.head_count {n_head} is not a multiple of \
                 {arch}.attention.head_count_kv {n_kv_head}"
            ),
        ));
    }
    let key_length = md_result(path, md_usize(content, &key("attention.key_length")))?;
    let value_length = md_result(path, md_usize(content, &key("attention.value_length")))?;
    let head_dim = match key_length {
        Some(k) => k,
        None => {
            if !hidden_size.is_multiple_of(n_head) {
                return Err(invalid(
                    path,
                    format!(
                        "{arch}.embedding_length {hidden_size} is not a multiple of \
                         {arch}.attention.head_count {n_head} and no \
                         {arch}.attention.key_length is given"
                    ),
                ));
            }
            hidden_size / n_head
        }
    };
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(invalid(
            path,
            format!("head dimension {head_dim} is odd or 0"),
        ));
    }
    if let Some(v) = value_length {
        if v != head_dim {
            return Err(EngineError::Unsupported(format!(
                "{}: `{arch}.attention.value_length` = {v} differs from the key length {head_dim}",
                crate::error::shown_path(path)
            )));
        }
    }
    if n_head.checked_mul(head_dim).is_none_or(|r| r > 1 << 24) {
        return Err(invalid(
            path,
            format!(
                "{arch}.attention.head_count {n_head} × head dimension {head_dim} is too large"
            ),
        ));
    }
    let rope_dim =
        md_result(path, md_usize(content, &key("rope.dimension_count")))?.unwrap_or(head_dim);
    if rope_dim != head_dim {
        return Err(EngineError::Unsupported(format!(
            "{}: partial RoPE ({arch}.rope.dimension_count {rope_dim} != head_dim {head_dim})",
            crate::error::shown_path(path)
        )));
    }
    if !(rms_norm_eps.is_finite() && rms_norm_eps >= 0.0) {
        return Err(invalid(path, format!("{eps_key} is {rms_norm_eps}")));
    }
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(invalid(
            path,
            format!("{arch}.rope.freq_base is {rope_theta}"),
        ));
    }
    let moe_params = if arch == "qwen3moe" {
        let expert_count = required(&key("expert_count"))?;
        let used = required(&key("expert_used_count"))?;
        let inter = required(&key("expert_feed_forward_length"))?;
        if expert_count == 0 || used == 0 || used > expert_count || inter == 0 {
            return Err(invalid(
                path,
                format!(
                    "{arch}.expert_count {expert_count}, {arch}.expert_used_count {used} and \
                     {arch}.expert_feed_forward_length {inter}: each must be at least 1 and \
                     the used count at most the expert count"
                ),
            ));
        }
        if expert_count > nucleus_moe::MAX_EXPERT_NUM as usize {
            return Err(EngineError::Unsupported(format!(
                "{}: {arch}.expert_count {expert_count} (at most {} experts are routed)",
                crate::error::shown_path(path),
                nucleus_moe::MAX_EXPERT_NUM
            )));
        }
        Some((expert_count, used, inter))
    } else {
        None
    };
    let scaling = match md_result(path, md_str(content, &key("rope.scaling.type")))? {
        None | Some("none") => RopeScaling::None,
        Some("linear") => {
            let factor =
                md_result(path, md_f64(content, &key("rope.scaling.factor")))?.unwrap_or(1.0);
            if !(factor.is_finite() && factor > 0.0) {
                return Err(invalid(
                    path,
                    format!("{arch}.rope.scaling.factor is {factor}"),
                ));
            }
            RopeScaling::Linear { factor }
        }
        Some(other) => {
            return Err(EngineError::Unsupported(format!(
                "{}: RoPE scaling {} ({arch}.rope.scaling.type)",
                crate::error::shown_path(path),
                quote(other.as_bytes())
            )))
        }
    };

    let loader = TensorLoader {
        content,
        mapped,
        path,
        device,
        used: Default::default(),
    };
    // The embedding fixes the vocabulary size.
    let token_embd = loader.weight(reader, "token_embd.weight", None, hidden_size)?;
    let vocab_size = token_embd.dims().0;

    let q_rows = n_head * head_dim;
    let kv_rows = n_kv_head * head_dim;
    // Which optional tensors the family has: qwen2's q/k/v biases are required, llama's are
    // optional (all layers or none, decided by layer 0), qwen3 has per-head q/k norms.
    let has = |name: &str| content.tensor_infos.contains_key(name);
    let (qkv_bias, o_bias, qk_norm) = match arch {
        "qwen2" => (true, false, false),
        "qwen3" | "qwen3moe" => (false, false, true),
        _ => (
            has("blk.0.attn_q.bias"),
            has("blk.0.attn_output.bias"),
            false,
        ),
    };
    let mut layers = Vec::with_capacity(n_layer.min(1024));
    let mut moe_layers = Vec::new();
    for i in 0..n_layer {
        let name = |t: &str| format!("blk.{i}.{t}.weight");
        let mut linear = |t: &str, rows: usize, cols: usize, bias: bool| -> Result<Linear> {
            let name = name(t);
            let weight = loader.weight(reader, &name, Some(rows), cols)?;
            let bias = if bias {
                Some(loader.load_1d(reader, &format!("blk.{i}.{t}.bias"), rows)?)
            } else {
                None
            };
            Ok(Linear { weight, bias })
        };
        let attn_q = linear("attn_q", q_rows, hidden_size, qkv_bias)?;
        let attn_k = linear("attn_k", kv_rows, hidden_size, qkv_bias)?;
        let attn_v = linear("attn_v", kv_rows, hidden_size, qkv_bias)?;
        let attn_output = linear("attn_output", hidden_size, q_rows, o_bias)?;
        // qwen3moe: a layer with a router is MoE (llama.cpp's `llm_build_qwen3moe`: all of
        // them); one without is dense and needs `feed_forward_length`.
        let ffn = match moe_params {
            Some((experts, used, inter)) if has(&name("ffn_gate_inp")) => {
                moe_layers.push(i);
                let router = linear("ffn_gate_inp", experts, hidden_size, false)?;
                let gate = loader.load_experts(
                    reader,
                    &name("ffn_gate_exps"),
                    experts,
                    inter,
                    hidden_size,
                )?;
                let up = loader.load_experts(
                    reader,
                    &name("ffn_up_exps"),
                    experts,
                    inter,
                    hidden_size,
                )?;
                let down = loader.load_experts(
                    reader,
                    &name("ffn_down_exps"),
                    experts,
                    hidden_size,
                    inter,
                )?;
                let experts = gate
                    .into_iter()
                    .zip(up)
                    .zip(down)
                    .map(|((gate, up), down)| Mlp {
                        gate: Linear {
                            weight: gate,
                            bias: None,
                        },
                        up: Linear {
                            weight: up,
                            bias: None,
                        },
                        down: Linear {
                            weight: down,
                            bias: None,
                        },
                    })
                    .collect();
                FeedForward::Moe(SparseMoe::from_parts(
                    router,
                    experts,
                    Vec::new(),
                    hidden_size,
                    used,
                    true,
                ))
            }
            _ => {
                if ffn_size == 0 {
                    return Err(invalid(
                        path,
                        format!(
                            "block {i} has no `{}` (so it is dense) but `{arch}.feed_forward_length` \
                             is missing or 0",
                            name("ffn_gate_inp")
                        ),
                    ));
                }
                FeedForward::Dense(Mlp {
                    gate: linear("ffn_gate", ffn_size, hidden_size, false)?,
                    up: linear("ffn_up", ffn_size, hidden_size, false)?,
                    down: linear("ffn_down", hidden_size, ffn_size, false)?,
                })
            }
        };
        let attn_norm = loader.norm(reader, &name("attn_norm"), hidden_size)?;
        let ffn_norm = loader.norm(reader, &name("ffn_norm"), hidden_size)?;
        let (q_norm, k_norm) = if qk_norm {
            (
                Some(loader.norm(reader, &name("attn_q_norm"), head_dim)?),
                Some(loader.norm(reader, &name("attn_k_norm"), head_dim)?),
            )
        } else {
            (None, None)
        };
        layers.push(LayerWeights {
            attn_norm,
            q: attn_q,
            k: attn_k,
            v: attn_v,
            o: attn_output,
            q_norm,
            k_norm,
            ffn_norm,
            ffn,
        });
    }
    let output_norm = loader.norm(reader, "output_norm.weight", hidden_size)?;
    let output = if content.tensor_infos.contains_key("output.weight") {
        Some(loader.weight(reader, "output.weight", Some(vocab_size), hidden_size)?)
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
                    "tensor {} is not part of a {n_layer}-layer {arch} model \
                     (`{arch}.block_count` {n_layer}); {} of the file's {} tensors are \
                     unused, which llama.cpp refuses too",
                    quote(first.as_bytes()),
                    unused.len(),
                    content.tensor_infos.len()
                ),
            ));
        }
    }
    // llama.cpp's optional per-pair frequency divisors (`freq_factors`).
    let freq_factors = if content.tensor_infos.contains_key("rope_freqs.weight") {
        let t = loader.load_1d(reader, "rope_freqs.weight", head_dim / 2)?;
        let factors = t.to_vec1::<f32>()?;
        if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
            return Err(invalid(
                path,
                format!("tensor `rope_freqs.weight` holds {bad}, not a positive number"),
            ));
        }
        Some(factors)
    } else {
        None
    };

    // llama.cpp's converter permutes q/k into adjacent pairs for `llama` only.
    let layout = if arch == "llama" {
        RopeLayout::Interleaved
    } else {
        RopeLayout::RotateHalf
    };
    let weight_dtype = content
        .tensor_infos
        .get("blk.0.attn_q.weight")
        .map_or("f32".to_string(), |t| {
            format!("{:?}", t.ggml_dtype).to_lowercase()
        });
    let config = ModelConfig {
        architecture: arch.to_string(),
        vocab_size,
        hidden_size,
        n_layer,
        n_head,
        n_kv_head,
        head_dim,
        ffn_size,
        rms_norm_eps,
        rope: RopeConfig {
            scaling,
            freq_factors,
            ..RopeConfig::new(rope_theta, layout)
        },
        context_length,
        qkv_bias,
        o_bias,
        qk_norm,
        tie_word_embeddings: output.is_none(),
        weight_dtype,
        // Filled in by the loader from the tokenizer metadata.
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        moe: moe_params.map(|(num_experts, used, inter)| MoeConfig {
            num_experts,
            num_experts_per_tok: used,
            moe_intermediate_size: inter,
            // GGUF has no norm_topk_prob; llama.cpp's qwen3moe always renormalises.
            norm_topk_prob: true,
            n_shared_experts: 0,
            shared_intermediate_size: 0,
            moe_layers,
        }),
    };
    let weights = Weights {
        embed: token_embd,
        layers,
        norm: output_norm,
        lm_head: output,
    };
    Transformer::new(config, weights, device)
}

/// A metadata helper's result with its message turned into `InvalidModel` for `path`.
fn md_result<T>(path: &Path, r: std::result::Result<T, String>) -> Result<T> {
    r.map_err(|m| invalid(path, m))
}

/// The memory maps of a GGUF model's files, for [`transformer_from_gguf`]: each file's map
/// with the offset of its first byte in the file (one file: 0) or in the splits joined end to
/// end (`crate::loader::gguf`'s `join_splits`), the offsets the tensor descriptions use.
#[derive(Debug, Default)]
pub(crate) struct MappedFiles {
    /// `(base, map)`, by increasing base.
    pub parts: Vec<(u64, Arc<memmap2::Mmap>)>,
}

impl MappedFiles {
    /// The map holding the bytes `start..start + len` of the model's files and the offset of
    /// `start` in it; `None` when no single map holds them all.
    fn locate(&self, start: u64, len: u64) -> Option<(&Arc<memmap2::Mmap>, usize)> {
        let i = self.parts.partition_point(|(base, _)| *base <= start);
        let (base, map) = self.parts.get(i.checked_sub(1)?)?;
        let offset = start - base;
        let end = offset.checked_add(len)?;
        (end <= map.len() as u64).then_some((map, usize::try_from(offset).ok()?))
    }
}

/// Reads tensors with the checks of [`Transformer::from_gguf`].
struct TensorLoader<'a> {
    content: &'a gguf_file::Content,
    /// The file's maps, when it was memory-mapped: f16 / bf16 matrices are then used in place
    /// and quantized ones copied straight from the map.
    mapped: Option<&'a MappedFiles>,
    path: &'a Path,
    device: &'a Device,
    /// The tensors read so far: every tensor of the file must be one of the model's.
    used: std::cell::RefCell<std::collections::HashSet<String>>,
}

impl TensorLoader<'_> {
    /// Reads the 2-D tensor `name`, checking it has `rows` rows (any when `None`, but at least
    /// one) of `cols` values, that quantized rows are whole blocks, and that its data lies
    /// within the file.
    fn check_2d(
        &self,
        name: &str,
        rows: Option<usize>,
        cols: usize,
    ) -> Result<&gguf_file::TensorInfo> {
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
        Ok(info)
    }

    /// The 2-D matrix `name` (the checks of [`TensorLoader::check_2d`]) as a [`Weight`] in
    /// its stored type: f16 / bf16 as a [`HalfMatrix`] and quantized blocks as a
    /// [`crate::models::mapped_quant::MappedQuant`], in place in the file's map when it is
    /// mapped; otherwise (no map, or quantized blocks the map cannot hold in place) with
    /// candle's `QMatMul` (blocks copied once from the map, whose pages are then released, or
    /// read), f16 / bf16 read into a [`HalfMatrix`].
    fn weight<R: Read + Seek>(
        &self,
        reader: &mut R,
        name: &str,
        rows: Option<usize>,
        cols: usize,
    ) -> Result<Weight> {
        let info = self.check_2d(name, rows, cols)?;
        let dims = info.shape.dims().to_vec();
        let rows = dims[0];
        let bytes = self.byte_size(name, &dims)?;
        let start = self.content.tensor_data_offset.checked_add(info.offset);
        let located = start.and_then(|s| self.mapped?.locate(s, bytes as u64));
        if let Some(kind) = half_kind(info.ggml_dtype) {
            if let Some((map, offset)) = located {
                if let Some(h) = HalfMatrix::mapped(kind, map.clone(), offset, rows, cols) {
                    self.used.borrow_mut().insert(name.to_string());
                    return Ok(Weight::Half(h));
                }
            }
            let q = self.read(reader, name, &dims)?;
            let data = q.data().map_err(|e| {
                invalid(
                    self.path,
                    format!("tensor `{name}`: {}", candle_message(&e)),
                )
            })?;
            return Ok(Weight::Half(HalfMatrix::from_le_bytes(
                kind, &data, rows, cols,
            )));
        }
        if let Some((map, offset)) = located {
            if let Some(q) = mapped_quant(info.ggml_dtype, map, offset, bytes, rows, cols) {
                self.used.borrow_mut().insert(name.to_string());
                return Ok(Weight::Quant(q));
            }
        }
        // Not in place (no map, or a start not aligned for the blocks): the blocks copied once.
        let read;
        let data: &[u8] = match located {
            Some((map, offset)) => {
                self.used.borrow_mut().insert(name.to_string());
                &map[offset..offset + bytes]
            }
            None => {
                read = self.read_bytes(reader, name, &dims)?;
                &read
            }
        };
        let weight = match owned_quant(info.ggml_dtype, data, rows, cols) {
            Some(q) => Weight::Quant(q),
            // f32: candle's QMatMul, its values copied out of the map as typed values (only
            // from an aligned start; the parser guarantees 8-aligned tensor data), else read.
            None => {
                let aligned = located
                    .filter(|_| (data.as_ptr() as usize).is_multiple_of(BLOCK_ALIGN))
                    .is_some();
                let q = if aligned {
                    qtensor_from_ggml(info.ggml_dtype, data, dims.clone(), self.device).map_err(
                        |e| {
                            invalid(
                                self.path,
                                format!("tensor `{name}`: {}", candle_message(&e)),
                            )
                        },
                    )?
                } else {
                    self.read(reader, name, &dims)?
                };
                Weight::Candle(self.matmul(q, name)?)
            }
        };
        if let Some((map, offset)) = located {
            release(map, offset, bytes);
        }
        Ok(weight)
    }

    /// The bytes of tensor `name` of shape `dims`, read from `reader` (the checks of
    /// [`TensorLoader::read`]).
    fn read_bytes<R: Read + Seek>(
        &self,
        reader: &mut R,
        name: &str,
        dims: &[usize],
    ) -> Result<Vec<u8>> {
        let q = self.read(reader, name, dims)?;
        let data = q.data().map_err(|e| {
            invalid(
                self.path,
                format!("tensor `{name}`: {}", candle_message(&e)),
            )
        })?;
        Ok(data.into_owned())
    }

    /// The bytes of tensor `name` of shape `dims`, checked not to overflow.
    fn byte_size(&self, name: &str, dims: &[usize]) -> Result<usize> {
        let info = self.info(name)?;
        dims.iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .and_then(|e| {
                (e / info.ggml_dtype.block_size()).checked_mul(info.ggml_dtype.type_size())
            })
            .ok_or_else(|| {
                invalid(
                    self.path,
                    format!("tensor `{name}` of shape {dims:?} is too large"),
                )
            })
    }

    /// Reads the 3-D expert tensor `name` (`[experts, rows, cols]` as candle reports it: ggml's
    /// `ffn_{gate,up,down}_exps`, ne = `[cols, rows, experts]`) and splits it into one
    /// `[rows, cols]` matrix per expert (each expert's data is contiguous, quantized blocks
    /// included), with the checks of [`TensorLoader::load`].
    fn load_experts<R: Read + Seek>(
        &self,
        reader: &mut R,
        name: &str,
        experts: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Weight>> {
        let info = self.info(name)?;
        let dims = info.shape.dims();
        if dims != [experts, rows, cols] {
            return Err(invalid(
                self.path,
                format!("tensor `{name}` has shape {dims:?}, expected [{experts}, {rows}, {cols}]"),
            ));
        }
        let dtype = info.ggml_dtype;
        if !cols.is_multiple_of(dtype.block_size()) {
            return Err(invalid(
                self.path,
                format!(
                    "tensor `{name}`: row length {cols} is not a multiple of the {dtype:?} block \
                     size {}",
                    dtype.block_size()
                ),
            ));
        }
        let bytes = self.byte_size(name, dims)?;
        let per = bytes / experts;
        let start = self.content.tensor_data_offset.checked_add(info.offset);
        let located = start.and_then(|s| self.mapped?.locate(s, bytes as u64));
        if let (Some(kind), Some((map, offset))) = (half_kind(dtype), located) {
            let halves = (0..experts)
                .map(|e| HalfMatrix::mapped(kind, map.clone(), offset + e * per, rows, cols))
                .collect::<Option<Vec<_>>>();
            if let Some(halves) = halves {
                self.used.borrow_mut().insert(name.to_string());
                return Ok(halves.into_iter().map(Weight::Half).collect());
            }
        }
        if let Some((map, offset)) = located {
            let mapped = (0..experts)
                .map(|e| mapped_quant(dtype, map, offset + e * per, per, rows, cols))
                .collect::<Option<Vec<_>>>();
            if let Some(mapped) = mapped {
                self.used.borrow_mut().insert(name.to_string());
                return Ok(mapped.into_iter().map(Weight::Quant).collect());
            }
        }
        let located = located
            .filter(|(map, offset)| (map.as_ptr() as usize + offset).is_multiple_of(BLOCK_ALIGN));
        let read;
        let data: &[u8] = match located {
            Some((map, offset)) => {
                self.used.borrow_mut().insert(name.to_string());
                &map[offset..offset + bytes]
            }
            None => {
                read = self.read_bytes(reader, name, dims)?;
                &read
            }
        };
        let weights = (0..experts)
            .map(|e| {
                if let Some(kind) = half_kind(dtype) {
                    return Ok(Weight::Half(HalfMatrix::from_le_bytes(
                        kind,
                        &data[e * per..(e + 1) * per],
                        rows,
                        cols,
                    )));
                }
                let part = &data[e * per..(e + 1) * per];
                if let Some(q) = owned_quant(dtype, part, rows, cols) {
                    return Ok(Weight::Quant(q));
                }
                let part = qtensor_from_ggml(dtype, part, vec![rows, cols], self.device).map_err(
                    |err| {
                        invalid(
                            self.path,
                            format!("tensor `{name}`, expert {e}: {}", candle_message(&err)),
                        )
                    },
                )?;
                Ok(Weight::Candle(self.matmul(part, name)?))
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some((map, offset)) = located {
            release(map, offset, bytes);
        }
        Ok(weights)
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

/// The [`HalfKind`] of a 16-bit float ggml type.
fn half_kind(dtype: GgmlDType) -> Option<HalfKind> {
    match dtype {
        GgmlDType::F16 => Some(HalfKind::F16),
        GgmlDType::BF16 => Some(HalfKind::Bf16),
        _ => None,
    }
}

/// Releases the pages of `map` under `offset..offset + len` once their bytes were copied out
/// (quantized blocks), so the copy is the one the process keeps resident; the file's bytes stay
/// readable (read-only file-backed pages are read again from the page cache if touched).
fn release(map: &memmap2::Mmap, offset: usize, len: usize) {
    // Whole 64 KiB windows only (a multiple of every page size in use: 4, 16 and 64 KiB), so
    // the pages shared with a neighbouring tensor used in place stay.
    let page = 64 << 10;
    // Absolute addresses: the window's start is at or after the tensor's, so at or after the
    // map's; its end may fall before the map's start (a small tensor near it), then nothing.
    let base = map.as_ptr() as usize;
    let start = (base + offset).next_multiple_of(page);
    let end = (base + offset + len) / page * page;
    if end > start {
        advise_dont_need(map, start - base, end - start);
    }
}

/// `madvise(MADV_DONTNEED)` on `len` bytes of `map` from `offset` (page-aligned), logged when
/// it fails; nothing off Unix.
#[cfg(unix)]
fn advise_dont_need(map: &memmap2::Mmap, offset: usize, len: usize) {
    // SAFETY: DontNeed on a read-only shared file mapping drops our page-table entries; later
    // reads of those pages fault the file's bytes in again (nothing was written to them), so
    // no reference into the map is invalidated.
    let r = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
    if let Err(e) = r {
        tracing::debug!(error = %e, "madvise(DONTNEED) on a copied tensor failed");
    }
}

#[cfg(not(unix))]
fn advise_dont_need(_map: &memmap2::Mmap, _offset: usize, _len: usize) {}

/// The alignment `qtensor_from_ggml` needs to read values out of the map as typed values (f32,
/// and the f16 scales of ggml blocks).
const BLOCK_ALIGN: usize = 8;
