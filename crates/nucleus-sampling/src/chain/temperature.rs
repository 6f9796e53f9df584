//! Temperature (spec/sampling.md step 7).

use super::{row_max, LogitsProcessor, ProcessorContext};
use crate::error::{ParamError, SampleError};
use crate::params::GREEDY_TEMPERATURE;

/// Temperature: `l = l / T` in f32, a pure division, as Hugging Face's
/// `TemperatureLogitsWarper.__call__` (`scores / self.temperature`), llama.cpp's
/// `llama_sampler_temp_impl` and vLLM's `Sampler.apply_temperature` compute it: the output is
/// the logits a later processor of the anchors would see, so a `repetition_penalty` placed
/// after it sees the signs of the scaled logits (issue 16: logits [1, 2, 3], token 0 seen,
/// temperature 1 then repetition penalty 2 gives p0 = 0.0566, as Hugging Face does). The shift
/// by the row maximum that keeps `exp` from overflowing belongs to the softmax, where it changes
/// nothing; the fixed `SamplingParams` path (spec/sampling.md step 7) still divides after
/// subtracting the maximum, which gives the same distribution because every step after it is
/// shift-invariant. `-inf` stays `-inf`. Stateless.
///
/// Place in the chain: its result depends on it. Before a penalty it changes what the penalty
/// does (the sign of `l` decides `l / r` or `l * r`); before min-p, top-k or top-p it changes the
/// probabilities they see (top-k's set does not change; min-p's and top-p's do).
///
/// For greedy decoding (T below 1e-5) use [`super::Selection::Greedy`].
#[derive(Clone, Debug, PartialEq)]
pub struct Temperature {
    t: f64,
    /// [`Self::after_max_subtraction`]'s form.
    shifted: bool,
}

impl Temperature {
    /// Temperature `t`.
    ///
    /// # Errors
    /// [`ParamError`] for `temperature` unless `t` is finite and `>= 1e-5`
    /// ([`GREEDY_TEMPERATURE`]); below it the fixed path is greedy, which here is the
    /// [`super::Selection::Greedy`] step.
    pub fn new(t: f64) -> Result<Self, ParamError> {
        if !(t >= GREEDY_TEMPERATURE && t.is_finite()) {
            return Err(ParamError::new(
                "temperature",
                t,
                "a finite number >= 1e-5 (for lower temperatures use the greedy selection)",
            ));
        }
        Ok(Self { t, shifted: false })
    }

    /// The fixed `SamplingParams` path's form (spec/sampling.md step 7): `l = (l - max) / T` in
    /// f32, the row maximum subtracted first so that no finite `T` can overflow; afterwards the
    /// maximum is 0. The distribution is the same as [`Self::new`]'s; the logits are not (every
    /// one is `<= 0`), so a logit-sign-dependent processor after it (a repetition penalty) acts
    /// differently. [`super::SamplerChain::from_params`] uses it, because there every later step
    /// is shift-invariant and this form rounds as the fast path does.
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn after_max_subtraction(t: f64) -> Result<Self, ParamError> {
        Ok(Self {
            shifted: true,
            ..Self::new(t)?
        })
    }

    /// The temperature.
    pub fn t(&self) -> f64 {
        self.t
    }
}

/// `logits[i] /= t` in f32 for every finite logit.
///
/// # Errors
/// [`SampleError::ProcessorOverflow`] naming `processor` and the lowest id whose quotient left
/// the f32 range (`|l| / T > f32::MAX`); the row is then left unchanged.
pub(crate) fn divide(
    logits: &mut [f32],
    t: f32,
    processor: &'static str,
) -> Result<(), SampleError> {
    if t >= 1.0 {
        logits.iter_mut().for_each(|l| *l /= t);
        return Ok(());
    }
    // |l / t| can only overflow where |l| > f32::MAX * t.
    let limit = f32::MAX * t;
    if let Some((i, &l)) = logits
        .iter()
        .enumerate()
        .find(|(_, l)| l.is_finite() && l.abs() > limit && !(*l / t).is_finite())
    {
        return Err(SampleError::ProcessorOverflow {
            processor,
            token_id: i as u32,
            logit: l,
        });
    }
    logits.iter_mut().for_each(|l| *l /= t);
    Ok(())
}

impl LogitsProcessor for Temperature {
    fn name(&self) -> &str {
        "temperature"
    }
    /// # Errors
    /// [`SampleError::ProcessorOverflow`] when `l / T` leaves the f32 range.
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        if !self.shifted {
            return divide(logits, self.t as f32, "temperature");
        }
        let max = row_max(logits);
        if max == f32::NEG_INFINITY {
            return Ok(());
        }
        let t = self.t as f32;
        for l in logits.iter_mut() {
            let d = *l - max;
            *l = if d == f32::NEG_INFINITY {
                if *l == f32::NEG_INFINITY {
                    f32::NEG_INFINITY
                } else {
                    // The difference of two finite logits left the f32 range: form it in f64.
                    ((f64::from(*l) - f64::from(max)) / self.t) as f32
                }
            } else {
                d / t
            };
        }
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}
