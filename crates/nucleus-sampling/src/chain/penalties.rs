//! Bias (spec/sampling.md step 4) and penalties (step 5).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::{check_range, LogitsProcessor, ProcessorContext};
use crate::error::{ParamError, SampleError};
use crate::params::LOGIT_BIAS_LIMIT;
use crate::sampler::repetition_penalized;

/// Adds a bias to the logits of some ids: `l = (l as f64 + bias) as f32`, each bias clamped to
/// `[-100, 100]` (spec step 4; OpenAI's and vLLM's `logit_bias`). `-inf` stays `-inf`.
/// Stateless.
///
/// Place in the chain: an additive shift of some logits: it commutes with other additive steps (frequency,
/// presence, sequence bias) but not with a temperature (a bias before `T` is divided by `T`) or
/// a repetition penalty (which looks at the signs).
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
/// 2019; Hugging Face's `RepetitionPenaltyLogitsProcessor`,
/// src/transformers/generation/logits_process.py). 1 is off.
///
/// With [`Self::with_prompt_ignore_length`]`(n)` (Hugging Face's `prompt_ignore_length`:
/// `input_ids[:, n:]`), the first `n` ids of the whole sequence, prompt first, do not count:
/// an id counts when it also occurs at index `n` or later. `n` past the prompt's end also
/// skips the first generated tokens; 0 or absent counts every id.
///
/// Stateful: [`LogitsProcessor::reset`] takes the prompt ids, [`LogitsProcessor::accept`] each
/// committed token; the context's ids are not read. Cloning copies the state.
///
/// Place in the chain: its result depends on the signs of the logits it sees, so it does not commute with
/// additive steps (bias) or a shift (log-softmax, [`super::Temperature::after_max_subtraction`]);
/// with a pure-division temperature it commutes (the signs do not change).
#[derive(Clone, Debug)]
pub struct RepetitionPenalty {
    penalty: f64,
    /// Hugging Face's `prompt_ignore_length`; `None` counts every id, as 0 does.
    prompt_ignore_length: Option<usize>,
    /// Ids of the sequence seen since the last reset, ignored ones included.
    seq_len: usize,
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
            prompt_ignore_length: None,
            seq_len: 0,
            ids: Vec::new(),
            seen: HashSet::new(),
            max_prompt: None,
            max_output: None,
        })
    }

    /// The same penalty, not counting the first `n` ids of the sequence (Hugging Face's
    /// `prompt_ignore_length`; its check `>= 0` is the type's). Every value is valid; 0 counts
    /// every id. Set it before the request's [`LogitsProcessor::reset`]: the state is cleared.
    pub fn with_prompt_ignore_length(mut self, n: usize) -> Self {
        self.prompt_ignore_length = Some(n);
        self.reset(&[]);
        self
    }

    /// The penalty.
    pub fn penalty(&self) -> f64 {
        self.penalty
    }

    /// Hugging Face's `prompt_ignore_length`, when set.
    pub fn prompt_ignore_length(&self) -> Option<usize> {
        self.prompt_ignore_length
    }

    /// Takes the next id of the sequence into account, unless it is among the ignored first.
    fn push(&mut self, id: u32) {
        if self.seq_len >= self.prompt_ignore_length.unwrap_or(0) {
            self.insert(id);
        }
        self.seq_len += 1;
    }

    /// The distinct ids counted so far (prompt and accepted tokens, past the ignored first
    /// [`Self::prompt_ignore_length`]), in first-seen order.
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
            *l = repetition_penalized(before, r);
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
        self.seq_len = 0;
        self.max_output = None;
        self.max_prompt = prompt_ids.iter().copied().max();
        for &id in prompt_ids {
            self.push(id);
        }
    }
    fn accept(&mut self, token: u32) {
        self.max_output = self.max_output.max(Some(token));
        self.push(token);
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
///
/// Place in the chain: an additive shift of the seen ids: it commutes with other additive steps, not with a
/// temperature (before `T` it is divided by `T`) or a repetition penalty.
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

/// Multi-token biases (spec/sampling.md, "Extended processors", step 4a; Hugging Face's
/// `SequenceBiasLogitsProcessor`, src/transformers/generation/logits_process.py): each entry
/// is a token sequence and a bias added to the logit of its last token when the sequence so
/// far ends with the rest of it, so that the next token would complete it. A one-token
/// sequence is biased at every step.
///
/// Exactly as Hugging Face's `__call__`:
/// - the sequence so far is the context's `prompt_ids` followed by its `output_ids`
///   (Hugging Face's `input_ids`), so a prefix may match across the prompt / output boundary;
/// - an entry longer than the whole sequence so far is skipped (`len(sequence_ids) >
///   input_ids.shape[1]`), even when its prefix alone would fit;
/// - the bias of each token is summed in f32, its one-token bias first, then the matching
///   longer entries in list order, and added to the logit in f32 (`scores + bias`); biases
///   of several entries ending in the same token add up;
/// - a list naming the same sequence twice keeps the last bias, at the first one's place
///   (Hugging Face turns the list into a dict).
///
/// `-inf` stays `-inf`. Stateless (it reads the context). O(total length of the entries)
/// per row, whatever the context's length; no allocation.
///
/// Place in the chain: an additive shift of a few logits; it commutes with other biases and
/// with hard constraints, not with the penalties or temperature.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceBias {
    /// The entries after Hugging Face's dict conversion (first place, last value).
    sequence_bias: Vec<(Vec<u32>, f64)>,
    /// The entries grouped by last token, ascending.
    groups: Vec<BiasGroup>,
    max_id: Option<u32>,
    /// The new logit of each group, formed before any is written.
    scratch: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq)]
struct BiasGroup {
    token: u32,
    /// The one-token entry's bias, 0 without one.
    single: f32,
    /// (prefix, bias) of the longer entries ending in `token`, in list order.
    longer: Vec<(Vec<u32>, f32)>,
}

impl SequenceBias {
    /// Biases by sequence: `(token ids, bias)` pairs, Hugging Face's list form
    /// `[[[1, 2], -1.5], [[3], 0.5]]`.
    ///
    /// # Errors
    /// [`ParamError`] for `sequence_bias` when the list is empty (Hugging Face's "non-empty
    /// list"), a sequence is empty, or a bias is NaN, infinite or outside the f32 range
    /// (Hugging Face keeps its biases in f32). Hugging Face's list form also rejects the token
    /// id 0 (`token_id > 0`, where its dict form checks `>= 0`): a slip, not followed; every
    /// u32 id is accepted here and ids at or above the vocabulary size are reported when the
    /// chain runs ([`SampleError::TokenIdOutOfRange`] for `sequence_bias`).
    pub fn new(sequence_bias: Vec<(Vec<u32>, f64)>) -> Result<Self, ParamError> {
        if sequence_bias.is_empty() {
            return Err(ParamError::new(
                "sequence_bias",
                "[]",
                "a non-empty list of [token ids, bias] pairs",
            ));
        }
        if sequence_bias.iter().any(|(ids, _)| ids.is_empty()) {
            return Err(ParamError::new(
                "sequence_bias",
                "an empty sequence",
                "non-empty token sequences",
            ));
        }
        if let Some((ids, b)) = sequence_bias.iter().find(|(_, b)| !(*b as f32).is_finite()) {
            return Err(ParamError::new(
                "sequence_bias",
                format!("{b} for sequence {ids:?}"),
                "finite biases within the f32 range",
            ));
        }
        // Hugging Face's `{tuple(ids): bias for ids, bias in list}`.
        let mut entries: Vec<(Vec<u32>, f64)> = Vec::with_capacity(sequence_bias.len());
        for (ids, b) in sequence_bias {
            match entries.iter_mut().find(|(seen, _)| *seen == ids) {
                Some(entry) => entry.1 = b,
                None => entries.push((ids, b)),
            }
        }
        let mut groups: Vec<BiasGroup> = Vec::new();
        for (ids, b) in &entries {
            let Some((&token, prefix)) = ids.split_last() else {
                continue;
            };
            let index = match groups.iter().position(|g| g.token == token) {
                Some(i) => i,
                None => {
                    groups.push(BiasGroup {
                        token,
                        single: 0.0,
                        longer: Vec::new(),
                    });
                    groups.len() - 1
                }
            };
            let group = &mut groups[index];
            if prefix.is_empty() {
                // Hugging Face's `zeros + length_1_bias`, in f32.
                group.single = 0.0 + *b as f32;
            } else {
                group.longer.push((prefix.to_vec(), *b as f32));
            }
        }
        groups.sort_by_key(|g| g.token);
        let max_id = entries.iter().flat_map(|(ids, _)| ids).copied().max();
        Ok(Self {
            scratch: vec![0.0; groups.len()],
            sequence_bias: entries,
            groups,
            max_id,
        })
    }

    /// The entries, each sequence once (a repeated sequence keeps its last bias).
    pub fn sequence_bias(&self) -> &[(Vec<u32>, f64)] {
        &self.sequence_bias
    }
}

/// Whether `prompt ++ output` ends with `suffix`.
fn ends_with_split(prompt: &[u32], output: &[u32], suffix: &[u32]) -> bool {
    match suffix.len().checked_sub(output.len()) {
        None | Some(0) => output.ends_with(suffix),
        Some(k) => prompt.ends_with(&suffix[..k]) && output == &suffix[k..],
    }
}

impl LogitsProcessor for SequenceBias {
    fn name(&self) -> &str {
        "sequence_bias"
    }
    /// # Errors
    /// [`SampleError::ProcessorOverflow`] when `l + bias` leaves the f32 range for a finite
    /// `l` (lowest such id); the row is then left unchanged.
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        let (prompt, output) = (ctx.prompt_ids, ctx.output_ids);
        let len = prompt.len() + output.len();
        for (group, new) in self.groups.iter().zip(self.scratch.iter_mut()) {
            let mut bias = group.single;
            for (prefix, b) in &group.longer {
                // Hugging Face skips a sequence longer than `input_ids`.
                if prefix.len() < len && ends_with_split(prompt, output, prefix) {
                    bias += b;
                }
            }
            let l = logits[group.token as usize];
            *new = l + bias;
            if l.is_finite() && !new.is_finite() {
                return Err(SampleError::ProcessorOverflow {
                    processor: "sequence_bias",
                    token_id: group.token,
                    logit: l,
                });
            }
        }
        for (group, &new) in self.groups.iter().zip(&self.scratch) {
            logits[group.token as usize] = new;
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("sequence_bias", &self.max_id, vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Serde helpers for `sequence_bias` in Hugging Face's list form `[[[1, 2], -1.5], [[3],
/// 0.5]]`, the biases through [`super::lenient_f64`].
pub(crate) mod sequence_bias_serde {
    use super::super::LenientF64;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(
        entries: &[(Vec<u32>, f64)],
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let wrapped: Vec<(&[u32], LenientF64)> = entries
            .iter()
            .map(|(ids, b)| (ids.as_slice(), LenientF64(*b)))
            .collect();
        wrapped.serialize(serializer)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<(Vec<u32>, f64)>, D::Error> {
        let wrapped = Vec::<(Vec<u32>, LenientF64)>::deserialize(deserializer)?;
        Ok(wrapped.into_iter().map(|(ids, b)| (ids, b.0)).collect())
    }
}

/// Raises the EOS logits exponentially once the output is long enough (Hugging Face's
/// `ExponentialDecayLengthPenalty`, src/transformers/generation/logits_process.py): when
/// `g = ctx.output_ids.len()` tokens have been generated and `g > start_index`, every EOS
/// logit `l` becomes `l + |l| * (decay_factor^(g - start_index) - 1)`, so a positive `l` is
/// multiplied by `decay_factor^k` and a negative one moves towards (and past) 0; at
/// `g <= start_index` nothing changes.
///
/// Exactly as Hugging Face's `__call__`: `start_index` counts from the end of the prompt
/// (Hugging Face adds the prompt's length, `input_ids_seq_length`, and compares with the
/// whole sequence's), so the count comes from the context's `output_ids`; the factor
/// `decay_factor^k - 1` is formed in f64 (Python's `pow`) and rounded to f32, and
/// `l + |l| * factor` is computed in f32. One deliberate difference: a removed EOS (`-inf`)
/// stays removed, where Hugging Face's `|-inf| * factor` added to `-inf` gives NaN for any
/// `decay_factor >= 1`.
///
/// EOS ids: the entry's `eos_token_id`, or, when it gives none, the context's
/// [`ProcessorContext::stop_token_ids`] (Hugging Face uses the generation config's EOS ids);
/// each distinct id once. Stateless (it reads the context). O(EOS ids) per row.
///
/// Place in the chain: the change is proportional to `|l|`, so it commutes with a pure
/// temperature division but not with a shift of the logits (a bias, the fixed path's max
/// subtraction); Hugging Face applies it to the raw logits, before temperature.
#[derive(Clone, Debug, PartialEq)]
pub struct ExponentialDecayLengthPenalty {
    start_index: usize,
    decay_factor: f64,
    /// Sorted, without duplicates; `None`: the context's stop ids.
    eos_token_id: Option<Vec<u32>>,
}

impl ExponentialDecayLengthPenalty {
    /// The penalty from `start_index` generated tokens on, with `decay_factor`, on
    /// `eos_token_id` (any order, duplicates ignored) or, for `None`, on the context's stop ids.
    ///
    /// # Errors
    /// [`ParamError`] for `decay_factor` when it is NaN or infinite: Hugging Face checks
    /// nothing of it, and such a value would write NaN or infinite logits. Every finite value
    /// is accepted as in Hugging Face (above 1 raises the EOS logits, below 1 lowers them).
    /// [`ParamError`] for `eos_token_id` when it is an empty list (Hugging Face rejects it:
    /// `torch.tensor([])` is a float tensor); leave it out to use the stop ids.
    pub fn new(
        start_index: usize,
        decay_factor: f64,
        eos_token_id: Option<Vec<u32>>,
    ) -> Result<Self, ParamError> {
        if !decay_factor.is_finite() {
            return Err(ParamError::new(
                "decay_factor",
                decay_factor,
                "a finite number (above 1 raises the EOS logits)",
            ));
        }
        let eos_token_id = match eos_token_id {
            Some(ids) if ids.is_empty() => {
                return Err(ParamError::new(
                    "eos_token_id",
                    "[]",
                    "at least one token id, or none (the stop ids)",
                ));
            }
            Some(mut ids) => {
                ids.sort_unstable();
                ids.dedup();
                Some(ids)
            }
            None => None,
        };
        Ok(Self {
            start_index,
            decay_factor,
            eos_token_id,
        })
    }

    /// The number of generated tokens after which the penalty starts.
    pub fn start_index(&self) -> usize {
        self.start_index
    }

    /// The decay factor.
    pub fn decay_factor(&self) -> f64 {
        self.decay_factor
    }

    /// The entry's EOS ids, ascending; `None`: the context's stop ids.
    pub fn eos_token_id(&self) -> Option<&[u32]> {
        self.eos_token_id.as_deref()
    }
}

impl LogitsProcessor for ExponentialDecayLengthPenalty {
    fn name(&self) -> &str {
        "exponential_decay_length_penalty"
    }
    /// # Errors
    /// [`SampleError::ProcessorOverflow`] when the new EOS logit leaves the f32 range (a
    /// factor `decay_factor^k` beyond it); the row is then left unchanged.
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        let generated = ctx.output_ids.len();
        if generated <= self.start_index {
            return Ok(());
        }
        let ids: &[u32] = match &self.eos_token_id {
            Some(ids) => ids,
            None => {
                check_range("stop_token_ids", ctx.stop_token_ids, logits.len())?;
                ctx.stop_token_ids
            }
        };
        let k = (generated - self.start_index) as f64;
        let factor = (self.decay_factor.powf(k) - 1.0) as f32;
        let penalised = |l: f32| l + l.abs() * factor;
        for &id in ids {
            let l = logits[id as usize];
            if l.is_finite() && !penalised(l).is_finite() {
                return Err(SampleError::ProcessorOverflow {
                    processor: "exponential_decay_length_penalty",
                    token_id: id,
                    logit: l,
                });
            }
        }
        for (i, &id) in ids.iter().enumerate() {
            // Each distinct id once (the context's stop ids may repeat one).
            if ids[..i].contains(&id) {
                continue;
            }
            let l = &mut logits[id as usize];
            if l.is_finite() {
                *l = penalised(*l);
            }
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        let last = self.eos_token_id.as_ref().and_then(|ids| ids.last());
        check_range("eos_token_id", last, vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// The encoder repetition penalty (Hugging Face's `EncoderRepetitionPenaltyLogitsProcessor`,
/// src/transformers/generation/logits_process.py, from its "hallucination penalty"): the
/// repetition penalty with the inverse factor `1 / penalty` on the distinct encoder input ids,
/// so `penalty > 1` raises them (`l < 0 ? l * (1/p) : l / (1/p)` in f32, with `1/p` formed in
/// f64 and rounded to f32, as Hugging Face's `self.penalty = 1 / penalty`). 1 is off.
///
/// Encoder ids: there is no encoder in a decoder-only model; the ids are the prompt ids given
/// to [`LogitsProcessor::reset`], each distinct id once (Hugging Face's `gather` / `scatter`
/// writes one value per id). Generated tokens do not count. `-inf` stays `-inf`.
///
/// Stateful: the ids come from [`LogitsProcessor::reset`]; cloning copies them. O(distinct
/// prompt ids) per row.
///
/// Place in the chain: its result depends on the logits' signs, so it does not commute with
/// a shift (bias, the fixed path's max subtraction); with a pure temperature division it
/// commutes.
#[derive(Clone, Debug)]
pub struct EncoderRepetitionPenalty {
    penalty: f64,
    /// The distinct prompt ids, ascending.
    ids: Vec<u32>,
}

impl EncoderRepetitionPenalty {
    /// A penalty `p` (above 1 rewards the prompt's ids, below 1 penalises them).
    ///
    /// # Errors
    /// [`ParamError`] for `encoder_repetition_penalty` unless `p` is finite and `> 0`
    /// (Hugging Face: "a strictly positive float").
    pub fn new(penalty: f64) -> Result<Self, ParamError> {
        if !(penalty > 0.0 && penalty.is_finite()) {
            return Err(ParamError::new(
                "encoder_repetition_penalty",
                penalty,
                "a finite number > 0 (1 disables it)",
            ));
        }
        Ok(Self {
            penalty,
            ids: Vec::new(),
        })
    }

    /// The penalty as given (the factor applied is its inverse).
    pub fn penalty(&self) -> f64 {
        self.penalty
    }

    /// The distinct encoder (prompt) ids, ascending.
    pub fn encoder_ids(&self) -> &[u32] {
        &self.ids
    }
}

impl LogitsProcessor for EncoderRepetitionPenalty {
    fn name(&self) -> &str {
        "encoder_repetition_penalty"
    }
    /// # Errors
    /// [`SampleError::ProcessorOverflow`] when `l * (1/p)` or `l / (1/p)` leaves the f32
    /// range for a finite `l` (lowest such id); the row is then left unchanged.
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        if self.penalty == 1.0 {
            return Ok(());
        }
        let inverse = (1.0 / self.penalty) as f32;
        let penalised = |l: f32| if l < 0.0 { l * inverse } else { l / inverse };
        for &id in &self.ids {
            let l = logits[id as usize];
            if l.is_finite() && !penalised(l).is_finite() {
                return Err(SampleError::ProcessorOverflow {
                    processor: "encoder_repetition_penalty",
                    token_id: id,
                    logit: l,
                });
            }
        }
        for &id in &self.ids {
            let l = &mut logits[id as usize];
            if l.is_finite() {
                *l = penalised(*l);
            }
        }
        Ok(())
    }
    fn reset(&mut self, prompt_ids: &[u32]) {
        self.ids.clear();
        self.ids.extend_from_slice(prompt_ids);
        self.ids.sort_unstable();
        self.ids.dedup();
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("prompt_ids", self.ids.last(), vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}
