//! `nucleus._core`'s Ascend operators (Python: `nucleus.npu`, python/nucleus/npu.py).

use pyo3::prelude::*;

/// Adds the NPU operators' functions to the module.
pub(crate) fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
