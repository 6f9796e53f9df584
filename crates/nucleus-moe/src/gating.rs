//! Gating: `moe_gating_top_k_softmax` and `moe_gating_top_k` (DeepSeek-V3 grouped routing),
//! spec/moe_routing.md, "The ops around it".

use std::cmp::Ordering;

use crate::{FloatElement, MoeError};

/// The routing of `N` tokens: `expert_idx [N, k]` i32 and `weights [N, k]` f32, each row in
/// descending order of the score the experts were chosen by (ties: lower expert id first).
#[derive(Clone, Debug, PartialEq)]
pub struct GatingOutput {
    /// `weights [N, k]`, flat.
    pub weights: Vec<f32>,
    /// `expert_idx [N, k]`, flat; the input of [`moe_init_routing`](crate::moe_init_routing).
    pub expert_idx: Vec<i32>,
    /// k, experts per token.
    pub k: usize,
}

/// `[N, E]` checks shared by both gating operators; returns N. A row of only -inf is refused
/// when the scores are a softmax (it has none).
fn check_logits<T: FloatElement>(
    logits: &[T],
    num_experts: usize,
    k: usize,
    k_max: usize,
    k_rule: &'static str,
    softmax: bool,
) -> Result<usize, MoeError> {
    if num_experts == 0 {
        return Err(MoeError::attribute(
            "num_experts",
            0,
            "num_experts (E) must be at least 1",
        ));
    }
    if !logits.len().is_multiple_of(num_experts) {
        return Err(MoeError::shape(
            "logits",
            format!(
                "logits must be [N, E] with E = {num_experts}, got {} elements (not a multiple of E)",
                logits.len()
            ),
        ));
    }
    if k == 0 || k > k_max {
        return Err(MoeError::attribute("k", k, k_rule));
    }
    let n = logits.len() / num_experts;
    for (row, r) in logits.chunks(num_experts).enumerate() {
        if let Some(col) = r.iter().position(|v| {
            let v = v.to_f32();
            v.is_nan() || v == f32::INFINITY
        }) {
            return Err(MoeError::NonFinite {
                tensor: "logits",
                row,
                col,
                value: r[col].to_f32(),
                rule: "gating logits must be numbers below +inf (-inf excludes an expert)",
            });
        }
        if softmax && r.iter().all(|v| v.to_f32() == f32::NEG_INFINITY) {
            return Err(MoeError::NonFinite {
                tensor: "logits",
                row,
                col: 0,
                value: f32::NEG_INFINITY,
                rule: "a row with every logit -inf has no softmax",
            });
        }
    }
    Ok(n)
}

/// Descending by score, ties to the lower id (scores are never NaN here).
#[inline]
fn by_score_desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0)
        .unwrap_or(Ordering::Equal)
        .then(a.1.cmp(&b.1))
}

/// The `k` best `(score, id)` of `cands` in descending score order, ties to the lower id;
/// O(len + k log k).
fn top_k(cands: &mut Vec<(f32, u32)>, k: usize) {
    if k < cands.len() {
        cands.select_nth_unstable_by(k - 1, by_score_desc);
        cands.truncate(k);
    }
    cands.sort_unstable_by(by_score_desc);
}

/// Softmax of one row in f32 (`exp(l - max) / sum`, the sum accumulated in f64).
fn softmax_row<T: FloatElement>(row: &[T], out: &mut Vec<f32>) {
    let max = row
        .iter()
        .map(|v| v.to_f32())
        .fold(f32::NEG_INFINITY, f32::max);
    out.clear();
    out.extend(row.iter().map(|v| (v.to_f32() - max).exp()));
    let z: f64 = out.iter().map(|&e| e as f64).sum();
    for e in out.iter_mut() {
        *e = (*e as f64 / z) as f32;
    }
}

/// Softmax gating then top-k: spec/moe_routing.md, `moe_gating_top_k_softmax` (torch_npu's
/// `npu_moe_gating_top_k_softmax`, vLLM's `topk_softmax`).
///
/// `logits [N, E]` (f32, f16 or bf16), flat. Without `renorm`: `p = softmax(logits)` over the E
/// experts in f32, the k largest `p` (ties to the lower expert id) with weights `p`. With
/// `renorm`: the k largest logits, weights = the softmax over those k. `finished [N]`: a row
/// flagged `true` gets expert id `E` in every slot (an invalid route, which
/// [`moe_init_routing`](crate::moe_init_routing) does not place); its weights are computed as for
/// any row (vLLM's behaviour).
///
/// # Errors
/// [`MoeError`]: `E == 0`; `logits` not a multiple of E; `k` outside `1..=E`; `finished` not
/// `[N]`; a NaN or +inf logit, or a row with every logit -inf.
pub fn moe_gating_top_k_softmax<T: FloatElement>(
    logits: &[T],
    num_experts: usize,
    k: usize,
    renorm: bool,
    finished: Option<&[bool]>,
) -> Result<GatingOutput, MoeError> {
    let n = check_logits(logits, num_experts, k, num_experts, "1 <= k <= E", true)?;
    if let Some(f) = finished {
        if f.len() != n {
            return Err(MoeError::shape(
                "finished",
                format!("finished must be [N] = [{n}], got {} elements", f.len()),
            ));
        }
    }
    let mut weights = Vec::with_capacity(n * k);
    let mut expert_idx = Vec::with_capacity(n * k);
    let mut probs = Vec::with_capacity(num_experts);
    let mut cands = Vec::with_capacity(num_experts);
    for (i, row) in logits.chunks(num_experts).enumerate() {
        cands.clear();
        if renorm {
            cands.extend(row.iter().enumerate().map(|(e, v)| (v.to_f32(), e as u32)));
            top_k(&mut cands, k);
            let max = cands[0].0;
            let exps: Vec<f32> = cands.iter().map(|&(l, _)| (l - max).exp()).collect();
            let z: f64 = exps.iter().map(|&e| e as f64).sum();
            weights.extend(exps.iter().map(|&e| (e as f64 / z) as f32));
        } else {
            softmax_row(row, &mut probs);
            cands.extend(probs.iter().enumerate().map(|(e, &p)| (p, e as u32)));
            top_k(&mut cands, k);
            weights.extend(cands.iter().map(|&(p, _)| p));
        }
        let done = finished.is_some_and(|f| f[i]);
        expert_idx.extend(cands.iter().map(
            |&(_, e)| {
                if done {
                    num_experts as i32
                } else {
                    e as i32
                }
            },
        ));
    }
    Ok(GatingOutput {
        weights,
        expert_idx,
        k,
    })
}

/// How a group of experts is scored in [`moe_gating_top_k`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GroupSelectMode {
    /// 0: the group's largest biased score.
    Max,
    /// 1: the sum of the group's two largest biased scores (DeepSeek-V3).
    #[default]
    Top2Sum,
}

/// The score function of [`moe_gating_top_k`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NormType {
    /// 0: softmax over the E experts.
    Softmax,
    /// 1: sigmoid of each logit (DeepSeek-V3).
    #[default]
    Sigmoid,
}

/// The attributes of [`moe_gating_top_k`] (torch_npu's `npu_moe_gating_top_k`; DeepSeek-V3's
/// `MoEGate`). `Default` is DeepSeek-V3's configuration without the sizes: set `k`, `k_group`,
/// `group_count`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupedTopKParams {
    /// k: experts per token, `1..=k_group * E / group_count`.
    pub k: usize,
    /// Groups kept per token, `1..=group_count`.
    pub k_group: usize,
    /// Groups the E experts are split into (contiguous, E / group_count each; E must be a
    /// multiple); 1 means no group masking.
    pub group_count: usize,
    /// Group score: max or sum of the top 2.
    pub group_select_mode: GroupSelectMode,
    /// Renormalise the k weights: `w / (sum(w) + eps)`.
    pub renorm: bool,
    /// Softmax or sigmoid scores.
    pub norm_type: NormType,
    /// Multiplies the final weights (DeepSeek-V3: 2.5).
    pub routed_scaling_factor: f32,
    /// The renormalisation's eps (spec: 1e-20).
    pub eps: f32,
}

impl Default for GroupedTopKParams {
    fn default() -> Self {
        Self {
            k: 0,
            k_group: 0,
            group_count: 0,
            group_select_mode: GroupSelectMode::Top2Sum,
            renorm: true,
            norm_type: NormType::Sigmoid,
            routed_scaling_factor: 1.0,
            eps: 1e-20,
        }
    }
}

/// DeepSeek-V3 grouped routing: spec/moe_routing.md, `moe_gating_top_k`.
///
/// Per token (row of `logits [N, E]`, f32, f16 or bf16): scores `s` = softmax or sigmoid of the
/// logits (f32); biased scores `b = s + bias` (`bias [E]` f32, the correction bias, optional);
/// each of `group_count` contiguous groups is scored by its max or top-2 sum of `b`; the best
/// `k_group` groups are kept (ties to the lower group id), the other groups' experts excluded;
/// the top k of `b` among the kept experts (ties to the lower id) are the experts, in
/// descending `b`; their weights are the unbiased `s`, renormalised `w / (sum(w) + eps)` when
/// `renorm`, times `routed_scaling_factor`.
///
/// # Errors
/// [`MoeError`]: `E == 0`; `logits` not a multiple of E; `group_count` 0 or not dividing E;
/// `k_group` outside `1..=group_count`; top-2 sum with groups of one expert; `k` outside
/// `1..=k_group * E / group_count`; `bias` not `[E]` or not finite; a non-finite
/// `routed_scaling_factor` or a negative / non-finite `eps`; a NaN or +inf logit, or (softmax
/// only) a row with every logit -inf.
pub fn moe_gating_top_k<T: FloatElement>(
    logits: &[T],
    num_experts: usize,
    bias: Option<&[f32]>,
    params: &GroupedTopKParams,
) -> Result<GatingOutput, MoeError> {
    let e = num_experts;
    let gc = params.group_count;
    if gc == 0 || (e > 0 && !e.is_multiple_of(gc)) {
        return Err(MoeError::attribute(
            "group_count",
            gc,
            "group_count must be at least 1 and divide E",
        ));
    }
    if params.k_group == 0 || params.k_group > gc {
        return Err(MoeError::attribute(
            "k_group",
            params.k_group,
            "1 <= k_group <= group_count",
        ));
    }
    let g = e / gc;
    if params.group_select_mode == GroupSelectMode::Top2Sum && e > 0 && g < 2 {
        return Err(MoeError::combination(
            "group_select_mode 1 (top-2 sum) needs at least 2 experts per group",
            format!("E {e}, group_count {gc}"),
        ));
    }
    if let Some(b) = bias {
        if b.len() != e {
            return Err(MoeError::shape(
                "bias",
                format!("bias must be [E] = [{e}], got {} elements", b.len()),
            ));
        }
        if let Some(col) = b.iter().position(|v| !v.is_finite()) {
            return Err(MoeError::NonFinite {
                tensor: "bias",
                row: 0,
                col,
                value: b[col],
                rule: "the correction bias must be finite",
            });
        }
    }
    if !params.routed_scaling_factor.is_finite() {
        return Err(MoeError::attribute(
            "routed_scaling_factor",
            params.routed_scaling_factor,
            "routed_scaling_factor must be finite",
        ));
    }
    if !(params.eps >= 0.0 && params.eps.is_finite()) {
        return Err(MoeError::attribute(
            "eps",
            params.eps,
            "eps must be finite and >= 0",
        ));
    }
    let k = params.k;
    let n = check_logits(
        logits,
        e,
        k,
        params.k_group * g,
        "1 <= k <= k_group * E / group_count",
        params.norm_type == NormType::Softmax,
    )?;
    let mut weights = Vec::with_capacity(n * k);
    let mut expert_idx = Vec::with_capacity(n * k);
    let mut scores = Vec::with_capacity(e);
    let mut cands = Vec::with_capacity(e);
    let mut groups = Vec::with_capacity(gc);
    for row in logits.chunks(e) {
        match params.norm_type {
            NormType::Softmax => softmax_row(row, &mut scores),
            NormType::Sigmoid => {
                scores.clear();
                scores.extend(row.iter().map(|v| 1.0 / (1.0 + (-v.to_f32()).exp())));
            }
        }
        let biased = |i: usize| scores[i] + bias.map_or(0.0, |b| b[i]);
        cands.clear();
        if gc > 1 {
            groups.clear();
            for grp in 0..gc {
                let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for i in grp * g..(grp + 1) * g {
                    let v = biased(i);
                    if v > first {
                        second = first;
                        first = v;
                    } else if v > second {
                        second = v;
                    }
                }
                let score = match params.group_select_mode {
                    GroupSelectMode::Max => first,
                    GroupSelectMode::Top2Sum => first + second,
                };
                groups.push((score, grp as u32));
            }
            top_k(&mut groups, params.k_group);
            for &(_, grp) in groups.iter() {
                let grp = grp as usize;
                cands.extend((grp * g..(grp + 1) * g).map(|i| (biased(i), i as u32)));
            }
        } else {
            cands.extend((0..e).map(|i| (biased(i), i as u32)));
        }
        top_k(&mut cands, k);
        let sum: f32 = cands.iter().map(|&(_, i)| scores[i as usize]).sum();
        for &(_, i) in cands.iter() {
            let mut w = scores[i as usize];
            if params.renorm {
                w /= sum + params.eps;
            }
            weights.push(w * params.routed_scaling_factor);
            expert_idx.push(i as i32);
        }
    }
    Ok(GatingOutput {
        weights,
        expert_idx,
        k,
    })
}
