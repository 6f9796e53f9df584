//! `nucleus bench sampling`: the speed of nucleus-sampling against named baselines on the same
//! data in one run, as ratios (DESIGN.md: "speed is measured as a ratio against named baselines
//! in one run, and against the memory-bandwidth floor").
//!
//! What runs, per workload of [`workload::workloads`] on [`workload::Logits`]:
//! - [`Method::Nucleus`] is [`nucleus_sampling::sample_batch`];
//! - [`Method::SortReference`] is [`reference`](mod@reference), the full-sort way PyTorch
//!   users and MiniMind sample;
//! - [`Method::Candle`] is candle-transformers' `LogitsProcessor` (feature `candle-baseline`);
//!
//! and the two floors of [`floors`]: a vectorised max pass and a max + sum-of-exp pass.
//! Every method samples all rows of the batch on the current rayon pool (nucleus-sampling's own
//! parallelism; the baselines' rows with `par_iter`), so a pool of N threads serves all of them
//! alike. Times are per row: the time of one batch divided by the batch, the median over
//! repeated timed runs, all measurements interleaved ([`median_us_per_row`]).
//!
//! The criterion benchmark (`benches/sampling.rs`) and the CLI both drive [`Bench`].

pub mod floors;
pub mod processors;
pub mod reference;
pub mod workload;

#[cfg(feature = "candle-baseline")]
pub mod candle;

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nucleus_sampling::{sample_batch, LogitsView, SampleRequest};
use rayon::prelude::*;

use crate::ParamError;
use floors::Isa;
use workload::{Body, Logits, Workload, HISTORY};

/// What `nucleus bench sampling` measures.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Token ids per row.
    pub vocab: usize,
    /// Rows per call.
    pub batch: usize,
    /// Threads of the rayon pool everything runs in.
    pub threads: usize,
    /// Timed runs per measurement; `None`: at least [`AUTO_MIN_RUNS`], until [`AUTO_BUDGET`]
    /// per measurement.
    pub iters: Option<usize>,
    /// Seed of the generated logits.
    pub seed: u64,
    /// Measure the chain processors of issue 16 ([`processors`]) instead of the workloads.
    pub processors: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            vocab: 151_936,
            batch: 1,
            threads: 1,
            iters: None,
            seed: workload::DEFAULT_SEED,
            processors: false,
        }
    }
}

/// Fewest timed runs of an automatic measurement.
pub const AUTO_MIN_RUNS: usize = 7;
/// Most timed runs of an automatic measurement.
pub const AUTO_MAX_RUNS: usize = 2_000;
/// An automatic measurement stops taking rounds once this much time per job was spent (after
/// [`AUTO_MIN_RUNS`] rounds).
pub const AUTO_BUDGET: Duration = Duration::from_millis(250);

/// A sampler measured on the workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// nucleus-sampling's `sample_batch`.
    Nucleus,
    /// The sort-based reference ([`reference`](mod@reference)).
    SortReference,
    /// candle-transformers' `LogitsProcessor`.
    Candle,
}

impl Method {
    /// Every method, in table order.
    pub const ALL: [Method; 3] = [Method::Nucleus, Method::SortReference, Method::Candle];

    /// Short name: `"nucleus"`, `"sort-ref"`, `"candle"`.
    pub fn name(self) -> &'static str {
        match self {
            Method::Nucleus => "nucleus",
            Method::SortReference => "sort-ref",
            Method::Candle => "candle",
        }
    }
}

/// A floor pass over every row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Floor {
    /// [`floors::max_pass`].
    Max(Isa),
    /// [`floors::max_sum_exp_pass`].
    MaxSumExp(Isa),
}

impl Floor {
    /// E.g. `"max pass (avx512)"`.
    pub fn name(self) -> String {
        match self {
            Floor::Max(isa) => format!("max pass ({})", isa.name()),
            Floor::MaxSumExp(isa) => format!("max+sum-exp pass ({})", isa.name()),
        }
    }
}

/// The generated data and everything each method needs, built once, outside the timing.
pub struct Bench {
    logits: Logits,
    /// The flat rows of workload (g).
    flat: Logits,
    #[cfg(feature = "candle-baseline")]
    candle: candle::CandleLogits,
    #[cfg(feature = "candle-baseline")]
    candle_flat: candle::CandleLogits,
}

impl Bench {
    /// Generates `[batch, vocab]` logits from `seed` ([`Logits::try_generate`]) and the candle
    /// tensor holding them.
    ///
    /// # Errors
    /// `vocab` below 64 or above `u32::MAX`, `batch` 0 (a [`ParamError`]), memory that cannot
    /// be had, or candle failing to build the tensor.
    pub fn new(batch: usize, vocab: usize, seed: u64) -> Result<Self> {
        check_shape(batch, vocab)?;
        let logits = Logits::try_generate(batch, vocab, seed)?;
        let flat = Logits::try_generate_body(batch, vocab, seed, Body::Flat)?;
        Ok(Self {
            #[cfg(feature = "candle-baseline")]
            candle: candle::CandleLogits::new(&logits)?,
            #[cfg(feature = "candle-baseline")]
            candle_flat: candle::CandleLogits::new(&flat)?,
            logits,
            flat,
        })
    }

    /// The generated (spiked) logits.
    pub fn logits(&self) -> &Logits {
        &self.logits
    }

    /// The logits `w` reads: the spiked ones, or the flat ones of workload (g).
    pub fn logits_for(&self, w: &Workload) -> &Logits {
        match w.body {
            Body::Spiked => &self.logits,
            Body::Flat => &self.flat,
        }
    }

    #[cfg(feature = "candle-baseline")]
    fn candle_for(&self, w: &Workload) -> &candle::CandleLogits {
        match w.body {
            Body::Spiked => &self.candle,
            Body::Flat => &self.candle_flat,
        }
    }

    /// The repetition-penalty context of row `i` under `w`: the row's previous ids, or none.
    pub fn context(&self, w: &Workload, i: usize) -> &[u32] {
        if w.uses_history {
            &self.logits_for(w).history[i]
        } else {
            &[]
        }
    }

    /// Whether `method` can run `w` (candle: built with feature `candle-baseline`, and candle
    /// has the filters `w` asks for).
    pub fn supports(&self, method: Method, w: &Workload) -> bool {
        match method {
            Method::Nucleus | Method::SortReference => true,
            #[cfg(feature = "candle-baseline")]
            Method::Candle => candle::sampling_for(&w.params, self.logits.vocab).is_some(),
            #[cfg(not(feature = "candle-baseline"))]
            Method::Candle => {
                let _ = w;
                false
            }
        }
    }

    /// Samples every row once with `method` under `w`, rows on the current rayon pool, and
    /// returns one token per row. Every row is at position [`HISTORY`], seed `w.params.seed`.
    ///
    /// # Errors
    /// A row that nucleus-sampling or candle reports as failed, or a method that
    /// [`Bench::supports`] rejects.
    pub fn sample(&self, method: Method, w: &Workload) -> Result<Vec<u32>> {
        let logits = self.logits_for(w);
        let batch = logits.batch;
        let position = HISTORY as u64;
        match method {
            Method::Nucleus => {
                let view = LogitsView::dense(&logits.data, batch, logits.vocab)?;
                let requests: Vec<SampleRequest<'_>> = (0..batch)
                    .map(|i| SampleRequest::new(&w.params, &[], self.context(w, i), position))
                    .collect();
                sample_batch(&view, &requests)?
                    .into_iter()
                    .map(|r| Ok(r?.token))
                    .collect()
            }
            Method::SortReference => Ok((0..batch)
                .into_par_iter()
                .map(|i| {
                    reference::sample_row(logits.row(i), &w.params, self.context(w, i), position)
                })
                .collect()),
            #[cfg(feature = "candle-baseline")]
            Method::Candle => {
                let sampling = candle::sampling_for(&w.params, self.logits.vocab)
                    .with_context(|| format!("candle has no sampler for {}", w.label()))?;
                (0..batch)
                    .into_par_iter()
                    .map(|i| {
                        self.candle_for(w)
                            .sample_row(i, &w.params, &sampling, self.context(w, i))
                    })
                    .collect()
            }
            #[cfg(not(feature = "candle-baseline"))]
            Method::Candle => anyhow::bail!("built without the candle-baseline feature"),
        }
    }

    /// Runs `floor` over every row, rows on the current rayon pool; returns the max (or the sum
    /// of exp) per row.
    pub fn floor(&self, floor: Floor) -> Vec<f32> {
        (0..self.logits.batch)
            .into_par_iter()
            .map(|i| {
                let row = self.logits.row(i);
                match floor {
                    Floor::Max(isa) => floors::max_pass(isa, row),
                    Floor::MaxSumExp(isa) => floors::max_sum_exp_pass(isa, row).1,
                }
            })
            .collect()
    }
}

/// One thing that is timed: a floor pass or a method on a workload, over the whole batch.
#[derive(Clone, Copy, Debug)]
pub enum Job<'a> {
    /// [`Bench::floor`].
    Floor(Floor),
    /// [`Bench::sample`].
    Sample(Method, &'a Workload),
}

impl Bench {
    /// Runs `job` once.
    ///
    /// # Errors
    /// As [`Bench::sample`].
    pub fn run_job(&self, job: Job<'_>) -> Result<()> {
        match job {
            Job::Floor(floor) => {
                std::hint::black_box(self.floor(floor));
            }
            Job::Sample(method, w) => {
                std::hint::black_box(self.sample(method, w)?);
            }
        }
        Ok(())
    }
}

/// Times every job and returns, per job, the median time per row in µs.
///
/// The jobs are interleaved: each round runs every job once, timed, so a slow spell of the
/// machine (another process, a frequency change) falls on all of them alike rather than on
/// whichever was being measured, and the ratios stay fair. A job under 2 ms per call gets one
/// untimed call right before its timed one, so its data are in cache as when it runs alone.
/// Rounds: `iters`, or automatically at least [`AUTO_MIN_RUNS`], then more until
/// [`AUTO_BUDGET`] per job has passed or [`AUTO_MAX_RUNS`] rounds. A warm-up round comes first.
///
/// # Errors
/// The first job that fails.
pub fn median_us_per_row(
    bench: &Bench,
    jobs: &[Job<'_>],
    iters: Option<usize>,
) -> Result<Vec<f64>> {
    interleaved_medians(jobs, bench.logits.batch, iters, |job| bench.run_job(job))
}

/// The timing loop of [`median_us_per_row`] for any jobs (shared with `nucleus bench
/// npu-sample`): `run(job)` makes one call over a batch of `batch` rows; returns per job the
/// median µs per row.
///
/// # Errors
/// The first job that fails.
pub fn interleaved_medians<J: Copy>(
    jobs: &[J],
    batch: usize,
    iters: Option<usize>,
    run: impl Fn(J) -> Result<()>,
) -> Result<Vec<f64>> {
    let per_row = |d: Duration| d.as_secs_f64() * 1e6 / batch as f64;
    let mut last = vec![Duration::ZERO; jobs.len()];
    for (&job, last) in jobs.iter().zip(&mut last) {
        let t = Instant::now();
        run(job)?;
        *last = t.elapsed();
    }
    let (min_rounds, max_rounds) = match iters {
        Some(n) => (n, n),
        None => (AUTO_MIN_RUNS, AUTO_MAX_RUNS),
    };
    let budget = AUTO_BUDGET * jobs.len() as u32;
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); jobs.len()];
    let start = Instant::now();
    let mut rounds = 0;
    while rounds < min_rounds || (rounds < max_rounds && start.elapsed() < budget) {
        for ((&job, last), times) in jobs.iter().zip(&mut last).zip(&mut times) {
            if *last < Duration::from_millis(2) {
                run(job)?;
            }
            let t = Instant::now();
            run(job)?;
            *last = t.elapsed();
            times.push(per_row(*last));
        }
        rounds += 1;
    }
    Ok(times.into_iter().map(median).collect())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `--vocab` in `64..=u32::MAX` and `--batch` at least 1, as [`ParamError`]s.
///
/// # Errors
/// The first flag outside its domain.
pub(crate) fn check_shape(batch: usize, vocab: usize) -> Result<()> {
    if !(64..=u32::MAX as usize).contains(&vocab) {
        bail!(ParamError::new(format!(
            "--vocab {vocab}: must be in 64..=4294967295"
        )));
    }
    if batch == 0 {
        bail!(ParamError::new("--batch must be at least 1"));
    }
    Ok(())
}

/// `--threads` and `--iters` at least 1, as [`ParamError`]s.
///
/// # Errors
/// The first flag outside its domain.
pub(crate) fn check_runs(threads: usize, iters: Option<usize>) -> Result<()> {
    if threads == 0 {
        bail!(ParamError::new("--threads must be at least 1"));
    }
    if iters == Some(0) {
        bail!(ParamError::new("--iters must be at least 1"));
    }
    Ok(())
}

/// Working memory per token of a row, per thread, that the methods keep or take while they
/// sample (nucleus-sampling's scratch, the sort reference's copies and sorted pairs, candle's
/// copy and sort): an estimate, counted in [`buffer_bytes`].
const SCRATCH_BYTES_PER_TOKEN: usize = 48;

/// The bytes of `nucleus bench sampling`'s buffers: the logits (spiked and flat), candle's
/// copy of them, the rows' histories, and every thread's working memory (48 bytes per token,
/// an estimate); `None` when they overflow `usize`.
pub fn buffer_bytes(batch: usize, vocab: usize, threads: usize) -> Option<usize> {
    let logits = crate::memory::product(&[2, batch, vocab, 4]);
    let candle = if cfg!(feature = "candle-baseline") {
        logits
    } else {
        Some(0)
    };
    crate::memory::total(&[
        logits,
        candle,
        crate::memory::product(&[2, batch, HISTORY, 4]),
        crate::memory::product(&[threads, vocab, SCRATCH_BYTES_PER_TOKEN]),
    ])
}

/// Whether candle's `LogitsProcessor` is measured: nucleus-bench was built with feature
/// `candle-baseline`.
pub const CANDLE_BUILT: bool = cfg!(feature = "candle-baseline");

/// The floors' medians, µs per row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FloorTimes {
    /// The instruction set the floors were compiled for ([`Isa::best`]).
    pub isa: Isa,
    /// [`floors::max_pass`] on `isa`.
    pub max_us: f64,
    /// [`floors::max_sum_exp_pass`] on `isa`.
    pub max_sum_exp_us: f64,
    /// Both passes compiled for the build's target, as nucleus is (max, max + sum-of-exp);
    /// `None` when `isa` is that target already ([`Isa::Baseline`]).
    pub baseline: Option<(f64, f64)>,
}

/// The floors of a table, in the order [`FloorTimes`] reads their medians: both passes on
/// [`Isa::best`], then on [`Isa::Baseline`] when that is another.
pub(crate) fn table_floors() -> Vec<Floor> {
    let isa = Isa::best();
    let mut floors = vec![Floor::Max(isa), Floor::MaxSumExp(isa)];
    if isa != Isa::Baseline {
        floors.push(Floor::Max(Isa::Baseline));
        floors.push(Floor::MaxSumExp(Isa::Baseline));
    }
    floors
}

impl FloorTimes {
    /// The floors' times from the first medians of `us`, measured for [`table_floors`].
    fn from_medians(us: &[f64]) -> Self {
        let isa = Isa::best();
        FloorTimes {
            isa,
            max_us: us[0],
            max_sum_exp_us: us[1],
            baseline: (isa != Isa::Baseline).then(|| (us[2], us[3])),
        }
    }
}

/// One workload's medians, µs per row.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadTimes {
    /// [`Workload::label`].
    pub label: String,
    /// [`Method::Nucleus`].
    pub nucleus_us: f64,
    /// [`Method::SortReference`].
    pub sort_reference_us: Option<f64>,
    /// [`Method::Candle`]; `None` where candle has no sampler for the workload or was not
    /// built ([`CANDLE_BUILT`]).
    pub candle_us: Option<f64>,
}

/// What `nucleus bench sampling` measured: the floors, then every workload of
/// [`workload::workloads`] in order.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingReport {
    /// The floors.
    pub floors: FloorTimes,
    /// The workloads, in [`workload::workloads`]'s order.
    pub workloads: Vec<WorkloadTimes>,
}

/// The results of [`run`]: the workload table, or with [`Config::processors`] the processor
/// table.
#[derive(Clone, Debug)]
pub enum SamplingResults {
    /// [`measure_workloads`].
    Workloads(SamplingReport),
    /// [`processors::measure_table`].
    Processors(processors::ProcessorsReport),
}

/// Runs the whole measurement of `config` in a rayon pool of `config.threads` threads: the
/// workloads against the baselines, or with `config.processors` the processors
/// ([`processors::measure_table`]). Every parameter is checked, and the buffers' memory
/// reserved ([`crate::reserve`]), before any work.
///
/// # Errors
/// A bad configuration (zero threads, batch or iterations; vocab below 64: a
/// [`ParamError`]), buffers larger than the memory that can be had, or a failed row.
pub fn run(config: &Config) -> Result<SamplingResults> {
    check_runs(config.threads, config.iters)?;
    check_shape(config.batch, config.vocab)?;
    let bytes = if config.processors {
        processors::buffer_bytes(config.batch, config.vocab)
    } else {
        buffer_bytes(config.batch, config.vocab, config.threads)
    };
    crate::reserve(
        bytes,
        &format!(
            "--vocab {} x --batch {} on {} thread(s)",
            config.vocab, config.batch, config.threads
        ),
    )?;
    let bench = Bench::new(config.batch, config.vocab, config.seed)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(config.threads)
        .build()
        .context("building the thread pool")?;
    if config.processors {
        pool.install(|| processors::measure_table(&bench, config).map(SamplingResults::Processors))
    } else {
        pool.install(|| measure_workloads(&bench, config.iters).map(SamplingResults::Workloads))
    }
}

/// Times the floors and every method on every workload it supports, all interleaved
/// ([`median_us_per_row`]), on the current rayon pool.
///
/// # Errors
/// A row that fails.
pub fn measure_workloads(bench: &Bench, iters: Option<usize>) -> Result<SamplingReport> {
    let mut jobs: Vec<Job<'_>> = table_floors().into_iter().map(Job::Floor).collect();
    let floor_count = jobs.len();
    let workloads = workload::workloads();
    for w in &workloads {
        for method in Method::ALL {
            if bench.supports(method, w) {
                jobs.push(Job::Sample(method, w));
            }
        }
    }
    let us = median_us_per_row(bench, &jobs, iters)?;
    let sample_us = |method: Method, w: &Workload| -> Option<f64> {
        jobs.iter()
            .zip(&us)
            .skip(floor_count)
            .find_map(|(job, &t)| match job {
                Job::Sample(m, jw) if *m == method && jw.id == w.id => Some(t),
                _ => None,
            })
    };
    let rows = workloads
        .iter()
        .map(|w| {
            Ok(WorkloadTimes {
                label: w.label(),
                nucleus_us: sample_us(Method::Nucleus, w).context("nucleus runs every workload")?,
                sort_reference_us: sample_us(Method::SortReference, w),
                candle_us: sample_us(Method::Candle, w),
            })
        })
        .collect::<Result<_>>()?;
    Ok(SamplingReport {
        floors: FloorTimes::from_medians(&us),
        workloads: rows,
    })
}
