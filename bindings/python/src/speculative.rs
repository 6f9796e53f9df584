//! `nucleus._core`'s speculative verification (Python: `nucleus.chain_speculative_sampling`).

use nucleus_sampling::speculative::{verify, TargetRows, Verifier, VerifyRequest};
use nucleus_sampling::SamplingParams;
use numpy::{
    IntoPyArray, PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// What `chain_speculative_verify` returns: the emitted tokens `[B * (S + 1)]` (-1 padding),
/// the drafts that pass their own acceptance test `[B]`, the emitted draft tokens `[B]`, and
/// per row `None` or the error's (kind, message).
type Verified<'py> = (
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Vec<Option<(String, String)>>,
);

/// Verifies `B` drafts of `S` tokens against the target's `S + 1` rows of probabilities,
/// exactly (nucleus_sampling::speculative, spec/sampling.md "Random streams"). `draft_probs`
/// f32 `[B, S, V]` and `target_probs` f32 `[B, S + 1, V]` C-contiguous, `draft_token_ids` i64
/// `[B, S]`, `seed` u64 `[B]` or `None` (drawn from the OS per row), `offset` u64 `[B]`: the
/// position of each row's first draft token.
#[pyfunction]
#[pyo3(signature = (draft_probs, draft_token_ids, target_probs, seed, offset))]
fn chain_speculative_verify<'py>(
    py: Python<'py>,
    draft_probs: PyReadonlyArray3<'py, f32>,
    draft_token_ids: PyReadonlyArray2<'py, i64>,
    target_probs: PyReadonlyArray3<'py, f32>,
    seed: Option<PyReadonlyArray1<'py, u64>>,
    offset: PyReadonlyArray1<'py, u64>,
) -> PyResult<Verified<'py>> {
    let (b, s, v) = (
        draft_probs.shape()[0],
        draft_probs.shape()[1],
        draft_probs.shape()[2],
    );
    let t = target_probs.shape();
    if t != [b, s + 1, v] || draft_token_ids.shape() != [b, s] {
        return Err(PyValueError::new_err(format!(
            "shapes must be draft_probs [B, S, V], draft_token_ids [B, S], target_probs \
             [B, S + 1, V]; got {:?}, {:?}, {:?}",
            draft_probs.shape(),
            draft_token_ids.shape(),
            t
        )));
    }
    if offset.len() != b || seed.as_ref().is_some_and(|s| s.len() != b) {
        return Err(PyValueError::new_err(
            "seed and offset must have one value per row",
        ));
    }
    let draft = draft_probs
        .as_slice()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let target = target_probs
        .as_slice()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let ids = draft_token_ids
        .as_slice()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    if let Some(bad) = ids.iter().find(|&&x| x < 0 || x as u64 >= v as u64) {
        return Err(PyValueError::new_err(format!(
            "draft token id {bad} is outside the vocabulary (0 to {})",
            v.saturating_sub(1)
        )));
    }
    let ids: Vec<u32> = ids.iter().map(|&x| x as u32).collect();
    let seeds: Option<Vec<u64>> = match &seed {
        Some(a) => Some(
            a.as_slice()
                .map_err(|e| PyValueError::new_err(e.to_string()))?
                .to_vec(),
        ),
        None => None,
    };
    let offsets = offset
        .as_slice()
        .map_err(|e| PyValueError::new_err(e.to_string()))?
        .to_vec();
    let (out, independent, emitted, errors) = py.detach(move || {
        let mut out = vec![-1i32; b * (s + 1)];
        let mut independent = vec![0i32; b];
        let mut emitted = vec![0i32; b];
        let mut errors = Vec::with_capacity(b);
        for r in 0..b {
            // Without a seed, one drawn from the OS serves both the verification and the
            // independent counts (they must use the same uniforms).
            let key = match &seeds {
                Some(s) => s[r],
                None => match nucleus_sampling::os_seed() {
                    Ok(k) => k,
                    Err(e) => {
                        errors.push(Some(("SeedUnavailable".to_string(), e.to_string())));
                        continue;
                    }
                },
            };
            let params = SamplingParams {
                seed: Some(key),
                ..SamplingParams::default()
            };
            let row_draft = &draft[r * s * v..(r + 1) * s * v];
            let row_target = &target[r * (s + 1) * v..(r + 1) * (s + 1) * v];
            let row_ids = &ids[r * s..(r + 1) * s];
            let request = VerifyRequest {
                position: offsets[r],
                draft_probs: Some(row_draft),
                ..VerifyRequest::new(
                    Verifier::Params(&params),
                    row_ids,
                    TargetRows::Probs(row_target),
                    v,
                )
            };
            match verify(&request) {
                Ok(o) => {
                    for (j, &tok) in o.tokens.iter().enumerate() {
                        out[r * (s + 1) + j] = tok as i32;
                    }
                    emitted[r] = o.accepted as i32;
                    // FlashInfer's accepted count: each draft token's own test, as if the ones
                    // before it had been accepted (the same uniform at its position).
                    let mut n = 0;
                    for i in 0..s {
                        let one = VerifyRequest {
                            position: offsets[r] + i as u64,
                            draft_probs: Some(&row_draft[i * v..(i + 1) * v]),
                            ..VerifyRequest::new(
                                Verifier::Params(&params),
                                &row_ids[i..i + 1],
                                TargetRows::Probs(&row_target[i * v..(i + 2) * v]),
                                v,
                            )
                        };
                        if verify(&one).is_ok_and(|o| o.accepted == 1) {
                            n += 1;
                        }
                    }
                    independent[r] = n;
                    errors.push(None);
                }
                Err(e) => {
                    errors.push(Some(crate::row_error(&e)));
                }
            }
        }
        (out, independent, emitted, errors)
    });
    Ok((
        out.into_pyarray(py),
        independent.into_pyarray(py),
        emitted.into_pyarray(py),
        errors,
    ))
}

/// Adds the speculative functions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(chain_speculative_verify, m)?)?;
    Ok(())
}
