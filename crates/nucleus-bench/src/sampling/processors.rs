//! `nucleus bench sampling --processors`: the processors of nucleus-sampling's chain catalogue
//! (issue 16), each alone in a [`SamplerChain`], against the floors of [`super::floors`].
//!
//! Each [`Case`] is one chain entry ([`ProcessorConfig`], the JSON form a user writes) on one
//! [`ContextKind`]; what is timed, per row, is
//! - for a processor: [`SamplerChain::process`] of a chain holding just that processor (its
//!   checks, the copy of the row, the processor, the final check and maximum);
//! - for a selection (mirostat v1 / v2, adaptive-p): [`SamplerChain::sample`] of a chain with no
//!   processor and that selection;
//! - for the `reset + process` cases: [`SamplerChain::reset`] with the prompt, an
//!   [`SamplerChain::accept`] of each output id, then the process (where a processor's cost
//!   linear in the context lies at reset, as no-repeat-ngram's index).
//!
//! The chain's own cost is measured too, by the same call on a chain with no processor on the
//! same context ([`Case::is_baseline`]; for selections a plain `sample` chain), and subtracted:
//! the table gives both the chain's time and the processor's own (the difference of the two
//! medians). Everything is interleaved with the two floors by [`super::interleaved_medians`],
//! as the workload table is, and the ratios are to the max + sum-of-exp pass.
//!
//! Every row of the batch has its own chain per case, reset with that row's context and left
//! so: no timed call changes a chain's state (`process` and `sample` without `accept` leave
//! it as it was), so every timed call does the same work. Rows run on the current rayon pool.

use std::sync::Mutex;

use anyhow::{anyhow, Context, Result};
use nucleus_sampling::chain::{ProcessorConfig, ProcessorContext, SamplerChain, Selection};
use nucleus_sampling::LogprobsKind;
use rayon::prelude::*;

use super::workload::{Logits, SplitMix64, HISTORY, SAMPLE_SEED};
use super::{interleaved_medians, Bench, Config, Floor, FloorTimes};

/// Ids of a long context ([`ContextKind::LongRandom`], [`ContextKind::LongRepeating`]).
pub const LONG_CONTEXT: usize = 4_096;

/// The last ids of every context that count as generated (`output_ids`); the rest is the
/// prompt.
pub const OUTPUT_IDS: usize = 32;

/// The target of issue 16, point 5: a processor within this many max + sum-of-exp passes.
pub const TARGET: f64 = 3.0;

/// Qwen2's ids of llama.cpp's default DRY breakers `"\n"`, `":"`, `"\""`, `"*"` (byte-level
/// BPE: 198, 25, 1, 9), each a single-token breaker; reduced modulo the vocabulary on a
/// smaller one ([`fit`]).
const QWEN_BREAKERS: [u32; 4] = [198, 25, 1, 9];
/// Qwen2's `<|im_end|>` and `<|endoftext|>`.
const QWEN_EOS: [u32; 2] = [151_645, 151_643];

/// `id` on a vocabulary of `vocab` ids: `id mod vocab`.
fn fit(id: u32, vocab: usize) -> u32 {
    (id as usize % vocab) as u32
}

/// The token ids a case's chain sees as the sequence so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContextKind {
    /// The workload's [`HISTORY`] = 256 previous ids of the row (uniform, repeats allowed).
    Workload,
    /// [`LONG_CONTEXT`] ids: 3,840 further uniform ids, then the row's 256.
    LongRandom,
    /// [`LONG_CONTEXT`] ids: the row's 256 ids sixteen times over, so that every suffix has
    /// occurred before (DRY penalises, no-repeat-ngram bans).
    LongRepeating,
}

impl ContextKind {
    /// `"256 ids"`, `"4,096 ids, random"`, `"4,096 ids, repeating"`.
    pub fn name(self) -> &'static str {
        match self {
            ContextKind::Workload => "256 ids",
            ContextKind::LongRandom => "4,096 ids, random",
            ContextKind::LongRepeating => "4,096 ids, repeating",
        }
    }

    /// Row `row`'s context ids.
    fn ids(self, logits: &Logits, row: usize, seed: u64) -> Vec<u32> {
        let history = &logits.history[row];
        match self {
            ContextKind::Workload => history.clone(),
            ContextKind::LongRandom => {
                let mut rng = SplitMix64::new(seed ^ 0x4C4F_4E47 ^ (row as u64).rotate_left(32));
                let mut ids: Vec<u32> = (0..LONG_CONTEXT - HISTORY)
                    .map(|_| rng.below(logits.vocab as u64) as u32)
                    .collect();
                ids.extend_from_slice(history);
                ids
            }
            ContextKind::LongRepeating => {
                history.iter().copied().cycle().take(LONG_CONTEXT).collect()
            }
        }
    }
}

/// What a case times per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// [`SamplerChain::process`].
    Process,
    /// [`SamplerChain::sample`] (a selection, or the plain `sample` chain).
    Sample,
    /// [`SamplerChain::reset`] with the prompt, `accept` of each output id, then
    /// [`SamplerChain::process`].
    ResetProcess,
}

impl Step {
    /// The baseline a case of this step is compared with: the same call on a chain with no
    /// processor ([`Step::ResetProcess`]: the plain process, the reset of an empty chain
    /// costing nothing).
    fn baseline(self) -> Step {
        match self {
            Step::Sample => Step::Sample,
            Step::Process | Step::ResetProcess => Step::Process,
        }
    }
}

/// A row's context as the case builders see it.
pub struct RowContext<'a> {
    /// The prompt's ids.
    pub prompt: &'a [u32],
    /// The generated ids.
    pub output: &'a [u32],
    /// Ids of the vocabulary.
    pub vocab: usize,
}

impl RowContext<'_> {
    /// The last `n` ids of prompt ++ output.
    fn tail(&self, n: usize) -> Vec<u32> {
        let all: Vec<u32> = self.prompt.iter().chain(self.output).copied().collect();
        all[all.len().saturating_sub(n)..].to_vec()
    }
}

/// One row of the processor table.
pub struct Case {
    /// E.g. `"dry 0.8"`.
    pub label: &'static str,
    /// The sequence the chain sees.
    pub context: ContextKind,
    /// How many of the context's last ids are output ids ([`OUTPUT_IDS`], or 0 for the first
    /// generated step).
    pub output: usize,
    /// What is timed.
    pub step: Step,
    /// The chain entry for a row's context; `None`: the chain with no processor (a baseline).
    pub entry: Option<fn(&RowContext<'_>) -> ProcessorConfig>,
}

impl Case {
    /// Whether this is a chain with no processor, which the others are compared with.
    pub fn is_baseline(&self) -> bool {
        self.entry.is_none()
    }

    fn new(label: &'static str, step: Step, entry: fn(&RowContext<'_>) -> ProcessorConfig) -> Self {
        Self {
            label,
            context: ContextKind::Workload,
            output: OUTPUT_IDS,
            step,
            entry: Some(entry),
        }
    }

    fn on(mut self, context: ContextKind) -> Self {
        self.context = context;
        self
    }

    fn baseline(label: &'static str, step: Step, context: ContextKind) -> Self {
        Self {
            label,
            context,
            output: OUTPUT_IDS,
            step,
            entry: None,
        }
    }

    /// The chain of this case for one row: its entry (a processor after which the chain
    /// samples with seed [`SAMPLE_SEED`], or the selection) or none.
    ///
    /// # Errors
    /// The entry's parameters out of range.
    fn chain(&self, ctx: &RowContext<'_>) -> Result<SamplerChain> {
        let plain = Selection::sample(Some(SAMPLE_SEED));
        let Some(entry) = self.entry else {
            return Ok(SamplerChain::new(plain));
        };
        let entry = entry(ctx);
        if let Some(selection) = entry.to_selection() {
            selection
                .validate()
                .with_context(|| format!("{}: {entry:?}", self.label))?;
            return Ok(SamplerChain::new(selection));
        }
        let mut chain = SamplerChain::new(plain);
        if let Some(p) = entry
            .to_processor()
            .with_context(|| format!("{}: {entry:?}", self.label))?
        {
            chain.push_boxed(p);
        }
        Ok(chain)
    }
}

/// A selection entry's common fields: one sample, seed [`SAMPLE_SEED`], no logprobs.
macro_rules! selection {
    ($variant:ident { $($field:ident: $value:expr),* }) => {
        ProcessorConfig::$variant {
            $($field: $value,)*
            seed: Some(SAMPLE_SEED),
            n: 1,
            logprobs: None,
            logprobs_kind: LogprobsKind::Processed,
        }
    };
}

/// DRY with llama.cpp's defaults (base 1.75, allowed length 2, the whole history) at
/// multiplier 0.8, the default breakers as single Qwen2 ids.
fn dry(ctx: &RowContext<'_>) -> ProcessorConfig {
    ProcessorConfig::Dry {
        multiplier: 0.8,
        base: 1.75,
        allowed_length: 2,
        penalty_last_n: -1,
        sequence_breakers: Some(
            QWEN_BREAKERS
                .iter()
                .map(|&id| vec![fit(id, ctx.vocab)])
                .collect(),
        ),
    }
}

fn no_repeat_ngram(_: &RowContext<'_>) -> ProcessorConfig {
    ProcessorConfig::NoRepeatNGram { ngram_size: 3 }
}

fn encoder_no_repeat_ngram(_: &RowContext<'_>) -> ProcessorConfig {
    ProcessorConfig::EncoderNoRepeatNGram {
        encoder_ngram_size: 3,
    }
}

/// Every case of the table, in order: the baselines, then the families of issue 16.
pub fn cases() -> Vec<Case> {
    use ContextKind::{LongRandom, LongRepeating};
    use Step::{Process, ResetProcess, Sample};
    vec![
        Case::baseline("chain, no processor", Process, ContextKind::Workload),
        Case::baseline("chain, no processor", Process, LongRandom),
        Case::baseline("chain, no processor", Process, LongRepeating),
        Case::baseline("sample chain, no processor", Sample, ContextKind::Workload),
        // repetition.rs
        Case::new("dry 0.8", Process, dry),
        Case::new("dry 0.8", Process, dry).on(LongRandom),
        Case::new("dry 0.8", Process, dry).on(LongRepeating),
        Case::new("no_repeat_ngram 3", Process, no_repeat_ngram),
        Case::new("no_repeat_ngram 3", Process, no_repeat_ngram).on(LongRepeating),
        Case::new(
            "no_repeat_ngram 3, reset + process",
            ResetProcess,
            no_repeat_ngram,
        ),
        Case::new(
            "no_repeat_ngram 3, reset + process",
            ResetProcess,
            no_repeat_ngram,
        )
        .on(LongRepeating),
        Case::new(
            "encoder_no_repeat_ngram 3",
            Process,
            encoder_no_repeat_ngram,
        ),
        Case::new(
            "encoder_no_repeat_ngram 3",
            Process,
            encoder_no_repeat_ngram,
        )
        .on(LongRepeating),
        // stochastic.rs
        Case::new("xtc 0.1, probability 1", Process, |_| {
            ProcessorConfig::Xtc {
                threshold: 0.1,
                probability: 1.0,
                min_keep: 1,
            }
        }),
        Case::new("mirostat v1, tau 5", Sample, |_| {
            selection!(Mirostat {
                tau: 5.0,
                eta: 0.1,
                m: 100
            })
        }),
        Case::new("mirostat v2, tau 5", Sample, |_| {
            selection!(MirostatV2 { tau: 5.0, eta: 0.1 })
        }),
        Case::new("adaptive_p 0.5", Sample, |_| {
            selection!(AdaptiveP {
                target: 0.5,
                decay: 0.9
            })
        }),
        // temperature.rs
        Case::new("temperature 0.8", Process, |_| {
            ProcessorConfig::Temperature { t: 0.8 }
        }),
        Case::new("dynatemp 1 +- 0.5", Process, |_| {
            ProcessorConfig::Dynatemp {
                t: 1.0,
                range: 0.5,
                exponent: 1.0,
            }
        }),
        Case::new("typical 0.9", Process, |_| ProcessorConfig::Typical {
            p: 0.9,
            min_keep: 1,
        }),
        Case::new("eta 3e-4", Process, |_| ProcessorConfig::Eta {
            epsilon: 3e-4,
            min_keep: 1,
        }),
        Case::new("top_h 0.4", Process, |_| ProcessorConfig::TopH {
            top_h: 0.4,
        }),
        Case::new("log_softmax", Process, |_| ProcessorConfig::LogSoftmax {}),
        // filters.rs
        Case::new("top_n_sigma 1", Process, |_| ProcessorConfig::TopNSigma {
            n: 1.0,
        }),
        Case::new("epsilon 3e-4", Process, |_| ProcessorConfig::Epsilon {
            epsilon: 3e-4,
            min_keep: 1,
        }),
        Case::new("top_k 50", Process, |_| ProcessorConfig::TopK {
            k: 50,
            min_keep: 1,
        }),
        Case::new("top_k 50, min_keep 5", Process, |_| ProcessorConfig::TopK {
            k: 50,
            min_keep: 5,
        }),
        Case::new("top_p 0.9", Process, |_| ProcessorConfig::TopP {
            p: 0.9,
            min_keep: 1,
        }),
        Case::new("top_p 0.9, min_keep 5", Process, |_| {
            ProcessorConfig::TopP {
                p: 0.9,
                min_keep: 5,
            }
        }),
        Case::new("min_p 0.05", Process, |_| ProcessorConfig::MinP {
            p: 0.05,
            min_keep: 1,
        }),
        Case::new("min_p 0.05, min_keep 5", Process, |_| {
            ProcessorConfig::MinP {
                p: 0.05,
                min_keep: 5,
            }
        }),
        // penalties.rs
        Case::new("repetition_penalty 1.1", Process, |_| {
            ProcessorConfig::RepetitionPenalty {
                penalty: 1.1,
                prompt_ignore_length: None,
            }
        }),
        Case::new("encoder_repetition_penalty 1.2", Process, |_| {
            ProcessorConfig::EncoderRepetitionPenalty { penalty: 1.2 }
        }),
        Case::new("sequence_bias, 4 sequences", Process, |ctx| {
            let v = ctx.vocab;
            let mut two = ctx.tail(1);
            two.push(fit(1_000, v));
            let mut three = ctx.tail(2);
            three.push(fit(2_000, v));
            ProcessorConfig::SequenceBias {
                sequence_bias: vec![
                    (two, -1.5),
                    (three, 2.0),
                    (vec![fit(3_000, v)], 0.5),
                    ([4, 5, 6, 7].map(|id| fit(id, v)).to_vec(), -2.0),
                ],
            }
        }),
        Case::new("exponential_decay_length_penalty", Process, |ctx| {
            ProcessorConfig::ExponentialDecayLengthPenalty {
                start_index: 10,
                decay_factor: 1.05,
                eos_token_id: Some(vec![fit(QWEN_EOS[0], ctx.vocab)]),
            }
        }),
        // constraints.rs
        Case {
            output: 0,
            ..Case::new("forced_bos_token, first step", Process, |ctx| {
                ProcessorConfig::ForcedBosToken {
                    bos_token_id: fit(QWEN_EOS[1], ctx.vocab),
                }
            })
        },
        Case::new("forced_eos_token, last step", Process, |ctx| {
            ProcessorConfig::ForcedEosToken {
                max_length: ctx.prompt.len() + ctx.output.len() + 1,
                eos_token_id: QWEN_EOS.map(|id| fit(id, ctx.vocab)).to_vec(),
            }
        }),
        Case::new("suppress_tokens, 8 ids", Process, |ctx| {
            ProcessorConfig::SuppressTokens {
                suppress_tokens: [220, 1, 2, 3, 4, 151_643, 151_644, 151_645]
                    .map(|id| fit(id, ctx.vocab))
                    .to_vec(),
            }
        }),
        Case::new("suppress_tokens_at_begin, its step", Process, |ctx| {
            ProcessorConfig::SuppressTokensAtBegin {
                begin_suppress_tokens: [220, QWEN_EOS[1]].map(|id| fit(id, ctx.vocab)).to_vec(),
                begin_index: ctx.output.len(),
            }
        }),
        Case::new("inf_nan_remove", Process, |_| {
            ProcessorConfig::InfNanRemove {}
        }),
    ]
}

/// One row's chain of one case, with the row's context.
struct RowChain {
    chain: SamplerChain,
    prompt: Vec<u32>,
    output: Vec<u32>,
}

impl RowChain {
    fn new(case: &Case, logits: &Logits, row: usize, seed: u64) -> Result<Self> {
        let mut ids = case.context.ids(logits, row, seed);
        let output = ids.split_off(ids.len() - case.output);
        let chain = case.chain(&RowContext {
            prompt: &ids,
            output: &output,
            vocab: logits.vocab,
        })?;
        let mut rc = Self {
            chain,
            prompt: ids,
            output,
        };
        rc.reset();
        Ok(rc)
    }

    fn reset(&mut self) {
        self.chain.reset(&self.prompt);
        for &t in &self.output {
            self.chain.accept(t);
        }
    }

    /// One timed call on `row`; returns a value of the result (so that nothing is optimised
    /// away).
    fn run(&mut self, row: &[f32], step: Step) -> Result<f64> {
        if step == Step::ResetProcess {
            self.reset();
        }
        let position = (self.prompt.len() + self.output.len()) as u64;
        let ctx = ProcessorContext::new(&self.prompt, &self.output, position);
        Ok(match step {
            Step::Process | Step::ResetProcess => f64::from(self.chain.process(row, &ctx)?[0]),
            Step::Sample => self.chain.sample(row, &ctx, 0)?.logprob,
        })
    }
}

/// The cases and every row's chain of each, built once, outside the timing.
pub struct ProcessorBench {
    cases: Vec<Case>,
    /// `chains[case][row]`.
    chains: Vec<Vec<Mutex<RowChain>>>,
}

impl ProcessorBench {
    /// Every case of [`cases`] with one chain per row of `bench`'s logits, reset with that
    /// row's context (long contexts drawn from `seed`).
    ///
    /// # Errors
    /// A case whose entry is out of range for this vocabulary.
    pub fn new(bench: &Bench, seed: u64) -> Result<Self> {
        let logits = bench.logits();
        let cases = cases();
        let chains = cases
            .iter()
            .map(|case| {
                (0..logits.batch)
                    .map(|row| RowChain::new(case, logits, row, seed).map(Mutex::new))
                    .collect()
            })
            .collect::<Result<_>>()?;
        Ok(Self { cases, chains })
    }

    /// The cases, in table order.
    pub fn cases(&self) -> &[Case] {
        &self.cases
    }

    /// Runs case `c` once on every row of `logits`, rows on the current rayon pool.
    ///
    /// # Errors
    /// A row the chain fails on.
    pub fn run_case(&self, logits: &Logits, c: usize) -> Result<()> {
        let step = self.cases[c].step;
        let out: Vec<f64> = self.chains[c]
            .par_iter()
            .enumerate()
            .map(|(i, rc)| {
                let mut rc = rc
                    .lock()
                    .map_err(|_| anyhow!("a row's chain was poisoned"))?;
                rc.run(logits.row(i), step)
                    .with_context(|| format!("{} ({})", self.cases[c].label, i))
            })
            .collect::<Result<_>>()?;
        std::hint::black_box(out);
        Ok(())
    }

    /// Row 0's chain entry of case `c` as JSON (`None` for a baseline).
    fn entry_json(&self, logits: &Logits, c: usize) -> Option<String> {
        let rc = self.chains[c][0].lock().ok()?;
        let entry = self.cases[c].entry?(&RowContext {
            prompt: &rc.prompt,
            output: &rc.output,
            vocab: logits.vocab,
        });
        serde_json::to_string(&entry).ok()
    }
}

/// Estimated working memory per token of a row that one case's chain keeps (the chain's copy
/// of the row and weights, a processor's weights, digits or sort buffer).
const CHAIN_BYTES_PER_TOKEN: usize = 32;

/// The bytes of the processor table's buffers: those of the workload table at one thread
/// ([`super::buffer_bytes`]: the logits, candle's copy, the histories), the long contexts, and
/// every case's chain per row (32 bytes per token, an estimate); `None` on overflow.
pub fn buffer_bytes(batch: usize, vocab: usize) -> Option<usize> {
    let chains = cases().len();
    crate::memory::total(&[
        super::buffer_bytes(batch, vocab, 1),
        crate::memory::product(&[batch, chains, LONG_CONTEXT, 4]),
        crate::memory::product(&[batch, chains, vocab, CHAIN_BYTES_PER_TOKEN]),
    ])
}

/// A job of the processor table.
#[derive(Clone, Copy, Debug)]
enum Job {
    Floor(Floor),
    Case(usize),
}

/// One measured row of the processor table.
#[derive(Clone, Debug)]
pub struct Measured {
    /// The case's label.
    pub label: &'static str,
    /// Its context.
    pub context: ContextKind,
    /// Median µs per row of the chain with the processor.
    pub chain_us: f64,
    /// The chain's median minus its baseline's (the same call with no processor); `None` for
    /// a baseline.
    pub processor_us: Option<f64>,
}

/// Measures every case and both floors, interleaved; returns the floors' medians (max, max +
/// sum-of-exp, and when the best ISA is not the baseline one, both compiled for the baseline)
/// and every case's.
///
/// # Errors
/// A case that fails on a row.
pub fn measure(
    bench: &Bench,
    procs: &ProcessorBench,
    iters: Option<usize>,
) -> Result<(Vec<f64>, Vec<Measured>)> {
    let mut jobs: Vec<Job> = super::table_floors().into_iter().map(Job::Floor).collect();
    let floor_jobs = jobs.len();
    jobs.extend((0..procs.cases.len()).map(Job::Case));
    let logits = bench.logits();
    let us = interleaved_medians(&jobs, logits.batch, iters, |job| match job {
        Job::Floor(f) => {
            std::hint::black_box(bench.floor(f));
            Ok(())
        }
        Job::Case(c) => procs.run_case(logits, c),
    })?;
    let (floors, case_us) = us.split_at(floor_jobs);
    let baseline = |case: &Case| -> Option<f64> {
        procs
            .cases
            .iter()
            .zip(case_us)
            .find(|(b, _)| {
                b.is_baseline() && b.step == case.step.baseline() && b.context == case.context
            })
            .map(|(_, &t)| t)
    };
    let measured = procs
        .cases
        .iter()
        .zip(case_us)
        .map(|(case, &t)| {
            let processor_us = if case.is_baseline() {
                None
            } else {
                Some(t - baseline(case).context("every case has a baseline")?)
            };
            Ok(Measured {
                label: case.label,
                context: case.context,
                chain_us: t,
                processor_us,
            })
        })
        .collect::<Result<_>>()?;
    Ok((floors.to_vec(), measured))
}

/// A processor's chain entry as JSON (row 0's), listed under the processor table.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The case's label.
    pub label: &'static str,
    /// Its context.
    pub context: ContextKind,
    /// The `ProcessorConfig` entry of row 0, as JSON.
    pub json: String,
}

/// What `nucleus bench sampling --processors` measured.
#[derive(Clone, Debug)]
pub struct ProcessorsReport {
    /// The floors' medians.
    pub floors: FloorTimes,
    /// Every case of [`cases`], in order.
    pub measured: Vec<Measured>,
    /// The chain entry of every case that has a processor.
    pub entries: Vec<Entry>,
}

/// Measures the processor table of `config` on the current rayon pool: [`measure`], and the
/// chain entries.
///
/// # Errors
/// A case that fails.
pub fn measure_table(bench: &Bench, config: &Config) -> Result<ProcessorsReport> {
    let procs = ProcessorBench::new(bench, config.seed)?;
    let (floors, measured) = measure(bench, &procs, config.iters)?;
    let logits = bench.logits();
    let entries = procs
        .cases
        .iter()
        .enumerate()
        .filter_map(|(c, case)| {
            procs.entry_json(logits, c).map(|json| Entry {
                label: case.label,
                context: case.context,
                json,
            })
        })
        .collect();
    Ok(ProcessorsReport {
        floors: FloorTimes::from_medians(&floors),
        measured,
        entries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{run, SamplingResults};

    /// The whole table on a tiny vocabulary, one timed run: every case builds, runs and gets a
    /// row with numbers (no timing is asserted), and every processor its JSON entry.
    #[test]
    fn bench_processor_table_runs_on_a_tiny_vocab() {
        let config = Config {
            vocab: 64,
            batch: 2,
            threads: 1,
            iters: Some(1),
            processors: true,
            ..Config::default()
        };
        let SamplingResults::Processors(report) = run(&config).unwrap() else {
            panic!("the processor table was asked for");
        };
        let cases = cases();
        assert_eq!(report.measured.len(), cases.len());
        for (m, case) in report.measured.iter().zip(&cases) {
            assert_eq!(m.label, case.label);
            assert_eq!(m.context, case.context);
            assert!(m.chain_us.is_finite() && m.chain_us >= 0.0, "{m:?}");
            assert_eq!(m.processor_us.is_none(), case.is_baseline(), "{m:?}");
            assert!(m.processor_us.is_none_or(f64::is_finite), "{m:?}");
        }
        assert!(report.floors.max_us >= 0.0 && report.floors.max_sum_exp_us >= 0.0);
        let listed: Vec<&str> = report.entries.iter().map(|e| e.label).collect();
        let processors: Vec<&str> = cases
            .iter()
            .filter(|c| !c.is_baseline())
            .map(|c| c.label)
            .collect();
        assert_eq!(listed, processors);
        assert!(report.entries.iter().all(|e| e.json.starts_with('{')));
    }

    /// Every non-baseline case has a baseline of its step and context, and the long contexts
    /// have their length.
    #[test]
    fn bench_processor_cases_have_baselines_and_contexts() {
        let cases = cases();
        for case in cases.iter().filter(|c| !c.is_baseline()) {
            assert!(
                cases.iter().any(|b| b.is_baseline()
                    && b.step == case.step.baseline()
                    && b.context == case.context),
                "{}",
                case.label
            );
        }
        let logits = Logits::generate(1, 1000, 7);
        assert_eq!(ContextKind::Workload.ids(&logits, 0, 1).len(), HISTORY);
        let random = ContextKind::LongRandom.ids(&logits, 0, 1);
        assert_eq!(random.len(), LONG_CONTEXT);
        assert_eq!(&random[LONG_CONTEXT - HISTORY..], &logits.history[0][..]);
        let repeating = ContextKind::LongRepeating.ids(&logits, 0, 1);
        assert_eq!(repeating.len(), LONG_CONTEXT);
        assert_eq!(&repeating[HISTORY..2 * HISTORY], &logits.history[0][..]);
    }
}
