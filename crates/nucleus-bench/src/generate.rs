//! `nucleus bench generate`: the whole decode loop of a model, as a user feels it, and
//! llama.cpp's on the same file (issue 23, point 1).
//!
//! Each round of each engine runs in a child process of its own ([`run`] starts it through the
//! caller's [`ChildCommand`]; the child runs [`one_round`] and prints one JSON line,
//! [`RoundResult`]), so that its load time starts from a fresh process and its resident
//! memory is its own, not the sum of every engine and round so far. A round loads the model
//! (timed), puts `batch` requests of `prompt_tokens` seeded random prompt ids ([`prompt_ids`],
//! the same ids for both engines) in, and generates `gen_tokens` greedy tokens per request,
//! every request to its full length (`ignore_eos`): prefill is the first step (every prompt in
//! one forward pass, and the first token of each), decode the steps after it, one token per
//! request each. Resident memory (`VmRSS`) is read once the tokens are generated, with the
//! model and its KV caches alive.
//!
//! - nucleus: `nucleus_engine::load_model` (the load), an `Engine` with `batch` requests at
//!   temperature 0, `Engine::step` until every request is done.
//! - llama.cpp (feature `llama-cpp`, the llama-cpp-2 crate): `llama_model_load_from_file`
//!   with mmap and `llama_init_from_model` (the load: the context holds the KV cache, of
//!   [`Config::kv_cache_dtype`], F16 by default as in llama.cpp), `--threads` threads for both prefill and
//!   decode; prefill is one `llama_decode` of a `llama_batch` holding every prompt (sequence
//!   `i` has seq id `i`, positions `0..P`, logits at its last token), each decode step one
//!   `llama_decode` of a batch of `batch` tokens, one per sequence. Greedy is the argmax of the
//!   logits (the lowest id among equal ones), and the child keeps, for row 0, the gap between
//!   the two largest logits of every step ([`RoundResult::top2_gaps`]).
//!
//! After each round of the engines, a read of a 256 MiB buffer, larger than the caches (the
//! fastest of three passes summing its words, on the caller's rayon pool), measures the
//! memory's read bandwidth in the parent, and the decode floor of a step is the bytes of the
//! model's weights (as stored in the file: the bytes an engine that keeps them in their stored
//! type reads per token) divided by that bandwidth. Figures are medians over the rounds, with
//! the spread (smallest to largest) beside them; the rounds interleave nucleus, llama.cpp and
//! the bandwidth read, so a busy moment of a shared machine touches them alike. The greedy
//! tokens of row 0 of the first round are compared ([`TokenComparison`]).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nucleus_engine::{
    load_model, Engine, EngineConfig, KvCacheDtype, Prompt, Request, SamplingParams,
};
use serde::{Deserialize, Serialize};

use crate::ParamError;

#[cfg(feature = "llama-cpp")]
mod llama;

/// What `nucleus bench generate` measures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The model: a GGUF file or a Hugging Face model folder (resolved by the caller; llama.cpp
    /// reads GGUF files only).
    pub model: PathBuf,
    /// Prompt tokens per request (seeded random ids; at least 1).
    pub prompt_tokens: usize,
    /// Tokens generated per request (greedy; the first comes from the prefill; at least 2).
    pub gen_tokens: usize,
    /// Requests that run together (`1..=nucleus_engine::MAX_SAMPLES_PER_REQUEST`).
    pub batch: usize,
    /// Threads of the forward pass and the sampler, of both engines, and of the bandwidth read
    /// (at least 1). The caller sizes the rayon pool of every process with it
    /// (`nucleus_engine::threads::configure`).
    pub threads: usize,
    /// Rounds (each engine loads the model and generates once per round; at least 1).
    pub rounds: usize,
    /// Whether llama.cpp runs too (needs feature `llama-cpp`).
    pub llama_cpp: bool,
    /// The KV cache's element type of both engines (nucleus's
    /// [`EngineConfig::kv_cache_dtype`], llama.cpp's `type_k` and `type_v`).
    pub kv_cache_dtype: KvCacheDtype,
    /// llama.cpp's flash attention (its `--flash-attn`, `llama_context_params.flash_attn_type`).
    pub llama_flash_attn: FlashAttn,
}

/// llama.cpp's flash attention policy (`llama_flash_attn_type`; its CLI's `-fa auto|on|off`).
///
/// On the CPU, llama.cpp's flash attention for one query row
/// (`ggml_compute_forward_flash_attn_ext_f16_one_chunk` in `ggml/src/ggml-cpu/ops.cpp`) sums
/// the values of an f16 cache into an f16 accumulator (`VKQ16`, `ggml_vec_mad_f16`), so its
/// decode logits differ from its own attention without it (and from an exact computation) by
/// about 2.5e-2 on the 0.85 B random model (BENCHMARKS.md, "Generation"); `Off` is its exact
/// attention (f32 scores and sums), what a comparison of greedy tokens needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlashAttn {
    /// llama.cpp's default: on where the backend supports it (the CPU does).
    #[default]
    Auto,
    /// Always.
    On,
    /// Never.
    Off,
}

impl FlashAttn {
    /// `auto`, `on` or `off` (llama.cpp's names).
    pub fn as_str(self) -> &'static str {
        match self {
            FlashAttn::Auto => "auto",
            FlashAttn::On => "on",
            FlashAttn::Off => "off",
        }
    }
}

/// Whether this build has llama.cpp (feature `llama-cpp`).
pub const LLAMA_CPP_BUILT: bool = cfg!(feature = "llama-cpp");

/// An engine timed by `nucleus bench generate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EngineKind {
    /// nucleus-engine.
    Nucleus,
    /// llama.cpp (feature `llama-cpp`).
    LlamaCpp,
}

impl EngineKind {
    /// `nucleus` or `llama.cpp`.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Nucleus => "nucleus",
            EngineKind::LlamaCpp => "llama.cpp",
        }
    }
}

/// The bytes of the buffer the bandwidth is read from: larger than any last-level cache.
pub const BANDWIDTH_BUFFER_BYTES: usize = 256 << 20;

/// The top-2 logit gap under which a first difference of greedy tokens counts as a near tie
/// (issue 23, point 3).
pub const NEAR_TIE_GAP: f32 = 1e-3;

/// One engine's round, as the child process prints it (one JSON line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundResult {
    /// The engine.
    pub engine: EngineKind,
    /// Seconds to load the model (nucleus: `load_model`; llama.cpp: the model and its
    /// context).
    pub load_s: f64,
    /// Seconds of the first step: every prompt through the model, and the first token of each.
    pub prefill_s: f64,
    /// Seconds of the steps after the first.
    pub decode_s: f64,
    /// Decode steps (each one token per request).
    pub decode_steps: usize,
    /// Resident bytes after generating, the model alive (`None` where there is no /proc).
    pub rss_bytes: Option<u64>,
    /// The greedy tokens of row 0 (request 0, sequence 0), `gen_tokens` of them.
    pub tokens: Vec<u32>,
    /// llama.cpp: per step, row 0's largest logit minus its second largest; nucleus: empty.
    pub top2_gaps: Vec<f32>,
}

impl RoundResult {
    /// Prefill tokens per second: `batch * prompt_tokens` over the prefill's time.
    pub fn prefill_tokens_per_s(&self, batch: usize, prompt_tokens: usize) -> f64 {
        (batch * prompt_tokens) as f64 / self.prefill_s.max(1e-9)
    }

    /// Decode tokens per second: `batch` tokens per decode step over the decode's time.
    pub fn decode_tokens_per_s(&self, batch: usize) -> f64 {
        (batch * self.decode_steps) as f64 / self.decode_s.max(1e-9)
    }

    /// Milliseconds per decode step.
    pub fn decode_ms_per_step(&self) -> f64 {
        self.decode_s * 1e3 / self.decode_steps.max(1) as f64
    }
}

/// One round: each engine's child, then the bandwidth read.
#[derive(Debug, Clone, PartialEq)]
pub struct Round {
    /// nucleus's round.
    pub nucleus: RoundResult,
    /// llama.cpp's round (`None` when it does not run).
    pub llama_cpp: Option<RoundResult>,
    /// The read bandwidth measured after the engines, in bytes per second.
    pub bandwidth: f64,
}

impl Round {
    /// The decode floor in milliseconds per step: `weight_bytes` read once at this round's
    /// bandwidth.
    pub fn floor_ms_per_step(&self, weight_bytes: u64) -> f64 {
        weight_bytes as f64 / self.bandwidth * 1e3
    }
}

/// How row 0's greedy tokens of the two engines compare (the first round's).
#[derive(Debug, Clone, PartialEq)]
pub enum TokenComparison {
    /// Every token equal.
    Equal {
        /// The tokens compared.
        count: usize,
    },
    /// The first difference.
    Differ {
        /// The step (0: the prefill's token).
        step: usize,
        /// nucleus's token there.
        nucleus: u32,
        /// llama.cpp's token there.
        llama_cpp: u32,
        /// llama.cpp's top-2 logit gap at that step (`None` if it did not report one).
        gap: Option<f32>,
    },
}

/// Compares the greedy tokens of row 0, with llama.cpp's top-2 gaps.
pub fn compare_tokens(nucleus: &RoundResult, llama_cpp: &RoundResult) -> TokenComparison {
    let (a, b) = (&nucleus.tokens, &llama_cpp.tokens);
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(step) => TokenComparison::Differ {
            step,
            nucleus: a[step],
            llama_cpp: b[step],
            gap: llama_cpp.top2_gaps.get(step).copied(),
        },
        None if a.len() == b.len() => TokenComparison::Equal { count: a.len() },
        // One engine stopped early: the first missing token is the difference.
        None => {
            let step = a.len().min(b.len());
            TokenComparison::Differ {
                step,
                nucleus: a.get(step).copied().unwrap_or(u32::MAX),
                llama_cpp: b.get(step).copied().unwrap_or(u32::MAX),
                gap: llama_cpp.top2_gaps.get(step).copied(),
            }
        }
    }
}

/// Checks the parameters: every count at least 1 (`gen_tokens` at least 2, so that there is
/// a decode step), `batch` within the engine's limit, llama.cpp only where it is built. The
/// prompt and generated tokens within the model's context are checked once the model is
/// loaded.
fn check_params(args: &Config) -> Result<()> {
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
    if args.llama_cpp && !LLAMA_CPP_BUILT {
        return usage(
            "llama.cpp is not in this build: build with feature llama-cpp \
             (scripts/build-llama-cpp-bench.sh)"
                .into(),
        );
    }
    Ok(())
}

/// The usage error for prompt and generated tokens beyond a context of `context` positions.
fn beyond_context(args: &Config, context: usize) -> Result<()> {
    if args.prompt_tokens + args.gen_tokens > context {
        bail!(ParamError::new(format!(
            "--prompt-tokens {} + --gen-tokens {} is more than the model's context of {}",
            args.prompt_tokens, args.gen_tokens, context
        )));
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

/// Seeded random prompt ids below `vocab` (xorshift64*, a fixed seed per request): request
/// `request`'s `len` ids, the same for every engine.
pub fn prompt_ids(request: usize, len: usize, vocab: usize) -> Vec<u32> {
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

/// One round of `engine`, in this process: what the child process runs (its figures then
/// printed as one JSON line, `serde_json::to_string` of the result). `config.rounds` is not
/// used.
///
/// # Errors
/// Parameters out of range ([`ParamError`], prompt and generated tokens beyond the model's
/// context too), a model the engine cannot load, a failed step, llama.cpp asked for in a build
/// without it.
pub fn one_round(engine: EngineKind, config: &Config) -> Result<RoundResult> {
    check_params(config)?;
    match engine {
        EngineKind::Nucleus => nucleus_round(config),
        #[cfg(feature = "llama-cpp")]
        EngineKind::LlamaCpp => llama::round(config),
        #[cfg(not(feature = "llama-cpp"))]
        EngineKind::LlamaCpp => bail!(ParamError::new(
            "llama.cpp is not in this build: build with feature llama-cpp"
        )),
    }
}

/// nucleus's round.
fn nucleus_round(args: &Config) -> Result<RoundResult> {
    let start = Instant::now();
    let loaded = load_model(&args.model, &nucleus_engine::Device::Cpu)?;
    let load = start.elapsed();
    let config = loaded.model.config().clone();
    beyond_context(args, config.context_length)?;
    let mut engine = Engine::new(
        loaded.model,
        loaded.tokenizer,
        EngineConfig {
            kv_cache_dtype: args.kv_cache_dtype,
            ..EngineConfig::default()
        },
    );
    let vocab = config.vocab_size;
    let mut first = None;
    for r in 0..args.batch {
        let info = engine.add_request(Request {
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
        first.get_or_insert(info.request_id);
    }
    let first = first.context("a request was added")?;
    let mut tokens = Vec::with_capacity(args.gen_tokens);
    let start = Instant::now();
    let outputs = engine.step()?;
    let prefill = start.elapsed();
    check_step(&outputs, args.batch, first, &mut tokens)?;
    let start = Instant::now();
    let mut decode_steps = 0;
    while engine.has_unfinished() {
        let outputs = engine.step()?;
        check_step(&outputs, args.batch, first, &mut tokens)?;
        decode_steps += 1;
    }
    let decode = start.elapsed();
    let rss = rss_bytes();
    drop(engine);
    Ok(RoundResult {
        engine: EngineKind::Nucleus,
        load_s: load.as_secs_f64(),
        prefill_s: prefill.as_secs_f64(),
        decode_s: decode.as_secs_f64(),
        decode_steps,
        rss_bytes: rss,
        tokens,
        top2_gaps: Vec::new(),
    })
}

/// Every request got a token this step (a failed sample is an error of the benchmark); row
/// 0's (request `first`) is appended to `tokens`.
fn check_step(
    outputs: &[nucleus_engine::StepOutput],
    batch: usize,
    first: u64,
    tokens: &mut Vec<u32>,
) -> Result<()> {
    if let Some(o) = outputs.iter().find(|o| o.token.is_none()) {
        bail!("request {} failed: {:?}", o.request_id, o.finish);
    }
    if outputs.len() != batch {
        bail!("a step gave {} tokens for {batch} requests", outputs.len());
    }
    tokens.extend(
        outputs
            .iter()
            .filter(|o| o.request_id == first)
            .filter_map(|o| o.token),
    );
    Ok(())
}

/// The command that runs one round of an engine in a child process: it must run
/// [`one_round`] with the same [`Config`] and print the result as one JSON line on stdout
/// (other lines before it are ignored), exit status 0; on an error, exit status 2 for a
/// [`ParamError`] (its message on stderr, `error: ` first), another on any other error.
pub type ChildCommand<'a> = dyn Fn(EngineKind) -> Command + 'a;

/// Runs the child of `engine` and reads its [`RoundResult`].
///
/// # Errors
/// The child cannot start, fails (exit status 2: a [`ParamError`] with its message), or
/// prints no result.
fn run_child(engine: EngineKind, child: &ChildCommand<'_>) -> Result<RoundResult> {
    let mut cmd = child(engine);
    let output = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("starting the {} round's process", engine.name()))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    let message = stderr
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("error: "))
        .unwrap_or_else(|| stderr.trim());
    if output.status.code() == Some(2) {
        bail!(ParamError::new(message));
    }
    if !output.status.success() {
        bail!(
            "the {} round's process failed ({}): {message}",
            engine.name(),
            output.status
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("the {} round's process printed no result", engine.name()))?;
    let result: RoundResult = serde_json::from_str(line)
        .with_context(|| format!("the {} round's result", engine.name()))?;
    if result.engine != engine {
        bail!(
            "the {} round's process ran {}",
            engine.name(),
            result.engine.name()
        );
    }
    Ok(result)
}

/// What `nucleus bench generate` measured.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateReport {
    /// The bytes of the model's weights as stored ([`stored_weight_bytes`]).
    pub weight_bytes: u64,
    /// Every round, in order.
    pub rounds: Vec<Round>,
    /// Row 0's greedy tokens of the first round, nucleus against llama.cpp (`None` when
    /// llama.cpp did not run).
    pub tokens: Option<TokenComparison>,
}

/// Runs `nucleus bench generate`: checks the parameters, reads the weights' stored size,
/// then `config.rounds` rounds, each a child process per engine (`child`) and a bandwidth
/// read here, on the current rayon pool.
///
/// # Errors
/// Parameters out of range ([`ParamError`]; prompt and generated tokens beyond the model's
/// context too, as the child finds it), a model that cannot be read, a bandwidth buffer that
/// cannot be allocated, a child that fails.
pub fn run(config: &Config, child: &ChildCommand<'_>) -> Result<GenerateReport> {
    check_params(config)?;
    let weight_bytes = stored_weight_bytes(&config.model)?;
    crate::reserve(Some(BANDWIDTH_BUFFER_BYTES), "the bandwidth read")?;
    let mut rounds = Vec::with_capacity(config.rounds);
    for _ in 0..config.rounds {
        let nucleus = run_child(EngineKind::Nucleus, child)?;
        let llama_cpp = config
            .llama_cpp
            .then(|| run_child(EngineKind::LlamaCpp, child))
            .transpose()?;
        // Allocated for the read and freed again, so that it is in no engine's RSS.
        let buffer: Vec<u64> = (0..BANDWIDTH_BUFFER_BYTES as u64 / 8).collect();
        let bandwidth = read_bandwidth(&buffer);
        drop(buffer);
        rounds.push(Round {
            nucleus,
            llama_cpp,
            bandwidth,
        });
    }
    let tokens = rounds
        .first()
        .and_then(|r| Some(compare_tokens(&r.nucleus, r.llama_cpp.as_ref()?)));
    Ok(GenerateReport {
        weight_bytes,
        rounds,
        tokens,
    })
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

    fn result(engine: EngineKind, tokens: &[u32], gaps: &[f32]) -> RoundResult {
        RoundResult {
            engine,
            load_s: 1.0,
            prefill_s: 0.5,
            decode_s: 0.25,
            decode_steps: 5,
            rss_bytes: Some(1 << 20),
            tokens: tokens.to_vec(),
            top2_gaps: gaps.to_vec(),
        }
    }

    #[test]
    fn the_first_difference_of_greedy_tokens_is_found_with_its_gap() {
        let n = result(EngineKind::Nucleus, &[1, 2, 3, 4], &[]);
        let same = result(EngineKind::LlamaCpp, &[1, 2, 3, 4], &[5.0, 4.0, 3.0, 2.0]);
        assert_eq!(
            compare_tokens(&n, &same),
            TokenComparison::Equal { count: 4 }
        );
        let other = result(
            EngineKind::LlamaCpp,
            &[1, 2, 7, 4],
            &[5.0, 4.0, 0.0005, 2.0],
        );
        assert_eq!(
            compare_tokens(&n, &other),
            TokenComparison::Differ {
                step: 2,
                nucleus: 3,
                llama_cpp: 7,
                gap: Some(0.0005)
            }
        );
        let short = result(EngineKind::LlamaCpp, &[1, 2], &[5.0, 4.0]);
        assert_eq!(
            compare_tokens(&n, &short),
            TokenComparison::Differ {
                step: 2,
                nucleus: 3,
                llama_cpp: u32::MAX,
                gap: None
            }
        );
    }

    #[test]
    fn a_round_result_is_one_json_line_and_reads_back() {
        let r = result(EngineKind::LlamaCpp, &[1, 2], &[0.5, 0.25]);
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<RoundResult>(&line).unwrap(), r);
        assert!((r.decode_tokens_per_s(2) - 40.0).abs() < 1e-9);
        assert!((r.prefill_tokens_per_s(2, 8) - 32.0).abs() < 1e-9);
        assert!((r.decode_ms_per_step() - 50.0).abs() < 1e-9);
    }

    #[test]
    fn llama_cpp_without_the_feature_is_a_parameter_error() {
        let config = Config {
            model: PathBuf::from("m.gguf"),
            prompt_tokens: 4,
            gen_tokens: 4,
            batch: 1,
            threads: 1,
            rounds: 1,
            llama_cpp: true,
            kv_cache_dtype: KvCacheDtype::F16,
            llama_flash_attn: FlashAttn::Auto,
        };
        let checked = check_params(&config);
        assert_eq!(checked.is_ok(), LLAMA_CPP_BUILT);
        if let Err(e) = checked {
            assert!(crate::is_param_error(&e), "{e}");
        }
    }
}
