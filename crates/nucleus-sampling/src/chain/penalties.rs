//! Bias (spec/sampling.md step 4) and penalties (step 5).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::{check_range, LogitsProcessor, ProcessorContext};
use crate::error::{ParamError, SampleError};
use crate::params::LOGIT_BIAS_LIMIT;

/// Adds a bias to the logits of some ids: `l = (l as f64 + bias) as f32`, each bias clamped to
/// `[-100, 100]` (spec step 4; OpenAI's and vLLM's `logit_bias`). `-inf` stays `-inf`.
/// Stateless.
#[derive(Clone, Debug, PartialEq)]
pub struct LogitBias {
    /// (id, clamped bias), ascending id.
    bias: Vec<(u32, f64)>,
}

impl LogitBias {
    /// Biases by token id; values are clamped to `[-100, 100]` ([`LOGIT_BIAS_LIMIT`]).
    ///
    /// # Errors
    /// [`ParamError`] for `logit_bias` when a value is NaN or infinite.
    pub fn new(bias: BTreeMap<u32, f64>) -> Result<Self, ParamError> {
        if let Some((id, b)) = bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(ParamError::new(
                "logit_bias",
                format!("{b} for token {id}"),
                "finite numbers (clamped to [-100, 100])",
            ));
        }
        Ok(Self {
            bias: bias
                .into_iter()
                .map(|(id, b)| (id, b.clamp(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)))
                .collect(),
        })
    }

    /// The (id, clamped bias) pairs, ascending id.
    pub fn bias(&self) -> &[(u32, f64)] {
        &self.bias
    }
}

impl LogitsProcessor for LogitBias {
    fn name(&self) -> &str {
        "logit_bias"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        for &(id, b) in &self.bias {
            let l = &mut logits[id as usize];
            *l = (f64::from(*l) + b) as f32;
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("logit_bias", self.bias.iter().map(|(id, _)| id), vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// The repetition penalty over the distinct ids of the prompt and the accepted tokens:
/// `l > 0 ? l / r : l * r` in f32, each distinct id once (spec step 5; CTRL, Keskar et al.
/// 2019; Hugging Face's `RepetitionPenaltyLogitsProcessor`). 1 is off.
///
/// Stateful: [`LogitsProcessor::reset`] takes the prompt ids, [`LogitsProcessor::accept`] each
/// committed token; the context's ids are not read. Cloning copies the state.
#[derive(Clone, Debug)]
pub struct RepetitionPenalty {
    penalty: f64,
    /// Distinct ids seen, in first-seen order (prompt first).
    ids: Vec<u32>,
    seen: HashSet<u32>,
    /// The largest prompt id and accepted id, for the range check.
    max_prompt: Option<u32>,
    max_output: Option<u32>,
}

impl RepetitionPenalty {
    /// A penalty `r`.
    ///
    /// # Errors
    /// [`ParamError`] for `repetition_penalty` unless `r` is finite and `> 0`.
    pub fn new(penalty: f64) -> Result<Self, ParamError> {
        if !(penalty > 0.0 && penalty.is_finite()) {
            return Err(ParamError::new(
                "repetition_penalty",
                penalty,
                "a finite number > 0 (1 disables it)",
            ));
        }
        Ok(Self {
            penalty,
            ids: Vec::new(),
            seen: HashSet::new(),
            max_prompt: None,
            max_output: None,
        })
    }

    /// The penalty.
    pub fn penalty(&self) -> f64 {
        self.penalty
    }

    /// The distinct ids seen so far (prompt and accepted tokens), in first-seen order.
    pub fn seen_ids(&self) -> &[u32] {
        &self.ids
    }

    fn insert(&mut self, id: u32) {
        if self.seen.insert(id) {
            self.ids.push(id);
        }
    }
}

impl LogitsProcessor for RepetitionPenalty {
    fn name(&self) -> &str {
        "repetition_penalty"
    }
    /// # Errors
    /// [`SampleError::PenaltyOverflow`] when `l / r` or `l * r` leaves the f32 range.
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        if self.penalty == 1.0 {
            return Ok(());
        }
        let r = self.penalty as f32;
        for &id in &self.ids {
            let l = &mut logits[id as usize];
            let before = *l;
            *l = if before > 0.0 { before / r } else { before * r };
            if before.is_finite() && !l.is_finite() {
                return Err(SampleError::PenaltyOverflow {
                    token_id: id,
                    logit: before,
                    penalty: self.penalty,
                });
            }
        }
        Ok(())
    }
    fn reset(&mut self, prompt_ids: &[u32]) {
        self.ids.clear();
        self.seen.clear();
        self.max_output = None;
        self.max_prompt = prompt_ids.iter().copied().max();
        for &id in prompt_ids {
            self.insert(id);
        }
    }
    fn accept(&mut self, token: u32) {
        self.max_output = self.max_output.max(Some(token));
        self.insert(token);
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("prompt_ids", &self.max_prompt, vocab_size)?;
        check_range("output_ids", &self.max_output, vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Frequency and presence penalties over the accepted tokens (prompt ids do not count):
/// `l = (l as f64 - (count * frequency + presence)) as f32` for every id accepted `count > 0`
/// times (spec step 5; OpenAI's definitions). Both 0 is off.
///
/// One processor for both, so that the fixed chain rounds once as the fast path does; the
/// config entries `frequency_penalty` and `presence_penalty` each build one with the other
/// penalty 0 ([`Self::frequency`], [`Self::presence`]).
///
/// Stateful: counts come from [`LogitsProcessor::accept`]; [`LogitsProcessor::reset`] clears
/// them. Cloning copies the counts.
#[derive(Clone, Debug)]
pub struct FrequencyPresencePenalty {
    frequency: f64,
    presence: f64,
    name: &'static str,
    /// (id, count) in first-seen order.
    counts: Vec<(u32, u32)>,
    /// id -> index into `counts`.
    index: HashMap<u32, usize>,
    max_output: Option<u32>,
}

impl FrequencyPresencePenalty {
    /// Both penalties.
    ///
    /// # Errors
    /// [`ParamError`] for `frequency_penalty` or `presence_penalty` outside `[-2, 2]`.
    pub fn new(frequency: f64, presence: f64) -> Result<Self, ParamError> {
        for (field, value) in [
            ("frequency_penalty", frequency),
            ("presence_penalty", presence),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(ParamError::new(field, value, "[-2, 2]"));
            }
        }
        Ok(Self {
            frequency,
            presence,
            name: "frequency_presence_penalty",
            counts: Vec::new(),
            index: HashMap::new(),
            max_output: None,
        })
    }

    /// The frequency penalty alone (named `frequency_penalty`).
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn frequency(frequency: f64) -> Result<Self, ParamError> {
        let mut p = Self::new(frequency, 0.0)?;
        p.name = "frequency_penalty";
        Ok(p)
    }

    /// The presence penalty alone (named `presence_penalty`).
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn presence(presence: f64) -> Result<Self, ParamError> {
        let mut p = Self::new(0.0, presence)?;
        p.name = "presence_penalty";
        Ok(p)
    }

    /// The number of times `token` was accepted since the last reset.
    pub fn count(&self, token: u32) -> u32 {
        self.index.get(&token).map_or(0, |&i| self.counts[i].1)
    }
}

impl LogitsProcessor for FrequencyPresencePenalty {
    fn name(&self) -> &str {
        self.name
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        if self.frequency == 0.0 && self.presence == 0.0 {
            return Ok(());
        }
        for &(id, count) in &self.counts {
            let l = &mut logits[id as usize];
            *l = (f64::from(*l) - (f64::from(count) * self.frequency + self.presence)) as f32;
        }
        Ok(())
    }
    fn reset(&mut self, _prompt_ids: &[u32]) {
        self.counts.clear();
        self.index.clear();
        self.max_output = None;
    }
    fn accept(&mut self, token: u32) {
        self.max_output = self.max_output.max(Some(token));
        match self.index.get(&token) {
            Some(&i) => self.counts[i].1 += 1,
            None => {
                self.index.insert(token, self.counts.len());
                self.counts.push((token, 1));
            }
        }
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("output_ids", &self.max_output, vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}
