//! Per-request sampling parameters and their validation (spec/sampling.md, "Inputs").

use crate::error::ParamError;

/// Temperatures below this are greedy (spec/sampling.md step 6).
pub const GREEDY_TEMPERATURE: f64 = 1e-5;

/// The parameters of one request, named as in vLLM and the OpenAI API.
///
/// Every field has an "off" value, and [`SamplingParams::default`] turns everything off at
/// temperature 1 (plain sampling from the softmax of the logits). Build one with struct update
/// syntax and check it with [`SamplingParams::validate`]:
///
/// ```
/// use nucleus_sampling::SamplingParams;
/// let params = SamplingParams { temperature: 0.8, top_k: 50, top_p: 0.9, seed: Some(42), ..Default::default() };
/// params.validate().unwrap();
/// ```
///
/// The order in which the parameters act is fixed (spec/sampling.md, "Order of operations"):
/// repetition penalty, temperature (or greedy), top-k, top-p, then selection.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature, `>= 0`. Below [`GREEDY_TEMPERATURE`] (1e-5, so 0 included) the
    /// token is chosen greedily: the argmax, ties to the lowest id. Default 1.
    pub temperature: f64,
    /// Keep exactly the `top_k` largest logits, ties broken toward the lower token id.
    /// `0`, `-1` (vLLM's legacy spelling) and any value `>= vocab_size` are off; other negative
    /// values are an error. Default 0 (off).
    pub top_k: i64,
    /// Keep the smallest set of tokens, in probability order (ties toward the lower id), whose
    /// renormalised mass is `>= top_p`. Range `(0, 1]`; 1 is off. Default 1.
    pub top_p: f64,
    /// Repetition penalty over the distinct ids of prompt + generated tokens:
    /// `l > 0 ? l / r : l * r` (CTRL, Keskar et al. 2019; Hugging Face's
    /// `RepetitionPenaltyLogitsProcessor`). Range `> 0` (finite); 1 is off. Default 1.
    pub repetition_penalty: f64,
    /// The seed of this request's Philox4x32-10 stream. `None`: drawn from the OS for this call
    /// and reported back in [`crate::SampleOutput::seed`]; an engine draws it once per request.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0, everything else off.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether these parameters choose the argmax (temperature below 1e-5).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    /// Checks every field against its allowed range.
    ///
    /// # Errors
    /// [`ParamError`] naming the first field out of range, its value and the allowed range.
    /// Nothing is clamped.
    pub fn validate(&self) -> Result<(), ParamError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(ParamError::new(
                "temperature",
                self.temperature,
                "a finite number >= 0",
            ));
        }
        if self.top_k < -1 {
            return Err(ParamError::new(
                "top_k",
                self.top_k,
                ">= 0 (0 or -1 disables it)",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ParamError::new("top_p", self.top_p, "(0, 1]"));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(ParamError::new(
                "repetition_penalty",
                self.repetition_penalty,
                "a finite number > 0 (1 disables it)",
            ));
        }
        Ok(())
    }
}
