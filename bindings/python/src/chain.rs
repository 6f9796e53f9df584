//! `nucleus._core.SamplerChain`: one sequence's processor chain (Python: `nucleus.SamplerChain`).

use nucleus_sampling::chain::{ProcessorConfig, ProcessorContext, SamplerChain};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::{Mutex, MutexGuard};

/// A processor chain built from the JSON of `nucleus sample`'s `chain` (README.md, "Processor
/// chains"), with the state of one sequence: the ids it was reset with and told.
///
/// The state is behind a mutex: threads sharing one chain take turns (each call sees the
/// state the previous one left), never a borrow error.
#[pyclass(name = "SamplerChain", module = "nucleus._core", frozen)]
pub(crate) struct PySamplerChain {
    state: Mutex<State>,
}

#[derive(Clone)]
struct State {
    chain: SamplerChain,
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
}

impl PySamplerChain {
    /// A chain with no sequence yet (no prompt, no output ids).
    fn fresh(chain: SamplerChain) -> Self {
        Self {
            state: Mutex::new(State {
                chain,
                prompt_ids: Vec::new(),
                output_ids: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A sampling error as `(kind, message)`, raised by the wrapper as `nucleus.SamplingError`.
fn sampling_error(e: &nucleus_sampling::SampleError) -> PyErr {
    PyValueError::new_err(crate::row_error(e))
}

#[pymethods]
impl PySamplerChain {
    /// Builds the chain from its JSON (a list of processor objects ending in a selection).
    #[new]
    fn new(config_json: &str) -> PyResult<Self> {
        let config: Vec<ProcessorConfig> = serde_json::from_str(config_json)
            .map_err(|e| PyValueError::new_err(format!("the chain's JSON: {e}")))?;
        let chain = SamplerChain::from_config(&config).map_err(value_error)?;
        Ok(Self::fresh(chain))
    }

    /// The chain of one request's `nucleus.SamplingParams` (a dict of its fields, as
    /// `src/params.rs` reads it): the crate's `SamplerChain::from_params`, whose results equal
    /// `nucleus.sample` with those parameters.
    ///
    /// Errors: `ValueError` for a field out of range; as `params_from_dict` for the dict.
    #[staticmethod]
    fn from_params(params: &Bound<'_, pyo3::types::PyDict>) -> PyResult<Self> {
        let p = crate::params::params_from_dict(params)?;
        let chain = SamplerChain::from_params(&p).map_err(value_error)?;
        Ok(Self::fresh(chain))
    }

    /// An independent copy: the same processors with the same state (counts, history, `mu`).
    fn clone(&self) -> Self {
        Self {
            state: Mutex::new(self.lock().clone()),
        }
    }

    /// Starts a sequence: the processors forget what they saw and learn the prompt.
    fn reset(&self, prompt_ids: Vec<u32>) {
        let mut state = self.lock();
        state.chain.reset(&prompt_ids);
        state.prompt_ids = prompt_ids;
        state.output_ids.clear();
    }

    /// Tells the chain the token the sequence took (after `sample`).
    fn accept(&self, token: u32) {
        let mut state = self.lock();
        state.chain.accept(token);
        state.output_ids.push(token);
    }

    /// The ids generated since `reset`.
    #[getter]
    fn output_ids(&self) -> Vec<u32> {
        self.lock().output_ids.clone()
    }

    /// Samples one row of f32 logits at `position`: `(token, logprob)`.
    #[pyo3(signature = (logits, position, sample_index=0))]
    fn sample(
        &self,
        py: Python<'_>,
        logits: PyReadonlyArray1<'_, f32>,
        position: u64,
        sample_index: u32,
    ) -> PyResult<(u32, f64)> {
        let row = logits.as_slice().map_err(value_error)?;
        let out = py.detach(|| {
            let mut state = self.lock();
            let State {
                chain,
                prompt_ids,
                output_ids,
            } = &mut *state;
            let ctx = ProcessorContext::new(prompt_ids, output_ids, position);
            chain.sample(row, &ctx, sample_index)
        });
        out.map(|o| (o.token, o.logprob))
            .map_err(|e| sampling_error(&e))
    }

    /// The final distribution the chain would draw this row from: float64 `[V]`.
    #[pyo3(signature = (logits, position))]
    fn distribution<'py>(
        &self,
        py: Python<'py>,
        logits: PyReadonlyArray1<'py, f32>,
        position: u64,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        let row = logits.as_slice().map_err(value_error)?;
        let out = py.detach(|| {
            let mut state = self.lock();
            let State {
                chain,
                prompt_ids,
                output_ids,
            } = &mut *state;
            let ctx = ProcessorContext::new(prompt_ids, output_ids, position);
            chain.distribution(row, &ctx)
        });
        out.map(|d| d.into_pyarray(py))
            .map_err(|e| sampling_error(&e))
    }
}

/// Adds the class to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySamplerChain>()?;
    Ok(())
}
