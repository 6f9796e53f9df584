//! Hugging Face folders on tiny random checkpoints written at run time: logits against
//! candle-transformers' `llama`, `qwen2` and `qwen3` on the same weights and against a slow f64
//! reference (tests/common/hf.rs), prefill against token-by-token, solo against a batch of 8,
//! RoPE scaling, both transformers spellings of the config, dtypes, shards, special ids, and a
//! typed error for each broken folder.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::hf::{
    checkpoint, random_weights, reference_logits, rounded, tiny_config, write_folder, RefRope,
    TempDir, VOCAB,
};
use common::max_abs_diff;
use nucleus_engine::{load_hf_folder, load_model, CausalLm, EngineError, KvCache, SeqInput};
use serde_json::{json, Value};

/// Logits of the same tokens through different code paths differ by f32 rounding only.
const TOL: f32 = 1e-4;

/// A prompt of MiniMind ids and the ids decoded after it, fixed (not sampled: every path sees
/// the same tokens).
const PROMPT: [u32; 7] = [1, 345, 2001, 17, 6399, 88, 4000];
const DECODE: [u32; 5] = [9, 512, 3, 1234, 6000];

fn run(model: &dyn CausalLm, cache: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>> {
    let logits = model.forward(&mut [SeqInput { tokens, cache }])?;
    assert_eq!(logits.dims(), [1, model.config().vocab_size]);
    Ok(logits.squeeze(0)?.to_vec1()?)
}

/// Our logits after the prompt and after each decoded token.
fn ours(dir: &std::path::Path) -> Result<Vec<Vec<f32>>> {
    let loaded = load_hf_folder(dir, &Device::Cpu)?;
    let model = &loaded.model;
    let mut cache = model.new_cache();
    let mut out = vec![run(model, &mut cache, &PROMPT)?];
    for t in DECODE {
        out.push(run(model, &mut cache, &[t])?);
    }
    Ok(out)
}

/// A candle-transformers model's logits, the same way: prefill then one token at a time.
fn theirs(
    mut step: impl FnMut(&Tensor, usize) -> candle_core::Result<Tensor>,
) -> Result<Vec<Vec<f32>>> {
    let input = |ids: &[u32]| Tensor::new(ids, &Device::Cpu).and_then(|t| t.unsqueeze(0));
    let flat = |t: Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
    let mut out = vec![flat(step(&input(&PROMPT)?, 0)?)?];
    for (i, t) in DECODE.iter().enumerate() {
        out.push(flat(step(&input(&[*t])?, PROMPT.len() + i)?)?);
    }
    Ok(out)
}

fn compare(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let mut worst = 0f32;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let d = max_abs_diff(x, y);
        assert!(d < TOL, "{what}, step {i}: max |diff| {d}");
        worst = worst.max(d);
    }
    println!("{what}: max |diff| over {} steps {worst:e}", a.len());
    worst
}

fn vb(dir: &std::path::Path, files: &[&str]) -> Result<VarBuilder<'static>> {
    let paths: Vec<_> = files.iter().map(|f| dir.join(f)).collect();
    Ok(unsafe { VarBuilder::from_mmaped_safetensors(&paths, DType::F32, &Device::Cpu)? })
}

/// The f64 reference's logits for the same steps (each step a full prefill of the history).
fn reference(config: &Value, weights: &common::hf::Weights, rope: &RefRope) -> Vec<Vec<f32>> {
    let mut history = PROMPT.to_vec();
    let mut out = vec![reference_logits(config, weights, rope, &history)];
    for t in DECODE {
        history.push(t);
        out.push(reference_logits(config, weights, rope, &history));
    }
    out
}

#[test]
fn llama_matches_candle_transformers_and_the_f64_reference() -> Result<()> {
    for tied in [false, true] {
        let mut config = tiny_config("llama");
        config["tie_word_embeddings"] = json!(tied);
        let (dir, weights) = checkpoint("llama", &config, 11)?;
        let ours = ours(&dir.0)?;
        let cfg = serde_json::from_value::<candle_transformers::models::llama::LlamaConfig>(
            config.clone(),
        )?
        .into_config(false);
        let model = candle_transformers::models::llama::Llama::load(
            vb(&dir.0, &["model.safetensors"])?,
            &cfg,
        )?;
        let mut cache =
            candle_transformers::models::llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu)?;
        let theirs = theirs(|x, pos| model.forward(x, pos, &mut cache))?;
        compare(
            &format!("llama (tied {tied}) vs candle-transformers"),
            &ours,
            &theirs,
        );
        let rope = RefRope::default(10_000.0, 16);
        compare(
            &format!("llama (tied {tied}) vs f64 reference"),
            &ours,
            &reference(&config, &weights, &rope),
        );
    }
    Ok(())
}

/// Llama 3.1's `rope_type: llama3` against candle-transformers' llama, which implements it; the
/// bands are exercised: with head_dim 16, theta 10000 and 32 original positions, pair 0
/// (wavelength 2π) is kept, pair 1 (≈ 19.9, between 32 / 4 and 32 / 1) interpolated, pairs
/// 2.. divided by the factor.
#[test]
fn llama3_rope_scaling_matches_candle_transformers() -> Result<()> {
    let mut config = tiny_config("llama");
    config["rope_scaling"] = json!({
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32
    });
    let (dir, _) = checkpoint("llama3", &config, 12)?;
    let ours = ours(&dir.0)?;
    let cfg =
        serde_json::from_value::<candle_transformers::models::llama::LlamaConfig>(config.clone())?
            .into_config(false);
    let model =
        candle_transformers::models::llama::Llama::load(vb(&dir.0, &["model.safetensors"])?, &cfg)?;
    let mut cache =
        candle_transformers::models::llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu)?;
    let theirs = theirs(|x, pos| model.forward(x, pos, &mut cache))?;
    compare("llama3 rope_scaling vs candle-transformers", &ours, &theirs);

    // And the scaling changes the logits (it is applied, not ignored).
    config["rope_scaling"] = Value::Null;
    let plain = TempDir::new("llama3-plain");
    write_folder(
        &plain.0,
        &config,
        &random_weights(&config, 12),
        DType::F32,
        1,
    )?;
    let unscaled = self::ours(&plain.0)?;
    assert!(max_abs_diff(&unscaled[5], &ours[5]) > 1e-3);
    Ok(())
}

#[test]
fn qwen2_matches_candle_transformers_and_the_f64_reference() -> Result<()> {
    let config = tiny_config("qwen2");
    let (dir, weights) = checkpoint("qwen2", &config, 21)?;
    assert!(weights.contains_key("model.layers.0.self_attn.q_proj.bias"));
    assert!(!weights.contains_key("model.layers.0.self_attn.o_proj.bias"));
    let ours = ours(&dir.0)?;
    let cfg: candle_transformers::models::qwen2::Config = serde_json::from_value(config.clone())?;
    let mut model = candle_transformers::models::qwen2::ModelForCausalLM::new(
        &cfg,
        vb(&dir.0, &["model.safetensors"])?,
    )?;
    let theirs = theirs(|x, pos| model.forward(x, pos))?;
    compare("qwen2 vs candle-transformers", &ours, &theirs);
    compare(
        "qwen2 vs f64 reference",
        &ours,
        &reference(&config, &weights, &RefRope::default(10_000.0, 16)),
    );
    Ok(())
}

#[test]
fn qwen3_matches_candle_transformers_and_the_f64_reference() -> Result<()> {
    for tied in [true, false] {
        let mut config = tiny_config("qwen3");
        config["tie_word_embeddings"] = json!(tied);
        let (dir, weights) = checkpoint("qwen3", &config, 31)?;
        let loaded = load_hf_folder(&dir.0, &Device::Cpu)?;
        // head_dim 32 as config.json says, not hidden / heads = 16.
        assert_eq!(loaded.model.config().head_dim, 32);
        assert!(loaded.model.config().qk_norm);
        drop(loaded);
        let ours = ours(&dir.0)?;
        let cfg: candle_transformers::models::qwen3::Config =
            serde_json::from_value(config.clone())?;
        let mut model = candle_transformers::models::qwen3::ModelForCausalLM::new(
            &cfg,
            vb(&dir.0, &["model.safetensors"])?,
        )?;
        let theirs = theirs(|x, pos| model.forward(x, pos))?;
        compare(
            &format!("qwen3 (tied {tied}) vs candle-transformers"),
            &ours,
            &theirs,
        );
        compare(
            &format!("qwen3 (tied {tied}) vs f64 reference"),
            &ours,
            &reference(&config, &weights, &RefRope::default(10_000.0, 32)),
        );
    }
    Ok(())
}

/// Llama's `attention_bias: true` (q, k, v and o biases), which candle-transformers' llama does
/// not implement: against the f64 reference.
#[test]
fn llama_attention_bias_matches_the_f64_reference() -> Result<()> {
    let mut config = tiny_config("llama");
    config["attention_bias"] = json!(true);
    let (dir, weights) = checkpoint("llama-bias", &config, 41)?;
    assert!(weights.contains_key("model.layers.1.self_attn.o_proj.bias"));
    compare(
        "llama attention_bias vs f64 reference",
        &ours(&dir.0)?,
        &reference(&config, &weights, &RefRope::default(10_000.0, 16)),
    );
    Ok(())
}

/// `rope_type: yarn` (Qwen2.5 / Qwen3 long context) against the f64 reference, whose inverse
/// frequencies are worked here from transformers' `_compute_yarn_parameters`: head_dim 32,
/// theta 10000, factor 4, 32 original positions, beta 32 / 1 → correction dims
/// 32 ln(32 / (32·2π)) / (2 ln 10000) = -3.19 → 0 and 32 ln(32 / 2π) / (2 ln 10000) = 2.83 → 3;
/// pair i's ramp min(i / 3, 1); attention factor 0.1 ln 4 + 1.
#[test]
fn yarn_matches_the_f64_reference() -> Result<()> {
    let mut config = tiny_config("qwen3");
    config["rope_scaling"] = json!({
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32
    });
    let (dir, weights) = checkpoint("yarn", &config, 51)?;
    let inv_freq = (0..16)
        .map(|i| {
            let base = 1.0 / 10_000f64.powf(2.0 * i as f64 / 32.0);
            let ramp = (i as f64 / 3.0).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            base / 4.0 * (1.0 - keep) + base * keep
        })
        .collect();
    let rope = RefRope {
        inv_freq,
        attention_factor: 0.1 * 4f64.ln() + 1.0,
    };
    compare(
        "qwen3 yarn vs f64 reference",
        &ours(&dir.0)?,
        &reference(&config, &weights, &rope),
    );
    Ok(())
}

/// transformers 5 writes `rope_parameters` (with `rope_theta` inside) and `dtype` where 4 wrote
/// `rope_theta` / `rope_scaling` and `torch_dtype`: the same model either way.
#[test]
fn transformers_5_config_spelling_gives_the_same_model() -> Result<()> {
    let mut v4 = tiny_config("llama");
    v4["rope_theta"] = json!(5000.0);
    v4["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
    let weights = random_weights(&v4, 61);
    let a = TempDir::new("v4");
    write_folder(&a.0, &v4, &weights, DType::F32, 1)?;
    let mut v5 = v4.clone();
    let obj = v5.as_object_mut().expect("object");
    obj.remove("rope_theta");
    obj.remove("rope_scaling");
    obj.remove("torch_dtype");
    obj.insert("dtype".into(), json!("float32"));
    obj.insert(
        "rope_parameters".into(),
        json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}),
    );
    let b = TempDir::new("v5");
    write_folder(&b.0, &v5, &weights, DType::F32, 1)?;
    let (la, lb) = (ours(&a.0)?, ours(&b.0)?);
    assert_eq!(la, lb);
    let rope = RefRope {
        inv_freq: RefRope::default(5000.0, 16)
            .inv_freq
            .iter()
            .map(|f| f / 2.0)
            .collect(),
        attention_factor: 1.0,
    };
    compare(
        "linear rope_scaling vs f64 reference",
        &la,
        &reference(&v4, &weights, &rope),
    );
    let m = load_hf_folder(&b.0, &Device::Cpu)?;
    assert_eq!(m.model.config().rope.theta, 5000.0);
    assert_eq!(m.model.config().weight_dtype, "f32");
    Ok(())
}

/// bf16 and f16 checkpoints, sharded with an index: the logits of the f32 model whose weights
/// are the rounded values.
#[test]
fn half_precision_and_sharded_checkpoints() -> Result<()> {
    let config = tiny_config("qwen2");
    let weights = random_weights(&config, 71);
    for dtype in [DType::BF16, DType::F16] {
        let half = TempDir::new("half");
        write_folder(&half.0, &config, &weights, dtype, 3)?;
        assert!(half.0.join("model.safetensors.index.json").is_file());
        let exact = TempDir::new("exact");
        write_folder(&exact.0, &config, &rounded(&weights, dtype), DType::F32, 1)?;
        // The same values, the same logits up to f32 rounding: the 16-bit matrices are
        // multiplied by nucleus's own kernels, the f32 ones by candle's, in another order.
        let (h, e) = (ours(&half.0)?, ours(&exact.0)?);
        compare(&format!("{dtype:?} vs its rounded f32 folder"), &h, &e);
        let loaded = load_model(&half.0, &Device::Cpu)?;
        assert_eq!(
            loaded.model.config().weight_dtype,
            format!("{dtype:?}").to_lowercase()
        );
    }
    Ok(())
}

/// Prefill of a whole prompt against token-by-token decode, and each of 8 mixed-length requests
/// alone against all 8 in one batch (also mixing prefill and decode rows).
#[test]
fn prefill_decode_and_batching_agree() -> Result<()> {
    let config = tiny_config("qwen3");
    let (dir, _) = checkpoint("batch", &config, 81)?;
    let loaded = load_hf_folder(&dir.0, &Device::Cpu)?;
    let model = &loaded.model;

    // Prefill against one token at a time.
    let prompt: Vec<u32> = (0..40).map(|i| (i * 157 + 3) % VOCAB as u32).collect();
    let mut a = model.new_cache();
    let whole = run(model, &mut a, &prompt)?;
    let mut b = model.new_cache();
    let mut one = Vec::new();
    for &t in &prompt {
        one = run(model, &mut b, &[t])?;
    }
    let d = max_abs_diff(&whole, &one);
    assert!(d < TOL, "prefill vs token by token: {d}");
    println!("prefill vs token-by-token: max |diff| {d:e}");

    // 8 requests: histories of different lengths, then new tokens (1 = decode, more = prefill).
    let mut rng = common::hf::Rng::new(5);
    let mut id = || ((rng.next() + 1.0) * 0.5 * (VOCAB - 1) as f32) as u32;
    let lens = [
        (0usize, 9usize),
        (5, 1),
        (12, 1),
        (0, 1),
        (3, 4),
        (20, 1),
        (1, 13),
        (7, 2),
    ];
    let mut identical = 0;
    let mut worst = 0f32;
    for round in 0..3 {
        let requests: Vec<(Vec<u32>, Vec<u32>)> = lens
            .iter()
            .map(|&(past, new)| {
                let past: Vec<u32> = (0..past + round).map(|_| id()).collect();
                let new: Vec<u32> = (0..new).map(|_| id()).collect();
                (past, new)
            })
            .collect();
        let mut solo = Vec::new();
        let mut caches = Vec::new();
        for (past, new) in &requests {
            let mut cache = model.new_cache();
            if !past.is_empty() {
                run(model, &mut cache, past)?;
            }
            caches.push(cache.clone());
            solo.push(run(model, &mut cache, new)?);
        }
        let mut inputs: Vec<SeqInput> = caches
            .iter_mut()
            .zip(&requests)
            .map(|(cache, (_, new))| SeqInput { tokens: new, cache })
            .collect();
        let batched: Vec<Vec<f32>> = model.forward(&mut inputs)?.to_vec2()?;
        for (i, (s, b)) in solo.iter().zip(&batched).enumerate() {
            let d = max_abs_diff(s, b);
            assert!(d < TOL, "round {round}, request {i}: batched vs solo {d}");
            worst = worst.max(d);
            identical += usize::from(s == b);
        }
    }
    println!("batch of 8 vs solo: {identical} of 24 rows bit-identical, max |diff| {worst:e}");
    Ok(())
}

/// Special ids: BOS from config.json, else tokenizer_config.json's `bos_token`. The
/// end-of-generation ids are the union of generation_config.json's `eos_token_id` (a list),
/// config.json's, tokenizer_config.json's `eos_token` and the tokens whose text is in
/// llama.cpp's end-of-generation list (MiniMind's `<|endoftext|>` 0 and `<|im_end|>` 2), sorted.
#[test]
fn special_ids_follow_transformers_precedence() -> Result<()> {
    let mut config = tiny_config("llama");
    let (dir, _) = checkpoint("ids", &config, 91)?;
    let l = load_hf_folder(&dir.0, &Device::Cpu)?;
    assert_eq!(
        (l.tokenizer.bos_token_id, l.tokenizer.eos_token_ids.clone()),
        (Some(1), vec![0, 2])
    );
    assert_eq!(l.model.config().eos_token_ids, vec![0, 2]);
    std::fs::write(
        dir.0.join("generation_config.json"),
        r#"{"bos_token_id": 1, "eos_token_id": [2, 0], "do_sample": true}"#,
    )?;
    let l = load_hf_folder(&dir.0, &Device::Cpu)?;
    assert_eq!(l.tokenizer.eos_token_ids, vec![0, 2]);
    std::fs::remove_file(dir.0.join("generation_config.json"))?;
    // Neither file has ids: tokenizer_config.json's <|im_start|> / <|im_end|> (1 / 2), and
    // <|endoftext|> (0) by its text.
    let obj = config.as_object_mut().expect("object");
    obj.remove("bos_token_id");
    obj.remove("eos_token_id");
    std::fs::write(dir.0.join("config.json"), serde_json::to_vec(&config)?)?;
    let l = load_hf_folder(&dir.0, &Device::Cpu)?;
    assert_eq!(
        (l.tokenizer.bos_token_id, l.tokenizer.eos_token_ids.clone()),
        (Some(1), vec![0, 2])
    );
    // MiniMind's tokenizer class is PreTrainedTokenizerFast: tokenizer.json's (absent)
    // post-processor is kept, no BOS is added.
    let plain = l
        .tokenizer
        .tokenizer
        .encode("hi", true)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec();
    assert_ne!(plain[0], 1);
    // A Llama 2 tokenizer class with add_bos_token true gets BOS prepended, as
    // LlamaTokenizerFast.update_post_processor does.
    let mut tc: Value =
        serde_json::from_slice(&std::fs::read(dir.0.join("tokenizer_config.json"))?)?;
    tc["tokenizer_class"] = json!("LlamaTokenizerFast");
    tc["add_bos_token"] = json!(true);
    std::fs::write(
        dir.0.join("tokenizer_config.json"),
        serde_json::to_vec(&tc)?,
    )?;
    let l = load_hf_folder(&dir.0, &Device::Cpu)?;
    let ids = l
        .tokenizer
        .tokenizer
        .encode("hi", true)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec();
    assert_eq!(ids[0], 1);
    assert_eq!(&ids[1..], &plain[..]);
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

#[test]
fn broken_folders_are_typed_errors_naming_the_thing() -> Result<()> {
    let config = tiny_config("llama");
    let weights = random_weights(&config, 101);
    let fresh = |edit: &dyn Fn(&mut Value)| -> Result<TempDir> {
        let mut c = config.clone();
        edit(&mut c);
        let d = TempDir::new("broken");
        write_folder(&d.0, &c, &weights, DType::F32, 1)?;
        Ok(d)
    };

    // An unknown model_type, listing the supported ones.
    let d = fresh(&|c| c["model_type"] = json!("mamba"))?;
    match load_err(&d.0) {
        EngineError::Unsupported(m) => assert!(
            m.ends_with(
                "model_type `mamba` is not supported; supported: llama, qwen2, qwen3, qwen3_moe, \
                 minimind"
            ),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
    // A rope_type we do not run, and sliding-window attention.
    let d = fresh(&|c| c["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 2.0}))?;
    match load_err(&d.0) {
        EngineError::Unsupported(m) => {
            assert!(m.contains("rope_scaling.rope_type `dynamic`"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    // One RoPE per layer type (transformers 5's hybrid models) is refused, not ignored.
    let d = fresh(&|c| {
        c["rope_parameters"] =
            json!({"full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    })?;
    match load_err(&d.0) {
        EngineError::Unsupported(m) => assert!(
            m.contains("`rope_parameters` holds one RoPE per layer type (`full_attention`: ...)"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
    // Scaling fields without a type, and yarn without its factor, as transformers refuses them.
    let d = fresh(&|c| c["rope_scaling"] = json!({"factor": 2.0}))?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "`rope_scaling` has `factor` but no `rope_type` (or `type`)"
    );
    let d = fresh(&|c| {
        c["rope_scaling"] = json!({"rope_type": "yarn", "original_max_position_embeddings": 32})
    })?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "missing field `rope_scaling.factor` (needed by rope_type \"yarn\")"
    );
    // A config.json that is not an object.
    let d = fresh(&|_| {})?;
    std::fs::write(d.0.join("config.json"), "[1, 2]")?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "an array of 2 values, expected a JSON object"
    );
    // Weights that are not a regular file are named as such, not as missing.
    let d = fresh(&|_| {})?;
    std::fs::remove_file(d.0.join("model.safetensors"))?;
    std::fs::create_dir(d.0.join("model.safetensors"))?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "not a regular file (a directory)"
    );
    let d = fresh(&|c| c["use_sliding_window"] = json!(true))?;
    match load_err(&d.0) {
        EngineError::Unsupported(m) => assert!(m.contains("use_sliding_window: true"), "{m}"),
        other => panic!("{other:?}"),
    }

    // A missing tensor: its name.
    let d = TempDir::new("missing-tensor");
    let mut w = weights.clone();
    w.remove("model.layers.1.mlp.up_proj.weight");
    write_folder(&d.0, &config, &w, DType::F32, 1)?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "missing tensor `model.layers.1.mlp.up_proj.weight`"
    );
    // A tensor of the wrong shape: name, found, expected.
    let d = TempDir::new("wrong-shape");
    let mut w = weights.clone();
    w.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        (vec![64, 64], vec![0.0; 64 * 64]),
    );
    write_folder(&d.0, &config, &w, DType::F32, 1)?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "tensor `model.layers.0.self_attn.k_proj.weight` has shape [64, 64], expected [32, 64]"
    );
    // A tokenizer with more ids than the embedding has rows (fewer is fine: padding).
    let d = TempDir::new("small-embedding");
    let mut c = config.clone();
    c["vocab_size"] = json!(6000);
    let w = random_weights(&c, 102);
    write_folder(&d.0, &c, &w, DType::F32, 1)?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "the tokenizer has 6400 ids but the embedding (model.embed_tokens.weight) has 6000 rows"
    );
    let d = TempDir::new("padded-embedding");
    c["vocab_size"] = json!(6464);
    write_folder(&d.0, &c, &random_weights(&c, 103), DType::F32, 1)?;
    assert_eq!(
        load_model(&d.0, &Device::Cpu)?.model.config().vocab_size,
        6464
    );

    // A folder without weights.
    let d = fresh(&|_| {})?;
    std::fs::remove_file(d.0.join("model.safetensors"))?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "no model.safetensors or model.safetensors.index.json: the folder has no weights"
    );
    // With both model.safetensors and an index, model.safetensors is read (transformers'
    // preference): here the index names a shard that does not exist.
    let d = fresh(&|_| {})?;
    std::fs::write(
        d.0.join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.norm.weight": "gone.safetensors"}}"#,
    )?;
    load_model(&d.0, &Device::Cpu)?;
    // A truncated shard is named, not the first one.
    let d = TempDir::new("truncated-shard");
    write_folder(&d.0, &config, &weights, DType::F32, 2)?;
    let second = d.0.join("model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&second)?.len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&second)?
        .set_len(len - 4)?;
    match load_err(&d.0) {
        EngineError::InvalidModel { path, message } => {
            assert_eq!(path, second, "{message}");
            assert!(
                message.starts_with("cannot map or parse the safetensors file"),
                "{message}"
            );
            // The path is named once, by the error itself.
            assert!(!message.contains("model-00002"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Tensors are read from the shard the index names: an index putting `model.norm.weight`
    // (written to the second shard) in the first is an error naming both.
    let d = TempDir::new("misrouted");
    write_folder(&d.0, &config, &weights, DType::F32, 2)?;
    let index_path = d.0.join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_slice(&std::fs::read(&index_path)?)?;
    assert_eq!(
        index["weight_map"]["model.norm.weight"],
        "model-00002-of-00002.safetensors"
    );
    index["weight_map"]["model.norm.weight"] = json!("model-00001-of-00002.safetensors");
    std::fs::write(&index_path, serde_json::to_vec(&index)?)?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "missing tensor `model.norm.weight`: model.safetensors.index.json puts it in \
         `model-00001-of-00002.safetensors`, which does not hold it"
    );
    // A sharded index naming a missing file.
    let d = TempDir::new("missing-shard");
    write_folder(&d.0, &config, &weights, DType::F32, 2)?;
    std::fs::remove_file(d.0.join("model-00002-of-00002.safetensors"))?;
    let m = invalid_message(load_err(&d.0));
    assert!(
        m.starts_with("weight_map names the shard `model-00002-of-00002.safetensors` (for tensor"),
        "{m}"
    );
    assert!(m.ends_with("), which is missing"), "{m}");
    // No config.json, and a config field of the wrong type.
    std::fs::remove_file(d.0.join("config.json"))?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "missing: a Hugging Face model folder needs the model's configuration here"
    );
    let d = fresh(&|c| c["num_hidden_layers"] = json!("two"))?;
    assert_eq!(
        invalid_message(load_err(&d.0)),
        "field `num_hidden_layers` is the string `two`, expected a positive integer"
    );
    Ok(())
}

/// The same random weights written as a Hugging Face folder and as a GGUF file (by llama.cpp's
/// converter's rules: q/k permuted into adjacent pairs for `llama` only, rotate-half kept for
/// `qwen2` / `qwen3`) give the same logits, for each family; f16 GGUF tensors equal the
/// folder of the f16-rounded weights.
#[test]
fn hugging_face_folders_and_gguf_files_give_the_same_logits() -> Result<()> {
    use candle_core::quantized::GgmlDType;
    for (model_type, tied) in [("llama", false), ("qwen2", true), ("qwen3", false)] {
        let mut config = tiny_config(model_type);
        config["tie_word_embeddings"] = json!(tied);
        let (dir, weights) = checkpoint(model_type, &config, 111)?;
        let gguf = common::TempFile(common::temp_path("model.gguf"));
        common::hf::write_gguf(&gguf.0, &config, &weights, model_type, GgmlDType::F32)?;
        let loaded = load_model(&gguf.0, &Device::Cpu)?;
        assert_eq!(loaded.model.config().architecture, model_type);
        assert_eq!(loaded.model.config().tie_word_embeddings, tied);
        let from_gguf = {
            let model = &loaded.model;
            let mut cache = model.new_cache();
            let mut out = vec![run(model, &mut cache, &PROMPT)?];
            for t in DECODE {
                out.push(run(model, &mut cache, &[t])?);
            }
            out
        };
        compare(
            &format!("{model_type}: GGUF vs Hugging Face folder"),
            &from_gguf,
            &ours(&dir.0)?,
        );
        // f16 tensors: the folder of the f16-rounded weights (norms and biases stay f32).
        let half = common::TempFile(common::temp_path("model-f16.gguf"));
        common::hf::write_gguf(&half.0, &config, &weights, model_type, GgmlDType::F16)?;
        let mut rounded_2d = weights.clone();
        for (shape, values) in rounded_2d.values_mut() {
            if shape.len() == 2 {
                *values = Tensor::from_vec(values.clone(), values.len(), &Device::Cpu)?
                    .to_dtype(DType::F16)?
                    .to_dtype(DType::F32)?
                    .to_vec1()?;
            }
        }
        let exact = TempDir::new("f16-exact");
        write_folder(&exact.0, &config, &rounded_2d, DType::F32, 1)?;
        let loaded = load_model(&half.0, &Device::Cpu)?;
        let mut cache = loaded.model.new_cache();
        let h = run(&loaded.model, &mut cache, &PROMPT)?;
        let e = ours(&exact.0)?;
        let d = max_abs_diff(&h, &e[0]);
        assert!(d < TOL, "{model_type} f16 GGUF vs rounded folder: {d}");
    }
    Ok(())
}

/// A GGUF model split in two files as llama.cpp's `gguf-split` writes them (all metadata in the
/// first, `split.no` / `split.count` in each, the tensors shared out) loads from its first file
/// as the whole file does; the second file alone, or the first without the second, is an error
/// naming what to do.
#[test]
fn split_gguf_files_load_as_one_model() -> Result<()> {
    use candle_core::quantized::gguf_file::{self, Value as G};
    use candle_core::quantized::{GgmlDType, QTensor};
    let config = tiny_config("qwen3");
    let weights = random_weights(&config, 121);
    let whole = common::TempFile(common::temp_path("whole.gguf"));
    common::hf::write_gguf(&whole.0, &config, &weights, "qwen3", GgmlDType::F32)?;
    let mut file = std::fs::File::open(&whole.0)?;
    let content = gguf_file::Content::read(&mut file)?;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, QTensor)> = names
        .iter()
        .map(|n| Ok(((*n).clone(), content.tensor(&mut file, n, &Device::Cpu)?)))
        .collect::<Result<_>>()?;
    let dir = TempDir::new("split");
    let split_path = |k: usize| dir.0.join(format!("tiny-{k:05}-of-00002.gguf"));
    let half = tensors.len() / 2;
    for (k, part) in [(1usize, &tensors[..half]), (2, &tensors[half..])] {
        let mut md: Vec<(String, G)> = if k == 1 {
            content
                .metadata
                .iter()
                .map(|(a, b)| (a.clone(), b.clone()))
                .collect()
        } else {
            Vec::new()
        };
        md.push(("split.no".into(), G::U16(k as u16 - 1)));
        md.push(("split.count".into(), G::U16(2)));
        md.push(("split.tensors.count".into(), G::I32(tensors.len() as i32)));
        let md_refs: Vec<(&str, &G)> = md.iter().map(|(a, b)| (a.as_str(), b)).collect();
        let t_refs: Vec<(&str, &QTensor)> = part.iter().map(|(a, b)| (a.as_str(), b)).collect();
        gguf_file::write(
            &mut std::fs::File::create(split_path(k))?,
            &md_refs,
            &t_refs,
        )?;
    }
    let logits = |path: &std::path::Path| -> Result<Vec<f32>> {
        let loaded = load_model(path, &Device::Cpu)?;
        let mut cache = loaded.model.new_cache();
        run(&loaded.model, &mut cache, &PROMPT)
    };
    assert_eq!(logits(&split_path(1))?, logits(&whole.0)?);

    assert_eq!(
        invalid_message(load_err(&split_path(2))),
        "split 2 of 2 of a split GGUF model (split.no 1): pass the first split, whose name ends \
         in -00001-of-00002.gguf"
    );
    std::fs::remove_file(split_path(2))?;
    let m = invalid_message(load_err(&split_path(1)));
    assert!(m.starts_with("missing: split 2 of 2 of "), "{m}");
    Ok(())
}

/// GGUF `qwen3` files in every tensor type candle reads and writes (f32, f16, bf16, the
/// ggml block formats and the k-quants) load and give the logits candle-transformers'
/// `quantized_qwen3` gives on the same file (both multiply with candle's `QMatMul`):
/// within 5e-3 for f32 / f16 / bf16 (`quantized_qwen3` itself is ~1e-3 from the f64
/// reference, where ours is ~2e-6) and 0.1 for the block types (see below); f32 / f16 / bf16
/// also equal the f64 reference over the rounded weights within 1e-4.
/// Sizes are whole k-quant blocks of 256 (hidden 256, ffn 256, 4 heads of 64). Q8_1 and Q8K,
/// which candle writes but cannot read, are a typed error.
#[test]
fn every_gguf_tensor_type_matches_candle_transformers_quantized_qwen3() -> Result<()> {
    use candle_core::quantized::{gguf_file, GgmlDType};
    let mut config = tiny_config("qwen3");
    config["hidden_size"] = json!(256);
    config["intermediate_size"] = json!(256);
    config["head_dim"] = json!(64);
    config["num_hidden_layers"] = json!(1);
    let weights = random_weights(&config, 131);
    let mut skipped = Vec::new();
    for dtype in [
        GgmlDType::F32,
        GgmlDType::F16,
        GgmlDType::BF16,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q8_1,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
        GgmlDType::Q8K,
    ] {
        let path = common::TempFile(common::temp_path("qwen3-q.gguf"));
        if let Err(e) = common::hf::write_gguf(&path.0, &config, &weights, "qwen3", dtype) {
            skipped.push(format!("{dtype:?}"));
            println!("{dtype:?}: candle cannot write it ({e})");
            continue;
        }
        if matches!(dtype, GgmlDType::Q8_1 | GgmlDType::Q8K) {
            // candle writes these dot-product intermediates but cannot read them back.
            let m = invalid_message(load_err(&path.0));
            assert!(
                m.contains(&format!("quantized type {dtype:?} is not supported")),
                "{m}"
            );
            skipped.push(format!("{dtype:?}"));
            continue;
        }
        let loaded = load_model(&path.0, &Device::Cpu)?;
        let mut cache = loaded.model.new_cache();
        let mut ours = vec![run(&loaded.model, &mut cache, &PROMPT)?];
        for t in DECODE {
            ours.push(run(&loaded.model, &mut cache, &[t])?);
        }
        let mut file = std::fs::File::open(&path.0)?;
        let content = gguf_file::Content::read(&mut file)?;
        let mut model = candle_transformers::models::quantized_qwen3::ModelWeights::from_gguf(
            content,
            &mut file,
            &Device::Cpu,
        )?;
        let theirs = theirs(|x, pos| model.forward(x, pos))?;
        let worst = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| max_abs_diff(a, b))
            .fold(0f32, f32::max);
        println!("qwen3 GGUF {dtype:?} vs candle-transformers quantized_qwen3: {worst:e}");
        // Block types also round the activations to q8 blocks, which turns quantized_qwen3's
        // ~1e-3 (its f32 error) into a few 1e-2; a wrong block layout gives O(1).
        let tol = if matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
            5e-3
        } else {
            0.1
        };
        assert!(worst < tol, "{dtype:?} vs quantized_qwen3: {worst}");
        if matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
            let dt = match dtype {
                GgmlDType::F32 => DType::F32,
                GgmlDType::F16 => DType::F16,
                _ => DType::BF16,
            };
            // Matrices rounded through the type, norms kept f32 (as the writer stores them).
            let mut held = weights.clone();
            for (shape, values) in held.values_mut() {
                if shape.len() == 2 {
                    *values = Tensor::from_vec(values.clone(), values.len(), &Device::Cpu)?
                        .to_dtype(dt)?
                        .to_dtype(DType::F32)?
                        .to_vec1()?;
                }
            }
            compare(
                &format!("qwen3 GGUF {dtype:?} vs f64 reference"),
                &ours,
                &reference(&config, &held, &RefRope::default(10_000.0, 64)),
            );
        }
    }
    assert_eq!(skipped, ["Q8_1", "Q8K"], "types candle cannot read");
    Ok(())
}
