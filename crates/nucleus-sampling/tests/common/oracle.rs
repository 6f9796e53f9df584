//! A slow, obvious f64 reference of the `SamplingParams` path of spec/sampling.md
//! (steps 1, 3, 4, 5, 6, 7, 8, 9, 10, 12), written from the spec alone: f64 arithmetic, full
//! stable sorts, no cleverness.
//!
//! Besides the final probabilities it reports whether the row is *fragile*: whether one of its
//! decisions (argmax, min-p threshold, top-k cut, top-p cut) lies within rounding of a
//! boundary, or its probabilities move by more than rounding when the processed logits
//! (bias and penalties applied) are perturbed by their possible f32 rounding error enough to
//! reach the comparison tolerance. The spec allows two correct implementations to differ there
//! ("Arithmetic": probabilities may be computed in f32; boundary decisions within about 1e-6
//! relative of the boundary may go either way), so property tests skip fragile rows.

use nucleus_sampling::SamplingParams;

/// Temperatures below this are greedy (spec step 6).
pub const GREEDY_BELOW: f64 = 1e-5;

/// Relative distance to a boundary within which the spec lets implementations differ.
pub const BOUNDARY_REL: f64 = 1e-6;

/// The bound of logit bias values (spec step 4, "clamped to [-100, 100]").
pub const BIAS_LIMIT: f64 = 100.0;

/// Why the oracle returns no distribution: the spec's error kinds.
#[derive(Clone, Debug, PartialEq)]
pub enum OracleError {
    /// A parameter out of range, by field name.
    InvalidParams(&'static str),
    /// A context or parameter id not below the vocabulary size.
    TokenIdOutOfRange { field: &'static str, token_id: u32 },
    /// NaN or +inf at this (lowest) id.
    NonFiniteLogits { token_id: u32 },
    /// Every logit is -inf after the hard constraints (step 3).
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
    /// The processed logits after steps 3-5 (constraints, bias, penalties), in f64.
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
    if !(p.min_p >= 0.0 && p.min_p <= 1.0) {
        return Err(OracleError::InvalidParams("min_p"));
    }
    if !(p.presence_penalty >= -2.0 && p.presence_penalty <= 2.0) {
        return Err(OracleError::InvalidParams("presence_penalty"));
    }
    if !(p.frequency_penalty >= -2.0 && p.frequency_penalty <= 2.0) {
        return Err(OracleError::InvalidParams("frequency_penalty"));
    }
    if p.logit_bias.values().any(|b| !b.is_finite()) {
        return Err(OracleError::InvalidParams("logit_bias"));
    }
    if p.allowed_token_ids.as_ref().is_some_and(|a| a.is_empty()) {
        return Err(OracleError::InvalidParams("allowed_token_ids"));
    }
    if p.bad_words.iter().any(|w| w.is_empty()) {
        return Err(OracleError::InvalidParams("bad_words"));
    }
    Ok(())
}

/// The oracle without EOS / stop ids (`min_tokens` then bans nothing).
pub fn oracle(
    row: &[f32],
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
) -> Result<Oracle, OracleError> {
    oracle_with_stops(row, params, prompt, output, &[])
}

/// The oracle: final probabilities of `row` (its length is the vocabulary size) under
/// `params`, with `prompt` and `output` as the context and `stops` as the EOS and stop ids.
pub fn oracle_with_stops(
    row: &[f32],
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    stops: &[u32],
) -> Result<Oracle, OracleError> {
    check_params(params)?;
    let vocab = row.len();
    let bias_ids: Vec<u32> = params.logit_bias.keys().copied().collect();
    let allowed: Vec<u32> = params.allowed_token_ids.clone().unwrap_or_default();
    let bad: Vec<u32> = params.bad_words.iter().flatten().copied().collect();
    for (field, ids) in [
        ("prompt_ids", prompt),
        ("output_ids", output),
        ("logit_bias", &bias_ids[..]),
        ("allowed_token_ids", &allowed[..]),
        ("bad_words", &bad[..]),
        ("stop_token_ids", stops),
    ] {
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

    // Step 3: hard constraints.
    let mut banned = vec![false; vocab];
    if let Some(allowed) = &params.allowed_token_ids {
        let mut ok = vec![false; vocab];
        for &id in allowed {
            ok[id as usize] = true;
        }
        for (b, ok) in banned.iter_mut().zip(ok) {
            *b |= !ok;
        }
    }
    for word in &params.bad_words {
        let (last, prefix) = word.split_last().expect("non-empty");
        if output.ends_with(prefix) {
            banned[*last as usize] = true;
        }
    }
    if output.len() < params.min_tokens {
        for &id in stops {
            banned[id as usize] = true;
        }
    }
    let constrained: Vec<f32> = row
        .iter()
        .zip(&banned)
        .map(|(&l, &b)| if b { f32::NEG_INFINITY } else { l })
        .collect();

    // Step 12: no candidate after step 3.
    if constrained.iter().all(|l| *l == f32::NEG_INFINITY) {
        return Err(OracleError::NoCandidates);
    }

    // Step 4: bias, clamped. Step 5: repetition over the distinct ids of prompt + output,
    // then frequency and presence over the output ids only.
    let mut seen = vec![false; vocab];
    for &id in prompt.iter().chain(output) {
        seen[id as usize] = true;
    }
    let mut count = vec![0u32; vocab];
    for &id in output {
        count[id as usize] += 1;
    }
    let bias: Vec<f64> = (0..vocab as u32)
        .map(|i| {
            params
                .logit_bias
                .get(&i)
                .map_or(0.0, |b| b.clamp(-BIAS_LIMIT, BIAS_LIMIT))
        })
        .collect();
    let r = params.repetition_penalty;
    let (fq, pr) = (params.frequency_penalty, params.presence_penalty);
    let rep_on = r != 1.0;
    let fp_on = fq != 0.0 || pr != 0.0;

    let mut penalised = vec![0.0f64; vocab];
    // An upper bound of the f32 rounding error of each processed logit (0: exact everywhere).
    let mut err = vec![0.0f64; vocab];
    // Ids with equal keys go through identical computations, so they tie exactly.
    let mut keys = vec![(0u32, 0u64, false, 0u32); vocab];
    for i in 0..vocab {
        let l = constrained[i];
        let rep = seen[i] && rep_on;
        let c = if fp_on { count[i] } else { 0 };
        keys[i] = (l.to_bits(), bias[i].to_bits(), rep, c);
        if l == f32::NEG_INFINITY {
            penalised[i] = f64::NEG_INFINITY;
            continue;
        }
        // Every operand and intermediate of any plausible evaluation order, with the magnitude
        // its f32 rounding can reach the result with: when all are f32 values, every f32
        // implementation computes the result exactly; otherwise each inexact one contributes
        // at most half an f32 ulp of its magnitude (doubled here for safety), and a repetition
        // penalty scales the earlier errors by up to max(r, 1/r).
        let mut ops: Vec<(f64, f64)> = vec![];
        let mut x = f64::from(l);
        if bias[i] != 0.0 {
            ops.push((bias[i], bias[i].abs()));
            x += bias[i];
            ops.push((x, x.abs()));
        }
        if rep {
            x = if x > 0.0 { x / r } else { x * r };
            ops.push((r, x.abs()));
            ops.push((x, x.abs()));
        }
        if c > 0 {
            let cf = f64::from(c) * fq;
            ops.extend([
                (fq, cf.abs()),
                (pr, pr.abs()),
                (cf, cf.abs()),
                (cf + pr, (cf + pr).abs()),
                (x - cf, (x - cf).abs()),
            ]);
            x -= cf + pr;
            ops.push((x, x.abs()));
        }
        let scale = if rep { r.max(1.0 / r) } else { 1.0 };
        err[i] = f64::powi(2.0, -22)
            * scale
            * ops
                .iter()
                .filter(|(v, _)| f64::from(*v as f32) != *v)
                .map(|(_, m)| m)
                .sum::<f64>();
        penalised[i] = x;
    }

    let mut out = core(&penalised, params, &keys, &err);

    // Sensitivity to the rounding of bias and penalties: perturb the inexact processed logits
    // by +-err (twice the worst f32 rounding of the operations involved) with sign patterns
    // that give every pair of ids opposite signs in at least one pattern (bit b of the id).
    // The response is about linear, so an implementation moves by at most about half of it;
    // the row is fragile when the perturbation moves a probability by more than 1e-6 (the
    // comparison tolerance), as happens at tiny temperatures with near-ties.
    if err.iter().any(|&e| e > 0.0) && !out.fragile {
        let bits = usize::BITS - vocab.leading_zeros();
        'patterns: for b in 0..bits.max(1) {
            let perturbed: Vec<f64> = penalised
                .iter()
                .enumerate()
                .map(|(i, &l)| {
                    if err[i] > 0.0 && l.is_finite() {
                        let sign = if (i >> b) & 1 == 1 { 1.0 } else { -1.0 };
                        l + sign * err[i]
                    } else {
                        l
                    }
                })
                .collect();
            let alt = core(&perturbed, params, &keys, &err);
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

type Key = (u32, u64, bool, u32);

/// Steps 6-10 on processed logits.
fn core(penalised: &[f64], params: &SamplingParams, keys: &[Key], err: &[f64]) -> Oracle {
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
    // `+ 0.0`: -0.0 and +0.0 are one value and tie (the stable sort keeps the lower id first).
    by_logit.sort_by(|&a, &b| (penalised[b] + 0.0).total_cmp(&(penalised[a] + 0.0)));

    // Step 6: greedy.
    if params.temperature < GREEDY_BELOW {
        let winner = by_logit[0];
        let mut probs = vec![0.0; vocab];
        probs[winner] = 1.0;
        let mut support = vec![false; vocab];
        support[winner] = true;
        let fragile = fragile_cut(&by_logit, 1, penalised, max, keys, err);
        return Oracle {
            probs,
            support,
            greedy: true,
            fragile,
            penalised: penalised.to_vec(),
        };
    }

    let mut fragile = false;
    let t = params.temperature;

    // Step 8: min-p. p_i >= min_p * p_max  <=>  (l_i - max) / T >= ln(min_p); ties kept.
    // `by_logit` is in probability order, so the survivors are a prefix of it.
    let mut survivors: Vec<usize> = by_logit.clone();
    if params.min_p > 0.0 {
        let ln_min_p = params.min_p.ln();
        let top = by_logit[0];
        let mut kept = Vec::new();
        for &i in &by_logit {
            let x = (penalised[i] - max) / t;
            // The rounding of x in f32 (subtraction, division, exp) and of the processed logits.
            let margin = BOUNDARY_REL
                + f64::powi(2.0, -21) * (x.abs() + (penalised[i].abs() + max.abs()) / t)
                + 2.0 * (err[i] + err[top]) / t;
            if (x - ln_min_p).abs() <= margin {
                // An exact tie with the maximum at min_p = 1 is decided exactly.
                let exact_tie_with_max = params.min_p == 1.0
                    && penalised[i] == max
                    && (keys[i] == keys[top] || (err[i] == 0.0 && err[top] == 0.0));
                if !exact_tie_with_max {
                    fragile = true;
                }
            }
            if x >= ln_min_p || penalised[i] == max {
                kept.push(i);
            }
        }
        survivors = kept;
    }

    // Step 9: top-k, exact k, on the candidate order above. 0, -1 and k >= vocab are off.
    let k = params.top_k;
    if k > 0 && (k as u64) < vocab as u64 {
        let k = k as usize;
        if k < survivors.len() {
            fragile |= fragile_cut(&survivors, k, penalised, max, keys, err);
            survivors.truncate(k);
        }
    }

    // Step 7: temperature after max subtraction; weights of the survivors.
    let weight = |i: usize| ((penalised[i] - max) / t).exp();

    // Step 10: top-p on the renormalised survivors, in probability order (ties toward the
    // lower id: a stable sort of the id-sorted survivors), shortest prefix with mass >= p.
    if params.top_p < 1.0 {
        let total: f64 = survivors.iter().map(|&i| weight(i)).sum();
        let mut order = survivors.clone();
        order.sort(); // ascending id, so the stable sort below breaks ties toward the lower id
        let prob = |i: usize| weight(i) / total;
        order.sort_by(|&a, &b| (prob(b) + 0.0).total_cmp(&(prob(a) + 0.0)));
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
            fragile |= fragile_cut(&order, cut, penalised, max, keys, err);
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
/// other (relative [`BOUNDARY_REL`] of the magnitudes involved, max subtraction included, plus
/// the rounding bounds `err` of the processed logits) and some pair of ids near the cut is not
/// an exact tie of identical computations (same key) or of exactly computed values.
fn fragile_cut(
    order: &[usize],
    cut: usize,
    penalised: &[f64],
    max: f64,
    keys: &[Key],
    err: &[f64],
) -> bool {
    if cut == 0 || cut >= order.len() {
        return false;
    }
    let (ia, ib) = (order[cut - 1], order[cut]);
    let a = penalised[ia];
    let b = penalised[ib];
    let tol = BOUNDARY_REL * (a.abs() + b.abs() + max.abs()) + 2.0 * (err[ia] + err[ib]) + 1e-300;
    if (a - b).abs() > tol {
        return false;
    }
    // The ids within rounding of the cut.
    let near: Vec<usize> = order
        .iter()
        .copied()
        .filter(|&i| {
            let t = tol + 2.0 * err[i];
            (penalised[i] - a).abs() <= t || (penalised[i] - b).abs() <= t
        })
        .collect();
    for (n, &i) in near.iter().enumerate() {
        for &j in &near[n + 1..] {
            let same_computation = keys[i] == keys[j];
            let exact_tie = penalised[i] == penalised[j] && err[i] == 0.0 && err[j] == 0.0;
            if !(same_computation || exact_tie) {
                return true;
            }
        }
    }
    false
}
