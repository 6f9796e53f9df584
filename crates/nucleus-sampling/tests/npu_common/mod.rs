//! The literal oracle of spec/npu_top_k_top_p_sample.md, written from the spec alone: a stable
//! descending sort of the whole row, the softmax, the cumulative sum and the stage rules, one
//! token at a time. Slow and obvious.
//!
//! Two choices, both the contract's (the crate docs of `nucleus_sampling::npu`, "Arithmetic"):
//! - the softmax numerators are `nucleus_sampling::npu::exp_weight` (the contract's f32 exp; it
//!   is checked against f64 `exp` in `npu_worked_cases.rs`), or the values themselves for
//!   probability input;
//! - the top-p rule `cumsum_i - p_i > top_p` is evaluated in exact rational arithmetic: with
//!   `p_i = w_i / Z`, it is `S_i > top_p * Z` (`S_i` the weight before rank `i`), compared
//!   here with big integers. A literal f64 cumsum can misjudge an exact tie (six tied maxima
//!   with `top_p` 0.5: `6 * (1/6)` rounds), where the spec's mathematics is unambiguous.
//!
//! Each test binary uses a different part of it, hence `allow(dead_code)`.

#![allow(dead_code)]

use std::cmp::Ordering;

use nucleus_sampling::npu::exp_weight;

/// What one row's oracle says.
#[derive(Clone, Debug, PartialEq)]
pub struct OracleRow {
    /// The chosen token id.
    pub chosen: u32,
    /// Token ids that survive all stages, in rank order.
    pub survivors: Vec<u32>,
    /// The survivors' weights (the renormalised distribution's numerators), in rank order.
    pub weights: Vec<f32>,
}

/// The row error kinds, by name (`TopKTopPRowError` variants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OracleError {
    NonFiniteLogits,
    InvalidProbability,
    NoCandidates,
    InvalidTopP,
    InvalidMinP,
    InvalidQ,
}

/// One row's inputs, every value already as f32 (f16 / bf16 widened).
#[derive(Clone, Debug)]
pub struct RowCase {
    pub values: Vec<f32>,
    pub input_is_logits: bool,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: Option<f32>,
    pub q: Option<Vec<f32>>,
}

/// The call's attributes.
#[derive(Clone, Copy, Debug)]
pub struct Attrs {
    pub eps: f64,
    pub ks_max: i64,
    pub q_by_rank: bool,
}

impl Default for Attrs {
    fn default() -> Self {
        Self {
            eps: 1e-8,
            ks_max: 1024,
            q_by_rank: false,
        }
    }
}

/// The spec, stage by stage.
pub fn oracle(row: &RowCase, attrs: &Attrs) -> Result<OracleRow, OracleError> {
    let x = &row.values;
    let v = x.len();
    // Checks, in the operator's documented order.
    if row.input_is_logits {
        if x.iter().any(|&l| l.is_nan() || l == f32::INFINITY) {
            return Err(OracleError::NonFiniteLogits);
        }
    } else if x.iter().any(|&p| !(p.is_finite() && p >= 0.0)) {
        return Err(OracleError::InvalidProbability);
    }
    if row.top_p.is_nan() {
        return Err(OracleError::InvalidTopP);
    }
    if row.min_p.is_some_and(|m| m.is_nan()) {
        return Err(OracleError::InvalidMinP);
    }

    // The stable descending sort of the row (ties keep the lower id first).
    let mut order: Vec<usize> = (0..v).collect();
    order.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap_or(Ordering::Equal));
    let max = x[order[0]];
    if (row.input_is_logits && max == f32::NEG_INFINITY) || (!row.input_is_logits && max <= 0.0) {
        return Err(OracleError::NoCandidates);
    }
    // Softmax numerators.
    let w: Vec<f32> = x
        .iter()
        .map(|&l| {
            if row.input_is_logits {
                exp_weight(l, max)
            } else {
                l
            }
        })
        .collect();

    // Stage 1: top-k.
    let ks = attrs.ks_max.min(1024);
    let k = row.top_k;
    let mut kept: Vec<usize> = if k >= 1 && i64::from(k) <= (v as i64).min(ks) {
        order[..k as usize].to_vec()
    } else {
        order.clone()
    };

    // Stage 2: top-p on the stage-1 distribution.
    let p = row.top_p;
    if p <= 0.0 {
        kept.truncate(1);
    } else if p < 1.0 {
        let z = Big::sum(kept.iter().map(|&i| w[i]));
        let target = z.mul_f32(p); // top_p * Z, scaled by 2^SHIFT (exact)
        let mut before = Big::zero();
        let mut survivors = Vec::new();
        for &i in &kept {
            // Remove i when (cumsum_i - p_i) > top_p, i.e. S_before > top_p * Z.
            if before.shifted().cmp(&target) != Ordering::Greater {
                survivors.push(i);
            }
            before = before.add(&Big::from_f32(w[i]));
        }
        kept = survivors;
    }

    // Stage 3: min-p on the distribution after top-p.
    if let Some(m) = row.min_p {
        if m >= 1.0 {
            kept.truncate(1);
        } else if m > 0.0 {
            let p_max = kept.iter().map(|&i| w[i]).fold(0.0f32, f32::max);
            let threshold = f64::from(m) * f64::from(p_max); // exact: two f32 factors
            kept.retain(|&i| f64::from(w[i]) >= threshold);
        }
    }
    assert!(!kept.is_empty(), "the oracle lost every token");

    // Stage 4: sample. The q entries read (the survivors', by id or rank) must be >= 0.
    let q_index = |i: usize| {
        if attrs.q_by_rank {
            order.iter().position(|&o| o == i).unwrap()
        } else {
            i
        }
    };
    if let Some(q) = &row.q {
        if kept
            .iter()
            .any(|&i| q[q_index(i)].is_nan() || q[q_index(i)] < 0.0)
        {
            return Err(OracleError::InvalidQ);
        }
    }
    let chosen = match &row.q {
        None => {
            // argmax of probs, ties to the lower index.
            let mut best = kept[0];
            for &i in &kept {
                if w[i] > w[best] || (w[i] == w[best] && i < best) {
                    best = i;
                }
            }
            best
        }
        Some(q) => {
            // probs / (q + eps), times the common factor Z; ties to the first in sorted order.
            let mut best: Option<(f64, usize)> = None;
            for &i in &kept {
                let j = q_index(i);
                let s = if w[i] == 0.0 {
                    0.0
                } else {
                    f64::from(w[i]) / (f64::from(q[j]) + attrs.eps)
                };
                if best.is_none_or(|(bs, _)| s > bs) {
                    best = Some((s, i));
                }
            }
            best.unwrap().1
        }
    };
    Ok(OracleRow {
        chosen: chosen as u32,
        survivors: kept.iter().map(|&i| i as u32).collect(),
        weights: kept.iter().map(|&i| w[i]).collect(),
    })
}

/// `logits_top_kp_select` for a row: the value where the token survived, else the fill.
pub fn select_row(row: &RowCase, survivors: &[u32]) -> Vec<f32> {
    let fill = if row.input_is_logits {
        f32::NEG_INFINITY
    } else {
        0.0
    };
    let mut out = vec![fill; row.values.len()];
    for &i in survivors {
        out[i as usize] = row.values[i as usize];
    }
    out
}

/// A non-negative big integer, little-endian u32 limbs: f32 values in units of 2^-149, and
/// products with `top_p` scaled by 2^SHIFT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Big(Vec<u32>);

/// `top_p` (an f32 below 1) is `m * 2^-s` with `s <= 173`; products are compared at scale
/// 2^SHIFT.
const SHIFT: u32 = 200;

impl Big {
    pub fn zero() -> Self {
        Big(vec![0; 16])
    }

    /// `f` (finite, >= 0) in units of 2^-149.
    pub fn from_f32(f: f32) -> Self {
        let bits = f.to_bits() & 0x7fff_ffff;
        let e = bits >> 23;
        let (m, shift) = if e == 0 {
            (bits & 0x7f_ffff, 0)
        } else {
            ((bits & 0x7f_ffff) | 0x80_0000, e - 1)
        };
        Big(vec![m; 1]).shl(shift)
    }

    pub fn sum(values: impl Iterator<Item = f32>) -> Self {
        values.fold(Big::zero(), |acc, v| acc.add(&Big::from_f32(v)))
    }

    pub fn add(&self, other: &Big) -> Big {
        let n = self.0.len().max(other.0.len()) + 1;
        let mut out = vec![0u32; n];
        let mut carry = 0u64;
        for (i, o) in out.iter_mut().enumerate() {
            let s = u64::from(*self.0.get(i).unwrap_or(&0))
                + u64::from(*other.0.get(i).unwrap_or(&0))
                + carry;
            *o = s as u32;
            carry = s >> 32;
        }
        Big(out).trim()
    }

    pub fn shl(&self, bits: u32) -> Big {
        let (limbs, rest) = ((bits / 32) as usize, bits % 32);
        let mut out = vec![0u32; self.0.len() + limbs + 1];
        for (i, &l) in self.0.iter().enumerate() {
            let v = u64::from(l) << rest;
            out[i + limbs] |= v as u32;
            out[i + limbs + 1] |= (v >> 32) as u32;
        }
        Big(out).trim()
    }

    fn mul_small(&self, m: u32) -> Big {
        let mut out = vec![0u32; self.0.len() + 1];
        let mut carry = 0u64;
        for (i, &l) in self.0.iter().enumerate() {
            let t = u64::from(l) * u64::from(m) + carry;
            out[i] = t as u32;
            carry = t >> 32;
        }
        out[self.0.len()] = carry as u32;
        Big(out).trim()
    }

    /// `self * p * 2^SHIFT` for `p` an f32 in `[0, 1)`: exact.
    pub fn mul_f32(&self, p: f32) -> Big {
        let bits = p.to_bits();
        let e = bits >> 23;
        let (m, s) = if e == 0 {
            (bits & 0x7f_ffff, 149)
        } else {
            ((bits & 0x7f_ffff) | 0x80_0000, 150 - e)
        };
        self.mul_small(m).shl(SHIFT - s)
    }

    /// `self * 2^SHIFT`, to compare with [`Big::mul_f32`].
    pub fn shifted(&self) -> Big {
        self.shl(SHIFT)
    }

    fn trim(mut self) -> Big {
        while self.0.len() > 1 && *self.0.last().unwrap() == 0 {
            self.0.pop();
        }
        self
    }
}

impl PartialOrd for Big {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Big {
    fn cmp(&self, other: &Self) -> Ordering {
        let a = self.clone().trim();
        let b = other.clone().trim();
        a.0.len()
            .cmp(&b.0.len())
            .then_with(|| a.0.iter().rev().cmp(b.0.iter().rev()))
    }
}
