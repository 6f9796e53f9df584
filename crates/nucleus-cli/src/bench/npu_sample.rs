//! `nucleus bench npu-sample`: nucleus-sampling's `top_k_top_p_sample` against the literal
//! sort-based computation ([`reference`](mod@reference)) and the max-pass floor, on the same
//! data in one run, all measurements interleaved (DESIGN.md: speed as ratios against named
//! baselines in one run).
//!
//! Data: the logits of `nucleus bench sampling` ([`Logits::generate`]: normal(0, 3) plus five
//! spikes per row at `row max + U(-2, 8)`), and `q` i.i.d. Exp(1) from the same seed. The
//! scenarios, every row alike: (a) top-k 50; (b) top-p 0.9; (c) top-k 50 + top-p 0.9 + q
//! (by token id, eps 1e-8); and (d) top-p 0.9 on rows without the spikes (normal(0, 3) only),
//! where no single token holds 90% of the mass, so top-p needs its candidate pass and
//! quickselect. `is_need_logits` is off. Times are µs per row: one call over the whole batch
//! divided by the batch, the median over the timed rounds.

pub mod reference;

use std::io::Write;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use nucleus_sampling::npu::{top_k_top_p_sample, TopKTopPSampleOptions};
use nucleus_sampling::LogitsView;
use rayon::prelude::*;

use super::sampling::floors::{self, Isa};
use super::sampling::workload::{Logits, SplitMix64, DEFAULT_SEED};
use super::sampling::{
    check_runs, check_shape, fmt_ratio, fmt_us, interleaved_medians, AUTO_BUDGET, AUTO_MIN_RUNS,
};
use super::try_collect;

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

/// A parameter set, applied to every row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// (a) top-k 50.
    TopK,
    /// (b) top-p 0.9.
    TopP,
    /// (c) top-k 50 + top-p 0.9 + q.
    TopKTopPQ,
    /// (d) top-p 0.9 on rows without spikes.
    TopPFlat,
}

impl Scenario {
    /// Every scenario, in table order.
    pub const ALL: [Scenario; 4] = [
        Scenario::TopK,
        Scenario::TopP,
        Scenario::TopKTopPQ,
        Scenario::TopPFlat,
    ];

    /// `"(a) top-k 50"`, ...
    pub fn label(self) -> &'static str {
        match self {
            Scenario::TopK => "(a) top-k 50",
            Scenario::TopP => "(b) top-p 0.9",
            Scenario::TopKTopPQ => "(c) top-k 50 + top-p 0.9 + q",
            Scenario::TopPFlat => "(d) top-p 0.9, rows without spikes",
        }
    }

    fn top_k(self) -> i32 {
        match self {
            Scenario::TopK | Scenario::TopKTopPQ => 50,
            Scenario::TopP | Scenario::TopPFlat => 0,
        }
    }

    fn top_p(self) -> f32 {
        match self {
            Scenario::TopK => 1.0,
            _ => 0.9,
        }
    }

    fn uses_q(self) -> bool {
        self == Scenario::TopKTopPQ
    }

    fn flat(self) -> bool {
        self == Scenario::TopPFlat
    }
}

/// Who computes a scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// `nucleus_sampling::npu::top_k_top_p_sample`.
    Nucleus,
    /// [`reference::sample_row`] on every row (rows in parallel on the pool).
    SortReference,
}

/// The data of one measurement, built outside the timing.
pub struct NpuBench {
    logits: Logits,
    flat: Vec<f32>,
    q: Vec<f32>,
}

impl NpuBench {
    /// `[batch, vocab]` logits from `seed`, rows without spikes, and `q`.
    ///
    /// # Errors
    /// `vocab` below 64 or above `u32::MAX`, or `batch` 0 (a
    /// [`UsageError`](crate::usage::UsageError)); memory that cannot be had.
    pub fn new(batch: usize, vocab: usize, seed: u64) -> Result<Self> {
        check_shape(batch, vocab)?;
        let logits = Logits::try_generate(batch, vocab, seed)?;
        let cells = logits.data.len();
        let mut rng = SplitMix64::new(seed ^ 0x9_0E5A);
        let flat = try_collect(
            cells,
            std::iter::repeat_with(|| (3.0 * rng.normal()) as f32),
            "the rows without spikes",
        )?;
        let q = try_collect(
            cells,
            std::iter::repeat_with(|| (-(1.0 - rng.next_f64()).ln()) as f32),
            "q",
        )?;
        Ok(Self { logits, flat, q })
    }

    fn data(&self, s: Scenario) -> &[f32] {
        if s.flat() {
            &self.flat
        } else {
            &self.logits.data
        }
    }

    /// Runs `method` on scenario `s` over the whole batch; returns the chosen ids.
    ///
    /// # Errors
    /// A row that nucleus-sampling reports as failed.
    pub fn sample(&self, method: Method, s: Scenario) -> Result<Vec<i64>> {
        let (batch, vocab) = (self.logits.batch, self.logits.vocab);
        let data = self.data(s);
        let q = s.uses_q().then_some(&self.q[..]);
        let eps = nucleus_sampling::npu::DEFAULT_EPS;
        match method {
            Method::Nucleus => {
                let view = LogitsView::dense(data, batch, vocab)?;
                let out = top_k_top_p_sample(
                    &view,
                    &vec![s.top_k(); batch],
                    &vec![s.top_p(); batch],
                    q,
                    None,
                    &TopKTopPSampleOptions::default(),
                )?;
                if let Some(e) = out.row_status.iter().find_map(|r| r.as_ref().err()) {
                    bail!("a row failed: {e}");
                }
                Ok(out.logits_select_idx)
            }
            Method::SortReference => Ok((0..batch)
                .into_par_iter()
                .map(|b| {
                    let row = &data[b * vocab..(b + 1) * vocab];
                    let qr = q.map(|q| &q[b * vocab..(b + 1) * vocab]);
                    i64::from(reference::sample_row(row, s.top_k(), s.top_p(), qr, eps))
                })
                .collect()),
        }
    }

    /// The max-pass floor over every row.
    pub fn floor(&self, isa: Isa) -> Vec<f32> {
        let vocab = self.logits.vocab;
        self.logits
            .data
            .par_chunks(vocab)
            .map(|row| floors::max_pass(isa, row))
            .collect()
    }
}

/// One thing that is timed.
#[derive(Clone, Copy, Debug)]
pub enum Job {
    /// [`NpuBench::floor`] with the widest instruction set.
    Floor,
    /// [`NpuBench::sample`].
    Sample(Method, Scenario),
}

impl NpuBench {
    /// Runs `job` once.
    ///
    /// # Errors
    /// As [`NpuBench::sample`].
    pub fn run_job(&self, job: Job) -> Result<()> {
        match job {
            Job::Floor => {
                std::hint::black_box(self.floor(Isa::best()));
            }
            Job::Sample(m, s) => {
                std::hint::black_box(self.sample(m, s)?);
            }
        }
        Ok(())
    }
}

/// Times every job, interleaved round by round (a slow spell of the machine falls on all of
/// them alike), and returns per job the median µs per row. As `nucleus bench sampling`: a
/// warm-up round, one untimed call before each timed one under 2 ms, `iters` rounds or
/// automatically at least [`AUTO_MIN_RUNS`], more until [`AUTO_BUDGET`] per job.
///
/// # Errors
/// The first job that fails.
pub fn median_us_per_row(bench: &NpuBench, jobs: &[Job], iters: Option<usize>) -> Result<Vec<f64>> {
    interleaved_medians(jobs, bench.logits.batch, iters, |job| bench.run_job(job))
}

/// Working memory per token of a row, per thread (the operator's weights and candidates, the
/// reference's sorted pairs and weights): an estimate, counted in [`buffer_bytes`].
const SCRATCH_BYTES_PER_TOKEN: usize = 24;

/// The bytes of `nucleus bench npu-sample`'s buffers: the logits and their histories, the rows
/// without spikes, `q`, and every thread's working memory; `None` when they overflow `usize`.
pub fn buffer_bytes(batch: usize, vocab: usize, threads: usize) -> Option<usize> {
    let matrix = super::product(&[batch, vocab, 4]);
    super::total(&[
        matrix,
        matrix,
        matrix,
        super::product(&[batch, super::sampling::workload::HISTORY, 4]),
        super::product(&[threads, vocab, SCRATCH_BYTES_PER_TOKEN]),
    ])
}

/// Runs the measurement in a rayon pool of `args.threads` threads and writes a Markdown table
/// to `out`. Every flag is checked, and the buffers' memory reserved ([`super::reserve`]),
/// before any work; before timing, checks that nucleus and the reference choose the same ids.
///
/// # Errors
/// A bad configuration (a [`UsageError`](crate::usage::UsageError)), buffers larger than the
/// memory that can be had, a disagreement between the methods, a failed row or a failed write.
pub fn run(args: &BenchNpuSampleArgs, out: &mut (dyn Write + Send)) -> Result<()> {
    check_runs(args.threads, args.iters)?;
    check_shape(args.batch, args.vocab)?;
    super::reserve(
        buffer_bytes(args.batch, args.vocab, args.threads),
        &format!(
            "--vocab {} x --batch {} on {} thread(s)",
            args.vocab, args.batch, args.threads
        ),
    )?;
    let bench = NpuBench::new(args.batch, args.vocab, DEFAULT_SEED)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build()
        .context("building the thread pool")?;
    pool.install(|| write_table(&bench, args, out))
}

fn write_table(
    bench: &NpuBench,
    args: &BenchNpuSampleArgs,
    out: &mut (dyn Write + Send),
) -> Result<()> {
    for s in Scenario::ALL {
        let a = bench.sample(Method::Nucleus, s)?;
        let b = bench.sample(Method::SortReference, s)?;
        ensure!(
            a == b,
            "{}: nucleus and the sort reference disagree",
            s.label()
        );
    }
    let mut jobs = vec![Job::Floor];
    for s in Scenario::ALL {
        jobs.push(Job::Sample(Method::Nucleus, s));
        jobs.push(Job::Sample(Method::SortReference, s));
    }
    let us = median_us_per_row(bench, &jobs, args.iters)?;
    let max_us = us[0];
    let iters = match args.iters {
        Some(n) => format!("{n} timed runs"),
        None => format!(
            "at least {AUTO_MIN_RUNS} timed runs, more within {} ms per measurement",
            AUTO_BUDGET.as_millis()
        ),
    };
    writeln!(
        out,
        "nucleus bench npu-sample: vocab {}, batch {}, threads {}; µs per row, median of {iters}, all measurements interleaved",
        args.vocab, args.batch, args.threads
    )?;
    writeln!(
        out,
        "floor ({}): max pass {} µs",
        Isa::best().name(),
        fmt_us(max_us)
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| scenario | nucleus µs | sort-ref µs | nucleus/max | sort-ref/nucleus |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|")?;
    for (i, s) in Scenario::ALL.iter().enumerate() {
        let (nucleus, sort) = (us[1 + 2 * i], us[2 + 2 * i]);
        writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            s.label(),
            fmt_us(nucleus),
            fmt_us(sort),
            fmt_ratio(nucleus / max_us),
            fmt_ratio(sort / nucleus),
        )?;
    }
    out.flush()?;
    Ok(())
}
