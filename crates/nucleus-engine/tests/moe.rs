//! The MoE families on tiny random checkpoints written at run time: Qwen3-MoE against
//! candle-transformers' `qwen3_moe` and the f64 reference (tests/common/hf.rs, written from
//! `modeling_qwen3_moe.py` and MiniMind's `model_minimind.py`); what candle does not follow
//! (`mlp_only_layers`, `decoder_sparse_step`) against the reference alone; both MiniMind
//! layouts, dense and MoE; the fused expert layout; GGUF `qwen3moe` against the same weights as
//! a folder; each MoE block against the naive per-token loop; and typed errors for configs
//! and checkpoints that do not match.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::hf::{
    checkpoint, fused, random_weights, reference_logits, tiny_moe_config, write_folder, RefRope,
    Rng, TempDir, Weights,
};
use common::max_abs_diff;
use nucleus_engine::{
    load_hf_folder, load_model, CausalLm, EngineError, ExpertWeights, KvCache, SeqInput, SparseMoe,
};
use serde_json::{json, Value};

/// Logits of the same tokens through different code paths differ by f32 rounding only.
const TOL: f32 = 1e-4;

const PROMPT: [u32; 7] = [1, 345, 2001, 17, 6399, 88, 4000];
const DECODE: [u32; 4] = [9, 512, 3, 1234];

fn run(model: &dyn CausalLm, cache: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>> {
    let logits = model.forward(&mut [SeqInput { tokens, cache }])?;
    Ok(logits.squeeze(0)?.to_vec1()?)
}

/// A model's logits after the prompt (one prefill) and after each decoded token.
fn steps(model: &dyn CausalLm) -> Result<Vec<Vec<f32>>> {
    let mut cache = model.new_cache();
    let mut out = vec![run(model, &mut cache, &PROMPT)?];
    for t in DECODE {
        out.push(run(model, &mut cache, &[t])?);
    }
    Ok(out)
}

fn ours(path: &std::path::Path) -> Result<Vec<Vec<f32>>> {
    steps(&load_model(path, &Device::Cpu)?.model)
}

/// The f64 reference for the same steps (each a full prefill of the history).
fn reference(config: &Value, weights: &Weights, theta: f64, head_dim: usize) -> Vec<Vec<f32>> {
    let rope = RefRope::default(theta, head_dim);
    let mut history = PROMPT.to_vec();
    let mut out = vec![reference_logits(config, weights, &rope, &history)];
    for t in DECODE {
        history.push(t);
        out.push(reference_logits(config, weights, &rope, &history));
    }
    out
}

fn compare(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
    let mut worst = 0f32;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let d = max_abs_diff(x, y);
        assert!(d < TOL, "{what}, step {i}: max |diff| {d}");
        worst = worst.max(d);
    }
    println!("{what}: max |diff| over {} steps {worst:e}", a.len());
}

fn vb(dir: &std::path::Path) -> Result<VarBuilder<'static>> {
    let paths = [dir.join("model.safetensors")];
    Ok(unsafe { VarBuilder::from_mmaped_safetensors(&paths, DType::F32, &Device::Cpu)? })
}

/// candle-transformers' qwen3_moe, prefill then one token at a time.
fn candle_qwen3_moe(config: &Value, dir: &std::path::Path) -> Result<Vec<Vec<f32>>> {
    let cfg: candle_transformers::models::qwen3_moe::Config =
        serde_json::from_value(config.clone())?;
    let mut model = candle_transformers::models::qwen3_moe::ModelForCausalLM::new(&cfg, vb(dir)?)?;
    let input = |ids: &[u32]| Tensor::new(ids, &Device::Cpu).and_then(|t| t.unsqueeze(0));
    let flat = |t: Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
    let mut out = vec![flat(model.forward(&input(&PROMPT)?, 0)?)?];
    for (i, t) in DECODE.iter().enumerate() {
        out.push(flat(model.forward(&input(&[*t])?, PROMPT.len() + i)?)?);
    }
    Ok(out)
}

/// Qwen3-MoE with and without `norm_topk_prob`, tied and untied: candle-transformers'
/// `qwen3_moe` (which follows transformers where `mlp_only_layers` is empty and the dtype is
/// f32, as here) and the f64 reference.
#[test]
fn qwen3_moe_matches_candle_transformers_and_the_f64_reference() -> Result<()> {
    for (norm, tied) in [(true, false), (false, true)] {
        let mut config = tiny_moe_config("qwen3_moe");
        config["norm_topk_prob"] = json!(norm);
        config["tie_word_embeddings"] = json!(tied);
        let (dir, weights) = checkpoint("qwen3-moe", &config, 201)?;
        let loaded = load_hf_folder(&dir.0, &Device::Cpu)?;
        let moe = loaded.model.config().moe.clone().expect("an MoE model");
        assert_eq!(
            (
                moe.num_experts,
                moe.num_experts_per_tok,
                moe.moe_intermediate_size
            ),
            (4, 2, 48)
        );
        assert_eq!(
            (moe.norm_topk_prob, moe.moe_layers.clone()),
            (norm, vec![0, 1])
        );
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let ours = steps(&loaded.model)?;
        let what = format!("qwen3_moe (norm_topk_prob {norm}, tied {tied})");
        compare(
            &format!("{what} vs candle-transformers"),
            &ours,
            &candle_qwen3_moe(&config, &dir.0)?,
        );
        compare(
            &format!("{what} vs f64 reference"),
            &ours,
            &reference(&config, &weights, 10_000.0, 32),
        );
    }
    Ok(())
}

/// `mlp_only_layers` and `decoder_sparse_step` make some layers dense (candle-transformers
/// ignores `mlp_only_layers`: against the f64 reference, which follows
/// `Qwen3MoeDecoderLayer`); 3 layers, 8 experts, 3 per token.
#[test]
fn qwen3_moe_dense_layers_match_the_f64_reference() -> Result<()> {
    for (edit, moe_layers) in [
        (json!({"mlp_only_layers": [1]}), vec![0, 2]),
        (json!({"decoder_sparse_step": 2}), vec![1]),
        (
            json!({"decoder_sparse_step": 1, "mlp_only_layers": [0, 2]}),
            vec![1],
        ),
    ] {
        let mut config = tiny_moe_config("qwen3_moe");
        config["num_hidden_layers"] = json!(3);
        config["num_experts"] = json!(8);
        config["num_experts_per_tok"] = json!(3);
        for (k, v) in edit.as_object().expect("object") {
            config[k] = v.clone();
        }
        let (dir, weights) = checkpoint("qwen3-moe-dense", &config, 202)?;
        let loaded = load_hf_folder(&dir.0, &Device::Cpu)?;
        assert_eq!(
            loaded.model.config().moe.as_ref().expect("moe").moe_layers,
            moe_layers,
            "{edit}"
        );
        compare(
            &format!("qwen3_moe {edit} vs f64 reference"),
            &steps(&loaded.model)?,
            &reference(&config, &weights, 10_000.0, 32),
        );
    }
    Ok(())
}

/// The fused expert layout (`gate_up_proj`, `down_proj`) and transformers 5.8's
/// `num_local_experts` give exactly the logits of the per-expert checkpoint.
#[test]
fn qwen3_moe_fused_experts_and_num_local_experts_are_the_same_model() -> Result<()> {
    let config = tiny_moe_config("qwen3_moe");
    let (dir, weights) = checkpoint("qwen3-moe-per-expert", &config, 203)?;
    let expected = ours(&dir.0)?;

    let fused_dir = TempDir::new("qwen3-moe-fused");
    write_folder(
        &fused_dir.0,
        &config,
        &fused(&config, &weights),
        DType::F32,
        1,
    )?;
    let loaded = load_hf_folder(&fused_dir.0, &Device::Cpu)?;
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    assert_eq!(steps(&loaded.model)?, expected, "fused layout");

    let mut renamed = config.clone();
    let experts = renamed
        .as_object_mut()
        .expect("object")
        .remove("num_experts")
        .expect("num_experts");
    renamed["num_local_experts"] = experts;
    let renamed_dir = TempDir::new("qwen3-moe-local");
    write_folder(&renamed_dir.0, &renamed, &weights, DType::F32, 1)?;
    assert_eq!(ours(&renamed_dir.0)?, expected, "num_local_experts");

    // bf16 fused: the folder of the bf16-rounded weights.
    let bf16_dir = TempDir::new("qwen3-moe-fused-bf16");
    write_folder(
        &bf16_dir.0,
        &config,
        &fused(&config, &weights),
        DType::BF16,
        1,
    )?;
    let rounded_dir = TempDir::new("qwen3-moe-rounded");
    write_folder(
        &rounded_dir.0,
        &config,
        &common::hf::rounded(&weights, DType::BF16),
        DType::F32,
        1,
    )?;
    compare(
        "qwen3_moe fused bf16 vs rounded f32",
        &ours(&bf16_dir.0)?,
        &ours(&rounded_dir.0)?,
    );
    Ok(())
}

/// MiniMind-3 (q/k norms; k = 1 renormalised to weight 1 as its `+ 1e-20` code does, and
/// k = 2) and MiniMind2 (no q/k norms, shared expert, renormalised because k = 2; and k = 1,
/// not renormalised), MoE and dense, against the f64 reference from `model_minimind.py`.
#[test]
fn minimind_layouts_match_the_f64_reference() -> Result<()> {
    let cases: [(&str, Value, bool); 6] = [
        ("minimind", json!({}), true),
        ("minimind", json!({"num_experts_per_tok": 2}), true),
        ("minimind", json!({"use_moe": false}), true),
        ("minimind2", json!({}), false),
        ("minimind2", json!({"num_experts_per_tok": 1}), false),
        ("minimind2", json!({"use_moe": false}), false),
    ];
    for (i, (kind, edit, qk_norm)) in cases.into_iter().enumerate() {
        let mut config = tiny_moe_config(kind);
        for (k, v) in edit.as_object().expect("object") {
            config[k] = v.clone();
        }
        let (dir, weights) = checkpoint("minimind", &config, 210 + i as u64)?;
        let loaded = load_hf_folder(&dir.0, &Device::Cpu)?;
        let c = loaded.model.config();
        assert_eq!(c.architecture, "minimind");
        assert_eq!(c.qk_norm, qk_norm, "{kind} {edit}");
        assert!(c.tie_word_embeddings);
        let moe = c.moe.clone();
        if kind == "minimind2" && edit.get("use_moe").is_none() {
            let moe = moe.expect("moe");
            assert_eq!((moe.n_shared_experts, moe.moe_intermediate_size), (1, 96));
            assert_eq!(moe.norm_topk_prob, moe.num_experts_per_tok > 1);
        }
        compare(
            &format!("{kind} {edit} vs f64 reference"),
            &steps(&loaded.model)?,
            &reference(&config, &weights, 1e6, 16),
        );
    }
    Ok(())
}

/// A MiniMind-3 MoE checkpoint also loads as `qwen3_moe` (its tensor names are Qwen3's,
/// `scripts/convert_model.py`) and gives the same logits; so does the dense one as `qwen3`.
#[test]
fn minimind3_checkpoints_load_as_qwen3() -> Result<()> {
    for (use_moe, as_type) in [(true, "qwen3_moe"), (false, "qwen3")] {
        let mut config = tiny_moe_config("minimind");
        config["use_moe"] = json!(use_moe);
        config["num_experts_per_tok"] = json!(2);
        let (dir, weights) = checkpoint("minimind-as-qwen3", &config, 220)?;
        let mut converted = config.clone();
        converted["model_type"] = json!(as_type);
        if !use_moe {
            for key in [
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
            ] {
                converted.as_object_mut().expect("object").remove(key);
            }
        }
        let qwen = TempDir::new("converted");
        write_folder(&qwen.0, &converted, &weights, DType::F32, 1)?;
        assert_eq!(ours(&qwen.0)?, ours(&dir.0)?, "minimind as {as_type}");
    }
    Ok(())
}

fn load_err(dir: &std::path::Path) -> EngineError {
    match load_model(dir, &Device::Cpu) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e,
    }
}

fn invalid_message(e: EngineError) -> String {
    match e {
        EngineError::InvalidModel { message, .. } => message,
        other => panic!("expected InvalidModel, got {other:?}"),
    }
}

/// Configs that match neither MiniMind layout, checkpoints of the other layout, and broken MoE
/// fields are typed errors naming what is wrong or missing.
#[test]
fn mismatched_moe_configs_and_checkpoints_are_typed_errors() -> Result<()> {
    let with = |kind: &str, edit: Value, seed: u64| -> Result<(TempDir, Value, Weights)> {
        let mut config = tiny_moe_config(kind);
        for (k, v) in edit.as_object().expect("object") {
            config[k] = v.clone();
        }
        let weights = random_weights(&config, seed);
        let dir = TempDir::new("moe-broken");
        write_folder(&dir.0, &config, &weights, DType::F32, 1)?;
        Ok((dir, config, weights))
    };
    let rewrite = |dir: &TempDir, config: &Value| -> Result<()> {
        std::fs::write(dir.0.join("config.json"), serde_json::to_vec(config)?)?;
        Ok(())
    };

    // Both layouts' fields.
    let (dir, mut config, _) = with("minimind2", json!({}), 230)?;
    config["num_experts"] = json!(4);
    rewrite(&dir, &config)?;
    let m = invalid_message(load_err(&dir.0));
    assert!(
        m.contains("matches neither layout")
            && m.contains("n_routed_experts")
            && m.contains("num_experts"),
        "{m}"
    );

    // A MiniMind2 checkpoint under a MiniMind-3 config: the q/k norms are missing.
    let (dir, _, _) = with("minimind2", json!({}), 231)?;
    rewrite(&dir, &tiny_moe_config("minimind"))?;
    let m = invalid_message(load_err(&dir.0));
    assert!(
        m.contains("missing tensor `model.layers.0.self_attn.q_norm.weight`")
            && m.contains("MiniMind-3 layout"),
        "{m}"
    );

    // A MiniMind-3 dense checkpoint under a MiniMind2 dense config: its q/k norms are not part
    // of that layout.
    let (dir, _, _) = with("minimind", json!({"use_moe": false}), 232)?;
    let mut v2 = tiny_moe_config("minimind2");
    v2["use_moe"] = json!(false);
    rewrite(&dir, &v2)?;
    let m = invalid_message(load_err(&dir.0));
    assert!(
        m.contains("self_attn.k_norm.weight") && m.contains("not part of the MiniMind2 layout"),
        "{m}"
    );

    // A MiniMind2 MoE config without its shared expert's tensors.
    let (dir, mut config, _) = with("minimind2", json!({}), 233)?;
    config["n_shared_experts"] = json!(2);
    rewrite(&dir, &config)?;
    let m = invalid_message(load_err(&dir.0));
    assert!(
        m.contains("missing tensor `model.layers.0.mlp.shared_experts.1.gate_proj.weight`"),
        "{m}"
    );

    // Qwen3-MoE: k above E, a sparse step of 0, a layer index out of range, the two expert
    // counts disagreeing, an expert of the wrong shape, a missing fused down_proj.
    for (edit, needle) in [
        (
            json!({"num_experts_per_tok": 5}),
            "num_experts_per_tok 5 is outside 1..=4",
        ),
        (
            json!({"decoder_sparse_step": 0}),
            "`decoder_sparse_step` is 0",
        ),
        (json!({"mlp_only_layers": [7]}), "`mlp_only_layers` holds 7"),
        (
            json!({"num_local_experts": 8}),
            "num_experts 4 and num_local_experts 8 disagree",
        ),
        (
            json!({"moe_intermediate_size": 40}),
            "`model.layers.0.mlp.experts.0.gate_proj.weight` has shape [48, 64], expected [40, 64]",
        ),
    ] {
        let (dir, mut config, _) = with("qwen3_moe", json!({}), 234)?;
        for (k, v) in edit.as_object().expect("object") {
            config[k] = v.clone();
        }
        rewrite(&dir, &config)?;
        let m = invalid_message(load_err(&dir.0));
        assert!(m.contains(needle), "{edit}: {m}");
    }
    let config = tiny_moe_config("qwen3_moe");
    let all = fused(&config, &random_weights(&config, 235));
    // Fused tensors with a `.weight` suffix, and a fused down_proj without its gate_up_proj.
    let mut suffixed = all.clone();
    let v = suffixed
        .remove("model.layers.0.mlp.experts.gate_up_proj")
        .expect("fused");
    suffixed.insert("model.layers.0.mlp.experts.gate_up_proj.weight".into(), v);
    let dir = TempDir::new("fused-suffix");
    write_folder(&dir.0, &config, &suffixed, DType::F32, 1)?;
    let m = invalid_message(load_err(&dir.0));
    assert!(
        m.contains("fused experts are named without the `.weight` suffix"),
        "{m}"
    );
    let mut down_only = all.clone();
    down_only.remove("model.layers.0.mlp.experts.gate_up_proj");
    let dir = TempDir::new("fused-down-only");
    write_folder(&dir.0, &config, &down_only, DType::F32, 1)?;
    let m = invalid_message(load_err(&dir.0));
    assert!(
        m.contains("missing tensor `model.layers.0.mlp.experts.gate_up_proj`: the checkpoint has the fused"),
        "{m}"
    );
    let mut f = all;
    f.remove("model.layers.1.mlp.experts.down_proj");
    let dir = TempDir::new("fused-missing");
    write_folder(&dir.0, &config, &f, DType::F32, 1)?;
    let m = invalid_message(load_err(&dir.0));
    assert!(
        m.contains("missing tensor `model.layers.1.mlp.experts.down_proj`"),
        "{m}"
    );
    Ok(())
}

/// The same random weights as a Hugging Face folder and as a GGUF `qwen3moe` file (experts
/// stacked into `ffn_{gate,up,down}_exps`, router `ffn_gate_inp`, rotate-half kept) give the
/// same logits; f16, bf16 and q8_0 GGUF experts equal the folder of the weights rounded the
/// same way (each expert's quantized blocks split out of the 3-D tensor).
#[test]
fn qwen3moe_gguf_matches_the_hugging_face_folder() -> Result<()> {
    use candle_core::quantized::{GgmlDType, QTensor};
    let mut config = tiny_moe_config("qwen3_moe");
    // Row lengths (64, 96 and the experts' 64) are whole q8_0 blocks of 32.
    config["moe_intermediate_size"] = json!(64);
    let (dir, weights) = checkpoint("qwen3moe-gguf", &config, 240)?;
    let gguf = common::TempFile(common::temp_path("qwen3moe.gguf"));
    common::hf::write_gguf(&gguf.0, &config, &weights, "qwen3moe", GgmlDType::F32)?;
    let loaded = load_model(&gguf.0, &Device::Cpu)?;
    let c = loaded.model.config();
    assert_eq!(c.architecture, "qwen3moe");
    let moe = c.moe.clone().expect("moe");
    assert_eq!(
        (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob),
        (4, 2, true)
    );
    compare(
        "qwen3moe GGUF vs Hugging Face folder",
        &steps(&loaded.model)?,
        &ours(&dir.0)?,
    );

    // The folder of what a GGUF file of `dtype` holds: every matrix through `dtype` (experts
    // rounded as the writer stacks them, row by row, so per-expert blocks are the same), 1-D
    // tensors kept.
    let held = |dtype: GgmlDType, weights: &Weights| -> Result<Weights> {
        let mut held = weights.clone();
        for (shape, values) in held.values_mut() {
            if shape.len() == 2 {
                let t = Tensor::from_vec(values.clone(), shape.as_slice(), &Device::Cpu)?;
                *values = QTensor::quantize(&t, dtype)?
                    .dequantize(&Device::Cpu)?
                    .flatten_all()?
                    .to_vec1()?;
            }
        }
        Ok(held)
    };
    let folder_of = |w: &Weights| -> Result<Vec<Vec<f32>>> {
        let dir = TempDir::new("qwen3moe-held");
        write_folder(&dir.0, &config, w, DType::F32, 1)?;
        ours(&dir.0)
    };
    for dtype in [GgmlDType::F16, GgmlDType::BF16] {
        let path = common::TempFile(common::temp_path("qwen3moe-half.gguf"));
        common::hf::write_gguf(&path.0, &config, &weights, "qwen3moe", dtype)?;
        compare(
            &format!("qwen3moe GGUF {dtype:?} vs the folder of its values"),
            &ours(&path.0)?,
            &folder_of(&held(dtype, &weights)?)?,
        );
    }
    // q8_0: candle's quantized matmul also rounds the activations to q8 blocks (as llama.cpp
    // does), so the logits differ from the dequantized weights' by that rounding, not by f32
    // rounding: a tolerance of 0.1, which a wrong split of the experts exceeds (the same file
    // against the folder with layer 0's experts 0 and 1 swapped).
    let path = common::TempFile(common::temp_path("qwen3moe-q8.gguf"));
    common::hf::write_gguf(&path.0, &config, &weights, "qwen3moe", GgmlDType::Q8_0)?;
    let q8 = ours(&path.0)?;
    let exact = folder_of(&held(GgmlDType::Q8_0, &weights)?)?;
    let mut swapped = weights.clone();
    for part in ["gate_proj", "up_proj", "down_proj"] {
        let a = format!("model.layers.0.mlp.experts.0.{part}.weight");
        let b = format!("model.layers.0.mlp.experts.1.{part}.weight");
        let (va, vb) = (swapped[&a].clone(), swapped[&b].clone());
        swapped.insert(a, vb);
        swapped.insert(b, va);
    }
    let wrong = folder_of(&held(GgmlDType::Q8_0, &swapped)?)?;
    let worst = |x: &[Vec<f32>], y: &[Vec<f32>]| {
        x.iter()
            .zip(y)
            .map(|(a, b)| max_abs_diff(a, b))
            .fold(0f32, f32::max)
    };
    let (d, d_wrong) = (worst(&q8, &exact), worst(&q8, &wrong));
    println!(
        "qwen3moe GGUF Q8_0: max |diff| {d:e} to its values, {d_wrong:e} with two experts swapped"
    );
    assert!(
        d < 0.1 && d_wrong > 0.1,
        "q8_0: {d} to its values, {d_wrong} swapped"
    );
    Ok(())
}

/// A GGUF `qwen3moe` file whose expert tensors do not fit its metadata is a typed error.
#[test]
fn broken_qwen3moe_gguf_is_a_typed_error() -> Result<()> {
    use candle_core::quantized::GgmlDType;
    let mut config = tiny_moe_config("qwen3_moe");
    config["moe_intermediate_size"] = json!(64);
    let weights = random_weights(&config, 241);
    // Experts written with 3 experts' router but 4 experts' stacks: the router has the wrong
    // shape for expert_count.
    let mut three = weights.clone();
    for l in 0..2 {
        let (shape, values) = three
            .get_mut(&format!("model.layers.{l}.mlp.gate.weight"))
            .expect("router");
        shape[0] = 3;
        values.truncate(3 * 64);
    }
    let path = common::TempFile(common::temp_path("qwen3moe-bad.gguf"));
    common::hf::write_gguf(&path.0, &config, &three, "qwen3moe", GgmlDType::F32)?;
    let m = invalid_message(match load_model(&path.0, &Device::Cpu) {
        Ok(_) => panic!("loaded"),
        Err(e) => e,
    });
    assert!(
        m.contains("tensor `blk.0.ffn_gate_inp.weight` has shape [3, 64], expected [4, 64]"),
        "{m}"
    );
    Ok(())
}

/// One random SwiGLU expert `[inter, hidden]`.
fn expert(rng: &mut Rng, hidden: usize, inter: usize) -> Result<(ExpertWeights, [Vec<f32>; 3])> {
    let g = rng.vec(inter * hidden, 0.3);
    let u = rng.vec(inter * hidden, 0.3);
    let d = rng.vec(hidden * inter, 0.3);
    let t = |v: &[f32], r: usize, c: usize| Tensor::from_slice(v, (r, c), &Device::Cpu);
    Ok((
        ExpertWeights {
            gate: t(&g, inter, hidden)?,
            up: t(&u, inter, hidden)?,
            down: t(&d, hidden, inter)?,
        },
        [g, u, d],
    ))
}

/// `down(silu(gate x) * up x)` in f64.
fn swiglu(w: &[Vec<f32>; 3], x: &[f64], hidden: usize) -> Vec<f64> {
    let inter = w[0].len() / hidden;
    let dot = |m: &[f32], row: usize, v: &[f64]| -> f64 {
        v.iter()
            .enumerate()
            .map(|(i, x)| f64::from(m[row * v.len() + i]) * x)
            .sum()
    };
    let act: Vec<f64> = (0..inter)
        .map(|r| {
            let g = dot(&w[0], r, x);
            g / (1.0 + (-g).exp()) * dot(&w[1], r, x)
        })
        .collect();
    (0..hidden).map(|o| dot(&w[2], o, &act)).collect()
}

/// Each MoE block equals the naive per-token loop (for each token, for each of its k experts,
/// weight times the expert's output; plus shared experts) within 1e-5 of the largest absolute
/// output: E, k, renormalisation and shared experts varied, prefill-sized and one-row inputs,
/// and a block reused across calls (its buffers) gives the same as a fresh one.
#[test]
fn moe_blocks_equal_the_naive_per_token_loop() -> Result<()> {
    let hidden = 32;
    for (case, (e, k, renorm, shared, rows)) in [
        (4, 1, true, 0, 37),
        (4, 2, true, 0, 37),
        (8, 3, false, 0, 64),
        (4, 2, true, 1, 19),
        (16, 4, true, 2, 1),
        (6, 6, false, 0, 5),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = Rng::new(300 + case as u64);
        let router = rng.vec(e * hidden, 1.0);
        let mut experts = Vec::new();
        let mut raw = Vec::new();
        for i in 0..e {
            let (w, r) = expert(&mut rng, hidden, 24 + 8 * (i % 3))?;
            experts.push(w);
            raw.push(r);
        }
        let mut shared_w = Vec::new();
        let mut shared_raw = Vec::new();
        for _ in 0..shared {
            let (w, r) = expert(&mut rng, hidden, 40)?;
            shared_w.push(w);
            shared_raw.push(r);
        }
        let block = SparseMoe::new(
            Tensor::from_slice(&router, (e, hidden), &Device::Cpu)?,
            experts,
            shared_w,
            k,
            renorm,
        )?;
        let x = rng.vec(rows * hidden, 1.0);
        let mut scratch = nucleus_engine::models::MoeScratch::default();
        let input = Tensor::from_slice(&x, (rows, hidden), &Device::Cpu)?;
        // A first call on other rows fills the buffers; the second must not see them.
        let other = Tensor::from_slice(
            &rng.vec(3 * rows * hidden, 1.0),
            (3 * rows, hidden),
            &Device::Cpu,
        )?;
        block.forward_with(&other, &mut scratch)?;
        let y: Vec<f32> = block
            .forward_with(&input, &mut scratch)?
            .flatten_all()?
            .to_vec1()?;
        assert_eq!(
            y,
            block.forward(&input)?.flatten_all()?.to_vec1::<f32>()?,
            "case {case}: reused buffers"
        );

        let mut naive = vec![0f64; rows * hidden];
        for t in 0..rows {
            let xt: Vec<f64> = x[t * hidden..(t + 1) * hidden]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let logits: Vec<f64> = (0..e)
                .map(|r| {
                    (0..hidden)
                        .map(|i| f64::from(router[r * hidden + i]) * xt[i])
                        .sum()
                })
                .collect();
            let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
            let z: f64 = p.iter().sum();
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).expect("finite"));
            let top = &order[..k];
            let sum: f64 = top.iter().map(|&i| p[i] / z).sum();
            let out = &mut naive[t * hidden..(t + 1) * hidden];
            for &i in top {
                let w = if renorm { p[i] / z / sum } else { p[i] / z };
                for (o, v) in out.iter_mut().zip(swiglu(&raw[i], &xt, hidden)) {
                    *o += w * v;
                }
            }
            for s in &shared_raw {
                for (o, v) in out.iter_mut().zip(swiglu(s, &xt, hidden)) {
                    *o += v;
                }
            }
        }
        let largest = naive.iter().fold(0f64, |m, v| m.max(v.abs()));
        let worst = y
            .iter()
            .zip(&naive)
            .fold(0f64, |m, (a, b)| m.max((f64::from(*a) - b).abs()));
        assert!(
            worst <= 1e-5 * largest,
            "case {case}: max |diff| {worst:e}, largest output {largest:e}"
        );
        println!("case {case} (E {e}, k {k}, renorm {renorm}, shared {shared}, rows {rows}): max |diff| {worst:e} of {largest:e}");
    }
    Ok(())
}

/// Bad blocks are typed errors, not panics.
#[test]
fn moe_block_arguments_are_checked() -> Result<()> {
    let mut rng = Rng::new(9);
    let router = Tensor::from_slice(&rng.vec(4 * 8, 1.0), (4, 8), &Device::Cpu)?;
    let experts = |n: usize, rng: &mut Rng| -> Result<Vec<ExpertWeights>> {
        (0..n).map(|_| Ok(expert(rng, 8, 4)?.0)).collect()
    };
    let e3 = experts(3, &mut rng)?;
    assert!(matches!(
        SparseMoe::new(router.clone(), e3, vec![], 1, true),
        Err(EngineError::InvalidRequest(m)) if m.contains("4 rows but 3 experts")
    ));
    let e4 = experts(4, &mut rng)?;
    assert!(matches!(
        SparseMoe::new(router.clone(), e4.clone(), vec![], 5, true),
        Err(EngineError::InvalidRequest(m)) if m.contains("k = 5")
    ));
    let wide = expert(&mut rng, 16, 4)?.0;
    assert!(matches!(
        SparseMoe::new(router.clone(), e4.clone(), vec![wide], 2, true),
        Err(EngineError::InvalidRequest(m)) if m.contains("shared expert 0")
    ));
    let block = SparseMoe::new(router, e4, vec![], 2, true)?;
    let rows = Tensor::zeros((2, 16), DType::F32, &Device::Cpu)?;
    assert!(matches!(
        block.forward(&rows),
        Err(EngineError::InvalidRequest(m)) if m.contains("width 16, expected 8")
    ));
    // Rows whose router logits are not numbers are routed nowhere and come out NaN; the other
    // rows are what they are alone.
    let mut rows = rng.vec(3 * 8, 1.0);
    rows[8..16].fill(f32::NAN);
    rows[16] = f32::INFINITY;
    let out: Vec<f32> = block
        .forward(&Tensor::from_slice(&rows, (3, 8), &Device::Cpu)?)?
        .flatten_all()?
        .to_vec1()?;
    assert!(out[8..].iter().all(|v| v.is_nan()), "{out:?}");
    let alone: Vec<f32> = block
        .forward(&Tensor::from_slice(&rows[..8], (1, 8), &Device::Cpu)?)?
        .flatten_all()?
        .to_vec1()?;
    assert_eq!(&out[..8], &alone[..]);
    // The routing buffers are sized before any is allocated.
    assert_eq!(
        nucleus_engine::moe_routing_bytes(usize::MAX, 8, 4, 2, 4),
        None
    );
    assert_eq!(
        nucleus_engine::moe_routing_bytes(10, 8, 4, 2, 4),
        Some(10 * 4 * (2 * 4 + 3 * 8 + 2 * (3 * 8 + 3 * 4 + 4)))
    );
    Ok(())
}

/// A token whose embedding is NaN poisons its own sequence only: in a batch, the other
/// sequences' logits are what they are alone, and the poisoned one's are NaN (which the
/// sampler refuses for that request), as in a dense model.
#[test]
fn a_nan_in_one_sequence_leaves_the_others_of_the_batch_alone() -> Result<()> {
    let mut config = tiny_moe_config("qwen3_moe");
    config["tie_word_embeddings"] = json!(false);
    let mut weights = random_weights(&config, 270);
    let (_, embed) = weights
        .get_mut("model.embed_tokens.weight")
        .expect("embedding");
    embed[42 * 64..43 * 64].fill(f32::NAN);
    let dir = TempDir::new("qwen3-moe-nan");
    write_folder(&dir.0, &config, &weights, DType::F32, 1)?;
    let model = load_hf_folder(&dir.0, &Device::Cpu)?.model;
    let healthy = run(&model, &mut model.new_cache(), &PROMPT)?;
    let mut caches = [model.new_cache(), model.new_cache()];
    let [a, b] = &mut caches;
    let logits = model.forward(&mut [
        SeqInput {
            tokens: &PROMPT,
            cache: a,
        },
        SeqInput {
            tokens: &[5, 42, 7],
            cache: b,
        },
    ])?;
    let first: Vec<f32> = logits.get(0)?.to_vec1()?;
    let second: Vec<f32> = logits.get(1)?.to_vec1()?;
    assert!(max_abs_diff(&first, &healthy) < TOL);
    assert!(second.iter().all(|v| v.is_nan()));
    Ok(())
}

/// A Qwen3-MoE sequence's logits are the same run alone and in a batch with others (prefill
/// and decode mixed), up to f32 rounding: routing is per token, whatever the other rows.
#[test]
fn moe_batches_agree_with_sequences_alone() -> Result<()> {
    let config = tiny_moe_config("qwen3_moe");
    let (dir, _) = checkpoint("qwen3-moe-batch", &config, 250)?;
    let model = load_hf_folder(&dir.0, &Device::Cpu)?.model;
    let prompts: [&[u32]; 3] = [&PROMPT, &[5, 6, 7], &[42]];
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| run(&model, &mut model.new_cache(), p))
        .collect::<Result<_>>()?;
    let mut caches: Vec<KvCache> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut batch: Vec<SeqInput<'_>> = prompts
        .iter()
        .zip(caches.iter_mut())
        .map(|(tokens, cache)| SeqInput { tokens, cache })
        .collect();
    let logits = model.forward(&mut batch)?;
    for (i, solo) in alone.iter().enumerate() {
        let row: Vec<f32> = logits.get(i)?.to_vec1()?;
        let d = max_abs_diff(&row, solo);
        assert!(d < TOL, "sequence {i}: batched vs alone {d}");
    }
    Ok(())
}

/// k-quant experts (blocks of 256 values, 144 / 210 bytes) are split per expert too: a GGUF
/// `qwen3moe` of Q4K and of Q6K tensors is close to the folder of its dequantized values
/// (activations are rounded to q8 blocks by the quantized matmul, so not within f32 rounding)
/// and far from the folder with layer 0's experts 1 and 2 swapped. Sizes are whole blocks:
/// hidden 256, experts of width 256, 4 heads of 64.
#[test]
fn qwen3moe_gguf_k_quant_experts_are_split_per_expert() -> Result<()> {
    use candle_core::quantized::{GgmlDType, QTensor};
    let mut config = tiny_moe_config("qwen3_moe");
    config["hidden_size"] = json!(256);
    config["intermediate_size"] = json!(256);
    config["moe_intermediate_size"] = json!(256);
    config["head_dim"] = json!(64);
    let weights = random_weights(&config, 260);
    let folder_of = |w: &Weights, dtype: GgmlDType| -> Result<Vec<Vec<f32>>> {
        let mut held = w.clone();
        for (shape, values) in held.values_mut() {
            if shape.len() == 2 {
                let t = Tensor::from_vec(values.clone(), shape.as_slice(), &Device::Cpu)?;
                *values = QTensor::quantize(&t, dtype)?
                    .dequantize(&Device::Cpu)?
                    .flatten_all()?
                    .to_vec1()?;
            }
        }
        let dir = TempDir::new("qwen3moe-kq");
        write_folder(&dir.0, &config, &held, DType::F32, 1)?;
        ours(&dir.0)
    };
    let mut swapped = weights.clone();
    for part in ["gate_proj", "up_proj", "down_proj"] {
        let a = format!("model.layers.0.mlp.experts.1.{part}.weight");
        let b = format!("model.layers.0.mlp.experts.2.{part}.weight");
        let (va, vb) = (swapped[&a].clone(), swapped[&b].clone());
        swapped.insert(a, vb);
        swapped.insert(b, va);
    }
    let worst = |x: &[Vec<f32>], y: &[Vec<f32>]| {
        x.iter()
            .zip(y)
            .map(|(a, b)| max_abs_diff(a, b))
            .fold(0f32, f32::max)
    };
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
        let path = common::TempFile(common::temp_path("qwen3moe-kq.gguf"));
        common::hf::write_gguf(&path.0, &config, &weights, "qwen3moe", dtype)?;
        let from_gguf = ours(&path.0)?;
        let d = worst(&from_gguf, &folder_of(&weights, dtype)?);
        let d_wrong = worst(&from_gguf, &folder_of(&swapped, dtype)?);
        println!("qwen3moe GGUF {dtype:?}: max |diff| {d:e} to its values, {d_wrong:e} with two experts swapped");
        assert!(
            d < 0.1 && d_wrong > 3.0 * d,
            "{dtype:?}: {d} to its values, {d_wrong} swapped"
        );
    }
    Ok(())
}
