//! `nucleus._core`'s Ascend operators (Python: `nucleus.npu`, python/nucleus/npu.py).
//!
//! As in lib.rs, the arrays arrive normalised by the Python wrapper: logits 2-D with contiguous
//! rows (read in place, any row stride), every other tensor C-contiguous in the dtype named
//! here. The work runs with the GIL released. A call-level error of the Rust operator is a
//! `ValueError` naming the input or attribute (`MemoryError` for an output that cannot be had);
//! per-row errors of `top_k_top_p_sample` are returned, not raised.

use half::{bf16, f16};
use nucleus_moe::{
    moe_finalize_routing, moe_gating_top_k, moe_gating_top_k_softmax, moe_init_routing,
    DropPadMode, Element, ExpandedX, ExpertTokensNumType, FinalizeRoutingInput, FloatElement,
    GroupSelectMode, GroupedTopKParams, MoeError, MoeInitRoutingAttrs, MoeInitRoutingInput,
    NormType, QuantMode, RowIdxType,
};
use nucleus_sampling::npu::{
    top_k_top_p_sample, QIndexing, TopKTopPError, TopKTopPSampleOptions, TopKTopPSampleOutput,
};
use nucleus_sampling::{InputKind, LogitValue, LogitsView};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::{PyMemoryError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::{rows_of, value_error};

/// Per row: `None`, or a failed row's error kind (the Rust variant's name) and message.
type RowErrors = Vec<Option<(String, String)>>;

/// The Rust variant's name of an error (its `Debug` up to the first non-alphanumeric).
fn variant_name(debug: &str) -> String {
    debug
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or("Error")
        .to_string()
}

fn top_k_top_p_error(e: TopKTopPError) -> PyErr {
    match e {
        TopKTopPError::DtypeMismatch { .. } => PyTypeError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

fn moe_error(e: MoeError) -> PyErr {
    match e {
        MoeError::Allocation { .. } => PyMemoryError::new_err(e.to_string()),
        _ => PyValueError::new_err(format!("{} error: {e}", e.kind())),
    }
}

/// The readonly arrays' slices (the wrapper made them C-contiguous).
fn slice_of<'a, T: numpy::Element>(a: &'a PyReadonlyArray1<'_, T>) -> PyResult<&'a [T]> {
    a.as_slice().map_err(value_error)
}

#[allow(clippy::too_many_arguments)]
fn sample_typed<T: LogitValue + numpy::Element>(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    top_k: &[i32],
    top_p: &[f32],
    q: Option<&[f32]>,
    min_ps: Option<&[f32]>,
    options: &TopKTopPSampleOptions,
    kind: InputKind,
) -> PyResult<TopKTopPSampleOutput> {
    let array: PyReadonlyArray2<'_, T> = logits.extract()?;
    let [batch, row_len] = [array.shape()[0], array.shape()[1]];
    let (data, row_stride) = rows_of(&array)?;
    let view = LogitsView::new(data, batch, row_len, row_stride, row_len)
        .map_err(value_error)?
        .with_kind(kind);
    py.detach(move || top_k_top_p_sample(&view, top_k, top_p, q, min_ps, options))
        .map_err(top_k_top_p_error)
}

/// What `npu_top_k_top_p_sample` returns: `logits_select_idx` int64 `[B]`,
/// `logits_top_kp_select` float32 `[B * V]` (flat) when asked, per-row errors.
type Sampled<'py> = (
    Bound<'py, PyArray1<i64>>,
    Option<Bound<'py, PyArray1<f32>>>,
    RowErrors,
);

/// `nucleus_sampling::npu::top_k_top_p_sample` (spec/npu_top_k_top_p_sample.md) on a 2-D
/// array of float32 / float16 / bfloat16 rows; `top_k` int32 `[B]`, `top_p` and `min_ps`
/// float32 `[B]`, `q` float32 `[B, V]` C-contiguous.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (logits, dtype, top_k, top_p, q, min_ps, eps, is_need_logits, top_k_guess,
                    ks_max, input_is_logits, q_sorted_rank))]
fn npu_top_k_top_p_sample<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    dtype: &str,
    top_k: PyReadonlyArray1<'py, i32>,
    top_p: PyReadonlyArray1<'py, f32>,
    q: Option<PyReadonlyArray2<'py, f32>>,
    min_ps: Option<PyReadonlyArray1<'py, f32>>,
    eps: f64,
    is_need_logits: bool,
    top_k_guess: i64,
    ks_max: i64,
    input_is_logits: bool,
    q_sorted_rank: bool,
) -> PyResult<Sampled<'py>> {
    let options = TopKTopPSampleOptions {
        eps,
        is_need_logits,
        top_k_guess,
        ks_max,
        q_indexing: if q_sorted_rank {
            QIndexing::SortedRank
        } else {
            QIndexing::TokenId
        },
    };
    let kind = if input_is_logits {
        InputKind::Logits
    } else {
        InputKind::Probs
    };
    let top_k = slice_of(&top_k)?;
    let top_p = slice_of(&top_p)?;
    let q_slice = match &q {
        Some(q) => Some(q.as_slice().map_err(value_error)?),
        None => None,
    };
    let min_ps = match &min_ps {
        Some(m) => Some(slice_of(m)?),
        None => None,
    };
    let out = match dtype {
        "float32" => {
            sample_typed::<f32>(py, logits, top_k, top_p, q_slice, min_ps, &options, kind)?
        }
        "float16" => {
            sample_typed::<f16>(py, logits, top_k, top_p, q_slice, min_ps, &options, kind)?
        }
        "bfloat16" => {
            sample_typed::<bf16>(py, logits, top_k, top_p, q_slice, min_ps, &options, kind)?
        }
        other => {
            return Err(PyTypeError::new_err(format!(
                "logits must be float32, float16 or bfloat16, got {other}"
            )))
        }
    };
    let errors = out
        .row_status
        .iter()
        .map(|s| {
            s.as_ref()
                .err()
                .map(|e| (variant_name(&format!("{e:?}")), e.to_string()))
        })
        .collect();
    Ok((
        out.logits_select_idx.into_pyarray(py),
        out.logits_top_kp_select.map(|v| v.into_pyarray(py)),
        errors,
    ))
}

/// What `npu_moe_init_routing_v2` returns: `expanded_x` (flat, in x's dtype or int8), its
/// shape, `expanded_row_idx` int32, `expert_tokens` int64 (flat) or None, `expanded_scale`
/// float32 or None, `valid_rows`.
type Routed<'py> = (
    Bound<'py, PyAny>,
    Vec<usize>,
    Bound<'py, PyArray1<i32>>,
    Option<Bound<'py, PyArray1<i64>>>,
    Option<Bound<'py, PyArray1<f32>>>,
    usize,
);

fn routing_typed<'py, T: Element + numpy::Element>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    expert_idx: &[i32],
    k: usize,
    scale: Option<&[f32]>,
    offset: Option<&[f32]>,
    attrs: &MoeInitRoutingAttrs,
) -> PyResult<Routed<'py>> {
    let array: PyReadonlyArray2<'py, T> = x.extract()?;
    let [num_rows, hidden_size] = [array.shape()[0], array.shape()[1]];
    let x = array.as_slice().map_err(value_error)?;
    let input = MoeInitRoutingInput {
        x,
        num_rows,
        hidden_size,
        expert_idx,
        k,
        scale,
        offset,
    };
    let out = py
        .detach(move || moe_init_routing(&input, attrs))
        .map_err(moe_error)?;
    let expanded_x = match out.expanded_x {
        ExpandedX::Unquantized(v) => v.into_pyarray(py).into_any(),
        ExpandedX::Int8(v) => v.into_pyarray(py).into_any(),
    };
    Ok((
        expanded_x,
        out.expanded_x_shape,
        out.expanded_row_idx.into_pyarray(py),
        out.expert_tokens.map(|v| v.into_pyarray(py)),
        out.expanded_scale.map(|v| v.into_pyarray(py)),
        out.valid_rows,
    ))
}

/// `nucleus_moe::moe_init_routing` (spec/moe_routing.md): `x [N, H]` C-contiguous float32 /
/// float16 / bfloat16 / int8, `expert_idx [N, K]` int32 C-contiguous, `scale` / `offset`
/// float32 flat; the attributes by their torch_npu names.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (x, dtype, expert_idx, scale, offset, active_num, expert_capacity,
                    expert_num, drop_pad_mode, expert_tokens_num_type, expert_tokens_num_flag,
                    quant_mode, active_expert_range, row_idx_type))]
fn npu_moe_init_routing_v2<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    dtype: &str,
    expert_idx: PyReadonlyArray2<'py, i32>,
    scale: Option<PyReadonlyArray1<'py, f32>>,
    offset: Option<PyReadonlyArray1<'py, f32>>,
    active_num: i64,
    expert_capacity: i64,
    expert_num: i64,
    drop_pad_mode: i64,
    expert_tokens_num_type: i64,
    expert_tokens_num_flag: bool,
    quant_mode: i64,
    active_expert_range: Option<[i64; 2]>,
    row_idx_type: i64,
) -> PyResult<Routed<'py>> {
    let attrs = MoeInitRoutingAttrs {
        active_num,
        expert_capacity,
        expert_num,
        drop_pad_mode: DropPadMode::try_from(drop_pad_mode).map_err(moe_error)?,
        expert_tokens_num_type: ExpertTokensNumType::try_from(expert_tokens_num_type)
            .map_err(moe_error)?,
        expert_tokens_num_flag,
        quant_mode: QuantMode::try_from(quant_mode).map_err(moe_error)?,
        active_expert_range,
        row_idx_type: RowIdxType::try_from(row_idx_type).map_err(moe_error)?,
    };
    let k = expert_idx.shape()[1];
    let ids = expert_idx.as_slice().map_err(value_error)?;
    let scale = match &scale {
        Some(s) => Some(slice_of(s)?),
        None => None,
    };
    let offset = match &offset {
        Some(o) => Some(slice_of(o)?),
        None => None,
    };
    match dtype {
        "float32" => routing_typed::<f32>(py, x, ids, k, scale, offset, &attrs),
        "float16" => routing_typed::<f16>(py, x, ids, k, scale, offset, &attrs),
        "bfloat16" => routing_typed::<bf16>(py, x, ids, k, scale, offset, &attrs),
        "int8" => routing_typed::<i8>(py, x, ids, k, scale, offset, &attrs),
        other => Err(PyTypeError::new_err(format!(
            "x must be float32, float16, bfloat16 or int8, got {other}"
        ))),
    }
}

/// `(weights float32 [N*k], expert_idx int32 [N*k])` of a gating call.
type Gated<'py> = (Bound<'py, PyArray1<f32>>, Bound<'py, PyArray1<i32>>);

fn gating_softmax_typed<'py, T: FloatElement + numpy::Element>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    k: usize,
    renorm: bool,
    finished: Option<&[bool]>,
) -> PyResult<Gated<'py>> {
    let array: PyReadonlyArray2<'py, T> = x.extract()?;
    let e = array.shape()[1];
    let logits = array.as_slice().map_err(value_error)?;
    let out = py
        .detach(move || moe_gating_top_k_softmax(logits, e, k, renorm, finished))
        .map_err(moe_error)?;
    Ok((
        out.weights.into_pyarray(py),
        out.expert_idx.into_pyarray(py),
    ))
}

/// `nucleus_moe::moe_gating_top_k_softmax`: `x [N, E]` C-contiguous float32 / float16 /
/// bfloat16, `finished` bool `[N]` or None.
#[pyfunction]
#[pyo3(signature = (x, dtype, k, renorm, finished))]
fn npu_moe_gating_top_k_softmax<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    dtype: &str,
    k: usize,
    renorm: bool,
    finished: Option<PyReadonlyArray1<'py, bool>>,
) -> PyResult<Gated<'py>> {
    let finished = match &finished {
        Some(f) => Some(slice_of(f)?),
        None => None,
    };
    match dtype {
        "float32" => gating_softmax_typed::<f32>(py, x, k, renorm, finished),
        "float16" => gating_softmax_typed::<f16>(py, x, k, renorm, finished),
        "bfloat16" => gating_softmax_typed::<bf16>(py, x, k, renorm, finished),
        other => Err(PyTypeError::new_err(format!(
            "x must be float32, float16 or bfloat16, got {other}"
        ))),
    }
}

fn gating_grouped_typed<'py, T: FloatElement + numpy::Element>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    bias: Option<&[f32]>,
    params: &GroupedTopKParams,
) -> PyResult<Gated<'py>> {
    let array: PyReadonlyArray2<'py, T> = x.extract()?;
    let e = array.shape()[1];
    let logits = array.as_slice().map_err(value_error)?;
    let out = py
        .detach(move || moe_gating_top_k(logits, e, bias, params))
        .map_err(moe_error)?;
    Ok((
        out.weights.into_pyarray(py),
        out.expert_idx.into_pyarray(py),
    ))
}

/// `nucleus_moe::moe_gating_top_k` (grouped routing): `x [N, E]` C-contiguous, `bias` float32
/// `[E]` or None; `group_select_mode` 0 max / 1 top-2 sum, `norm_type` 0 softmax / 1 sigmoid.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (x, dtype, k, bias, k_group, group_count, group_select_mode, renorm,
                    norm_type, routed_scaling_factor, eps))]
fn npu_moe_gating_top_k<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    dtype: &str,
    k: usize,
    bias: Option<PyReadonlyArray1<'py, f32>>,
    k_group: usize,
    group_count: usize,
    group_select_mode: i64,
    renorm: bool,
    norm_type: i64,
    routed_scaling_factor: f32,
    eps: f32,
) -> PyResult<Gated<'py>> {
    let params = GroupedTopKParams {
        k,
        k_group,
        group_count,
        group_select_mode: match group_select_mode {
            0 => GroupSelectMode::Max,
            1 => GroupSelectMode::Top2Sum,
            v => {
                return Err(PyValueError::new_err(format!(
                    "group_select_mode = {v}: must be 0 (max) or 1 (sum of the top 2)"
                )))
            }
        },
        renorm,
        norm_type: match norm_type {
            0 => NormType::Softmax,
            1 => NormType::Sigmoid,
            v => {
                return Err(PyValueError::new_err(format!(
                    "norm_type = {v}: must be 0 (softmax) or 1 (sigmoid)"
                )))
            }
        },
        routed_scaling_factor,
        eps,
    };
    let bias = match &bias {
        Some(b) => Some(slice_of(b)?),
        None => None,
    };
    match dtype {
        "float32" => gating_grouped_typed::<f32>(py, x, bias, &params),
        "float16" => gating_grouped_typed::<f16>(py, x, bias, &params),
        "bfloat16" => gating_grouped_typed::<bf16>(py, x, bias, &params),
        other => Err(PyTypeError::new_err(format!(
            "x must be float32, float16 or bfloat16, got {other}"
        ))),
    }
}

/// The optional `[rows, H]` tensors of a finalize call, in the dtype of `expert_out`.
struct FinalizeExtras<'py> {
    skip1: Option<Bound<'py, PyAny>>,
    skip2: Option<Bound<'py, PyAny>>,
    bias: Option<Bound<'py, PyAny>>,
}

#[allow(clippy::too_many_arguments)]
fn finalize_typed<'py, T: FloatElement + numpy::Element>(
    py: Python<'py>,
    expert_out: &Bound<'py, PyAny>,
    valid_rows: Option<usize>,
    expanded_row_idx: &[i32],
    k: usize,
    weights: Option<&[f32]>,
    expert_idx: Option<&[i32]>,
    extras: &FinalizeExtras<'py>,
) -> PyResult<Bound<'py, PyAny>> {
    let array: PyReadonlyArray2<'py, T> = expert_out.extract()?;
    let [rows, hidden_size] = [array.shape()[0], array.shape()[1]];
    let expert_out = array.as_slice().map_err(value_error)?;
    let read = |a: &Option<Bound<'py, PyAny>>| -> PyResult<Option<PyReadonlyArray2<'py, T>>> {
        a.as_ref().map(|a| a.extract()).transpose()
    };
    let (skip1, skip2, bias) = (
        read(&extras.skip1)?,
        read(&extras.skip2)?,
        read(&extras.bias)?,
    );
    let skip1 = skip1
        .as_ref()
        .map(|a| a.as_slice())
        .transpose()
        .map_err(value_error)?;
    let skip2 = skip2
        .as_ref()
        .map(|a| a.as_slice())
        .transpose()
        .map_err(value_error)?;
    let bias = bias
        .as_ref()
        .map(|a| a.as_slice())
        .transpose()
        .map_err(value_error)?;
    let input = FinalizeRoutingInput {
        expert_out,
        hidden_size,
        valid_rows: valid_rows.unwrap_or(rows),
        expanded_row_idx,
        k,
        weights,
        expert_idx,
        skip1,
        skip2,
        bias,
    };
    let out = py
        .detach(move || moe_finalize_routing(&input))
        .map_err(moe_error)?;
    Ok(out.into_pyarray(py).into_any())
}

/// `nucleus_moe::moe_finalize_routing` (`moe_token_unpermute` without the extras):
/// `expert_out [R, H]` C-contiguous float32 / float16 / bfloat16, `expanded_row_idx` int32
/// gather `[N*K]` (route `i*K + k`), `weights` float32 `[N*K]` or None, `expert_idx` int32
/// `[N*K]` or None, `skip1` / `skip2` `[N, H]` and `bias` `[E, H]` in the dtype of
/// `expert_out`. Returns `out` flat `[N*H]`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (expert_out, dtype, valid_rows, expanded_row_idx, k, weights, expert_idx,
                    skip1, skip2, bias))]
fn npu_moe_finalize_routing<'py>(
    py: Python<'py>,
    expert_out: &Bound<'py, PyAny>,
    dtype: &str,
    valid_rows: Option<usize>,
    expanded_row_idx: PyReadonlyArray1<'py, i32>,
    k: usize,
    weights: Option<PyReadonlyArray1<'py, f32>>,
    expert_idx: Option<PyReadonlyArray1<'py, i32>>,
    skip1: Option<Bound<'py, PyAny>>,
    skip2: Option<Bound<'py, PyAny>>,
    bias: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let idx = slice_of(&expanded_row_idx)?;
    let weights = match &weights {
        Some(w) => Some(slice_of(w)?),
        None => None,
    };
    let expert_idx = match &expert_idx {
        Some(e) => Some(slice_of(e)?),
        None => None,
    };
    let extras = FinalizeExtras { skip1, skip2, bias };
    match dtype {
        "float32" => finalize_typed::<f32>(
            py, expert_out, valid_rows, idx, k, weights, expert_idx, &extras,
        ),
        "float16" => finalize_typed::<f16>(
            py, expert_out, valid_rows, idx, k, weights, expert_idx, &extras,
        ),
        "bfloat16" => finalize_typed::<bf16>(
            py, expert_out, valid_rows, idx, k, weights, expert_idx, &extras,
        ),
        other => Err(PyTypeError::new_err(format!(
            "expert_out must be float32, float16 or bfloat16, got {other}"
        ))),
    }
}

/// Adds the NPU operators' functions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(npu_top_k_top_p_sample, m)?)?;
    m.add_function(wrap_pyfunction!(npu_moe_init_routing_v2, m)?)?;
    m.add_function(wrap_pyfunction!(npu_moe_gating_top_k_softmax, m)?)?;
    m.add_function(wrap_pyfunction!(npu_moe_gating_top_k, m)?)?;
    m.add_function(wrap_pyfunction!(npu_moe_finalize_routing, m)?)?;
    Ok(())
}
