//! `nucleus._core.SamplerChain`: one sequence's processor chain (Python: `nucleus.SamplerChain`).

use nucleus_sampling::chain::{ProcessorConfig, ProcessorContext, SamplerChain};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A processor chain built from the JSON of `nucleus sample`'s `chain` (README.md, "Processor
/// chains"), with the state of one sequence: the ids it was reset with and told.
#[pyclass(name = "SamplerChain", module = "nucleus._core")]
pub(crate) struct PySamplerChain {
    chain: SamplerChain,
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
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
        Ok(Self {
            chain,
            prompt_ids: Vec::new(),
            output_ids: Vec::new(),
        })
    }

    /// Starts a sequence: the processors forget what they saw and learn the prompt.
    fn reset(&mut self, prompt_ids: Vec<u32>) {
        self.chain.reset(&prompt_ids);
        self.prompt_ids = prompt_ids;
        self.output_ids.clear();
    }

    /// Tells the chain the token the sequence took (after `sample`).
    fn accept(&mut self, token: u32) {
        self.chain.accept(token);
        self.output_ids.push(token);
    }

    /// The ids generated since `reset`.
    #[getter]
    fn output_ids(&self) -> Vec<u32> {
        self.output_ids.clone()
    }

    /// Samples one row of f32 logits at `position`: `(token, logprob)`.
    #[pyo3(signature = (logits, position, sample_index=0))]
    fn sample(
        &mut self,
        py: Python<'_>,
        logits: PyReadonlyArray1<'_, f32>,
        position: u64,
        sample_index: u32,
    ) -> PyResult<(u32, f64)> {
        let row = logits.as_slice().map_err(value_error)?;
        let (chain, prompt, output) = (&mut self.chain, &self.prompt_ids, &self.output_ids);
        let out = py.detach(|| {
            let ctx = ProcessorContext::new(prompt, output, position);
            chain.sample(row, &ctx, sample_index)
        });
        out.map(|o| (o.token, o.logprob))
            .map_err(|e| sampling_error(&e))
    }

    /// The final distribution the chain would draw this row from: float64 `[V]`.
    #[pyo3(signature = (logits, position))]
    fn distribution<'py>(
        &mut self,
        py: Python<'py>,
        logits: PyReadonlyArray1<'py, f32>,
        position: u64,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        let row = logits.as_slice().map_err(value_error)?;
        let (chain, prompt, output) = (&mut self.chain, &self.prompt_ids, &self.output_ids);
        let out = py.detach(|| {
            let ctx = ProcessorContext::new(prompt, output, position);
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
