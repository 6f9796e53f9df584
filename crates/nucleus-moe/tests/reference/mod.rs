//! A slow, literal reference of spec/moe_routing.md, written from the spec text only (not from the
//! operator's source), used as the oracle of `random_vs_reference.rs` and proven on the spec's
//! worked cases by `worked_cases_reference.rs`.
//!
//! Plain types only: `x` is given widened to f32 (exact for f16, bf16 and i8), attributes are the
//! NPU's integer encodings, errors are strings (tests only compare "both refuse"). Every output is
//! computed by an explicit loop over its definition; the route order is a stable argsort by the
//! "Order" section's key. Gating and unpermute / finalize are computed in f64.

#![allow(dead_code)]
// Explicit index loops on purpose: each output is written as its definition reads.
#![allow(clippy::needless_range_loop)]

/// The attributes of `moe_init_routing`, in the NPU's integer encodings.
#[derive(Clone, Debug)]
pub struct RefAttrs {
    pub active_num: i64,
    pub expert_capacity: i64,
    pub expert_num: i64,
    /// 0 dropless, 1 drop/pad.
    pub drop_pad_mode: i64,
    /// 0 cumsum, 1 count, 2 key-value.
    pub expert_tokens_num_type: i64,
    pub expert_tokens_num_flag: bool,
    /// -1 none, 0 static, 1 dynamic.
    pub quant_mode: i64,
    pub active_expert_range: Option<[i64; 2]>,
    /// 0 gather, 1 scatter.
    pub row_idx_type: i64,
}

impl RefAttrs {
    /// The NPU's defaults with `expert_num = e`.
    pub fn new(e: i64) -> Self {
        RefAttrs {
            active_num: -1,
            expert_capacity: -1,
            expert_num: e,
            drop_pad_mode: 0,
            expert_tokens_num_type: 0,
            expert_tokens_num_flag: false,
            quant_mode: -1,
            active_expert_range: None,
            row_idx_type: 0,
        }
    }
}

/// The inputs of `moe_init_routing`; `x` widened to f32.
#[derive(Clone, Debug)]
pub struct RefInput {
    pub x: Vec<f32>,
    /// `x` was i8 (only quant none is allowed then).
    pub x_is_i8: bool,
    pub n: usize,
    pub h: usize,
    pub expert_idx: Vec<i32>,
    pub k: usize,
    pub scale: Option<Vec<f32>>,
    pub offset: Option<Vec<f32>>,
}

/// `expanded_x`: the copied rows (as f32 values of x's type) or int8.
#[derive(Clone, Debug, PartialEq)]
pub enum RefX {
    Float(Vec<f32>),
    Int8(Vec<i8>),
}

#[derive(Clone, Debug)]
pub struct RefOutput {
    pub expanded_x: RefX,
    pub expanded_x_shape: Vec<usize>,
    pub expanded_row_idx: Vec<i32>,
    pub expert_tokens: Option<Vec<i64>>,
    pub expanded_scale: Option<Vec<f32>>,
    pub valid_rows: usize,
}

fn refuse<T>(why: &str) -> Result<T, String> {
    Err(why.to_string())
}

/// Spec "`moe_init_routing` inputs and attributes": every listed rule. Returns `(start, end)`.
fn validate(input: &RefInput, a: &RefAttrs) -> Result<(i64, i64), String> {
    let (n, h, k) = (input.n, input.h, input.k);
    if input.x.len() != n * h {
        return refuse("x is not [N, H]");
    }
    if input.expert_idx.len() != n * k {
        return refuse("expert_idx is not [N, K]");
    }
    if !(0..=1).contains(&a.drop_pad_mode) {
        return refuse("drop_pad_mode must be 0 or 1");
    }
    if !(0..=2).contains(&a.expert_tokens_num_type) {
        return refuse("expert_tokens_num_type must be 0, 1 or 2");
    }
    if !(-1..=1).contains(&a.quant_mode) {
        return refuse("quant_mode must be -1, 0 or 1");
    }
    if !(0..=1).contains(&a.row_idx_type) {
        return refuse("row_idx_type must be 0 or 1");
    }
    // expert_num E (1..=10240; 5120 in key-value mode)
    if a.expert_num < 1 || a.expert_num > 10240 {
        return refuse("expert_num must be in 1..=10240");
    }
    if a.expert_tokens_num_type == 2 && a.expert_num > 5120 {
        return refuse("expert_num must be <= 5120 in key-value mode");
    }
    // active_num (-1 or 0 = all routes; > 0 = at most this many)
    if a.active_num < -1 {
        return refuse("active_num must be >= -1");
    }
    // active_expert_range ([] or [start, end], 0 <= start < end <= E)
    let e = a.expert_num;
    let (start, end) = match a.active_expert_range {
        None => (0, e),
        Some([s, t]) => {
            if !(0 <= s && s < t && t <= e) {
                return refuse("active_expert_range must satisfy 0 <= start < end <= E");
            }
            (s, t)
        }
    };
    // Drop/pad requires range = [0, E), row_idx_type 0, and count type; 1 <= C <= N.
    if a.drop_pad_mode == 1 {
        if (start, end) != (0, e) {
            return refuse("drop/pad requires the range [0, E)");
        }
        if a.row_idx_type != 0 {
            return refuse("drop/pad requires row_idx_type 0");
        }
        if a.expert_tokens_num_type != 1 {
            return refuse("drop/pad requires the count type");
        }
        if a.expert_capacity < 1 || a.expert_capacity > n as i64 {
            return refuse("drop/pad requires 1 <= expert_capacity <= N");
        }
    }
    // i8 x with quant 0 or 1 is an error.
    if input.x_is_i8 && a.quant_mode != -1 {
        return refuse("i8 x cannot be quantised");
    }
    // scale / offset shapes.
    let scale_len = input.scale.as_ref().map(|s| s.len());
    let offset_len = input.offset.as_ref().map(|s| s.len());
    match a.quant_mode {
        -1 => {
            if scale_len.is_some_and(|l| l != n) {
                return refuse("quant none: scale must be [N]");
            }
            if offset_len.is_some() {
                return refuse("offset is quant 0 only");
            }
        }
        0 => {
            if scale_len != Some(1) {
                return refuse("static quant: scale [1] required");
            }
            if offset_len != Some(1) {
                return refuse("static quant: offset [1] required");
            }
        }
        _ => {
            let range_len = (end - start) as usize;
            if let Some(l) = scale_len {
                if l != h && l != range_len * h {
                    return refuse("dynamic quant: smooth scale must be [1, H] or [end-start, H]");
                }
            }
            if offset_len.is_some() {
                return refuse("offset is quant 0 only");
            }
        }
    }
    Ok((start, end))
}

/// Static int8: `q = clamp(round_half_even(x * scale + offset), -128, 127)` in f32.
pub fn quant_static(x: f32, scale: f32, offset: f32) -> i8 {
    let v: f32 = x * scale + offset;
    let q = v.round_ties_even().clamp(-128.0, 127.0);
    q as i8
}

/// Dynamic int8 of one row: `v = x * smooth`, `s = max|v| / 127`, `q = round_half_even(v / s)`;
/// an all-zero row gives q = 0, s = 0. Returns (q, s).
pub fn quant_dynamic(row: &[f32], smooth: Option<&[f32]>) -> (Vec<i8>, f32) {
    let mut v = vec![0f32; row.len()];
    for c in 0..row.len() {
        v[c] = match smooth {
            Some(sm) => row[c] * sm[c],
            None => row[c],
        };
    }
    let mut maxabs = 0f32;
    for &vc in &v {
        if vc.abs() > maxabs {
            maxabs = vc.abs();
        }
    }
    if maxabs == 0.0 {
        return (vec![0; row.len()], 0.0);
    }
    let s: f32 = maxabs / 127.0;
    let mut q = vec![0i8; row.len()];
    for c in 0..row.len() {
        let r = (v[c] / s).round_ties_even();
        assert!(
            (-128.0..=127.0).contains(&r),
            "dynamic quant out of range: {r}"
        );
        q[c] = r as i8;
    }
    (q, s)
}

/// The sort class of an expert id (spec "Order"): in-range first ascending, then ids >= end
/// ascending, then ids < start in route order.
fn sort_key(e: i32, start: i64, end: i64) -> (u8, i64) {
    let e = e as i64;
    if e >= start && e < end {
        (0, e)
    } else if e >= end {
        (1, e)
    } else {
        (2, 0)
    }
}

/// The route order of spec "Order": a stable argsort of j = i*K + k by [`sort_key`].
pub fn route_order(expert_idx: &[i32], start: i64, end: i64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..expert_idx.len()).collect();
    // `sort_by_key` is stable: equal keys keep ascending j (row i, then slot k).
    order.sort_by_key(|&j| sort_key(expert_idx[j], start, end));
    order
}

/// `moe_init_routing`, literally.
pub fn init_routing(input: &RefInput, a: &RefAttrs) -> Result<RefOutput, String> {
    let (start, end) = validate(input, a)?;
    let (n, h, k) = (input.n, input.h, input.k);
    let nk = n * k;
    let ids = &input.expert_idx;
    let e_num = a.expert_num as usize;
    let in_range = |e: i32| (e as i64) >= start && (e as i64) < end;

    let order = route_order(ids, start, end);
    let mut pos = vec![usize::MAX; nk];
    for r in 0..nk {
        pos[order[r]] = r;
    }
    // A = number of in-range routes.
    let mut a_cnt = 0usize;
    for j in 0..nk {
        if in_range(ids[j]) {
            a_cnt += 1;
        }
    }
    // Counts per in-range expert, before any drop.
    let range_len = (end - start) as usize;
    let mut counts = vec![0i64; range_len];
    for j in 0..nk {
        if in_range(ids[j]) {
            counts[(ids[j] as i64 - start) as usize] += 1;
        }
    }

    // For every output row (or drop/pad slot): the route placed there, if any.
    let drop_pad = a.drop_pad_mode == 1;
    let rows: usize;
    let shape: Vec<usize>;
    let valid_rows: usize;
    let mut src: Vec<Option<usize>>;
    let mut expanded_row_idx = vec![-1i32; nk];
    if drop_pad {
        let c = a.expert_capacity as usize;
        rows = e_num * c;
        shape = vec![e_num, c, h];
        valid_rows = rows;
        src = vec![None; rows];
        for e in 0..e_num {
            // The s-th route of expert e, in sorted (= route) order.
            let mut s = 0usize;
            for r in 0..nk {
                let j = order[r];
                if ids[j] as i64 == e as i64 {
                    if s < c {
                        src[e * c + s] = Some(j);
                        expanded_row_idx[j] = (e * c + s) as i32;
                    }
                    s += 1;
                }
            }
        }
    } else {
        rows = if a.active_num > 0 {
            (a.active_num as usize).min(nk)
        } else {
            nk
        };
        shape = vec![rows, h];
        valid_rows = rows.min(a_cnt);
        src = vec![None; rows];
        for r in 0..valid_rows {
            src[r] = Some(order[r]);
        }
        if a.row_idx_type == 0 {
            for j in 0..nk {
                if in_range(ids[j]) {
                    expanded_row_idx[j] = pos[j] as i32;
                }
            }
        } else {
            // Scatter: out[r] = order[r] (the operator writes the whole sorted order).
            for r in 0..nk {
                expanded_row_idx[r] = order[r] as i32;
            }
        }
    }

    // expanded_x and expanded_scale, row by row.
    let mut xf = vec![0f32; rows * h];
    let mut xq = vec![0i8; rows * h];
    let mut scale_out = vec![0f32; rows];
    for r in 0..rows {
        let Some(j) = src[r] else { continue };
        let i = j / k;
        let row = &input.x[i * h..(i + 1) * h];
        match a.quant_mode {
            -1 => {
                xf[r * h..(r + 1) * h].copy_from_slice(row);
                if let Some(sc) = &input.scale {
                    scale_out[r] = sc[i];
                }
            }
            0 => {
                let sc = input.scale.as_ref().unwrap()[0];
                let of = input.offset.as_ref().unwrap()[0];
                for c in 0..h {
                    xq[r * h + c] = quant_static(row[c], sc, of);
                }
            }
            _ => {
                let smooth: Option<&[f32]> = input.scale.as_ref().map(|sm| {
                    let srow = if sm.len() == h {
                        0
                    } else {
                        (ids[j] as i64 - start) as usize
                    };
                    &sm[srow * h..(srow + 1) * h]
                });
                let (q, s) = quant_dynamic(row, smooth);
                xq[r * h..(r + 1) * h].copy_from_slice(&q);
                scale_out[r] = s;
            }
        }
    }
    let expanded_x = if a.quant_mode == -1 {
        RefX::Float(xf)
    } else {
        RefX::Int8(xq)
    };
    let expanded_scale = match a.quant_mode {
        -1 if input.scale.is_some() => Some(scale_out),
        1 => Some(scale_out),
        _ => None,
    };

    let expert_tokens = if !a.expert_tokens_num_flag {
        None
    } else {
        Some(match a.expert_tokens_num_type {
            1 => counts.clone(),
            0 => {
                let mut acc = 0i64;
                let mut cs = vec![0i64; range_len];
                for t in 0..range_len {
                    acc += counts[t];
                    cs[t] = acc;
                }
                cs
            }
            _ => {
                let mut kv = vec![0i64; 2 * e_num];
                let mut row = 0usize;
                for t in 0..range_len {
                    if counts[t] > 0 {
                        kv[2 * row] = start + t as i64;
                        kv[2 * row + 1] = counts[t];
                        row += 1;
                    }
                }
                kv
            }
        })
    };

    Ok(RefOutput {
        expanded_x,
        expanded_x_shape: shape,
        expanded_row_idx,
        expert_tokens,
        expanded_scale,
        valid_rows,
    })
}

/// A gating result in f64. `near_tie`: a decision (a rank the output depends on) was between two
/// scores that differ, but by so little (relative 2e-6, ~30 f32 ulps) that the operator's f32 arithmetic may
/// order them either way; the expert ids are then not comparable.
#[derive(Clone, Debug)]
pub struct RefGating {
    pub weights: Vec<f64>,
    pub expert_idx: Vec<i32>,
    pub near_tie: bool,
}

/// Two different scores closer than f32 arithmetic can tell apart reliably.
pub fn near(a: f64, b: f64) -> bool {
    a != b && (a - b).abs() <= 2e-6 * a.abs().max(b.abs())
}

/// Indices of `v` by descending value, ties to the lower index (a stable sort).
fn rank_desc(v: &[f64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap());
    idx
}

fn softmax(l: &[f64]) -> Vec<f64> {
    let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let ex: Vec<f64> = l.iter().map(|&x| (x - m).exp()).collect();
    let s: f64 = ex.iter().sum();
    ex.iter().map(|&x| x / s).collect()
}

fn check_logits(logits: &[f32], e: usize, need_finite_row: bool) -> Result<usize, String> {
    if e == 0 {
        return refuse("E must be >= 1");
    }
    if !logits.len().is_multiple_of(e) {
        return refuse("logits is not [N, E]");
    }
    for &l in logits {
        if l.is_nan() || l == f32::INFINITY {
            return refuse("NaN or +inf logit");
        }
    }
    let n = logits.len() / e;
    if need_finite_row {
        for i in 0..n {
            if logits[i * e..(i + 1) * e]
                .iter()
                .all(|&l| l == f32::NEG_INFINITY)
            {
                return refuse("a row of only -inf has no softmax");
            }
        }
    }
    Ok(n)
}

/// `moe_gating_top_k_softmax(logits [N, E], k, renorm)`: softmax then top-k, ties to the lower
/// id; renorm = top-k then softmax over the k; finished rows get id E.
pub fn gating_top_k_softmax(
    logits: &[f32],
    e: usize,
    k: usize,
    renorm: bool,
    finished: Option<&[bool]>,
) -> Result<RefGating, String> {
    let n = check_logits(logits, e, true)?;
    if k < 1 || k > e {
        return refuse("k must be in 1..=E");
    }
    if finished.is_some_and(|f| f.len() != n) {
        return refuse("finished is not [N]");
    }
    let mut out = RefGating {
        weights: vec![0.0; n * k],
        expert_idx: vec![0; n * k],
        near_tie: false,
    };
    for i in 0..n {
        let l: Vec<f64> = logits[i * e..(i + 1) * e]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let p = softmax(&l);
        let rank = rank_desc(&p);
        for t in 0..k.min(e - 1) {
            if near(p[rank[t]], p[rank[t + 1]]) {
                out.near_tie = true;
            }
        }
        let chosen: Vec<usize> = rank[..k].to_vec();
        let w: Vec<f64> = if renorm {
            let lk: Vec<f64> = chosen.iter().map(|&c| l[c]).collect();
            softmax(&lk)
        } else {
            chosen.iter().map(|&c| p[c]).collect()
        };
        let fin = finished.is_some_and(|f| f[i]);
        for t in 0..k {
            out.weights[i * k + t] = w[t];
            out.expert_idx[i * k + t] = if fin { e as i32 } else { chosen[t] as i32 };
        }
    }
    Ok(out)
}

/// The parameters of `moe_gating_top_k`.
#[derive(Clone, Debug)]
pub struct RefGroupedParams {
    pub k: usize,
    pub k_group: usize,
    pub group_count: usize,
    /// false: group score = max; true: sum of the top 2.
    pub top2_sum: bool,
    pub renorm: bool,
    /// false: softmax; true: sigmoid.
    pub sigmoid: bool,
    pub routed_scaling_factor: f64,
    pub eps: f64,
}

/// `moe_gating_top_k` (DeepSeek-V3 grouped routing), literally, in f64.
pub fn gating_top_k_grouped(
    logits: &[f32],
    e: usize,
    bias: Option<&[f32]>,
    p: &RefGroupedParams,
) -> Result<RefGating, String> {
    let n = check_logits(logits, e, !p.sigmoid)?;
    let g = p.group_count;
    if g == 0 || !e.is_multiple_of(g) {
        return refuse("group_count must divide E");
    }
    let gsize = e / g;
    if p.k_group < 1 || p.k_group > g {
        return refuse("k_group must be in 1..=group_count");
    }
    if p.top2_sum && gsize < 2 {
        return refuse("a top-2 sum needs groups of at least 2 experts");
    }
    if p.k < 1 || p.k > p.k_group * gsize {
        return refuse("k must be in 1..=k_group * E / group_count");
    }
    if let Some(b) = bias {
        if b.len() != e || b.iter().any(|v| !v.is_finite()) {
            return refuse("bias must be [E], finite");
        }
    }
    let k = p.k;
    let mut out = RefGating {
        weights: vec![0.0; n * k],
        expert_idx: vec![0; n * k],
        near_tie: false,
    };
    for i in 0..n {
        let l: Vec<f64> = logits[i * e..(i + 1) * e]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let s: Vec<f64> = if p.sigmoid {
            l.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect()
        } else {
            softmax(&l)
        };
        let b: Vec<f64> = (0..e)
            .map(|c| s[c] + bias.map_or(0.0, |bb| bb[c] as f64))
            .collect();
        let mut masked = b.clone();
        if g > 1 {
            let mut gscore = vec![0f64; g];
            for (gi, gs) in gscore.iter_mut().enumerate() {
                let mut vals: Vec<f64> = b[gi * gsize..(gi + 1) * gsize].to_vec();
                vals.sort_by(|x, y| y.partial_cmp(x).unwrap());
                *gs = if p.top2_sum {
                    vals[0] + vals[1]
                } else {
                    vals[0]
                };
            }
            let grank = rank_desc(&gscore);
            if p.k_group < g && near(gscore[grank[p.k_group - 1]], gscore[grank[p.k_group]]) {
                out.near_tie = true;
            }
            for &gi in &grank[p.k_group..] {
                for v in masked.iter_mut().skip(gi * gsize).take(gsize) {
                    *v = f64::NEG_INFINITY;
                }
            }
        }
        let rank = rank_desc(&masked);
        for t in 0..k.min(e - 1) {
            let (a, b) = (masked[rank[t]], masked[rank[t + 1]]);
            if b != f64::NEG_INFINITY && near(a, b) {
                out.near_tie = true;
            }
        }
        let chosen = &rank[..k];
        let mut w: Vec<f64> = chosen.iter().map(|&c| s[c]).collect();
        if p.renorm {
            let sum: f64 = w.iter().sum();
            for v in w.iter_mut() {
                *v /= sum + p.eps;
            }
        }
        for t in 0..k {
            out.weights[i * k + t] = w[t] * p.routed_scaling_factor;
            out.expert_idx[i * k + t] = chosen[t] as i32;
        }
    }
    Ok(out)
}

/// The inputs of `moe_finalize_routing` (and of `moe_token_unpermute`: no skips, bias or ids),
/// widened to f32.
#[derive(Clone, Debug, Default)]
pub struct RefFinalize<'a> {
    pub expert_out: &'a [f32],
    pub h: usize,
    pub valid_rows: usize,
    pub expanded_row_idx: &'a [i32],
    pub k: usize,
    pub weights: Option<&'a [f32]>,
    pub expert_idx: Option<&'a [i32]>,
    pub skip1: Option<&'a [f32]>,
    pub skip2: Option<&'a [f32]>,
    pub bias: Option<&'a [f32]>,
}

/// `out[i] = skip1[i] + skip2[i] + sum_k w[i,k] * (expert_out[idx] + bias[expert_idx[i,k]])`,
/// routes with index -1 or at / past the valid row count contributing nothing, in f64.
/// Returns `(out [N, H], magnitude [N, H])`, the magnitude being the sum of the absolute values
/// of every term (for a tolerance).
pub fn finalize(f: &RefFinalize<'_>) -> Result<(Vec<f64>, Vec<f64>), String> {
    let (h, k) = (f.h, f.k);
    if h == 0 || k == 0 {
        return refuse("H and K must be >= 1");
    }
    if !f.expert_out.len().is_multiple_of(h) {
        return refuse("expert_out is not [R, H]");
    }
    let r_rows = f.expert_out.len() / h;
    if f.valid_rows > r_rows {
        return refuse("valid_rows > R");
    }
    if !f.expanded_row_idx.len().is_multiple_of(k) {
        return refuse("expanded_row_idx is not [N * K]");
    }
    let n = f.expanded_row_idx.len() / k;
    if f.weights.is_some_and(|w| w.len() != n * k) {
        return refuse("weights is not [N, K]");
    }
    if f.expanded_row_idx.iter().any(|&v| v < -1) {
        return refuse("an index below -1");
    }
    for s in [f.skip1, f.skip2].into_iter().flatten() {
        if s.len() != n * h {
            return refuse("skip is not [N, H]");
        }
    }
    if f.expert_idx.is_some_and(|e| e.len() != n * k) {
        return refuse("expert_idx is not [N, K]");
    }
    let mut e_num = 0;
    if let Some(b) = f.bias {
        if b.is_empty() || !b.len().is_multiple_of(h) {
            return refuse("bias is not [E, H]");
        }
        e_num = b.len() / h;
        if f.expert_idx.is_none() {
            return refuse("bias needs expert_idx");
        }
    }
    let placed = |j: usize| {
        let idx = f.expanded_row_idx[j];
        idx >= 0 && (idx as usize) < f.valid_rows
    };
    if f.bias.is_some() {
        let ids = f.expert_idx.unwrap();
        for j in 0..n * k {
            if placed(j) && (ids[j] < 0 || ids[j] as usize >= e_num) {
                return refuse("a placed route's expert id is outside [0, E)");
            }
        }
    }
    let mut out = vec![0f64; n * h];
    let mut mag = vec![0f64; n * h];
    for i in 0..n {
        for c in 0..h {
            let mut acc = 0f64;
            let mut m = 0f64;
            for s in [f.skip1, f.skip2].into_iter().flatten() {
                acc += s[i * h + c] as f64;
                m += (s[i * h + c] as f64).abs();
            }
            for kk in 0..k {
                let j = i * k + kk;
                if !placed(j) {
                    continue;
                }
                let row = f.expanded_row_idx[j] as usize;
                let w = f.weights.map_or(1.0, |w| w[j] as f64);
                let mut v = f.expert_out[row * h + c] as f64;
                let mut vm = v.abs();
                if let Some(b) = f.bias {
                    let e = f.expert_idx.unwrap()[j] as usize;
                    v += b[e * h + c] as f64;
                    vm += (b[e * h + c] as f64).abs();
                }
                acc += w * v;
                m += w.abs() * vm;
            }
            out[i * h + c] = acc;
            mag[i * h + c] = m;
        }
    }
    Ok((out, mag))
}
