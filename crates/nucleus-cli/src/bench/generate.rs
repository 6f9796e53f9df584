//! `nucleus bench generate`: its flags and table (nucleus-bench's
//! [`nucleus_bench::generate`] measures: what each figure is, and how it is taken).

use std::io::Write;

use anyhow::Result;
use clap::Args;
use nucleus_bench::generate::{spread, Config, Round};

/// The flags of `nucleus bench generate`.
#[derive(Args, Debug, Clone)]
pub struct BenchGenerateArgs {
    /// The model (as `generate --model`; default $NUCLEUS_MODEL, else stories260K from the
    /// hub cache).
    #[arg(long, value_name = "M")]
    pub model: Option<String>,
    /// Prompt tokens per request (seeded random ids).
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Tokens generated per request (greedy; the first comes from the prefill).
    #[arg(long, default_value_t = 32)]
    pub gen_tokens: usize,
    /// Requests that run together.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Threads of the forward pass, the sampler and the bandwidth read.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Rounds (each loads the model and generates); figures are their medians.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
}

/// Runs `nucleus bench generate`, writing a Markdown table to `out`.
///
/// # Errors
/// As [`nucleus_bench::generate::run`], a model that cannot be resolved, a failed write.
pub fn run(args: &BenchGenerateArgs, out: &mut dyn Write) -> Result<()> {
    let config = Config {
        model: crate::model::resolve(args.model.as_deref())?,
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        batch: args.batch,
        threads: args.threads,
        rounds: args.rounds,
    };
    let report = nucleus_bench::generate::run(&config)?;
    let (b, p, g) = (args.batch, args.prompt_tokens, args.gen_tokens);
    writeln!(
        out,
        "model {} ({:.1} MiB of weights as stored), batch {b}, prompt {p} tokens, {g} generated, \
         {} thread(s), {} round(s): median (smallest to largest)",
        config.model.display(),
        report.weight_bytes as f64 / (1024.0 * 1024.0),
        args.threads,
        args.rounds
    )?;
    writeln!(out)?;
    writeln!(out, "| measure | median | spread |")?;
    writeln!(out, "|---|---:|---:|")?;
    let rounds = &report.rounds;
    let row = |out: &mut dyn Write, name: &str, f: &dyn Fn(&Round) -> f64, digits: usize| {
        if let Some(s) = spread(rounds.iter().map(f).collect()) {
            let (m, lo, hi) = (s.median, s.min, s.max);
            writeln!(
                out,
                "| {name} | {m:.digits$} | {lo:.digits$} to {hi:.digits$} |"
            )?;
        }
        Ok::<(), anyhow::Error>(())
    };
    let w = report.weight_bytes;
    row(
        out,
        "prefill tokens/s",
        &|r| r.prefill_tokens_per_s(b, p),
        1,
    )?;
    row(out, "decode tokens/s", &|r| r.decode_tokens_per_s(b), 1)?;
    row(out, "decode ms per step", &|r| r.decode_ms_per_step(), 3)?;
    row(
        out,
        "decode floor ms per step (weights / bandwidth)",
        &|r| r.floor_ms_per_step(w),
        3,
    )?;
    row(out, "read bandwidth GB/s", &|r| r.bandwidth / 1e9, 2)?;
    row(out, "load s", &|r| r.load.as_secs_f64(), 3)?;
    if rounds.iter().all(|r| r.rss.is_some()) {
        row(
            out,
            "resident MiB after generating",
            &|r| r.rss.unwrap_or(0) as f64 / (1024.0 * 1024.0),
            1,
        )?;
    }
    Ok(())
}
