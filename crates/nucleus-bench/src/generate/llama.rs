//! llama.cpp's round of `nucleus bench generate` (feature `llama-cpp`), through the
//! llama-cpp-2 crate: the same file, prompt ids, greedy decoding, threads and batch as
//! nucleus's round ([`super`] says what is timed).

use std::num::NonZeroU32;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use llama_cpp_2::context::params::{KvCacheType as LlamaKvType, LlamaContextParams};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use super::{beyond_context, prompt_ids, rss_bytes, Config, EngineKind, FlashAttn, RoundResult};

/// The argmax of `logits` (the lowest id among equal largest values) and the gap between the
/// largest and the second largest value (0 for a tie; `f32::INFINITY` for a row of one).
fn greedy(logits: &[f32]) -> (u32, f32) {
    let (mut best, mut first, mut second) = (0usize, f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l.total_cmp(&first).is_gt() {
            second = first;
            first = l;
            best = i;
        } else if l.total_cmp(&second).is_gt() {
            second = l;
        }
    }
    (best as u32, first - second)
}

/// A position or count as llama.cpp's `i32`.
fn int(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).with_context(|| format!("{what} {n} is beyond llama.cpp's i32"))
}

/// llama.cpp's round: load (the model with mmap, and its context), prefill every prompt in
/// one batch, then one batch of `batch` tokens per decode step.
pub(super) fn round(args: &Config) -> Result<RoundResult> {
    let Some(path) = args.model.to_str() else {
        bail!("llama.cpp needs a UTF-8 path, got {}", args.model.display());
    };
    if args.model.is_dir() {
        bail!(crate::ParamError::new(format!(
            "llama.cpp reads GGUF files, and {path} is a folder"
        )));
    }
    let mut backend = LlamaBackend::init().context("initialising llama.cpp")?;
    backend.void_logs();
    let (batch, p, g) = (args.batch, args.prompt_tokens, args.gen_tokens);
    let threads = int(args.threads, "--threads")?;
    let kv = match args.kv_cache_dtype {
        nucleus_engine::KvCacheDtype::F16 => LlamaKvType::F16,
        nucleus_engine::KvCacheDtype::F32 => LlamaKvType::F32,
    };
    let per_sequence = p + g;
    let n_ctx =
        NonZeroU32::new(u32::try_from(batch * per_sequence)?).context("an empty context")?;
    let n_batch = u32::try_from((batch * p).max(batch))?;

    let start = Instant::now();
    let model = LlamaModel::load_from_file(
        &backend,
        path,
        &LlamaModelParams::default().with_use_mmap(true),
    )
    .with_context(|| format!("llama.cpp cannot load {path}"))?;
    beyond_context(args, model.n_ctx_train() as usize)?;
    let params = LlamaContextParams::default()
        .with_n_ctx(Some(n_ctx))
        .with_n_batch(n_batch)
        .with_n_seq_max(u32::try_from(batch)?)
        .with_n_threads(threads)
        .with_n_threads_batch(threads)
        .with_type_k(kv)
        .with_type_v(kv)
        .with_flash_attention_policy(match args.llama_flash_attn {
            FlashAttn::Auto => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_AUTO,
            FlashAttn::On => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED,
            FlashAttn::Off => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED,
        });
    let mut ctx: LlamaContext<'_> = model
        .new_context(&backend, params)
        .context("llama.cpp cannot make the context")?;
    let load = start.elapsed();

    let vocab = usize::try_from(model.n_vocab()).context("llama.cpp's vocabulary size")?;
    let mut tokens = Vec::with_capacity(g);
    let mut gaps = Vec::with_capacity(g);
    // Row `r`'s logits are at batch index `logit_at[r]`.
    let mut logit_at = Vec::with_capacity(batch);
    let mut prefill_batch = LlamaBatch::new(batch * p, int(batch, "--batch")?);
    for r in 0..batch {
        let ids = prompt_ids(r, p, vocab);
        for (i, &id) in ids.iter().enumerate() {
            let last = i + 1 == p;
            prefill_batch.add(
                LlamaToken(int(id as usize, "a token id")?),
                int(i, "a position")?,
                &[int(r, "a sequence id")?],
                last,
            )?;
        }
        logit_at.push(int(r * p + p - 1, "a batch index")?);
    }
    let start = Instant::now();
    ctx.decode(&mut prefill_batch)
        .context("llama.cpp's prefill")?;
    let mut next = pick(&ctx, &logit_at, &mut tokens, &mut gaps);
    let prefill = start.elapsed();
    drop(prefill_batch);

    let mut step_batch = LlamaBatch::new(batch, int(batch, "--batch")?);
    let rows: Vec<i32> = (0..batch)
        .map(|r| int(r, "a batch index"))
        .collect::<Result<_>>()?;
    let start = Instant::now();
    let mut decode_steps = 0;
    for step in 1..g {
        step_batch.clear();
        for (r, &id) in next.iter().enumerate() {
            step_batch.add(
                LlamaToken(int(id as usize, "a token id")?),
                int(p + step - 1, "a position")?,
                &[rows[r]],
                true,
            )?;
        }
        ctx.decode(&mut step_batch)
            .with_context(|| format!("llama.cpp's decode step {step}"))?;
        next = pick(&ctx, &rows, &mut tokens, &mut gaps);
        decode_steps += 1;
    }
    let decode = start.elapsed();
    let rss = rss_bytes();
    drop(ctx);
    Ok(RoundResult {
        engine: EngineKind::LlamaCpp,
        load_s: load.as_secs_f64(),
        prefill_s: prefill.as_secs_f64(),
        decode_s: decode.as_secs_f64(),
        decode_steps,
        rss_bytes: rss,
        tokens,
        top2_gaps: gaps,
    })
}

/// Every row's greedy token from the logits at batch indices `at` (row 0's token and top-2
/// gap appended to `tokens` and `gaps`).
fn pick(
    ctx: &LlamaContext<'_>,
    at: &[i32],
    tokens: &mut Vec<u32>,
    gaps: &mut Vec<f32>,
) -> Vec<u32> {
    at.iter()
        .enumerate()
        .map(|(r, &i)| {
            let (token, gap) = greedy(ctx.get_logits_ith(i));
            if r == 0 {
                tokens.push(token);
                gaps.push(gap);
            }
            token
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_lowest_id_of_the_largest_and_the_gap_to_the_next() {
        assert_eq!(greedy(&[1.0, 3.0, 2.5, 3.0]), (1, 0.0));
        assert_eq!(greedy(&[1.0, 3.0, 2.5]), (1, 0.5));
        assert_eq!(greedy(&[-1.0, -4.0]), (0, 3.0));
        assert_eq!(greedy(&[2.0]), (0, f32::INFINITY));
    }
}
