//! A slow, obvious f64 reference of the `SamplingParams` path of spec/sampling.md
//! (steps 1, 5, 6, 7, 9, 10, 12), written from the spec alone: f64 arithmetic, full stable
//! sorts, no cleverness.
//!
//! Besides the final probabilities it reports whether the row is *fragile*: whether one of its
//! decisions (argmax, top-k cut, top-p cut) lies within rounding of a boundary, or its
//! probabilities move by more than rounding when the penalised logits are perturbed by a couple
//! of f32 ulps enough to reach the comparison tolerance. The spec allows two correct implementations to differ there ("Arithmetic":
//! probabilities may be computed in f32; boundary decisions within about 1e-6 relative of the
//! boundary may go either way), so property tests skip fragile rows.

use nucleus_sampling::SamplingParams;

/// Temperatures below this are greedy (spec step 6).
pub const GREEDY_BELOW: f64 = 1e-5;

/// Relative distance to a boundary within which the spec lets implementations differ.
pub const BOUNDARY_REL: f64 = 1e-6;

/// Why the oracle returns no distribution: the spec's error kinds.
#[derive(Clone, Debug, PartialEq)]
pub enum OracleError {
    /// A parameter out of range, by field name.
    InvalidParams(&'static str),
    /// A context id not below the vocabulary size.
    TokenIdOutOfRange { field: &'static str, token_id: u32 },
    /// NaN or +inf at this (lowest) id.
    NonFiniteLogits { token_id: u32 },
    /// Every logit is -inf.
    NoCandidates,
}

/// The oracle's answer for one row.
#[derive(Clone, Debug)]
pub struct Oracle {
    /// Final probabilities, one per id (one-hot for greedy).
    pub probs: Vec<f64>,
    /// Whether each id survived every filter (a survivor may still have probability 0 after
    /// f64 underflow at tiny temperatures; a non-survivor must have probability exactly 0).
    pub support: Vec<bool>,
    /// Greedy (temperature below 1e-5).
    pub greedy: bool,
    /// Some decision lies within rounding of its boundary (see the module docs).
    pub fragile: bool,
    /// The penalised logits (step 5), in f64.
    pub penalised: Vec<f64>,
}

/// Parameter check, from the spec's ranges ("Inputs" and "Parameter edge values").
pub fn check_params(p: &SamplingParams) -> Result<(), OracleError> {
    if !(p.temperature >= 0.0 && p.temperature.is_finite()) {
        return Err(OracleError::InvalidParams("temperature"));
    }
    if p.top_k < -1 {
        return Err(OracleError::InvalidParams("top_k"));
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return Err(OracleError::InvalidParams("top_p"));
    }
    if !(p.repetition_penalty > 0.0 && p.repetition_penalty.is_finite()) {
        return Err(OracleError::InvalidParams("repetition_penalty"));
    }
    Ok(())
}

/// The oracle: final probabilities of `row` (its length is the vocabulary size) under
/// `params`, with `prompt` and `output` as the context.
pub fn oracle(
    row: &[f32],
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
) -> Result<Oracle, OracleError> {
    check_params(params)?;
    let vocab = row.len();
    for (field, ids) in [("prompt_ids", prompt), ("output_ids", output)] {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(OracleError::TokenIdOutOfRange {
                field,
                token_id: id,
            });
        }
    }

    // Step 1: NaN or +inf is an error for this row; -inf masks.
    if let Some(i) = row.iter().position(|l| l.is_nan() || *l == f32::INFINITY) {
        return Err(OracleError::NonFiniteLogits { token_id: i as u32 });
    }

    // Step 5: repetition penalty over the distinct ids of prompt + output, each once.
    let mut seen = vec![false; vocab];
    for &id in prompt.iter().chain(output) {
        seen[id as usize] = true;
    }
    let r = params.repetition_penalty;
    let penalised: Vec<f64> = row
        .iter()
        .zip(&seen)
        .map(|(&l, &s)| penalise(f64::from(l), s, r))
        .collect();

    // Step 12: no candidate.
    if penalised.iter().all(|l| *l == f64::NEG_INFINITY) {
        return Err(OracleError::NoCandidates);
    }

    // Which ids' penalised logits carry a rounding error in an f32 implementation: a penalised
    // id whose value differs between f64 and f32 arithmetic (or r itself is not an f32).
    let inexact: Vec<bool> = row
        .iter()
        .zip(&seen)
        .map(|(&l, &s)| s && r != 1.0 && !penalty_is_exact(l, r))
        .collect();
    let keys: Vec<(u32, bool)> = row
        .iter()
        .zip(&seen)
        .map(|(l, s)| (l.to_bits(), *s && r != 1.0))
        .collect();

    let mut out = core(&penalised, params, &keys, &inexact);

    // Sensitivity to the rounding of the penalty: perturb the inexact penalised logits by
    // +-2 f32 ulps (relative 2^-22; an f32 implementation's penalty is off by at most about
    // 2^-23: r rounded to f32, then the quotient rounded) with sign patterns that give every
    // pair of ids opposite signs in at least one pattern (bit b of the id). The response is
    // about linear, so an implementation moves by at most about half of it; the row is fragile
    // when the perturbation moves a probability by more than 1e-6 (the comparison tolerance),
    // as happens at tiny temperatures with near-ties of penalised and unpenalised logits.
    if inexact.iter().any(|&x| x) && !out.fragile {
        let bits = usize::BITS - vocab.leading_zeros();
        'patterns: for b in 0..bits.max(1) {
            let perturbed: Vec<f64> = penalised
                .iter()
                .enumerate()
                .map(|(i, &l)| {
                    if inexact[i] && l.is_finite() {
                        let sign = if (i >> b) & 1 == 1 { 1.0 } else { -1.0 };
                        l * (1.0 + sign * f64::powi(2.0, -22))
                    } else {
                        l
                    }
                })
                .collect();
            let alt = core(&perturbed, params, &keys, &inexact);
            let moved = alt
                .probs
                .iter()
                .zip(&out.probs)
                .any(|(a, b)| (a - b).abs() > 1e-6);
            if moved || alt.fragile {
                out.fragile = true;
                break 'patterns;
            }
        }
    }
    Ok(out)
}

fn penalise(l: f64, seen: bool, r: f64) -> f64 {
    if !seen {
        l
    } else if l > 0.0 {
        l / r
    } else {
        l * r
    }
}

/// Whether `l / r` (or `l * r`) is exact in every plausible f32 implementation: `r` is an f32
/// and the f32 result equals the f64 result.
fn penalty_is_exact(l: f32, r: f64) -> bool {
    let rf = r as f32;
    if f64::from(rf) != r {
        return false;
    }
    let (f32_result, f64_result) = if l > 0.0 {
        (l / rf, f64::from(l) / r)
    } else {
        (l * rf, f64::from(l) * r)
    };
    f64::from(f32_result) == f64_result
}

/// Steps 6-10 on penalised logits.
fn core(
    penalised: &[f64],
    params: &SamplingParams,
    keys: &[(u32, bool)],
    inexact: &[bool],
) -> Oracle {
    let vocab = penalised.len();
    let candidates: Vec<usize> = (0..vocab)
        .filter(|&i| penalised[i] != f64::NEG_INFINITY)
        .collect();
    let max = candidates
        .iter()
        .map(|&i| penalised[i])
        .fold(f64::NEG_INFINITY, f64::max);

    // All candidates in the spec's order: logit descending, ties toward the lower id (a stable
    // sort of ids in ascending order).
    let mut by_logit = candidates.clone();
    by_logit.sort_by(|&a, &b| penalised[b].total_cmp(&penalised[a]));

    // Step 6: greedy.
    if params.temperature < GREEDY_BELOW {
        let winner = by_logit[0];
        let mut probs = vec![0.0; vocab];
        probs[winner] = 1.0;
        let mut support = vec![false; vocab];
        support[winner] = true;
        let fragile = fragile_cut(&by_logit, 1, penalised, max, keys, inexact);
        return Oracle {
            probs,
            support,
            greedy: true,
            fragile,
            penalised: penalised.to_vec(),
        };
    }

    let mut fragile = false;

    // Step 9: top-k, exact k, on the candidate order above. 0, -1 and k >= vocab are off.
    let k = params.top_k;
    let mut survivors: Vec<usize> = if k > 0 && (k as u64) < vocab as u64 {
        let k = k as usize;
        if k < by_logit.len() {
            fragile |= fragile_cut(&by_logit, k, penalised, max, keys, inexact);
        }
        by_logit.iter().copied().take(k).collect()
    } else {
        by_logit.clone()
    };

    // Step 7: temperature after max subtraction; weights of the survivors.
    let t = params.temperature;
    let weight = |i: usize| ((penalised[i] - max) / t).exp();

    // Step 10: top-p on the renormalised survivors, in probability order (ties toward the
    // lower id: a stable sort of the id-sorted survivors), shortest prefix with mass >= p.
    if params.top_p < 1.0 {
        let total: f64 = survivors.iter().map(|&i| weight(i)).sum();
        let mut order = survivors.clone();
        order.sort(); // ascending id, so the stable sort below breaks ties toward the lower id
        let prob = |i: usize| weight(i) / total;
        order.sort_by(|&a, &b| prob(b).total_cmp(&prob(a)));
        let p = params.top_p;
        let mut cum = 0.0f64;
        let mut cut = order.len(); // rounding may leave every prefix below p: keep all
        for (n, &i) in order.iter().enumerate() {
            cum += prob(i);
            // Every prefix up to the first one reaching p: within rounding of p is fragile.
            if (cum - p).abs() <= BOUNDARY_REL * p {
                fragile = true;
            }
            if cum >= p {
                cut = n + 1;
                break;
            }
        }
        if cut < order.len() {
            // Near-ties in probability at the cut are near-ties in scaled logit.
            fragile |= fragile_cut(&order, cut, penalised, max, keys, inexact);
        }
        order.truncate(cut);
        survivors = order;
    }

    let total: f64 = survivors.iter().map(|&i| weight(i)).sum();
    let mut probs = vec![0.0; vocab];
    let mut support = vec![false; vocab];
    for &i in &survivors {
        probs[i] = weight(i) / total;
        support[i] = true;
    }
    Oracle {
        probs,
        support,
        greedy: false,
        fragile,
        penalised: penalised.to_vec(),
    }
}

/// Whether the cut between `order[cut - 1]` (kept) and `order[cut]` (dropped) could fall
/// differently in a correct f32 implementation: the two values are within rounding of each
/// other (relative [`BOUNDARY_REL`] of the magnitudes involved, max subtraction included) and
/// some pair of ids near the cut is not an exact tie of identical computations (same input
/// bits, same penalty status) or of exactly computed values.
fn fragile_cut(
    order: &[usize],
    cut: usize,
    penalised: &[f64],
    max: f64,
    keys: &[(u32, bool)],
    inexact: &[bool],
) -> bool {
    if cut == 0 || cut >= order.len() {
        return false;
    }
    let a = penalised[order[cut - 1]];
    let b = penalised[order[cut]];
    let tol = BOUNDARY_REL * (a.abs() + b.abs() + max.abs()) + 1e-300;
    if (a - b).abs() > tol {
        return false;
    }
    // The ids within rounding of the cut.
    let near: Vec<usize> = order
        .iter()
        .copied()
        .filter(|&i| (penalised[i] - a).abs() <= tol || (penalised[i] - b).abs() <= tol)
        .collect();
    for (n, &i) in near.iter().enumerate() {
        for &j in &near[n + 1..] {
            let same_computation = keys[i] == keys[j];
            let exact_tie = penalised[i] == penalised[j] && !inexact[i] && !inexact[j];
            if !(same_computation || exact_tie) {
                return true;
            }
        }
    }
    false
}
