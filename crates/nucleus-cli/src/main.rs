//! `nucleus`: the command-line tool of the nucleus workspace.
//!
//! `nucleus generate` runs a GGUF Llama model and chooses every token with nucleus-sampling;
//! `nucleus sample` samples logits given as JSON lines or a safetensors tensor
//! (`nucleus_cli::sample`); `nucleus bench sampling` measures the sampler against baselines
//! (`nucleus_cli::bench`); `nucleus grammar validate` checks a text against a grammar
//! (`nucleus_cli::grammar`).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use nucleus_cli::report::{self, Output};
use nucleus_cli::usage::UsageError;
use nucleus_engine::{
    hub, load_model, Engine, EngineConfig, EngineError, FinishReason, GrammarOptions, Request,
    SamplingParams,
};

#[derive(Parser, Debug)]
#[command(
    name = "nucleus",
    version,
    about = "The decode step of LLM inference: logits to tokens, and the loop around it."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text with a model (GGUF file or Hugging Face folder), every token chosen by
    /// nucleus-sampling.
    Generate(GenerateArgs),
    /// Sample real logits: JSON lines in (a file or stdin), one JSON answer per row out.
    Sample(SampleArgs),
    /// Ascend's fused top-k -> top-p -> exponential sampling (npu_top_k_top_p_sample): one
    /// call per JSON line (or a safetensors file), one JSON answer per call.
    TopKTopPSample(nucleus_cli::npu_sample::NpuSampleArgs),
    /// MoE token routing (npu_moe_init_routing_v2): one call per JSON line, one answer per call.
    MoeInitRouting(nucleus_cli::moe_init_routing::MoeInitRoutingArgs),
    /// Measure speed against named baselines on generated data.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Structured output: check texts against JSON Schemas, regular expressions, Lark grammars.
    #[command(subcommand)]
    Grammar(GrammarCommand),
}

#[derive(Subcommand, Debug)]
enum GrammarCommand {
    /// Tokenise a text as a model would generate it and check it against a grammar: prints
    /// `accepted` (exit 0) or where it is rejected (exit 1); errors exit 2.
    Validate(nucleus_cli::grammar::ValidateArgs),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Time nucleus-sampling, a sort-based reference and candle's LogitsProcessor on seeded
    /// synthetic logits, against a max pass and a max+sum-of-exp pass; prints a Markdown table.
    Sampling(BenchSamplingArgs),
    /// Time top_k_top_p_sample against the literal sort-based computation and a max pass;
    /// prints a Markdown table.
    NpuSample(nucleus_cli::bench::npu_sample::BenchNpuSampleArgs),
    /// Time moe_init_routing and moe_token_unpermute against a straightforward reference and
    /// memory-copy floors at decode and prefill shapes; prints a Markdown table.
    Moe(nucleus_cli::bench::moe::BenchMoeArgs),
}

#[derive(Args, Debug)]
struct BenchSamplingArgs {
    /// Token ids per row (at least 64).
    #[arg(long, default_value_t = 151_936)]
    vocab: usize,
    /// Rows sampled per call.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Threads of the rayon pool that every method runs in.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Timed runs per measurement (default: at least 7, more within 0.25 s each); µs are medians.
    #[arg(long)]
    iters: Option<usize>,
}

#[derive(Args, Debug)]
struct SampleArgs {
    /// JSON lines to sample, one row each (default, or `-`: stdin).
    #[arg(long, conflicts_with = "logits")]
    input: Option<PathBuf>,
    /// A safetensors file with a [batch, vocab] tensor named `logits` (f32, f16 or bf16),
    /// instead of JSON lines.
    #[arg(long)]
    logits: Option<PathBuf>,
    /// With --logits only: a JSON file with one params object for every row, or a list of one
    /// per row (default: temperature 1, everything else off). JSON lines carry their own.
    // `requires` alone is not enough: clap lets a required argument be missing when it
    // conflicts with one that is present, so `--input F --params P` needs the conflict too.
    #[arg(long, requires = "logits", conflicts_with = "input")]
    params: Option<PathBuf>,
    /// Add "dist", the full final distribution, to every answer.
    #[arg(long)]
    dist: bool,
    /// `--max-input-bytes`: most bytes of one JSON line and of a --logits or --params file.
    #[command(flatten)]
    limit: nucleus_cli::input::InputLimit,
    /// `--threads`.
    #[command(flatten)]
    threads: nucleus_cli::threads::Threads,
}

#[derive(Args, Debug)]
struct GenerateArgs {
    /// A prompt (repeat the flag for several requests that run together). "" is BOS alone
    /// (an error for a tokenizer that adds no BOS, as Qwen's).
    #[arg(long, required = true, allow_hyphen_values = true)]
    prompt: Vec<String>,
    /// The model: a GGUF file (arch llama, qwen2, qwen3, qwen3moe) or a Hugging Face model
    /// folder (model_type llama, qwen2, qwen3, qwen3_moe, minimind). Default: $NUCLEUS_MODEL, else ggml-org/models
    /// tinyllamas/stories260K.gguf from the Hugging Face hub cache.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Most tokens to generate per completion.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    temperature: f64,
    /// Keep the k most likely tokens (0 or -1: off).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    top_k: i64,
    /// Keep the smallest set of tokens whose probability reaches p (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f64,
    /// Repetition penalty over prompt and generated tokens (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repetition_penalty: f64,
    /// Seed of every request's random stream (default: drawn from the OS per request).
    #[arg(long, allow_negative_numbers = true)]
    seed: Option<u64>,
    /// Completions per prompt; sample j uses sample index j of the seed's stream.
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// Stop when this text is generated (not printed); repeat for several.
    #[arg(long)]
    stop: Vec<String>,
    /// Print the prompt before its completion.
    #[arg(long)]
    echo: bool,
    /// Structured output: the completion is JSON valid under this JSON Schema (the path of a
    /// file holding it, else the schema itself as inline JSON).
    #[arg(long, value_name = "S", conflicts_with_all = ["regex", "grammar"])]
    json_schema: Option<String>,
    /// Structured output: the whole completion matches this regular expression.
    #[arg(
        long,
        value_name = "RE",
        conflicts_with = "grammar",
        allow_hyphen_values = true
    )]
    regex: Option<String>,
    /// Structured output: the completion matches this Lark grammar (llguidance's dialect).
    #[arg(long, value_name = "FILE.lark")]
    grammar: Option<PathBuf>,
    /// With --json-schema: most whitespace characters in a row between JSON tokens (0: compact
    /// JSON; `none`: unbounded). Default 8; an error without --json-schema.
    #[arg(long, value_name = "N", value_parser = nucleus_cli::grammar::parse_max_whitespace)]
    max_whitespace: Option<nucleus_cli::grammar::MaxWhitespace>,
    /// `--max-input-bytes`: most bytes of a --json-schema or --grammar file (not of the GGUF
    /// model).
    #[command(flatten)]
    limit: nucleus_cli::input::InputLimit,
    /// `--threads`.
    #[command(flatten)]
    threads: nucleus_cli::threads::Threads,
}

fn main() -> ExitCode {
    // A bug must not print a backtrace at the user: one line, then exit 101. The hook never
    // panics itself (a panic inside it aborts the process).
    std::panic::set_hook(Box::new(nucleus_cli::report::panic_hook));
    let cli = Cli::parse();
    // The thread count, once, before any pool exists (README.md, "CLI": `--threads`). The
    // benchmarks' own `--threads` sizes the pools they time; it sizes the process's too.
    let explicit = match &cli.command {
        Command::Generate(a) => a.threads.explicit(),
        Command::Sample(a) => a.threads.explicit(),
        Command::TopKTopPSample(a) => a.threads.explicit(),
        Command::MoeInitRouting(a) => a.threads.explicit(),
        Command::Grammar(GrammarCommand::Validate(a)) => a.threads.explicit(),
        Command::Bench(BenchCommand::Sampling(a)) => Some(a.threads.max(1)),
        Command::Bench(BenchCommand::NpuSample(a)) => Some(a.threads.max(1)),
        Command::Bench(BenchCommand::Moe(a)) => Some(a.threads.max(1)),
    };
    if let Err(e) = nucleus_engine::threads::configure(explicit) {
        report::error(&e.to_string());
        return ExitCode::from(nucleus_cli::usage::USAGE_STATUS);
    }
    let result = match cli.command {
        Command::Generate(args) => generate(args),
        Command::Sample(args) => sample(args),
        Command::TopKTopPSample(args) => Ok(nucleus_cli::npu_sample::command(&args)),
        Command::MoeInitRouting(args) => Ok(nucleus_cli::moe_init_routing::command(&args)),
        Command::Bench(BenchCommand::Sampling(args)) => bench_sampling(args),
        Command::Bench(BenchCommand::NpuSample(args)) => {
            nucleus_cli::bench::npu_sample::run(&args, &mut Output(std::io::stdout()))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Bench(BenchCommand::Moe(args)) => {
            nucleus_cli::bench::moe::run(&args, &mut Output(std::io::stdout()))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Grammar(GrammarCommand::Validate(args)) => {
            Ok(nucleus_cli::grammar::validate_command(&args))
        }
    };
    match result {
        Ok(code) => code,
        // The reader went away (`nucleus generate ... | head`): stop quietly, as Unix tools do.
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            // The error and its causes on one line ("cannot read X: No such file"), each once.
            report::error(&nucleus_cli::usage::message(&e));
            // A bad flag value (or a flag without effect) is a usage error, like clap's own.
            if nucleus_cli::usage::is_usage(&e) {
                ExitCode::from(nucleus_cli::usage::USAGE_STATUS)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Runs `nucleus generate`. Exit status 0 when every completion finished (eos, stop, length),
/// 1 when any failed or the model, a grammar file or a prompt cannot be used; 2 (a
/// [`UsageError`]) for a flag value outside its domain or a flag without effect, checked
/// before the model is loaded.
fn generate(args: GenerateArgs) -> Result<ExitCode> {
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..Default::default()
    };
    params
        .validate()
        .map_err(|e| UsageError::new(format!("{e}")))?;
    if args.max_tokens == 0 {
        return Err(UsageError::new("--max-tokens must be at least 1").into());
    }
    if !(1..=nucleus_engine::MAX_SAMPLES_PER_REQUEST).contains(&args.n) {
        return Err(UsageError::new(format!(
            "--n must be in 1..={}, got {}",
            nucleus_engine::MAX_SAMPLES_PER_REQUEST,
            args.n
        ))
        .into());
    }
    if args.stop.iter().any(String::is_empty) {
        return Err(UsageError::new("--stop \"\": an empty stop string never matches").into());
    }
    let max_whitespace =
        nucleus_cli::grammar::max_whitespace_for(args.max_whitespace, args.json_schema.is_some())?;
    let grammar = nucleus_cli::grammar::grammar_spec_from(
        args.json_schema.as_deref(),
        args.regex.as_deref(),
        args.grammar.as_deref(),
        args.limit.max_input_bytes,
    )?;
    let grammar_options = GrammarOptions {
        max_whitespace: max_whitespace.0,
    };
    let path = hub::resolve_model(args.model.as_deref())?;
    let loaded = load_model(&path, &candle_device())?;
    for warning in &loaded.warnings {
        report::warning(&warning.to_string());
    }
    let config = loaded.model.config().clone();
    let mut engine = Engine::new(loaded.model, loaded.tokenizer, EngineConfig::default());

    let streaming = args.prompt.len() == 1 && args.n == 1;
    let mut ids = Vec::new();
    let mut seeds = Vec::new();
    let mut prompt_lens = Vec::new();
    for (index, prompt) in args.prompt.iter().enumerate() {
        // Named as the rest of the output names requests: by index, from 0.
        let info = engine
            .add_request(Request {
                params: params.clone(),
                max_tokens: args.max_tokens,
                stop_strings: args.stop.clone(),
                n: args.n,
                grammar: grammar.clone(),
                grammar_options,
                ..Request::new(prompt.clone())
            })
            .map_err(|e| match e {
                // One grammar for every prompt: its error is not the prompt's.
                EngineError::Grammar(_) => anyhow::Error::new(e),
                e => anyhow::Error::new(e).context(format!("--prompt {index} (request {index})")),
            })?;
        ids.push(info.request_id);
        seeds.push(info.seed);
        prompt_lens.push(info.prompt_ids.len());
    }
    // Before the first step: a run whose KV caches the machine cannot hold is refused here,
    // not aborted midway.
    check_kv_cache(&config, &prompt_lens, args.n, args.max_tokens)?;

    let stdout = std::io::stdout();
    let mut out = Output(stdout.lock());
    if streaming && args.echo {
        write!(out, "{}", args.prompt[0])?;
        out.flush()?;
    }
    // Completions printed whole when several run together: (request, sample) -> text.
    let mut texts: BTreeMap<(u64, u32), String> = BTreeMap::new();
    let mut finished: Vec<(u64, u32, FinishReason, usize)> = Vec::new();
    let mut counts: BTreeMap<(u64, u32), usize> = BTreeMap::new();
    while engine.has_unfinished() {
        for step in engine.step()? {
            let key = (step.request_id, step.sample_index);
            if step.token.is_some() {
                *counts.entry(key).or_default() += 1;
            }
            if streaming {
                write!(out, "{}", step.text)?;
                out.flush()?;
            } else {
                texts.entry(key).or_default().push_str(&step.text);
            }
            if let Some(reason) = step.finish {
                if !streaming {
                    let text = texts.remove(&key).unwrap_or_default();
                    let index = ids.iter().position(|&r| r == key.0).unwrap_or(0);
                    writeln!(out, "--- request {index} sample {} ---", key.1)?;
                    if args.echo {
                        write!(out, "{}", args.prompt[index])?;
                    }
                    writeln!(out, "{text}")?;
                    out.flush()?;
                }
                finished.push((key.0, key.1, reason, counts.get(&key).copied().unwrap_or(0)));
            }
        }
    }
    if streaming {
        writeln!(out)?;
    }
    let m = engine.metrics();
    let rate = |n: usize, t: std::time::Duration| {
        if t.as_secs_f64() > 0.0 {
            n as f64 / t.as_secs_f64()
        } else {
            0.0
        }
    };
    report::note(&format!(
        "prefill: {} tokens in {:.3} s ({:.1} tokens/s)",
        m.prefill_tokens,
        m.prefill_time.as_secs_f64(),
        rate(m.prefill_tokens, m.prefill_time)
    ));
    report::note(&format!(
        "decode: {} tokens in {:.3} s ({:.1} tokens/s); {} tokens generated in all",
        m.decode_tokens,
        m.decode_time.as_secs_f64(),
        rate(m.decode_tokens, m.decode_time),
        m.generated_tokens
    ));
    for (index, seed) in seeds.iter().enumerate() {
        report::note(&format!("request {index}: seed {seed}"));
    }
    finished.sort_by_key(|f| (f.0, f.1));
    let mut failed = false;
    for (request, sample, reason, tokens) in finished {
        let index = ids.iter().position(|&r| r == request).unwrap_or(0);
        let plural = if tokens == 1 { "" } else { "s" };
        report::note(&format!(
            "request {index} sample {sample}: finish reason {reason}, {tokens} token{plural}"
        ));
        failed |= matches!(reason, FinishReason::Error(_));
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Runs `nucleus sample`. Exit status 0 when every row got an answer (a row's error is an
/// answer); 1 for an unreadable or unusable input file and when writing the answers fails (a
/// closed pipe, as in `nucleus sample | head`, ends quietly with 0).
fn sample(args: SampleArgs) -> Result<ExitCode> {
    use nucleus_cli::sample::{run_command, run_jsonl, run_safetensors, Options};
    let options = Options { dist: args.dist };
    let limit = args.limit.max_input_bytes;
    Ok(run_command(
        args.logits.as_deref(),
        args.input.as_deref(),
        |logits, out| run_safetensors(logits, args.params.as_deref(), out, &options, limit),
        |input, out| run_jsonl(input, out, &options, limit),
    ))
}

/// Runs `nucleus bench sampling`: the table goes to stdout.
fn bench_sampling(args: BenchSamplingArgs) -> Result<ExitCode> {
    let config = nucleus_cli::bench::sampling::Config {
        vocab: args.vocab,
        batch: args.batch,
        threads: args.threads,
        iters: args.iters,
        ..Default::default()
    };
    nucleus_cli::bench::sampling::run(&config, &mut Output(std::io::stdout()))?;
    Ok(ExitCode::SUCCESS)
}

/// The positions a sequence's KV cache has room for at its largest, when it starts with
/// `prompt` tokens and grows to `final_len`: nucleus-engine's `KvCache` allocates the prompt's
/// length (at least 16) at prefill, then doubles (at least to the needed length, at most the
/// context length).
fn kv_capacity(prompt: usize, final_len: usize, context: usize) -> usize {
    let mut capacity = prompt.max(16).min(context);
    while capacity < final_len {
        capacity = capacity.saturating_mul(2).min(context);
    }
    capacity
}

/// Refuses a run whose memory the machine cannot hold, before any step: the KV caches of
/// every sequence (prompts x `--n`) at their largest, each `positions x n_layer x 2 (K and V)
/// x n_kv_head x head_dim` f32 values (nucleus-engine's `KvCache` layout; positions: the
/// capacity that holds `min(prompt tokens + --max-tokens, context length)`), one sequence's
/// cache once more (the old storage while it is reallocated), and each sequence's logits row
/// and attention scores, with a margin; checked by reserving that many bytes at once
/// ([`nucleus_cli::memory::can_allocate`], the benchmarks' check).
///
/// # Errors
/// One message with the numbers, when the bytes cannot be had.
fn check_kv_cache(
    config: &nucleus_engine::ModelConfig,
    prompt_lens: &[usize],
    n: usize,
    max_tokens: usize,
) -> Result<()> {
    use nucleus_cli::memory::{can_allocate_checked, gib, with_margin};
    let context = config.context_length;
    let per_position = [config.n_layer, 2, config.n_kv_head, config.head_dim, 4]
        .iter()
        .try_fold(1usize, |p, &f| p.checked_mul(f));
    let capacities: Vec<usize> = prompt_lens
        .iter()
        .map(|&p| kv_capacity(p, p.saturating_add(max_tokens).min(context), context))
        .collect();
    let positions = capacities
        .iter()
        .try_fold(0usize, |sum, &c| sum.checked_add(c.checked_mul(n)?));
    let sequences = prompt_lens.len().saturating_mul(n);
    let largest = capacities.iter().copied().max().unwrap_or(0);
    let cache = positions
        .and_then(|p| p.checked_add(largest))
        .zip(per_position)
        .and_then(|(p, b)| p.checked_mul(b));
    let per_sequence = [config.vocab_size, config.n_head.saturating_mul(context)]
        .iter()
        .try_fold(0usize, |sum, &v| sum.checked_add(v.checked_mul(4)?));
    // An MoE layer's routing buffers for the largest forward: every prompt's prefill at once,
    // or one decode row per sequence (one layer's at a time: they are reused).
    let rows = prompt_lens.iter().sum::<usize>().max(sequences);
    let moe = match &config.moe {
        Some(m) => m.routing_bytes(rows, config.hidden_size),
        None => Some(0),
    };
    let bytes = cache
        .zip(per_sequence.and_then(|b| b.checked_mul(sequences)))
        .and_then(|(c, s)| c.checked_add(s))
        .zip(moe)
        .and_then(|(c, m)| c.checked_add(m))
        .map(with_margin);
    if can_allocate_checked(bytes) {
        return Ok(());
    }
    let shown = |b: Option<usize>| match b {
        Some(b) => format!("{b} bytes ({})", gib(b)),
        None => "more bytes than this machine can address".to_string(),
    };
    let moe_part = match (&config.moe, moe) {
        (Some(m), Some(b)) if b > 0 => format!(
            "; its largest forward ({rows} rows) also needs {} for an MoE layer's routing \
             ({} experts per token, {} experts)",
            shown(Some(b)),
            m.num_experts_per_tok,
            m.num_experts
        ),
        (Some(_), None) => {
            "; its MoE routing needs more bytes than this machine can address".to_string()
        }
        _ => String::new(),
    };
    anyhow::bail!(
        "the KV cache of this run needs {}, which cannot be allocated here: {sequences} \
         sequences ({} prompt(s) x --n {n}), each of up to {largest} positions (its prompt \
         tokens + --max-tokens {max_tokens}, within the model's context of {context}) of {} \
         bytes ({} layers x 2 (K and V) x {} KV heads x {} values x 4 bytes){moe_part}; {} \
         with the logits, the MoE routing (if any) and a margin. Lower --n, --max-tokens or \
         the number of prompts",
        shown(cache),
        prompt_lens.len(),
        per_position.unwrap_or(usize::MAX),
        config.n_layer,
        config.n_kv_head,
        config.head_dim,
        shown(bytes),
    )
}

fn candle_device() -> nucleus_engine::Device {
    nucleus_engine::Device::Cpu
}
