//! Thousands of seeded random cases of every operator against the literal reference of
//! `tests/reference` (itself checked on the spec's worked cases by `worked_cases_reference.rs`).
//!
//! `moe_init_routing` is compared exactly (every output, `expanded_x` bit for bit with its element
//! type); invalid attribute / shape combinations must be refused by both. Gating compares expert
//! ids exactly (except where the f64 reference sees two different scores within 1e-5 relative,
//! which f32 arithmetic may order either way (relative 2e-6); such cases are counted and must stay
//! rare: under 1%) and
//! weights within a relative tolerance. Unpermute / finalize compare within a tolerance derived
//! from f32 accumulation. Each test prints its case count per mode (`--nocapture`) and asserts a
//! minimum per mode so it cannot pass vacuously.

mod reference;

use std::collections::BTreeMap;

use half::{bf16, f16};
use nucleus_moe::{
    moe_finalize_routing, moe_gating_top_k, moe_gating_top_k_softmax, moe_init_routing,
    moe_token_unpermute, DropPadMode, Element, ExpandedX, ExpertTokensNumType,
    FinalizeRoutingInput, FloatElement, GatingOutput, GroupSelectMode, GroupedTopKParams, MoeError,
    MoeInitRoutingAttrs, MoeInitRoutingInput, MoeInitRoutingOutput, NormType, QuantMode,
    RowIdxType,
};
use reference::{RefAttrs, RefGating, RefGroupedParams, RefInput, RefOutput, RefX};

// ---------------------------------------------------------------------------------------------
// Seeded PRNG (SplitMix64) and per-mode counters.

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n >= 1).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + self.below((hi - lo + 1) as u64) as i64
    }
    fn urange(&mut self, lo: usize, hi: usize) -> usize {
        self.range(lo as i64, hi as i64) as usize
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
}

#[derive(Default)]
struct Counts(BTreeMap<&'static str, usize>);

impl Counts {
    fn hit(&mut self, mode: &'static str) {
        *self.0.entry(mode).or_default() += 1;
    }
    fn get(&self, mode: &str) -> usize {
        self.0.get(mode).copied().unwrap_or(0)
    }
    /// Prints every count and asserts each `(mode, min)`.
    fn report(&self, test: &str, mins: &[(&str, usize)]) {
        println!("{test}: cases per mode:");
        for (k, v) in &self.0 {
            println!("  {k:<36} {v}");
        }
        for &(mode, min) in mins {
            assert!(
                self.get(mode) >= min,
                "{test}: mode {mode} had {} cases, fewer than {min}",
                self.get(mode)
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Element types of x.

trait TestElem: Element {
    const NAME: &'static str;
    /// `v` as this type (`v` is already an integer in -128..=127 for i8).
    fn from_val(v: f32) -> Self;
}
impl TestElem for f32 {
    const NAME: &'static str = "x_f32";
    fn from_val(v: f32) -> Self {
        v
    }
}
impl TestElem for f16 {
    const NAME: &'static str = "x_f16";
    fn from_val(v: f32) -> Self {
        f16::from_f32(v)
    }
}
impl TestElem for bf16 {
    const NAME: &'static str = "x_bf16";
    fn from_val(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl TestElem for i8 {
    const NAME: &'static str = "x_i8";
    fn from_val(v: f32) -> Self {
        v as i8
    }
}

/// A value of x: zeros, halves and quarters (round-half-even ties), integers, wide and small floats.
fn gen_x(rng: &mut Rng, is_i8: bool) -> f32 {
    if is_i8 {
        return rng.range(-128, 127) as f32;
    }
    match rng.below(9) {
        0 => 0.0,
        1 => -0.0,
        2 => rng.range(-16, 16) as f32 * 0.5,
        3 => rng.range(-600, 600) as f32 * 0.25,
        4 => ((rng.unit() * 2.0 - 1.0) * 1000.0) as f32,
        5 => ((rng.unit() * 2.0 - 1.0) * 3.0) as f32,
        6 => rng.range(-130, 130) as f32,
        7 => ((rng.unit() * 2.0 - 1.0) * 1e-3) as f32,
        _ => rng.range(-254, 254) as f32 * 0.5,
    }
}

/// An expert id: mostly in [0, E), and -1, other negatives, E, past E.
fn gen_id(rng: &mut Rng, e: i64) -> i32 {
    match rng.below(12) {
        0..=6 => rng.range(0, e - 1) as i32,
        7 => -1,
        8 => rng.pick(&[-2, -3, -100, i32::MIN]),
        9 => e as i32,
        10 => (e + rng.range(1, 5)) as i32,
        _ => {
            let inside = rng.range(0, e - 1) as i32;
            rng.pick(&[i32::MAX, (e + 1000) as i32, inside])
        }
    }
}

// ---------------------------------------------------------------------------------------------
// moe_init_routing cases.

/// One case: `x` as f32 values exactly representable in `dtype` (0 f32, 1 f16, 2 bf16, 3 i8).
#[derive(Clone, Debug)]
struct Case {
    dtype: u8,
    input: RefInput,
    attrs: RefAttrs,
}

const DROPLESS: u64 = 0;
const ACTIVE: u64 = 1;
const DROP_PAD: u64 = 2;

#[derive(Clone, Copy)]
enum Size {
    Small,
    Large,
    /// Large enough for the operator's parallel row copy (>= 1 MiB of rows, even for i8).
    Parallel,
}

fn gen_case(rng: &mut Rng, size: Size, mode: Option<u64>, dtype: Option<u8>) -> Case {
    let dtype = dtype.unwrap_or_else(|| rng.below(4) as u8);
    let is_i8 = dtype == 3;
    let mode = mode.unwrap_or_else(|| rng.below(3));
    let (mut n, k, h, e) = match size {
        Size::Small => (
            rng.urange(0, 12),
            rng.urange(1, 4),
            rng.urange(1, 6),
            rng.range(1, 10),
        ),
        Size::Large => (
            rng.urange(20, 400),
            rng.urange(1, 8),
            rng.urange(1, 48),
            rng.range(1, 300),
        ),
        Size::Parallel => (
            rng.urange(1000, 1200),
            rng.urange(4, 6),
            rng.urange(256, 300),
            rng.range(8, 64),
        ),
    };
    if mode == DROP_PAD && n == 0 {
        n = 1;
    }
    let mut a = RefAttrs::new(e);
    // active_expert_range
    a.active_expert_range = if mode == DROP_PAD {
        if rng.chance(0.5) {
            None
        } else {
            Some([0, e])
        }
    } else {
        match rng.below(3) {
            0 => None,
            1 => Some([0, e]),
            _ => {
                let s = rng.range(0, e - 1);
                let t = rng.range(s + 1, e);
                Some([s, t])
            }
        }
    };
    let (start, end) = a.active_expert_range.map_or((0, e), |[s, t]| (s, t));
    // expert ids; sometimes concentrated on few experts (long ties, capacity drops)
    let hot = rng.chance(0.3);
    let hot_e = rng.range(0, e - 1);
    let expert_idx: Vec<i32> = (0..n * k)
        .map(|_| {
            if hot && rng.chance(0.6) {
                hot_e as i32
            } else {
                gen_id(rng, e)
            }
        })
        .collect();
    let nk = (n * k) as i64;
    a.active_num = match mode {
        DROPLESS => rng.pick(&[-1, 0]),
        ACTIVE => rng.range(1, nk + 3),
        // drop/pad with active_num > 0: see `drop_pad_with_positive_active_num`
        _ => rng.pick(&[-1, 0]),
    };
    a.expert_capacity = if mode == DROP_PAD {
        rng.range(1, n as i64)
    } else {
        rng.pick(&[-1, 0, 1, 7, -5, 100_000])
    };
    a.drop_pad_mode = (mode == DROP_PAD) as i64;
    a.expert_tokens_num_type = if mode == DROP_PAD { 1 } else { rng.range(0, 2) };
    a.expert_tokens_num_flag = rng.chance(0.7);
    a.row_idx_type = if mode == DROP_PAD { 0 } else { rng.range(0, 1) };
    a.quant_mode = if is_i8 { -1 } else { rng.range(-1, 1) };
    // x
    let zero_rows = rng.chance(0.2);
    let mut x = vec![0f32; n * h];
    for i in 0..n {
        if zero_rows && rng.chance(0.3) {
            continue;
        }
        for c in 0..h {
            x[i * h + c] = gen_x(rng, is_i8);
        }
    }
    // scale / offset
    let mut scale = None;
    let mut offset = None;
    match a.quant_mode {
        -1 => {
            if rng.chance(0.5) {
                scale = Some((0..n).map(|_| gen_x(rng, false)).collect());
            }
        }
        0 => {
            let s = if rng.chance(0.7) {
                rng.pick(&[2.0, 0.5, 1.0, -1.0, 0.25, 3.0, 100.0, 1e-3, -0.75])
            } else {
                (rng.unit() * 8.0 - 4.0) as f32
            };
            let o = if rng.chance(0.7) {
                rng.pick(&[0.0, 0.5, -0.5, 1.5, -3.25, 10.0])
            } else {
                (rng.unit() * 4.0 - 2.0) as f32
            };
            scale = Some(vec![s]);
            offset = Some(vec![o]);
        }
        _ => {
            let rows = match rng.below(3) {
                0 => 0,
                1 => 1,
                _ => (end - start) as usize,
            };
            if rows > 0 {
                let sm: Vec<f32> = (0..rows * h)
                    .map(|_| {
                        if rng.chance(0.6) {
                            rng.pick(&[1.0, 0.5, 2.0, -1.0, 0.0, 0.25, 3.0])
                        } else {
                            (rng.unit() * 6.0 - 3.0) as f32
                        }
                    })
                    .collect();
                scale = Some(sm);
            }
        }
    }
    // static: +-inf x is defined (clamp gives 127 / -128); the spec says nothing of it elsewhere
    if a.quant_mode == 0 && !x.is_empty() && rng.chance(0.1) {
        let p = rng.urange(0, x.len() - 1);
        x[p] = rng.pick(&[f32::INFINITY, f32::NEG_INFINITY]);
    }
    // values exactly representable in the element type
    let x: Vec<f32> = match dtype {
        1 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        2 => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        _ => x,
    };
    Case {
        dtype,
        input: RefInput {
            x,
            x_is_i8: is_i8,
            n,
            h,
            expert_idx,
            k,
            scale,
            offset,
        },
        attrs: a,
    }
}

fn op_attrs(a: &RefAttrs) -> Result<MoeInitRoutingAttrs, MoeError> {
    Ok(MoeInitRoutingAttrs {
        active_num: a.active_num,
        expert_capacity: a.expert_capacity,
        expert_num: a.expert_num,
        drop_pad_mode: DropPadMode::try_from(a.drop_pad_mode)?,
        expert_tokens_num_type: ExpertTokensNumType::try_from(a.expert_tokens_num_type)?,
        expert_tokens_num_flag: a.expert_tokens_num_flag,
        quant_mode: QuantMode::try_from(a.quant_mode)?,
        active_expert_range: a.active_expert_range,
        row_idx_type: RowIdxType::try_from(a.row_idx_type)?,
    })
}

fn run_op<T: TestElem>(case: &Case) -> Result<MoeInitRoutingOutput<T>, MoeError> {
    let inp = &case.input;
    let x: Vec<T> = inp.x.iter().map(|&v| T::from_val(v)).collect();
    // the reference sees exactly the widened values
    for (v, w) in x.iter().zip(&inp.x) {
        assert_eq!(v.to_f32().to_bits(), w.to_bits());
    }
    let input = MoeInitRoutingInput {
        x: &x,
        num_rows: inp.n,
        hidden_size: inp.h,
        expert_idx: &inp.expert_idx,
        k: inp.k,
        scale: inp.scale.as_deref(),
        offset: inp.offset.as_deref(),
    };
    moe_init_routing(&input, &op_attrs(&case.attrs)?)
}

fn bits(v: &Option<Vec<f32>>) -> Option<Vec<u32>> {
    v.as_ref().map(|v| v.iter().map(|f| f.to_bits()).collect())
}

/// Exact comparison of every output; `Err` describes the first difference.
fn compare<T: TestElem>(op: &MoeInitRoutingOutput<T>, r: &RefOutput) -> Result<(), String> {
    if op.expanded_x_shape != r.expanded_x_shape {
        return Err(format!(
            "expanded_x_shape: op {:?} ref {:?}",
            op.expanded_x_shape, r.expanded_x_shape
        ));
    }
    match (&op.expanded_x, &r.expanded_x) {
        (ExpandedX::Unquantized(v), RefX::Float(w)) => {
            if op.expanded_x.dtype() != T::DTYPE {
                return Err("expanded_x element type".into());
            }
            let vb: Vec<u32> = v.iter().map(|e| e.to_f32().to_bits()).collect();
            let wb: Vec<u32> = w.iter().map(|e| e.to_bits()).collect();
            if vb != wb {
                let vf: Vec<f32> = v.iter().map(|e| e.to_f32()).collect();
                return Err(format!("expanded_x: op {vf:?} ref {w:?}"));
            }
        }
        (ExpandedX::Int8(v), RefX::Int8(w)) => {
            if v != w {
                return Err(format!("expanded_x (int8): op {v:?} ref {w:?}"));
            }
        }
        _ => return Err("expanded_x: quantised vs not".into()),
    }
    if op.expanded_row_idx != r.expanded_row_idx {
        return Err(format!(
            "expanded_row_idx: op {:?} ref {:?}",
            op.expanded_row_idx, r.expanded_row_idx
        ));
    }
    if op.expert_tokens != r.expert_tokens {
        return Err(format!(
            "expert_tokens: op {:?} ref {:?}",
            op.expert_tokens, r.expert_tokens
        ));
    }
    if bits(&op.expanded_scale) != bits(&r.expanded_scale) {
        return Err(format!(
            "expanded_scale: op {:?} ref {:?}",
            op.expanded_scale, r.expanded_scale
        ));
    }
    if op.valid_rows != r.valid_rows {
        return Err(format!(
            "valid_rows: op {} ref {}",
            op.valid_rows, r.valid_rows
        ));
    }
    Ok(())
}

/// Runs both on a case. `Ok(true)`: both accepted and agree; `Ok(false)`: both refused.
fn check_case(case: &Case) -> Result<bool, String> {
    fn go<T: TestElem>(case: &Case) -> Result<bool, String> {
        let r = reference::init_routing(&case.input, &case.attrs);
        let op = run_op::<T>(case);
        match (op, r) {
            (Ok(op), Ok(r)) => compare(&op, &r).map(|_| true),
            (Err(_), Err(_)) => Ok(false),
            (Ok(_), Err(why)) => Err(format!("reference refuses ({why}), operator accepts")),
            (Err(e), Ok(_)) => Err(format!("operator refuses ({e}), reference accepts")),
        }
    }
    match case.dtype {
        0 => go::<f32>(case),
        1 => go::<f16>(case),
        2 => go::<bf16>(case),
        _ => go::<i8>(case),
    }
}

fn dtype_name(d: u8) -> &'static str {
    match d {
        0 => <f32 as TestElem>::NAME,
        1 => <f16 as TestElem>::NAME,
        2 => <bf16 as TestElem>::NAME,
        _ => <i8 as TestElem>::NAME,
    }
}

/// The modes a valid case exercises.
fn tally(c: &Case, counts: &mut Counts) {
    let a = &c.attrs;
    let inp = &c.input;
    let e = a.expert_num;
    let nk = (inp.n * inp.k) as i64;
    counts.hit(dtype_name(c.dtype));
    counts.hit(match (a.drop_pad_mode, a.active_num > 0) {
        (1, _) => "mode_drop_pad",
        (_, true) => "mode_active",
        _ => "mode_dropless",
    });
    if a.drop_pad_mode == 1 && a.expert_capacity == 1 {
        counts.hit("drop_pad_capacity_1");
    }
    if a.drop_pad_mode == 1 && a.expert_capacity == inp.n as i64 {
        counts.hit("drop_pad_capacity_N");
    }
    if a.drop_pad_mode == 0 && a.active_num > nk {
        counts.hit("active_num_beyond_NK");
    }
    if a.drop_pad_mode == 0 && a.active_num == 1 {
        counts.hit("active_num_1");
    }
    if a.drop_pad_mode == 0 {
        counts.hit(if a.row_idx_type == 0 {
            "row_idx_gather"
        } else {
            "row_idx_scatter"
        });
    }
    let tt = match a.expert_tokens_num_type {
        0 => "tokens_cumsum",
        1 => "tokens_count",
        _ => "tokens_key_value",
    };
    counts.hit(tt);
    if !a.expert_tokens_num_flag {
        counts.hit("tokens_flag_off");
    }
    let (start, end) = a.active_expert_range.map_or((0, e), |[s, t]| (s, t));
    let sc = inp.scale.as_ref().map_or(0, |s| s.len());
    counts.hit(match a.quant_mode {
        -1 if inp.scale.is_some() => "quant_none_with_scale",
        -1 => "quant_none",
        0 if inp.x.iter().any(|v| v.is_infinite()) => "quant_static_inf_x",
        0 => "quant_static",
        _ if sc == 0 => "quant_dynamic_no_smooth",
        _ if (end - start) > 1 && sc == inp.h => "quant_dynamic_smooth_1xH",
        _ if (end - start) > 1 => "quant_dynamic_smooth_rangexH",
        _ => "quant_dynamic_smooth_range_of_1",
    });
    counts.hit(match a.active_expert_range {
        None => "range_default",
        Some([s, t]) if s == 0 && t == e => "range_full_explicit",
        Some(_) => "range_partial",
    });
    let ids = &inp.expert_idx;
    if ids.iter().any(|&i| i < -1) {
        counts.hit("ids_negative_below_minus_1");
    }
    if ids.contains(&-1) {
        counts.hit("ids_minus_1");
    }
    if ids.iter().any(|&i| i as i64 == e) {
        counts.hit("ids_equal_E");
    }
    if ids.iter().any(|&i| i as i64 > e) {
        counts.hit("ids_above_E");
    }
    if ids
        .iter()
        .any(|&i| (i as i64) >= 0 && (i as i64) < e && ((i as i64) < start || (i as i64) >= end))
    {
        counts.hit("ids_in_0_E_outside_range");
    }
    if inp.n == 0 {
        counts.hit("n_0");
    }
}

#[test]
fn init_routing_random_matches_reference() {
    let mut rng = Rng::new(0x5EED_0001);
    let mut counts = Counts::default();
    let mut cases: Vec<(Size, usize)> = vec![(Size::Small, 60_000), (Size::Large, 300)];
    cases.push((Size::Parallel, 6));
    for (size, num) in cases {
        for case_no in 0..num {
            let case = gen_case(&mut rng, size, None, None);
            match check_case(&case) {
                Ok(true) => {}
                Ok(false) => panic!("case {case_no}: a valid case was refused by both: {case:?}"),
                Err(why) => panic!("case {case_no}: {why}\n{case:?}"),
            }
            tally(&case, &mut counts);
            counts.hit(match size {
                Size::Small => "size_small",
                Size::Large => "size_large",
                Size::Parallel => "size_parallel",
            });
        }
    }
    counts.report(
        "init_routing_random_matches_reference",
        &[
            ("x_f32", 6000),
            ("x_f16", 6000),
            ("x_bf16", 6000),
            ("x_i8", 6000),
            ("mode_dropless", 8000),
            ("mode_active", 8000),
            ("mode_drop_pad", 8000),
            ("drop_pad_capacity_1", 1000),
            ("drop_pad_capacity_N", 1000),
            ("active_num_1", 200),
            ("active_num_beyond_NK", 600),
            ("row_idx_gather", 6000),
            ("row_idx_scatter", 6000),
            ("tokens_cumsum", 4000),
            ("tokens_count", 4000),
            ("tokens_key_value", 4000),
            ("tokens_flag_off", 4000),
            ("quant_none", 4000),
            ("quant_none_with_scale", 4000),
            ("quant_static", 4000),
            ("quant_static_inf_x", 300),
            ("quant_dynamic_no_smooth", 1000),
            ("quant_dynamic_smooth_1xH", 600),
            ("quant_dynamic_smooth_rangexH", 600),
            ("range_default", 6000),
            ("range_full_explicit", 6000),
            ("range_partial", 4000),
            ("ids_negative_below_minus_1", 4000),
            ("ids_minus_1", 4000),
            ("ids_equal_E", 4000),
            ("ids_above_E", 4000),
            ("ids_in_0_E_outside_range", 2000),
            ("n_0", 600),
            ("size_large", 300),
            ("size_parallel", 6),
        ],
    );
}

/// Mutations that break exactly one rule of the spec; both must refuse.
const MUTATIONS: &[&str] = &[
    "drop_pad_with_scatter",
    "drop_pad_with_partial_range",
    "drop_pad_with_cumsum",
    "drop_pad_with_key_value",
    "drop_pad_capacity_0",
    "drop_pad_capacity_negative",
    "drop_pad_capacity_above_N",
    "drop_pad_with_N_0",
    "expert_num_0",
    "expert_num_negative",
    "expert_num_above_10240",
    "expert_num_above_5120_key_value",
    "active_num_below_minus_1",
    "range_start_negative",
    "range_empty",
    "range_reversed",
    "range_end_above_E",
    "quant_none_scale_not_N",
    "quant_none_with_offset",
    "static_without_scale",
    "static_without_offset",
    "static_scale_not_1",
    "static_offset_not_1",
    "dynamic_smooth_bad_shape",
    "dynamic_with_offset",
    "i8_x_static",
    "i8_x_dynamic",
    "x_not_N_by_H",
    "expert_idx_not_N_by_K",
    "drop_pad_mode_2",
    "quant_mode_2",
    "quant_mode_minus_2",
    "tokens_type_3",
    "row_idx_type_2",
];

/// Applies mutation `m` to a fresh valid case; `None` if it does not apply to that case.
fn mutate(rng: &mut Rng, m: &str) -> Option<Case> {
    let needs_dp = m.starts_with("drop_pad_with") || m.starts_with("drop_pad_capacity");
    let mode = if needs_dp { Some(DROP_PAD) } else { None };
    let dtype = match m {
        "i8_x_static" | "i8_x_dynamic" => Some(3),
        _ if m.starts_with("static") || m.starts_with("dynamic") => Some(rng.below(3) as u8),
        _ => None,
    };
    let mut c = gen_case(rng, Size::Small, mode, dtype);
    let a = &mut c.attrs;
    let e = a.expert_num;
    let n = c.input.n;
    let h = c.input.h;
    match m {
        "drop_pad_with_scatter" => a.row_idx_type = 1,
        "drop_pad_with_partial_range" => {
            if e < 2 {
                return None;
            }
            let s = rng.range(0, e - 1);
            let t = if s == 0 {
                rng.range(1, e - 1)
            } else {
                rng.range(s + 1, e)
            };
            a.active_expert_range = Some([s, t]);
        }
        "drop_pad_with_cumsum" => a.expert_tokens_num_type = 0,
        "drop_pad_with_key_value" => a.expert_tokens_num_type = 2,
        "drop_pad_capacity_0" => a.expert_capacity = 0,
        "drop_pad_capacity_negative" => a.expert_capacity = rng.pick(&[-1, -2, i64::MIN]),
        "drop_pad_capacity_above_N" => a.expert_capacity = n as i64 + rng.range(1, 3),
        "drop_pad_with_N_0" => {
            c.input.n = 0;
            c.input.x.clear();
            c.input.expert_idx.clear();
            if let Some(s) = &mut c.input.scale {
                if a.quant_mode == -1 {
                    s.clear();
                }
            }
            a.expert_capacity = rng.pick(&[0, 1, 2]);
        }
        "expert_num_0" => {
            a.expert_num = 0;
            a.active_expert_range = None;
        }
        "expert_num_negative" => {
            a.expert_num = rng.pick(&[-1, -5, i64::MIN]);
            a.active_expert_range = None;
        }
        "expert_num_above_10240" => {
            a.expert_num = rng.pick(&[10241, 20000, i64::MAX]);
        }
        "expert_num_above_5120_key_value" => {
            if a.drop_pad_mode == 1 {
                return None;
            }
            a.expert_num = rng.range(5121, 10240);
            a.expert_tokens_num_type = 2;
        }
        "active_num_below_minus_1" => a.active_num = rng.pick(&[-2, -3, -100, i64::MIN]),
        "range_start_negative" => {
            if a.drop_pad_mode == 1 {
                return None;
            }
            a.active_expert_range = Some([rng.range(-3, -1), rng.range(1, e)]);
        }
        "range_empty" => {
            let s = rng.range(0, e);
            a.active_expert_range = Some([s, s]);
        }
        "range_reversed" => {
            if e < 2 {
                return None;
            }
            let t = rng.range(1, e);
            a.active_expert_range = Some([t, rng.range(0, t - 1)]);
        }
        "range_end_above_E" => {
            a.active_expert_range = Some([rng.range(0, e - 1), e + rng.range(1, 3)]);
        }
        "quant_none_scale_not_N" => {
            if a.quant_mode != -1 {
                return None;
            }
            let len = if n > 0 && rng.chance(0.5) {
                n - 1
            } else {
                n + 1
            };
            c.input.scale = Some(vec![1.0; len]);
        }
        "quant_none_with_offset" => {
            if a.quant_mode != -1 {
                return None;
            }
            c.input.offset = Some(vec![0.0]);
        }
        "static_without_scale"
        | "static_without_offset"
        | "static_scale_not_1"
        | "static_offset_not_1" => {
            a.quant_mode = 0;
            c.input.scale = Some(vec![1.0]);
            c.input.offset = Some(vec![0.0]);
            match m {
                "static_without_scale" => c.input.scale = None,
                "static_without_offset" => c.input.offset = None,
                "static_scale_not_1" => c.input.scale = Some(vec![1.0; rng.pick(&[0, 2, 3])]),
                _ => c.input.offset = Some(vec![0.0; rng.pick(&[0, 2, 3])]),
            }
        }
        "dynamic_smooth_bad_shape" => {
            a.quant_mode = 1;
            c.input.offset = None;
            let (s, t) = a.active_expert_range.map_or((0, e), |[s, t]| (s, t));
            let r = (t - s) as usize;
            let len = rng.pick(&[0, h - 1, h + 1, 2 * h, (r + 1) * h, r * h + 1]);
            if len == h || len == r * h {
                return None;
            }
            c.input.scale = Some(vec![1.0; len]);
        }
        "dynamic_with_offset" => {
            a.quant_mode = 1;
            c.input.scale = None;
            c.input.offset = Some(vec![0.0]);
        }
        "i8_x_static" => {
            a.quant_mode = 0;
            c.input.scale = Some(vec![1.0]);
            c.input.offset = Some(vec![0.0]);
        }
        "i8_x_dynamic" => {
            a.quant_mode = 1;
            c.input.scale = None;
            c.input.offset = None;
        }
        "x_not_N_by_H" => {
            if c.input.x.is_empty() || rng.chance(0.5) {
                c.input.x.push(1.0);
            } else {
                c.input.x.pop();
            }
        }
        "expert_idx_not_N_by_K" => {
            if c.input.expert_idx.is_empty() || rng.chance(0.5) {
                c.input.expert_idx.push(0);
            } else {
                c.input.expert_idx.pop();
            }
        }
        "drop_pad_mode_2" => a.drop_pad_mode = rng.pick(&[2, -1]),
        "quant_mode_2" => a.quant_mode = 2,
        "quant_mode_minus_2" => a.quant_mode = -2,
        "tokens_type_3" => a.expert_tokens_num_type = rng.pick(&[3, -1]),
        "row_idx_type_2" => a.row_idx_type = rng.pick(&[2, -1]),
        _ => unreachable!("{m}"),
    }
    Some(c)
}

#[test]
fn init_routing_invalid_combinations_both_refuse() {
    let mut rng = Rng::new(0x5EED_0002);
    let mut counts = Counts::default();
    for round in 0..120 {
        for &m in MUTATIONS {
            let Some(case) = mutate(&mut rng, m) else {
                continue;
            };
            match check_case(&case) {
                Ok(false) => counts.hit(m),
                Ok(true) => panic!("round {round}, {m}: both accepted: {case:?}"),
                Err(why) => panic!("round {round}, {m}: {why}\n{case:?}"),
            }
        }
    }
    let mins: Vec<(&str, usize)> = MUTATIONS.iter().map(|&m| (m, 30)).collect();
    counts.report("init_routing_invalid_combinations_both_refuse", &mins);
}

#[test]
fn init_routing_attribute_boundaries_accepted() {
    // The largest legal values next to the refused ones above.
    let mut rng = Rng::new(0x5EED_0003);
    let mut counts = Counts::default();
    for _ in 0..40 {
        let mut c = gen_case(&mut rng, Size::Small, Some(DROPLESS), None);
        let (e, t) = rng.pick(&[(10240, 0), (10240, 1), (5120, 2), (6000, 1), (1, 2)]);
        c.attrs.expert_num = e;
        c.attrs.expert_tokens_num_type = t;
        c.attrs.expert_tokens_num_flag = true;
        c.attrs.active_expert_range = None;
        if let Some(s) = &c.input.scale {
            if c.attrs.quant_mode == 1 && s.len() != c.input.h {
                c.input.scale = None;
            }
        }
        match check_case(&c) {
            Ok(true) => counts.hit("expert_num_boundary"),
            Ok(false) => panic!("both refused a legal case: {c:?}"),
            Err(why) => panic!("{why}\n{c:?}"),
        }
    }
    counts.report(
        "init_routing_attribute_boundaries_accepted",
        &[("expert_num_boundary", 40)],
    );
}

/// The spec's drop/pad rules ("Drop/pad requires range = [0, E), row_idx_type 0, and count
/// type") do not mention `active_num`, and the drop/pad output (`[E, C, H]`, routes past
/// capacity dropped) is defined without it, so drop/pad with `active_num > 0` is legal and
/// `active_num` has no effect there (as `expert_capacity` has none outside drop/pad).
#[test]
fn drop_pad_with_positive_active_num() {
    let mut rng = Rng::new(0x5EED_000A);
    let mut counts = Counts::default();
    for case_no in 0..2000 {
        let mut c = gen_case(&mut rng, Size::Small, Some(DROP_PAD), None);
        c.attrs.active_num = rng.range(1, (c.input.n * c.input.k) as i64 + 3);
        if let Err(why) = check_case(&c) {
            panic!("case {case_no}: {why}\n{c:?}");
        }
        counts.hit("drop_pad_with_positive_active_num");
    }
    counts.report(
        "drop_pad_with_positive_active_num",
        &[("drop_pad_with_positive_active_num", 2000)],
    );
}

// ---------------------------------------------------------------------------------------------
// Gating.

/// Weights: |op - ref| <= 4e-6 * |ref| (+ 1e-5 relative where the f64 reference found a near tie
/// that f32 may order differently). The operator works in f32: exp of an argument up to 16 in
/// magnitude (|l - max| for logits in [-8, 8]) carries about 16 * 2^-24 ~ 1e-6 relative error,
/// the normalising sum and the renormalisation a few ulps more.
const W_REL_TOL: f64 = 4e-6;

fn widen<T: FloatElement>(v: &[f32]) -> (Vec<T>, Vec<f32>) {
    let t: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
    let w: Vec<f32> = t.iter().map(|x| x.to_f32()).collect();
    (t, w)
}

/// A gating logit: a style per case: fine grid (exact ties), coarse grid (many ties), continuous,
/// plus -inf entries. `offset` shifts the grid (0.1 for the grouped op: no x / -x pairs on the
/// grid, so sigmoid(x) + sigmoid(-x) = 1 coincidences, exact only in exact arithmetic, never occur).
fn gen_logit(rng: &mut Rng, style: u64, offset: f32) -> f32 {
    if rng.chance(0.12) {
        return f32::NEG_INFINITY;
    }
    match style {
        0 => rng.range(-32, 32) as f32 * 0.25 + offset,
        1 => rng.range(-2, 2) as f32 + offset,
        2 => ((rng.unit() * 2.0 - 1.0) * 8.0) as f32,
        _ => {
            if rng.chance(0.5) {
                rng.range(-32, 32) as f32 * 0.25 + offset
            } else {
                ((rng.unit() * 2.0 - 1.0) * 8.0) as f32
            }
        }
    }
}

fn gen_logits(rng: &mut Rng, n: usize, e: usize, offset: f32) -> Vec<f32> {
    let style = rng.below(4);
    let mut l: Vec<f32> = (0..n * e).map(|_| gen_logit(rng, style, offset)).collect();
    // every row keeps a finite logit (a row of only -inf has no softmax)
    for i in 0..n {
        if l[i * e..(i + 1) * e]
            .iter()
            .all(|&v| v == f32::NEG_INFINITY)
        {
            l[i * e + rng.below(e as u64) as usize] = rng.range(-8, 8) as f32 + offset;
        }
    }
    l
}

fn has_equal_logits(l: &[f32], e: usize) -> bool {
    l.chunks(e.max(1)).any(|row| {
        (0..row.len())
            .any(|a| (a + 1..row.len()).any(|b| row[a] == row[b] && row[a] != f32::NEG_INFINITY))
    })
}

/// Compares a gating result; returns whether the ids were comparable (no near tie).
///
/// Without a near tie: ids exactly, weights position by position within [`W_REL_TOL`]. With one
/// (the reference saw two different scores within 2e-6 relative, which the operator's f32 may
/// order either way): rows that chose the same set of experts compare each expert's weight by id
/// (1e-5 relative: the near-tied scores enter the weights); rows whose set differs (a swap at the
/// k-th place changes the renormalisation) are not compared.
fn compare_gating(op: &GatingOutput, r: &RefGating, k: usize, ctx: &dyn Fn() -> String) -> bool {
    assert_eq!(
        op.weights.len(),
        r.weights.len(),
        "weights length; {}",
        ctx()
    );
    assert_eq!(
        op.expert_idx.len(),
        r.expert_idx.len(),
        "ids length; {}",
        ctx()
    );
    let close = |w: f32, rw: f64, tol: f64| (w as f64 - rw).abs() <= tol * rw.abs();
    if !r.near_tie {
        assert_eq!(op.expert_idx, r.expert_idx, "expert ids; {}", ctx());
        for (t, (&w, &rw)) in op.weights.iter().zip(&r.weights).enumerate() {
            assert!(
                close(w, rw, W_REL_TOL),
                "weight {t}: op {w} ref {rw}; op {:?} ref {:?}; {}",
                op.weights,
                r.weights,
                ctx()
            );
        }
        return true;
    }
    for row in 0..op.expert_idx.len() / k.max(1) {
        let span = row * k..(row + 1) * k;
        let (oi, ri) = (&op.expert_idx[span.clone()], &r.expert_idx[span.clone()]);
        let (mut os, mut rs) = (oi.to_vec(), ri.to_vec());
        os.sort();
        rs.sort();
        if os != rs {
            continue;
        }
        for t in 0..k {
            // finished rows repeat id E: match them by position
            let u = if oi[t] == ri[t] {
                t
            } else {
                ri.iter().position(|&x| x == oi[t]).unwrap()
            };
            let (w, rw) = (op.weights[row * k + t], r.weights[row * k + u]);
            assert!(
                close(w, rw, 1e-5),
                "row {row} expert {}: op {w} ref {rw}; {}",
                oi[t],
                ctx()
            );
        }
    }
    false
}

#[test]
fn gating_top_k_softmax_random_matches_reference() {
    let mut rng = Rng::new(0x5EED_0004);
    let mut counts = Counts::default();
    for case_no in 0..20_000 {
        let dtype = rng.below(3);
        let n = rng.urange(0, 8);
        let e = rng.urange(1, 12);
        let k = rng.urange(1, e);
        let renorm = rng.chance(0.5);
        let finished: Option<Vec<bool>> = rng
            .chance(0.3)
            .then(|| (0..n).map(|_| rng.chance(0.4)).collect());
        let logits = gen_logits(&mut rng, n, e, 0.0);
        fn go<T: FloatElement>(
            l: &[f32],
            e: usize,
            k: usize,
            renorm: bool,
            fin: Option<&[bool]>,
        ) -> (Result<GatingOutput, MoeError>, Vec<f32>) {
            let (t, w) = widen::<T>(l);
            (moe_gating_top_k_softmax(&t, e, k, renorm, fin), w)
        }
        let (op, wl) = match dtype {
            0 => go::<f32>(&logits, e, k, renorm, finished.as_deref()),
            1 => go::<f16>(&logits, e, k, renorm, finished.as_deref()),
            _ => go::<bf16>(&logits, e, k, renorm, finished.as_deref()),
        };
        let r = reference::gating_top_k_softmax(&wl, e, k, renorm, finished.as_deref());
        let ctx = || {
            format!(
                "case {case_no}: logits {wl:?} E {e} k {k} renorm {renorm} finished {finished:?}"
            )
        };
        let (op, r) = match (op, r) {
            (Ok(op), Ok(r)) => (op, r),
            (op, r) => panic!(
                "acceptance differs: op {:?} ref {:?}; {}",
                op.err(),
                r.err(),
                ctx()
            ),
        };
        assert_eq!(op.k, k);
        if !compare_gating(&op, &r, op.k, &ctx) {
            counts.hit("ids_skipped_near_tie");
        }
        counts.hit(["logits_f32", "logits_f16", "logits_bf16"][dtype as usize]);
        counts.hit(if renorm { "renorm_on" } else { "renorm_off" });
        if finished.as_ref().is_some_and(|f| f.contains(&true)) {
            counts.hit("with_finished_rows");
        }
        if wl.contains(&f32::NEG_INFINITY) {
            counts.hit("with_neg_inf");
        }
        if has_equal_logits(&wl, e) {
            counts.hit("with_exact_ties");
        }
        if k == e {
            counts.hit("k_equals_E");
        }
        counts.hit("all");
    }
    counts.report(
        "gating_top_k_softmax_random_matches_reference",
        &[
            ("logits_f32", 4000),
            ("logits_f16", 4000),
            ("logits_bf16", 4000),
            ("renorm_on", 6000),
            ("renorm_off", 6000),
            ("with_finished_rows", 2000),
            ("with_neg_inf", 6000),
            ("with_exact_ties", 4000),
            ("k_equals_E", 600),
        ],
    );
    assert!(counts.get("ids_skipped_near_tie") * 100 <= counts.get("all"));
}

#[test]
fn gating_top_k_softmax_invalid_both_refuse() {
    let mut rng = Rng::new(0x5EED_0005);
    let mut counts = Counts::default();
    let kinds = [
        "e_0",
        "k_0",
        "k_above_E",
        "nan",
        "pos_inf",
        "all_neg_inf",
        "finished_len",
        "ragged",
    ];
    for _ in 0..40 {
        for &kind in &kinds {
            let n = rng.urange(1, 5);
            let mut e = rng.urange(1, 8);
            let mut k = rng.urange(1, e);
            let renorm = rng.chance(0.5);
            let mut l = gen_logits(&mut rng, n, e, 0.0);
            let mut fin: Option<Vec<bool>> = None;
            let p = rng.urange(0, l.len() - 1);
            match kind {
                "e_0" => {
                    e = 0;
                    l.clear();
                }
                "k_0" => k = 0,
                "k_above_E" => k = e + rng.urange(1, 3),
                "nan" => l[p] = f32::NAN,
                "pos_inf" => l[p] = f32::INFINITY,
                "all_neg_inf" => {
                    let i = p / e;
                    l[i * e..(i + 1) * e].fill(f32::NEG_INFINITY);
                }
                "finished_len" => fin = Some(vec![false; n + rng.urange(1, 2)]),
                _ => {
                    if e == 1 {
                        e = 2;
                        k = 1;
                        l.truncate(l.len() / 2 * 2);
                    }
                    l.push(0.0);
                }
            }
            let r = reference::gating_top_k_softmax(&l, e, k, renorm, fin.as_deref());
            let op = moe_gating_top_k_softmax(&l, e, k, renorm, fin.as_deref());
            assert!(
                r.is_err(),
                "{kind}: the reference accepts {l:?} e {e} k {k}"
            );
            assert!(
                op.is_err(),
                "{kind}: the operator accepts {l:?} e {e} k {k}"
            );
            counts.hit(kind);
        }
    }
    let mins: Vec<(&str, usize)> = kinds.iter().map(|&k| (k, 40)).collect();
    counts.report("gating_top_k_softmax_invalid_both_refuse", &mins);
}

fn op_params(p: &RefGroupedParams) -> GroupedTopKParams {
    GroupedTopKParams {
        k: p.k,
        k_group: p.k_group,
        group_count: p.group_count,
        group_select_mode: if p.top2_sum {
            GroupSelectMode::Top2Sum
        } else {
            GroupSelectMode::Max
        },
        renorm: p.renorm,
        norm_type: if p.sigmoid {
            NormType::Sigmoid
        } else {
            NormType::Softmax
        },
        routed_scaling_factor: p.routed_scaling_factor as f32,
        eps: p.eps as f32,
    }
}

fn gen_grouped(rng: &mut Rng) -> (usize, usize, RefGroupedParams, Option<Vec<f32>>) {
    let g = rng.urange(1, 4);
    let gsize = rng.urange(1, 4);
    let e = g * gsize;
    let n = rng.urange(0, 6);
    let top2 = gsize >= 2 && rng.chance(0.6);
    let k_group = if g == 1 { 1 } else { rng.urange(1, g) };
    let k = rng.urange(1, k_group * gsize);
    let p = RefGroupedParams {
        k,
        k_group,
        group_count: g,
        top2_sum: top2,
        renorm: rng.chance(0.5),
        sigmoid: rng.chance(0.5),
        routed_scaling_factor: rng.pick(&[1.0, 2.5, 0.5, 1.75]),
        // the spec's 1e-20, and a larger one (eps 0 would make 0 / 0 of a row of zero weights)
        eps: if rng.chance(0.8) { 1e-20 } else { 1e-6 },
    };
    // bias on a 1/16 grid from a few values (equal biases keep exact ties)
    let bias = rng.chance(0.5).then(|| {
        let few = rng.chance(0.5);
        (0..e)
            .map(|_| {
                if few {
                    rng.pick(&[0.0, 0.125, -0.25])
                } else {
                    rng.range(-16, 16) as f32 / 16.0
                }
            })
            .collect()
    });
    (n, e, p, bias)
}

#[test]
fn gating_top_k_grouped_random_matches_reference() {
    let mut rng = Rng::new(0x5EED_0006);
    let mut counts = Counts::default();
    for case_no in 0..20_000 {
        let dtype = rng.below(3);
        let (n, e, p, bias) = gen_grouped(&mut rng);
        let logits = gen_logits(&mut rng, n, e, 0.1);
        let params = op_params(&p);
        fn go<T: FloatElement>(
            l: &[f32],
            e: usize,
            bias: Option<&[f32]>,
            params: &GroupedTopKParams,
        ) -> (Result<GatingOutput, MoeError>, Vec<f32>) {
            let (t, w) = widen::<T>(l);
            (moe_gating_top_k(&t, e, bias, params), w)
        }
        let (op, wl) = match dtype {
            0 => go::<f32>(&logits, e, bias.as_deref(), &params),
            1 => go::<f16>(&logits, e, bias.as_deref(), &params),
            _ => go::<bf16>(&logits, e, bias.as_deref(), &params),
        };
        let r = reference::gating_top_k_grouped(&wl, e, bias.as_deref(), &p);
        let ctx = || format!("case {case_no}: logits {wl:?} E {e} bias {bias:?} {p:?}");
        let (op, r) = match (op, r) {
            (Ok(op), Ok(r)) => (op, r),
            (op, r) => panic!(
                "acceptance differs: op {:?} ref {:?}; {}",
                op.err(),
                r.err(),
                ctx()
            ),
        };
        if !compare_gating(&op, &r, op.k, &ctx) {
            counts.hit("ids_skipped_near_tie");
        }
        counts.hit(["logits_f32", "logits_f16", "logits_bf16"][dtype as usize]);
        counts.hit(if p.sigmoid { "sigmoid" } else { "softmax" });
        counts.hit(if bias.is_some() { "bias" } else { "no_bias" });
        counts.hit(if p.group_count == 1 {
            "group_count_1"
        } else if p.k_group < p.group_count {
            "groups_masked"
        } else {
            "groups_all_kept"
        });
        if p.group_count > 1 {
            counts.hit(if p.top2_sum {
                "group_top2_sum"
            } else {
                "group_max"
            });
        }
        counts.hit(if p.renorm { "renorm_on" } else { "renorm_off" });
        if p.routed_scaling_factor != 1.0 {
            counts.hit("routed_scaling_factor_not_1");
        }
        if has_equal_logits(&wl, e) {
            counts.hit("with_exact_ties");
        }
        if wl.contains(&f32::NEG_INFINITY) {
            counts.hit("with_neg_inf");
        }
        counts.hit("all");
    }
    counts.report(
        "gating_top_k_grouped_random_matches_reference",
        &[
            ("logits_f32", 4000),
            ("logits_f16", 4000),
            ("logits_bf16", 4000),
            ("sigmoid", 6000),
            ("softmax", 6000),
            ("bias", 6000),
            ("no_bias", 6000),
            ("group_count_1", 2000),
            ("groups_masked", 4000),
            ("group_top2_sum", 3000),
            ("group_max", 3000),
            ("renorm_on", 6000),
            ("renorm_off", 6000),
            ("routed_scaling_factor_not_1", 6000),
            ("with_exact_ties", 4000),
            ("with_neg_inf", 4000),
        ],
    );
    assert!(counts.get("ids_skipped_near_tie") * 100 <= counts.get("all"));
}

#[test]
fn gating_top_k_grouped_invalid_both_refuse() {
    let mut rng = Rng::new(0x5EED_0007);
    let mut counts = Counts::default();
    let kinds = [
        "e_0",
        "group_count_0",
        "group_count_not_dividing",
        "k_group_0",
        "k_group_above_groups",
        "k_0",
        "k_above_kept",
        "top2_groups_of_1",
        "bias_len",
        "nan",
        "pos_inf",
        "softmax_all_neg_inf",
    ];
    for _ in 0..40 {
        for &kind in &kinds {
            let (mut n, mut e, mut p, mut bias) = gen_grouped(&mut rng);
            if n == 0 {
                n = 1;
            }
            let mut l = gen_logits(&mut rng, n, e, 0.1);
            let pos = rng.urange(0, l.len() - 1);
            match kind {
                "e_0" => {
                    e = 0;
                    l.clear();
                    bias = None;
                }
                "group_count_0" => p.group_count = 0,
                "group_count_not_dividing" => {
                    if e == 1 {
                        p.group_count = 2;
                    } else {
                        p.group_count = (2..=e + 1).find(|g| e % g != 0).unwrap();
                    }
                    p.k_group = 1;
                    p.k = 1;
                }
                "k_group_0" => p.k_group = 0,
                "k_group_above_groups" => p.k_group = p.group_count + 1,
                "k_0" => p.k = 0,
                "k_above_kept" => p.k = p.k_group * (e / p.group_count) + 1,
                "top2_groups_of_1" => {
                    p.group_count = e;
                    p.k_group = 1;
                    p.k = 1;
                    p.top2_sum = true;
                }
                "bias_len" => bias = Some(vec![0.0; e + rng.urange(1, 2)]),
                "nan" => l[pos] = f32::NAN,
                "pos_inf" => l[pos] = f32::INFINITY,
                _ => {
                    p.sigmoid = false;
                    let i = pos / e;
                    l[i * e..(i + 1) * e].fill(f32::NEG_INFINITY);
                }
            }
            let r = reference::gating_top_k_grouped(&l, e, bias.as_deref(), &p);
            let op = moe_gating_top_k(&l, e, bias.as_deref(), &op_params(&p));
            assert!(r.is_err(), "{kind}: the reference accepts E {e} {p:?}");
            assert!(op.is_err(), "{kind}: the operator accepts E {e} {p:?}");
            counts.hit(kind);
        }
    }
    let mins: Vec<(&str, usize)> = kinds.iter().map(|&k| (k, 40)).collect();
    counts.report("gating_top_k_grouped_invalid_both_refuse", &mins);
}

// ---------------------------------------------------------------------------------------------
// Unpermute / finalize.

/// A random routing from an actual `moe_init_routing` call (dropless, active or drop/pad), or
/// hand-made indices. Returns (expanded_row_idx, expert ids, R rows of expert_out, valid_rows).
fn gen_routing(
    rng: &mut Rng,
    n: usize,
    k: usize,
    e: i64,
    source: u64,
) -> (Vec<i32>, Vec<i32>, usize, usize) {
    if source == 3 {
        // hand-made: indices in -1..R+2, any valid_rows <= R; ids in [0, E)
        let r = rng.urange(0, 2 * n * k + 2);
        let valid = rng.urange(0, r);
        let idx = (0..n * k)
            .map(|_| rng.range(-1, r as i64 + 2) as i32)
            .collect();
        let ids = (0..n * k).map(|_| rng.range(0, e - 1) as i32).collect();
        return (idx, ids, r, valid);
    }
    let ids: Vec<i32> = (0..n * k).map(|_| gen_id(rng, e)).collect();
    let mut a = MoeInitRoutingAttrs::new(e);
    match source {
        0 => {}
        1 => a.active_num = rng.range(1, (n * k) as i64 + 2),
        _ => {
            a.drop_pad_mode = DropPadMode::DropPad;
            a.expert_tokens_num_type = ExpertTokensNumType::Count;
            a.expert_capacity = rng.range(1, n as i64);
        }
    }
    if source != 2 && rng.chance(0.4) {
        let s = rng.range(0, e - 1);
        a.active_expert_range = Some([s, rng.range(s + 1, e)]);
    }
    let x = vec![0f32; n];
    let out = moe_init_routing(
        &MoeInitRoutingInput {
            x: &x,
            num_rows: n,
            hidden_size: 1,
            expert_idx: &ids,
            k,
            scale: None,
            offset: None,
        },
        &a,
    )
    .expect("a legal routing");
    let rows = out.expanded_x_shape[..out.expanded_x_shape.len() - 1]
        .iter()
        .product();
    (out.expanded_row_idx, ids, rows, out.valid_rows)
}

/// Half an ulp of `T` relative to the value (the final rounding to `T`).
fn half_ulp_rel(dtype: u64) -> f64 {
    match dtype {
        0 => 0.0,
        1 => 2f64.powi(-11),
        _ => 2f64.powi(-8),
    }
}

#[derive(Clone, Debug)]
struct FinCase {
    dtype: u64,
    h: usize,
    k: usize,
    valid_rows: usize,
    expert_out: Vec<f32>,
    idx: Vec<i32>,
    weights: Option<Vec<f32>>,
    expert_idx: Option<Vec<i32>>,
    skip1: Option<Vec<f32>>,
    skip2: Option<Vec<f32>>,
    bias: Option<Vec<f32>>,
    /// Call `moe_token_unpermute` (no skips, bias or ids) instead of `moe_finalize_routing`.
    unpermute: bool,
}

fn run_fin<T: FloatElement>(c: &FinCase) -> (Result<Vec<f32>, MoeError>, Vec<Vec<f32>>) {
    let (eo, eow) = widen::<T>(&c.expert_out);
    let conv = |v: &Option<Vec<f32>>| v.as_ref().map(|v| widen::<T>(v));
    let (s1, s2, b) = (conv(&c.skip1), conv(&c.skip2), conv(&c.bias));
    let res = if c.unpermute {
        moe_token_unpermute(&eo, c.h, &c.idx, c.weights.as_deref(), c.k, c.valid_rows)
    } else {
        moe_finalize_routing(&FinalizeRoutingInput {
            expert_out: &eo,
            hidden_size: c.h,
            valid_rows: c.valid_rows,
            expanded_row_idx: &c.idx,
            k: c.k,
            weights: c.weights.as_deref(),
            expert_idx: c.expert_idx.as_deref(),
            skip1: s1.as_ref().map(|v| &v.0[..]),
            skip2: s2.as_ref().map(|v| &v.0[..]),
            bias: b.as_ref().map(|v| &v.0[..]),
        })
    };
    let wid = |v: Option<(Vec<T>, Vec<f32>)>| v.map_or(Vec::new(), |v| v.1);
    (
        res.map(|o| o.iter().map(|v| v.to_f32()).collect()),
        vec![eow, wid(s1), wid(s2), wid(b)],
    )
}

/// Runs both; `Ok(true)` both accepted and agree, `Ok(false)` both refused.
fn check_fin(c: &FinCase) -> Result<bool, String> {
    let (op, w) = match c.dtype {
        0 => run_fin::<f32>(c),
        1 => run_fin::<f16>(c),
        _ => run_fin::<bf16>(c),
    };
    let opt = |v: &Option<Vec<f32>>, i: usize| v.as_ref().map(|_| &w[i][..]);
    let rf = reference::RefFinalize {
        expert_out: &w[0],
        h: c.h,
        valid_rows: c.valid_rows,
        expanded_row_idx: &c.idx,
        k: c.k,
        weights: c.weights.as_deref(),
        expert_idx: if c.unpermute {
            None
        } else {
            c.expert_idx.as_deref()
        },
        skip1: if c.unpermute { None } else { opt(&c.skip1, 1) },
        skip2: if c.unpermute { None } else { opt(&c.skip2, 2) },
        bias: if c.unpermute { None } else { opt(&c.bias, 3) },
    };
    let r = reference::finalize(&rf);
    match (op, r) {
        (Ok(op), Ok((r, mag))) => {
            if op.len() != r.len() {
                return Err(format!("out length: op {} ref {}", op.len(), r.len()));
            }
            for t in 0..op.len() {
                // f32 accumulation of a few terms: 1e-5 * (sum |terms| + 1); then one rounding
                // to T: half an ulp of T relative to the value.
                let tol = 1e-5 * (mag[t] + 1.0) + half_ulp_rel(c.dtype) * r[t].abs() * 1.0001;
                if (op[t] as f64 - r[t]).abs() > tol {
                    return Err(format!(
                        "out[{t}]: op {} ref {} (tol {tol}); op {op:?} ref {r:?}",
                        op[t], r[t]
                    ));
                }
            }
            Ok(true)
        }
        (Err(_), Err(_)) => Ok(false),
        (Ok(_), Err(why)) => Err(format!("reference refuses ({why}), operator accepts")),
        (Err(e), Ok(_)) => Err(format!("operator refuses ({e}), reference accepts")),
    }
}

fn gen_fin(rng: &mut Rng) -> (FinCase, u64) {
    let dtype = rng.below(3);
    let source = rng.below(4);
    let n = if source == 2 {
        rng.urange(1, 10)
    } else {
        rng.urange(0, 10)
    };
    let k = rng.urange(1, 4);
    let h = rng.urange(1, 6);
    let e = rng.range(1, 8);
    let (idx, ids, rows, valid) = gen_routing(rng, n, k, e, source);
    let val = |rng: &mut Rng| ((rng.unit() * 2.0 - 1.0) * 10.0) as f32;
    let expert_out = (0..rows * h).map(|_| val(rng)).collect();
    let weights = rng.chance(0.8).then(|| {
        (0..n * k)
            .map(|_| (rng.unit() * 3.0 - 1.0) as f32)
            .collect()
    });
    let unpermute = rng.chance(0.4);
    let skip1 = rng
        .chance(0.5)
        .then(|| (0..n * h).map(|_| val(rng)).collect());
    let skip2 = rng
        .chance(0.5)
        .then(|| (0..n * h).map(|_| val(rng)).collect());
    let bias: Option<Vec<f32>> = rng
        .chance(0.5)
        .then(|| (0..e as usize * h).map(|_| val(rng)).collect());
    let expert_idx = (bias.is_some() || rng.chance(0.3)).then_some(ids);
    (
        FinCase {
            dtype,
            h,
            k,
            valid_rows: valid,
            expert_out,
            idx,
            weights,
            expert_idx,
            skip1,
            skip2,
            bias,
            unpermute,
        },
        source,
    )
}

#[test]
fn unpermute_and_finalize_random_match_reference() {
    let mut rng = Rng::new(0x5EED_0008);
    let mut counts = Counts::default();
    for case_no in 0..20_000 {
        let (c, source) = gen_fin(&mut rng);
        match check_fin(&c) {
            Ok(true) => {}
            Ok(false) => panic!("case {case_no}: both refused a legal case: {c:?}"),
            Err(why) => panic!("case {case_no}: {why}\n{c:?}"),
        }
        counts.hit(
            [
                "route_dropless",
                "route_active",
                "route_drop_pad",
                "route_hand_made",
            ][source as usize],
        );
        counts.hit(["out_f32", "out_f16", "out_bf16"][c.dtype as usize]);
        if c.unpermute {
            counts.hit("unpermute");
        } else {
            counts.hit("finalize");
            if c.skip1.is_some() && c.skip2.is_some() {
                counts.hit("finalize_two_skips");
            }
            if c.bias.is_some() {
                counts.hit("finalize_bias");
            }
        }
        if c.weights.is_none() {
            counts.hit("weights_none");
        }
        if c.idx.iter().any(|&i| i >= 0 && i as usize >= c.valid_rows) {
            counts.hit("index_at_or_past_valid_rows");
        }
        if c.idx.contains(&-1) {
            counts.hit("index_minus_1");
        }
    }
    counts.report(
        "unpermute_and_finalize_random_match_reference",
        &[
            ("route_dropless", 3000),
            ("route_active", 3000),
            ("route_drop_pad", 3000),
            ("route_hand_made", 3000),
            ("out_f32", 4000),
            ("out_f16", 4000),
            ("out_bf16", 4000),
            ("unpermute", 5000),
            ("finalize", 8000),
            ("finalize_two_skips", 1600),
            ("finalize_bias", 3000),
            ("weights_none", 2000),
            ("index_at_or_past_valid_rows", 3000),
            ("index_minus_1", 4000),
        ],
    );
}

#[test]
fn unpermute_and_finalize_invalid_both_refuse() {
    let mut rng = Rng::new(0x5EED_0009);
    let mut counts = Counts::default();
    let kinds = [
        "index_below_minus_1",
        "valid_rows_above_R",
        "weights_len",
        "skip1_len",
        "skip2_len",
        "bias_without_expert_idx",
        "bias_not_E_by_H",
        "expert_idx_len",
        "placed_id_outside_bias",
        "expert_out_not_R_by_H",
        "row_idx_not_N_by_K",
    ];
    let mut tries = 0;
    while kinds.iter().any(|k| counts.get(k) < 40) {
        tries += 1;
        assert!(tries < 100_000, "mutations do not apply");
        let kind = kinds[rng.below(kinds.len() as u64) as usize];
        let (mut c, _) = gen_fin(&mut rng);
        let (n, h) = (c.idx.len() / c.k, c.h);
        c.unpermute = false;
        match kind {
            "index_below_minus_1" => {
                if c.idx.is_empty() {
                    continue;
                }
                let p = rng.urange(0, c.idx.len() - 1);
                c.idx[p] = rng.pick(&[-2, -5, i32::MIN]);
            }
            "valid_rows_above_R" => c.valid_rows = c.expert_out.len() / h + rng.urange(1, 3),
            "weights_len" => c.weights = Some(vec![1.0; n * c.k + rng.urange(1, 2)]),
            "skip1_len" => c.skip1 = Some(vec![0.0; n * h + 1]),
            "skip2_len" => c.skip2 = Some(vec![0.0; n * h + h]),
            "bias_without_expert_idx" => {
                c.bias = Some(vec![0.0; h * rng.urange(1, 3)]);
                c.expert_idx = None;
            }
            "bias_not_E_by_H" => {
                if h == 1 {
                    continue;
                }
                c.bias = Some(vec![0.0; h * rng.urange(0, 2) + rng.urange(1, h - 1)]);
                c.expert_idx = Some(vec![0; n * c.k]);
            }
            "expert_idx_len" => c.expert_idx = Some(vec![0; n * c.k + 1]),
            "placed_id_outside_bias" => {
                let placed: Vec<usize> = (0..c.idx.len())
                    .filter(|&j| c.idx[j] >= 0 && (c.idx[j] as usize) < c.valid_rows)
                    .collect();
                if placed.is_empty() {
                    continue;
                }
                let eb = rng.urange(1, 3);
                c.bias = Some(vec![0.0; eb * h]);
                let mut ids: Vec<i32> = vec![0; c.idx.len()];
                ids[placed[rng.urange(0, placed.len() - 1)]] = rng.pick(&[-1, eb as i32, 99]);
                c.expert_idx = Some(ids);
            }
            "expert_out_not_R_by_H" => {
                if h == 1 {
                    continue;
                }
                c.expert_out.push(0.0);
            }
            _ => {
                if c.k == 1 {
                    continue;
                }
                c.idx.push(-1);
            }
        }
        match check_fin(&c) {
            Ok(false) => counts.hit(kind),
            Ok(true) => panic!("{kind}: both accepted: {c:?}"),
            Err(why) => panic!("{kind}: {why}\n{c:?}"),
        }
    }
    let mins: Vec<(&str, usize)> = kinds.iter().map(|&k| (k, 40)).collect();
    counts.report("unpermute_and_finalize_invalid_both_refuse", &mins);
}
