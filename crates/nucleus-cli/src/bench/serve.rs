//! `nucleus bench serve`: its flags and tables; the load driver is nucleus-bench's
//! ([`nucleus_bench::serve`]: what is measured and checked).

use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use nucleus_bench::serve::{Config, PhaseRow, ServeEvent};

/// Which OpenAI route the requests use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Route {
    /// `POST /v1/completions` with the prompt as text.
    Completions,
    /// `POST /v1/chat/completions` with the prompt as one user message (the model needs a
    /// chat template).
    Chat,
}

/// The flags of `nucleus bench serve`.
#[derive(Args, Debug)]
pub struct BenchServeArgs {
    /// The model to serve: a GGUF file, a Hugging Face folder or a hub id (default:
    /// $NUCLEUS_MODEL).
    #[arg(long)]
    pub model: Option<String>,
    /// The route the requests use.
    #[arg(long, value_enum, default_value_t = Route::Completions)]
    pub endpoint: Route,
    /// The prompt of every request.
    #[arg(long, default_value = "Once upon a time")]
    pub prompt: String,
    /// Tokens generated per request (`max_tokens`, with `ignore_eos`).
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// The load phase's concurrent streams: one run per value, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub concurrency: Vec<usize>,
    /// Requests of each load run (0: no load phase).
    #[arg(long, default_value_t = 500)]
    pub requests: usize,
    /// Requests of the fault phase (0: no fault phase).
    #[arg(long, default_value_t = 200)]
    pub fault_requests: usize,
    /// Concurrent streams of the fault phase.
    #[arg(long, default_value_t = 32)]
    pub fault_concurrency: usize,
    /// The share of the fault phase's requests that hang up mid-stream (spread evenly: 0.2 is
    /// every fifth), each after 1 to max_tokens/2 chunks of text (so the fault phase needs
    /// --max-tokens 8 or more).
    #[arg(long, default_value_t = 0.2)]
    pub disconnect_fraction: f64,
    /// Seconds of the soak phase (0: no soak phase; at most a week).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=604_800))]
    pub soak_seconds: u64,
    /// Concurrent streams of the soak phase.
    #[arg(long, default_value_t = 8)]
    pub soak_concurrency: usize,
    /// Seconds between two samples of the server's resident memory in the soak (at most half
    /// the soak).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=302_400))]
    pub rss_interval: u64,
    /// The most the server's resident memory may grow in the soak, in MiB: the largest sample
    /// against the first sample at or after the warm-up (a sixth of the soak, at most 60 s).
    #[arg(long, default_value_t = 32)]
    pub max_rss_growth_mib: u64,
    /// The server's `--max-num-seqs`.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_num_seqs: u32,
    /// The server's `--max-queue`.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// The server's `--threads` (default: its own default).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub threads: Option<u32>,
    /// Seconds one request may take before it counts as lost (at most a day).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub request_timeout: u64,
}

impl From<Route> for nucleus_bench::serve::Route {
    fn from(r: Route) -> Self {
        match r {
            Route::Completions => Self::Completions,
            Route::Chat => Self::Chat,
        }
    }
}

const HEADER: &str = "| phase | streams | requests | 200 | 4xx | 503 | 5xx | lost | hung up | req/s | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |";
const RULE: &str = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

/// Seconds as milliseconds for a cell, `-` for none (`NaN`).
fn ms(s: f64) -> String {
    if s.is_nan() {
        "-".into()
    } else {
        format!("{:.2}", s * 1e3)
    }
}

fn write_row(out: &mut dyn Write, r: &PhaseRow) -> Result<()> {
    writeln!(
        out,
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.0} | {} | {} | {} | {} |",
        r.phase,
        r.streams,
        r.sent,
        r.ok,
        r.c4xx,
        r.c503,
        r.c5xx,
        r.lost,
        r.hung_up,
        r.requests_per_s,
        r.tokens_per_s,
        ms(r.ttft_p50),
        ms(r.ttft_p99),
        ms(r.itl_p50),
        ms(r.itl_p99),
    )?;
    out.flush()?;
    Ok(())
}

/// Runs `nucleus bench serve` (this binary's `serve` as the server): tables on `out`; exit
/// status 1 when a check fails (each failure an `error:` line).
///
/// # Errors
/// Flags out of range (usage, exit 2); the model cannot be resolved; the server does not
/// start; writing fails.
pub fn run(args: &BenchServeArgs, out: &mut dyn Write) -> Result<ExitCode> {
    let config = Config {
        server_binary: std::env::current_exe().context("finding the nucleus binary")?,
        model: crate::model::resolve(args.model.as_deref())?,
        endpoint: args.endpoint.into(),
        prompt: args.prompt.clone(),
        max_tokens: args.max_tokens,
        concurrency: args.concurrency.clone(),
        requests: args.requests,
        fault_requests: args.fault_requests,
        fault_concurrency: args.fault_concurrency,
        disconnect_fraction: args.disconnect_fraction,
        soak_seconds: args.soak_seconds,
        soak_concurrency: args.soak_concurrency,
        rss_interval: args.rss_interval,
        max_rss_growth_mib: args.max_rss_growth_mib,
        max_num_seqs: args.max_num_seqs,
        max_queue: args.max_queue,
        threads: args.threads,
        request_timeout: args.request_timeout,
    };
    let report = nucleus_bench::serve::run(&config, &mut |event| {
        match event {
            ServeEvent::Started(s) => {
                writeln!(
                    out,
                    "nucleus bench serve: {} over {} at {}: {} tokens per request \
                     (ignore_eos, temperature 1, a seed each), server --max-num-seqs {} \
                     --max-queue {}\n",
                    s.model, s.path, s.base, args.max_tokens, args.max_num_seqs, args.max_queue
                )?;
                writeln!(out, "{HEADER}\n{RULE}")?;
            }
            ServeEvent::Phase(row) => write_row(out, &row)?,
        }
        Ok(())
    })?;
    writeln!(out)?;
    if let Some(f) = &report.faults {
        writeln!(
            out,
            "faults: {} of {} requests hung up mid-stream, {} of the other {} completed; the \
             server aborted {} and was back at 0 running and 0 waiting {:.0} ms after the last \
             answer",
            f.hung_up,
            f.sent,
            f.completed,
            f.others,
            f.aborted,
            f.drained_s * 1e3
        )?;
    }
    match &report.soak {
        None => {}
        Some(None) => writeln!(
            out,
            "soak: the server's resident memory cannot be read here (no /proc)"
        )?,
        Some(Some(m)) => {
            writeln!(
                out,
                "soak: {} s at {} streams, {} requests; server RSS (MiB) at start {:.1}, after \
                 the {:.0} s warm-up {:.1}, highest {:.1}, last {:.1}: growth after warm-up \
                 {:.1} MiB (bound {} MiB)",
                m.seconds,
                m.streams,
                m.requests,
                m.start_mib,
                m.warm_up_s,
                m.after_warm_up_mib,
                m.highest_mib,
                m.last_mib,
                m.growth_mib,
                m.bound_mib
            )?;
            let series: Vec<String> = m
                .samples
                .iter()
                .map(|&(t, mib)| format!("{t:.0}s {mib:.1}"))
                .collect();
            writeln!(out, "soak: RSS samples: {}", series.join(", "))?;
        }
    }
    if report.failures.is_empty() {
        writeln!(out, "\nall checks passed")?;
        Ok(ExitCode::SUCCESS)
    } else {
        for f in &report.failures {
            crate::report::error(f);
        }
        Ok(ExitCode::FAILURE)
    }
}
