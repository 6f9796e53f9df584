//! `nucleus`: the command-line tool of the nucleus workspace.
//!
//! `nucleus generate` runs a GGUF Llama model and chooses every token with nucleus-sampling;
//! `nucleus sample` samples logits given as JSON lines or a safetensors tensor
//! (`nucleus_cli::sample`); `nucleus bench sampling` measures the sampler against baselines
//! (`nucleus_cli::bench`); `nucleus grammar validate` checks a text against a grammar
//! (`nucleus_cli::grammar`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use nucleus_cli::report::{self, Output};

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
    Generate(Box<nucleus_cli::generate::GenerateArgs>),
    /// Print the token ids of a text as a model's tokenizer encodes it (a JSON list).
    Tokenize(nucleus_cli::tokenize::TokenizeArgs),
    /// Print the text of token ids (a JSON list) as a model's tokenizer decodes them.
    Detokenize(nucleus_cli::tokenize::DetokenizeArgs),
    /// Print a conversation rendered with a model's chat template, for checking.
    ChatTemplate(nucleus_cli::chat::ChatTemplateArgs),
    /// Sample real logits: JSON lines in (a file or stdin), one JSON answer per row out.
    Sample(SampleArgs),
    /// Ascend's fused top-k -> top-p -> exponential sampling (npu_top_k_top_p_sample): one
    /// call per JSON line (or a safetensors file), one JSON answer per call.
    TopKTopPSample(nucleus_cli::npu_sample::NpuSampleArgs),
    /// Speculative-decoding verification: accept or reject a draft's tokens against the
    /// target model's rows, one request per JSON line, one JSON answer per request.
    SpeculativeVerify(nucleus_cli::speculative_verify::SpeculativeVerifyArgs),
    /// Serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming), with
    /// continuous batching.
    Serve(Box<nucleus_cli::serve::ServeArgs>),
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
    /// Load-test `nucleus serve` over loopback: streams at several concurrencies, clients
    /// that hang up mid-stream, a soak with the server's memory sampled; prints Markdown
    /// tables and exits 1 when a request is lost or a check fails.
    Serve(nucleus_cli::bench::serve::BenchServeArgs),
    /// Time a model's decode loop: load, prefill and decode tokens/s, ms per step against the
    /// floor of reading its weights once, resident memory; medians over rounds.
    Generate(nucleus_cli::bench::generate::BenchGenerateArgs),
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
    /// Instead of the workloads: every chain processor of issue 16 alone in a chain, its own
    /// cost (the chain's minus an empty chain's) against the max+sum-of-exp pass.
    #[arg(long)]
    processors: bool,
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

fn main() -> ExitCode {
    // A bug must not print a backtrace at the user: one line, then exit 101. The hook never
    // panics itself (a panic inside it aborts the process).
    std::panic::set_hook(Box::new(nucleus_cli::report::panic_hook));
    nucleus_cli::memory::tune_malloc();
    let cli = Cli::parse();
    // The thread count, once, before any pool exists (README.md, "CLI": `--threads`). The
    // benchmarks' own `--threads` sizes the pools they time; it sizes the process's too.
    let explicit = match &cli.command {
        Command::Generate(a) => a.threads.explicit(),
        Command::Sample(a) => a.threads.explicit(),
        Command::Tokenize(_) | Command::Detokenize(_) | Command::ChatTemplate(_) => None,
        Command::TopKTopPSample(a) => a.threads.explicit(),
        Command::MoeInitRouting(a) => a.threads.explicit(),
        Command::SpeculativeVerify(a) => a.threads.explicit(),
        Command::Serve(a) => a.threads.explicit(),
        Command::Grammar(GrammarCommand::Validate(a)) => a.threads.explicit(),
        Command::Bench(BenchCommand::Sampling(a)) => Some(a.threads.max(1)),
        Command::Bench(BenchCommand::NpuSample(a)) => Some(a.threads.max(1)),
        Command::Bench(BenchCommand::Moe(a)) => Some(a.threads.max(1)),
        // The server it starts is a process of its own, with its own --threads.
        Command::Bench(BenchCommand::Serve(_)) => None,
        Command::Bench(BenchCommand::Generate(a)) => Some(a.threads.max(1)),
    };
    if let Err(e) = nucleus_engine::threads::configure(explicit) {
        report::error(&e.to_string());
        return ExitCode::from(nucleus_cli::usage::USAGE_STATUS);
    }
    let result = match cli.command {
        Command::Generate(args) => nucleus_cli::generate::run(*args),
        Command::Sample(args) => sample(args),
        Command::Tokenize(args) => nucleus_cli::tokenize::tokenize_command(&args),
        Command::Detokenize(args) => nucleus_cli::tokenize::detokenize_command(&args),
        Command::ChatTemplate(args) => nucleus_cli::chat::chat_template_command(&args),
        Command::TopKTopPSample(args) => Ok(nucleus_cli::npu_sample::command(&args)),
        Command::MoeInitRouting(args) => Ok(nucleus_cli::moe_init_routing::command(&args)),
        Command::SpeculativeVerify(args) => Ok(nucleus_cli::speculative_verify::command(&args)),
        Command::Serve(args) => nucleus_cli::serve::run(&args),
        Command::Bench(BenchCommand::Sampling(args)) => bench_sampling(args),
        Command::Bench(BenchCommand::NpuSample(args)) => {
            nucleus_cli::bench::npu_sample::run(&args, &mut Output(std::io::stdout()))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Bench(BenchCommand::Moe(args)) => {
            nucleus_cli::bench::moe::run(&args, &mut Output(std::io::stdout()))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Bench(BenchCommand::Serve(args)) => {
            nucleus_cli::bench::serve::run(&args, &mut Output(std::io::stdout()))
        }
        Command::Bench(BenchCommand::Generate(args)) => {
            nucleus_cli::bench::generate::run(&args, &mut Output(std::io::stdout()))
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
    let config = nucleus_bench::sampling::Config {
        vocab: args.vocab,
        batch: args.batch,
        threads: args.threads,
        iters: args.iters,
        processors: args.processors,
        ..Default::default()
    };
    nucleus_cli::bench::sampling::run(&config, &mut Output(std::io::stdout()))?;
    Ok(ExitCode::SUCCESS)
}
