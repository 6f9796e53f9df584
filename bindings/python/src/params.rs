//! `nucleus.SamplingParams` ↔ the crate's [`SamplingParams`]: every field, by name.
//!
//! The Python class (python/nucleus/params.py) is a frozen dataclass; its `_to_dict()` is read
//! here by [`params_from_dict`], and [`default_params`] gives the crate's defaults so that the
//! class's defaults are tested against them.

use std::collections::BTreeMap;

use nucleus_sampling::{LogprobsKind, SamplingParams};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The field names, in the crate's order.
const FIELDS: [&str; 34] = [
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "seed",
    "n",
    "logprobs",
    "logprobs_kind",
    "sequence_bias",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "no_repeat_ngram_size",
    "dynatemp_range",
    "dynatemp_exponent",
    "typical_p",
    "top_n_sigma",
    "epsilon_cutoff",
    "eta_cutoff",
    "xtc_threshold",
    "xtc_probability",
    "min_keep",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
];

fn get<'py, T: FromPyObjectOwned<'py>>(
    d: &Bound<'py, PyDict>,
    name: &str,
    default: T,
) -> PyResult<T> {
    match d.get_item(name)? {
        None => Ok(default),
        Some(v) if v.is_none() => Ok(default),
        Some(v) => v.extract::<T>().map_err(|e| {
            let e: PyErr = e.into();
            PyTypeError::new_err(format!("SamplingParams.{name}: {e}"))
        }),
    }
}

fn optional<'py, T: FromPyObjectOwned<'py>>(
    d: &Bound<'py, PyDict>,
    name: &str,
) -> PyResult<Option<T>> {
    match d.get_item(name)? {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v.extract::<T>().map(Some).map_err(|e| {
            let e: PyErr = e.into();
            PyTypeError::new_err(format!("SamplingParams.{name}: {e}"))
        }),
    }
}

/// The crate's parameters from a dict of field names (absent or `None`: the default). Ranges
/// are not checked here: the sampler checks them per row and answers with an
/// `InvalidParams` row error naming the field.
///
/// Errors: `ValueError` for an unknown field or a `logprobs_kind` other than "raw" and
/// "processed"; `TypeError` naming the field for a value of the wrong type.
pub(crate) fn params_from_dict(d: &Bound<'_, PyDict>) -> PyResult<SamplingParams> {
    for key in d.keys() {
        let key: String = key.extract()?;
        if !FIELDS.contains(&key.as_str()) {
            return Err(PyValueError::new_err(format!(
                "SamplingParams has no field {key:?}"
            )));
        }
    }
    let p = SamplingParams::default();
    let logprobs_kind = match optional::<String>(d, "logprobs_kind")?.as_deref() {
        None | Some("processed") => LogprobsKind::Processed,
        Some("raw") => LogprobsKind::Raw,
        Some(other) => {
            return Err(PyValueError::new_err(format!(
                "SamplingParams.logprobs_kind must be \"raw\" or \"processed\", got {other:?}"
            )))
        }
    };
    Ok(SamplingParams {
        temperature: get(d, "temperature", p.temperature)?,
        top_k: get(d, "top_k", p.top_k)?,
        top_p: get(d, "top_p", p.top_p)?,
        min_p: get(d, "min_p", p.min_p)?,
        repetition_penalty: get(d, "repetition_penalty", p.repetition_penalty)?,
        presence_penalty: get(d, "presence_penalty", p.presence_penalty)?,
        frequency_penalty: get(d, "frequency_penalty", p.frequency_penalty)?,
        logit_bias: get::<BTreeMap<u32, f64>>(d, "logit_bias", BTreeMap::new())?,
        allowed_token_ids: optional(d, "allowed_token_ids")?,
        bad_words: get(d, "bad_words", Vec::new())?,
        min_tokens: get(d, "min_tokens", p.min_tokens)?,
        seed: optional(d, "seed")?,
        n: get(d, "n", p.n)?,
        logprobs: optional(d, "logprobs")?,
        logprobs_kind,
        sequence_bias: get(d, "sequence_bias", Vec::new())?,
        dry_multiplier: get(d, "dry_multiplier", p.dry_multiplier)?,
        dry_base: get(d, "dry_base", p.dry_base)?,
        dry_allowed_length: get(d, "dry_allowed_length", p.dry_allowed_length)?,
        dry_penalty_last_n: get(d, "dry_penalty_last_n", p.dry_penalty_last_n)?,
        dry_sequence_breakers: get(d, "dry_sequence_breakers", Vec::new())?,
        no_repeat_ngram_size: get(d, "no_repeat_ngram_size", p.no_repeat_ngram_size)?,
        dynatemp_range: get(d, "dynatemp_range", p.dynatemp_range)?,
        dynatemp_exponent: get(d, "dynatemp_exponent", p.dynatemp_exponent)?,
        typical_p: get(d, "typical_p", p.typical_p)?,
        top_n_sigma: get(d, "top_n_sigma", p.top_n_sigma)?,
        epsilon_cutoff: get(d, "epsilon_cutoff", p.epsilon_cutoff)?,
        eta_cutoff: get(d, "eta_cutoff", p.eta_cutoff)?,
        xtc_threshold: get(d, "xtc_threshold", p.xtc_threshold)?,
        xtc_probability: get(d, "xtc_probability", p.xtc_probability)?,
        min_keep: get(d, "min_keep", p.min_keep)?,
        mirostat: get(d, "mirostat", p.mirostat)?,
        mirostat_tau: get(d, "mirostat_tau", p.mirostat_tau)?,
        mirostat_eta: get(d, "mirostat_eta", p.mirostat_eta)?,
    })
}

/// The crate's `SamplingParams::default()` as a dict of every field.
#[pyfunction]
fn default_params(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let p = SamplingParams::default();
    let d = PyDict::new(py);
    d.set_item("temperature", p.temperature)?;
    d.set_item("top_k", p.top_k)?;
    d.set_item("top_p", p.top_p)?;
    d.set_item("min_p", p.min_p)?;
    d.set_item("repetition_penalty", p.repetition_penalty)?;
    d.set_item("presence_penalty", p.presence_penalty)?;
    d.set_item("frequency_penalty", p.frequency_penalty)?;
    d.set_item("logit_bias", p.logit_bias)?;
    d.set_item("allowed_token_ids", p.allowed_token_ids)?;
    d.set_item("bad_words", p.bad_words)?;
    d.set_item("min_tokens", p.min_tokens)?;
    d.set_item("seed", p.seed)?;
    d.set_item("n", p.n)?;
    d.set_item("logprobs", p.logprobs)?;
    d.set_item("logprobs_kind", p.logprobs_kind.as_str())?;
    d.set_item("sequence_bias", p.sequence_bias)?;
    d.set_item("dry_multiplier", p.dry_multiplier)?;
    d.set_item("dry_base", p.dry_base)?;
    d.set_item("dry_allowed_length", p.dry_allowed_length)?;
    d.set_item("dry_penalty_last_n", p.dry_penalty_last_n)?;
    d.set_item("dry_sequence_breakers", p.dry_sequence_breakers)?;
    d.set_item("no_repeat_ngram_size", p.no_repeat_ngram_size)?;
    d.set_item("dynatemp_range", p.dynatemp_range)?;
    d.set_item("dynatemp_exponent", p.dynatemp_exponent)?;
    d.set_item("typical_p", p.typical_p)?;
    d.set_item("top_n_sigma", p.top_n_sigma)?;
    d.set_item("epsilon_cutoff", p.epsilon_cutoff)?;
    d.set_item("eta_cutoff", p.eta_cutoff)?;
    d.set_item("xtc_threshold", p.xtc_threshold)?;
    d.set_item("xtc_probability", p.xtc_probability)?;
    d.set_item("min_keep", p.min_keep)?;
    d.set_item("mirostat", p.mirostat)?;
    d.set_item("mirostat_tau", p.mirostat_tau)?;
    d.set_item("mirostat_eta", p.mirostat_eta)?;
    Ok(d)
}

/// Checks every field's range (the crate's `SamplingParams::validate`): `None`, or the
/// `(field, message)` of the first field out of range.
///
/// Errors: as [`params_from_dict`].
#[pyfunction]
fn validate_params(d: &Bound<'_, PyDict>) -> PyResult<Option<(String, String)>> {
    let p = params_from_dict(d)?;
    Ok(p.validate()
        .err()
        .map(|e| (e.field.to_string(), e.to_string())))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(default_params, m)?)?;
    m.add_function(wrap_pyfunction!(validate_params, m)?)?;
    Ok(())
}
