//! nucleus's and llama.cpp's logits on one GGUF file, step by step (feature `llama-cpp`): both
//! engines get `nucleus bench generate`'s seeded prompt ids (request 0), then both are fed
//! llama.cpp's greedy token of each step, so their logits can be compared at every step even
//! after their greedy tokens part. One thread each.
//!
//! ```text
//! logit_diff MODEL [PROMPT_TOKENS=256] [STEPS=32] [FLASH_ATTN=auto|on|off] [KV=f16|f32]
//! ```
//!
//! Prints, per step: llama.cpp's greedy token, nucleus's, llama.cpp's top-2 logit gap, and the
//! largest and the root-mean-square difference of the two engines' logits. With `DUMP=DIR` in
//! the environment it also writes `DIR/ids.txt` (the prompt ids) and `DIR/stepN.bin` (llama.cpp's
//! then nucleus's logits of step N, little-endian f32), which
//! `scripts/reference-logits.py` compares with an f64 computation of the same file.

use std::num::NonZeroU32;

use anyhow::{bail, Context, Result};
use llama_cpp_2::context::params::{KvCacheType, LlamaContextParams};
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use nucleus_engine::{CausalLm, KvCacheDtype, SeqInput};

/// The argmax (the lowest id among equal largest values) and the gap to the second largest.
fn top2(logits: &[f32]) -> (usize, f32) {
    let (mut best, mut first, mut second) = (0, f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if v > first {
            second = first;
            first = v;
            best = i;
        } else if v > second {
            second = v;
        }
    }
    (best, first - second)
}

fn nucleus_step(
    model: &dyn CausalLm,
    cache: &mut nucleus_engine::KvCache,
    ids: &[u32],
) -> Result<Vec<f32>> {
    Ok(model
        .forward(&mut [SeqInput { tokens: ids, cache }])?
        .flatten_all()?
        .to_vec1()?)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1).cloned() else {
        bail!("usage: logit_diff MODEL [PROMPT_TOKENS] [STEPS] [auto|on|off] [f16|f32]");
    };
    let p: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(256);
    let steps: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(32);
    let flash = match args.get(4).map(String::as_str).unwrap_or("auto") {
        "auto" => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_AUTO,
        "on" => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED,
        "off" => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED,
        other => bail!("flash attention is auto, on or off, got {other}"),
    };
    let (llama_kv, nucleus_kv) = match args.get(5).map(String::as_str).unwrap_or("f16") {
        "f16" => (KvCacheType::F16, KvCacheDtype::F16),
        "f32" => (KvCacheType::F32, KvCacheDtype::F32),
        other => bail!("the KV cache is f16 or f32, got {other}"),
    };
    if p == 0 || steps == 0 {
        bail!("PROMPT_TOKENS and STEPS must be at least 1");
    }
    nucleus_engine::threads::configure(Some(1))?;

    let mut backend = LlamaBackend::init()?;
    backend.void_logs();
    let model = LlamaModel::load_from_file(&backend, &path, &LlamaModelParams::default())
        .with_context(|| format!("llama.cpp cannot load {path}"))?;
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(u32::try_from(p + steps)?))
        .with_n_batch(u32::try_from(p)?)
        .with_n_threads(1)
        .with_n_threads_batch(1)
        .with_type_k(llama_kv)
        .with_type_v(llama_kv)
        .with_flash_attention_policy(flash);
    let mut ctx = model.new_context(&backend, params)?;

    let loaded = nucleus_engine::load_model(path.as_ref(), &nucleus_engine::Device::Cpu)?;
    let nucleus = loaded.model;
    let mut cache = nucleus.new_cache_of(nucleus_kv);
    let ids = nucleus_bench::generate::prompt_ids(0, p, nucleus.config().vocab_size);
    let dump = std::env::var("DUMP").ok();
    if let Some(dir) = &dump {
        let text: Vec<String> = ids.iter().map(u32::to_string).collect();
        std::fs::write(format!("{dir}/ids.txt"), text.join(" "))?;
    }

    let mut batch = LlamaBatch::new(p, 1);
    for (i, &id) in ids.iter().enumerate() {
        batch.add(
            LlamaToken(i32::try_from(id)?),
            i32::try_from(i)?,
            &[0],
            i + 1 == p,
        )?;
    }
    ctx.decode(&mut batch)?;
    let mut theirs = ctx.get_logits_ith(i32::try_from(p - 1)?).to_vec();
    let mut ours = nucleus_step(&nucleus, &mut cache, &ids)?;
    println!("step llama.cpp nucleus llama.cpp_top2_gap max_abs_diff rms_diff");
    for step in 0..steps {
        let (token, gap) = top2(&theirs);
        let (mine, _) = top2(&ours);
        let (mut max, mut sum2) = (0f64, 0f64);
        for (a, b) in theirs.iter().zip(&ours) {
            let d = (*a as f64 - *b as f64).abs();
            max = max.max(d);
            sum2 += d * d;
        }
        println!(
            "{step} {token} {mine} {gap:.3e} {max:.3e} {:.3e}{}",
            (sum2 / theirs.len() as f64).sqrt(),
            if token != mine { " differ" } else { "" }
        );
        if let Some(dir) = &dump {
            let bytes: Vec<u8> = theirs
                .iter()
                .chain(&ours)
                .flat_map(|v| v.to_le_bytes())
                .collect();
            std::fs::write(format!("{dir}/step{step}.bin"), bytes)?;
        }
        if step + 1 == steps {
            break;
        }
        let mut one = LlamaBatch::new(1, 1);
        one.add(
            LlamaToken(i32::try_from(token)?),
            i32::try_from(p + step)?,
            &[0],
            true,
        )?;
        ctx.decode(&mut one)?;
        theirs = ctx.get_logits_ith(0).to_vec();
        ours = nucleus_step(&nucleus, &mut cache, &[u32::try_from(token)?])?;
    }
    Ok(())
}
