//! Hugging Face model folders: `config.json`, safetensors weights, `tokenizer.json`,
//! `tokenizer_config.json` and `generation_config.json`, read as transformers reads them.
//!
//! # Families (`model_type`)
//! | `model_type` | transformers class | attention biases | q/k norm |
//! |---|---|---|---|
//! | `llama` | `LlamaForCausalLM` (`models/llama/modeling_llama.py`) | q, k, v, o when `attention_bias` | no |
//! | `qwen2` | `Qwen2ForCausalLM` (`models/qwen2/modeling_qwen2.py`) | q, k, v always; o never | no |
//! | `qwen3` | `Qwen3ForCausalLM` (`models/qwen3/modeling_qwen3.py`) | q, k, v, o when `attention_bias` | `q_norm`, `k_norm` over `head_dim` |
//! | `qwen3_moe` | `Qwen3MoeForCausalLM` (`models/qwen3_moe/modeling_qwen3_moe.py`) | as `qwen3` | as `qwen3` |
//! | `minimind` (MiniMind-3) | `MiniMindForCausalLM` (jingyaogong/minimind `model/model_minimind.py`) | none | `q_norm`, `k_norm` |
//! | `minimind` with `n_routed_experts` / `n_shared_experts` (MiniMind2) | the same file before 2026-04 | none | none |
//!
//! MoE fields (`qwen3_moe`: `num_experts` / `num_local_experts`, `num_experts_per_tok`,
//! `moe_intermediate_size`, `norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`;
//! `minimind`: `use_moe`, `num_experts` or `n_routed_experts`, `n_shared_experts`,
//! `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`, `scoring_func`) are read
//! by `moe_config`; MiniMind's absent fields take `MiniMindConfig`'s defaults.
//!
//! # config.json
//! Read: `model_type`, `vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
//! `num_attention_heads`, `num_key_value_heads` (default `num_attention_heads`), `head_dim`
//! (default `hidden_size / num_attention_heads`), `max_position_embeddings`, `rms_norm_eps`,
//! `tie_word_embeddings` (default false), `attention_bias` (default false), `hidden_act` (must be
//! `silu`), `mlp_bias` (must be false), `use_sliding_window` (must be false),
//! `partial_rotary_factor` (must be 1), `bos_token_id`, `eos_token_id`, `torch_dtype` / `dtype`.
//! RoPE: transformers 4's `rope_theta` (default 10000) and `rope_scaling`, or transformers 5's
//! `rope_parameters` (holding `rope_theta` too); `rope_type` (or the older `type`) `default`,
//! `linear`, `llama3` or `yarn` (see [`crate::models::rope`]); any other is
//! [`EngineError::Unsupported`] naming the field.
//!
//! # Weights
//! `model.safetensors`, or the shards named by `model.safetensors.index.json`'s `weight_map`;
//! memory-mapped, f32 / f16 / bf16, converted to f32 at load. Tensor names are transformers':
//! `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}`,
//! `model.layers.{i}.self_attn.{q,k}_norm.weight`, `model.layers.{i}.post_attention_layernorm.weight`,
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.norm.weight`, `lm_head.weight`
//! (read only when the embeddings are not tied, as transformers ties them). MoE layers:
//! `mlp.gate.weight` `[E, H]` and the experts per expert
//! (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused (`mlp.experts.gate_up_proj`
//! `[E, 2I, H]`, `mlp.experts.down_proj` `[E, H, I]`); MiniMind2's
//! `mlp.shared_experts.{j}.{gate,up,down}_proj.weight`. A `minimind` checkpoint is read
//! strictly: a tensor its layout has no place for is an error (MiniMind's `strict=True`).
//!
//! # Tokenizer
//! `tokenizer.json` through the `tokenizers` crate, as it is. For `tokenizer_class`
//! `LlamaTokenizer` / `LlamaTokenizerFast` (Llama 2), `tokenizer_config.json`'s `add_bos_token`
//! (default true) and `add_eos_token` (default false) set the post-processor, as
//! `LlamaTokenizerFast.update_post_processor` does; other classes (Llama 3's and Qwen's
//! `PreTrainedTokenizerFast` / `Qwen2TokenizerFast`) keep tokenizer.json's post-processor. BOS:
//! config.json's `bos_token_id`, else tokenizer_config.json's `bos_token`. EOS (a list):
//! generation_config.json's `eos_token_id` (a number or a list), else config.json's, else
//! tokenizer_config.json's `eos_token`.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use candle_core::safetensors::{Load, MmapedSafetensors};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::error::{bounded, candle_message, invalid, quote, shown_path, EngineError, Result};
use crate::loader::LoadedModel;
use crate::models::rope::yarn_mscale;
use crate::models::transformer::{FeedForward, LayerWeights, Linear, Mlp, ModelConfig, Weights};
use crate::models::weight::Weight;
use crate::models::{MoeConfig, RopeConfig, RopeLayout, RopeScaling, SparseMoe, Transformer};
use crate::tokenizer::{bos_eos_template, eog_ids_by_text, ModelTokenizer, TokenizerKind};

/// The `model_type`s [`load_hf_folder`] runs.
pub const SUPPORTED_MODEL_TYPES: [&str; 5] = ["llama", "qwen2", "qwen3", "qwen3_moe", "minimind"];

/// The most bytes of a JSON file of a model folder we read (config, index, tokenizer config):
/// real ones are at most a few MB (a sharded index of a large model ~100 KB).
const MAX_JSON_BYTES: u64 = 64 << 20;

/// The most bytes of a tokenizer.json (real ones: 2-35 MB; Gemma's, the largest we know, 33 MB).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Loads the model, tokenizer and special ids of the Hugging Face folder `dir` onto `device`
/// (see the module docs for what is read).
///
/// # Errors
/// - [`EngineError::InvalidModel`] naming the file and the field or tensor: a missing or
///   unreadable `config.json` or `tokenizer.json`, a field of the wrong type or out of range,
///   inconsistent hyper-parameters, a folder without weights (`model.safetensors` or
///   `model.safetensors.index.json`), an index naming a missing file or a tensor a shard does
///   not hold, a missing tensor, a tensor of the wrong shape (name, expected, found) or dtype
///   (f32, f16, bf16 only), a corrupt safetensors file, a tokenizer with more ids than the
///   embedding has rows, special ids outside the vocabulary.
/// - [`EngineError::Unsupported`]: a `model_type` we do not run (the message lists the
///   supported ones), a `rope_type` other than default / linear / llama3 / yarn, sliding-window
///   attention, an activation other than SiLU, MLP biases, partial RoPE.
pub fn load_hf_folder(dir: &Path, device: &Device) -> Result<LoadedModel> {
    let _span = tracing::debug_span!("load_hf_folder", dir = %dir.display()).entered();
    let config_path = dir.join("config.json");
    let config = read_json(&config_path, "the model's configuration")?;
    let cfg = Json {
        path: &config_path,
        value: &config,
    };
    let mut warnings = Vec::new();
    let mut model_config = model_config(&cfg)?;

    let weights_files = weight_files(dir)?;
    let mut shards = Vec::with_capacity(weights_files.files.len());
    for path in &weights_files.files {
        // SAFETY: the file is mapped read-only; as with every mmap, a concurrent truncation of
        // the file by another process would fault (memmap2's documented caveat, as for candle
        // and transformers' safetensors loading).
        let st = unsafe { MmapedSafetensors::new(path) }.map_err(|e| {
            invalid(
                path,
                format!(
                    "cannot map or parse the safetensors file: {}",
                    without_path(&candle_message(&e), path)
                ),
            )
        })?;
        shards.push(st);
    }
    // Each tensor is read from the shard the index names (transformers' rule), else from the
    // single file.
    let mut routing = std::collections::HashMap::new();
    match &weights_files.index {
        Some(index) => {
            let file_index: std::collections::HashMap<&str, usize> = weights_files
                .names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.as_str(), i))
                .collect();
            for (tensor, file) in index {
                routing.insert(tensor.clone(), file_index[file.as_str()]);
            }
        }
        None => {
            for (name, _) in shards[0].tensors() {
                routing.insert(name, 0);
            }
        }
    }
    let reader = TensorReader {
        shards: &shards,
        files: &weights_files.files,
        routing,
        dir,
        index: weights_files.index.as_ref(),
        device,
        used: Default::default(),
    };
    reader.check_memory()?;
    let minimind = minimind_layout(&cfg)?;
    let weights = read_weights(&reader, &mut model_config).map_err(|e| match (e, minimind) {
        (EngineError::InvalidModel { path, message }, Some(layout))
            if message.starts_with("missing tensor") =>
        {
            EngineError::InvalidModel {
                path,
                message: bounded(format!(
                    "{message}: config.json describes the {} layout ({})",
                    layout.name(),
                    layout.hint()
                )),
            }
        }
        (e, _) => e,
    })?;
    let unused = reader.unused();
    if let (Some(first), Some(layout)) = (unused.first(), minimind) {
        // MiniMind loads its state dict strictly: a tensor its layout has no place for means
        // the config and the checkpoint disagree.
        return Err(invalid(
            dir,
            format!(
                "tensor {} is not part of the {} layout config.json describes ({}); {} \
                 tensor(s) unused",
                quote(first.as_bytes()),
                layout.name(),
                layout.hint(),
                unused.len()
            ),
        ));
    }
    if let Some(first) = unused.first() {
        warnings.push(bounded(format!(
            "{}: {} tensor(s) of the checkpoint are not used by a {} model (first: {}), as \
             transformers ignores them",
            shown_path(dir),
            unused.len(),
            model_config.architecture,
            quote(first.as_bytes())
        )));
    }

    let tokenizer = read_tokenizer(
        &dir.join("tokenizer.json"),
        dir,
        &cfg,
        Some(model_config.vocab_size),
    )?;
    model_config.bos_token_id = tokenizer.bos_token_id;
    model_config.eos_token_ids = tokenizer.eos_token_ids.clone();
    let model = Transformer::new(model_config, weights, device)?;
    Ok(LoadedModel {
        model: Box::new(model),
        tokenizer,
        warnings,
    })
}

/// The tokenizer and special ids of the Hugging Face folder `dir`, and the model's vocabulary
/// size (the embedding's rows, from config.json), without reading the weights: what a grammar
/// needs. The same checks as [`load_hf_folder`] on config.json and the tokenizer files.
///
/// # Errors
/// As [`load_hf_folder`]'s for those files.
pub fn load_hf_tokenizer(dir: &Path) -> Result<(ModelTokenizer, usize)> {
    let config_path = dir.join("config.json");
    let config = read_json(&config_path, "the model's configuration")?;
    let cfg = Json {
        path: &config_path,
        value: &config,
    };
    let model_config = model_config(&cfg)?;
    let tokenizer = read_tokenizer(
        &dir.join("tokenizer.json"),
        dir,
        &cfg,
        Some(model_config.vocab_size),
    )?;
    Ok((tokenizer, model_config.vocab_size))
}

/// The tokenizer of the `tokenizer.json` file `path`, with the special ids and post-processor
/// of the files beside it when present: tokenizer_config.json, generation_config.json and
/// config.json (whose `vocab_size`, when there, bounds the ids as in [`load_hf_tokenizer`]).
///
/// # Errors
/// [`EngineError::InvalidModel`] naming the file that is missing, unreadable or malformed
/// (as [`load_hf_tokenizer`]'s).
pub fn load_tokenizer_json(path: &Path) -> Result<ModelTokenizer> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let config_path = dir.join("config.json");
    let config = read_optional_json(&config_path, "the model's configuration")?;
    let null = Value::Null;
    let cfg = Json {
        path: &config_path,
        value: config.as_ref().unwrap_or(&null),
    };
    let vocab_size = cfg.opt_usize("vocab_size")?;
    read_tokenizer(path, dir, &cfg, vocab_size)
}

/// `message` without a leading `PATH: ` (candle prefixes its I/O and parse errors with the
/// file's path, which our message names already).
fn without_path(message: &str, path: &Path) -> String {
    let prefix = format!("{}: ", path.display());
    message.strip_prefix(&prefix).unwrap_or(message).to_string()
}

/// A JSON document and the file it came from, for messages.
struct Json<'a> {
    path: &'a Path,
    value: &'a Value,
}

impl Json<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.value.get(key).filter(|v| !v.is_null())
    }

    fn err(&self, message: impl Into<String>) -> EngineError {
        invalid(self.path, message)
    }

    /// A required positive integer.
    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(format!("missing field `{key}`")))
    }

    /// An optional positive integer (null counts as absent).
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|v| usize::try_from(v).ok()) {
                Some(0) => Err(self.err(format!("field `{key}` is 0"))),
                Some(n) => Ok(Some(n)),
                None => Err(self.err(format!(
                    "field `{key}` is {}, expected a positive integer",
                    describe(v)
                ))),
            },
        }
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        opt_f64_in(self, self.value, key, key)
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(format!(
                "field `{key}` is {}, expected true or false",
                describe(v)
            ))),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(format!(
                "field `{key}` is {}, expected a string",
                describe(v)
            ))),
        }
    }
}

/// `object[key]` as a finite f64, named `shown` in messages.
fn opt_f64_in(json: &Json<'_>, object: &Value, key: &str, shown: &str) -> Result<Option<f64>> {
    match object.get(key).filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => match v.as_f64().filter(|f| f.is_finite()) {
            Some(f) => Ok(Some(f)),
            None => Err(json.err(format!(
                "field `{shown}` is {}, expected a number",
                describe(v)
            ))),
        },
    }
}

/// A JSON value described in a few words for messages (strings quoted and cut).
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("the string {}", quote(s.as_bytes())),
        Value::Array(a) => format!("an array of {} values", a.len()),
        Value::Object(_) => "an object".to_string(),
    }
}

fn unsupported(path: &Path, message: impl std::fmt::Display) -> EngineError {
    EngineError::Unsupported(bounded(format!("{}: {message}", shown_path(path))))
}

/// Reads and parses a JSON file of at most [`MAX_JSON_BYTES`]; `what` names it in messages.
fn read_json(path: &Path, what: &str) -> Result<Value> {
    let meta = std::fs::metadata(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            invalid(
                path,
                format!("missing: a Hugging Face model folder needs {what} here"),
            )
        } else {
            EngineError::Io {
                path: path.to_path_buf(),
                source: e,
            }
        }
    })?;
    if !meta.is_file() {
        return Err(invalid(path, "not a regular file"));
    }
    if meta.len() > MAX_JSON_BYTES {
        return Err(invalid(
            path,
            format!(
                "{} bytes, more than the {MAX_JSON_BYTES} a model folder's JSON file may have",
                meta.len()
            ),
        ));
    }
    let bytes = std::fs::read(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| invalid(path, format!("not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(invalid(
            path,
            format!("{}, expected a JSON object", describe(&value)),
        ));
    }
    Ok(value)
}

/// An optional JSON file: `Ok(None)` when it does not exist.
pub(crate) fn read_optional_json(path: &Path, what: &str) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    read_json(path, what).map(Some)
}

/// The layout of a `model_type: "minimind"` checkpoint, told apart by its config.json.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MiniMind {
    /// MiniMind-3 (2026-04): Qwen3's layout (q/k norms), `num_experts`, no shared experts.
    V3,
    /// MiniMind2 (2025): no q/k norms, `n_routed_experts` and `n_shared_experts`.
    V2,
}

impl MiniMind {
    fn name(self) -> &'static str {
        match self {
            MiniMind::V3 => "MiniMind-3",
            MiniMind::V2 => "MiniMind2",
        }
    }

    /// How the other layout differs, for messages.
    fn hint(self) -> &'static str {
        match self {
            MiniMind::V3 => {
                "q/k norms, `num_experts`; a MiniMind2 checkpoint has no q/k norms and its \
                 config.json has `n_routed_experts` / `n_shared_experts`"
            }
            MiniMind::V2 => {
                "no q/k norms, `n_routed_experts`, shared experts; a MiniMind-3 checkpoint has \
                 q/k norms and its config.json has `num_experts`"
            }
        }
    }
}

/// config.json's family, and for `minimind` its layout.
fn minimind_layout(cfg: &Json<'_>) -> Result<Option<MiniMind>> {
    if cfg.get("model_type").and_then(Value::as_str) != Some("minimind") {
        return Ok(None);
    }
    let v2_keys: Vec<&str> = ["n_routed_experts", "n_shared_experts"]
        .into_iter()
        .filter(|k| cfg.get(k).is_some())
        .collect();
    let v3_keys: Vec<&str> = ["num_experts", "head_dim", "moe_intermediate_size"]
        .into_iter()
        .filter(|k| cfg.get(k).is_some())
        .collect();
    match (v2_keys.is_empty(), v3_keys.is_empty()) {
        (false, false) => Err(cfg.err(format!(
            "a minimind config.json matches neither layout: it has MiniMind2's {} and \
             MiniMind-3's {}",
            v2_keys.join(", "),
            v3_keys.join(", ")
        ))),
        (false, true) => Ok(Some(MiniMind::V2)),
        _ => Ok(Some(MiniMind::V3)),
    }
}

/// A minimind config.json with MiniMind's defaults filled in where a key is absent
/// (`MiniMindConfig.__init__`'s `kwargs.get(key, default)` in jingyaogong/minimind
/// `model/model_minimind.py`, and its 2025 MiniMind2 signature), so the common parser reads it.
/// MiniMind sets `rope_scaling` itself (YaRN, factor 16 over 2048 positions, when
/// `inference_rope_scaling`), ignoring config.json's; applied only when
/// `max_position_embeddings` exceeds 2048, as its `precompute_freqs_cis` does.
fn minimind_config(cfg: &Json<'_>, layout: MiniMind) -> Result<Value> {
    let mut c = cfg.value.clone();
    let obj = c
        .as_object_mut()
        .ok_or_else(|| cfg.err("config.json is not a JSON object"))?;
    let mut default = |key: &str, v: Value| {
        if obj.get(key).is_none_or(Value::is_null) {
            obj.insert(key.to_string(), v);
        }
    };
    let v2 = layout == MiniMind::V2;
    default("hidden_size", json!(if v2 { 512 } else { 768 }));
    default("num_hidden_layers", json!(8));
    default("vocab_size", json!(6400));
    default("num_attention_heads", json!(8));
    default("num_key_value_heads", json!(if v2 { 2 } else { 4 }));
    default("max_position_embeddings", json!(32768));
    default("rms_norm_eps", json!(if v2 { 1e-5 } else { 1e-6 }));
    default("rope_theta", json!(1e6));
    default("hidden_act", json!("silu"));
    default("bos_token_id", json!(1));
    default("eos_token_id", json!(2));
    default("use_moe", json!(false));
    default("norm_topk_prob", json!(true));
    if v2 {
        default("num_experts_per_tok", json!(2));
        default("n_routed_experts", json!(4));
        default("n_shared_experts", json!(1));
    } else {
        default("tie_word_embeddings", json!(true));
        default("num_experts_per_tok", json!(1));
        default("num_experts", json!(4));
    }
    let probe = Json {
        path: cfg.path,
        value: &Value::Object(obj.clone()),
    };
    let hidden = probe.usize("hidden_size")?;
    let heads = probe.usize("num_attention_heads")?;
    let inference_rope_scaling = probe.opt_bool("inference_rope_scaling")?.unwrap_or(false);
    let max_pos = probe.usize("max_position_embeddings")?;
    if probe.get("intermediate_size").is_none() {
        // MiniMind-3: ceil(hidden * pi / 64) * 64; MiniMind2: 64 * ceil(int(hidden * 8 / 3) / 64).
        let inter = if v2 {
            (hidden * 8 / 3).div_ceil(64) * 64
        } else {
            (hidden as f64 * std::f64::consts::PI / 64.0).ceil() as usize * 64
        };
        obj.insert("intermediate_size".to_string(), json!(inter));
    }
    if v2 {
        // MiniMind2's attention always has head_dim = hidden / heads and ties the LM head.
        if hidden % heads != 0 {
            return Err(cfg.err(format!(
                "hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )));
        }
        obj.insert("head_dim".to_string(), json!(hidden / heads));
        obj.insert("tie_word_embeddings".to_string(), json!(true));
        if let Some(f) = probe.opt_str("scoring_func")? {
            if f != "softmax" {
                return Err(unsupported(
                    cfg.path,
                    format!(
                        "scoring_func {} (MiniMind2 implements only \"softmax\")",
                        quote(f.as_bytes())
                    ),
                ));
            }
        }
    } else if probe.get("moe_intermediate_size").is_none() {
        let inter = obj["intermediate_size"].clone();
        obj.insert("moe_intermediate_size".to_string(), inter);
    }
    obj.remove("rope_parameters");
    obj.remove("rope_scaling");
    if inference_rope_scaling && max_pos > 2048 {
        obj.insert(
            "rope_scaling".to_string(),
            json!({"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048,
                   "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}),
        );
    }
    Ok(c)
}

/// The [`ModelConfig`] of config.json (vocabulary size, special ids and weight dtype are
/// completed from the weights and the tokenizer).
fn model_config(cfg: &Json<'_>) -> Result<ModelConfig> {
    let model_type = match cfg.get("model_type") {
        Some(Value::String(s)) => s.as_str(),
        Some(v) => {
            return Err(cfg.err(format!(
                "field `model_type` is {}, expected a string",
                describe(v)
            )))
        }
        None => {
            return Err(cfg.err(format!(
                "missing field `model_type` (one of {})",
                SUPPORTED_MODEL_TYPES.join(", ")
            )))
        }
    };
    if !SUPPORTED_MODEL_TYPES.contains(&model_type) {
        return Err(unsupported(
            cfg.path,
            format!(
                "model_type {} is not supported; supported: {}",
                quote(model_type.as_bytes()),
                SUPPORTED_MODEL_TYPES.join(", ")
            ),
        ));
    }
    let minimind = minimind_layout(cfg)?;
    let normalized;
    let cfg = match minimind {
        Some(layout) => {
            normalized = minimind_config(cfg, layout)?;
            &Json {
                path: cfg.path,
                value: &normalized,
            }
        }
        None => cfg,
    };
    let hidden_size = cfg.usize("hidden_size")?;
    let ffn_size = cfg.usize("intermediate_size")?;
    let n_layer = cfg.usize("num_hidden_layers")?;
    let n_head = cfg.usize("num_attention_heads")?;
    // The defaults of the families' config classes: LlamaConfig `None` → the head count;
    // Qwen2Config and Qwen3Config 32 (configuration_qwen2.py / configuration_qwen3.py).
    // Qwen3MoeConfig 4 (configuration_qwen3_moe.py).
    let n_kv_head = cfg
        .opt_usize("num_key_value_heads")?
        .unwrap_or(match model_type {
            "llama" => n_head,
            "qwen3_moe" => 4,
            _ => 32,
        });
    let vocab_size = cfg.usize("vocab_size")?;
    let context_length = cfg.usize("max_position_embeddings")?;
    let rms_norm_eps = cfg
        .opt_f64("rms_norm_eps")?
        .ok_or_else(|| cfg.err("missing field `rms_norm_eps`"))?;
    if rms_norm_eps < 0.0 {
        return Err(cfg.err(format!("field `rms_norm_eps` is {rms_norm_eps}, negative")));
    }
    if n_head % n_kv_head != 0 {
        return Err(cfg.err(format!(
            "num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_kv_head}"
        )));
    }
    let head_dim = match cfg.opt_usize("head_dim")? {
        Some(d) => d,
        // Qwen3Config's default head_dim is 128, not hidden / heads.
        None if model_type == "qwen3" => 128,
        None => {
            if hidden_size % n_head != 0 {
                return Err(cfg.err(format!(
                    "hidden_size {hidden_size} is not a multiple of num_attention_heads {n_head} \
                     and no head_dim is given"
                )));
            }
            hidden_size / n_head
        }
    };
    if head_dim % 2 != 0 {
        return Err(cfg.err(format!(
            "head dimension {head_dim} is odd (RoPE rotates pairs)"
        )));
    }
    // Sizes whose product would overflow the tensors are refused before any allocation.
    for (what, a, b) in [
        ("num_attention_heads * head_dim", n_head, head_dim),
        ("vocab_size * hidden_size", vocab_size, hidden_size),
        ("intermediate_size * hidden_size", ffn_size, hidden_size),
    ] {
        if a.checked_mul(b).is_none_or(|p| p > (1usize << 40)) {
            return Err(cfg.err(format!("{what} = {a} * {b} is too large")));
        }
    }

    if let Some(act) = cfg.opt_str("hidden_act")? {
        if act != "silu" {
            return Err(unsupported(
                cfg.path,
                format!(
                    "hidden_act {} (only \"silu\", SwiGLU, is supported)",
                    quote(act.as_bytes())
                ),
            ));
        }
    }
    if cfg.opt_bool("mlp_bias")? == Some(true) {
        return Err(unsupported(cfg.path, "mlp_bias: true (MLP biases)"));
    }
    if cfg.opt_bool("use_sliding_window")? == Some(true) {
        return Err(unsupported(
            cfg.path,
            "use_sliding_window: true (sliding-window attention)",
        ));
    }
    if let Some(f) = cfg.opt_f64("partial_rotary_factor")? {
        if f != 1.0 {
            return Err(unsupported(
                cfg.path,
                format!("partial_rotary_factor {f} (partial RoPE)"),
            ));
        }
    }
    let attention_bias = cfg.opt_bool("attention_bias")?.unwrap_or(false);
    let (qkv_bias, o_bias, qk_norm) = match (model_type, minimind) {
        ("qwen2", _) => (true, false, false),
        ("qwen3" | "qwen3_moe", _) => (attention_bias, attention_bias, true),
        ("minimind", Some(MiniMind::V3)) => (false, false, true),
        ("minimind", _) => (false, false, false),
        _ => (attention_bias, attention_bias, false),
    };
    let moe = moe_config(cfg, model_type, minimind, n_layer, ffn_size, hidden_size)?;
    let rope = rope_config(cfg, context_length)?;
    let weight_dtype = cfg
        .opt_str("torch_dtype")?
        .or(cfg.opt_str("dtype")?)
        .unwrap_or("unknown")
        .to_string();
    Ok(ModelConfig {
        architecture: model_type.to_string(),
        vocab_size,
        hidden_size,
        n_layer,
        n_head,
        n_kv_head,
        head_dim,
        ffn_size,
        rms_norm_eps,
        rope,
        context_length,
        qkv_bias,
        o_bias,
        qk_norm,
        tie_word_embeddings: cfg.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        weight_dtype,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        moe,
    })
}

/// The MoE layers of config.json (`None` for a dense model):
/// - `qwen3_moe` (`Qwen3MoeConfig`, transformers `configuration_qwen3_moe.py`, and
///   `Qwen3MoeDecoderLayer`): `num_experts` (transformers 5.8: `num_local_experts`; default
///   128), `num_experts_per_tok` (8), `moe_intermediate_size` (768), `norm_topk_prob` (false),
///   `decoder_sparse_step` (1), `mlp_only_layers` ([]); layer `l` is MoE iff `l` is not in
///   `mlp_only_layers`, `num_experts > 0` and `(l + 1) % decoder_sparse_step == 0`;
/// - `minimind` with `use_moe`: every layer; MiniMind-3 `num_experts`, `num_experts_per_tok`,
///   `moe_intermediate_size`, `norm_topk_prob` (even for k = 1); MiniMind2 `n_routed_experts`,
///   `num_experts_per_tok`, `n_shared_experts`, experts of `intermediate_size`, and
///   `norm_topk_prob` only when k > 1.
fn moe_config(
    cfg: &Json<'_>,
    model_type: &str,
    minimind: Option<MiniMind>,
    n_layer: usize,
    ffn_size: usize,
    hidden_size: usize,
) -> Result<Option<MoeConfig>> {
    let count = |key: &str, default: usize| -> Result<usize> {
        match cfg.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| {
                    cfg.err(format!(
                        "field `{key}` is {}, expected a non-negative integer",
                        describe(v)
                    ))
                }),
        }
    };
    let check = |experts: usize, k: usize, inter: usize| -> Result<()> {
        if experts > nucleus_moe::MAX_EXPERT_NUM as usize {
            return Err(unsupported(
                cfg.path,
                format!(
                    "{experts} experts (at most {} are routed)",
                    nucleus_moe::MAX_EXPERT_NUM
                ),
            ));
        }
        if k == 0 || k > experts {
            let default = if cfg.get("num_experts_per_tok").is_none() {
                " (the default: config.json has no num_experts_per_tok)"
            } else {
                ""
            };
            return Err(cfg.err(format!(
                "num_experts_per_tok {k}{default} is outside 1..={experts} (the number of \
                 experts)"
            )));
        }
        if inter == 0 || inter.checked_mul(hidden_size).is_none_or(|p| p > 1 << 40) {
            return Err(cfg.err(format!(
                "the experts' intermediate size {inter} is 0 or too large"
            )));
        }
        Ok(())
    };
    match (model_type, minimind) {
        ("qwen3_moe", _) => {
            let experts = match (cfg.get("num_experts"), cfg.get("num_local_experts")) {
                (Some(_), Some(_)) => {
                    let (a, b) = (count("num_experts", 0)?, count("num_local_experts", 0)?);
                    if a != b {
                        return Err(cfg.err(format!(
                            "num_experts {a} and num_local_experts {b} disagree"
                        )));
                    }
                    a
                }
                (None, Some(_)) => count("num_local_experts", 0)?,
                _ => count("num_experts", 128)?,
            };
            let step = count("decoder_sparse_step", 1)?;
            if step == 0 {
                return Err(cfg.err("field `decoder_sparse_step` is 0"));
            }
            let mlp_only: Vec<usize> = match cfg.get("mlp_only_layers") {
                None => Vec::new(),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| {
                        v.as_u64()
                            .and_then(|v| usize::try_from(v).ok())
                            .filter(|&l| l < n_layer)
                            .ok_or_else(|| {
                                cfg.err(format!(
                                    "field `mlp_only_layers` holds {}, not a layer index below \
                                     num_hidden_layers {n_layer}",
                                    describe(v)
                                ))
                            })
                    })
                    .collect::<Result<_>>()?,
                Some(v) => {
                    return Err(cfg.err(format!(
                        "field `mlp_only_layers` is {}, expected an array of layer indices",
                        describe(v)
                    )))
                }
            };
            let moe_layers: Vec<usize> = (0..n_layer)
                .filter(|l| experts > 0 && !mlp_only.contains(l) && (l + 1) % step == 0)
                .collect();
            if moe_layers.is_empty() {
                return Ok(None);
            }
            let k = count("num_experts_per_tok", 8)?;
            let inter = count("moe_intermediate_size", 768)?;
            check(experts, k, inter)?;
            Ok(Some(MoeConfig {
                num_experts: experts,
                num_experts_per_tok: k,
                moe_intermediate_size: inter,
                norm_topk_prob: cfg.opt_bool("norm_topk_prob")?.unwrap_or(false),
                n_shared_experts: 0,
                shared_intermediate_size: 0,
                moe_layers,
            }))
        }
        (_, Some(layout)) => {
            if !cfg.opt_bool("use_moe")?.unwrap_or(false) {
                return Ok(None);
            }
            let k = count("num_experts_per_tok", 0)?;
            let norm = cfg.opt_bool("norm_topk_prob")?.unwrap_or(true);
            let (experts, inter, shared, norm) = match layout {
                MiniMind::V3 => (
                    count("num_experts", 0)?,
                    count("moe_intermediate_size", 0)?,
                    0,
                    norm,
                ),
                MiniMind::V2 => (
                    count("n_routed_experts", 0)?,
                    ffn_size,
                    count("n_shared_experts", 0)?,
                    norm && k > 1,
                ),
            };
            check(experts, k, inter)?;
            if shared > 64 {
                return Err(cfg.err(format!("n_shared_experts {shared} is more than 64")));
            }
            Ok(Some(MoeConfig {
                num_experts: experts,
                num_experts_per_tok: k,
                moe_intermediate_size: inter,
                norm_topk_prob: norm,
                n_shared_experts: shared,
                shared_intermediate_size: if shared > 0 { ffn_size } else { 0 },
                moe_layers: (0..n_layer).collect(),
            }))
        }
        _ => Ok(None),
    }
}

/// The RoPE of config.json: transformers 4's `rope_theta` + `rope_scaling`, or transformers 5's
/// `rope_parameters`.
fn rope_config(cfg: &Json<'_>, max_position_embeddings: usize) -> Result<RopeConfig> {
    let (params, field) = match (cfg.get("rope_parameters"), cfg.get("rope_scaling")) {
        (Some(p), _) => (Some(p), "rope_parameters"),
        (None, Some(s)) => (Some(s), "rope_scaling"),
        (None, None) => (None, "rope_scaling"),
    };
    if let Some(p) = params {
        if !p.is_object() {
            return Err(cfg.err(format!(
                "field `{field}` is {}, expected an object",
                describe(p)
            )));
        }
    }
    let theta = match params
        .and_then(|p| p.get("rope_theta"))
        .filter(|v| !v.is_null())
    {
        Some(_) => opt_f64_in(
            cfg,
            params.expect("checked"),
            "rope_theta",
            &format!("{field}.rope_theta"),
        )?,
        None => cfg.opt_f64("rope_theta")?,
    }
    .unwrap_or(10_000.0);
    if theta.is_nan() || theta <= 0.0 {
        return Err(cfg.err(format!("rope_theta is {theta}, not positive")));
    }
    let mut rope = RopeConfig::new(theta, RopeLayout::RotateHalf);
    let Some(p) = params else {
        return Ok(rope);
    };
    // transformers 5 may give one RoPE per layer type (`{"full_attention": {...}, ...}`):
    // hybrid-attention models, which these families are not.
    if let Some((key, _)) = p
        .as_object()
        .and_then(|o| o.iter().find(|(_, v)| v.is_object()))
    {
        return Err(unsupported(
            cfg.path,
            format!(
                "`{field}` holds one RoPE per layer type ({}: ...); these families have one",
                quote(key.as_bytes())
            ),
        ));
    }
    let rope_type = match p.get("rope_type").or_else(|| p.get("type")) {
        // Only the base given (transformers 5's `{"rope_theta": ...}`): default RoPE. Scaling
        // fields without a type are refused, as transformers refuses them.
        None | Some(Value::Null) => {
            let other = p
                .as_object()
                .and_then(|o| o.keys().find(|k| k.as_str() != "rope_theta"));
            if let Some(key) = other {
                return Err(cfg.err(format!(
                    "`{field}` has {} but no `rope_type` (or `type`)",
                    quote(key.as_bytes())
                )));
            }
            "default"
        }
        Some(Value::String(s)) => s.as_str(),
        Some(v) => {
            return Err(cfg.err(format!(
                "field `{field}.rope_type` is {}, expected a string",
                describe(v)
            )))
        }
    };
    let num = |key: &str| opt_f64_in(cfg, p, key, &format!("{field}.{key}"));
    let positive = |key: &str, v: Option<f64>| -> Result<f64> {
        match v {
            Some(v) if v > 0.0 => Ok(v),
            Some(v) => Err(cfg.err(format!("field `{field}.{key}` is {v}, not positive"))),
            None => Err(cfg.err(format!(
                "missing field `{field}.{key}` (needed by rope_type {rope_type:?})"
            ))),
        }
    };
    rope.scaling = match rope_type {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: positive("factor", num("factor")?)?,
        },
        "llama3" => {
            let low = positive("low_freq_factor", num("low_freq_factor")?)?;
            let high = positive("high_freq_factor", num("high_freq_factor")?)?;
            if high <= low {
                return Err(cfg.err(format!(
                    "{field}.high_freq_factor {high} is not above low_freq_factor {low}"
                )));
            }
            RopeScaling::Llama3 {
                factor: positive("factor", num("factor")?)?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: positive(
                    "original_max_position_embeddings",
                    num("original_max_position_embeddings")?,
                )?,
            }
        }
        "yarn" => {
            let original = match num("original_max_position_embeddings")? {
                Some(v) => positive("original_max_position_embeddings", Some(v))?,
                None => max_position_embeddings as f64,
            };
            // Required, as transformers' `_validate_yarn_parameters` requires it.
            let factor = positive("factor", num("factor")?)?;
            let attention_factor = match num("attention_factor")? {
                Some(a) => a,
                None => match (num("mscale")?, num("mscale_all_dim")?) {
                    (Some(m), Some(m_all)) if m != 0.0 && m_all != 0.0 => {
                        yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
                    }
                    _ => yarn_mscale(factor, 1.0),
                },
            };
            let truncate = match p.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(cfg.err(format!(
                        "field `{field}.truncate` is {}, expected true or false",
                        describe(v)
                    )))
                }
            };
            // transformers: `beta_fast or 32`, `beta_slow or 1` (0 also means the default).
            let beta = |key: &str, default: f64| -> Result<f64> {
                Ok(num(key)?.filter(|&b| b != 0.0).unwrap_or(default))
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: beta("beta_fast", 32.0)?,
                beta_slow: beta("beta_slow", 1.0)?,
                attention_factor,
                truncate,
            }
        }
        other => {
            return Err(unsupported(
                cfg.path,
                format!(
                    "{field}.rope_type {} is not supported (supported: default, linear, llama3, \
                     yarn)",
                    quote(other.as_bytes())
                ),
            ))
        }
    };
    Ok(rope)
}

/// The safetensors files of a folder, and the index that named them.
struct WeightFiles {
    files: Vec<PathBuf>,
    /// The file names of `files`, as the index writes them.
    names: Vec<String>,
    /// `model.safetensors.index.json`'s `weight_map` (tensor → file name), when sharded.
    index: Option<BTreeMap<String, String>>,
}

/// `model.safetensors` (preferred when both exist, as transformers prefers it), or the shards of
/// `model.safetensors.index.json`.
fn weight_files(dir: &Path) -> Result<WeightFiles> {
    let single = dir.join("model.safetensors");
    if regular_file(&single)? {
        return Ok(WeightFiles {
            files: vec![single],
            names: vec!["model.safetensors".to_string()],
            index: None,
        });
    }
    let index_path = dir.join("model.safetensors.index.json");
    if let Some(index) = read_optional_json(&index_path, "the shard index")? {
        let json = Json {
            path: &index_path,
            value: &index,
        };
        let map = match index.get("weight_map") {
            Some(Value::Object(map)) => map,
            Some(other) => {
                return Err(json.err(format!(
                    "`weight_map` is {}, expected an object (tensor name → shard file)",
                    describe(other)
                )))
            }
            None => return Err(json.err("missing object `weight_map` (tensor name → shard file)")),
        };
        let mut weight_map = BTreeMap::new();
        let mut files: Vec<PathBuf> = Vec::new();
        let mut names: Vec<String> = Vec::new();
        let mut seen = HashSet::new();
        for (tensor, file) in map {
            let Value::String(file) = file else {
                return Err(json.err(format!(
                    "weight_map[{}] is {}, expected a file name",
                    quote(tensor.as_bytes()),
                    describe(file)
                )));
            };
            // A shard is a file of this folder, never a path elsewhere.
            if file.contains('/') || file.contains('\\') || file == ".." || file.is_empty() {
                return Err(json.err(format!(
                    "weight_map[{}] names {}, not a file of this folder",
                    quote(tensor.as_bytes()),
                    quote(file.as_bytes())
                )));
            }
            if seen.insert(file.clone()) {
                let path = dir.join(file);
                if !regular_file(&path)? {
                    return Err(json.err(format!(
                        "weight_map names the shard {} (for tensor {}), which is missing",
                        quote(file.as_bytes()),
                        quote(tensor.as_bytes())
                    )));
                }
                files.push(path);
                names.push(file.clone());
            }
            weight_map.insert(tensor.clone(), file.clone());
        }
        if files.is_empty() {
            return Err(json.err("weight_map is empty"));
        }
        return Ok(WeightFiles {
            files,
            names,
            index: Some(weight_map),
        });
    }
    let other = [
        "pytorch_model.bin",
        "model.pt",
        "pytorch_model.bin.index.json",
    ]
    .into_iter()
    .find(|f| dir.join(f).exists());
    Err(invalid(
        dir,
        match other {
            Some(f) => format!(
                "no model.safetensors or model.safetensors.index.json (the weights); {f} is a \
                 PyTorch pickle, which nucleus does not read: convert it to safetensors"
            ),
            None => "no model.safetensors or model.safetensors.index.json: the folder has no \
                     weights"
                .to_string(),
        },
    ))
}

/// Whether `path` is a regular file (symbolic links followed): `Ok(false)` when it does not
/// exist, an error naming it when it is something else (a directory, a FIFO, a device), which
/// is never opened.
fn regular_file(path: &Path) -> Result<bool> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(true),
        Ok(m) => Err(invalid(
            path,
            format!(
                "not a regular file ({})",
                crate::hub::file_kind(&m.file_type())
            ),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(EngineError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Reads tensors by name with the shape and dtype checks of [`load_hf_folder`].
struct TensorReader<'a> {
    shards: &'a [MmapedSafetensors],
    files: &'a [PathBuf],
    /// Tensor name → index of its shard.
    routing: std::collections::HashMap<String, usize>,
    dir: &'a Path,
    index: Option<&'a BTreeMap<String, String>>,
    device: &'a Device,
    used: std::cell::RefCell<HashSet<String>>,
}

impl TensorReader<'_> {
    fn get(&self, name: &str) -> Option<safetensors::tensor::TensorView<'_>> {
        let shard = *self.routing.get(name)?;
        self.shards[shard].get(name).ok()
    }

    fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Reserves (and releases) the memory the weights will take, so that a checkpoint the
    /// machine cannot hold is an error before any tensor is read (an allocation failing
    /// inside candle would abort the process): every tensor the checkpoint routes at its
    /// stored size (matrices stay f16 / bf16; vectors become f32, at most twice their stored
    /// size, counted as 4 bytes per element), plus twice the largest tensor in its file's
    /// dtype (the read and the conversion's intermediate).
    fn check_memory(&self) -> Result<()> {
        let mut total: u64 = 0;
        let mut largest: u64 = 0;
        for (name, &shard) in &self.routing {
            let Ok(view) = self.shards[shard].get(name) else {
                continue;
            };
            let elems = view
                .shape()
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
                .unwrap_or(u64::MAX);
            let stored = elems.saturating_mul((view.dtype().bitsize() as u64).div_ceil(8));
            let kept = if view.shape().len() >= 2 {
                stored
            } else {
                elems.saturating_mul(4)
            };
            total = total.saturating_add(kept);
            largest = largest.max(stored.saturating_mul(2));
        }
        let bytes = total.saturating_add(largest);
        let fits = usize::try_from(bytes)
            .ok()
            .is_some_and(|b| Vec::<u8>::new().try_reserve_exact(b).is_ok());
        if !fits {
            return Err(EngineError::OutOfMemory {
                what: format!(
                    "the weights of {} ({} bytes) and one tensor's conversion",
                    shown_path(self.dir),
                    total
                ),
                bytes,
            });
        }
        Ok(())
    }

    /// The tensor `name` of shape `shape` as f32.
    fn read(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Ok(self.read_stored(name, shape)?.to_dtype(DType::F32)?)
    }

    /// The matrix `name` of shape `[rows, cols]` in its stored type ([`Weight::from_tensor`]:
    /// f16 and bf16 stay 16-bit).
    fn read_weight(&self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        Weight::from_tensor(self.read_stored(name, &[rows, cols])?)
    }

    /// The tensor `name` of shape `shape` in its stored dtype (f32, f16 or bf16).
    fn read_stored(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let view = self.get(name).ok_or_else(|| {
            let message = match self.index.and_then(|i| i.get(name)) {
                Some(file) => format!(
                    "missing tensor {}: model.safetensors.index.json puts it in {}, which does \
                     not hold it",
                    quote(name.as_bytes()),
                    quote(file.as_bytes())
                ),
                None => format!("missing tensor {}", quote(name.as_bytes())),
            };
            invalid(self.dir, message)
        })?;
        self.used.borrow_mut().insert(name.to_string());
        if view.shape() != shape {
            return Err(invalid(
                self.dir,
                format!(
                    "tensor {} has shape {:?}, expected {shape:?}",
                    quote(name.as_bytes()),
                    view.shape()
                ),
            ));
        }
        use safetensors::Dtype;
        if !matches!(view.dtype(), Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(invalid(
                self.dir,
                format!(
                    "tensor {} has dtype {:?}; f32, f16 and bf16 are supported",
                    quote(name.as_bytes()),
                    view.dtype()
                ),
            ));
        }
        let file = &self.files[self.routing[name]];
        view.load(self.device).map_err(|e| {
            invalid(
                file,
                format!("tensor {}: {}", quote(name.as_bytes()), candle_message(&e)),
            )
        })
    }

    fn linear(&self, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let weight = self.read_weight(&format!("{prefix}.weight"), out, inp)?;
        let bias = if bias {
            Some(self.read(&format!("{prefix}.bias"), &[out])?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// The checkpoint's tensors that were not read, sorted (`rotary_emb.inv_freq` buffers of
    /// older checkpoints left out: transformers recomputes them too).
    fn unused(&self) -> Vec<String> {
        let used = self.used.borrow();
        let mut unused: Vec<String> = self
            .routing
            .keys()
            .filter(|n| !used.contains(*n) && !n.ends_with("rotary_emb.inv_freq"))
            .cloned()
            .collect();
        unused.sort();
        unused
    }
}

/// Every weight of the model; completes `config.weight_dtype` from the embedding's dtype.
fn read_weights(r: &TensorReader<'_>, config: &mut ModelConfig) -> Result<Weights> {
    let c = config.clone();
    let embed_name = "model.embed_tokens.weight";
    if let Some(view) = r.get(embed_name) {
        config.weight_dtype = format!("{:?}", view.dtype()).to_lowercase();
    }
    let embed = r.read_weight(embed_name, c.vocab_size, c.hidden_size)?;
    let q_rows = c.n_head * c.head_dim;
    let kv_rows = c.n_kv_head * c.head_dim;
    let mut layers = Vec::with_capacity(c.n_layer.min(1024));
    for i in 0..c.n_layer {
        let p = format!("model.layers.{i}");
        let norm = |name: &str, len: usize| r.read(&format!("{p}.{name}.weight"), &[len]);
        let attn = format!("{p}.self_attn");
        let mlp = format!("{p}.mlp");
        layers.push(LayerWeights {
            attn_norm: norm("input_layernorm", c.hidden_size)?,
            q: r.linear(&format!("{attn}.q_proj"), q_rows, c.hidden_size, c.qkv_bias)?,
            k: r.linear(
                &format!("{attn}.k_proj"),
                kv_rows,
                c.hidden_size,
                c.qkv_bias,
            )?,
            v: r.linear(
                &format!("{attn}.v_proj"),
                kv_rows,
                c.hidden_size,
                c.qkv_bias,
            )?,
            o: r.linear(&format!("{attn}.o_proj"), c.hidden_size, q_rows, c.o_bias)?,
            q_norm: if c.qk_norm {
                Some(norm("self_attn.q_norm", c.head_dim)?)
            } else {
                None
            },
            k_norm: if c.qk_norm {
                Some(norm("self_attn.k_norm", c.head_dim)?)
            } else {
                None
            },
            ffn_norm: norm("post_attention_layernorm", c.hidden_size)?,
            ffn: match &c.moe {
                Some(moe) if moe.moe_layers.contains(&i) => {
                    FeedForward::Moe(read_moe(r, &mlp, moe, c.hidden_size)?)
                }
                _ => FeedForward::Dense(read_mlp(r, &mlp, c.ffn_size, c.hidden_size)?),
            },
        });
    }
    let norm = r.read("model.norm.weight", &[c.hidden_size])?;
    let lm_head = if c.tie_word_embeddings {
        // transformers ties the head to the embedding and ignores a saved copy.
        if r.has("lm_head.weight") {
            r.used.borrow_mut().insert("lm_head.weight".to_string());
        }
        None
    } else {
        Some(
            r.read_weight("lm_head.weight", c.vocab_size, c.hidden_size)
                .map_err(|e| match e {
                    EngineError::InvalidModel { path, message }
                        if message.starts_with("missing") =>
                    {
                        EngineError::InvalidModel {
                            path,
                            message: format!(
                                "{message} (config.json has tie_word_embeddings false or unset, \
                                 so the LM head is its own tensor)"
                            ),
                        }
                    }
                    other => other,
                })?,
        )
    };
    Ok(Weights {
        embed,
        layers,
        norm,
        lm_head,
    })
}

/// A dense SwiGLU block: `{prefix}.{gate,up,down}_proj.weight`.
fn read_mlp(r: &TensorReader<'_>, prefix: &str, inter: usize, hidden: usize) -> Result<Mlp> {
    Ok(Mlp {
        gate: r.linear(&format!("{prefix}.gate_proj"), inter, hidden, false)?,
        up: r.linear(&format!("{prefix}.up_proj"), inter, hidden, false)?,
        down: r.linear(&format!("{prefix}.down_proj"), hidden, inter, false)?,
    })
}

/// An MoE block under `prefix` (`model.layers.{i}.mlp`): the router `gate.weight` `[E, H]`;
/// the experts either per expert (`experts.{e}.{gate,up,down}_proj.weight`) or fused as newer
/// transformers saves them (`experts.gate_up_proj` `[E, 2I, H]`, rows `[0, I)` the gate and
/// `[I, 2I)` the up projection as `chunk(2)` splits them, and `experts.down_proj` `[E, H, I]`,
/// no `.weight` suffix: `Qwen3MoeExperts` in `modeling_qwen3_moe.py`); MiniMind2's shared
/// experts `shared_experts.{j}.{gate,up,down}_proj.weight`.
fn read_moe(
    r: &TensorReader<'_>,
    prefix: &str,
    moe: &MoeConfig,
    hidden: usize,
) -> Result<SparseMoe> {
    let (e, inter) = (moe.num_experts, moe.moe_intermediate_size);
    let router = r.linear(&format!("{prefix}.gate"), e, hidden, false)?;
    let linear = |t: Tensor| -> Result<Linear> {
        Ok(Linear {
            weight: Weight::from_tensor(t)?,
            bias: None,
        })
    };
    let fused = format!("{prefix}.experts.gate_up_proj");
    let fused_down = format!("{prefix}.experts.down_proj");
    for name in [&fused, &fused_down] {
        if r.has(&format!("{name}.weight")) {
            return Err(invalid(
                r.dir,
                format!(
                    "tensor {}: fused experts are named without the `.weight` suffix \
                     ({}, as transformers' Qwen3MoeExperts saves them)",
                    quote(format!("{name}.weight").as_bytes()),
                    quote(name.as_bytes())
                ),
            ));
        }
    }
    if r.has(&fused_down) && !r.has(&fused) {
        return Err(invalid(
            r.dir,
            format!(
                "missing tensor {}: the checkpoint has the fused {} but not the fused gate and \
                 up projections",
                quote(fused.as_bytes()),
                quote(fused_down.as_bytes())
            ),
        ));
    }
    let experts = if r.has(&fused) {
        let gate_up = r.read_stored(&fused, &[e, 2 * inter, hidden])?;
        let down = r.read_stored(&fused_down, &[e, hidden, inter])?;
        (0..e)
            .map(|x| -> Result<Mlp> {
                let gu = gate_up.get(x)?; // [2I, H]
                Ok(Mlp {
                    gate: linear(gu.narrow(0, 0, inter)?.contiguous()?)?,
                    up: linear(gu.narrow(0, inter, inter)?.contiguous()?)?,
                    down: linear(down.get(x)?.contiguous()?)?,
                })
            })
            .collect::<Result<Vec<_>>>()?
    } else {
        (0..e)
            .map(|x| read_mlp(r, &format!("{prefix}.experts.{x}"), inter, hidden))
            .collect::<Result<Vec<_>>>()?
    };
    let shared = (0..moe.n_shared_experts)
        .map(|j| {
            read_mlp(
                r,
                &format!("{prefix}.shared_experts.{j}"),
                moe.shared_intermediate_size,
                hidden,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(SparseMoe::from_parts(
        router,
        experts,
        shared,
        hidden,
        moe.num_experts_per_tok,
        moe.norm_topk_prob,
    ))
}

/// A special token of tokenizer_config.json (`"bos_token": "<s>"` or
/// `{"content": "<s>", ...}`), as its text.
fn special_token_text(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    }
}

/// `eos_token_id` as a list: a number or an array of numbers.
fn id_list(json: &Json<'_>, key: &str) -> Result<Option<Vec<u32>>> {
    let Some(v) = json.get(key) else {
        return Ok(None);
    };
    let one = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    let ids = match v {
        Value::Array(a) => a.iter().map(one).collect::<Option<Vec<u32>>>(),
        other => one(other).map(|id| vec![id]),
    };
    ids.map(Some).ok_or_else(|| {
        json.err(format!(
            "field `{key}` is {}, expected a token id or a list of them",
            describe(v)
        ))
    })
}

/// tokenizer.json with the post-processor transformers would use, and the special ids.
fn read_tokenizer(
    path: &Path,
    dir: &Path,
    cfg: &Json<'_>,
    vocab_size: Option<usize>,
) -> Result<ModelTokenizer> {
    let meta = std::fs::metadata(path).map_err(|_| {
        invalid(
            path,
            "missing: a Hugging Face model folder needs its tokenizer here (nucleus reads \
             tokenizer.json, not the slow tokenizer's files)",
        )
    })?;
    if !meta.is_file() {
        return Err(invalid(
            path,
            format!(
                "not a regular file ({})",
                crate::hub::file_kind(&meta.file_type())
            ),
        ));
    }
    if meta.len() > MAX_TOKENIZER_BYTES {
        return Err(invalid(
            path,
            format!(
                "{} bytes, more than the {MAX_TOKENIZER_BYTES} a tokenizer.json may have",
                meta.len()
            ),
        ));
    }
    let mut tokenizer = Tokenizer::from_file(path).map_err(|e| {
        invalid(
            path,
            format!("not a tokenizer the tokenizers crate reads: {e}"),
        )
    })?;
    let n_ids = tokenizer.get_vocab_size(true);
    let vocab_size = match vocab_size {
        Some(v) if n_ids > v => {
            return Err(invalid(
                path,
                format!(
                    "the tokenizer has {n_ids} ids but the embedding (model.embed_tokens.weight) \
                     has {v} rows"
                ),
            ))
        }
        Some(v) => v,
        None => n_ids,
    };

    let tc_path = dir.join("tokenizer_config.json");
    let tc_value = read_optional_json(&tc_path, "the tokenizer configuration")?;
    let null = Value::Null;
    let tc = Json {
        path: &tc_path,
        value: tc_value.as_ref().unwrap_or(&null),
    };
    let token_id = |json: &Json<'_>, key: &str| -> Result<Option<u32>> {
        match json.get(key) {
            None => Ok(None),
            Some(v) => {
                let text = special_token_text(v).ok_or_else(|| {
                    json.err(format!(
                        "field `{key}` is {}, expected a token",
                        describe(v)
                    ))
                })?;
                tokenizer.token_to_id(text).map(Some).ok_or_else(|| {
                    json.err(format!(
                        "`{key}` {} is not a token of tokenizer.json",
                        quote(text.as_bytes())
                    ))
                })
            }
        }
    };
    let bos = match id_list(cfg, "bos_token_id")? {
        Some(ids) => ids.first().copied(),
        None => token_id(&tc, "bos_token")?,
    };
    let gc_path = dir.join("generation_config.json");
    let gc_value = read_optional_json(&gc_path, "the generation configuration")?;
    let gc = Json {
        path: &gc_path,
        value: gc_value.as_ref().unwrap_or(&null),
    };
    // The end-of-generation set: every source, then llama.cpp's text list (see
    // ModelTokenizer::eos_token_ids).
    let mut eos_sources: Vec<(u32, &Path)> = Vec::new();
    for (json, from) in [(&gc, gc_path.as_path()), (cfg, cfg.path)] {
        for id in id_list(json, "eos_token_id")?.unwrap_or_default() {
            eos_sources.push((id, from));
        }
    }
    let tc_eos = token_id(&tc, "eos_token")?;
    let eos_first = tc_eos.or(eos_sources.first().map(|&(id, _)| id));
    eos_sources.extend(tc_eos.map(|id| (id, tc_path.as_path())));
    for (what, id, from) in bos.iter().map(|&id| ("bos_token_id", id, cfg.path)).chain(
        eos_sources
            .iter()
            .map(|&(id, from)| ("eos_token_id", id, from)),
    ) {
        if id as usize >= vocab_size {
            return Err(invalid(
                from,
                format!("{what} {id} is outside the vocabulary of {vocab_size} ids"),
            ));
        }
    }
    let eos: Vec<u32> = eos_sources
        .iter()
        .map(|&(id, _)| id)
        .chain(eog_ids_by_text(&tokenizer))
        .collect::<std::collections::BTreeSet<u32>>()
        .into_iter()
        .collect();

    let class = tc.opt_str("tokenizer_class")?.unwrap_or("");
    if matches!(class, "LlamaTokenizer" | "LlamaTokenizerFast") {
        let add_bos = tc.opt_bool("add_bos_token")?.unwrap_or(true);
        let add_eos = tc.opt_bool("add_eos_token")?.unwrap_or(false);
        // The tokenizer's own special tokens, as LlamaTokenizerFast's template uses them.
        let bos_one = token_id(&tc, "bos_token")?.or(bos);
        let eos_one = eos_first;
        let template = bos_eos_template(
            &|id| tokenizer.id_to_token(id),
            bos_one,
            eos_one,
            add_bos,
            add_eos,
        )
        .map_err(|e| invalid(&tc_path, e.to_string()))?;
        tokenizer.with_post_processor(template);
    }
    let add_bos_token = bos.is_some_and(|b| {
        tokenizer
            .encode("", true)
            .is_ok_and(|e| e.get_ids().first() == Some(&b))
    });
    Ok(ModelTokenizer {
        bos_token: bos.and_then(|id| tokenizer.id_to_token(id)),
        eos_token: eos_first.and_then(|id| tokenizer.id_to_token(id)),
        tokenizer,
        bos_token_id: bos,
        add_bos_token,
        eos_token_ids: eos,
        kind: TokenizerKind::HuggingFace,
        warnings: Vec::new(),
        plain: std::sync::OnceLock::new(),
    })
}
