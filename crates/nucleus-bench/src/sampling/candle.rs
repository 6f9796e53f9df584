//! The candle baseline: `candle_transformers::generation::LogitsProcessor`, the sampler of
//! candle's examples, with the `Sampling` variant matching each workload, and
//! `candle_transformers::utils::apply_repeat_penalty` for the repetition penalty.
//!
//! The `[batch, vocab]` tensor is built once, outside the timed region (an engine on candle
//! already holds its logits as a tensor); what is timed per row is taking the row (`get`, a
//! view), the penalty when on, a fresh `LogitsProcessor` (seeding its `StdRng`) and `sample`,
//! which computes `softmax(logits / T)` as a tensor, copies it to a `Vec` and filters there.

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use nucleus_sampling::SamplingParams;

use super::workload::Logits;

/// The candle `Sampling` with the same parameters, or `None` when candle has no such filter
/// (min-p).
pub fn sampling_for(params: &SamplingParams, vocab: usize) -> Option<Sampling> {
    if params.min_p > 0.0 {
        return None;
    }
    if params.is_greedy() {
        return Some(Sampling::ArgMax);
    }
    let temperature = params.temperature;
    let k = usize::try_from(params.top_k)
        .ok()
        .filter(|&k| k > 0 && k < vocab);
    let p = (params.top_p < 1.0).then_some(params.top_p);
    Some(match (k, p) {
        (Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        (Some(k), None) => Sampling::TopK { k, temperature },
        (None, Some(p)) => Sampling::TopP { p, temperature },
        (None, None) => Sampling::All { temperature },
    })
}

/// The benchmark's logits as one candle tensor `[batch, vocab]` on the CPU.
pub struct CandleLogits {
    tensor: Tensor,
}

impl CandleLogits {
    /// Copies `logits` into a tensor (not timed).
    pub fn new(logits: &Logits) -> Result<Self> {
        // A copy whose memory is reserved first (candle's own copy would abort when it cannot
        // be had), moved into the tensor.
        let copy = crate::try_collect(
            logits.data.len(),
            logits.data.iter().copied(),
            "candle's copy of the logits",
        )?;
        let tensor = Tensor::from_vec(copy, (logits.batch, logits.vocab), &Device::Cpu)?;
        Ok(Self { tensor })
    }

    /// Samples row `i` with candle: penalty over `context` when `params` has one, then
    /// `LogitsProcessor::from_sampling(seed, sampling).sample`.
    pub fn sample_row(
        &self,
        i: usize,
        params: &SamplingParams,
        sampling: &Sampling,
        context: &[u32],
    ) -> Result<u32> {
        let mut row = self.tensor.get(i)?;
        if params.repetition_penalty != 1.0 && !context.is_empty() {
            row = candle_transformers::utils::apply_repeat_penalty(
                &row,
                params.repetition_penalty as f32,
                context,
            )?;
        }
        let seed = params.seed.unwrap_or(0);
        let mut processor = LogitsProcessor::from_sampling(seed, sampling.clone());
        Ok(processor.sample(&row)?)
    }
}
