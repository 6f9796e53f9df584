//! The catalogue's temperature-and-entropy processors and filters (issue 16): typical-p,
//! top-n-sigma, dynamic temperature, log-softmax, epsilon, eta, top-h, and `min_keep` on
//! top-k / top-p / min-p.
//!
//! For each: (a) exact cases worked by hand from the anchor's documented semantics (the
//! arithmetic in the comments), (b) a slow, obvious f64 oracle written here, compared with the
//! processor on random rows (several vocabulary sizes, ties, `-inf` entries; rows where a
//! decision of the oracle lies within rounding of its boundary are skipped and counted), and
//! (c) parameter errors naming the field. Then the JSON configuration and the chain order.
//!
//! Exact cases given as probabilities use dyadic rows: logits `-k a` with `a = ln 2` rounded
//! to f32 and `k` in {0, 1, 2, 4} (`k a` is exact in f32), whose weights `exp(-k a)` round to
//! exactly `2^-k` (`a - ln 2` is about 1.9e-9, far below half an ulp of the result); every
//! test checks that premise first, so a failure there blames the platform's `exp`, not the
//! processor.

use crate::common;

use common::{assert_close, SplitMix};
use nucleus_sampling::chain::{
    ChainError, DynamicTemperature, Epsilon, Eta, LogSoftmax, LogitsProcessor, MinP,
    ProcessorConfig, ProcessorContext, RepetitionPenalty, SamplerChain, Selection, Temperature,
    TopH, TopK, TopNSigma, TopP, Typical,
};

const NEG: f32 = f32::NEG_INFINITY;
const A: f32 = std::f32::consts::LN_2;

fn ctx0() -> ProcessorContext<'static> {
    ProcessorContext::default()
}

/// Applies one processor alone to a copy of `row`.
fn applied(p: &mut dyn LogitsProcessor, row: &[f32]) -> Vec<f32> {
    let mut out = row.to_vec();
    p.apply(&mut out, &ctx0()).unwrap();
    out
}

/// The ids of the finite entries.
fn kept(row: &[f32]) -> Vec<u32> {
    (0..row.len() as u32)
        .filter(|&i| row[i as usize] != NEG)
        .collect()
}

/// A sampling chain's final distribution over `row`.
fn dist(processors: Vec<Box<dyn LogitsProcessor>>, row: &[f32]) -> Vec<f64> {
    let mut chain = SamplerChain::new(Selection::sample(Some(1)));
    for p in processors {
        chain.push_boxed(p);
    }
    chain.distribution(row, &ctx0()).unwrap()
}

/// Logits `-k a` (weights `2^-k` relative to the maximum 0); `None` is `-inf`.
fn dyadic(ks: &[Option<i32>]) -> Vec<f32> {
    ks.iter()
        .map(|k| match *k {
            None => NEG,
            Some(k) => {
                assert!([0, 1, 2, 4].contains(&k));
                let l = -(k as f32) * A;
                assert_eq!(l.exp(), 0.5f32.powi(k), "premise: exp(-{k} a) is 2^-{k}");
                l
            }
        })
        .collect()
}

/// probs [0.5, 0.25, 0.125, 0.125]: weights 1, 1/2, 1/4, 1/4, z = 2.
fn row_8421() -> Vec<f32> {
    dyadic(&[Some(0), Some(1), Some(2), Some(2)])
}

// ---------------------------------------------------------------------------------------------
// Random rows and the f64 oracles
// ---------------------------------------------------------------------------------------------

/// Rows of several shapes: normal at several scales, quantised (ties), masked (`-inf`),
/// four-valued (heavy ties), with a far outlier, and one row of 151,936.
fn random_rows() -> Vec<Vec<f32>> {
    let mut g = SplitMix(0x05ee_de27);
    let mut rows = Vec::new();
    for &n in &[1usize, 2, 3, 7, 64, 100, 101, 111, 257, 1000, 5000, 32000] {
        for shape in 0..6 {
            let row: Vec<f32> = (0..n)
                .map(|_| {
                    let x = g.normal();
                    match shape {
                        0 => (x * 2.0) as f32,
                        1 => ((x * 3.0 * 2.0).round() / 2.0) as f32,
                        2 if g.next_f64() < 0.3 => NEG,
                        2 => (x * 4.0) as f32,
                        3 => -(g.below(4) as f32),
                        4 => (x * 0.01) as f32,
                        _ if g.next_f64() < 0.01 => -1e30,
                        _ => (x * 6.0) as f32,
                    }
                })
                .collect();
            rows.push(row);
        }
    }
    let mut big: Vec<f32> = (0..151_936).map(|_| (g.normal() * 3.0) as f32).collect();
    big[7] = NEG;
    rows.push(big);
    for row in &mut rows {
        if row.iter().all(|&l| l == NEG) {
            row[0] = 0.0;
        }
    }
    rows
}

/// The finite ids in the order (logit descending, id ascending).
fn by_logit(row: &[f32]) -> Vec<u32> {
    let mut ids = kept(row);
    // `+ 0.0`: -0.0 and 0.0 are the same logit.
    ids.sort_by(|&a, &b| {
        (row[b as usize] + 0.0)
            .total_cmp(&(row[a as usize] + 0.0))
            .then(a.cmp(&b))
    });
    ids
}

/// Softmax of the finite logits in f64 (0 for `-inf`), and `ln Z` relative to the maximum.
fn probs64(row: &[f32]) -> (Vec<f64>, f64, f64) {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &l| m.max(f64::from(l)));
    let e: Vec<f64> = row.iter().map(|&l| (f64::from(l) - max).exp()).collect();
    let z: f64 = e.iter().sum();
    (e.iter().map(|x| x / z).collect(), max, z.ln())
}

fn entropy64(p: &[f64]) -> f64 {
    -p.iter()
        .filter(|&&x| x > 0.0)
        .map(|&x| x * x.ln())
        .sum::<f64>()
}

/// The `k` best ids (logit descending, id ascending), sorted by id.
fn best(row: &[f32], k: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = by_logit(row).into_iter().take(k).collect();
    ids.sort_unstable();
    ids
}

/// How close (absolute) a running probability mass may come to its target before the
/// oracle calls the row ambiguous: the processors' f32 weights and `l - max` differ from the
/// oracle's f64 values by about 1e-7 relative.
const MASS_MARGIN: f64 = 2e-7;

/// Compares a processor's kept set with an oracle on every random row; the oracle returns
/// `None` where a decision is within rounding. At most `max_skipped` rows may be skipped.
fn against_oracle(
    what: &str,
    mut make: impl FnMut() -> Box<dyn LogitsProcessor>,
    oracle: impl Fn(&[f32]) -> Option<Vec<u32>>,
    max_skipped: usize,
) {
    let mut skipped = 0;
    for (r, row) in random_rows().iter().enumerate() {
        let Some(want) = oracle(row) else {
            skipped += 1;
            eprintln!("{what}: row {r} (len {}) skipped", row.len());
            continue;
        };
        let got = kept(&applied(make().as_mut(), row));
        assert_eq!(
            got.len(),
            want.len(),
            "{what}: row {r} (len {}): kept {} tokens, the oracle {}",
            row.len(),
            got.len(),
            want.len()
        );
        assert_eq!(got, want, "{what}: row {r}");
    }
    assert!(skipped <= max_skipped, "{what}: {skipped} rows skipped");
}

/// llama.cpp's `llama_sampler_typical_apply`, in f64: scores `|-ln p - H|` ascending (ties to
/// the lower id), stop at the first token where the running mass is `> p` and `min_keep` are
/// in.
fn typical_oracle(row: &[f32], typ: f64, min_keep: usize) -> Option<Vec<u32>> {
    let ids = kept(row);
    if ids.len() <= 1 || typ >= 1.0 {
        return Some(ids);
    }
    let (p, max, ln_z) = probs64(row);
    let h = entropy64(&p);
    let score = |i: u32| (-((f64::from(row[i as usize]) - max) - ln_z) - h).abs();
    let mut order = ids.clone();
    order.sort_by(|&a, &b| score(a).total_cmp(&score(b)).then(a.cmp(&b)));
    let mut cum = 0.0;
    let mut last = order.len();
    for (r, &i) in order.iter().enumerate() {
        cum += p[i as usize];
        if (cum - typ).abs() < MASS_MARGIN {
            return None;
        }
        if cum > typ && r + 1 >= min_keep {
            last = r + 1;
            break;
        }
    }
    if last < order.len() {
        let (a, b) = (order[last - 1], order[last]);
        if row[a as usize] != row[b as usize] && (score(a) - score(b)).abs() < 1e-7 {
            return None;
        }
    }
    let mut keep = order[..last].to_vec();
    keep.sort_unstable();
    Some(keep)
}

/// Removes `p < threshold` unless fewer than `min_keep` remain (then the `min_keep` best).
fn cutoff_oracle(row: &[f32], threshold: f64, min_keep: usize) -> Option<Vec<u32>> {
    let (p, _, _) = probs64(row);
    let ids = kept(row);
    if ids
        .iter()
        .any(|&i| (p[i as usize] - threshold).abs() < 1e-6 * threshold)
    {
        return None;
    }
    let survivors: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&i| p[i as usize] >= threshold)
        .collect();
    if survivors.len() < min_keep {
        return Some(best(row, min_keep));
    }
    Some(survivors)
}

/// Hugging Face's `TopHLogitsWarper` in f64.
fn top_h_oracle(row: &[f32], top_h: f64) -> Option<Vec<u32>> {
    let order = by_logit(row);
    let cand = &order[..order.len().min(100)];
    let l0 = f64::from(row[cand[0] as usize]);
    let e: Vec<f64> = cand
        .iter()
        .map(|&i| (f64::from(row[i as usize]) - l0).exp())
        .collect();
    let z: f64 = e.iter().sum();
    let q: Vec<f64> = e.iter().map(|x| x / z).collect();
    let tau = top_h * entropy64(&q);
    let mut keep = 1;
    let mut c = 0.0;
    for (j, &i) in cand.iter().enumerate() {
        // A zero f32 probability: 0 * log 0 is NaN in Hugging Face, which ends the prefix.
        if (row[i as usize] - row[cand[0] as usize]).exp() == 0.0 {
            break;
        }
        c += -q[j] * q[j].ln();
        if (c - tau).abs() < 1e-6 * (1.0 + tau) && j > 0 {
            return None;
        }
        if j > 0 && c > tau {
            break;
        }
        keep = j + 1;
    }
    let mut ids = cand[..keep].to_vec();
    ids.sort_unstable();
    Some(ids)
}

// ---------------------------------------------------------------------------------------------
// Typical
// ---------------------------------------------------------------------------------------------

#[test]
fn typical_hand_cases_stop_strictly_above_p_as_llama_cpp() {
    // probs [0.5, 0.25, 0.125, 0.125] (logits 0, -a, -2a, -2a). H = 0.5 ln 2 + 0.25 (2 ln 2)
    // + 2 (0.125) (3 ln 2) = 1.75 ln 2. Scores |-ln p - H|: token 0 |ln 2 - 1.75 ln 2| =
    // 0.75 ln 2; token 1 |2 ln 2 - 1.75 ln 2| = 0.25 ln 2; tokens 2, 3: 1.25 ln 2. Order
    // 1, 0, 2, 3; running mass 0.25, 0.75, 0.875, 1.
    let row = row_8421();
    // p = 0.75: 0.75 > 0.75 is false (an exact hit: dyadic sums are exact), so token 2 joins:
    // {1, 0, 2} -> [4/7, 2/7, 1/7, 0]. (Hugging Face stops at the hit: [2/3, 1/3, 0, 0].)
    let d = dist(vec![Box::new(Typical::new(0.75).unwrap())], &row);
    assert_close(
        &d,
        &[4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0, 0.0],
        1e-12,
        "typical 0.75",
    );
    // p = 0.74: 0.75 > 0.74 stops after token 0: [2/3, 1/3, 0, 0].
    let d = dist(vec![Box::new(Typical::new(0.74).unwrap())], &row);
    assert_close(&d, &[2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0], 1e-12, "typical 0.74");
    // p = 0.2: 0.25 > 0.2 at once: only token 1, the most likely token is dropped.
    let out = applied(&mut Typical::new(0.2).unwrap(), &row);
    assert_eq!(kept(&out), [1]);
    assert_eq!(out[1], row[1], "kept logits are unchanged");
    // p = 0.25: an exact hit again, so token 0 joins: {0, 1}.
    assert_eq!(
        kept(&applied(&mut Typical::new(0.25).unwrap(), &row)),
        [0, 1]
    );
    // min_keep: at least that many of the order 1, 0, 2, 3 (the tie 2, 3 to the lower id).
    for (min_keep, want) in [(1, vec![1]), (2, vec![0, 1]), (3, vec![0, 1, 2])] {
        let mut p = Typical::new(0.2).unwrap().with_min_keep(min_keep).unwrap();
        assert_eq!(kept(&applied(&mut p, &row)), want, "min_keep {min_keep}");
    }
    let mut p = Typical::new(0.2).unwrap().with_min_keep(9).unwrap();
    assert_eq!(kept(&applied(&mut p, &row)), [0, 1, 2, 3]);
    // 1 is off; one finite logit is unchanged; -inf entries are not candidates.
    assert_eq!(applied(&mut Typical::new(1.0).unwrap(), &row), row);
    let one = [NEG, 2.0, NEG];
    assert_eq!(applied(&mut Typical::new(0.1).unwrap(), &one), one);
    let masked = dyadic(&[Some(0), None, Some(1), Some(2), None, Some(2)]);
    assert_eq!(
        kept(&applied(&mut Typical::new(0.75).unwrap(), &masked)),
        [0, 2, 3]
    );
    // A uniform row: every score 0, the order is by id; 4 tokens of 0.25, p = 0.5 is hit
    // exactly after two, so three are kept: {0, 1, 2}.
    let flat = [1.5f32; 4];
    assert_eq!(
        kept(&applied(&mut Typical::new(0.5).unwrap(), &flat)),
        [0, 1, 2]
    );
}

#[test]
fn typical_matches_the_f64_oracle_on_random_rows() {
    for (typ, min_keep) in [
        (0.2, 1),
        (0.5, 1),
        (0.9, 1),
        (0.95, 3),
        (0.99, 1),
        (0.3, 50),
    ] {
        against_oracle(
            &format!("typical {typ} min_keep {min_keep}"),
            || Box::new(Typical::new(typ).unwrap().with_min_keep(min_keep).unwrap()),
            |row| typical_oracle(row, typ, min_keep),
            3,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Top-n-sigma
// ---------------------------------------------------------------------------------------------

#[test]
fn top_n_sigma_hand_cases_keep_the_threshold() {
    // [-4, 0 x 6, 4]: mean 0, population variance (16 + 16) / 8 = 4, sigma 2, max 4.
    let row = [-4.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0];
    // n = 2: threshold 4 - 4 = 0 exactly; the zeros are kept (l >= threshold), -4 is not.
    let out = applied(&mut TopNSigma::new(2.0).unwrap(), &row);
    assert_eq!(out, [NEG, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0]);
    // n = 1.999: threshold 0.002 > 0: only the maximum.
    assert_eq!(
        kept(&applied(&mut TopNSigma::new(1.999).unwrap(), &row)),
        [7]
    );
    // n = 4: threshold -4 exactly: all kept; n = 3.99: threshold -3.98, -4 removed.
    assert_eq!(applied(&mut TopNSigma::new(4.0).unwrap(), &row), row);
    assert_eq!(
        kept(&applied(&mut TopNSigma::new(3.99).unwrap(), &row)),
        [1, 2, 3, 4, 5, 6, 7]
    );
    // -inf entries are not in the statistics (else the mean would be -inf).
    let mut masked = row.to_vec();
    masked.extend([NEG, NEG]);
    let out = applied(&mut TopNSigma::new(2.0).unwrap(), &masked);
    assert_eq!(kept(&out), [1, 2, 3, 4, 5, 6, 7]);
    // n <= 0 is off; one finite logit is unchanged.
    for n in [0.0, -1.0] {
        assert_eq!(applied(&mut TopNSigma::new(n).unwrap(), &row), row);
    }
    assert_eq!(
        applied(&mut TopNSigma::new(0.1).unwrap(), &[NEG, 3.0]),
        [NEG, 3.0]
    );
}

#[test]
fn top_n_sigma_matches_the_f64_oracle_on_random_rows() {
    for n in [0.5, 1.0, 2.0, 3.0] {
        against_oracle(
            &format!("top_n_sigma {n}"),
            || Box::new(TopNSigma::new(n).unwrap()),
            |row| {
                let ids = kept(row);
                let vals: Vec<f64> = ids.iter().map(|&i| f64::from(row[i as usize])).collect();
                if vals.len() <= 1 {
                    return Some(ids);
                }
                let mean = vals.iter().sum::<f64>() / vals.len() as f64;
                let var =
                    vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / vals.len() as f64;
                let max = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let threshold = max - n * var.sqrt();
                if vals
                    .iter()
                    .any(|v| (v - threshold).abs() < 1e-9 * (1.0 + threshold.abs()))
                {
                    return None;
                }
                Some(
                    ids.into_iter()
                        .filter(|&i| f64::from(row[i as usize]) >= threshold)
                        .collect(),
                )
            },
            // Two distinct values [a, b] with n = 2: max - 2 sigma is exactly the smaller one.
            6,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Dynamic temperature
// ---------------------------------------------------------------------------------------------

#[test]
fn dynatemp_hand_cases_map_the_normalised_entropy() {
    // A uniform row: H = ln 4 = max entropy, normalised 1 -> T = t + range = 1.5; 3 / 1.5 = 2.
    let mut p = DynamicTemperature::new(1.0, 0.5, 1.0).unwrap();
    assert_eq!(applied(&mut p, &[3.0; 4]), [2.0; 4]);
    // With -inf entries the candidates are the finite ones: n = 3, H = ln 3, normalised 1.
    assert_eq!(applied(&mut p, &[3.0, NEG, 3.0, 3.0]), [2.0, NEG, 2.0, 2.0]);
    // One-hot-like: exp(-200) is 0 in f32, H = 0 -> T = max(0, t - range) = 0.5.
    assert_eq!(
        applied(&mut p, &[0.0, -200.0, -200.0]),
        [0.0, -400.0, -400.0]
    );
    // ... and with t - range <= 0, T = 0: llama.cpp's temp <= 0 keeps only the maximum.
    let mut p = DynamicTemperature::new(0.5, 1.0, 1.0).unwrap();
    assert_eq!(applied(&mut p, &[-200.0, 0.0, -200.0]), [NEG, 0.0, NEG]);
    // [0, -200, 0, -200]: H = ln 2, n = 4, normalised ln 2 / ln 4 = 1/2; exponent 2 -> 1/4;
    // t = 1, range 1: T = 0 + 2 * 1/4 = 0.5.
    let mut p = DynamicTemperature::new(1.0, 1.0, 2.0).unwrap();
    assert_eq!(
        applied(&mut p, &[0.0, -200.0, 0.0, -200.0]),
        [0.0, -400.0, 0.0, -400.0]
    );
    // probs [0.5, 0.25, 0.25]: H = 1.5 ln 2, normalised 1.5 ln 2 / ln 3 = 0.946395;
    // t = 1, range 0.5: T = 0.5 + 1 * 0.946395 = 1.446395.
    let row = dyadic(&[Some(0), Some(1), Some(1)]);
    let mut p = DynamicTemperature::new(1.0, 0.5, 1.0).unwrap();
    let out = applied(&mut p, &row);
    let t = 1.446_394_630_357_186f64;
    let want: Vec<f64> = row.iter().map(|&l| f64::from(l) / t).collect();
    let got: Vec<f64> = out.iter().map(|&l| f64::from(l)).collect();
    assert_close(&got, &want, 1e-6, "dynatemp 1 +- 0.5");
    // Exponent 0: (anything)^0 = 1 -> T = t + range = 1.5 on any row.
    let mut p = DynamicTemperature::new(1.0, 0.5, 0.0).unwrap();
    assert_eq!(applied(&mut p, &[3.0, 0.0, -3.0]), [2.0, 0.0, -2.0]);
    // Range <= 0: the plain temperature t (a pure division).
    let mut p = DynamicTemperature::new(2.0, 0.0, 1.0).unwrap();
    assert_eq!(applied(&mut p, &[2.0, 4.0, NEG]), [1.0, 2.0, NEG]);
    // One finite logit with range on: unchanged (llama.cpp returns early).
    let mut p = DynamicTemperature::new(1.0, 0.5, 1.0).unwrap();
    assert_eq!(applied(&mut p, &[NEG, 3.0]), [NEG, 3.0]);
}

#[test]
fn dynatemp_matches_the_f64_oracle_on_random_rows() {
    for (t, range, exponent) in [(1.0, 0.5, 1.0), (0.8, 0.8, 2.0), (1.5, 1.0, 0.5)] {
        let mut p = DynamicTemperature::new(t, range, exponent).unwrap();
        for (r, row) in random_rows().iter().enumerate() {
            let ids = kept(row);
            let out = applied(&mut p, row);
            if ids.len() <= 1 {
                assert_eq!(out, *row);
                continue;
            }
            let (probs, _, _) = probs64(row);
            let ne = entropy64(&probs) / (ids.len() as f64).ln();
            let lo = (t - range).max(0.0);
            let temp = lo + (t + range - lo) * ne.powf(exponent);
            if temp as f32 == 0.0 {
                // T = 0: only the maximum (lowest id among ties) stays.
                assert_eq!(kept(&out), best(row, 1), "dynatemp row {r}: T = 0");
                continue;
            }
            for i in 0..row.len() {
                let want = f64::from(row[i]) / temp;
                let got = f64::from(out[i]);
                assert!(
                    (got == want) || (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "dynatemp row {r} id {i}: got {got}, want {want}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Log-softmax
// ---------------------------------------------------------------------------------------------

#[test]
fn log_softmax_hand_cases() {
    // [1, 1]: logsumexp = 1 + ln 2, so each becomes -ln 2; -inf stays -inf.
    let ln2 = std::f64::consts::LN_2;
    let out = applied(&mut LogSoftmax::new(), &[1.0, NEG, 1.0]);
    assert_eq!(out, [-ln2 as f32, NEG, -ln2 as f32]);
    // probs [0.5, 0.25, 0.125, 0.125] -> [-ln 2, -2 ln 2, -3 ln 2, -3 ln 2].
    let out = applied(&mut LogSoftmax::new(), &row_8421());
    let got: Vec<f64> = out.iter().map(|&l| f64::from(l)).collect();
    assert_close(
        &got,
        &[-ln2, -2.0 * ln2, -3.0 * ln2, -3.0 * ln2],
        1e-6,
        "ln p",
    );
    // An all -inf row is unchanged.
    assert_eq!(applied(&mut LogSoftmax::new(), &[NEG, NEG]), [NEG, NEG]);
    // The distribution is unchanged, the logits' signs are not: [1, 1], token 0 seen,
    // repetition penalty 2. Alone: l0 = 1 > 0 -> 0.5, p0 = e^0.5 / (e^0.5 + e) = 0.377541.
    // After log-softmax: l0 = -ln 2 < 0 -> -2 ln 2, p0 = 1/4 / (1/4 + 1/2) = 1/3.
    for (with, p0) in [(false, 0.377_540_668_798_145_4), (true, 1.0 / 3.0)] {
        let mut chain = SamplerChain::new(Selection::sample(Some(1)));
        if with {
            chain.push(LogSoftmax::new());
        }
        chain.push(RepetitionPenalty::new(2.0).unwrap());
        chain.reset(&[0]);
        let d = chain
            .distribution(&[1.0, 1.0], &ProcessorContext::new(&[0], &[], 1))
            .unwrap();
        assert!((d[0] - p0).abs() < 1e-6, "log_softmax {with}: {d:?}");
    }
}

#[test]
fn log_softmax_matches_the_f64_oracle_on_random_rows() {
    for row in random_rows() {
        let out = applied(&mut LogSoftmax::new(), &row);
        let max = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &l| m.max(f64::from(l)));
        let lse = max
            + row
                .iter()
                .map(|&l| (f64::from(l) - max).exp())
                .sum::<f64>()
                .ln();
        for (i, (&l, &o)) in row.iter().zip(&out).enumerate() {
            if l == NEG {
                assert_eq!(o, NEG);
                continue;
            }
            let want = f64::from(l) - lse;
            let got = f64::from(o);
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "log_softmax id {i}: got {got}, want {want}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Epsilon and eta
// ---------------------------------------------------------------------------------------------

#[test]
fn epsilon_hand_cases_straddle_the_cutoff() {
    // probs [0.5, 0.25, 0.125, 0.125].
    let row = row_8421();
    let eps = |e: f64, k: usize| Epsilon::new(e).unwrap().with_min_keep(k).unwrap();
    // 0.125 < 0.125 is false: all stay. 0.126: tokens 2, 3 go -> [2/3, 1/3, 0, 0].
    assert_eq!(applied(&mut eps(0.125, 1), &row), row);
    let d = dist(vec![Box::new(eps(0.126, 1))], &row);
    assert_close(
        &d,
        &[2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0],
        1e-12,
        "epsilon 0.126",
    );
    assert_eq!(kept(&applied(&mut eps(0.3, 1), &row)), [0]);
    // Nothing reaches 0.6: the best token stays (min_keep 1).
    assert_eq!(kept(&applied(&mut eps(0.6, 1), &row)), [0]);
    // min_keep 3 with 0.3: one survivor, so the 3 best: 0, 1 and 2 (2 ties 3: lower id).
    let d = dist(vec![Box::new(eps(0.3, 3))], &row);
    assert_close(
        &d,
        &[4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0, 0.0],
        1e-12,
        "min_keep 3",
    );
    assert_eq!(kept(&applied(&mut eps(0.126, 2), &row)), [0, 1]);
    // A uniform row of 0.25 under 0.3: exactly one token, the lowest id (Hugging Face's
    // `scores < topk(...)[-1]` would keep all four ties).
    assert_eq!(kept(&applied(&mut eps(0.3, 1), &[0.0; 4])), [0]);
    // -inf entries are not candidates: [0, -inf, -a] has probs [2/3, 0, 1/3].
    let masked = dyadic(&[Some(0), None, Some(1)]);
    assert_eq!(kept(&applied(&mut eps(0.3, 1), &masked)), [0, 2]);
    assert_eq!(kept(&applied(&mut eps(0.34, 1), &masked)), [0]);
}

#[test]
fn eta_hand_cases_take_the_smaller_threshold() {
    let eta = |e: f64, k: usize| Eta::new(e).unwrap().with_min_keep(k).unwrap();
    // probs [0.5, 0.25, 0.125, 0.125]: H = 1.75 ln 2, exp(-H) = 2^-1.75 = 0.297302.
    // epsilon 0.17: sqrt(0.17) 0.297302 = 0.122581 < 0.17 -> eta 0.122581 < 0.125: all stay.
    // epsilon 0.18: sqrt(0.18) 0.297302 = 0.126134 -> tokens 2, 3 (0.125) go.
    let row = row_8421();
    assert_eq!(applied(&mut eta(0.17, 1), &row), row);
    let d = dist(vec![Box::new(eta(0.18, 1))], &row);
    assert_close(&d, &[2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0], 1e-12, "eta 0.18");
    assert_eq!(kept(&applied(&mut eta(0.18, 3), &row)), [0, 1, 2]);
    // probs [8/9, 1/18, 1/18] (weights 1, 1/16, 1/16): H = 8/9 ln(9/8) + 1/9 ln 18 = 0.425848,
    // sqrt(eps) exp(-H) = 0.653215 sqrt(eps) > eps for eps < 0.4267: eta = epsilon.
    // epsilon 0.06 > 1/18 = 0.055556: tokens 1, 2 go; epsilon 0.05 < 1/18: all stay.
    let row = dyadic(&[Some(0), Some(4), Some(4)]);
    assert_eq!(kept(&applied(&mut eta(0.06, 1), &row)), [0]);
    assert_eq!(applied(&mut eta(0.05, 1), &row), row);
}

#[test]
fn epsilon_and_eta_match_the_f64_oracle_on_random_rows() {
    for (e, k) in [(3e-4, 1), (0.01, 1), (0.05, 1), (0.01, 20), (0.2, 3)] {
        against_oracle(
            &format!("epsilon {e} min_keep {k}"),
            || Box::new(Epsilon::new(e).unwrap().with_min_keep(k).unwrap()),
            |row| cutoff_oracle(row, e, k),
            3,
        );
        against_oracle(
            &format!("eta {e} min_keep {k}"),
            || Box::new(Eta::new(e).unwrap().with_min_keep(k).unwrap()),
            |row| {
                let (p, _, _) = probs64(row);
                let eta = e.min(e.sqrt() * (-entropy64(&p)).exp());
                cutoff_oracle(row, eta, k)
            },
            3,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Top-h
// ---------------------------------------------------------------------------------------------

#[test]
fn top_h_hand_cases() {
    // A uniform row of 4: q = 1/4, H = ln 4, each term -q ln q = ln 4 / 4. top_h 0.5: tau =
    // ln 4 / 2; C_1 = ln 4 / 4 <= tau, C_2 = ln 4 / 2 = tau (exact: doubling) is kept (<=),
    // C_3 > tau: {0, 1}. top_h 0.49: C_2 > tau: {0}.
    let flat = [0.0f32; 4];
    assert_eq!(kept(&applied(&mut TopH::new(0.5).unwrap(), &flat)), [0, 1]);
    assert_eq!(kept(&applied(&mut TopH::new(0.49).unwrap(), &flat)), [0]);
    // probs [0.5, 0.25, 0.25]: H = 1.5 ln 2; terms 0.5 ln 2 each; C = 0.5, 1, 1.5 (x ln 2).
    // top_h 0.6: tau = 0.9 ln 2: {0}; top_h 0.7: tau = 1.05 ln 2: {0, 1}.
    let row = dyadic(&[Some(0), Some(1), Some(1)]);
    assert_eq!(kept(&applied(&mut TopH::new(0.6).unwrap(), &row)), [0]);
    let d = dist(vec![Box::new(TopH::new(0.7).unwrap())], &row);
    assert_close(&d, &[2.0 / 3.0, 1.0 / 3.0, 0.0], 1e-12, "top_h 0.7");
    // Only the 100 best are candidates: 150 equal logits -> ids 0..99 (ties to the lower
    // id), q = 1/100, C_k = k ln 100 / 100; top_h 0.505: k <= 50.5, so ids 0..49.
    let wide = [1.0f32; 150];
    let out = applied(&mut TopH::new(0.505).unwrap(), &wide);
    assert_eq!(kept(&out), (0..50).collect::<Vec<u32>>());
    // A zero f32 probability ends the prefix (Hugging Face: 0 log 0 is NaN): [0, 0, -200]:
    // q = 1/2, 1/2, 0; top_h 1, tau = ln 2; C_2 = ln 2 <= tau keeps token 1; token 2 goes.
    assert_eq!(
        kept(&applied(&mut TopH::new(1.0).unwrap(), &[0.0, 0.0, -200.0])),
        [0, 1]
    );
    // One finite logit: unchanged.
    assert_eq!(
        applied(&mut TopH::new(0.3).unwrap(), &[NEG, 1.0]),
        [NEG, 1.0]
    );
}

#[test]
fn top_h_matches_the_f64_oracle_on_random_rows() {
    for top_h in [0.1, 0.4, 0.8, 0.95] {
        against_oracle(
            &format!("top_h {top_h}"),
            || Box::new(TopH::new(top_h).unwrap()),
            |row| top_h_oracle(row, top_h),
            3,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// min_keep on top-k, top-p, min-p
// ---------------------------------------------------------------------------------------------

#[test]
fn min_keep_hand_cases_on_top_k_top_p_min_p() {
    let row = common::ln_row(&[0.4, 0.3, 0.2, 0.1]);
    // top_k 2, min_keep 3: k = max(2, 3) = 3 -> [4/9, 3/9, 2/9, 0]. Off stays off.
    let d = dist(
        vec![Box::new(TopK::new(2).unwrap().with_min_keep(3).unwrap())],
        &row,
    );
    assert_close(&d, &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, 0.0], 1e-6, "top_k");
    let mut off = TopK::new(0).unwrap().with_min_keep(3).unwrap();
    assert_eq!(applied(&mut off, &row), row);
    let mut k1 = TopK::new(1).unwrap().with_min_keep(2).unwrap();
    assert_eq!(kept(&applied(&mut k1, &[5.0, 5.0, 5.0])), [0, 1]);
    // top_p 0.5: 0.4 < 0.5 <= 0.7 keeps 2; min_keep 3 keeps 3. top_p 0.8 already keeps 3.
    let d = dist(
        vec![Box::new(TopP::new(0.5).unwrap().with_min_keep(3).unwrap())],
        &row,
    );
    assert_close(&d, &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, 0.0], 1e-6, "top_p");
    let mut p = TopP::new(0.8).unwrap().with_min_keep(2).unwrap();
    assert_eq!(kept(&applied(&mut p, &row)), [0, 1, 2]);
    // min_p: weights relative to the max 1, 0.75, 0.5, 0.25. min_p 0.6 keeps {0, 1}, which
    // is enough for min_keep 2; min_p 0.8 keeps {0}, so min_keep 2 gives {0, 1}, 3 {0, 1, 2}.
    let mp = |p: f64, k: usize| MinP::new(p).unwrap().with_min_keep(k).unwrap();
    assert_eq!(kept(&applied(&mut mp(0.6, 2), &row)), [0, 1]);
    assert_eq!(kept(&applied(&mut mp(0.8, 2), &row)), [0, 1]);
    assert_eq!(kept(&applied(&mut mp(0.8, 3), &row)), [0, 1, 2]);
    assert_eq!(kept(&applied(&mut mp(0.8, 9), &row)), [0, 1, 2, 3]);
    // Ties at the min_keep boundary go to the lower id: [3, 1, 1, 1], min_p 0.9, min_keep 2.
    assert_eq!(
        kept(&applied(&mut mp(0.9, 2), &[3.0, 1.0, 1.0, 1.0])),
        [0, 1]
    );
    // -inf entries are not survivors: [-inf, ln 0.4, -inf, ln 0.3, ln 0.2] with min_p 0.8
    // passes only id 1, so min_keep 2 keeps ids 1 and 3 (an earlier draft counted the -inf
    // entries as passing and kept one token).
    let masked = [NEG, row[0], NEG, row[1], row[2]];
    assert_eq!(kept(&applied(&mut mp(0.8, 2), &masked)), [1, 3]);
    let mut e = Epsilon::new(0.6).unwrap().with_min_keep(2).unwrap();
    assert_eq!(kept(&applied(&mut e, &masked)), [1, 3]);
}

#[test]
fn min_keep_filters_match_the_f64_oracle_on_random_rows() {
    for (k, m) in [(1, 5), (5, 2), (20, 40)] {
        against_oracle(
            &format!("top_k {k} min_keep {m}"),
            || Box::new(TopK::new(k as i64).unwrap().with_min_keep(m).unwrap()),
            |row| Some(best(row, k.max(m))),
            0,
        );
    }
    for (top_p, m) in [(0.1, 5), (0.5, 3), (0.9, 30)] {
        against_oracle(
            &format!("top_p {top_p} min_keep {m}"),
            || Box::new(TopP::new(top_p).unwrap().with_min_keep(m).unwrap()),
            |row| {
                let (p, _, _) = probs64(row);
                let order = by_logit(row);
                let mut cum = 0.0;
                let mut cut = order.len();
                for (j, &i) in order.iter().enumerate() {
                    cum += p[i as usize];
                    if (cum - top_p).abs() < MASS_MARGIN {
                        return None;
                    }
                    if cum >= top_p {
                        cut = j + 1;
                        break;
                    }
                }
                let mut ids = order[..cut.max(m).min(order.len())].to_vec();
                ids.sort_unstable();
                Some(ids)
            },
            3,
        );
    }
    for (min_p, m) in [(0.1, 5), (0.5, 2), (0.9, 10)] {
        against_oracle(
            &format!("min_p {min_p} min_keep {m}"),
            || Box::new(MinP::new(min_p).unwrap().with_min_keep(m).unwrap()),
            |row| {
                let max = row
                    .iter()
                    .fold(f64::NEG_INFINITY, |a, &l| a.max(f64::from(l)));
                let rel = |i: u32| (f64::from(row[i as usize]) - max).exp();
                let ids = kept(row);
                if ids.iter().any(|&i| (rel(i) - min_p).abs() < 1e-6) {
                    return None;
                }
                let pass: Vec<u32> = ids.into_iter().filter(|&i| rel(i) >= min_p).collect();
                Some(if pass.len() < m { best(row, m) } else { pass })
            },
            3,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Parameter validation
// ---------------------------------------------------------------------------------------------

#[test]
fn bad_parameters_are_errors_naming_the_field() {
    let nan = f64::NAN;
    let inf = f64::INFINITY;
    let field = |r: Result<(), nucleus_sampling::ParamError>| r.unwrap_err().field;
    for p in [0.0, -0.1, 1.5, nan] {
        assert_eq!(field(Typical::new(p).map(drop)), "typical_p", "{p}");
    }
    for n in [nan, inf, -inf] {
        assert_eq!(field(TopNSigma::new(n).map(drop)), "top_n_sigma", "{n}");
    }
    for e in [0.0, 1.0, -0.5, nan, inf] {
        assert_eq!(field(Epsilon::new(e).map(drop)), "epsilon_cutoff", "{e}");
        assert_eq!(field(Eta::new(e).map(drop)), "eta_cutoff", "{e}");
    }
    for h in [0.0, 1.1, -1.0, nan] {
        assert_eq!(field(TopH::new(h).map(drop)), "top_h", "{h}");
    }
    let dt = |t, r, e| DynamicTemperature::new(t, r, e).map(drop);
    assert_eq!(field(dt(1.0, nan, 1.0)), "dynatemp_range");
    assert_eq!(field(dt(1.0, inf, 1.0)), "dynatemp_range");
    assert_eq!(field(dt(1.0, 1e300, 1.0)), "dynatemp_range");
    assert_eq!(field(dt(1.0, 0.5, -1.0)), "dynatemp_exponent");
    assert_eq!(field(dt(1.0, 0.5, nan)), "dynatemp_exponent");
    assert_eq!(field(dt(0.0, 0.0, 1.0)), "temperature");
    assert_eq!(field(dt(-1.0, 0.5, 1.0)), "temperature");
    assert_eq!(field(dt(nan, 0.5, 1.0)), "temperature");
    assert!(dt(0.0, 0.5, 1.0).is_ok(), "t 0 with a range is allowed");
    // min_keep 0: Hugging Face requires a positive integer.
    assert_eq!(
        field(TopK::new(5).unwrap().with_min_keep(0).map(drop)),
        "min_keep"
    );
    assert_eq!(
        field(TopP::new(0.5).unwrap().with_min_keep(0).map(drop)),
        "min_keep"
    );
    assert_eq!(
        field(MinP::new(0.5).unwrap().with_min_keep(0).map(drop)),
        "min_keep"
    );
    assert_eq!(
        field(Typical::new(0.5).unwrap().with_min_keep(0).map(drop)),
        "min_keep"
    );
    assert_eq!(
        field(Epsilon::new(0.1).unwrap().with_min_keep(0).map(drop)),
        "min_keep"
    );
    assert_eq!(
        field(Eta::new(0.1).unwrap().with_min_keep(0).map(drop)),
        "min_keep"
    );

    // The same through JSON: a ParamError naming the field.
    let cases = [
        (r#"{"typical": {"p": 0}}"#, "typical_p"),
        (r#"{"typical": {"p": 0.5, "min_keep": 0}}"#, "min_keep"),
        (r#"{"top_n_sigma": {"n": "nan"}}"#, "top_n_sigma"),
        (
            r#"{"dynatemp": {"t": 1, "range": "inf"}}"#,
            "dynatemp_range",
        ),
        (
            r#"{"dynatemp": {"t": 1, "range": 1, "exponent": -2}}"#,
            "dynatemp_exponent",
        ),
        (r#"{"dynatemp": {"t": 0, "range": 0}}"#, "temperature"),
        (r#"{"epsilon": {"epsilon": 1}}"#, "epsilon_cutoff"),
        (r#"{"eta": {"epsilon": 0}}"#, "eta_cutoff"),
        (r#"{"top_h": {"top_h": 0}}"#, "top_h"),
        (r#"{"top_k": {"k": 3, "min_keep": 0}}"#, "min_keep"),
        (r#"{"top_p": {"p": 0.5, "min_keep": 0}}"#, "min_keep"),
        (r#"{"min_p": {"p": 0.5, "min_keep": 0}}"#, "min_keep"),
    ];
    for (entry, want) in cases {
        let c: Vec<ProcessorConfig> =
            serde_json::from_str(&format!(r#"[{entry}, {{"greedy": {{}}}}]"#))
                .unwrap_or_else(|e| panic!("{entry}: {e}"));
        match SamplerChain::from_config(&c) {
            Err(ChainError::InvalidParams {
                index: 0, source, ..
            }) => assert_eq!(source.field, want, "{entry}"),
            other => panic!("{entry}: {other:?}"),
        }
    }
    // Unknown fields are serde errors.
    for entry in [
        r#"{"typical": {"typical_p": 0.5}}"#,
        r#"{"eta": {"eta": 0.1}}"#,
        r#"{"log_softmax": {"x": 1}}"#,
    ] {
        let r: Result<Vec<ProcessorConfig>, _> =
            serde_json::from_str(&format!(r#"[{entry}, {{"greedy": {{}}}}]"#));
        assert!(r.is_err(), "{entry}");
    }
}

// ---------------------------------------------------------------------------------------------
// JSON configuration
// ---------------------------------------------------------------------------------------------

#[test]
fn config_round_trips_and_builds_the_processors() {
    let json = r#"[
        {"typical": {"p": 0.9}},
        {"typical": {"p": 0.8, "min_keep": 2}},
        {"top_n_sigma": {"n": 1.5}},
        {"dynatemp": {"t": 1.0, "range": 0.5}},
        {"dynatemp": {"t": 1.0, "range": 0.5, "exponent": 2.0}},
        {"epsilon": {"epsilon": 0.0003}},
        {"eta": {"epsilon": 0.0004, "min_keep": 3}},
        {"top_h": {"top_h": 0.4}},
        {"log_softmax": {}},
        {"top_k": {"k": 5, "min_keep": 7}},
        {"top_p": {"p": 0.9, "min_keep": 2}},
        {"min_p": {"p": 0.1, "min_keep": 3}},
        {"sample": {"seed": 3}}
    ]"#;
    let config: Vec<ProcessorConfig> = serde_json::from_str(json).unwrap();
    assert_eq!(
        config[3],
        ProcessorConfig::Dynatemp {
            t: 1.0,
            range: 0.5,
            exponent: 1.0
        }
    );
    assert_eq!(
        config[0],
        ProcessorConfig::Typical {
            p: 0.9,
            min_keep: 1
        }
    );
    let text = serde_json::to_string(&config).unwrap();
    let again: Vec<ProcessorConfig> = serde_json::from_str(&text).unwrap();
    assert_eq!(again, config);
    // Defaults are omitted: min_keep 1, exponent 1.
    assert!(text.contains(r#"{"typical":{"p":0.9}}"#), "{text}");
    assert!(
        text.contains(r#"{"dynatemp":{"t":1.0,"range":0.5}}"#),
        "{text}"
    );
    assert!(text.contains(r#"{"log_softmax":{}}"#), "{text}");
    assert!(text.contains(r#"{"top_k":{"k":5,"min_keep":7}}"#), "{text}");
    // The existing forms are unchanged.
    let old: Vec<ProcessorConfig> =
        serde_json::from_str(r#"[{"top_k":{"k":2}},{"top_p":{"p":0.5}},{"min_p":{"p":0.1}}]"#)
            .unwrap();
    assert_eq!(
        serde_json::to_string(&old).unwrap(),
        r#"[{"top_k":{"k":2}},{"top_p":{"p":0.5}},{"min_p":{"p":0.1}}]"#
    );

    let chain = SamplerChain::from_config(&config).unwrap();
    let names: Vec<&str> = chain.processors().iter().map(|p| p.name()).collect();
    assert_eq!(
        names,
        [
            "typical",
            "typical",
            "top_n_sigma",
            "dynatemp",
            "dynatemp",
            "epsilon",
            "eta",
            "top_h",
            "log_softmax",
            "top_k",
            "top_p",
            "min_p"
        ]
    );
    for c in &config[..config.len() - 1] {
        assert_eq!(c.to_processor().unwrap().unwrap().name(), c.name());
    }
    // min_keep reaches the processor: top_k 5 with min_keep 7 keeps 7 of 10.
    let c: Vec<ProcessorConfig> =
        serde_json::from_str(r#"[{"top_k": {"k": 5, "min_keep": 7}}, {"greedy": {}}]"#).unwrap();
    let mut chain = SamplerChain::from_config(&c).unwrap();
    let row: Vec<f32> = (0..10).map(|i| i as f32).collect();
    assert_eq!(
        kept(chain.process(&row, &ctx0()).unwrap()),
        [3, 4, 5, 6, 7, 8, 9]
    );
}

// ---------------------------------------------------------------------------------------------
// Chain order
// ---------------------------------------------------------------------------------------------

#[test]
fn top_n_sigma_commutes_with_temperature() {
    // [-4, 0 x 6, 4] at T = 0.5 is [-8, 0 x 6, 8]: sigma 4, threshold 8 - 2 * 4 = 0: the same
    // set either way.
    let row = [-4.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0];
    let both = |first_t: bool, t: f64, n: f64, row: &[f32]| {
        let mut chain = SamplerChain::new(Selection::greedy());
        let temp = Temperature::new(t).unwrap();
        let sigma = TopNSigma::new(n).unwrap();
        if first_t {
            chain.push(temp).push(sigma);
        } else {
            chain.push(sigma).push(temp);
        }
        kept(chain.process(row, &ctx0()).unwrap())
    };
    assert_eq!(both(true, 0.5, 2.0, &row), [1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(both(false, 0.5, 2.0, &row), [1, 2, 3, 4, 5, 6, 7]);
    // Random rows, away from the threshold.
    let mut compared = 0;
    for row in random_rows().iter().filter(|r| r.len() <= 32000) {
        let vals: Vec<f64> = row
            .iter()
            .filter(|&&l| l != NEG)
            .map(|&l| f64::from(l))
            .collect();
        let mean = vals.iter().sum::<f64>() / vals.len() as f64;
        let sd = (vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / vals.len() as f64).sqrt();
        let max = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        for (t, n) in [(0.5, 1.0), (0.7, 2.0), (2.0, 0.5)] {
            let thr = max - n * sd;
            if vals
                .iter()
                .any(|v| (v - thr).abs() < 1e-4 * (1.0 + thr.abs()))
            {
                continue;
            }
            assert_eq!(both(true, t, n, row), both(false, t, n, row), "T {t} n {n}");
            compared += 1;
        }
    }
    assert!(compared > 150, "{compared}");
}

#[test]
fn epsilon_does_not_commute_with_temperature() {
    // probs [0.5, 0.25, 0.125, 0.125], epsilon 0.126. Epsilon first: tokens 2, 3 go.
    // Temperature 2 first: weights 1, 2^-0.5, 1/2, 1/2, z = 2.7071, probs 0.369, 0.261,
    // 0.185, 0.185: all pass 0.126.
    let row = row_8421();
    let eps = || Box::new(Epsilon::new(0.126).unwrap()) as Box<dyn LogitsProcessor>;
    let temp = || Box::new(Temperature::new(2.0).unwrap()) as Box<dyn LogitsProcessor>;
    let support = |d: Vec<f64>| (0..d.len()).filter(|&i| d[i] > 0.0).collect::<Vec<_>>();
    assert_eq!(support(dist(vec![eps(), temp()], &row)), [0, 1]);
    assert_eq!(support(dist(vec![temp(), eps()], &row)), [0, 1, 2, 3]);
}

#[test]
fn dynatemp_without_range_is_the_temperature_processor() {
    for row in random_rows().iter().take(30) {
        for t in [0.3, 1.0, 1.7] {
            let a = applied(&mut DynamicTemperature::new(t, 0.0, 1.0).unwrap(), row);
            let b = applied(&mut Temperature::new(t).unwrap(), row);
            assert_eq!(a, b);
        }
    }
}
