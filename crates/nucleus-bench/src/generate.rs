//! `nucleus bench generate`: the whole decode loop of a model, as a user feels it (issue 23,
//! point 1).
//!
//! Each round loads the model (timed), adds `--batch` requests of `--prompt-tokens` seeded
//! random prompt ids, and generates `--gen-tokens` greedy tokens per request with the engine
//! (`ignore_eos`, so every request runs its full length): prefill is the first step (every
//! prompt in one forward pass), decode the steps after it. Resident memory (`VmRSS`) is read
//! once the round's tokens are generated, with the model, its KV caches and the engine still
//! alive. Then, the model dropped, a read of a 256 MiB buffer, larger than the caches (the
//! fastest of three passes summing its words, on `--threads` threads), measures the memory's
//! read bandwidth, and the decode floor of
//! a token is the bytes of the model's weights (as stored in the file: the bytes an engine
//! that keeps them in their stored type reads per token) divided by that bandwidth. Figures
//! are medians over `--rounds`, with the spread (smallest to largest) beside them; the rounds
//! interleave loading, generating and the bandwidth read, so a busy moment of this shared
//! machine touches them alike.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use nucleus_engine::{load_model, Engine, EngineConfig, Prompt, Request, SamplingParams};

use crate::ParamError;

/// What `nucleus bench generate` measures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The model: a GGUF file or a Hugging Face model folder (resolved by the caller).
    pub model: PathBuf,
    /// Prompt tokens per request (seeded random ids; at least 1).
    pub prompt_tokens: usize,
    /// Tokens generated per request (greedy; the first comes from the prefill; at least 2).
    pub gen_tokens: usize,
    /// Requests that run together (`1..=nucleus_engine::MAX_SAMPLES_PER_REQUEST`).
    pub batch: usize,
    /// Threads of the forward pass, the sampler and the bandwidth read (at least 1). The
    /// caller sizes the process's rayon pool with it (`nucleus_engine::threads::configure`).
    pub threads: usize,
    /// Rounds (each loads the model and generates; at least 1); figures are their medians.
    pub rounds: usize,
}

/// The bytes of the buffer the bandwidth is read from: larger than any last-level cache.
pub const BANDWIDTH_BUFFER_BYTES: usize = 256 << 20;

/// One round's measurements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Round {
    /// Loading the model (read, parse, build the forward pass).
    pub load: Duration,
    /// The first step: every prompt through the model, and the first token of each.
    pub prefill: Duration,
    /// The steps after the first.
    pub decode: Duration,
    /// Decode steps (each one token per request).
    pub decode_steps: usize,
    /// Resident bytes after generating, the model alive.
    pub rss: Option<u64>,
    /// The read bandwidth measured after the round, in bytes per second.
    pub bandwidth: f64,
}

/// Checks the flags: every count at least 1 (`--gen-tokens` at least 2, so that there is a
/// decode step), and the prompt and generated tokens within the model's context (checked
/// once the model is loaded).
fn check_flags(args: &Config) -> Result<()> {
    let usage = |m: String| -> Result<()> { Err(ParamError::new(m).into()) };
    for (value, flag, least) in [
        (args.prompt_tokens, "--prompt-tokens", 1),
        (args.gen_tokens, "--gen-tokens", 2),
        (args.batch, "--batch", 1),
        (args.threads, "--threads", 1),
        (args.rounds, "--rounds", 1),
    ] {
        if value < least {
            return usage(format!("{flag} must be at least {least}, got {value}"));
        }
    }
    if args.batch > nucleus_engine::MAX_SAMPLES_PER_REQUEST {
        return usage(format!(
            "--batch must be at most {}, got {}",
            nucleus_engine::MAX_SAMPLES_PER_REQUEST,
            args.batch
        ));
    }
    Ok(())
}

/// The bytes of the model's weights as its files store them: the GGUF file's tensors (their
/// ggml blocks), or the `.safetensors` files of a Hugging Face folder.
///
/// # Errors
/// A file cannot be read or is not a valid GGUF file.
pub fn stored_weight_bytes(path: &Path) -> Result<u64> {
    if path.is_dir() {
        let mut bytes = 0;
        for entry in std::fs::read_dir(path)? {
            let entry = entry?;
            if entry.path().extension().is_some_and(|e| e == "safetensors") {
                bytes += entry.metadata()?.len();
            }
        }
        return Ok(bytes);
    }
    let mut file = std::fs::File::open(path)?;
    let content = nucleus_engine::gguf::read_content(&mut file, path)?;
    Ok(content
        .tensor_infos
        .values()
        .map(|t| {
            let blocks = t.shape.elem_count() / t.ggml_dtype.block_size();
            (blocks * t.ggml_dtype.type_size()) as u64
        })
        .sum())
}

/// One read of `buffer` summing its words, split over the current rayon pool; returns the
/// bytes per second of the fastest of three passes.
pub fn read_bandwidth(buffer: &[u64]) -> f64 {
    use rayon::prelude::*;
    let chunk = buffer.len().div_ceil(rayon::current_num_threads()).max(1);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        let sum: u64 = buffer
            .par_chunks(chunk)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.min(start.elapsed().as_secs_f64());
    }
    (std::mem::size_of_val(buffer) as f64) / best.max(1e-9)
}

/// `VmRSS` of this process, in bytes (`None` where there is no /proc).
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Seeded random prompt ids below `vocab` (xorshift64*, a fixed seed per request).
fn prompt_ids(request: usize, len: usize, vocab: usize) -> Vec<u32> {
    let mut state =
        0x9E37_79B9_7F4A_7C15u64 ^ (request as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..len)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as u32 % vocab as u32
        })
        .collect()
}

/// One round: load, generate, read RSS; then, the model dropped, the bandwidth read (its
/// buffer allocated for it and freed again, so that it is not in the next round's RSS).
fn round(path: &Path, args: &Config) -> Result<Round> {
    let start = Instant::now();
    let loaded = load_model(path, &nucleus_engine::Device::Cpu)?;
    let load = start.elapsed();
    let config = loaded.model.config().clone();
    if args.prompt_tokens + args.gen_tokens > config.context_length {
        return Err(ParamError::new(format!(
            "--prompt-tokens {} + --gen-tokens {} is more than the model's context of {}",
            args.prompt_tokens, args.gen_tokens, config.context_length
        ))
        .into());
    }
    let mut engine = Engine::new(loaded.model, loaded.tokenizer, EngineConfig::default());
    let vocab = config.vocab_size;
    for r in 0..args.batch {
        engine.add_request(Request {
            prompt: Prompt::Tokens(prompt_ids(r, args.prompt_tokens, vocab)),
            params: SamplingParams {
                temperature: 0.0,
                seed: Some(0),
                ..SamplingParams::default()
            },
            max_tokens: args.gen_tokens,
            ignore_eos: true,
            ..Request::new("")
        })?;
    }
    let start = Instant::now();
    let first = engine.step()?;
    let prefill = start.elapsed();
    check_step(&first, args.batch)?;
    let start = Instant::now();
    let mut decode_steps = 0;
    while engine.has_unfinished() {
        let outputs = engine.step()?;
        check_step(&outputs, args.batch)?;
        decode_steps += 1;
    }
    let decode = start.elapsed();
    let rss = rss_bytes();
    drop(engine);
    let buffer: Vec<u64> = (0..BANDWIDTH_BUFFER_BYTES as u64 / 8).collect();
    let bandwidth = read_bandwidth(&buffer);
    drop(buffer);
    Ok(Round {
        load,
        prefill,
        decode,
        decode_steps,
        rss,
        bandwidth,
    })
}

/// Every request got a token this step (a failed sample is an error of the benchmark).
fn check_step(outputs: &[nucleus_engine::StepOutput], batch: usize) -> Result<()> {
    if let Some(o) = outputs.iter().find(|o| o.token.is_none()) {
        bail!("request {} failed: {:?}", o.request_id, o.finish);
    }
    if outputs.len() != batch {
        bail!("a step gave {} tokens for {batch} requests", outputs.len());
    }
    Ok(())
}

/// A median and the spread (smallest, largest) of a figure over rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// The median (of an even count, the mean of the middle two).
    pub median: f64,
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
}

/// The median and the spread of `values` (compared with `total_cmp`); `None` when empty.
pub fn spread(mut values: Vec<f64>) -> Option<Spread> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    };
    Some(Spread {
        median,
        min: values[0],
        max: values[n - 1],
    })
}

/// What `nucleus bench generate` measured.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateReport {
    /// The bytes of the model's weights as stored ([`stored_weight_bytes`]).
    pub weight_bytes: u64,
    /// Every round, in order.
    pub rounds: Vec<Round>,
}

impl Round {
    /// Prefill tokens per second: `batch * prompt_tokens` over the prefill's time.
    pub fn prefill_tokens_per_s(&self, batch: usize, prompt_tokens: usize) -> f64 {
        (batch * prompt_tokens) as f64 / self.prefill.as_secs_f64().max(1e-9)
    }

    /// Decode tokens per second: `batch` tokens per decode step over the decode's time.
    pub fn decode_tokens_per_s(&self, batch: usize) -> f64 {
        (batch * self.decode_steps) as f64 / self.decode.as_secs_f64().max(1e-9)
    }

    /// Milliseconds per decode step.
    pub fn decode_ms_per_step(&self) -> f64 {
        self.decode.as_secs_f64() * 1e3 / self.decode_steps.max(1) as f64
    }

    /// The decode floor in milliseconds per step: `weight_bytes` read once at this round's
    /// bandwidth.
    pub fn floor_ms_per_step(&self, weight_bytes: u64) -> f64 {
        weight_bytes as f64 / self.bandwidth * 1e3
    }
}

/// Runs `nucleus bench generate`: checks the parameters, reads the weights' stored size,
/// then `config.rounds` rounds.
///
/// # Errors
/// Parameters out of range ([`ParamError`]; prompt and generated tokens beyond the model's
/// context too, once it is loaded), a model that cannot be loaded, a bandwidth buffer that
/// cannot be allocated, a failed step.
pub fn run(config: &Config) -> Result<GenerateReport> {
    check_flags(config)?;
    let weight_bytes = stored_weight_bytes(&config.model)?;
    crate::reserve(Some(BANDWIDTH_BUFFER_BYTES), "the bandwidth read")?;
    let rounds = (0..config.rounds)
        .map(|_| round(&config.model, config))
        .collect::<Result<Vec<Round>>>()?;
    Ok(GenerateReport {
        weight_bytes,
        rounds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_spreads() {
        let s = |median, min, max| Some(Spread { median, min, max });
        assert_eq!(spread(vec![3.0, 1.0, 2.0]), s(2.0, 1.0, 3.0));
        assert_eq!(spread(vec![4.0, 1.0, 2.0, 3.0]), s(2.5, 1.0, 4.0));
        assert_eq!(spread(vec![]), None);
    }

    #[test]
    fn prompts_are_seeded_and_within_the_vocabulary() {
        let a = prompt_ids(0, 100, 512);
        assert_eq!(a, prompt_ids(0, 100, 512));
        assert_ne!(a, prompt_ids(1, 100, 512));
        assert!(a.iter().all(|&t| t < 512));
        assert!(a.iter().collect::<std::collections::BTreeSet<_>>().len() > 50);
    }
}
