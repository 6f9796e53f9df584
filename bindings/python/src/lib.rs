//! `nucleus._core`: the Rust side of the Python package `nucleus` (bindings/python/python/nucleus).
//!
//! The functions here take arrays already normalised by the Python wrapper (`nucleus/__init__.py`):
//! the logits a 2-D NumPy array of float32, float16 or bfloat16 (`ml_dtypes.bfloat16`) whose
//! rows are contiguous (any row stride, read in place without a copy), and every per-row
//! parameter a C-contiguous 1-D array of its dtype with one value per row. The work runs with
//! the GIL released (`Python::detach`).

use half::{bf16, f16};
use nucleus_sampling::{
    distribution, distribution_from_probs, sample_batch, InputKind, LogitValue, LogitsView,
    SampleError, SampleOutput, SampleRequest, SamplingParams,
};
use numpy::{
    IntoPyArray, PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

mod bitmask;
mod chain;
mod dlpack;
mod grammar;
mod npu;
mod params;
mod speculative;

/// The per-row parameters, one value per row each (`nucleus.sample`'s keywords).
struct Rows<'py> {
    temperature: PyReadonlyArray1<'py, f64>,
    top_k: PyReadonlyArray1<'py, i64>,
    top_p: PyReadonlyArray1<'py, f64>,
    min_p: PyReadonlyArray1<'py, f64>,
    repetition_penalty: PyReadonlyArray1<'py, f64>,
    presence_penalty: PyReadonlyArray1<'py, f64>,
    frequency_penalty: PyReadonlyArray1<'py, f64>,
    /// `None`: every row draws a seed from the OS.
    seed: Option<PyReadonlyArray1<'py, u64>>,
    position: PyReadonlyArray1<'py, u64>,
    /// The Philox counter's third word per row (the sample index).
    sample_index: PyReadonlyArray1<'py, u32>,
    /// Each row's prompt ids and generated ids (the penalties count them); empty: none.
    prompt_ids: Vec<Vec<u32>>,
    output_ids: Vec<Vec<u32>>,
    /// `nucleus.SamplingParams` per row (every field of the crate's parameters); empty: the
    /// arrays above give each row's parameters.
    extended: Vec<SamplingParams>,
    /// Each row's EOS and stop ids (banned while `min_tokens` is not reached); empty: none.
    stop_token_ids: Vec<Vec<u32>>,
    /// Mirostat's `mu` per row before this step; NaN (or no array): the start value.
    mirostat_mu: Option<PyReadonlyArray1<'py, f64>>,
    /// The structured-output bitmask, int32 `[batch, words]` (XGrammar's layout); `None`: none.
    token_bitmask: Option<PyReadonlyArray2<'py, i32>>,
}

/// One row's request, owned (moved into the GIL-free part).
struct Owned {
    params: SamplingParams,
    position: u64,
    sample_index: u32,
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
    stop_token_ids: Vec<u32>,
    mirostat_mu: Option<f64>,
    /// The row's bitmask words (a copy: ceil(V / 32) words, small beside the logits).
    token_bitmask: Option<Vec<u32>>,
}

impl Owned {
    fn request(&self) -> SampleRequest<'_> {
        let mut r = SampleRequest::new(
            &self.params,
            &self.prompt_ids,
            &self.output_ids,
            self.position,
        )
        .with_sample_index(self.sample_index)
        .with_stop_token_ids(&self.stop_token_ids);
        if let Some(mu) = self.mirostat_mu {
            r = r.with_mirostat_mu(mu);
        }
        if let Some(words) = &self.token_bitmask {
            r = r.with_token_bitmask(words);
        }
        r
    }
}

impl Rows<'_> {
    /// Row `i`'s parameters (the arrays are checked to hold `batch` values first).
    fn params(&self, i: usize) -> PyResult<SamplingParams> {
        if let Some(p) = self.extended.get(i) {
            return Ok(p.clone());
        }
        let f = |a: &PyReadonlyArray1<'_, f64>| -> PyResult<f64> {
            Ok(a.as_slice().map_err(value_error)?[i])
        };
        Ok(SamplingParams {
            temperature: f(&self.temperature)?,
            top_k: self.top_k.as_slice().map_err(value_error)?[i],
            top_p: f(&self.top_p)?,
            min_p: f(&self.min_p)?,
            repetition_penalty: f(&self.repetition_penalty)?,
            presence_penalty: f(&self.presence_penalty)?,
            frequency_penalty: f(&self.frequency_penalty)?,
            seed: match &self.seed {
                Some(s) => Some(s.as_slice().map_err(value_error)?[i]),
                None => None,
            },
            ..SamplingParams::default()
        })
    }

    /// Every row's request: its parameters, position, sample index and ids.
    fn requests(&self, batch: usize) -> PyResult<Vec<Owned>> {
        let positions = self.position.as_slice().map_err(value_error)?;
        let indices = self.sample_index.as_slice().map_err(value_error)?;
        let ids = |v: &[Vec<u32>], i: usize| v.get(i).cloned().unwrap_or_default();
        let mu = match &self.mirostat_mu {
            Some(a) => Some(a.as_slice().map_err(value_error)?),
            None => None,
        };
        let mask = self.token_bitmask.as_ref().map(|a| a.as_array());
        (0..batch)
            .map(|i| {
                Ok(Owned {
                    params: self.params(i)?,
                    position: positions[i],
                    sample_index: indices[i],
                    prompt_ids: ids(&self.prompt_ids, i),
                    output_ids: ids(&self.output_ids, i),
                    stop_token_ids: ids(&self.stop_token_ids, i),
                    mirostat_mu: mu.map(|m| m[i]).filter(|m| !m.is_nan()),
                    token_bitmask: mask
                        .as_ref()
                        .map(|m| m.row(i).iter().map(|&w| w as u32).collect()),
                })
            })
            .collect()
    }

    fn check(&self, batch: usize) -> PyResult<()> {
        let lens = [
            ("temperature", self.temperature.len()),
            ("top_k", self.top_k.len()),
            ("top_p", self.top_p.len()),
            ("min_p", self.min_p.len()),
            ("repetition_penalty", self.repetition_penalty.len()),
            ("presence_penalty", self.presence_penalty.len()),
            ("frequency_penalty", self.frequency_penalty.len()),
            ("position", self.position.len()),
            ("sample_index", self.sample_index.len()),
        ];
        for (name, len) in lens {
            if len != batch {
                return Err(PyValueError::new_err(format!(
                    "{name} has {len} values for {batch} rows"
                )));
            }
        }
        if let Some(m) = &self.mirostat_mu {
            if m.len() != batch {
                return Err(PyValueError::new_err(format!(
                    "mirostat_mu has {} values for {batch} rows",
                    m.len()
                )));
            }
        }
        if let Some(m) = &self.token_bitmask {
            if m.shape()[0] != batch {
                return Err(PyValueError::new_err(format!(
                    "token_bitmask has {} rows for {batch} rows of logits",
                    m.shape()[0]
                )));
            }
        }
        for (name, v) in [
            ("prompt_ids", &self.prompt_ids),
            ("output_ids", &self.output_ids),
            ("stop_token_ids", &self.stop_token_ids),
        ] {
            if !v.is_empty() && v.len() != batch {
                return Err(PyValueError::new_err(format!(
                    "{name} has {} rows for {batch} rows of logits",
                    v.len()
                )));
            }
        }
        if !self.extended.is_empty() && self.extended.len() != batch {
            return Err(PyValueError::new_err(format!(
                "params has {} SamplingParams for {batch} rows",
                self.extended.len()
            )));
        }
        if let Some(s) = &self.seed {
            if s.len() != batch {
                return Err(PyValueError::new_err(format!(
                    "seed has {} values for {batch} rows",
                    s.len()
                )));
            }
        }
        Ok(())
    }
}

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// `"logits"` or `"probs"`.
fn input_kind(kind: &str) -> PyResult<InputKind> {
    match kind {
        "logits" => Ok(InputKind::Logits),
        "probs" => Ok(InputKind::Probs),
        other => Err(PyValueError::new_err(format!(
            "kind must be \"logits\" or \"probs\", got {other:?}"
        ))),
    }
}

/// A 2-D array's elements as one slice covering every row, and its row stride in elements.
///
/// # Errors
/// A `ValueError` when the rows are not contiguous (an element stride other than the item
/// size) or the row stride is negative or not a whole number of elements.
fn rows_of<'a, T: numpy::Element>(a: &'a PyReadonlyArray2<'_, T>) -> PyResult<(&'a [T], usize)> {
    let [batch, row_len] = [a.shape()[0], a.shape()[1]];
    if batch == 0 || row_len == 0 {
        // No element to read (NumPy may give an empty array zero strides).
        return Ok((&[], row_len));
    }
    if !(a.data() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(PyValueError::new_err(
            "the logits are not aligned to their item size; copy them (np.ascontiguousarray)",
        ));
    }
    let item = std::mem::size_of::<T>() as isize;
    let strides = a.strides();
    if row_len > 1 && strides[1] != item {
        return Err(PyValueError::new_err(format!(
            "the logits' rows must be contiguous (element stride {} bytes, the item is {item})",
            strides[1]
        )));
    }
    let row_stride = if batch <= 1 {
        row_len
    } else {
        if strides[0] < 0 || strides[0] % item != 0 {
            return Err(PyValueError::new_err(format!(
                "the logits' row stride {} bytes is not a forward whole number of {item}-byte items",
                strides[0]
            )));
        }
        (strides[0] / item) as usize
    };
    if batch > 1 && row_stride < row_len {
        return Err(PyValueError::new_err(format!(
            "the logits' rows overlap (row stride {row_stride} items, rows of {row_len})"
        )));
    }
    let len = if batch == 0 {
        0
    } else {
        (batch - 1) * row_stride + row_len
    };
    // SAFETY: the readonly borrow keeps the array alive and unwritten by Rust; the checks
    // above make [data, data + len) exactly the span of its rows.
    let data = unsafe { std::slice::from_raw_parts(a.data() as *const T, len) };
    Ok((data, row_stride.max(row_len)))
}

/// The kind (the Rust variant's name) and message of a row's error.
pub(crate) fn row_error(e: &SampleError) -> (String, String) {
    let debug = format!("{e:?}");
    let kind = debug
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or("SampleError")
        .to_string();
    (kind, e.to_string())
}

type RowResults = Vec<Result<SampleOutput, SampleError>>;

/// Per row: `None`, or a failed row's error kind and message.
type RowErrors = Vec<Option<(String, String)>>;

/// What `sample` returns: token ids, logprobs, per-row errors, then per row the seed used,
/// the number of candidates and mirostat's `mu` after the step (NaN when off or failed).
type Sampled<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<f64>>,
    RowErrors,
    Bound<'py, PyArray1<u64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<f64>>,
);

fn sample_typed<T: LogitValue + numpy::Element>(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    kind: InputKind,
    vocab_size: usize,
    rows: &Rows<'_>,
) -> PyResult<RowResults> {
    let array: PyReadonlyArray2<'_, T> = logits.extract()?;
    let batch = array.shape()[0];
    let row_len = array.shape()[1];
    rows.check(batch)?;
    let (data, row_stride) = rows_of(&array)?;
    let view = LogitsView::new(data, batch, row_len, row_stride, vocab_size)
        .map_err(value_error)?
        .with_kind(kind);
    let requests = rows.requests(batch)?;
    py.detach(move || {
        let requests: Vec<SampleRequest<'_>> = requests.iter().map(Owned::request).collect();
        sample_batch(&view, &requests).map_err(value_error)
    })
}

/// Samples one token per row: `(token_ids int64[B], logprobs float64[B], errors)`, `errors[i]`
/// `None` or `(kind, message)`; a failed row has token -1 and logprob NaN.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (logits, dtype, kind, vocab_size, temperature, top_k, top_p, min_p,
                    repetition_penalty, presence_penalty, frequency_penalty, seed, position,
                    sample_index, prompt_ids, output_ids, params=None, stop_token_ids=None,
                    mirostat_mu=None, token_bitmask=None))]
fn sample<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    dtype: &str,
    kind: &str,
    vocab_size: usize,
    temperature: PyReadonlyArray1<'py, f64>,
    top_k: PyReadonlyArray1<'py, i64>,
    top_p: PyReadonlyArray1<'py, f64>,
    min_p: PyReadonlyArray1<'py, f64>,
    repetition_penalty: PyReadonlyArray1<'py, f64>,
    presence_penalty: PyReadonlyArray1<'py, f64>,
    frequency_penalty: PyReadonlyArray1<'py, f64>,
    seed: Option<PyReadonlyArray1<'py, u64>>,
    position: PyReadonlyArray1<'py, u64>,
    sample_index: PyReadonlyArray1<'py, u32>,
    prompt_ids: Vec<Vec<u32>>,
    output_ids: Vec<Vec<u32>>,
    params: Option<Vec<Bound<'py, pyo3::types::PyDict>>>,
    stop_token_ids: Option<Vec<Vec<u32>>>,
    mirostat_mu: Option<PyReadonlyArray1<'py, f64>>,
    token_bitmask: Option<PyReadonlyArray2<'py, i32>>,
) -> PyResult<Sampled<'py>> {
    let kind = input_kind(kind)?;
    let rows = Rows {
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed,
        position,
        sample_index,
        prompt_ids,
        output_ids,
        extended: params
            .unwrap_or_default()
            .iter()
            .map(params::params_from_dict)
            .collect::<PyResult<_>>()?,
        stop_token_ids: stop_token_ids.unwrap_or_default(),
        mirostat_mu,
        token_bitmask,
    };
    let results = match dtype {
        "float32" => sample_typed::<f32>(py, logits, kind, vocab_size, &rows)?,
        "float16" => sample_typed::<f16>(py, logits, kind, vocab_size, &rows)?,
        "bfloat16" => sample_typed::<bf16>(py, logits, kind, vocab_size, &rows)?,
        other => {
            return Err(PyValueError::new_err(format!(
                "logits must be float32, float16 or bfloat16, got {other}"
            )))
        }
    };
    let mut tokens = Vec::with_capacity(results.len());
    let mut logprobs = Vec::with_capacity(results.len());
    let mut errors = Vec::with_capacity(results.len());
    let mut seeds = Vec::with_capacity(results.len());
    let mut candidates = Vec::with_capacity(results.len());
    let mut mu = Vec::with_capacity(results.len());
    for r in &results {
        match r {
            Ok(o) => {
                tokens.push(i64::from(o.token));
                logprobs.push(o.logprob);
                errors.push(None);
                seeds.push(o.seed);
                candidates.push(o.num_candidates as i64);
                mu.push(o.mirostat_mu.unwrap_or(f64::NAN));
            }
            Err(e) => {
                tokens.push(-1);
                logprobs.push(f64::NAN);
                errors.push(Some(row_error(e)));
                seeds.push(0);
                candidates.push(0);
                mu.push(f64::NAN);
            }
        }
    }
    Ok((
        tokens.into_pyarray(py),
        logprobs.into_pyarray(py),
        errors,
        seeds.into_pyarray(py),
        candidates.into_pyarray(py),
        mu.into_pyarray(py),
    ))
}

/// The exact final distribution of each row (float32 logits): `(probs float64[B * V], errors)`,
/// row-major; a failed row is NaN.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (logits, kind, vocab_size, temperature, top_k, top_p, min_p,
                    repetition_penalty, presence_penalty, frequency_penalty, seed, position,
                    sample_index, prompt_ids, output_ids, params=None, stop_token_ids=None,
                    mirostat_mu=None, token_bitmask=None))]
fn distribution_f32<'py>(
    py: Python<'py>,
    logits: PyReadonlyArray2<'py, f32>,
    kind: &str,
    vocab_size: usize,
    temperature: PyReadonlyArray1<'py, f64>,
    top_k: PyReadonlyArray1<'py, i64>,
    top_p: PyReadonlyArray1<'py, f64>,
    min_p: PyReadonlyArray1<'py, f64>,
    repetition_penalty: PyReadonlyArray1<'py, f64>,
    presence_penalty: PyReadonlyArray1<'py, f64>,
    frequency_penalty: PyReadonlyArray1<'py, f64>,
    seed: Option<PyReadonlyArray1<'py, u64>>,
    position: PyReadonlyArray1<'py, u64>,
    sample_index: PyReadonlyArray1<'py, u32>,
    prompt_ids: Vec<Vec<u32>>,
    output_ids: Vec<Vec<u32>>,
    params: Option<Vec<Bound<'py, pyo3::types::PyDict>>>,
    stop_token_ids: Option<Vec<Vec<u32>>>,
    mirostat_mu: Option<PyReadonlyArray1<'py, f64>>,
    token_bitmask: Option<PyReadonlyArray2<'py, i32>>,
) -> PyResult<(Bound<'py, PyArray1<f64>>, RowErrors)> {
    let kind = input_kind(kind)?;
    let rows = Rows {
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed,
        position,
        sample_index,
        prompt_ids,
        output_ids,
        extended: params
            .unwrap_or_default()
            .iter()
            .map(params::params_from_dict)
            .collect::<PyResult<_>>()?,
        stop_token_ids: stop_token_ids.unwrap_or_default(),
        mirostat_mu,
        token_bitmask,
    };
    let batch = logits.shape()[0];
    let row_len = logits.shape()[1];
    rows.check(batch)?;
    if vocab_size == 0 || vocab_size > row_len {
        return Err(PyValueError::new_err(format!(
            "vocab_size {vocab_size} must be in 1..={row_len} (the row length)"
        )));
    }
    let (data, row_stride) = rows_of(&logits)?;
    let requests = rows.requests(batch)?;
    let (probs, errors) = py.detach(move || {
        let mut probs = vec![f64::NAN; batch * row_len];
        let mut errors = Vec::with_capacity(batch);
        for (i, r) in requests.iter().enumerate() {
            let row = &data[i * row_stride..i * row_stride + vocab_size];
            let request = r.request();
            let d = match kind {
                InputKind::Logits => distribution(row, &request),
                InputKind::Probs => distribution_from_probs(row, &request),
            };
            match d {
                Ok(d) => {
                    let out = &mut probs[i * row_len..(i + 1) * row_len];
                    out[..vocab_size].copy_from_slice(&d);
                    out[vocab_size..].fill(0.0);
                    errors.push(None);
                }
                Err(e) => errors.push(Some(row_error(&e))),
            }
        }
        (probs, errors)
    });
    Ok((probs.into_pyarray(py), errors))
}

/// The module `nucleus._core`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sample, m)?)?;
    m.add_function(wrap_pyfunction!(distribution_f32, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    npu::register(m)?;
    bitmask::register(m)?;
    dlpack::register(m)?;
    speculative::register(m)?;
    chain::register(m)?;
    grammar::register(m)?;
    params::register(m)?;
    Ok(())
}
