//! `nucleus._core`'s token-bitmask function (Python: `nucleus.apply_token_bitmask_inplace`).

use numpy::{PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Sets `logits[r, t] = -inf` for every row `r` of `rows` and every token `t < vocab_size` whose
/// bit in `bitmask[r]` is clear (XGrammar's int32 layout: bit `t % 32` of word `t / 32`, set =
/// allowed), and for every `t >= vocab_size` (as llguidance does). `logits` float32
/// `[B, row_len]`, rows contiguous; `bitmask` int32 `[B', ceil(vocab_size / 32)]` or wider.
#[pyfunction]
fn apply_token_bitmask_inplace_f32<'py>(
    py: Python<'py>,
    mut logits: PyReadwriteArray2<'py, f32>,
    bitmask: PyReadonlyArray2<'py, i32>,
    vocab_size: usize,
    rows: Vec<usize>,
) -> PyResult<()> {
    let (batch, row_len) = (logits.shape()[0], logits.shape()[1]);
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
    let mask = bitmask.as_array();
    let mut view = logits.as_array_mut();
    // Every selected row, its bitmask words as u32 (the same bits).
    let mut work: Vec<(usize, Vec<u32>)> = Vec::with_capacity(rows.len());
    for &r in &rows {
        let row = mask.row(r);
        work.push((r, row.iter().map(|&w| w as u32).collect()));
    }
    // Row r -> its entry of `work` (a row named twice is masked once: the same bits).
    let mut slot = vec![None; batch];
    for (pos, (r, _)) in work.iter().enumerate() {
        slot[*r] = Some(pos);
    }
    let targets: Vec<_> = view
        .outer_iter_mut()
        .zip(slot)
        .filter_map(|(row, pos)| pos.map(|p| (row, p)))
        .collect();
    // Contiguity of each row, checked before any write.
    for (row, _) in &targets {
        if row.as_slice().is_none() {
            return Err(PyValueError::new_err(
                "the logits' rows must be contiguous (element stride 4 bytes)",
            ));
        }
    }
    py.detach(move || {
        for (mut row, pos) in targets {
            if let Some(values) = row.as_slice_mut() {
                let (vocab, padding) = values.split_at_mut(vocab_size);
                // The checks above make the words enough: this cannot fail.
                let _ = nucleus_sampling::apply_token_bitmask_inplace(vocab, &work[pos].1);
                padding.fill(f32::NEG_INFINITY);
            }
        }
    });
    Ok(())
}

/// Adds the bitmask function to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(apply_token_bitmask_inplace_f32, m)?)?;
    Ok(())
}
