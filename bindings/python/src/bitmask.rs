//! `nucleus._core`'s token-bitmask function (Python: `nucleus.apply_token_bitmask_inplace`).

use numpy::{PyArrayDescrMethods, PyReadonlyArray2, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Sets `logits[r, t] = -inf` for every row `r` of `rows` and every token `t < vocab_size` whose
/// bit in `bitmask[r]` is clear (XGrammar's int32 layout: bit `t % 32` of word `t / 32`, set =
/// allowed), and for every `t >= vocab_size` (as llguidance does). `logits` float32
/// `[B, row_len]`, rows contiguous; `bitmask` int32 `[B', ceil(vocab_size / 32)]` or wider.
///
/// Only the selected rows are borrowed, each for its own write, not the whole array: threads
/// masking different rows of one logits array at the same time (as engines do) never refuse
/// each other; two threads writing the same row at once is the caller's race, as with
/// XGrammar's kernel.
#[pyfunction]
fn apply_token_bitmask_inplace_f32<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyUntypedArray>,
    bitmask: PyReadonlyArray2<'py, i32>,
    vocab_size: usize,
    rows: Vec<usize>,
) -> PyResult<()> {
    if logits.ndim() != 2 || !logits.dtype().is_equiv_to(&numpy::dtype::<f32>(py)) {
        return Err(PyValueError::new_err("logits must be a 2-D float32 array"));
    }
    // SAFETY: a live NumPy array; reading its fields is sound.
    let (data, flags) = unsafe {
        let raw = logits.as_array_ptr();
        ((*raw).fields.data.cast::<f32>(), (*raw).fields.flags)
    };
    if flags & numpy::npyffi::NPY_ARRAY_WRITEABLE == 0 {
        return Err(PyValueError::new_err(
            "logits is read-only: apply_token_bitmask_inplace writes into it",
        ));
    }
    let (batch, row_len) = (logits.shape()[0], logits.shape()[1]);
    let strides = logits.strides();
    let (mask_rows, words) = (bitmask.shape()[0], bitmask.shape()[1]);
    if vocab_size > row_len || vocab_size.div_ceil(32) > words {
        return Err(PyValueError::new_err(format!(
            "vocab_size {vocab_size} needs rows of at least {vocab_size} logits and \
             {} bitmask words; got {row_len} and {words}",
            vocab_size.div_ceil(32)
        )));
    }
    if let Some(&r) = rows.iter().find(|&&r| r >= batch || r >= mask_rows) {
        return Err(PyValueError::new_err(format!(
            "row {r} is outside the logits ({batch} rows) or the bitmask ({mask_rows} rows)"
        )));
    }
    if row_len > 1 && strides[1] != 4 {
        return Err(PyValueError::new_err(format!(
            "the logits' rows must be contiguous (element stride {} bytes, a float32 is 4)",
            strides[1]
        )));
    }
    if batch > 1 && row_len > 0 && strides[0].unsigned_abs() < row_len * 4 {
        return Err(PyValueError::new_err(format!(
            "the logits' rows overlap (row stride {} bytes, rows of {row_len} values)",
            strides[0]
        )));
    }
    if !(data as usize).is_multiple_of(std::mem::align_of::<f32>()) {
        return Err(PyValueError::new_err(
            "the logits are not aligned to 4 bytes; copy them (np.ascontiguousarray)",
        ));
    }
    let mask = bitmask.as_array();
    // Every selected row once (a row named twice is masked once: the same bits), with its
    // bitmask words as u32 (the same bits) and the address of its first logit.
    let mut seen = vec![false; batch];
    let mut work: Vec<(usize, Vec<u32>)> = Vec::with_capacity(rows.len());
    for &r in &rows {
        if !std::mem::replace(&mut seen[r], true) && row_len > 0 {
            // SAFETY: r < batch, so the row's first element lies inside the array.
            let start = unsafe { data.cast::<u8>().offset(r as isize * strides[0]) } as usize;
            work.push((start, mask.row(r).iter().map(|&w| w as u32).collect()));
        }
    }
    py.detach(move || {
        for (start, words) in &work {
            // SAFETY: the row's `row_len` values are contiguous, inside the array, and no
            // other row overlaps them (checked above); each is borrowed once, here. The array
            // is kept alive by the caller's reference for the duration of the call.
            let values = unsafe { std::slice::from_raw_parts_mut(*start as *mut f32, row_len) };
            let (vocab, padding) = values.split_at_mut(vocab_size);
            // The checks above make the words enough: this cannot fail.
            let _ = nucleus_sampling::apply_token_bitmask_inplace(vocab, words);
            padding.fill(f32::NEG_INFINITY);
        }
    });
    Ok(())
}

/// Adds the bitmask function to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(apply_token_bitmask_inplace_f32, m)?)?;
    Ok(())
}
