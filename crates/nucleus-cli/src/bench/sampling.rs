//! `nucleus bench sampling`: the workload table, or with `--processors` the processor table
//! (nucleus-bench's [`nucleus_bench::sampling`] measures both).

use std::io::Write;

use anyhow::Result;
use nucleus_bench::sampling::processors::{ProcessorsReport, TARGET};
use nucleus_bench::sampling::{Config, FloorTimes, SamplingReport, SamplingResults, CANDLE_BUILT};

use super::{fmt_ratio, fmt_us, iters_text};

/// Runs the measurement of `config` and writes its table to `out` (Markdown).
///
/// # Errors
/// As [`nucleus_bench::sampling::run`] (a bad parameter is a
/// [`nucleus_bench::ParamError`]), or a failed write.
pub fn run(config: &Config, out: &mut dyn Write) -> Result<()> {
    match nucleus_bench::sampling::run(config)? {
        SamplingResults::Workloads(report) => write_workloads(&report, config, out),
        SamplingResults::Processors(report) => write_processors(&report, config, out),
    }
}

/// The table's first line (`COMMAND: vocab V, batch B, threads N; ...`) and the floors' line:
/// `floors (avx2): max pass X µs, max+sum-exp pass Y µs[; compiled for the build's target like
/// nucleus: ...]`.
fn write_head(
    out: &mut dyn Write,
    command: &str,
    config: &Config,
    floors: &FloorTimes,
) -> Result<()> {
    writeln!(
        out,
        "{command}: vocab {}, batch {}, threads {}; µs per row, median of {}, all measurements interleaved",
        config.vocab,
        config.batch,
        config.threads,
        iters_text(config.iters)
    )?;
    write!(
        out,
        "floors ({}): max pass {} µs, max+sum-exp pass {} µs",
        floors.isa.name(),
        fmt_us(floors.max_us),
        fmt_us(floors.max_sum_exp_us)
    )?;
    if let Some((max, sum_exp)) = floors.baseline {
        write!(
            out,
            "; compiled for the build's target like nucleus: {} µs, {} µs",
            fmt_us(max),
            fmt_us(sum_exp)
        )?;
    }
    writeln!(out)?;
    Ok(())
}

fn write_workloads(report: &SamplingReport, config: &Config, out: &mut dyn Write) -> Result<()> {
    write_head(out, "nucleus bench sampling", config, &report.floors)?;
    writeln!(out)?;
    writeln!(
        out,
        "| workload | nucleus µs | sort-ref µs | candle µs | nucleus/max | nucleus/max+sum-exp | sort-ref/nucleus | candle/nucleus |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|")?;
    let (max_us, sum_exp_us) = (report.floors.max_us, report.floors.max_sum_exp_us);
    for w in &report.workloads {
        let nucleus = w.nucleus_us;
        let (sort, candle) = (w.sort_reference_us, w.candle_us);
        let cell = |v: Option<f64>, f: fn(f64) -> String| v.map_or("n/a".to_string(), f);
        writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            w.label,
            fmt_us(nucleus),
            cell(sort, fmt_us),
            cell(candle, fmt_us),
            fmt_ratio(nucleus / max_us),
            fmt_ratio(nucleus / sum_exp_us),
            cell(sort.map(|s| s / nucleus), fmt_ratio),
            cell(candle.map(|c| c / nucleus), fmt_ratio),
        )?;
    }
    if !CANDLE_BUILT {
        writeln!(out)?;
        writeln!(
            out,
            "candle: not measured, built without feature candle-baseline"
        )?;
    }
    out.flush()?;
    Ok(())
}

fn write_processors(report: &ProcessorsReport, config: &Config, out: &mut dyn Write) -> Result<()> {
    let sum_exp_us = report.floors.max_sum_exp_us;
    write_head(
        out,
        "nucleus bench sampling --processors",
        config,
        &report.floors,
    )?;
    writeln!(
        out,
        "chain: SamplerChain::process with the processor alone (selections: SamplerChain::sample); processor: chain minus the same call with no processor on the same context"
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| processor | context | chain µs | processor µs | chain/max+sum-exp | processor/max+sum-exp | processor within {TARGET}x |"
    )?;
    writeln!(out, "|---|---|---:|---:|---:|---:|---|")?;
    for m in &report.measured {
        let (own, own_ratio, verdict) = match m.processor_us {
            Some(p) => {
                let r = p / sum_exp_us;
                let verdict = if r <= TARGET { "yes" } else { "no" };
                (fmt_us(p), fmt_ratio(r), verdict)
            }
            None => ("-".to_string(), "-".to_string(), "(baseline)"),
        };
        writeln!(
            out,
            "| {} | {} | {} | {own} | {} | {own_ratio} | {verdict} |",
            m.label,
            m.context.name(),
            fmt_us(m.chain_us),
            fmt_ratio(m.chain_us / sum_exp_us),
        )?;
    }
    writeln!(out)?;
    writeln!(out, "chain entries (row 0, JSON):")?;
    for e in &report.entries {
        writeln!(out, "- {} ({}): `{}`", e.label, e.context.name(), e.json)?;
    }
    out.flush()?;
    Ok(())
}
