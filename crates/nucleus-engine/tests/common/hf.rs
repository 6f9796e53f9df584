//! Tiny random Hugging Face checkpoints, written at run time (config.json, safetensors weights,
//! MiniMind's tokenizer.json from ../shared), and a slow f64 reference forward pass over the
//! same weights, written from transformers' modeling files (`modeling_llama.py`,
//! `modeling_qwen2.py`, `modeling_qwen3.py`) independently of nucleus' model code.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

/// Tensors by name: shape and f32 values, row-major.
pub type Weights = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// MiniMind's tokenizer folder in ../shared (6,400 ids).
pub fn minimind_tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/minimind-tokenizer")
}

/// Ids of MiniMind's tokenizer: the embedding of a test checkpoint has this many rows.
pub const VOCAB: usize = 6400;

/// A temporary model folder, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let path = super::temp_path(tag);
        std::fs::create_dir_all(&path).expect("create a temp dir");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A deterministic generator of uniform values in [-1, 1) (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((x >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

/// The tiny config of a family: 2 layers, hidden 64, 4 query heads, 2 kv heads, ffn 96, 128
/// positions. Qwen3 gets an explicit `head_dim` of 32 (not 64 / 4 = 16), as Qwen3-0.6B has 128
/// for hidden 1024 / 16 heads.
pub fn tiny_config(model_type: &str) -> Value {
    let mut c = json!({
        "model_type": model_type,
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32"
    });
    match model_type {
        "qwen2" => {
            c["sliding_window"] = json!(4096);
            c["max_window_layers"] = json!(2);
            c["use_sliding_window"] = json!(false);
        }
        "qwen3" => {
            c["head_dim"] = json!(32);
            c["attention_bias"] = json!(false);
            c["sliding_window"] = Value::Null;
            c["max_window_layers"] = json!(2);
            c["use_sliding_window"] = json!(false);
        }
        _ => {}
    }
    c
}

/// The tiny config of an MoE family: `qwen3_moe` (Qwen3's tiny config, 4 experts of width 48,
/// 2 per token, renormalised), `minimind` (MiniMind-3: q/k norms, 4 experts, 1 per token,
/// renormalised, tied), `minimind2` (`model_type` minimind with MiniMind2's fields: no q/k
/// norms, 4 routed experts of width `intermediate_size`, 2 per token, 1 shared expert).
pub fn tiny_moe_config(kind: &str) -> Value {
    match kind {
        "qwen3_moe" => {
            let mut c = tiny_config("qwen3");
            c["model_type"] = json!("qwen3_moe");
            c["num_experts"] = json!(4);
            c["num_experts_per_tok"] = json!(2);
            c["moe_intermediate_size"] = json!(48);
            c["norm_topk_prob"] = json!(true);
            c["decoder_sparse_step"] = json!(1);
            c["mlp_only_layers"] = json!([]);
            c
        }
        "minimind" => json!({
            "model_type": "minimind",
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "hidden_act": "silu",
            "tie_word_embeddings": true,
            "use_moe": true,
            "num_experts": 4,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 48,
            "norm_topk_prob": true,
            "flash_attn": true,
            "dropout": 0.0,
            "inference_rope_scaling": false,
            "bos_token_id": 1,
            "eos_token_id": 2
        }),
        "minimind2" => json!({
            "model_type": "minimind",
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "hidden_act": "silu",
            "use_moe": true,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "scoring_func": "softmax",
            "norm_topk_prob": true,
            "aux_loss_alpha": 0.01,
            "seq_aux": true,
            "flash_attn": true,
            "dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2
        }),
        other => panic!("no tiny MoE config {other}"),
    }
}

/// The MoE layout of a test config, by the families' own rules (transformers'
/// `Qwen3MoeDecoderLayer`, MiniMind's `MiniMindBlock`), written here apart from the loader.
pub struct RefMoe {
    pub experts: usize,
    pub k: usize,
    pub inter: usize,
    pub shared: usize,
    pub shared_inter: usize,
    /// Whether the k probabilities are divided by their sum.
    pub renorm: bool,
    /// Per layer: MoE or dense.
    pub is_moe: Vec<bool>,
}

/// Whether a config is MiniMind2's (its MoE fields are `n_routed_experts` / `n_shared_experts`).
pub fn is_minimind2(config: &Value) -> bool {
    config["model_type"] == "minimind" && config.get("n_routed_experts").is_some()
}

/// Whether q and k are RMS-normalised per head (Qwen3, Qwen3-MoE, MiniMind-3).
pub fn has_qk_norm(config: &Value) -> bool {
    match config["model_type"].as_str() {
        Some("qwen3" | "qwen3_moe") => true,
        Some("minimind") => !is_minimind2(config),
        _ => false,
    }
}

impl RefMoe {
    pub fn of(config: &Value) -> Option<Self> {
        let g = |k: &str| config[k].as_u64().map(|v| v as usize);
        let layers = g("num_hidden_layers").expect("layers");
        match config["model_type"].as_str()? {
            "qwen3_moe" => {
                let experts = g("num_experts")
                    .or(g("num_local_experts"))
                    .expect("experts");
                let step = g("decoder_sparse_step").unwrap_or(1);
                let only: Vec<usize> = config["mlp_only_layers"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|v| v.as_u64().expect("index") as usize)
                            .collect()
                    })
                    .unwrap_or_default();
                Some(Self {
                    experts,
                    k: g("num_experts_per_tok").expect("k"),
                    inter: g("moe_intermediate_size").expect("inter"),
                    shared: 0,
                    shared_inter: 0,
                    renorm: config["norm_topk_prob"].as_bool().unwrap_or(false),
                    is_moe: (0..layers)
                        .map(|l| experts > 0 && !only.contains(&l) && (l + 1) % step == 0)
                        .collect(),
                })
            }
            "minimind" if config["use_moe"].as_bool().unwrap_or(false) => {
                let k = g("num_experts_per_tok").expect("k");
                let norm = config["norm_topk_prob"].as_bool().unwrap_or(true);
                Some(if is_minimind2(config) {
                    let inter = g("intermediate_size").expect("inter");
                    Self {
                        experts: g("n_routed_experts").expect("experts"),
                        k,
                        inter,
                        shared: g("n_shared_experts").unwrap_or(1),
                        shared_inter: inter,
                        renorm: norm && k > 1,
                        is_moe: vec![true; layers],
                    }
                } else {
                    Self {
                        experts: g("num_experts").expect("experts"),
                        k,
                        inter: g("moe_intermediate_size").expect("inter"),
                        shared: 0,
                        shared_inter: 0,
                        renorm: norm,
                        is_moe: vec![true; layers],
                    }
                })
            }
            _ => None,
        }
    }
}

/// Whether the LM head is the embedding (MiniMind2 always ties it).
pub fn tied(config: &Value) -> bool {
    is_minimind2(config) || config["tie_word_embeddings"].as_bool().unwrap_or(false)
}

/// The sizes of a test config.json (kv heads and head_dim defaulted as LlamaConfig does).
pub struct Dims {
    pub hidden: usize,
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv: usize,
    pub head_dim: usize,
    pub vocab: usize,
}

impl Dims {
    pub fn of(config: &Value) -> Self {
        let g = |k: &str| config[k].as_u64().expect(k) as usize;
        let (hidden, heads) = (g("hidden_size"), g("num_attention_heads"));
        Self {
            hidden,
            ffn: g("intermediate_size"),
            layers: g("num_hidden_layers"),
            heads,
            kv: config["num_key_value_heads"]
                .as_u64()
                .map_or(heads, |v| v as usize),
            head_dim: config["head_dim"]
                .as_u64()
                .map_or(hidden / heads, |v| v as usize),
            vocab: g("vocab_size"),
        }
    }
}

/// The shapes of every tensor of a checkpoint of `config` (transformers' names).
pub fn tensor_shapes(config: &Value) -> Vec<(String, Vec<usize>)> {
    let Dims {
        hidden: h,
        ffn,
        layers,
        heads,
        kv,
        head_dim: hd,
        ..
    } = Dims::of(config);
    let model_type = config["model_type"].as_str().expect("model_type");
    let bias = config["attention_bias"].as_bool().unwrap_or(false);
    let (qkv_bias, o_bias) = match model_type {
        "qwen2" => (true, false),
        _ => (bias, bias),
    };
    let vocab = Dims::of(config).vocab;
    let mut t = vec![("model.embed_tokens.weight".to_string(), vec![vocab, h])];
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        t.push((format!("{p}.input_layernorm.weight"), vec![h]));
        t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        for (name, rows, cols, b) in [
            ("q_proj", heads * hd, h, qkv_bias),
            ("k_proj", kv * hd, h, qkv_bias),
            ("v_proj", kv * hd, h, qkv_bias),
            ("o_proj", h, heads * hd, o_bias),
        ] {
            t.push((format!("{p}.self_attn.{name}.weight"), vec![rows, cols]));
            if b {
                t.push((format!("{p}.self_attn.{name}.bias"), vec![rows]));
            }
        }
        if has_qk_norm(config) {
            t.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            t.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        }
        let mlp = |t: &mut Vec<(String, Vec<usize>)>, prefix: String, inter: usize| {
            t.push((format!("{prefix}.gate_proj.weight"), vec![inter, h]));
            t.push((format!("{prefix}.up_proj.weight"), vec![inter, h]));
            t.push((format!("{prefix}.down_proj.weight"), vec![h, inter]));
        };
        match RefMoe::of(config) {
            Some(moe) if moe.is_moe[i] => {
                t.push((format!("{p}.mlp.gate.weight"), vec![moe.experts, h]));
                for e in 0..moe.experts {
                    mlp(&mut t, format!("{p}.mlp.experts.{e}"), moe.inter);
                }
                for j in 0..moe.shared {
                    mlp(
                        &mut t,
                        format!("{p}.mlp.shared_experts.{j}"),
                        moe.shared_inter,
                    );
                }
            }
            _ => mlp(&mut t, format!("{p}.mlp"), ffn),
        }
    }
    t.push(("model.norm.weight".to_string(), vec![h]));
    if !tied(config) {
        t.push(("lm_head.weight".to_string(), vec![vocab, h]));
    }
    t
}

/// Random weights for `config`: matrices uniform in ±1/sqrt(in), norms 1 ± 0.2, biases ±0.1.
pub fn random_weights(config: &Value, seed: u64) -> Weights {
    let mut rng = Rng::new(seed);
    tensor_shapes(config)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let values = if name.ends_with("norm.weight") {
                rng.vec(n, 0.2).into_iter().map(|v| 1.0 + v).collect()
            } else if name.ends_with(".bias") {
                rng.vec(n, 0.1)
            } else {
                let fan_in = *shape.last().expect("2-D");
                rng.vec(n, 1.0 / (fan_in as f32).sqrt())
            };
            (name, (shape, values))
        })
        .collect()
}

/// Writes a model folder: config.json, the weights (in `dtype`, one file or `shards` files with
/// an index), MiniMind's tokenizer.json and tokenizer_config.json.
pub fn write_folder(
    dir: &Path,
    config: &Value,
    weights: &Weights,
    dtype: DType,
    shards: usize,
) -> anyhow::Result<()> {
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(config)?)?;
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let tensors: Vec<(String, Tensor)> = names
        .iter()
        .map(|name| {
            let (shape, values) = &weights[*name];
            let t = Tensor::from_vec(values.clone(), shape.as_slice(), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .expect("tensor");
            ((*name).clone(), t)
        })
        .collect();
    if shards <= 1 {
        let map: HashMap<String, Tensor> = tensors.into_iter().collect();
        candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    } else {
        let per = tensors.len().div_ceil(shards);
        let mut weight_map = serde_json::Map::new();
        for (s, chunk) in tensors.chunks(per).enumerate() {
            let file = format!("model-{:05}-of-{shards:05}.safetensors", s + 1);
            let map: HashMap<String, Tensor> = chunk.iter().cloned().collect();
            candle_core::safetensors::save(&map, dir.join(&file))?;
            for (name, _) in chunk {
                weight_map.insert(name.clone(), json!(file));
            }
        }
        let index = json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_vec_pretty(&index)?,
        )?;
    }
    let tok = minimind_tokenizer_dir();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tok.join(file), dir.join(file))?;
    }
    Ok(())
}

/// A random checkpoint of `config` in a fresh folder (f32, one file).
pub fn checkpoint(tag: &str, config: &Value, seed: u64) -> anyhow::Result<(TempDir, Weights)> {
    let dir = TempDir::new(tag);
    let weights = random_weights(config, seed);
    write_folder(&dir.0, config, &weights, DType::F32, 1)?;
    Ok((dir, weights))
}

/// Values of `weights` rounded through `dtype` (what a bf16 / f16 checkpoint holds).
pub fn rounded(weights: &Weights, dtype: DType) -> Weights {
    weights
        .iter()
        .map(|(name, (shape, values))| {
            let t = Tensor::from_vec(values.clone(), values.len(), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.to_vec1::<f32>())
                .expect("round");
            (name.clone(), (shape.clone(), t))
        })
        .collect()
}

/// The RoPE of the reference: inverse frequencies (f64) and the factor cos / sin are scaled by.
pub struct RefRope {
    pub inv_freq: Vec<f64>,
    pub attention_factor: f64,
}

impl RefRope {
    /// transformers' `_compute_default_rope_parameters`.
    pub fn default(theta: f64, head_dim: usize) -> Self {
        Self {
            inv_freq: (0..head_dim / 2)
                .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
                .collect(),
            attention_factor: 1.0,
        }
    }
}

/// The last position's logits of `tokens` (a whole causal prefill), in f64, by transformers'
/// formulas: RMSNorm `x / sqrt(mean(x²) + eps) * w`; q/k/v (+ biases), Qwen3's per-head q/k
/// RMSNorm, `apply_rotary_pos_emb` with `rotate_half` (cos/sin times the attention factor),
/// `repeat_kv`, softmax(q kᵀ / sqrt(head_dim)) causal, o_proj, SwiGLU `down(silu(gate) * up)`.
pub fn reference_logits(
    config: &Value,
    weights: &Weights,
    rope: &RefRope,
    tokens: &[u32],
) -> Vec<f32> {
    reference_logits_kv(config, weights, rope, tokens, false)
}

/// [`reference_logits`], with the keys (after RoPE) and values rounded to the nearest f16 when
/// `f16_kv` (what an f16 KV cache stores; the rest stays f64).
pub fn reference_logits_kv(
    config: &Value,
    weights: &Weights,
    rope: &RefRope,
    tokens: &[u32],
    f16_kv: bool,
) -> Vec<f32> {
    let kv_round = |x: Vec<f64>| -> Vec<f64> {
        if f16_kv {
            x.into_iter()
                .map(|v| f64::from(half::f16::from_f64(v).to_f32()))
                .collect()
        } else {
            x
        }
    };
    let Dims {
        hidden: h,
        layers,
        heads,
        kv,
        head_dim: hd,
        ..
    } = Dims::of(config);
    let eps = config["rms_norm_eps"].as_f64().expect("eps");
    let qk_norm = has_qk_norm(config);
    let moe = RefMoe::of(config);
    let w = |name: &str| -> Vec<f64> {
        weights
            .get(name)
            .unwrap_or_else(|| panic!("weight {name}"))
            .1
            .iter()
            .map(|&v| f64::from(v))
            .collect()
    };
    let has = |name: &str| weights.contains_key(name);
    let rms = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, w)| v * r * w).collect()
    };
    // y = W x + b, W [out, in] row-major.
    let linear = |x: &[f64], wt: &[f64], b: Option<Vec<f64>>| -> Vec<f64> {
        let inp = x.len();
        let out = wt.len() / inp;
        (0..out)
            .map(|o| {
                let dot: f64 = (0..inp).map(|i| wt[o * inp + i] * x[i]).sum();
                dot + b.as_ref().map_or(0.0, |b| b[o])
            })
            .collect()
    };
    let rotate = |x: &mut [f64], pos: usize| {
        let half = hd / 2;
        for i in 0..half {
            let angle = pos as f64 * rope.inv_freq[i];
            let (c, s) = (
                angle.cos() * rope.attention_factor,
                angle.sin() * rope.attention_factor,
            );
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        }
    };
    let embed = w("model.embed_tokens.weight");
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| embed[t as usize * h..(t as usize + 1) * h].to_vec())
        .collect();
    let n = tokens.len();
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        let bias = |name: &str| {
            let key = format!("{p}.self_attn.{name}.bias");
            has(&key).then(|| w(&key))
        };
        let (wq, wk, wv, wo) = (
            w(&format!("{p}.self_attn.q_proj.weight")),
            w(&format!("{p}.self_attn.k_proj.weight")),
            w(&format!("{p}.self_attn.v_proj.weight")),
            w(&format!("{p}.self_attn.o_proj.weight")),
        );
        let ln1 = w(&format!("{p}.input_layernorm.weight"));
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let hn = rms(x, &ln1);
            let mut q = linear(&hn, &wq, bias("q_proj"));
            let mut k = linear(&hn, &wk, bias("k_proj"));
            let v = linear(&hn, &wv, bias("v_proj"));
            for (t, heads_of, norm) in [(&mut q, heads, "q_norm"), (&mut k, kv, "k_norm")] {
                for head in 0..heads_of {
                    let slot = &mut t[head * hd..(head + 1) * hd];
                    if qk_norm {
                        let normed = rms(slot, &w(&format!("{p}.self_attn.{norm}.weight")));
                        slot.copy_from_slice(&normed);
                    }
                    rotate(slot, pos);
                }
            }
            qs.push(q);
            ks.push(kv_round(k));
            vs.push(kv_round(v));
        }
        let ln2 = w(&format!("{p}.post_attention_layernorm.weight"));
        // SwiGLU `down(silu(gate x) * up x)` of the expert under `prefix`.
        let swiglu = |prefix: &str, x: &[f64]| -> Vec<f64> {
            let gate = linear(x, &w(&format!("{prefix}.gate_proj.weight")), None);
            let up = linear(x, &w(&format!("{prefix}.up_proj.weight")), None);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            linear(&act, &w(&format!("{prefix}.down_proj.weight")), None)
        };
        let moe_layer = moe.as_ref().filter(|m| m.is_moe[l]);
        for i in 0..n {
            let mut attn = vec![0.0; heads * hd];
            for head in 0..heads {
                let kvh = head / (heads / kv);
                let q = &qs[i][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    let v = &vs[j][kvh * hd..(kvh + 1) * hd];
                    for d in 0..hd {
                        attn[head * hd + d] += ej / z * v[d];
                    }
                }
            }
            let o = linear(&attn, &wo, bias("o_proj"));
            let x: Vec<f64> = xs[i].iter().zip(&o).map(|(a, b)| a + b).collect();
            let hn = rms(&x, &ln2);
            let down = match moe_layer {
                None => swiglu(&format!("{p}.mlp"), &hn),
                Some(m) => {
                    // softmax(gate(x)) over the experts, the k largest, renormalised or not,
                    // each chosen expert weighted; shared experts added unweighted.
                    let logits = linear(&hn, &w(&format!("{p}.mlp.gate.weight")), None);
                    let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = logits.iter().map(|v| (v - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let mut order: Vec<usize> = (0..m.experts).collect();
                    order.sort_by(|&a, &b| e[b].partial_cmp(&e[a]).expect("finite"));
                    let chosen = &order[..m.k];
                    let total: f64 = chosen.iter().map(|&c| e[c] / z).sum();
                    let mut y = vec![0.0; h];
                    for &c in chosen {
                        let wgt = if m.renorm { e[c] / z / total } else { e[c] / z };
                        let out = swiglu(&format!("{p}.mlp.experts.{c}"), &hn);
                        for (yi, oi) in y.iter_mut().zip(&out) {
                            *yi += wgt * oi;
                        }
                    }
                    for j in 0..m.shared {
                        let out = swiglu(&format!("{p}.mlp.shared_experts.{j}"), &hn);
                        for (yi, oi) in y.iter_mut().zip(&out) {
                            *yi += oi;
                        }
                    }
                    y
                }
            };
            xs[i] = x.iter().zip(&down).map(|(a, b)| a + b).collect();
        }
        // Layer l is done for every position before layer l + 1 starts (the lists above were
        // computed from the previous layer's outputs).
    }
    let last = rms(&xs[n - 1], &w("model.norm.weight"));
    let head = if has("lm_head.weight") && !tied(config) {
        w("lm_head.weight")
    } else {
        embed
    };
    linear(&last, &head, None)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

/// Writes `weights` (a Hugging Face checkpoint of `config`) as a GGUF file of architecture
/// `arch` (`llama`, `qwen2`, `qwen3`) by llama.cpp's converter's rules
/// (`convert_hf_to_gguf.py`): tensor names mapped to `token_embd`, `blk.N.attn_q`, …;
/// q/k rows permuted into adjacent RoPE pairs for `llama` only (`LlamaModel.permute`);
/// `output.weight` only when the embeddings are not tied; the hyper-parameters under `arch.*`
/// (`attention.key_length` for the head dimension). Tensors are stored as `dtype` (F32, F16, or
/// a quantized type). The tokenizer is a `llama` SentencePiece vocabulary of `vocab` generic
/// pieces (the logits tests feed ids; BOS 1, EOS 2).
pub fn write_gguf(
    path: &Path,
    config: &Value,
    weights: &Weights,
    arch: &str,
    dtype: candle_core::quantized::GgmlDType,
) -> anyhow::Result<()> {
    use candle_core::quantized::gguf_file::{self, Value as G};
    use candle_core::quantized::QTensor;
    let d = Dims::of(config);
    let (h, layers, heads, vocab, kv, hd) =
        (d.hidden, d.layers, d.heads, d.vocab, d.kv, d.head_dim);
    // HF's rotate-half rows of each head (i, i + hd/2) become adjacent pairs (2i, 2i + 1).
    let permute = |values: &[f32], n_heads: usize| -> Vec<f32> {
        let cols = values.len() / (n_heads * hd);
        let mut out = vec![0f32; values.len()];
        for head in 0..n_heads {
            for j in 0..hd / 2 {
                for t in 0..2 {
                    let src = head * hd + t * (hd / 2) + j;
                    let dst = head * hd + 2 * j + t;
                    out[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&values[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    };
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    for name in names {
        let (shape, values) = &weights[name];
        if name.contains(".mlp.experts.") {
            continue; // stacked below
        }
        let mapped = if name == "model.embed_tokens.weight" {
            "token_embd.weight".to_string()
        } else if name == "model.norm.weight" {
            "output_norm.weight".to_string()
        } else if name == "lm_head.weight" {
            if config["tie_word_embeddings"].as_bool().unwrap_or(false) {
                continue;
            }
            "output.weight".to_string()
        } else {
            let rest = name.strip_prefix("model.layers.").expect("a layer tensor");
            let (i, rest) = rest.split_once('.').expect("layer index");
            let part = match rest.rsplit_once('.').expect("suffix").0 {
                "input_layernorm" => "attn_norm",
                "post_attention_layernorm" => "ffn_norm",
                "self_attn.q_proj" => "attn_q",
                "self_attn.k_proj" => "attn_k",
                "self_attn.v_proj" => "attn_v",
                "self_attn.o_proj" => "attn_output",
                "self_attn.q_norm" => "attn_q_norm",
                "self_attn.k_norm" => "attn_k_norm",
                "mlp.gate_proj" => "ffn_gate",
                "mlp.up_proj" => "ffn_up",
                "mlp.down_proj" => "ffn_down",
                "mlp.gate" => "ffn_gate_inp",
                other => panic!("unmapped {other}"),
            };
            let suffix = rest.rsplit_once('.').expect("suffix").1;
            format!("blk.{i}.{part}.{suffix}")
        };
        let values = if arch == "llama" && mapped.ends_with("attn_q.weight") {
            permute(values, heads)
        } else if arch == "llama" && mapped.ends_with("attn_k.weight") {
            permute(values, kv)
        } else {
            values.clone()
        };
        let t = Tensor::from_vec(values, shape.as_slice(), &Device::Cpu)?;
        // Norms and biases stay f32, as the converter keeps 1-D tensors in f32.
        let ty = if shape.len() == 1 {
            candle_core::quantized::GgmlDType::F32
        } else {
            dtype
        };
        tensors.push((mapped, QTensor::quantize(&t, ty)?));
    }
    // The converter stacks each MoE layer's experts into `ffn_{gate,up,down}_exps`
    // ([E, I, H], [E, I, H], [E, H, I] in candle's order; ggml ne reversed).
    let moe = RefMoe::of(config);
    if let Some(m) = &moe {
        for (l, _) in m.is_moe.iter().enumerate().filter(|(_, &b)| b) {
            for (hf, gg, rows, cols) in [
                ("gate_proj", "ffn_gate_exps", m.inter, h),
                ("up_proj", "ffn_up_exps", m.inter, h),
                ("down_proj", "ffn_down_exps", h, m.inter),
            ] {
                let mut stacked = Vec::with_capacity(m.experts * rows * cols);
                for e in 0..m.experts {
                    let key = format!("model.layers.{l}.mlp.experts.{e}.{hf}.weight");
                    stacked.extend_from_slice(&weights[&key].1);
                }
                let t = Tensor::from_vec(stacked, (m.experts, rows, cols), &Device::Cpu)?;
                tensors.push((
                    format!("blk.{l}.{gg}.weight"),
                    QTensor::quantize(&t, dtype)?,
                ));
            }
        }
    }
    let eps = config["rms_norm_eps"].as_f64().expect("eps") as f32;
    let theta = config["rope_theta"].as_f64().unwrap_or(10_000.0) as f32;
    let mut md: Vec<(String, G)> = vec![
        ("general.architecture".into(), G::String(arch.into())),
        (
            format!("{arch}.context_length"),
            G::U32(
                config["max_position_embeddings"]
                    .as_u64()
                    .expect("positions") as u32,
            ),
        ),
        (format!("{arch}.embedding_length"), G::U32(h as u32)),
        (format!("{arch}.block_count"), G::U32(layers as u32)),
        (format!("{arch}.attention.head_count"), G::U32(heads as u32)),
        (format!("{arch}.attention.head_count_kv"), G::U32(kv as u32)),
        (format!("{arch}.attention.key_length"), G::U32(hd as u32)),
        (format!("{arch}.attention.value_length"), G::U32(hd as u32)),
        (format!("{arch}.rope.dimension_count"), G::U32(hd as u32)),
        (format!("{arch}.rope.freq_base"), G::F32(theta)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            G::F32(eps),
        ),
        (format!("{arch}.feed_forward_length"), G::U32(d.ffn as u32)),
        ("tokenizer.ggml.model".into(), G::String("llama".into())),
        ("tokenizer.ggml.bos_token_id".into(), G::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), G::U32(2)),
    ];
    if let Some(m) = &moe {
        md.push((format!("{arch}.expert_count"), G::U32(m.experts as u32)));
        md.push((format!("{arch}.expert_used_count"), G::U32(m.k as u32)));
        md.push((
            format!("{arch}.expert_feed_forward_length"),
            G::U32(m.inter as u32),
        ));
    }
    let pieces: Vec<String> = (0..vocab)
        .map(|i| match i {
            0 => "<unk>".to_string(),
            1 => "<s>".to_string(),
            2 => "</s>".to_string(),
            3..=258 => format!("<0x{:02X}>", i - 3),
            _ => format!("\u{2581}w{i}"),
        })
        .collect();
    let types: Vec<G> = (0..vocab)
        .map(|i| {
            G::I32(match i {
                0 => 2,
                1 | 2 => 3,
                3..=258 => 6,
                _ => 1,
            })
        })
        .collect();
    md.push((
        "tokenizer.ggml.tokens".into(),
        G::Array(pieces.into_iter().map(G::String).collect()),
    ));
    md.push((
        "tokenizer.ggml.scores".into(),
        G::Array((0..vocab).map(|i| G::F32(-(i as f32))).collect()),
    ));
    md.push(("tokenizer.ggml.token_type".into(), G::Array(types)));
    let md_refs: Vec<(&str, &G)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(path)?;
    gguf_file::write(&mut file, &md_refs, &t_refs)?;
    Ok(())
}

/// The same checkpoint with each MoE layer's experts in the fused layout newer transformers
/// saves (`mlp.experts.gate_up_proj` `[E, 2I, H]`: rows `[0, I)` expert e's gate, `[I, 2I)`
/// its up; `mlp.experts.down_proj` `[E, H, I]`; no `.weight` suffix).
pub fn fused(config: &Value, weights: &Weights) -> Weights {
    let m = RefMoe::of(config).expect("an MoE config");
    let h = Dims::of(config).hidden;
    let mut out: Weights = weights
        .iter()
        .filter(|(k, _)| !k.contains(".mlp.experts."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (l, _) in m.is_moe.iter().enumerate().filter(|(_, &b)| b) {
        let p = format!("model.layers.{l}.mlp.experts");
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..m.experts {
            gate_up.extend_from_slice(&weights[&format!("{p}.{e}.gate_proj.weight")].1);
            gate_up.extend_from_slice(&weights[&format!("{p}.{e}.up_proj.weight")].1);
            down.extend_from_slice(&weights[&format!("{p}.{e}.down_proj.weight")].1);
        }
        out.insert(
            format!("{p}.gate_up_proj"),
            (vec![m.experts, 2 * m.inter, h], gate_up),
        );
        out.insert(
            format!("{p}.down_proj"),
            (vec![m.experts, h, m.inter], down),
        );
    }
    out
}
