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

use anyhow::{bail, ensure, Context, Result};
use nucleus_sampling::npu::{top_k_top_p_sample, TopKTopPSampleOptions};
use nucleus_sampling::LogitsView;
use rayon::prelude::*;

use super::sampling::floors::{self, Isa};
use super::sampling::workload::{Logits, SplitMix64, DEFAULT_SEED};
use super::sampling::{check_runs, check_shape, interleaved_medians};
use crate::try_collect;

/// What `nucleus bench npu-sample` measures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Token ids per row (at least 64).
    pub vocab: usize,
    /// Rows per call (at least 1).
    pub batch: usize,
    /// Threads of the rayon pool that every method runs in (at least 1).
    pub threads: usize,
    /// Timed runs per measurement (`None`: at least [`AUTO_MIN_RUNS`](crate::sampling::AUTO_MIN_RUNS), more within
    /// [`AUTO_BUDGET`](crate::sampling::AUTO_BUDGET) each); µs are medians.
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
    /// [`ParamError`](crate::ParamError)); memory that cannot be had.
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
/// automatically at least [`AUTO_MIN_RUNS`](crate::sampling::AUTO_MIN_RUNS), more until [`AUTO_BUDGET`](crate::sampling::AUTO_BUDGET) per job.
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
    let matrix = crate::memory::product(&[batch, vocab, 4]);
    crate::memory::total(&[
        matrix,
        matrix,
        matrix,
        crate::memory::product(&[batch, super::sampling::workload::HISTORY, 4]),
        crate::memory::product(&[threads, vocab, SCRATCH_BYTES_PER_TOKEN]),
    ])
}

/// One scenario's medians, µs per row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScenarioTimes {
    /// The scenario.
    pub scenario: Scenario,
    /// [`Method::Nucleus`].
    pub nucleus_us: f64,
    /// [`Method::SortReference`].
    pub sort_reference_us: f64,
}

/// What `nucleus bench npu-sample` measured.
#[derive(Clone, Debug, PartialEq)]
pub struct NpuReport {
    /// The instruction set of the max pass ([`Isa::best`]).
    pub isa: Isa,
    /// The max pass floor, µs per row.
    pub max_us: f64,
    /// Every scenario of [`Scenario::ALL`], in order.
    pub scenarios: Vec<ScenarioTimes>,
}

/// Runs the measurement in a rayon pool of `config.threads` threads. Every parameter is
/// checked, and the buffers' memory reserved ([`crate::reserve`]), before any work; before
/// timing, checks that nucleus and the reference choose the same ids.
///
/// # Errors
/// A bad configuration (a [`ParamError`](crate::ParamError)), buffers larger than the memory
/// that can be had, a disagreement between the methods, or a failed row.
pub fn run(config: &Config) -> Result<NpuReport> {
    check_runs(config.threads, config.iters)?;
    check_shape(config.batch, config.vocab)?;
    crate::reserve(
        buffer_bytes(config.batch, config.vocab, config.threads),
        &format!(
            "--vocab {} x --batch {} on {} thread(s)",
            config.vocab, config.batch, config.threads
        ),
    )?;
    let bench = NpuBench::new(config.batch, config.vocab, DEFAULT_SEED)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(config.threads)
        .build()
        .context("building the thread pool")?;
    pool.install(|| measure(&bench, config.iters))
}

/// Checks that nucleus and the reference agree on every scenario, then times the floor and
/// both methods on every scenario, interleaved, on the current rayon pool.
///
/// # Errors
/// A disagreement, or a failed row.
pub fn measure(bench: &NpuBench, iters: Option<usize>) -> Result<NpuReport> {
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
    let us = median_us_per_row(bench, &jobs, iters)?;
    Ok(NpuReport {
        isa: Isa::best(),
        max_us: us[0],
        scenarios: Scenario::ALL
            .iter()
            .enumerate()
            .map(|(i, &scenario)| ScenarioTimes {
                scenario,
                nucleus_us: us[1 + 2 * i],
                sort_reference_us: us[2 + 2 * i],
            })
            .collect(),
    })
}
