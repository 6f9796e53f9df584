//! The chi-square goodness-of-fit test used by `chi_square.rs`, with its critical value
//! computed here rather than copied from a table.

/// Complementary error function, Numerical Recipes' `erfcc` (Chebyshev fit, fractional error
/// below 1.2e-7 everywhere): ample for locating a normal quantile to four digits.
pub fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    // Horner, innermost coefficient first: the same operations as the nested form.
    const C: [f64; 9] = [
        0.170_872_77,
        -0.822_152_23,
        1.488_515_87,
        -1.135_203_98,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_68,
    ];
    let mut poly = C[0];
    for c in &C[1..] {
        poly = c + t * poly;
    }
    let ans = t * (-z * z - 1.265_512_23 + t * poly).exp();
    if x >= 0.0 {
        ans
    } else {
        2.0 - ans
    }
}

/// Upper tail of the standard normal, `P(Z > z)`.
pub fn normal_upper_tail(z: f64) -> f64 {
    0.5 * erfc(z / std::f64::consts::SQRT_2)
}

/// The standard normal quantile `z` with `P(Z > z) = alpha`, by bisection.
pub fn normal_upper_quantile(alpha: f64) -> f64 {
    let (mut lo, mut hi) = (0.0f64, 40.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if normal_upper_tail(mid) > alpha {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// The chi-square critical value with `df` degrees of freedom at upper-tail probability
/// `alpha`, by the Wilson–Hilferty approximation: `(X/df)^(1/3)` is close to normal with mean
/// `1 - 2/(9 df)` and variance `2/(9 df)`, so
/// `crit = df * (1 - 2/(9 df) + z_alpha * sqrt(2/(9 df)))^3`.
/// For the tail 1e-6 and df >= 3 it is within a few percent of the exact value, on the
/// conservative (larger) side for small df.
pub fn chi_square_critical(df: usize, alpha: f64) -> f64 {
    let df = df as f64;
    let z = normal_upper_quantile(alpha);
    let v = 2.0 / (9.0 * df);
    df * (1.0 - v + z * v.sqrt()).powi(3)
}

/// The outcome of [`chi_square_test`].
#[derive(Debug)]
pub struct ChiSquare {
    pub statistic: f64,
    pub df: usize,
    pub critical: f64,
    /// Draws that landed on a token of zero probability (must be 0).
    pub outside_support: u64,
}

/// Pearson's chi-square of `counts` (per token id) against `probs` (per token id) for `n`
/// draws. Tokens with expected count >= 5 are their own bins; the rest are pooled into one bin
/// (merged into the smallest bin if the pool's expected count is below 5).
pub fn chi_square_test(counts: &[u64], probs: &[f64], alpha: f64) -> ChiSquare {
    assert_eq!(counts.len(), probs.len());
    let n: u64 = counts.iter().sum();
    let nf = n as f64;
    let mut bins: Vec<(f64, f64)> = Vec::new(); // (observed, expected)
    let (mut pool_obs, mut pool_exp) = (0.0f64, 0.0f64);
    let mut outside_support = 0;
    for (&c, &p) in counts.iter().zip(probs) {
        if p <= 0.0 {
            outside_support += c;
            continue;
        }
        let e = nf * p;
        if e >= 5.0 {
            bins.push((c as f64, e));
        } else {
            pool_obs += c as f64;
            pool_exp += e;
        }
    }
    if pool_exp > 0.0 {
        if pool_exp >= 5.0 || bins.is_empty() {
            bins.push((pool_obs, pool_exp));
        } else {
            let smallest = bins
                .iter_mut()
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .expect("non-empty");
            smallest.0 += pool_obs;
            smallest.1 += pool_exp;
        }
    }
    let statistic = bins.iter().map(|(o, e)| (o - e) * (o - e) / e).sum();
    let df = bins.len().saturating_sub(1).max(1);
    ChiSquare {
        statistic,
        df,
        critical: chi_square_critical(df, alpha),
        outside_support,
    }
}
