//! What `nucleus sample` reads: one JSON row ([`RowInput`]) and parameter objects
//! ([`ParamsInput`]), with numbers that may be spelled `"-inf"`, `"inf"` or `"nan"`.
//!
//! Every struct denies unknown fields, so a misspelt name (`"topk"`) is an `invalid_row` error
//! rather than a silently ignored setting.

use std::collections::BTreeMap;
use std::fmt;

use nucleus_sampling::{LogprobsKind, ProcessorConfig, SamplingParams};
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

/// A JSON number, or one of the strings `"-inf"`, `"inf"` and `"nan"` (JSON has no spelling for
/// them; also `"+inf"`, `"infinity"`, in any case): the spellings of
/// [`nucleus_sampling::chain::lenient_f64`], so that `params` and `chain` rows read numbers
/// alike. Integers are converted to the nearest f64.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Lenient(pub f64);

impl<'de> Deserialize<'de> for Lenient {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        nucleus_sampling::chain::lenient_f64::deserialize(deserializer).map(Lenient)
    }
}

/// A JSON object deserialized as `T`. serde's derived structs also accept a JSON list of their
/// fields in declaration order; rows and parameters must name their fields, so a list (`[0.7]`
/// for `{"temperature": 0.7}`) is rejected here instead of being read silently.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Object<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(std::marker::PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = T;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }

        deserializer
            .deserialize_map(ObjectVisitor(std::marker::PhantomData))
            .map(Object)
    }
}

/// The message of a list whose memory could not be had while it was read; a parse error
/// holding it is an `allocation` error ([`allocation_kind`]).
pub const NOT_HELD: &str = "the list could not be held in memory";

/// Makes room for one more element of `values`, fallibly (doubling, as `push` would).
///
/// # Errors
/// The memory cannot be had: a [`NOT_HELD`] error.
fn grow<T, E: de::Error>(values: &mut Vec<T>) -> Result<(), E> {
    if values.len() == values.capacity() && values.try_reserve(values.len().max(16)).is_err() {
        return Err(E::custom(format_args!(
            "{NOT_HELD} (after {} values)",
            values.len()
        )));
    }
    Ok(())
}

/// A JSON list read into a vector that grows fallibly: a list the machine cannot hold is an
/// error answer of kind `allocation` ([`NOT_HELD`]), never an abort. (serde's `Vec` grows with
/// `push`, which aborts when memory runs out.)
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fallible<T>(pub Vec<T>);

impl<T> AsRef<[T]> for Fallible<T> {
    fn as_ref(&self) -> &[T] {
        &self.0
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Fallible<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ListVisitor<T>(std::marker::PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for ListVisitor<T> {
            type Value = Fallible<T>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                // serde's own word for a `Vec`, so messages stay as they were.
                f.write_str("a sequence")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Fallible<T>, A::Error> {
                let mut values = Vec::new();
                while let Some(v) = seq.next_element()? {
                    grow(&mut values)?;
                    values.push(v);
                }
                Ok(Fallible(values))
            }
        }

        deserializer.deserialize_seq(ListVisitor(std::marker::PhantomData))
    }
}

/// `"allocation"` for a parse error message saying a value could not be held in memory
/// ([`NOT_HELD`]), else `fallback`.
pub fn allocation_kind(message: &str, fallback: &'static str) -> &'static str {
    if message.contains(NOT_HELD) {
        "allocation"
    } else {
        fallback
    }
}

/// A row of values (`logits` or `probs`) as f32: each a JSON number (rounded to the nearest f32)
/// or `"-inf"`, `"inf"`, `"nan"` ([`Lenient`]).
///
/// A finite number that rounds beyond the f32 range (magnitude above about 3.4e38) has no f32
/// value: the first one is kept in `beyond_f32` (its index and value), and the row is an
/// `invalid_row` error that names the field ([`Row::check_range`]), never a silent ±inf.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Row {
    /// The values, rounded to f32.
    pub values: Vec<f32>,
    /// The first finite value whose f32 rounding is infinite: (index, value).
    pub beyond_f32: Option<(usize, f64)>,
}

impl Row {
    /// The values, or an `invalid_row` message naming `field`, the index and the value of the
    /// first finite number outside the f32 range.
    ///
    /// # Errors
    /// `"logits[0] = 1e39 is outside the f32 range (about ±3.4e38)"`.
    pub fn check_range(self, field: &str) -> Result<Vec<f32>, String> {
        match self.beyond_f32 {
            None => Ok(self.values),
            Some((i, v)) => Err(format!(
                "{field}[{i}] = {v:e} is outside the f32 range (about ±3.4e38)"
            )),
        }
    }
}

impl<'de> Deserialize<'de> for Row {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct RowVisitor;

        impl<'de> Visitor<'de> for RowVisitor {
            type Value = Row;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#"a list of numbers (or "-inf", "inf", "nan")"#)
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Row, A::Error> {
                // serde_json gives no size hint: the vector grows, fallibly, so that a row
                // the machine cannot hold is an error answer (kind `allocation`), not an abort.
                let mut values: Vec<f32> = Vec::new();
                let mut beyond_f32 = None;
                while let Some(Lenient(v)) = seq.next_element()? {
                    let rounded = v as f32;
                    if beyond_f32.is_none() && v.is_finite() && rounded.is_infinite() {
                        beyond_f32 = Some((values.len(), v));
                    }
                    grow(&mut values)?;
                    values.push(rounded);
                }
                Ok(Row { values, beyond_f32 })
            }
        }

        deserializer.deserialize_seq(RowVisitor)
    }
}

/// A `logit_bias` object, `{"<token id>": bias}`, in which every id appears once: a repeated
/// id (`{"1": 5, "1": -5}`, also `{"1": 5, "01": -5}`) is an error naming it, never "the last
/// one wins".
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BiasMap(pub BTreeMap<u32, f64>);

impl<'de> Deserialize<'de> for BiasMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BiasVisitor;

        impl<'de> Visitor<'de> for BiasVisitor {
            type Value = BiasMap;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#"an object {"<token id>": bias}"#)
            }

            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<BiasMap, A::Error> {
                let mut out = BTreeMap::new();
                while let Some(id) = map.next_key::<u32>()? {
                    let Lenient(bias) = map.next_value()?;
                    if out.insert(id, bias).is_some() {
                        return Err(de::Error::custom(format_args!(
                            "token id {id} appears more than once"
                        )));
                    }
                }
                Ok(BiasMap(out))
            }
        }

        deserializer.deserialize_map(BiasVisitor)
    }
}

/// `"raw"` or `"processed"` ([`LogprobsKind`]).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum KindInput {
    /// [`LogprobsKind::Raw`].
    Raw,
    /// [`LogprobsKind::Processed`].
    Processed,
}

/// A `params` object: [`SamplingParams`] fields by their snake_case names, every one optional
/// and off when absent or `null` (temperature 1).
///
/// `logit_bias` is an OpenAI-style object `{"<token id>": bias}`, each id once ([`BiasMap`]);
/// `bad_words` a list of id
/// lists; `seed` a u64, exact over its whole range (JSON integers are read without going
/// through f64).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamsInput {
    temperature: Option<Lenient>,
    top_k: Option<i64>,
    top_p: Option<Lenient>,
    min_p: Option<Lenient>,
    repetition_penalty: Option<Lenient>,
    presence_penalty: Option<Lenient>,
    frequency_penalty: Option<Lenient>,
    logit_bias: Option<BiasMap>,
    allowed_token_ids: Option<Vec<u32>>,
    bad_words: Option<Vec<Vec<u32>>>,
    min_tokens: Option<usize>,
    seed: Option<u64>,
    n: Option<usize>,
    logprobs: Option<usize>,
    logprobs_kind: Option<KindInput>,
    sequence_bias: Option<Vec<(Vec<u32>, Lenient)>>,
    dry_multiplier: Option<Lenient>,
    dry_base: Option<Lenient>,
    dry_allowed_length: Option<usize>,
    dry_penalty_last_n: Option<i64>,
    dry_sequence_breakers: Option<Vec<Vec<u32>>>,
    no_repeat_ngram_size: Option<usize>,
    dynatemp_range: Option<Lenient>,
    dynatemp_exponent: Option<Lenient>,
    typical_p: Option<Lenient>,
    top_n_sigma: Option<Lenient>,
    epsilon_cutoff: Option<Lenient>,
    eta_cutoff: Option<Lenient>,
    xtc_threshold: Option<Lenient>,
    xtc_probability: Option<Lenient>,
    min_keep: Option<usize>,
    mirostat: Option<u8>,
    mirostat_tau: Option<Lenient>,
    mirostat_eta: Option<Lenient>,
}

impl ParamsInput {
    /// The [`SamplingParams`] these fields spell, defaults for the absent ones. Ranges are not
    /// checked here: the sampler checks them per row ([`SamplingParams::validate`]) and answers
    /// with an `invalid_params` error naming the field.
    pub fn to_params(&self) -> SamplingParams {
        let d = SamplingParams::default();
        let f = |v: Option<Lenient>, default: f64| v.map_or(default, |Lenient(x)| x);
        SamplingParams {
            temperature: f(self.temperature, d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: f(self.top_p, d.top_p),
            min_p: f(self.min_p, d.min_p),
            repetition_penalty: f(self.repetition_penalty, d.repetition_penalty),
            presence_penalty: f(self.presence_penalty, d.presence_penalty),
            frequency_penalty: f(self.frequency_penalty, d.frequency_penalty),
            logit_bias: self
                .logit_bias
                .as_ref()
                .map_or_else(BTreeMap::new, |b| b.0.clone()),
            allowed_token_ids: self.allowed_token_ids.clone(),
            bad_words: self.bad_words.clone().unwrap_or_default(),
            min_tokens: self.min_tokens.unwrap_or(d.min_tokens),
            seed: self.seed,
            n: self.n.unwrap_or(d.n),
            logprobs: self.logprobs,
            logprobs_kind: match self.logprobs_kind {
                None => d.logprobs_kind,
                Some(KindInput::Raw) => LogprobsKind::Raw,
                Some(KindInput::Processed) => LogprobsKind::Processed,
            },
            sequence_bias: self.sequence_bias.as_ref().map_or_else(Vec::new, |v| {
                v.iter()
                    .map(|(ids, Lenient(b))| (ids.clone(), *b))
                    .collect()
            }),
            dry_multiplier: f(self.dry_multiplier, d.dry_multiplier),
            dry_base: f(self.dry_base, d.dry_base),
            dry_allowed_length: self.dry_allowed_length.unwrap_or(d.dry_allowed_length),
            dry_penalty_last_n: self.dry_penalty_last_n.unwrap_or(d.dry_penalty_last_n),
            dry_sequence_breakers: self.dry_sequence_breakers.clone().unwrap_or_default(),
            no_repeat_ngram_size: self.no_repeat_ngram_size.unwrap_or(d.no_repeat_ngram_size),
            dynatemp_range: f(self.dynatemp_range, d.dynatemp_range),
            dynatemp_exponent: f(self.dynatemp_exponent, d.dynatemp_exponent),
            typical_p: f(self.typical_p, d.typical_p),
            top_n_sigma: f(self.top_n_sigma, d.top_n_sigma),
            epsilon_cutoff: f(self.epsilon_cutoff, d.epsilon_cutoff),
            eta_cutoff: f(self.eta_cutoff, d.eta_cutoff),
            xtc_threshold: f(self.xtc_threshold, d.xtc_threshold),
            xtc_probability: f(self.xtc_probability, d.xtc_probability),
            min_keep: self.min_keep.unwrap_or(d.min_keep),
            mirostat: self.mirostat.unwrap_or(d.mirostat),
            mirostat_tau: f(self.mirostat_tau, d.mirostat_tau),
            mirostat_eta: f(self.mirostat_eta, d.mirostat_eta),
        }
    }
}

/// One line of JSON input: a row of logits or probabilities, its parameters (`params`) or
/// processor chain (`chain`), and its context. See the module docs of [`crate::sample`] for
/// the defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RowInput {
    /// Logits of the row.
    pub logits: Option<Row>,
    /// Probabilities (non-negative weights) of the row, instead of logits.
    pub probs: Option<Row>,
    /// Sampling parameters.
    pub params: Option<Object<ParamsInput>>,
    /// A processor chain, instead of `params`.
    pub chain: Option<ChainInput>,
    /// Prompt token ids.
    pub prompt_ids: Option<Fallible<u32>>,
    /// Token ids generated so far.
    pub output_ids: Option<Fallible<u32>>,
    /// Index in the whole sequence of the token being chosen.
    pub position: Option<u64>,
    /// EOS token ids (banned while fewer than `min_tokens` ids were generated).
    pub eos_token_ids: Option<Fallible<u32>>,
    /// Stop token ids (as `eos_token_ids`).
    pub stop_token_ids: Option<Fallible<u32>>,
    /// Candidate ids: the first `vocab_size` values of the row.
    pub vocab_size: Option<usize>,
}

/// The `chain` field: an ordered list of processor configurations, the JSON form of
/// [`nucleus_sampling::ProcessorConfig`] (e.g. `[{"top_k": {"k": 50}}, {"sample": {"seed": 1}}]`).
pub type ChainInput = Vec<ProcessorConfig>;
