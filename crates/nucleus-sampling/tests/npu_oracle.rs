//! `top_k_top_p_sample` against the literal oracle of `npu_common` on random batches: every
//! chosen id, every `logits_top_kp_select` row (bit for bit) and every row status must be the
//! oracle's exactly.
//!
//! The batches cover the 16 scenarios (top-k, top-p, min-p and q-sampling each on or off; the
//! test counts them), ties, -inf entries, signed zeros, tiny and huge logits, weights that
//! tie at 1.0 below a tiny maximum, k at 0, 1, min(V, ks_max) and beyond, p at 0, tiny,
//! 0.999999, 1 and above, min_p edge values, f16 / bf16 rows, probability input (dyadic
//! values, where top-p boundaries are hit exactly, and random ones), both q indexings,
//! `is_need_logits` on and off, and rows long enough for the candidate cut and the
//! quickselect of top-p without top-k.

mod common;
mod npu_common;

use common::SplitMix;
use half::{bf16, f16};
use npu_common::{oracle, select_row, Attrs, OracleError, RowCase};
use nucleus_sampling::npu::{
    top_k_top_p_sample, QIndexing, TopKTopPRowError, TopKTopPSampleOptions,
};
use nucleus_sampling::{InputKind, LogitValue, LogitsView};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dtype {
    F32,
    F16,
    Bf16,
}

fn round_to(d: Dtype, v: f32) -> f32 {
    match d {
        Dtype::F32 => v,
        Dtype::F16 => f16::from_f32(v).to_f32(),
        Dtype::Bf16 => bf16::from_f32(v).to_f32(),
    }
}

fn pick<T: Copy>(g: &mut SplitMix, items: &[T]) -> T {
    items[g.below(items.len() as u64) as usize]
}

/// A row of logits of one of several shapes.
fn logits_row(g: &mut SplitMix, v: usize) -> Vec<f32> {
    let kind = g.below(9);
    let mut row: Vec<f32> = (0..v)
        .map(|_| match kind {
            0 => (g.normal() * pick(g, &[0.5, 2.0, 8.0])) as f32,
            // Small integers: many ties.
            1 => g.below(4) as f32,
            2 => {
                if g.below(10) < 3 {
                    f32::NEG_INFINITY
                } else {
                    (g.normal() * 3.0) as f32
                }
            }
            3 => f32::NEG_INFINITY,
            4 => (g.normal() * 3.0) as f32,
            // Huge magnitudes.
            5 => (g.normal() * 1e30) as f32,
            // Signed zeros and tiny values.
            6 => pick(g, &[0.0, -0.0, 1e-10, -1e-10, 1e-38, 2.0]),
            // Distinct logits whose weights round to 1.0 below a tiny maximum.
            7 => 1e-10 * (1.0 + g.below(5) as f32 * 1e-6),
            // A wide spread: weights down to subnormals and zero.
            _ => (g.next_f64() * -120.0) as f32,
        })
        .collect();
    match kind {
        // A few finite values among -inf.
        3 => {
            for _ in 0..1 + g.below(3) {
                let i = g.below(v as u64) as usize;
                row[i] = g.below(3) as f32;
            }
        }
        // A spike that holds most of the mass.
        4 => {
            let i = g.below(v as u64) as usize;
            row[i] = 12.0 + g.below(4) as f32;
        }
        _ => {}
    }
    row
}

/// A row of probabilities: dyadic values (exact top-p boundaries), random ones, zeros.
fn probs_row(g: &mut SplitMix, v: usize) -> Vec<f32> {
    let kind = g.below(3);
    let mut row: Vec<f32> = (0..v)
        .map(|_| match kind {
            0 => g.below(8) as f32 / 64.0,
            1 => g.next_f64() as f32,
            _ => {
                if g.below(2) == 0 {
                    0.0
                } else {
                    g.next_f64() as f32 * 1e-3
                }
            }
        })
        .collect();
    if row.iter().all(|&p| p == 0.0) && g.below(4) != 0 {
        row[0] = 0.5;
    }
    row
}

fn exp1(g: &mut SplitMix) -> f32 {
    (-(1.0 - g.next_f64()).ln()) as f32
}

#[derive(Default)]
struct Coverage {
    scenarios: [usize; 16],
    rows: usize,
    errors: usize,
    k_boundary: usize,
    k_beyond: usize,
    p_tiny: usize,
    p_high: usize,
    p_off_above: usize,
    p_nonpositive: usize,
    long_rows: usize,
    f16: usize,
    bf16: usize,
    probs: usize,
    by_rank: usize,
    need_logits: usize,
}

/// One random batch; checks it against the oracle and records what it covered.
fn check_batch(g: &mut SplitMix, case: usize, cov: &mut Coverage) {
    let long = g.below(40) == 0;
    let v = if long {
        3000 + g.below(12_000) as usize
    } else {
        pick(
            g,
            &[1usize, 2, 3, 4, 5, 8, 13, 31, 64, 100, 257, 600, 1030, 2048],
        )
    };
    let batch = 1 + g.below(5) as usize;
    let input_is_logits = g.below(4) != 0;
    let dtype = pick(g, &[Dtype::F32, Dtype::F32, Dtype::F16, Dtype::Bf16]);
    let with_q = g.below(5) < 3;
    let with_min_p = g.below(2) == 0;
    let attrs = Attrs {
        eps: pick(g, &[1e-8, 1e-8, 0.0, 0.25]),
        ks_max: {
            let r = 1 + g.below(1024) as i64;
            pick(g, &[1024, 1024, r, 2000, 3, 1])
        },
        q_by_rank: g.below(3) == 0,
    };
    let is_need_logits = g.below(2) == 0;
    let top_p_as_logits_dtype = g.below(2) == 0;

    let mut rows = Vec::with_capacity(batch);
    for _ in 0..batch {
        let raw = if input_is_logits {
            logits_row(g, v)
        } else {
            probs_row(g, v)
        };
        let values: Vec<f32> = raw.iter().map(|&x| round_to(dtype, x)).collect();
        let ks = attrs.ks_max.min(1024) as i32;
        let lim = (v as i32).min(ks);
        let top_k_choices = [
            0,
            -1,
            1,
            1 + g.below(lim as u64) as i32,
            1 + g.below(lim as u64) as i32,
            lim,
            lim + 1,
            v as i32,
            1024,
            1025,
            2000,
        ];
        let top_k = pick(g, &top_k_choices);
        let dyadic_p = (1 + g.below(63)) as f32 / 64.0;
        let top_p_choices = [
            0.0,
            -0.5,
            1e-30,
            1e-7,
            g.next_f64() as f32,
            g.next_f64() as f32,
            dyadic_p,
            dyadic_p,
            0.5,
            0.999_999,
            1.0,
            1.5,
        ];
        let top_p = pick(g, &top_p_choices);
        let min_p_choices = [
            0.0,
            -1.0,
            1e-30,
            0.05,
            g.next_f64() as f32,
            dyadic_p,
            0.999_999,
            1.0,
            2.0,
        ];
        let min_p = with_min_p.then(|| pick(g, &min_p_choices));
        let (top_p, min_p) = if top_p_as_logits_dtype {
            (round_to(dtype, top_p), min_p.map(|m| round_to(dtype, m)))
        } else {
            (top_p, min_p)
        };
        let q = with_q.then(|| {
            let kind = g.below(6);
            (0..v)
                .map(|_| match kind {
                    0 => 1.0,
                    1 => pick(g, &[0.0, 1.0, 0.5]),
                    2 => pick(g, &[f32::INFINITY, 1.0]),
                    _ => exp1(g),
                })
                .collect::<Vec<f32>>()
        });
        rows.push(RowCase {
            values,
            input_is_logits,
            top_k,
            top_p,
            min_p,
            q,
        });
    }
    // Rarely, an invalid row: the others must still be computed.
    if g.below(25) == 0 {
        let r = &mut rows[g.below(batch as u64) as usize];
        match g.below(4) {
            0 => r.values[g.below(v as u64) as usize] = f32::NAN,
            1 => r.top_p = f32::NAN,
            2 if r.q.is_some() => r.q.as_mut().unwrap()[0] = -1.0,
            _ => r.values[g.below(v as u64) as usize] = f32::INFINITY,
        }
    }

    let options = TopKTopPSampleOptions {
        eps: attrs.eps,
        is_need_logits,
        top_k_guess: pick(g, &[32, 0, -5, 1000]),
        ks_max: attrs.ks_max,
        q_indexing: if attrs.q_by_rank {
            QIndexing::SortedRank
        } else {
            QIndexing::TokenId
        },
    };
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.values.clone()).collect();
    let q: Option<Vec<f32>> = with_q.then(|| {
        rows.iter()
            .flat_map(|r| r.q.clone().unwrap())
            .collect::<Vec<f32>>()
    });
    let kind = if input_is_logits {
        InputKind::Logits
    } else {
        InputKind::Probs
    };
    let got = match (dtype, top_p_as_logits_dtype) {
        (Dtype::F32, _) => run::<f32, f32>(&flat, batch, v, kind, &rows, q.as_deref(), &options),
        (Dtype::F16, true) => run::<f16, f16>(&flat, batch, v, kind, &rows, q.as_deref(), &options),
        (Dtype::F16, false) => {
            run::<f16, f32>(&flat, batch, v, kind, &rows, q.as_deref(), &options)
        }
        (Dtype::Bf16, true) => {
            run::<bf16, bf16>(&flat, batch, v, kind, &rows, q.as_deref(), &options)
        }
        (Dtype::Bf16, false) => {
            run::<bf16, f32>(&flat, batch, v, kind, &rows, q.as_deref(), &options)
        }
    };

    for (b, row) in rows.iter().enumerate() {
        let what = format!(
            "case {case} row {b}: V {v} {dtype:?} logits {input_is_logits} k {} p {:e} min_p {:?} q {} {attrs:?}",
            row.top_k, row.top_p, row.min_p, with_q
        );
        let want = oracle(row, &attrs);
        let (idx, status, select) = (&got.0[b], &got.1[b], got.2.as_ref().map(|s| &s[b]));
        match want {
            Err(e) => {
                cov.errors += 1;
                let kind = match status {
                    Err(TopKTopPRowError::NonFiniteLogits { .. }) => OracleError::NonFiniteLogits,
                    Err(TopKTopPRowError::InvalidProbability { .. }) => {
                        OracleError::InvalidProbability
                    }
                    Err(TopKTopPRowError::NoCandidates) => OracleError::NoCandidates,
                    Err(TopKTopPRowError::InvalidTopP) => OracleError::InvalidTopP,
                    Err(TopKTopPRowError::InvalidMinP) => OracleError::InvalidMinP,
                    Err(TopKTopPRowError::InvalidQ { .. }) => OracleError::InvalidQ,
                    Ok(()) => panic!("{what}: want {e:?}, got Ok (id {idx})"),
                };
                assert_eq!(kind, e, "{what}");
                assert_eq!(*idx, -1, "{what}");
                if let Some(s) = select {
                    let fill = if input_is_logits {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    };
                    assert!(s.iter().all(|x| x.to_bits() == fill.to_bits()), "{what}");
                }
            }
            Ok(o) => {
                assert!(status.is_ok(), "{what}: {status:?}");
                assert_eq!(
                    *idx,
                    i64::from(o.chosen),
                    "{what}: survivors {:?}",
                    o.survivors
                );
                if let Some(s) = select {
                    let want = select_row(row, &o.survivors);
                    for (i, (a, w)) in s.iter().zip(&want).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            w.to_bits(),
                            "{what}: logits_top_kp_select[{i}] {a} vs {w}; survivors {:?}",
                            o.survivors
                        );
                    }
                }
                cov.rows += 1;
                let ks = attrs.ks_max.min(1024);
                let k_on = row.top_k >= 1 && i64::from(row.top_k) <= (v as i64).min(ks);
                let p_on = row.top_p > 0.0 && row.top_p < 1.0;
                let m_on = row.min_p.is_some_and(|m| m > 0.0 && m < 1.0);
                let s = usize::from(k_on)
                    | usize::from(p_on) << 1
                    | usize::from(m_on) << 2
                    | usize::from(with_q) << 3;
                cov.scenarios[s] += 1;
                cov.k_boundary += usize::from(i64::from(row.top_k) == (v as i64).min(ks));
                cov.k_beyond += usize::from(i64::from(row.top_k) > (v as i64).min(ks));
                cov.p_tiny += usize::from(row.top_p > 0.0 && row.top_p < 1e-6);
                cov.p_high += usize::from(row.top_p > 0.99 && row.top_p < 1.0);
                cov.p_off_above += usize::from(row.top_p > 1.0);
                cov.p_nonpositive += usize::from(row.top_p <= 0.0);
                cov.long_rows += usize::from(long && !k_on && p_on);
                cov.f16 += usize::from(dtype == Dtype::F16);
                cov.bf16 += usize::from(dtype == Dtype::Bf16);
                cov.probs += usize::from(!input_is_logits);
                cov.by_rank += usize::from(attrs.q_by_rank && with_q);
                cov.need_logits += usize::from(is_need_logits);
            }
        }
    }
}

type Got = (
    Vec<i64>,
    Vec<Result<(), TopKTopPRowError>>,
    Option<Vec<Vec<f32>>>,
);

/// Calls the operator with the rows in element type `T` and `top_p` / `min_ps` in `P`.
fn run<T: LogitValue + FromF32, P: LogitValue + FromF32>(
    flat: &[f32],
    batch: usize,
    v: usize,
    kind: InputKind,
    rows: &[RowCase],
    q: Option<&[f32]>,
    options: &TopKTopPSampleOptions,
) -> Got {
    let data: Vec<T> = flat.iter().map(|&x| T::from_f32(x)).collect();
    let view = LogitsView::dense(&data, batch, v).unwrap().with_kind(kind);
    let top_k: Vec<i32> = rows.iter().map(|r| r.top_k).collect();
    let top_p: Vec<P> = rows.iter().map(|r| P::from_f32(r.top_p)).collect();
    let min_ps: Option<Vec<P>> = rows[0]
        .min_p
        .is_some()
        .then(|| rows.iter().map(|r| P::from_f32(r.min_p.unwrap())).collect());
    let out = top_k_top_p_sample(&view, &top_k, &top_p, q, min_ps.as_deref(), options)
        .expect("a well-formed call");
    let select = out
        .logits_top_kp_select
        .map(|s| s.chunks(v).map(<[f32]>::to_vec).collect());
    (out.logits_select_idx, out.row_status, select)
}

/// f32 into the element types (exact for values already rounded to them).
trait FromF32 {
    fn from_f32(v: f32) -> Self;
}

impl FromF32 for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl FromF32 for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl FromF32 for bf16 {
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

#[test]
fn random_batches_equal_the_literal_oracle() {
    let mut g = SplitMix(0x6e70_755f_7361_6d70);
    let mut cov = Coverage::default();
    for case in 0..3000 {
        check_batch(&mut g, case, &mut cov);
    }
    eprintln!(
        "rows {}, errors {}, scenarios {:?}",
        cov.rows, cov.errors, cov.scenarios
    );
    for (s, &n) in cov.scenarios.iter().enumerate() {
        assert!(
            n >= 40,
            "scenario {s:04b} (q, min-p, top-p, top-k) covered by {n} rows only"
        );
    }
    for (what, n) in [
        ("error rows", cov.errors),
        ("k = min(V, ks_max)", cov.k_boundary),
        ("k beyond min(V, ks_max)", cov.k_beyond),
        ("tiny p", cov.p_tiny),
        ("p in (0.99, 1)", cov.p_high),
        ("p above 1", cov.p_off_above),
        ("p <= 0", cov.p_nonpositive),
        ("long rows, top-p without top-k", cov.long_rows),
        ("f16", cov.f16),
        ("bf16", cov.bf16),
        ("probability input", cov.probs),
        ("q by sorted rank", cov.by_rank),
        ("is_need_logits", cov.need_logits),
    ] {
        assert!(n >= 20, "{what}: only {n} rows");
    }
}

/// Long rows where top-p without top-k keeps thousands of tokens: the candidate cut from the
/// weight levels, the bucketed selection and the certification all run, against the oracle.
#[test]
fn long_flat_rows_equal_the_literal_oracle() {
    let mut g = SplitMix(0x10f1a7);
    let v = 40_000;
    let attrs = Attrs::default();
    for (case, (scale, p, logits)) in [
        (3.0, 0.9f32, true),
        (1.0, 0.5, true),
        (0.5, 0.999, true),
        (3.0, 0.3, true),
        (0.0, 0.7, true),
        (1.0, 0.9, false),
        (2.0, 0.95, true),
    ]
    .into_iter()
    .enumerate()
    {
        let values: Vec<f32> = (0..v)
            .map(|_| {
                if logits {
                    // Scale 0: few distinct values (ties across thousands of tokens).
                    if scale == 0.0 {
                        g.below(6) as f32
                    } else {
                        (g.normal() * scale) as f32
                    }
                } else {
                    g.next_f64() as f32
                }
            })
            .collect();
        let row = RowCase {
            values,
            input_is_logits: logits,
            top_k: 0,
            top_p: p,
            min_p: None,
            q: Some((0..v).map(|_| exp1(&mut g)).collect()),
        };
        let want = oracle(&row, &attrs).expect("valid");
        assert!(
            want.survivors.len() > 20,
            "case {case}: {}",
            want.survivors.len()
        );
        let options = TopKTopPSampleOptions {
            is_need_logits: true,
            ..Default::default()
        };
        let kind = if logits {
            InputKind::Logits
        } else {
            InputKind::Probs
        };
        let got = run::<f32, f32>(
            &row.values,
            1,
            v,
            kind,
            std::slice::from_ref(&row),
            row.q.as_deref(),
            &options,
        );
        assert_eq!(got.0[0], i64::from(want.chosen), "case {case}");
        let select = &got.2.as_ref().unwrap()[0];
        let want_select = select_row(&row, &want.survivors);
        assert!(
            select
                .iter()
                .zip(&want_select)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "case {case}: survivors differ ({} in the oracle)",
            want.survivors.len()
        );
    }
}
