//! Large rows (8,193 to 327,680 ids) against the f64 oracle of spec/sampling.md: the
//! selection steps 6-11 (greedy, top-k, min-p, top-p, plain temperature sampling, logits near
//! ±3e38 that take the exact fallback of step 7, exact boundaries with probability input).
//! Steps 1-5 and the row formats are in `large_rows/inputs.rs`; what every case asserts and
//! where its expected answer comes from are in `common/large_rows.rs`.

use crate::common;

use common::large_rows::*;
use common::oracle::oracle_with_stops;
use common::{inverse_cdf, normal_row, spec_uniform, SplitMix};
use nucleus_sampling::{
    distribution, distribution_from_probs, sample_row, sample_row_from_probs, SampleRequest,
    SamplingParams,
};

// ---------------------------------------------------------------------------------------------
// Greedy

/// Step 6: the argmax, ties to the lowest id, wherever the maxima lie relative to runs, blocks
/// and chunks; at temperature 0, below 1e-5 (other filters ignored) and as top_k = 1.
#[test]
fn greedy_argmax_wherever_the_maxima_lie() {
    let mut t = Tally::new("greedy");
    for (s, &n) in SIZES.iter().enumerate() {
        let base = normal_row(100 + s as u64, n, 3.0);
        let last_run = (n - 1) / 32 * 32;
        let last_block = (n - 1) / 512 * 512;
        let scenarios: [(&str, Vec<usize>); 12] = [
            ("max at id 0", vec![0]),
            ("max at vocab-1", vec![n - 1]),
            ("tie at vocab-2 and vocab-1", vec![n - 1, n - 2]),
            ("ties in three blocks", vec![7 * 512 + 100, 3 * 512 + 5, 40]),
            ("tie across a run boundary", vec![32, 31]),
            ("tie across a block boundary", vec![512, 511]),
            ("tie across a chunk boundary", vec![8_192, 8_191]),
            ("tie in the last run", vec![n - 1, last_run]),
            ("max at vocab-1 tied with id 0", vec![n - 1, 0]),
            ("tie at both ends of a block", vec![1_535, 1_024]),
            (
                "max in the last block",
                vec![last_block + (n - 1 - last_block) / 2],
            ),
            (
                "tie of 64 ids, one per block",
                (0..64).map(|b| (n - 1 - 37 * b) / 512 * 512 + b).collect(),
            ),
        ];
        for (what, ids) in scenarios {
            let mut row = base.clone();
            for &i in &ids {
                row[i] = 50.0;
            }
            let want = *ids.iter().min().unwrap();
            let params = [
                ("T=0", greedy(s as u64)),
                (
                    "T=5e-6 with top_k 50, top_p 0.3, min_p 0.5",
                    SamplingParams {
                        temperature: 5e-6,
                        top_k: 50,
                        top_p: 0.3,
                        min_p: 0.5,
                        ..seeded(s as u64)
                    },
                ),
                (
                    "top_k 1 at T=0.7",
                    SamplingParams {
                        temperature: 0.7,
                        top_k: 1,
                        ..seeded(s as u64)
                    },
                ),
            ];
            for (j, (pname, p)) in params.iter().enumerate() {
                let name = format!("vocab {n}, {what}, {pname}");
                let c = if j == 0 {
                    check(&mut t, &name, &row, p, &Hist::default())
                } else {
                    let o = one_hot(&row, want, p.is_greedy());
                    check_against(&mut t, &name, &row, p, &Hist::default(), o)
                };
                assert_one_hot(&name, &c, want);
            }
        }
        // One ulp above a tie: the larger value wins although its id is higher. (The oracle
        // calls one ulp a near-tie; without bias or penalties the argmax compares the row's
        // own f32 values, which leaves no room for rounding.)
        let mut row = base.clone();
        row[300] = 50.0;
        row[n - 2] = f32::from_bits(50.0f32.to_bits() + 1);
        row[n - 1] = 50.0;
        for (pname, p) in [
            ("greedy", greedy(9)),
            (
                "top_k 1",
                SamplingParams {
                    top_k: 1,
                    ..seeded(9)
                },
            ),
        ] {
            let name = format!("vocab {n}, max one ulp above a lower tie, {pname}");
            let o = one_hot(&row, n - 2, p.is_greedy());
            let c = check_against(&mut t, &name, &row, &p, &Hist::default(), o);
            assert_one_hot(&name, &c, n - 2);
        }
        // An equal row: id 0.
        let row = vec![-3.5f32; n];
        let name = format!("vocab {n}, equal row");
        let o = one_hot(&row, 0, true);
        let c = check_against(&mut t, &name, &row, &greedy(9), &Hist::default(), o);
        assert_one_hot(&name, &c, 0);
    }
    t.finish(100);
}

/// -0.0 and +0.0 are the same logit (equal weights at any temperature), so at the maximum they
/// tie and the lower id wins, whichever zero it holds. Checked directly, not with the oracle
/// (whose sort uses `total_cmp`, which orders -0.0 below +0.0).
#[test]
fn signed_zeros_at_the_maximum_tie() {
    for &n in &[8_193usize, 32_000] {
        for (lo, hi) in [(37usize, 900usize), (511, 512), (31, n - 1)] {
            for (zl, zh) in [(-0.0f32, 0.0f32), (0.0, -0.0)] {
                let mut row = vec![-1.0f32; n];
                row[lo] = zl;
                row[hi] = zh;
                for p in [
                    greedy(3),
                    SamplingParams {
                        top_k: 1,
                        ..seeded(3)
                    },
                ] {
                    let req = SampleRequest::new(&p, &[], &[], 5);
                    let d = distribution(&row, &req).unwrap();
                    let s = sample_row(&row, &req).unwrap();
                    assert_eq!(
                        (d[lo], s.token as usize),
                        (1.0, lo),
                        "vocab {n}: {zl:?} at {lo}, {zh:?} at {hi}, {p:?}"
                    );
                }
                // Without a filter the two zeros weigh the same.
                let p = seeded(3);
                let d = distribution(&row, &SampleRequest::new(&p, &[], &[], 5)).unwrap();
                assert_eq!(d[lo], d[hi], "vocab {n}: {zl:?} at {lo}, {zh:?} at {hi}");
            }
        }
    }
}

/// Exact weights `exp((l_i - max) / T)` of `kept`, renormalised, in f64.
fn softmax_of(row: &[f32], kept: &[usize], temperature: f64) -> Vec<f64> {
    let max = kept
        .iter()
        .map(|&i| f64::from(row[i]))
        .fold(f64::NEG_INFINITY, f64::max);
    let mut probs = vec![0.0; row.len()];
    for &i in kept {
        probs[i] = ((f64::from(row[i]) - max) / temperature).exp();
    }
    let z: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= z);
    probs
}

/// Asserts that `distribution()` keeps exactly the ids `kept` (in any order).
#[track_caller]
fn assert_kept(name: &str, row: &[f32], p: &SamplingParams, kept: &[usize]) {
    let d = distribution(row, &SampleRequest::new(p, &[], &[], 0)).unwrap();
    let mut want = kept.to_vec();
    want.sort_unstable();
    let got: Vec<usize> = (0..row.len()).filter(|&i| d[i] > 0.0).collect();
    let missing: Vec<usize> = want.iter().copied().filter(|i| d[*i] == 0.0).collect();
    let extra: Vec<usize> = got
        .iter()
        .copied()
        .filter(|i| want.binary_search(i).is_err())
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{name}: {} ids kept, want {} (top_k {}); missing {:?}, extra {:?}",
        got.len(),
        want.len(),
        p.top_k,
        &missing[..missing.len().min(8)],
        &extra[..extra.len().min(8)]
    );
}

/// Top-k with -0.0 and +0.0 tied at the cut (quantised or rounded logits produce both): exactly
/// k ids are kept (spec step 9), and since the two zeros are the same logit, the tie goes to
/// the lowest ids whatever their sign. Min-p and top-p treat the zeros as equal too. Checked
/// against expectations computed here (the oracle's `total_cmp` sort puts -0.0 below +0.0).
#[test]
fn top_k_with_signed_zeros_at_the_cut_keeps_exactly_k() {
    let mut t = Tally::new("signed zeros at a cut");
    // Minimal rows.
    let small: [(&[f32], i64, &[usize]); 5] = [
        (&[1.0, -0.0, 0.0], 2, &[0, 1]),
        (&[-0.0, -1.0, 0.0], 2, &[0, 2]),
        (&[-0.0, -0.0, 0.0, 0.0], 3, &[0, 1, 2]),
        (&[0.0, -0.0, 0.0], 2, &[0, 1]),
        (&[-0.0, 0.0, 2.0], 2, &[0, 2]),
    ];
    for (row, k, kept) in small {
        let p = SamplingParams {
            top_k: k,
            ..seeded(17)
        };
        let name = format!("{row:?}, top_k {k}");
        assert_kept(&name, row, &p, kept);
        let o = given(row, softmax_of(row, kept, 1.0), false);
        check_against(&mut t, &name, row, &p, &Hist::default(), o);
    }
    // Large rows: normal(0, 3) rounded to quarters keeps the sign of the values rounded to 0.
    for (s, &n) in [8_193usize, 50_257, 151_936].iter().enumerate() {
        let row: Vec<f32> = normal_row(3_000 + s as u64, n, 3.0)
            .iter()
            .map(|&x| (x / 0.25).round() * 0.25)
            .collect();
        let positive: Vec<usize> = (0..n).filter(|&i| row[i] > 0.0).collect();
        let zeros: Vec<usize> = (0..n).filter(|&i| row[i] == 0.0).collect();
        let negative_zeros = zeros.iter().filter(|&&i| row[i].is_sign_negative()).count();
        assert!(negative_zeros > 10 && zeros.len() - negative_zeros > 10);
        let nz = zeros.len();
        for (j, m) in [1, nz / 3, nz / 2, nz - 1].into_iter().enumerate() {
            let k = positive.len() + m;
            let temperature = TEMPERATURES[(j + s) % 3].max(1.0);
            let p = SamplingParams {
                top_k: k as i64,
                temperature,
                ..seeded(18 + j as u64)
            };
            let mut kept = positive.clone();
            kept.extend_from_slice(&zeros[..m]);
            let name = format!("vocab {n}, {nz} zeros ({negative_zeros} of them -0.0), top_k {k}");
            assert_kept(&name, &row, &p, &kept);
            let o = given(&row, softmax_of(&row, &kept, temperature), false);
            check_against(&mut t, &name, &row, &p, &Hist::default(), o);
        }
    }
    // Min-p 1 keeps every zero at the maximum; top-p on an all-zero row keeps the lowest ids.
    for &n in &[8_193usize, 32_000] {
        let mut row = vec![-1.0f32; n];
        let ids = [3usize, 31, 32, 511, 512, 4_000, n - 1];
        for (j, &i) in ids.iter().enumerate() {
            row[i] = if j % 2 == 0 { -0.0 } else { 0.0 };
        }
        let p = SamplingParams {
            min_p: 1.0,
            ..seeded(19)
        };
        let name = format!("vocab {n}, ±0 at the maximum, min_p 1");
        check_against(
            &mut t,
            &name,
            &row,
            &p,
            &Hist::default(),
            uniform(&row, &ids),
        );
        let zeros: Vec<f32> = (0..n)
            .map(|i| if i % 3 == 0 { -0.0 } else { 0.0 })
            .collect();
        let p = SamplingParams {
            top_p: 0.5,
            ..seeded(20)
        };
        let m = n.div_ceil(2);
        let first: Vec<usize> = (0..m).collect();
        let name = format!("vocab {n}, ±0 everywhere, top_p 0.5");
        check_against(
            &mut t,
            &name,
            &zeros,
            &p,
            &Hist::default(),
            uniform(&zeros, &first),
        );
    }
    t.finish(100);
}

// ---------------------------------------------------------------------------------------------
// Top-k

/// Step 9, exact k with ties to the lower id, for k from 1 to past vocab/16 (where the top-k
/// buffer gives way to another path) on continuous, heavily tied, ascending (every value beats
/// the running threshold: the buffer compacts again and again) and descending rows.
#[test]
fn top_k_keeps_exactly_k_on_large_rows() {
    let mut t = Tally::new("top_k");
    let kinds = ["normal(0,3)", "quantised 1/4", "ascending", "descending"];
    for (s, &n) in SIZES.iter().enumerate() {
        let v16 = n / 16;
        let ks = [
            1,
            2,
            50,
            1000,
            v16 - 1,
            v16,
            v16 + 1,
            2 * v16,
            n / 2,
            n - 1,
            n,
            n + 5,
        ];
        for (r, kind) in kinds.iter().enumerate() {
            let row = row_kind(kind, 200 + s as u64, n);
            for (j, &k) in ks.iter().enumerate() {
                // Every k on every row of the two smallest sizes; a rotating half elsewhere.
                if s >= 2 && (j + r + s) % 2 == 1 {
                    continue;
                }
                let temperature = TEMPERATURES[(j + r + s) % 3];
                let p = SamplingParams {
                    temperature,
                    top_k: k as i64,
                    ..seeded(1_000 + j as u64)
                };
                let name = format!("vocab {n}, {kind}, top_k {k}, T {temperature}");
                let c = check(&mut t, &name, &row, &p, &Hist::default());
                assert_support_size(&name, &c, k.min(n));
                match *kind {
                    "ascending" => assert!(c.d[n - 1] > 0.0 && (k >= n || c.d[n - 1 - k] == 0.0)),
                    "descending" => assert!(c.d[0] > 0.0 && (k >= n || c.d[k] == 0.0)),
                    _ => {}
                }
            }
        }
    }
    t.finish(95);
}

/// Ties at the k-th value spread over every block (every 7th id): exactly the lowest ids of
/// the tie are kept. Expected values computed here (a tie of 21,706 ids at the cut makes the
/// oracle's near-tie check quadratic).
#[test]
fn top_k_breaks_a_wide_tie_toward_the_lower_ids() {
    let mut t = Tally::new("top_k wide tie");
    for (s, &n) in SIZES.iter().enumerate() {
        // 10 ids at 5.0 and every 7th id at 2.0; the rest below.
        let mut row = normal_row(300 + s as u64, n, 0.3);
        let tied: Vec<usize> = (0..n).step_by(7).collect();
        for &i in &tied {
            row[i] = 2.0;
        }
        let top: Vec<usize> = (0..10)
            .map(|j| (j * 4_099 + 3) % n)
            .filter(|i| i % 7 != 0)
            .collect();
        for &i in &top {
            row[i] = 5.0;
        }
        for k in [
            top.len() + 1,
            top.len() + 33,
            top.len() + 600,
            n / 16,
            n / 8,
        ] {
            let p = SamplingParams {
                top_k: k as i64,
                ..seeded(s as u64)
            };
            let name = format!("vocab {n}, tie of {} ids, top_k {k}", tied.len());
            let kept_ties = k - top.len();
            let mut kept = top.clone();
            kept.extend_from_slice(&tied[..kept_ties]);
            let o = given(&row, softmax_of(&row, &kept, 1.0), false);
            let c = check_against(&mut t, &name, &row, &p, &Hist::default(), o);
            for (j, &i) in tied.iter().enumerate() {
                assert_eq!(c.d[i] > 0.0, j < kept_ties, "{name}: tied id {i} (#{j})");
            }
            for &i in &top {
                assert!(c.d[i] > 0.0, "{name}: top id {i}");
            }
            assert_support_size(&name, &c, k);
        }
    }
    t.finish(100);
}

// ---------------------------------------------------------------------------------------------
// min-p

/// Step 8 on large rows: min_p 0.05, 1e-6 and 1.0 (ties at the maximum spread over blocks are
/// all kept), alone and with top-k and top-p, at three temperatures, on continuous and
/// quantised rows.
#[test]
fn min_p_on_large_rows() {
    let mut t = Tally::new("min_p");
    for (s, &n) in SIZES.iter().enumerate() {
        let cont = normal_row(1_400 + s as u64, n, 3.0);
        let quant = quantised(&cont, 1.0 / 64.0);
        let tie_ids = [0, 31, 32, 511, 512, 4_103, n - 1];
        let mut ties = quant.clone();
        for &i in &tie_ids {
            ties[i] = 30.0;
        }
        for (r, (kind, row)) in [
            ("normal(0,3)", &cont),
            ("quantised 1/64", &quant),
            ("7 ties at the max", &ties),
        ]
        .into_iter()
        .enumerate()
        {
            for (j, min_p) in [0.05, 1e-6, 1.0].into_iter().enumerate() {
                for (extra, top_k, top_p) in [
                    ("alone", 0, 1.0),
                    ("with top_k 1000", 1000, 1.0),
                    ("with top_p 0.9", 0, 0.9),
                ] {
                    let temperature = TEMPERATURES[(s + r + j) % 3];
                    let p = SamplingParams {
                        temperature,
                        min_p,
                        top_k,
                        top_p,
                        ..seeded(1_500 + j as u64)
                    };
                    let name = format!("vocab {n}, {kind}, min_p {min_p} {extra}, T {temperature}");
                    let c = check(&mut t, &name, row, &p, &Hist::default());
                    if min_p == 1.0 {
                        if r == 2 {
                            for &i in &tie_ids {
                                assert_eq!(c.d[i], 1.0 / 7.0, "{name}: id {i}");
                            }
                            assert_eq!(support_size(&c.d), 7, "{name}");
                        } else {
                            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                            let at_max = row.iter().filter(|&&l| l == max).count();
                            assert_eq!(support_size(&c.d), at_max, "{name}");
                        }
                    }
                }
            }
        }
    }
    t.finish(90);
}

// ---------------------------------------------------------------------------------------------
// top-p alone

/// Step 10 without top-k (every weight by the polynomial exp, candidates above a bound from the
/// total mass; on rows where that leaves many, the search on the dense weights) on peaked rows
/// and flat rows, p = 0.9, 0.5, 0.999999 and 1e-9. On the equal row the survivors are exactly
/// the ids 0..m with m the least count whose mass m / vocab >= p. Flat normal(0, 1) is the
/// benchmark's workload (g); the quantised row has ties at every weight, the boundary's
/// included.
#[test]
fn top_p_alone_on_peaked_and_flat_rows() {
    let mut t = Tally::new("top_p");
    let kinds = [
        "peaked",
        "flat equal",
        "flat normal(0,0.1)",
        "normal(0,3)",
        "spikes over normal(0,1)",
        "flat normal(0,1)",
        "quantised 1/4",
    ];
    for (s, &n) in SIZES.iter().enumerate() {
        for (r, kind) in kinds.iter().enumerate() {
            let row = row_kind(kind, 1_600 + s as u64, n);
            for (j, top_p) in [0.9, 0.5, 0.999_999, 1e-9].into_iter().enumerate() {
                for (ti, temperature) in TEMPERATURES.into_iter().enumerate() {
                    // All three temperatures on the peaked rows; T = 0.3 on the spikes; one,
                    // rotating, elsewhere.
                    let wanted = match *kind {
                        "peaked" => true,
                        "spikes over normal(0,1)" => ti == 0,
                        _ => ti == (s + r + j) % 3,
                    };
                    if !wanted {
                        continue;
                    }
                    let p = SamplingParams {
                        temperature,
                        top_p,
                        ..seeded(1_700 + j as u64)
                    };
                    let name = format!("vocab {n}, {kind}, top_p {top_p}, T {temperature}");
                    let c = if *kind == "flat equal" {
                        // Expected here: the oracle's near-tie check is quadratic in a tie of
                        // the whole row.
                        let m = (1..=n).find(|&m| m as f64 / n as f64 >= top_p).unwrap();
                        let near = |m: usize| (m as f64 / n as f64 - top_p).abs() <= 1e-6 * top_p;
                        let first: Vec<usize> = (0..m).collect();
                        let mut o = uniform(&row, &first);
                        o.fragile = near(m) || near(m - 1);
                        let c = check_against(&mut t, &name, &row, &p, &Hist::default(), o);
                        if !c.o.fragile {
                            for (i, &x) in c.d.iter().enumerate() {
                                let want = if i < m { 1.0 / m as f64 } else { 0.0 };
                                assert!(
                                    (x - want).abs() <= 1e-15,
                                    "{name}: id {i}: {x}, want {want} (m = {m})"
                                );
                            }
                        }
                        c
                    } else {
                        check(&mut t, &name, &row, &p, &Hist::default())
                    };
                    if top_p == 1e-9 && *kind != "flat equal" {
                        let want = top_ids(&row, 1)[0] as usize;
                        assert_one_hot(&name, &c, want);
                    }
                    if *kind == "spikes over normal(0,1)" {
                        // Masses 0.9643, 0.0344, 0.0012 and less than 1e-12 for the rest.
                        let kept = if top_p == 0.999_999 {
                            vec![n - 1, 8_191, 32]
                        } else {
                            vec![n - 1]
                        };
                        assert!(!c.o.fragile, "{name}");
                        assert_eq!(support_size(&c.d), kept.len(), "{name}");
                        assert!(kept.iter().all(|&i| c.d[i] > 0.0), "{name}");
                    }
                }
            }
        }
    }
    t.finish(75);
}

// ---------------------------------------------------------------------------------------------
// Plain temperature sampling

/// Steps 7 and 11 alone: softmax at T = 0.3, 1 and 2.5 over the whole row.
#[test]
fn plain_temperature_sampling_on_large_rows() {
    let mut t = Tally::new("temperature");
    let kinds = [
        "normal(0,3)",
        "peaked",
        "quantised 1/4",
        "flat normal(0,0.1)",
        "ascending",
    ];
    for (s, &n) in SIZES.iter().enumerate() {
        for kind in kinds {
            let row = row_kind(kind, 1_800 + s as u64, n);
            for (j, temperature) in TEMPERATURES.into_iter().enumerate() {
                let p = SamplingParams {
                    temperature,
                    ..seeded(1_900 + j as u64 + 10 * s as u64)
                };
                let name = format!("vocab {n}, {kind}, T {temperature}");
                let c = check(&mut t, &name, &row, &p, &Hist::default());
                assert_support_size(&name, &c, n);
            }
        }
    }
    t.finish(100);
}

// ---------------------------------------------------------------------------------------------
// |max| > 1e30

/// Without penalties or bias, steps 6-11 depend only on the order of the logits and on
/// x_i = (l_i - max) / T. For a row of huge logits the oracle's rounding allowances (relative
/// to |l|) call every pair of neighbours a near-tie, although `l - max` is exact there. The
/// surrogate row holds x_i itself (f64, then f32; below -1e4, where every weight is 0,
/// clamped to -1e4; -inf kept) at temperature 1 (greedy stays greedy): the same order, the same
/// weights, magnitudes at which the allowances mean what they should.
fn surrogate(row: &[f32], p: &SamplingParams) -> (Vec<f32>, SamplingParams) {
    let max = f64::from(row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let t = if p.is_greedy() { 1.0 } else { p.temperature };
    let row2 = row
        .iter()
        .map(|&l| {
            if l == f32::NEG_INFINITY {
                l
            } else {
                ((f64::from(l) - max) / t).max(-1e4) as f32
            }
        })
        .collect();
    let p2 = SamplingParams {
        temperature: if p.is_greedy() { p.temperature } else { 1.0 },
        ..p.clone()
    };
    (row2, p2)
}

/// Logits near ±3e38 (the exact fallback): at T = 1e38 the differences are O(1) in exact
/// arithmetic although `l - max` overflows f32; at T = 1 only the ties at the maximum keep any
/// weight; rows near -f32::MAX differ by ulps of 2^104.
#[test]
fn huge_logits_take_the_exact_fallback() {
    let mut t = Tally::new("huge logits");
    for (s, &n) in [32_000usize, 151_936].iter().enumerate() {
        let mut g = SplitMix(2_000 + s as u64);
        // (a) normal(0, 1) * 1e38, clamped to ±3.3e38, with 3e38 at two ids.
        let mut wide: Vec<f32> = (0..n)
            .map(|_| (g.normal() * 1e38).clamp(-3.3e38, 3.3e38) as f32)
            .collect();
        for i in [512, 777] {
            wide[i] = 3.35e38;
        }
        // (b) -f32::MAX plus 0..64 ulps.
        let low: Vec<f32> = (0..n)
            .map(|_| -f32::from_bits(f32::MAX.to_bits() - g.below(64) as u32))
            .collect();
        // (c) ±3e38 and ordinary values: the maxima (ties at 31, 8192, n-1) take everything.
        let mut mixed = normal_row(2_100 + s as u64, n, 3.0);
        for i in (0..n).step_by(97) {
            mixed[i] = -3e38;
        }
        for i in [31, 8_192, n - 1] {
            mixed[i] = 3e38;
        }
        // (d) one logit at 2e30, just above the fallback's bound, the rest ordinary.
        let mut just = normal_row(2_200 + s as u64, n, 3.0);
        just[n / 3] = 2e30;
        // (kind, row, temperature, compare with the oracle on the surrogate row)
        let rows: [(&str, &[f32], f64, bool); 6] = [
            ("normal * 1e38, T 1e38", &wide, 1e38, false),
            ("normal * 1e38, T 3e38", &wide, 3e38, false),
            ("-f32::MAX + ulps, T 1e32", &low, 1e32, true),
            ("-f32::MAX + ulps, T 1", &low, 1.0, false),
            ("±3e38 and ordinary, T 1", &mixed, 1.0, false),
            ("one 2e30, T 1", &just, 1.0, false),
        ];
        let top_level: Vec<usize> = {
            let max = low.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            (0..n).filter(|&i| low[i] == max).collect()
        };
        for (kind, row, temperature, use_surrogate) in rows {
            let params = [
                (
                    "plain",
                    SamplingParams {
                        temperature,
                        ..seeded(1)
                    },
                ),
                (
                    "top_k 50",
                    SamplingParams {
                        temperature,
                        top_k: 50,
                        ..seeded(2)
                    },
                ),
                (
                    "top_p 0.9",
                    SamplingParams {
                        temperature,
                        top_p: 0.9,
                        ..seeded(3)
                    },
                ),
                (
                    "min_p 0.05",
                    SamplingParams {
                        temperature,
                        min_p: 0.05,
                        ..seeded(4)
                    },
                ),
                ("greedy", greedy(5)),
            ];
            for (pname, p) in &params {
                let name = format!("vocab {n}, {kind}, {pname}");
                // At T = 1 the last three rows put all the weight on the ties at the maximum
                // (every other weight is exp(-2^104) or less): expected values from here, as
                // those rows are ties of 10^5 ids for the oracle.
                let maxima: &[usize] = match kind {
                    "-f32::MAX + ulps, T 1" => &top_level,
                    "±3e38 and ordinary, T 1" => &[31, 8_192, n - 1],
                    "one 2e30, T 1" => &[n / 3],
                    _ => &[],
                };
                let c = if use_surrogate {
                    let (row2, p2) = surrogate(row, p);
                    let o = oracle_with_stops(&row2, &p2, &[], &[], &[])
                        .unwrap_or_else(|e| panic!("{name}: oracle: {e:?}"));
                    check_against(&mut t, &name, row, p, &Hist::default(), o)
                } else if !maxima.is_empty() {
                    let c = maxima.len();
                    let kept = match *pname {
                        "greedy" => 1,
                        "top_k 50" => c.min(50),
                        "top_p 0.9" => (1..=c).find(|&m| m as f64 / c as f64 >= 0.9).unwrap(),
                        _ => c,
                    };
                    let o = if p.is_greedy() {
                        one_hot(row, maxima[0], true)
                    } else {
                        uniform(row, &maxima[..kept])
                    };
                    check_against(&mut t, &name, row, p, &Hist::default(), o)
                } else {
                    check(&mut t, &name, row, p, &Hist::default())
                };
                match (kind, *pname) {
                    (_, "greedy") => {
                        let want = top_ids(row, 1)[0] as usize;
                        assert_one_hot(&name, &c, want);
                    }
                    ("±3e38 and ordinary, T 1", _) => {
                        for i in [31, 8_192, n - 1] {
                            assert_eq!(c.d[i], 1.0 / 3.0, "{name}: id {i}");
                        }
                    }
                    ("one 2e30, T 1", _) => assert_one_hot(&name, &c, n / 3),
                    ("-f32::MAX + ulps, T 1", "top_k 50") => {
                        let d = uniform(row, &top_level[..50]).probs;
                        assert!(c.d == d, "{name}: want the first 50 ids of the top level");
                    }
                    _ => {}
                }
            }
        }
    }
    t.finish(90);
}

// ---------------------------------------------------------------------------------------------
// Exact boundaries with probability input

/// Probability input (spec "Inputs"; exact boundaries are tested with dyadic probabilities) on
/// large rows: a top-p prefix that reaches p exactly takes nothing more, min-p keeps the ties
/// with its threshold, top-k keeps the lowest ids of a tie, and every draw is the inverse CDF.
#[test]
fn exact_boundaries_with_probability_input() {
    let mut cases: Vec<(String, Vec<f32>, SamplingParams, Vec<f64>)> = Vec::new();
    for &n in &[32_000usize, 32_768, 151_936] {
        // The spec's worked case [0.25, 0.125, 0.125, 0.5], top_p 0.75, spread over the row.
        let mut probs = vec![0.0f32; n];
        for (id, w) in [(7, 0.25), (100, 0.125), (9_000, 0.125), (n - 1, 0.5)] {
            probs[id] = w;
        }
        let mut want = vec![0.0; n];
        want[7] = 1.0 / 3.0;
        want[n - 1] = 2.0 / 3.0;
        let p = SamplingParams {
            top_p: 0.75,
            ..seeded(40)
        };
        cases.push((
            format!("vocab {n}, worked case, top_p 0.75"),
            probs,
            p,
            want,
        ));
        // Equal weights: top_p 0.5 is reached exactly by the first half.
        let m = n / 2;
        let want: Vec<f64> = (0..n)
            .map(|i| if i < m { 1.0 / m as f64 } else { 0.0 })
            .collect();
        let p = SamplingParams {
            top_p: 0.5,
            ..seeded(41)
        };
        cases.push((
            format!("vocab {n}, equal weights, top_p 0.5"),
            vec![1.0; n],
            p,
            want,
        ));
        // Min-p 0.25 keeps the ties with the threshold (4 ids at 1, 10 at 0.25, the rest 0.125).
        let mut probs = vec![0.125f32; n];
        let top = [0, 511, 8_192, n - 1];
        let at = [
            31,
            32,
            512,
            4_000,
            8_191,
            n / 2,
            n - 33,
            n - 32,
            n - 3,
            n - 2,
        ];
        top.iter().for_each(|&i| probs[i] = 1.0);
        at.iter().for_each(|&i| probs[i] = 0.25);
        let mut want = vec![0.0; n];
        top.iter().for_each(|&i| want[i] = 1.0 / 6.5);
        at.iter().for_each(|&i| want[i] = 0.25 / 6.5);
        let p = SamplingParams {
            min_p: 0.25,
            ..seeded(42)
        };
        cases.push((
            format!("vocab {n}, ties at the min-p threshold"),
            probs,
            p,
            want,
        ));
        // Top-k 1000 in a tie of every 5th id.
        let probs: Vec<f32> = (0..n)
            .map(|i| if i % 5 == 0 { 0.5 } else { 0.25 })
            .collect();
        let want: Vec<f64> = (0..n)
            .map(|i| if i % 5 == 0 && i < 5_000 { 1e-3 } else { 0.0 })
            .collect();
        let p = SamplingParams {
            top_k: 1000,
            ..seeded(43)
        };
        cases.push((format!("vocab {n}, top_k 1000 in a tie"), probs, p, want));
    }
    for (name, probs, p, want) in &cases {
        let d = distribution_from_probs(probs, &SampleRequest::new(p, &[], &[], 0))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (i, (&g, &w)) in d.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-12 && (g > 0.0) == (w > 0.0),
                "{name}: id {i}: {g}, want {w}"
            );
        }
        for (pos, idx) in DRAWS {
            let req = SampleRequest::new(p, &[], &[], pos).with_sample_index(idx);
            let s = sample_row_from_probs(probs, &req).unwrap_or_else(|e| panic!("{name}: {e}"));
            let u = spec_uniform(p.seed.unwrap(), pos, idx);
            assert_eq!(s.num_candidates, support_size(want), "{name}");
            if let Some(tok) = inverse_cdf(want, u, 1e-9) {
                assert_eq!(s.token, tok, "{name}: u = {u}");
            }
            assert!(
                (s.logprob - want[s.token as usize].ln()).abs() <= 1e-9,
                "{name}"
            );
        }
    }
}
