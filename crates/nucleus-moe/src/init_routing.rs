//! `moe_init_routing`: spec/moe_routing.md, "`moe_init_routing` inputs and attributes", "Order",
//! "Outputs", "Quantisation" (torch_npu's `npu_moe_init_routing_v2`).

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::{DType, Element, MoeError, PARALLEL_MIN_BYTES};

/// The largest `expert_num` (spec: `1..=10240`).
pub const MAX_EXPERT_NUM: i64 = 10240;
/// The largest `expert_num` when `expert_tokens_num_type` is key-value (spec: 5120).
pub const MAX_EXPERT_NUM_KEY_VALUE: i64 = 5120;

/// `drop_pad_mode`: 0 dropless (every in-range route gets a row, optionally capped by
/// `active_num`), 1 drop/pad (each expert gets exactly `expert_capacity` slots).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DropPadMode {
    /// 0: dropless (or active, with `active_num > 0`).
    #[default]
    Dropless,
    /// 1: drop/pad: `expanded_x [E, C, H]`.
    DropPad,
}

/// `expert_tokens_num_type`: the form of `expert_tokens`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertTokensNumType {
    /// 0: inclusive prefix sum of the counts, `[end - start]`.
    #[default]
    Cumsum,
    /// 1: routes per in-range expert, `[end - start]`.
    Count,
    /// 2: `[E, 2]` rows `[expert id, count]` for experts with count > 0 (ascending id), then
    /// zero rows.
    KeyValue,
}

/// `quant_mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuantMode {
    /// -1: rows copied as they are.
    #[default]
    None,
    /// 0: static int8, `q = clamp(round_half_even(x * scale + offset), -128, 127)`.
    Static,
    /// 1: dynamic int8 per row, `v = x * smooth`, `s = max|v| / 127`, `q = round_half_even(v / s)`.
    Dynamic,
}

/// `row_idx_type`: the form of `expanded_row_idx`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowIdxType {
    /// 0: gather, `out[j]` = the row route `j` went to, -1 if none.
    #[default]
    Gather,
    /// 1: scatter, `out[r]` = the route placed at row `r`.
    Scatter,
}

macro_rules! attr_enum_from_i64 {
    ($ty:ident, $name:literal, $rule:literal, $($v:literal => $var:ident),+) => {
        impl TryFrom<i64> for $ty {
            type Error = MoeError;
            /// The NPU's integer encoding; any other value is [`MoeError::Attribute`].
            fn try_from(v: i64) -> Result<Self, MoeError> {
                match v {
                    $($v => Ok($ty::$var),)+
                    _ => Err(MoeError::attribute($name, v, $rule)),
                }
            }
        }
        impl From<$ty> for i64 {
            fn from(v: $ty) -> i64 {
                match v {
                    $($ty::$var => $v,)+
                }
            }
        }
    };
}
attr_enum_from_i64!(DropPadMode, "drop_pad_mode", "drop_pad_mode must be 0 (dropless) or 1 (drop/pad)", 0 => Dropless, 1 => DropPad);
attr_enum_from_i64!(ExpertTokensNumType, "expert_tokens_num_type", "expert_tokens_num_type must be 0 (cumsum), 1 (count) or 2 (key-value)", 0 => Cumsum, 1 => Count, 2 => KeyValue);
attr_enum_from_i64!(QuantMode, "quant_mode", "quant_mode must be -1 (none), 0 (static int8) or 1 (dynamic int8)", -1 => None, 0 => Static, 1 => Dynamic);
attr_enum_from_i64!(RowIdxType, "row_idx_type", "row_idx_type must be 0 (gather) or 1 (scatter)", 0 => Gather, 1 => Scatter);

/// The attributes of [`moe_init_routing`], by their spec names. `Default` gives the NPU's
/// defaults except `expert_num`, which has none (set it; 0 is refused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeInitRoutingAttrs {
    /// -1 or 0: every in-range route gets a row (dropless); > 0: at most this many rows
    /// (active). Less than -1 is refused. Ignored in drop/pad mode (the capacity caps rows).
    pub active_num: i64,
    /// C, drop/pad only (`1 <= C <= N`); ignored in dropless mode.
    pub expert_capacity: i64,
    /// E, `1..=10240` (`1..=5120` with key-value `expert_tokens`).
    pub expert_num: i64,
    /// Dropless or drop/pad.
    pub drop_pad_mode: DropPadMode,
    /// The form of `expert_tokens`.
    pub expert_tokens_num_type: ExpertTokensNumType,
    /// Whether `expert_tokens` is computed.
    pub expert_tokens_num_flag: bool,
    /// No quantisation, static or dynamic int8.
    pub quant_mode: QuantMode,
    /// `[start, end)` of the experts this call places (`0 <= start < end <= E`); `None` is
    /// `[0, E)`.
    pub active_expert_range: Option<[i64; 2]>,
    /// Gather or scatter `expanded_row_idx`.
    pub row_idx_type: RowIdxType,
}

impl Default for MoeInitRoutingAttrs {
    fn default() -> Self {
        Self {
            active_num: -1,
            expert_capacity: -1,
            expert_num: 0,
            drop_pad_mode: DropPadMode::Dropless,
            expert_tokens_num_type: ExpertTokensNumType::Cumsum,
            expert_tokens_num_flag: false,
            quant_mode: QuantMode::None,
            active_expert_range: None,
            row_idx_type: RowIdxType::Gather,
        }
    }
}

impl MoeInitRoutingAttrs {
    /// The defaults with `expert_num = E`.
    pub fn new(expert_num: i64) -> Self {
        Self {
            expert_num,
            ..Self::default()
        }
    }
}

/// The tensors of one [`moe_init_routing`] call, flat and row-major.
#[derive(Clone, Copy, Debug)]
pub struct MoeInitRoutingInput<'a, T> {
    /// `x [N, H]`, `N * H` elements.
    pub x: &'a [T],
    /// N, the number of rows (tokens).
    pub num_rows: usize,
    /// H, the hidden size (>= 1).
    pub hidden_size: usize,
    /// `expert_idx [N, K]`, `N * K` expert ids; ids outside the active range (negative ones
    /// included) are invalid routes, legal and not placed.
    pub expert_idx: &'a [i32],
    /// K, experts per row (>= 1).
    pub k: usize,
    /// `scale`: quant none: `None` or `[N]` per-row values carried into `expanded_scale`;
    /// static: `[1]`, required; dynamic: `None`, `[1, H]` or `[end - start, H]` smooth scales.
    pub scale: Option<&'a [f32]>,
    /// `offset`: static only, `[1]`, required; otherwise `None`.
    pub offset: Option<&'a [f32]>,
}

/// `expanded_x`: rows of `x`'s type, or int8 when quantised.
#[derive(Clone, Debug, PartialEq)]
pub enum ExpandedX<T> {
    /// Quant mode none: the rows of `x`, in `x`'s element type.
    Unquantized(Vec<T>),
    /// Static or dynamic int8.
    Int8(Vec<i8>),
}

impl<T> ExpandedX<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            ExpandedX::Unquantized(v) => v.len(),
            ExpandedX::Int8(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T: Element> ExpandedX<T> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            ExpandedX::Unquantized(_) => T::DTYPE,
            ExpandedX::Int8(_) => DType::I8,
        }
    }
}

/// The outputs of [`moe_init_routing`] (spec "Outputs").
#[derive(Clone, Debug, PartialEq)]
pub struct MoeInitRoutingOutput<T> {
    /// `expanded_x`, flat; its shape is [`expanded_x_shape`](Self::expanded_x_shape). Rows past
    /// [`valid_rows`](Self::valid_rows) and drop/pad padding slots are zeros.
    pub expanded_x: ExpandedX<T>,
    /// `[min(active_num, N*K) or N*K, H]`, or `[E, C, H]` in drop/pad mode.
    pub expanded_x_shape: Vec<usize>,
    /// `expanded_row_idx [N*K]` i32: gather (`out[j]` = the row of route `j`, -1 if invalid or
    /// dropped; in active mode a row `>= active_num` means dropped; in drop/pad mode
    /// `e * C + s`), or scatter (`out[r]` = the route at row `r`, the whole sorted order,
    /// invalid routes last).
    pub expanded_row_idx: Vec<i32>,
    /// With `expert_tokens_num_flag`: count or cumsum `[end - start]`, or key-value `[E, 2]`
    /// (flat). Counted before any `active_num` or capacity drop.
    pub expert_tokens: Option<Vec<i64>>,
    /// `expanded_scale [rows]` f32: the carried per-row `scale` (quant none, when given) or the
    /// dynamic dequantisation scale; 0 for rows past `valid_rows` and padding slots. `None` with
    /// static quantisation, and with quant none without `scale`.
    pub expanded_scale: Option<Vec<f32>>,
    /// Rows of `expanded_x` holding data: `min(rows, A)` (A = in-range routes) in dropless and
    /// active mode, `E * C` (every slot, padding included) in drop/pad mode.
    pub valid_rows: usize,
}

impl<T> Default for MoeInitRoutingOutput<T> {
    fn default() -> Self {
        Self {
            expanded_x: ExpandedX::Int8(Vec::new()),
            expanded_x_shape: Vec::new(),
            expanded_row_idx: Vec::new(),
            expert_tokens: None,
            expanded_scale: None,
            valid_rows: 0,
        }
    }
}

/// Routes tokens to experts: spec/moe_routing.md, `moe_init_routing` (torch_npu's
/// `npu_moe_init_routing_v2`), every mode: dropless, active (`active_num`), drop/pad
/// (`expert_capacity`), gather / scatter `expanded_row_idx`, count / cumsum / key-value
/// `expert_tokens`, no / static int8 / dynamic int8 quantisation (with optional smooth
/// scales), `active_expert_range`.
///
/// Routes `j = i*K + k` are ordered by a stable counting sort in O(N*K + E): in-range experts
/// ascending, then ids `>= end` ascending, then ids `< start` (negative ones included) in route
/// order. Rows are copied (quantised) in parallel on the rayon pool when there are more than
/// a few hundred KiB of them. The result does not depend on the thread count.
///
/// # Errors
/// [`MoeError`] naming the rule: shapes (`x` not `[N, H]`, `expert_idx` not `[N, K]`, `scale`
/// / `offset` of the wrong shape or given where the mode takes none), attributes
/// (`expert_num` outside `1..=10240` or `1..=5120` for key-value, `active_num < -1`,
/// a bad `active_expert_range`, `expert_capacity` outside `1..=N` in drop/pad mode), drop/pad
/// with a partial range, scatter indices or a non-count `expert_tokens_num_type`, i8 `x` with
/// quantisation, `N * K` past `i32::MAX`, and non-finite quantisation inputs in a row that is
/// placed (NaN `x` with static quantisation, where +-inf saturates to 127 / -128; any
/// non-finite `x * smooth` with dynamic quantisation; non-finite static `scale` / `offset` or
/// smooth scale). An `expanded_x` that cannot be allocated is [`MoeError::Allocation`] (it is
/// reserved before any work).
/// Rows no route places (invalid routes, rows dropped by `active_num` or capacity) are never
/// read for quantisation, so they cannot fail.
pub fn moe_init_routing<T: Element>(
    input: &MoeInitRoutingInput<'_, T>,
    attrs: &MoeInitRoutingAttrs,
) -> Result<MoeInitRoutingOutput<T>, MoeError> {
    let mut out = MoeInitRoutingOutput::default();
    moe_init_routing_into(input, attrs, &mut out)?;
    Ok(out)
}

/// [`moe_init_routing`] into `out`, reusing its buffers (no allocation when their capacities
/// suffice). On error `out` may hold a partial result.
pub fn moe_init_routing_into<T: Element>(
    input: &MoeInitRoutingInput<'_, T>,
    attrs: &MoeInitRoutingAttrs,
    out: &mut MoeInitRoutingOutput<T>,
) -> Result<(), MoeError> {
    let plan = Plan::new(input, attrs)?;
    let h = input.hidden_size;
    let rows = plan.out_rows;
    // The output can be far larger than the inputs (drop/pad: E * C rows): reserve it first.
    let shape = || match plan.mode {
        DropPadMode::DropPad => {
            format!("[E, C, H] = [{}, {}, {h}]", plan.expert_num, plan.capacity)
        }
        DropPadMode::Dropless => format!("[{rows}, {h}]"),
    };
    let elem_bytes = match plan.quant {
        QuantMode::None => std::mem::size_of::<T>(),
        _ => 1,
    };
    let len = rows.checked_mul(h).ok_or_else(|| MoeError::Allocation {
        tensor: "expanded_x",
        bytes: rows as u128 * h as u128 * elem_bytes as u128,
        shape: shape(),
    })?;
    match plan.quant {
        QuantMode::None => MoeError::reserve(
            unquantized_vec(&mut out.expanded_x),
            len,
            "expanded_x",
            shape,
        )?,
        _ => MoeError::reserve(int8_vec(&mut out.expanded_x), len, "expanded_x", shape)?,
    }
    let routes = Routes::sort(input.expert_idx, &plan);
    let src = |r: usize| -> Option<usize> { routes.source_route(r, &plan) };
    let placed_rows = || {
        let mut placed = vec![false; input.num_rows];
        for j in (0..rows).filter_map(src) {
            placed[j / input.k] = true;
        }
        placed
    };
    // Quantise the source rows once when the result does not depend on the expert.
    // Only rows that are placed somewhere are quantised (and can fail).
    let pre = match plan.quant {
        QuantMode::Static => Some(quantise_rows(input, QuantMode::Static, &placed_rows())?),
        QuantMode::Dynamic if !plan.per_expert_smooth => {
            Some(quantise_rows(input, QuantMode::Dynamic, &placed_rows())?)
        }
        _ => None,
    };

    match (&pre, plan.quant) {
        (None, QuantMode::None) => {
            let dst = unquantized_vec(&mut out.expanded_x);
            gather_rows(dst, rows, h, input.x, &|r| src(r).map(|j| j / input.k));
        }
        (Some(q), _) => {
            let dst = int8_vec(&mut out.expanded_x);
            gather_rows(dst, rows, h, &q.values, &|r| src(r).map(|j| j / input.k));
        }
        (None, _) => {
            // Dynamic with a smooth scale per expert: quantise each placed route.
            let smooth = input.scale.expect("per-expert smooth scale");
            let start = plan.start;
            let mut ok = vec![true; rows];
            let scales = reuse_vec(out.expanded_scale.get_or_insert_with(Vec::new), rows);
            let dst = reuse_vec(int8_vec(&mut out.expanded_x), rows * h);
            let work =
                |(r, ((row, s), ok)): (usize, ((&mut [i8], &mut f32), &mut bool))| match src(r) {
                    Some(j) => {
                        let e = (input.expert_idx[j] as i64 - start) as usize;
                        let x = &input.x[(j / input.k) * h..][..h];
                        match quantise_dynamic_row(x, Some(&smooth[e * h..][..h]), row) {
                            Some(v) => *s = v,
                            None => *ok = false,
                        }
                    }
                    None => {
                        row.fill(0);
                        *s = 0.0;
                    }
                };
            if rows * h * 4 >= PARALLEL_MIN_BYTES {
                dst.par_chunks_mut(h)
                    .zip(scales.par_iter_mut())
                    .zip(ok.par_iter_mut())
                    .enumerate()
                    .for_each(work);
            } else {
                dst.chunks_mut(h)
                    .zip(scales.iter_mut())
                    .zip(ok.iter_mut())
                    .enumerate()
                    .for_each(work);
            }
            // The failing route of the lowest source row (then the lowest position).
            let failed = (0..rows)
                .filter(|&r| !ok[r])
                .filter_map(&src)
                .min_by_key(|&j| j);
            if let Some(j) = failed {
                let e = (input.expert_idx[j] as i64 - start) as usize;
                let sm = &smooth[e * h..][..h];
                return Err(non_finite_error(
                    input.x,
                    h,
                    j / input.k,
                    DYNAMIC_RULE,
                    |c, v| !(v * sm[c]).is_finite(),
                ));
            }
        }
    }

    // expanded_scale for the other modes.
    match plan.quant {
        QuantMode::None => match input.scale {
            Some(scale) => {
                let s = reuse_vec(out.expanded_scale.get_or_insert_with(Vec::new), rows);
                for (r, v) in s.iter_mut().enumerate() {
                    *v = src(r).map_or(0.0, |j| scale[j / input.k]);
                }
            }
            None => out.expanded_scale = None,
        },
        QuantMode::Static => out.expanded_scale = None,
        QuantMode::Dynamic => {
            if let Some(q) = &pre {
                let s = reuse_vec(out.expanded_scale.get_or_insert_with(Vec::new), rows);
                for (r, v) in s.iter_mut().enumerate() {
                    *v = src(r).map_or(0.0, |j| q.scales[j / input.k]);
                }
            }
        }
    }

    out.expanded_x_shape = match plan.mode {
        DropPadMode::DropPad => vec![plan.expert_num, plan.capacity, h],
        DropPadMode::Dropless => vec![rows, h],
    };
    routes.write_row_idx(&plan, input.expert_idx, &mut out.expanded_row_idx);
    out.expert_tokens = attrs
        .expert_tokens_num_flag
        .then(|| routes.expert_tokens(&plan, attrs.expert_tokens_num_type));
    out.valid_rows = plan.valid_rows(routes.in_range);
    Ok(())
}

/// The validated attributes and derived sizes of one call.
struct Plan {
    expert_num: usize,
    start: i64,
    end: i64,
    mode: DropPadMode,
    capacity: usize,
    quant: QuantMode,
    per_expert_smooth: bool,
    row_idx_type: RowIdxType,
    /// Rows of `expanded_x` (`E * C` slots in drop/pad mode).
    out_rows: usize,
}

impl Plan {
    fn new<T: Element>(
        input: &MoeInitRoutingInput<'_, T>,
        attrs: &MoeInitRoutingAttrs,
    ) -> Result<Self, MoeError> {
        let (n, h, k) = (input.num_rows, input.hidden_size, input.k);
        if h == 0 {
            return Err(MoeError::shape("x", "the hidden size H must be at least 1"));
        }
        if k == 0 {
            return Err(MoeError::shape(
                "expert_idx",
                "K (experts per row) must be at least 1",
            ));
        }
        if n.checked_mul(h) != Some(input.x.len()) {
            return Err(MoeError::shape(
                "x",
                format!(
                    "x must be [N, H] = [{n}, {h}] ({} elements), got {} elements",
                    n as u128 * h as u128,
                    input.x.len()
                ),
            ));
        }
        let nk = n.checked_mul(k).filter(|&nk| nk <= i32::MAX as usize);
        let Some(nk) = nk else {
            return Err(MoeError::shape(
                "expert_idx",
                format!("N * K = {n} * {k} must be at most 2^31 - 1 (expanded_row_idx is i32)"),
            ));
        };
        if input.expert_idx.len() != nk {
            return Err(MoeError::shape(
                "expert_idx",
                format!(
                    "expert_idx must be [N, K] = [{n}, {k}] ({nk} elements), got {} elements",
                    input.expert_idx.len()
                ),
            ));
        }
        let e = attrs.expert_num;
        let max_e = if attrs.expert_tokens_num_type == ExpertTokensNumType::KeyValue {
            if !(1..=MAX_EXPERT_NUM_KEY_VALUE).contains(&e) {
                return Err(MoeError::attribute(
                    "expert_num",
                    e,
                    "1 <= expert_num <= 5120 when expert_tokens_num_type is 2 (key-value)",
                ));
            }
            MAX_EXPERT_NUM_KEY_VALUE
        } else {
            MAX_EXPERT_NUM
        };
        if !(1..=max_e).contains(&e) {
            return Err(MoeError::attribute(
                "expert_num",
                e,
                "1 <= expert_num <= 10240",
            ));
        }
        let [start, end] = attrs.active_expert_range.unwrap_or([0, e]);
        if !(0 <= start && start < end && end <= e) {
            return Err(MoeError::attribute(
                "active_expert_range",
                [start, end],
                "active_expert_range must be [] or [start, end] with 0 <= start < end <= expert_num",
            ));
        }
        if attrs.active_num < -1 {
            return Err(MoeError::attribute(
                "active_num",
                attrs.active_num,
                "active_num must be -1 or 0 (all routes) or > 0 (at most that many rows)",
            ));
        }
        let mut capacity = 0;
        let out_rows;
        match attrs.drop_pad_mode {
            DropPadMode::DropPad => {
                if !(1..=n as i64).contains(&attrs.expert_capacity) {
                    return Err(MoeError::attribute(
                        "expert_capacity",
                        attrs.expert_capacity,
                        "drop/pad mode requires 1 <= expert_capacity <= N",
                    ));
                }
                if [start, end] != [0, e] {
                    return Err(MoeError::combination(
                        "drop/pad mode requires active_expert_range = [0, expert_num)",
                        format!("active_expert_range [{start}, {end}), expert_num {e}"),
                    ));
                }
                if attrs.row_idx_type != RowIdxType::Gather {
                    return Err(MoeError::combination(
                        "drop/pad mode requires row_idx_type 0 (gather)",
                        "row_idx_type 1",
                    ));
                }
                if attrs.expert_tokens_num_type != ExpertTokensNumType::Count {
                    return Err(MoeError::combination(
                        "drop/pad mode requires expert_tokens_num_type 1 (count)",
                        format!(
                            "expert_tokens_num_type {}",
                            i64::from(attrs.expert_tokens_num_type)
                        ),
                    ));
                }
                // active_num is ignored here, as expert_capacity is outside drop/pad mode: the
                // spec defines the drop/pad outputs without it.
                capacity = attrs.expert_capacity as usize;
                out_rows = e as usize * capacity;
            }
            DropPadMode::Dropless => {
                if attrs.active_num > 0 {
                    let a = usize::try_from(attrs.active_num).unwrap_or(usize::MAX);
                    out_rows = a.min(nk);
                } else {
                    out_rows = nk;
                }
            }
        }
        let quant = attrs.quant_mode;
        if quant != QuantMode::None && T::DTYPE == DType::I8 {
            return Err(MoeError::combination(
                "i8 x cannot be quantised (quant_mode must be -1 for i8 x)",
                format!("quant_mode {}", i64::from(quant)),
            ));
        }
        let range = (end - start) as usize;
        let mut per_expert_smooth = false;
        match quant {
            QuantMode::None => {
                if let Some(s) = input.scale {
                    if s.len() != n {
                        return Err(MoeError::shape(
                            "scale",
                            format!(
                                "without quantisation scale must be [N] = [{n}], got {} elements",
                                s.len()
                            ),
                        ));
                    }
                }
                if input.offset.is_some() {
                    return Err(MoeError::shape(
                        "offset",
                        "offset is only taken with static quantisation (quant_mode 0)",
                    ));
                }
            }
            QuantMode::Static => {
                for (name, t) in [("scale", input.scale), ("offset", input.offset)] {
                    let Some(t) = t else {
                        return Err(MoeError::shape(
                            name,
                            "static quantisation (quant_mode 0) requires it, shape [1]",
                        ));
                    };
                    if t.len() != 1 {
                        return Err(MoeError::shape(
                            name,
                            format!(
                                "static quantisation takes shape [1], got {} elements",
                                t.len()
                            ),
                        ));
                    }
                    if !t[0].is_finite() {
                        return Err(MoeError::NonFinite {
                            tensor: name,
                            row: 0,
                            col: 0,
                            value: t[0],
                            rule: "static quantisation parameters must be finite",
                        });
                    }
                }
            }
            QuantMode::Dynamic => {
                if let Some(s) = input.scale {
                    if let Some(i) = s.iter().position(|v| !v.is_finite()) {
                        return Err(MoeError::NonFinite {
                            tensor: "scale",
                            row: i / h,
                            col: i % h,
                            value: s[i],
                            rule: "the smooth scale of dynamic quantisation must be finite",
                        });
                    }
                    if s.len() == range * h {
                        per_expert_smooth = range > 1;
                    } else if s.len() != h {
                        return Err(MoeError::shape(
                            "scale",
                            format!(
                                "dynamic quantisation takes a smooth scale [1, H] = [1, {h}] or [end - start, H] = [{range}, {h}], got {} elements",
                                s.len()
                            ),
                        ));
                    }
                }
                if input.offset.is_some() {
                    return Err(MoeError::shape(
                        "offset",
                        "offset is only taken with static quantisation (quant_mode 0)",
                    ));
                }
            }
        }
        Ok(Plan {
            expert_num: e as usize,
            start,
            end,
            mode: attrs.drop_pad_mode,
            capacity,
            quant,
            per_expert_smooth,
            row_idx_type: attrs.row_idx_type,
            out_rows,
        })
    }

    fn range(&self) -> usize {
        (self.end - self.start) as usize
    }

    fn valid_rows(&self, in_range: usize) -> usize {
        match self.mode {
            DropPadMode::DropPad => self.out_rows,
            DropPadMode::Dropless => self.out_rows.min(in_range),
        }
    }
}

/// The sorted order of the routes.
struct Routes {
    /// `order[r]` = the route at sorted position `r` (all `N * K` routes).
    order: Vec<u32>,
    /// `pos[j]` = the sorted position of route `j`.
    pos: Vec<u32>,
    /// Routes per in-range expert, `[end - start]`.
    counts: Vec<u32>,
    /// Exclusive prefix sums of `counts` (the first position of each in-range expert).
    first: Vec<u32>,
    /// A: the number of in-range routes.
    in_range: usize,
}

impl Routes {
    /// The stable counting sort of spec "Order".
    fn sort(expert_idx: &[i32], plan: &Plan) -> Self {
        let nk = expert_idx.len();
        let (start, end, e) = (plan.start, plan.end, plan.expert_num as i64);
        let range = plan.range();
        // Buckets: in-range experts [0, range), then ids end..=E (E is the usual "finished"
        // sentinel), then the rare ids > E (sorted by a stable comparison sort), then ids < start
        // in route order.
        let above = (e - end) as usize + 1;
        const BIG: u32 = u32::MAX - 1;
        const BELOW: u32 = u32::MAX;
        let mut counts = vec![0u32; range + above];
        let mut bucket = vec![0u32; nk];
        let mut big = Vec::new();
        let mut below = 0usize;
        for (j, (&id, b)) in expert_idx.iter().zip(bucket.iter_mut()).enumerate() {
            let id = id as i64;
            *b = if id >= start && id <= e {
                let b = (id - start) as usize;
                counts[b] += 1;
                b as u32
            } else if id > e {
                big.push((id, j as u32));
                BIG
            } else {
                below += 1;
                BELOW
            };
        }
        let mut next = Vec::with_capacity(counts.len());
        let mut acc = 0u32;
        for &c in &counts {
            next.push(acc);
            acc += c;
        }
        let first = next[..range].to_vec();
        let in_range = counts[..range].iter().map(|&c| c as usize).sum();
        big.sort_by_key(|&(id, _)| id);
        let big_start = acc;
        let mut below_next = acc + big.len() as u32;
        debug_assert_eq!(below_next as usize + below, nk);
        let mut order = vec![0u32; nk];
        let mut pos = vec![0u32; nk];
        for (j, &b) in bucket.iter().enumerate() {
            let p = match b {
                BIG => continue,
                BELOW => {
                    below_next += 1;
                    below_next - 1
                }
                b => {
                    let slot = &mut next[b as usize];
                    *slot += 1;
                    *slot - 1
                }
            };
            order[p as usize] = j as u32;
            pos[j] = p;
        }
        for (i, &(_, j)) in big.iter().enumerate() {
            let p = big_start + i as u32;
            order[p as usize] = j;
            pos[j as usize] = p;
        }
        counts.truncate(range);
        Routes {
            order,
            pos,
            counts,
            first,
            in_range,
        }
    }

    /// The route whose row goes to output row (or drop/pad slot) `r`, if any.
    #[inline]
    fn source_route(&self, r: usize, plan: &Plan) -> Option<usize> {
        match plan.mode {
            DropPadMode::Dropless => (r < self.in_range).then(|| self.order[r] as usize),
            DropPadMode::DropPad => {
                let (e, s) = (r / plan.capacity, r % plan.capacity);
                (s < self.counts[e] as usize)
                    .then(|| self.order[self.first[e] as usize + s] as usize)
            }
        }
    }

    fn write_row_idx(&self, plan: &Plan, expert_idx: &[i32], out: &mut Vec<i32>) {
        let nk = self.order.len();
        out.clear();
        out.reserve(nk);
        match (plan.mode, plan.row_idx_type) {
            (DropPadMode::Dropless, RowIdxType::Scatter) => {
                out.extend(self.order.iter().map(|&j| j as i32));
            }
            (DropPadMode::Dropless, RowIdxType::Gather) => {
                let a = self.in_range as u32;
                out.extend(self.pos.iter().map(|&p| if p < a { p as i32 } else { -1 }));
            }
            (DropPadMode::DropPad, _) => {
                let c = plan.capacity;
                let a = self.in_range as u32;
                // In drop/pad mode every in-range expert is [0, E), so start = 0.
                out.extend(self.pos.iter().zip(expert_idx).map(|(&p, &e)| {
                    if p >= a {
                        return -1;
                    }
                    let e = e as usize;
                    let s = (p - self.first[e]) as usize;
                    if s < c {
                        (e * c + s) as i32
                    } else {
                        -1
                    }
                }));
            }
        }
    }

    fn expert_tokens(&self, plan: &Plan, kind: ExpertTokensNumType) -> Vec<i64> {
        match kind {
            ExpertTokensNumType::Count => self.counts.iter().map(|&c| c as i64).collect(),
            ExpertTokensNumType::Cumsum => {
                let mut acc = 0i64;
                self.counts
                    .iter()
                    .map(|&c| {
                        acc += c as i64;
                        acc
                    })
                    .collect()
            }
            ExpertTokensNumType::KeyValue => {
                let mut kv = vec![0i64; plan.expert_num * 2];
                let mut row = 0;
                for (i, &c) in self.counts.iter().enumerate() {
                    if c > 0 {
                        kv[2 * row] = plan.start + i as i64;
                        kv[2 * row + 1] = c as i64;
                        row += 1;
                    }
                }
                kv
            }
        }
    }
}

/// Source rows quantised once (static, or dynamic without a per-expert smooth scale).
struct Quantised {
    values: Vec<i8>,
    /// Dynamic only: the per-row scale `s`.
    scales: Vec<f32>,
}

const STATIC_RULE: &str =
    "static quantisation needs x * scale + offset to be a number (NaN cannot be quantised)";
const DYNAMIC_RULE: &str =
    "dynamic quantisation needs every x * smooth scale to be finite (x non-finite, or the product overflowing f32, has no scale)";

/// `round_half_even(clamp(y, -128, 127)) as i8` for a `y` that is not NaN. Adding 1.5 * 2^23
/// rounds to an integer in the FPU's mode (to nearest, ties to even; the constant is even, so
/// ties land on even results) for |y| <= 2^22, and the integer is then the low bits of the sum.
/// Unlike `round_ties_even` (a libm call per element without SSE4.1) this vectorises on every
/// x86-64 and gives the same value.
#[inline(always)]
fn to_i8(y: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0;
    let c = y.clamp(-128.0, 127.0);
    ((c + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32) as i8
}

/// Static int8 of one row; `false` if some `x * scale + offset` is NaN.
#[inline]
fn quantise_static_row<T: Element>(x: &[T], scale: f32, offset: f32, q: &mut [i8]) -> bool {
    let mut nan = false;
    for (&v, q) in x.iter().zip(q.iter_mut()) {
        let y = v.to_f32() * scale + offset;
        nan |= y.is_nan();
        *q = to_i8(y);
    }
    !nan
}

/// Largest `|f32 bits|` of a row, as bits: a non-negative finite float orders like its bits,
/// and inf / NaN bits exceed every finite one (an integer max vectorises; `f32::max` does not).
const MAX_FINITE_BITS: u32 = 0x7f7f_ffff;

/// Dynamic int8 of one row: `v = x * smooth`, `s = max|v| / 127`, `q = round_half_even(v / s)`
/// (q = 0 and s = 0 for an all-zero row, and for a row whose `max|v| / 127` underflows to 0 in
/// f32, i.e. `max|v| < 127 * 2^-149`: 0 is then the nearest dequantised value). q is clamped to
/// [-128, 127]; it passes 127 only when `s` is subnormal and rounded. `None` if some `v` is not
/// finite.
#[inline]
fn quantise_dynamic_row<T: Element>(x: &[T], smooth: Option<&[f32]>, q: &mut [i8]) -> Option<f32> {
    let mut max_bits = 0u32;
    match smooth {
        Some(sm) => {
            for (&v, &m) in x.iter().zip(sm) {
                max_bits = max_bits.max((v.to_f32() * m).to_bits() & 0x7fff_ffff);
            }
        }
        None => {
            for &v in x {
                max_bits = max_bits.max(v.to_f32().to_bits() & 0x7fff_ffff);
            }
        }
    }
    if max_bits > MAX_FINITE_BITS {
        return None;
    }
    let s = f32::from_bits(max_bits) / 127.0;
    if s == 0.0 {
        q.fill(0);
        return Some(s);
    }
    match smooth {
        Some(sm) => {
            for ((&v, &m), q) in x.iter().zip(sm).zip(q.iter_mut()) {
                *q = to_i8((v.to_f32() * m) / s);
            }
        }
        None => {
            for (&v, q) in x.iter().zip(q.iter_mut()) {
                *q = to_i8(v.to_f32() / s);
            }
        }
    }
    Some(s)
}

/// The typed error for the first value of row `row` of `x` that `f(column, x value)` rejects.
fn non_finite_error<T: Element>(
    x: &[T],
    h: usize,
    row: usize,
    rule: &'static str,
    bad: impl Fn(usize, f32) -> bool,
) -> MoeError {
    let xs = &x[row * h..][..h];
    let col = (0..h).find(|&c| bad(c, xs[c].to_f32())).unwrap_or(0);
    MoeError::NonFinite {
        tensor: "x",
        row,
        col,
        value: xs[col].to_f32(),
        rule,
    }
}

/// Quantises every placed source row once (the others stay zeros, unread); the first failing
/// row (lowest index) is the error.
fn quantise_rows<T: Element>(
    input: &MoeInitRoutingInput<'_, T>,
    quant: QuantMode,
    placed: &[bool],
) -> Result<Quantised, MoeError> {
    let h = input.hidden_size;
    let mut values = vec![0i8; input.x.len()];
    let mut scales = vec![0f32; input.num_rows];
    let mut ok = vec![true; input.num_rows];
    let (scale, offset) = match quant {
        QuantMode::Static => (
            input.scale.expect("checked")[0],
            input.offset.expect("checked")[0],
        ),
        _ => (1.0, 0.0),
    };
    let smooth = input.scale;
    type Row<'a, T> = (
        (((&'a [T], &'a mut [i8]), &'a mut f32), &'a mut bool),
        &'a bool,
    );
    let work = |((((x, q), s), ok), &placed): Row<'_, T>| {
        if !placed {
            return;
        }
        if quant == QuantMode::Static {
            *ok = quantise_static_row(x, scale, offset, q);
        } else {
            match quantise_dynamic_row(x, smooth, q) {
                Some(v) => *s = v,
                None => *ok = false,
            }
        }
    };
    if input.x.len() * 4 >= PARALLEL_MIN_BYTES {
        input
            .x
            .par_chunks(h)
            .zip(values.par_chunks_mut(h))
            .zip(scales.par_iter_mut())
            .zip(ok.par_iter_mut())
            .zip(placed.par_iter())
            .for_each(work);
    } else {
        input
            .x
            .chunks(h)
            .zip(values.chunks_mut(h))
            .zip(scales.iter_mut())
            .zip(ok.iter_mut())
            .zip(placed.iter())
            .for_each(work);
    }
    if let Some(row) = ok.iter().position(|&o| !o) {
        return Err(if quant == QuantMode::Static {
            non_finite_error(input.x, h, row, STATIC_RULE, |_, v| {
                (v * scale + offset).is_nan()
            })
        } else {
            non_finite_error(input.x, h, row, DYNAMIC_RULE, |c, v| {
                !(v * smooth.map_or(1.0, |s| s[c])).is_finite()
            })
        });
    }
    Ok(Quantised { values, scales })
}

/// Sets `dst` to `rows * h` elements: row `r` = `src` row `src_row(r)`, or zeros. The rows are
/// written straight into `dst`'s spare capacity (no zero fill before the copy: a fresh
/// `expanded_x` is written once), in parallel when large.
fn gather_rows<U: Copy + Default + Send + Sync>(
    dst: &mut Vec<U>,
    rows: usize,
    h: usize,
    src: &[U],
    src_row: &(dyn Fn(usize) -> Option<usize> + Sync),
) {
    let len = rows * h;
    dst.clear();
    dst.reserve_exact(len);
    let spare = &mut dst.spare_capacity_mut()[..len];
    let work = |(r, row): (usize, &mut [MaybeUninit<U>])| match src_row(r) {
        Some(i) => {
            let from = &src[i * h..][..h];
            // SAFETY: `row` and `from` are both `h` elements long, and do not overlap (`from`
            // is borrowed immutably while `row` is a part of `dst`'s spare capacity).
            unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), row.as_mut_ptr().cast::<U>(), h) }
        }
        None => row.iter_mut().for_each(|v| {
            v.write(U::default());
        }),
    };
    if len * std::mem::size_of::<U>() >= PARALLEL_MIN_BYTES {
        // Chunks of whole rows of at least ~64 KiB each, so a task outweighs its dispatch.
        let row_bytes = h * std::mem::size_of::<U>();
        let per_task = (64 * 1024 / row_bytes.max(1)).max(1);
        spare
            .par_chunks_mut(h * per_task)
            .enumerate()
            .for_each(|(t, chunk)| {
                chunk
                    .chunks_mut(h)
                    .enumerate()
                    .for_each(|(i, row)| work((t * per_task + i, row)))
            });
    } else {
        spare.chunks_mut(h).enumerate().for_each(work);
    }
    // SAFETY: every one of the `len` elements was written above (each row is either copied
    // whole or filled whole), and `len <= capacity`.
    unsafe { dst.set_len(len) };
}

fn reuse_vec<U: Copy + Default>(v: &mut Vec<U>, len: usize) -> &mut [U] {
    if v.len() != len {
        v.clear();
        v.resize(len, U::default());
    }
    v
}

fn unquantized_vec<T: Element>(x: &mut ExpandedX<T>) -> &mut Vec<T> {
    if !matches!(x, ExpandedX::Unquantized(_)) {
        *x = ExpandedX::Unquantized(Vec::new());
    }
    match x {
        ExpandedX::Unquantized(v) => v,
        ExpandedX::Int8(_) => unreachable!(),
    }
}

fn int8_vec<T>(x: &mut ExpandedX<T>) -> &mut Vec<i8> {
    if !matches!(x, ExpandedX::Int8(_)) {
        *x = ExpandedX::Int8(Vec::new());
    }
    match x {
        ExpandedX::Int8(v) => v,
        ExpandedX::Unquantized(_) => unreachable!(),
    }
}
