//! The worked cases of spec/npu_top_k_top_p_sample.md, each its own test, the stage rules at
//! their edges with hand-computed answers, and the typed errors.

use half::{bf16, f16};
use nucleus_sampling::npu::{
    exp_weight, top_k_top_p_sample, QIndexing, TopKTopPError, TopKTopPRowError,
    TopKTopPSampleOptions, TopKTopPSampleOutput,
};
use nucleus_sampling::{InputKind, LogitsView};

const NEG: f32 = f32::NEG_INFINITY;

fn need_logits() -> TopKTopPSampleOptions {
    TopKTopPSampleOptions {
        is_need_logits: true,
        ..Default::default()
    }
}

/// One call on a dense f32 `[batch, vocab]` matrix.
#[allow(clippy::too_many_arguments)]
fn call(
    data: &[f32],
    vocab: usize,
    kind: InputKind,
    top_k: &[i32],
    top_p: &[f32],
    q: Option<&[f32]>,
    min_ps: Option<&[f32]>,
    options: &TopKTopPSampleOptions,
) -> TopKTopPSampleOutput {
    let view = LogitsView::dense(data, data.len() / vocab, vocab)
        .unwrap()
        .with_kind(kind);
    top_k_top_p_sample(&view, top_k, top_p, q, min_ps, options).unwrap()
}

fn logits1(
    row: &[f32],
    top_k: i32,
    top_p: f32,
    q: Option<&[f32]>,
    options: &TopKTopPSampleOptions,
) -> TopKTopPSampleOutput {
    call(
        row,
        row.len(),
        InputKind::Logits,
        &[top_k],
        &[top_p],
        q,
        None,
        options,
    )
}

fn probs1(
    row: &[f32],
    top_k: i32,
    top_p: f32,
    q: Option<&[f32]>,
    options: &TopKTopPSampleOptions,
) -> TopKTopPSampleOutput {
    call(
        row,
        row.len(),
        InputKind::Probs,
        &[top_k],
        &[top_p],
        q,
        None,
        options,
    )
}

fn select(out: &TopKTopPSampleOutput) -> Vec<f32> {
    out.logits_top_kp_select.clone().expect("is_need_logits")
}

/// The ids whose `logits_top_kp_select` entry is not the fill value.
fn kept(out: &TopKTopPSampleOutput, vocab: usize, fill: f32) -> Vec<Vec<usize>> {
    select(out)
        .chunks(vocab)
        .map(|r| {
            r.iter()
                .enumerate()
                .filter(|(_, v)| v.to_bits() != fill.to_bits())
                .map(|(i, _)| i)
                .collect()
        })
        .collect()
}

// ---- The spec's worked cases ----

#[test]
fn worked_case_top_k_2_keeps_ids_1_and_3_and_the_argmax_tie_goes_to_id_1() {
    let out = logits1(&[1.0, 3.0, 2.0, 3.0], 2, 1.0, None, &need_logits());
    assert_eq!(out.logits_select_idx, vec![1]);
    assert_eq!(select(&out), vec![NEG, 3.0, NEG, 3.0]);
    assert_eq!(out.row_status, vec![Ok(())]);
}

#[test]
fn worked_case_probabilities_top_p_0_75_keeps_3_0_1_because_0_75_is_not_above_0_75() {
    let probs = [0.25, 0.125, 0.125, 0.5];
    let out = probs1(&probs, 0, 0.75, None, &need_logits());
    assert_eq!(out.logits_select_idx, vec![3]);
    // Sorted [3, 0, 1, 2], mass before [0, 0.5, 0.75, 0.875]: id 2 alone is removed, and the
    // fill value of probability input is 0.
    assert_eq!(select(&out), vec![0.25, 0.125, 0.0, 0.5]);
}

#[test]
fn worked_case_q_by_token_id_after_top_p_chooses_3_then_1() {
    let probs = [0.25, 0.125, 0.125, 0.5];
    // id 2 is removed by top-p, so its tiny q does not matter: 0.5/1 beats 0.25/1 and 0.125/1.
    let out = probs1(
        &probs,
        0,
        0.75,
        Some(&[1.0, 1.0, 0.01, 1.0]),
        &need_logits(),
    );
    assert_eq!(out.logits_select_idx, vec![3]);
    // 0.125 / 0.1 = 1.25 beats 0.5 / 1.
    let out = probs1(&probs, 0, 0.75, Some(&[1.0, 0.1, 1.0, 1.0]), &need_logits());
    assert_eq!(out.logits_select_idx, vec![1]);
    assert_eq!(select(&out), vec![0.25, 0.125, 0.0, 0.5]);
}

#[test]
fn worked_case_top_k_0_or_2000_skips_the_stage_and_a_mixed_batch_follows_each_rows_rules() {
    let row = [1.0f32, 3.0, 2.0, 3.0, 0.5];
    let data: Vec<f32> = row.iter().copied().cycle().take(5 * 6).collect();
    let q = [
        [1.0f32; 5],
        [1.0; 5],
        [1.0, 1.0, 1.0, 1.0, 1e-9],
        [1.0, 1.0, 1.0, 1.0, 1e-9],
        [1e-9, 1.0, 1.0, 1.0, 1.0],
        [1.0; 5],
    ]
    .concat();
    let out = call(
        &data,
        5,
        InputKind::Logits,
        &[0, 2000, 3, 2000, 2, 1],
        &[1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
        Some(&q),
        None,
        &need_logits(),
    );
    assert_eq!(
        kept(&out, 5, NEG),
        vec![
            vec![0, 1, 2, 3, 4], // top-k off (0)
            vec![0, 1, 2, 3, 4], // top-k off (2000 > min(V, 1024))
            vec![1, 2, 3],       // top-k 3
            vec![0, 1, 2, 3, 4], // off: id 4's tiny q wins
            vec![1, 3],          // top-k 2: id 0's tiny q does not matter
            vec![1],             // top_p 0 keeps the maximum only
        ]
    );
    assert_eq!(out.logits_select_idx, vec![1, 1, 1, 4, 1, 1]);
}

// ---- Stage rules at their edges ----

#[test]
fn an_exact_top_p_boundary_keeps_one_more_token_in_a_short_list_and_in_a_long_row() {
    // Top-k on (a list of 8), uniform 1/8: mass before rank 4 is exactly 0.5, so ranks 0-4
    // survive (the op-plugin golden's `>=` would keep 4).
    let probs = [0.125f32; 8];
    let out = probs1(&probs, 8, 0.5, None, &need_logits());
    assert_eq!(kept(&out, 8, 0.0), vec![vec![0, 1, 2, 3, 4]]);
    // Top-p without top-k on 4096 ids of 1/4096: mass before rank 2048 is exactly 0.5, so ids
    // 0..=2048 survive. The f64 sums are exact here and sit on the boundary: the exact path
    // decides.
    let v = 4096;
    let probs = vec![1.0f32 / v as f32; v];
    let out = probs1(&probs, 0, 0.5, None, &need_logits());
    assert_eq!(kept(&out, v, 0.0), vec![(0..=2048).collect::<Vec<_>>()]);
    // 1/4096 more: the mass before rank 2049 is now exactly the target, so it survives too.
    let p = 0.5 + 1.0 / 4096.0;
    let out = probs1(&probs, 0, p, None, &need_logits());
    assert_eq!(kept(&out, v, 0.0), vec![(0..=2049).collect::<Vec<_>>()]);
    // Tied weights 4, 3, 2, 1 (ids i % 4 = 3, 2, 1, 0), Z = 1024 * 10 = 10240. top_p 0.25:
    // target 2560 = 640 fours exactly, so ranks 0..=640 survive: the first 641 ids with
    // i % 4 = 3.
    let weights: Vec<f32> = (0..v).map(|i| ((i % 4) + 1) as f32).collect();
    let out = probs1(&weights, 0, 0.25, None, &need_logits());
    let want: Vec<usize> = (0..v).filter(|i| i % 4 == 3).take(641).collect();
    assert_eq!(kept(&out, v, 0.0), vec![want]);
    // top_p 0.4f32 = 0.4000000059604645: target 4096.00006, just above the 1024 fours; the
    // first three (id 2) has 4096 before it and survives, the second (4099 before) does not.
    let out = probs1(&weights, 0, 0.4, None, &need_logits());
    let mut want: Vec<usize> = (0..v).filter(|i| i % 4 == 3).collect();
    want.push(2);
    want.sort_unstable();
    assert_eq!(kept(&out, v, 0.0), vec![want]);
}

#[test]
fn top_p_at_or_below_zero_keeps_the_first_rank_and_one_or_above_is_off() {
    let row = [2.0f32, 5.0, 5.0, 1.0];
    for p in [0.0f32, -0.0, -3.0, f32::NEG_INFINITY] {
        let out = logits1(&row, 0, p, None, &need_logits());
        assert_eq!(select(&out), vec![NEG, 5.0, NEG, NEG], "top_p {p}");
        assert_eq!(out.logits_select_idx, vec![1]);
    }
    for p in [1.0f32, 1.5, f32::INFINITY] {
        let out = logits1(&row, 0, p, None, &need_logits());
        assert_eq!(select(&out), row.to_vec(), "top_p {p}");
    }
    // A tiny p keeps the maximum alone too (its mass is above any tiny target).
    let out = logits1(&row, 0, 1e-30, None, &need_logits());
    assert_eq!(select(&out), vec![NEG, 5.0, NEG, NEG]);
}

#[test]
fn min_p_keeps_tokens_at_or_above_min_p_times_the_maximum_and_one_token_at_or_above_1() {
    // 0.5 * 0.4f32 is 0.2f32 exactly: id 1 sits on the threshold and is kept; 0.19 is not.
    let probs = [0.4f32, 0.2, 0.19, 0.21];
    let opts = need_logits();
    let run = |m: f32| {
        call(
            &probs,
            4,
            InputKind::Probs,
            &[0],
            &[1.0],
            None,
            Some(&[m]),
            &opts,
        )
    };
    assert_eq!(kept(&run(0.5), 4, 0.0), vec![vec![0, 1, 3]]);
    assert_eq!(kept(&run(0.0), 4, 0.0), vec![vec![0, 1, 2, 3]]);
    assert_eq!(kept(&run(-1.0), 4, 0.0), vec![vec![0, 1, 2, 3]]);
    assert_eq!(kept(&run(1.0), 4, 0.0), vec![vec![0]]);
    assert_eq!(kept(&run(7.0), 4, 0.0), vec![vec![0]]);
    // >= 1 keeps the first in the sorted order: the lowest id among tied maxima.
    let logits = [2.0f32, 5.0, 5.0, 1.0];
    for m in [1.0f32, 2.0] {
        let out = call(
            &logits,
            4,
            InputKind::Logits,
            &[0],
            &[1.0],
            None,
            Some(&[m]),
            &opts,
        );
        assert_eq!(select(&out), vec![NEG, 5.0, NEG, NEG]);
    }
    // Logits: p_i / p_max = e^(l_i - max); min_p 0.36 keeps the tokens within
    // -ln(0.36) = 1.02 of the max: id 0 (1 below) survives, id 2 (1.1 below) does not.
    let logits = [4.0f32, 5.0, 3.9, 5.0];
    let m = 0.36f32;
    assert!(exp_weight(4.0, 5.0) >= m && exp_weight(3.9, 5.0) < m);
    let out = call(
        &logits,
        4,
        InputKind::Logits,
        &[0],
        &[1.0],
        None,
        Some(&[m]),
        &opts,
    );
    assert_eq!(select(&out), vec![4.0, 5.0, NEG, 5.0]);
}

#[test]
fn top_k_is_on_between_1_and_min_v_ks_max_without_rounding_ks_max() {
    let row: Vec<f32> = (0..2000).map(|i| (i % 97) as f32 * 0.1).collect();
    let count = |k: i32, ks_max: i64| {
        let opts = TopKTopPSampleOptions {
            ks_max,
            ..need_logits()
        };
        kept(&logits1(&row, k, 1.0, None, &opts), row.len(), NEG)[0].len()
    };
    assert_eq!(count(5, 1024), 5);
    assert_eq!(count(5, 5), 5);
    // ks_max 4: top_k 5 is out of range, so the stage is skipped (a build that rounds ks_max
    // up to 8 would keep 5).
    assert_eq!(count(5, 4), 2000);
    assert_eq!(count(3, 3), 3);
    assert_eq!(count(4, 3), 2000);
    // Values above 1024 act as 1024.
    assert_eq!(count(1024, 5000), 1024);
    assert_eq!(count(1025, 5000), 2000);
    assert_eq!(count(0, 1024), 2000);
    assert_eq!(count(-1, 1024), 2000);
    assert_eq!(count(1, 1024), 1);
    // k = V is on, V + 1 is off (the same survivors here: every token).
    let short = &row[..10];
    let opts = need_logits();
    assert_eq!(
        kept(&logits1(short, 10, 1.0, None, &opts), 10, NEG)[0].len(),
        10
    );
    assert_eq!(
        kept(&logits1(short, 11, 1.0, None, &opts), 10, NEG)[0].len(),
        10
    );
    // With top-p after them, both renormalise over the same 10 tokens.
    let out = logits1(short, 10, 0.5, None, &opts);
    let off = logits1(short, 11, 0.5, None, &opts);
    assert_eq!(select(&out), select(&off));
}

#[test]
fn top_k_ties_go_to_the_lower_id_and_signed_zeros_tie() {
    let row = [0.0f32, -0.0, 1.0, -0.0, 0.0, 1.0];
    let out = logits1(&row, 4, 1.0, None, &need_logits());
    // 1.0 at ids 2 and 5, then the zeros by id: 0 and 1.
    assert_eq!(select(&out), vec![0.0, -0.0, 1.0, NEG, NEG, 1.0]);
    assert_eq!(out.logits_select_idx, vec![2]);
}

#[test]
fn q_by_sorted_rank_indexes_the_rank_not_the_id() {
    let row = [1.0f32, 3.0, 2.0, 3.0];
    // Ranks: id 1 (0), id 3 (1), id 2 (2), id 0 (3).
    let q = [1.0f32, 1.0, 1.0, 0.001];
    let by_rank = TopKTopPSampleOptions {
        q_indexing: QIndexing::SortedRank,
        ..need_logits()
    };
    // q[3] belongs to rank 3, id 0: e^-2 / 0.001 = 135 beats 1 / 1.
    assert_eq!(
        logits1(&row, 0, 1.0, Some(&q), &by_rank).logits_select_idx,
        vec![0]
    );
    // By id, q[3] belongs to id 3: 1 / 0.001 wins.
    assert_eq!(
        logits1(&row, 0, 1.0, Some(&q), &need_logits()).logits_select_idx,
        vec![3]
    );
    // With top-k 2 the survivors are ranks 0 and 1: q[3] is not read; ties go to rank 0.
    assert_eq!(
        logits1(&row, 2, 1.0, Some(&q), &by_rank).logits_select_idx,
        vec![1]
    );
    assert_eq!(
        logits1(&row, 2, 1.0, Some(&[1.0, 1.0, 1.0, 0.5]), &need_logits()).logits_select_idx,
        vec![3]
    );
}

#[test]
fn q_zero_with_eps_zero_scores_infinity_and_ties_go_to_the_first_rank() {
    let row = [1.0f32, 3.0, 2.0, 3.0];
    let opts = TopKTopPSampleOptions {
        eps: 0.0,
        ..Default::default()
    };
    // ids 0 and 2 have q = 0: both score +inf; id 2 ranks before id 0.
    let out = logits1(&row, 0, 1.0, Some(&[0.0, 1.0, 0.0, 1.0]), &opts);
    assert_eq!(out.logits_select_idx, vec![2]);
    // q = +inf scores 0: every survivor at +inf ties at 0, the first rank wins.
    let inf = f32::INFINITY;
    let out = logits1(&row, 0, 1.0, Some(&[inf; 4]), &opts);
    assert_eq!(out.logits_select_idx, vec![1]);
    // eps 0.5 turns q = 0 into 0.5.
    let opts = TopKTopPSampleOptions {
        eps: 0.5,
        ..Default::default()
    };
    let out = logits1(&row, 0, 1.0, Some(&[0.0, 1.0, 0.0, 1.0]), &opts);
    // scores: id0 e^-2/0.5, id1 1/1.5, id2 e^-1/0.5 = 0.736, id3 1/1.5 = 0.667.
    assert_eq!(out.logits_select_idx, vec![2]);
}

#[test]
fn without_q_the_argmax_of_probs_ties_to_the_lower_id_even_below_the_first_rank() {
    // Distinct logits whose weights both round to 1.0: the probabilities tie, so the argmax
    // is id 0, although id 1 holds the larger logit (the first rank).
    let row = [1e-10f32, 1.000_001e-10, -5.0];
    assert!(row[1] > row[0]);
    assert_eq!(exp_weight(row[0], row[1]), 1.0);
    let opts = need_logits();
    assert_eq!(
        logits1(&row, 0, 1.0, None, &opts).logits_select_idx,
        vec![0]
    );
    // When top-k 1 keeps the first rank alone, it is the answer.
    assert_eq!(
        logits1(&row, 1, 1.0, None, &opts).logits_select_idx,
        vec![1]
    );
}

#[test]
fn probability_input_fills_with_zero_and_renormalises_within_top_k() {
    // top-k 2 keeps 0.3 and 0.3 (renormalised 0.5 each); top-p 0.5: mass before rank 1 is
    // exactly 0.5 -> kept.
    let probs = [0.3f32, 0.1, 0.3, 0.05];
    let out = probs1(&probs, 2, 0.5, None, &need_logits());
    assert_eq!(select(&out), vec![0.3, 0.0, 0.3, 0.0]);
    // Unnormalised weights are renormalised too.
    let weights = [3.0f32, 1.0, 3.0, 0.5];
    let out = probs1(&weights, 2, 0.5, None, &need_logits());
    assert_eq!(select(&out), vec![3.0, 0.0, 3.0, 0.0]);
}

#[test]
fn f16_and_bf16_rows_give_the_results_of_their_f32_values() {
    let row: Vec<f32> = (0..300)
        .map(|i| ((i * 37) % 101) as f32 * 0.07 - 2.0)
        .collect();
    let q: Vec<f32> = (0..300)
        .map(|i| 0.1 + ((i * 13) % 17) as f32 * 0.3)
        .collect();
    let opts = need_logits();
    for (k, p) in [(0, 0.9f32), (20, 0.7), (0, 1.0), (50, 1.0)] {
        let h: Vec<f16> = row.iter().map(|&v| f16::from_f32(v)).collect();
        let hw: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        let b: Vec<bf16> = row.iter().map(|&v| bf16::from_f32(v)).collect();
        let bw: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
        let view_h = LogitsView::dense(&h, 1, 300).unwrap();
        let view_b = LogitsView::dense(&b, 1, 300).unwrap();
        let got_h =
            top_k_top_p_sample(&view_h, &[k], &[f16::from_f32(p)], Some(&q), None, &opts).unwrap();
        let got_b = top_k_top_p_sample(&view_b, &[k], &[p], Some(&q), None, &opts).unwrap();
        let p_h = f16::from_f32(p).to_f32();
        assert_eq!(
            got_h,
            logits1(&hw, k, p_h, Some(&q), &opts),
            "f16 k {k} p {p}"
        );
        assert_eq!(
            got_b,
            logits1(&bw, k, p, Some(&q), &opts),
            "bf16 k {k} p {p}"
        );
    }
}

#[test]
fn exp_weight_is_within_a_few_ulps_of_exp_and_monotone() {
    let mut worst = 0.0f64;
    let mut prev = 0.0f32;
    let mut x = -87.0f32;
    while x <= 0.0 {
        let want = f64::from(x).exp();
        let got = exp_weight(x, 0.0);
        worst = worst.max(((f64::from(got) - want) / want).abs());
        assert!(got >= prev, "not monotone at {x}");
        prev = got;
        x += 0.000_71;
    }
    assert!(worst < 4e-7, "worst relative error {worst}");
    assert_eq!(exp_weight(5.0, 5.0), 1.0);
    assert_eq!(exp_weight(NEG, 5.0), 0.0);
    assert_eq!(exp_weight(-200.0, 0.0), 0.0);
    // The argument is rounded to f32 first: for huge logits the difference is what counts.
    assert_eq!(exp_weight(1e30, 1e30), 1.0);
}

// ---- Typed errors ----

#[test]
fn whole_call_errors_are_typed() {
    let data = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let view = LogitsView::dense(&data, 2, 3).unwrap();
    let opts = TopKTopPSampleOptions::default();
    let err = |r: Result<TopKTopPSampleOutput, TopKTopPError>| r.unwrap_err();
    assert_eq!(
        err(top_k_top_p_sample(
            &view,
            &[1],
            &[0.5f32, 0.5],
            None,
            None,
            &opts
        )),
        TopKTopPError::LengthMismatch {
            input: "top_k",
            len: 1,
            batch: 2
        }
    );
    assert_eq!(
        err(top_k_top_p_sample(
            &view,
            &[1, 1],
            &[0.5f32; 3],
            None,
            None,
            &opts
        )),
        TopKTopPError::LengthMismatch {
            input: "top_p",
            len: 3,
            batch: 2
        }
    );
    assert_eq!(
        err(top_k_top_p_sample(
            &view,
            &[1, 1],
            &[0.5f32; 2],
            None,
            Some(&[0.1]),
            &opts
        )),
        TopKTopPError::LengthMismatch {
            input: "min_ps",
            len: 1,
            batch: 2
        }
    );
    assert_eq!(
        err(top_k_top_p_sample(
            &view,
            &[1, 1],
            &[0.5f32; 2],
            Some(&[1.0; 5]),
            None,
            &opts
        )),
        TopKTopPError::QShape {
            len: 5,
            batch: 2,
            vocab: 3,
            needed: 6
        }
    );
    // top_p must be in the logits' dtype or f32.
    let half: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
    let view_b = LogitsView::dense(&half, 2, 3).unwrap();
    assert_eq!(
        err(top_k_top_p_sample(
            &view_b,
            &[1, 1],
            &[f16::from_f32(0.5); 2],
            None,
            None,
            &opts
        )),
        TopKTopPError::DtypeMismatch {
            input: "top_p",
            got: "f16",
            logits: "bf16"
        }
    );
    assert!(top_k_top_p_sample(
        &view_b,
        &[1, 1],
        &[bf16::from_f32(0.5); 2],
        None,
        None,
        &opts
    )
    .is_ok());
    assert!(top_k_top_p_sample(&view_b, &[1, 1], &[0.5f32; 2], None, None, &opts).is_ok());
    for (eps, ks_max, name) in [
        (-1.0, 1024, "eps"),
        (f64::NAN, 1024, "eps"),
        (f64::INFINITY, 1024, "eps"),
        (1e-8, 0, "ks_max"),
        (1e-8, -5, "ks_max"),
    ] {
        let o = TopKTopPSampleOptions {
            eps,
            ks_max,
            ..opts
        };
        match err(top_k_top_p_sample(
            &view,
            &[1, 1],
            &[0.5f32; 2],
            None,
            None,
            &o,
        )) {
            TopKTopPError::InvalidAttribute { name: n, .. } => assert_eq!(n, name),
            other => panic!("{other:?}"),
        }
    }
    // The messages name the input.
    let e = err(top_k_top_p_sample(
        &view,
        &[1],
        &[0.5f32; 2],
        None,
        None,
        &opts,
    ));
    assert_eq!(e.to_string(), "`top_k` has 1 values for 2 logits rows");
}

#[test]
fn a_nan_row_fails_alone_and_the_other_rows_are_computed() {
    let good = [1.0f32, 3.0, 2.0, 3.0];
    let data = [
        good,
        [1.0, f32::NAN, 2.0, f32::INFINITY],
        good,
        [1.0, 2.0, f32::INFINITY, 0.0],
        [NEG; 4],
        good,
        good,
        good,
    ]
    .concat();
    let q = [[1.0f32; 4]; 8].concat();
    let mut q_bad = q.clone();
    // Row 6: a NaN at id 2, which top-k removes (never read), and one at id 3, a survivor.
    q_bad[6 * 4 + 2] = f32::NAN;
    q_bad[6 * 4 + 3] = f32::NAN;
    q_bad[7 * 4 + 1] = -0.5;
    let top_p = [1.0f32, 1.0, 0.5, 1.0, 1.0, f32::NAN, 1.0, 1.0];
    let out = call(
        &data,
        4,
        InputKind::Logits,
        &[2; 8],
        &top_p,
        Some(&q_bad),
        None,
        &need_logits(),
    );
    assert_eq!(out.logits_select_idx, vec![1, -1, 1, -1, -1, -1, -1, -1]);
    assert_eq!(out.row_status[0], Ok(()));
    assert!(matches!(
        out.row_status[1],
        Err(TopKTopPRowError::NonFiniteLogits { token_id: 1, value }) if value.is_nan()
    ));
    assert_eq!(out.row_status[2], Ok(()));
    assert_eq!(
        out.row_status[3],
        Err(TopKTopPRowError::NonFiniteLogits {
            token_id: 2,
            value: f32::INFINITY
        })
    );
    assert_eq!(out.row_status[4], Err(TopKTopPRowError::NoCandidates));
    assert_eq!(out.row_status[5], Err(TopKTopPRowError::InvalidTopP));
    assert!(matches!(
        out.row_status[6],
        Err(TopKTopPRowError::InvalidQ { index: 3, value }) if value.is_nan()
    ));
    assert_eq!(
        out.row_status[7],
        Err(TopKTopPRowError::InvalidQ {
            index: 1,
            value: -0.5
        })
    );
    let s = select(&out);
    assert_eq!(&s[..4], &[NEG, 3.0, NEG, 3.0]);
    // top-k 2 then top-p 0.5: Z = 2, the mass before id 3 is exactly 1 = 0.5 Z: kept.
    assert_eq!(&s[8..12], &[NEG, 3.0, NEG, 3.0]);
    for b in [1, 3, 4, 5, 6, 7] {
        assert!(s[b * 4..b * 4 + 4].iter().all(|&v| v == NEG), "row {b}");
    }
    // The same good rows alone give the same answers.
    let alone = call(
        &[good, good].concat(),
        4,
        InputKind::Logits,
        &[2, 2],
        &[1.0, 0.5],
        Some(&[1.0; 8]),
        None,
        &need_logits(),
    );
    assert_eq!(alone.logits_select_idx, vec![1, 1]);
}

#[test]
fn only_the_q_entries_of_survivors_are_read_and_checked() {
    let row = [1.0f32, 3.0, 2.0, 3.0];
    let nan = f32::NAN;
    // Top-k 2 keeps ids 1 and 3: a NaN or negative q at ids 0 and 2 is never read.
    let out = logits1(&row, 2, 1.0, Some(&[nan, 1.0, -1.0, 0.5]), &need_logits());
    assert_eq!(out.row_status, vec![Ok(())]);
    assert_eq!(out.logits_select_idx, vec![3]);
    // ... but at a survivor it is an error naming the lowest bad index read.
    let out = logits1(&row, 3, 1.0, Some(&[nan, 1.0, -1.0, -2.0]), &need_logits());
    assert_eq!(
        out.row_status,
        vec![Err(TopKTopPRowError::InvalidQ {
            index: 2,
            value: -1.0
        })]
    );
    // By rank: survivors are ranks 0 and 1, so q[2] and q[3] are not read.
    let by_rank = TopKTopPSampleOptions {
        q_indexing: QIndexing::SortedRank,
        ..need_logits()
    };
    let out = logits1(&row, 2, 1.0, Some(&[1.0, 1.0, nan, -1.0]), &by_rank);
    assert_eq!(out.row_status, vec![Ok(())]);
    let out = logits1(&row, 2, 1.0, Some(&[1.0, -0.5, 1.0, 1.0]), &by_rank);
    assert_eq!(
        out.row_status,
        vec![Err(TopKTopPRowError::InvalidQ {
            index: 1,
            value: -0.5
        })]
    );
    // Every token survives: every entry is read.
    let out = logits1(&row, 0, 1.0, Some(&[1.0, 1.0, 1.0, -0.0]), &need_logits());
    assert_eq!(out.row_status, vec![Ok(())]);
    let out = logits1(&row, 0, 1.0, Some(&[1.0, 1.0, nan, 1.0]), &need_logits());
    assert!(matches!(
        out.row_status[0],
        Err(TopKTopPRowError::InvalidQ { index: 2, .. })
    ));
}

#[test]
fn invalid_probabilities_and_min_p_are_row_errors() {
    let data = [
        [0.5f32, -0.1, 0.2],
        [0.0, 0.0, 0.0],
        [0.5, f32::INFINITY, 0.1],
        [0.5, 0.3, 0.2],
        [0.5, 0.3, 0.2],
    ]
    .concat();
    let out = call(
        &data,
        3,
        InputKind::Probs,
        &[0; 5],
        &[1.0; 5],
        None,
        Some(&[0.1, 0.1, 0.1, f32::NAN, 0.5]),
        &need_logits(),
    );
    assert_eq!(
        out.row_status,
        vec![
            Err(TopKTopPRowError::InvalidProbability {
                token_id: 1,
                value: -0.1
            }),
            Err(TopKTopPRowError::NoCandidates),
            Err(TopKTopPRowError::InvalidProbability {
                token_id: 1,
                value: f32::INFINITY
            }),
            Err(TopKTopPRowError::InvalidMinP),
            Ok(()),
        ]
    );
    assert_eq!(out.logits_select_idx, vec![-1, -1, -1, -1, 0]);
    // min_p 0.5 of 0.5: 0.3 stays, 0.2 goes; fill 0.
    assert_eq!(&select(&out)[12..], &[0.5, 0.3, 0.0]);
    assert!(select(&out)[..12].iter().all(|&v| v == 0.0));
}

#[test]
fn an_empty_batch_is_an_empty_answer() {
    let view = LogitsView::<f32>::dense(&[], 0, 4).unwrap();
    let out =
        top_k_top_p_sample(&view, &[], &[] as &[f32], Some(&[]), None, &need_logits()).unwrap();
    assert!(out.logits_select_idx.is_empty() && out.row_status.is_empty());
    assert_eq!(out.logits_top_kp_select, Some(vec![]));
}
