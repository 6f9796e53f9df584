//! `nucleus bench npu-sample`: its flags and table (nucleus-bench's
//! [`nucleus_bench::npu_sample`] measures).

use std::io::Write;

use anyhow::Result;
use clap::Args;
use nucleus_bench::npu_sample::Config;

use super::{fmt_ratio, fmt_us, iters_text};

/// The flags of `nucleus bench npu-sample`.
#[derive(Args, Debug, Clone)]
pub struct BenchNpuSampleArgs {
    /// Token ids per row (at least 64).
    #[arg(long, default_value_t = 151_936)]
    pub vocab: usize,
    /// Rows per call.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Threads of the rayon pool that every method runs in.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Timed runs per measurement (default: at least 7, more within 0.25 s each); µs are medians.
    #[arg(long)]
    pub iters: Option<usize>,
}

/// Runs the measurement and writes a Markdown table to `out`.
///
/// # Errors
/// As [`nucleus_bench::npu_sample::run`], or a failed write.
pub fn run(args: &BenchNpuSampleArgs, out: &mut dyn Write) -> Result<()> {
    let report = nucleus_bench::npu_sample::run(&Config {
        vocab: args.vocab,
        batch: args.batch,
        threads: args.threads,
        iters: args.iters,
    })?;
    writeln!(
        out,
        "nucleus bench npu-sample: vocab {}, batch {}, threads {}; µs per row, median of {}, all measurements interleaved",
        args.vocab,
        args.batch,
        args.threads,
        iters_text(args.iters)
    )?;
    writeln!(
        out,
        "floor ({}): max pass {} µs",
        report.isa.name(),
        fmt_us(report.max_us)
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| scenario | nucleus µs | sort-ref µs | nucleus/max | sort-ref/nucleus |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|")?;
    for s in &report.scenarios {
        writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            s.scenario.label(),
            fmt_us(s.nucleus_us),
            fmt_us(s.sort_reference_us),
            fmt_ratio(s.nucleus_us / report.max_us),
            fmt_ratio(s.sort_reference_us / s.nucleus_us),
        )?;
    }
    out.flush()?;
    Ok(())
}
