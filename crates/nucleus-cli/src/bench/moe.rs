//! `nucleus bench moe`: its flags and table (nucleus-bench's [`nucleus_bench::moe`]
//! measures), a row group per shape as it is measured.

use std::io::Write;

use anyhow::Result;
use clap::{Args, ValueEnum};
use nucleus_bench::moe::{Config, MoeEvent};

use super::{fmt_ratio, fmt_us, iters_text};

/// The flags of `nucleus bench moe`.
#[derive(Args, Debug, Clone)]
pub struct BenchMoeArgs {
    /// Tokens per call, N (several: `--rows 1 8 64` or `--rows 1,8,64`).
    #[arg(long, num_args = 1.., value_delimiter = ',', default_values_t = [1usize, 8, 64, 4096])]
    pub rows: Vec<usize>,
    /// Hidden sizes, H (several as for --rows).
    #[arg(long, num_args = 1.., value_delimiter = ',', default_values_t = [2048usize, 7168])]
    pub hidden: Vec<usize>,
    /// Experts per token, K.
    #[arg(long, default_value_t = 8)]
    pub k: usize,
    /// Experts, E.
    #[arg(long, default_value_t = 256)]
    pub experts: usize,
    /// Element type of x and of the expert outputs.
    #[arg(long, value_enum, default_value_t = MoeDtype::Bf16)]
    pub dtype: MoeDtype,
    /// Threads of the rayon pool that every method runs in.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Timed runs per measurement (default: at least 7, more within 0.25 s each); µs are medians.
    #[arg(long)]
    pub iters: Option<usize>,
}

/// `--dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MoeDtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl From<MoeDtype> for nucleus_bench::moe::MoeDtype {
    fn from(d: MoeDtype) -> Self {
        match d {
            MoeDtype::F32 => Self::F32,
            MoeDtype::F16 => Self::F16,
            MoeDtype::Bf16 => Self::Bf16,
        }
    }
}

/// Runs the measurement of every shape (`--rows` x `--hidden`) and writes a Markdown table to
/// `out`, a row group per shape as it is measured.
///
/// # Errors
/// As [`nucleus_bench::moe::run`], or a failed write.
pub fn run(args: &BenchMoeArgs, out: &mut (dyn Write + Send)) -> Result<()> {
    let config = Config {
        rows: args.rows.clone(),
        hidden: args.hidden.clone(),
        k: args.k,
        experts: args.experts,
        dtype: args.dtype.into(),
        threads: args.threads,
        iters: args.iters,
    };
    let dtype = config.dtype.name();
    nucleus_bench::moe::run(&config, &mut |event| {
        match event {
            MoeEvent::Started => {
                writeln!(
                    out,
                    "nucleus bench moe: K {}, E {}, {dtype}, threads {}; µs per call, median of {}, the measurements of each shape interleaved",
                    args.k,
                    args.experts,
                    args.threads,
                    iters_text(args.iters)
                )?;
                writeln!(
                    out,
                    "floors: init = expanded_x's N*K*H {dtype} written once (memcpy of each x row to K consecutive rows of a preallocated buffer); int8 = the same from an int8 x (N*K*H bytes); unpermute = one read of expert_out (N*K*H {dtype}) + one write of out (N*H){}",
                    if args.threads > 1 {
                        "; each the faster of its run on the pool and on one thread"
                    } else {
                        ""
                    }
                )?;
                writeln!(
                    out,
                    "reference (one thread): stable sort_by_key of the routes + a row-copy loop (int8: quantising every expanded row); unpermute: a loop over tokens and k, f32 sums"
                )?;
                writeln!(out)?;
                writeln!(
                    out,
                    "| N | H | operation | floor µs | nucleus µs | reference µs | nucleus/floor | reference/nucleus |"
                )?;
                writeln!(out, "|---:|---:|---|---:|---:|---:|---:|---:|")?;
            }
            MoeEvent::Shape(times) => {
                let (n, h) = (times.shape.n, times.shape.h);
                for op in &times.operations {
                    let (reference, ratio) = match op.reference_us {
                        Some(r) => (fmt_us(r), fmt_ratio(r / op.nucleus_us)),
                        None => (String::new(), String::new()),
                    };
                    writeln!(
                        out,
                        "| {n} | {h} | {} | {} | {} | {reference} | {} | {ratio} |",
                        op.label,
                        fmt_us(op.floor_us),
                        fmt_us(op.nucleus_us),
                        fmt_ratio(op.nucleus_us / op.floor_us),
                    )?;
                }
            }
        }
        out.flush()?;
        Ok(())
    })
}
