//! Every worked case of spec/moe_routing.md, "Worked cases", through the operators, with the
//! exact values the spec gives (each equals the published NPU golden), and the typed errors
//! of every rule the spec lists.

use half::{bf16, f16};
use nucleus_moe::*;

/// x = [[1,10],[2,20],[3,30]], expert_idx = [[2,0],[1,2],[0,1]] (N=3, K=2, H=2), E = 4.
const X: [f32; 6] = [1., 10., 2., 20., 3., 30.];
const IDS: [i32; 6] = [2, 0, 1, 2, 0, 1];

fn input<'a, T>(x: &'a [T], h: usize, ids: &'a [i32], k: usize) -> MoeInitRoutingInput<'a, T> {
    MoeInitRoutingInput {
        x,
        num_rows: x.len() / h,
        hidden_size: h,
        expert_idx: ids,
        k,
        scale: None,
        offset: None,
    }
}

fn counted(e: i64, kind: ExpertTokensNumType) -> MoeInitRoutingAttrs {
    MoeInitRoutingAttrs {
        expert_tokens_num_flag: true,
        expert_tokens_num_type: kind,
        ..MoeInitRoutingAttrs::new(e)
    }
}

fn unquantized<T: Clone>(x: &ExpandedX<T>) -> Vec<T> {
    match x {
        ExpandedX::Unquantized(v) => v.clone(),
        ExpandedX::Int8(_) => panic!("expected unquantized expanded_x"),
    }
}

fn int8<T>(x: &ExpandedX<T>) -> Vec<i8> {
    match x {
        ExpandedX::Int8(v) => v.clone(),
        ExpandedX::Unquantized(_) => panic!("expected int8 expanded_x"),
    }
}

#[test]
fn dropless_gather_count() {
    let out = moe_init_routing(
        &input(&X, 2, &IDS, 2),
        &counted(4, ExpertTokensNumType::Count),
    )
    .unwrap();
    assert_eq!(
        unquantized(&out.expanded_x),
        [1., 10., 3., 30., 2., 20., 3., 30., 1., 10., 2., 20.]
    );
    assert_eq!(out.expanded_x_shape, [6, 2]);
    assert_eq!(out.expanded_row_idx, [4, 0, 2, 5, 1, 3]);
    assert_eq!(out.expert_tokens.unwrap(), [2, 2, 2, 0]);
    assert_eq!(out.expanded_scale, None);
    assert_eq!(out.valid_rows, 6);
}

#[test]
fn dropless_same_in_every_element_type() {
    let attrs = counted(4, ExpertTokensNumType::Count);
    let want = [1., 10., 3., 30., 2., 20., 3., 30., 1., 10., 2., 20.];
    let x16: Vec<f16> = X.iter().map(|&v| f16::from_f32(v)).collect();
    let out = moe_init_routing(&input(&x16, 2, &IDS, 2), &attrs).unwrap();
    let got: Vec<f32> = unquantized(&out.expanded_x)
        .iter()
        .map(|v| v.to_f32())
        .collect();
    assert_eq!(got, want);
    assert_eq!(out.expanded_x.dtype(), DType::F16);
    let xb: Vec<bf16> = X.iter().map(|&v| bf16::from_f32(v)).collect();
    let out = moe_init_routing(&input(&xb, 2, &IDS, 2), &attrs).unwrap();
    let got: Vec<f32> = unquantized(&out.expanded_x)
        .iter()
        .map(|v| v.to_f32())
        .collect();
    assert_eq!(got, want);
    let x8: Vec<i8> = X.iter().map(|&v| v as i8).collect();
    let out = moe_init_routing(&input(&x8, 2, &IDS, 2), &attrs).unwrap();
    assert_eq!(
        unquantized(&out.expanded_x),
        [1, 10, 3, 30, 2, 20, 3, 30, 1, 10, 2, 20]
    );
    assert_eq!(out.expanded_x.dtype(), DType::I8);
}

#[test]
fn dropless_scatter_cumsum() {
    let attrs = MoeInitRoutingAttrs {
        row_idx_type: RowIdxType::Scatter,
        ..counted(4, ExpertTokensNumType::Cumsum)
    };
    let out = moe_init_routing(&input(&X, 2, &IDS, 2), &attrs).unwrap();
    assert_eq!(out.expanded_row_idx, [1, 4, 2, 5, 0, 3]);
    assert_eq!(out.expert_tokens.unwrap(), [2, 4, 6, 6]);
    assert_eq!(
        unquantized(&out.expanded_x),
        [1., 10., 3., 30., 2., 20., 3., 30., 1., 10., 2., 20.]
    );
}

#[test]
fn key_value_with_per_row_scale() {
    let scale = [0.5, 0.25, 0.125];
    let inp = MoeInitRoutingInput {
        scale: Some(&scale),
        ..input(&X, 2, &IDS, 2)
    };
    let out = moe_init_routing(&inp, &counted(4, ExpertTokensNumType::KeyValue)).unwrap();
    assert_eq!(out.expert_tokens.unwrap(), [0, 2, 1, 2, 2, 2, 0, 0]);
    assert_eq!(
        out.expanded_scale.unwrap(),
        [0.5, 0.125, 0.25, 0.125, 0.5, 0.25]
    );
}

#[test]
fn active_num_four() {
    let attrs = MoeInitRoutingAttrs {
        active_num: 4,
        ..counted(4, ExpertTokensNumType::Count)
    };
    let out = moe_init_routing(&input(&X, 2, &IDS, 2), &attrs).unwrap();
    assert_eq!(
        unquantized(&out.expanded_x),
        [1., 10., 3., 30., 2., 20., 3., 30.]
    );
    assert_eq!(out.expanded_x_shape, [4, 2]);
    assert_eq!(out.expanded_row_idx, [4, 0, 2, 5, 1, 3]);
    assert_eq!(out.expert_tokens.unwrap(), [2, 2, 2, 0]);
    assert_eq!(out.valid_rows, 4);
}

#[test]
fn active_expert_range() {
    let x = [1., 1.5, 2., 2.5, 3., 3.5, 4., 4.5];
    let ids = [0, 3, 1, 2, 3, 1, 2, 0];
    let attrs = MoeInitRoutingAttrs {
        active_expert_range: Some([1, 3]),
        ..counted(4, ExpertTokensNumType::Count)
    };
    let out = moe_init_routing(&input(&x, 2, &ids, 2), &attrs).unwrap();
    assert_eq!(out.valid_rows, 4);
    let got = unquantized(&out.expanded_x);
    assert_eq!(got[..8], [2., 2.5, 3., 3.5, 2., 2.5, 4., 4.5]);
    // Rows past the valid count are written with zeros (the NPU leaves them undefined).
    assert_eq!(got[8..], [0.; 8]);
    assert_eq!(out.expanded_row_idx, [-1, -1, 0, 2, -1, 1, 3, -1]);
    assert_eq!(out.expert_tokens.unwrap(), [2, 2]);
    // Scatter: the valid rows' routes, then ids >= end ascending, then ids < start in route
    // order (spec "Order").
    let scatter = MoeInitRoutingAttrs {
        row_idx_type: RowIdxType::Scatter,
        ..attrs
    };
    let out = moe_init_routing(&input(&x, 2, &ids, 2), &scatter).unwrap();
    assert_eq!(out.expanded_row_idx, [2, 5, 3, 6, 1, 4, 0, 7]);
}

#[test]
fn drop_pad() {
    let x = [1., -1., 2., -2., 3., -3., 4., -4.];
    let ids = [0, 1, 0, 2, 1, 0, 0, 2];
    let scale = [1., 2., 3., 4.];
    let attrs = MoeInitRoutingAttrs {
        drop_pad_mode: DropPadMode::DropPad,
        expert_capacity: 2,
        ..counted(4, ExpertTokensNumType::Count)
    };
    let inp = MoeInitRoutingInput {
        scale: Some(&scale),
        ..input(&x, 2, &ids, 2)
    };
    let out = moe_init_routing(&inp, &attrs).unwrap();
    assert_eq!(
        unquantized(&out.expanded_x),
        [1., -1., 2., -2., 1., -1., 3., -3., 2., -2., 4., -4., 0., 0., 0., 0.]
    );
    assert_eq!(out.expanded_x_shape, [4, 2, 2]);
    assert_eq!(out.expanded_row_idx, [0, 2, 1, 4, 3, -1, -1, 5]);
    assert_eq!(out.expert_tokens.unwrap(), [4, 2, 2, 0]);
    assert_eq!(
        out.expanded_scale.unwrap(),
        [1., 2., 1., 3., 2., 4., 0., 0.]
    );
    assert_eq!(out.valid_rows, 8);
}

#[test]
fn dynamic_int8() {
    let x = [254., 5., -3., -127., 62.5, 0.5];
    let ids = [1, 0];
    let attrs = MoeInitRoutingAttrs {
        quant_mode: QuantMode::Dynamic,
        ..MoeInitRoutingAttrs::new(2)
    };
    let out = moe_init_routing(&input(&x, 3, &ids, 1), &attrs).unwrap();
    assert_eq!(int8(&out.expanded_x), [-127, 62, 0, 127, 2, -2]);
    assert_eq!(out.expanded_scale.unwrap(), [1.0, 2.0]);
    assert_eq!(out.expanded_row_idx, [1, 0]);
    // The same through a [1, H] smooth scale of ones, and a per-expert [E, H] one.
    let ones = [1.; 3];
    let inp = MoeInitRoutingInput {
        scale: Some(&ones),
        ..input(&x, 3, &ids, 1)
    };
    assert_eq!(
        int8(&moe_init_routing(&inp, &attrs).unwrap().expanded_x),
        [-127, 62, 0, 127, 2, -2]
    );
    // Expert 0 (row 1) scaled by 2 in every column: the row's q is unchanged, its scale doubles.
    let per_expert = [2., 2., 2., 1., 1., 1.];
    let inp = MoeInitRoutingInput {
        scale: Some(&per_expert),
        ..input(&x, 3, &ids, 1)
    };
    let out = moe_init_routing(&inp, &attrs).unwrap();
    assert_eq!(int8(&out.expanded_x), [-127, 62, 0, 127, 2, -2]);
    assert_eq!(out.expanded_scale.unwrap(), [2.0, 2.0]);
}

#[test]
fn dynamic_int8_all_zero_row() {
    let x = [0., 0., 0., 1., -2., 0.5];
    let attrs = MoeInitRoutingAttrs {
        quant_mode: QuantMode::Dynamic,
        ..MoeInitRoutingAttrs::new(1)
    };
    let out = moe_init_routing(&input(&x, 3, &[0, 0], 1), &attrs).unwrap();
    // s = 2/127 for row 1: 1/s = 63.5 -> 64 (half to even), -2/s = -127, 0.5/s = 31.75 -> 32.
    assert_eq!(int8(&out.expanded_x), [0, 0, 0, 64, -127, 32]);
    assert_eq!(out.expanded_scale.unwrap(), [0.0, 2.0 / 127.0]);
}

#[test]
fn static_int8() {
    let x = [0.25, 1., 100., -70., -0.75, 0., -1.25, 63.];
    let ids = [1, 0];
    let attrs = MoeInitRoutingAttrs {
        quant_mode: QuantMode::Static,
        ..MoeInitRoutingAttrs::new(2)
    };
    let inp = MoeInitRoutingInput {
        scale: Some(&[2.]),
        offset: Some(&[0.5]),
        ..input(&x, 4, &ids, 1)
    };
    let out = moe_init_routing(&inp, &attrs).unwrap();
    assert_eq!(int8(&out.expanded_x), [-1, 0, -2, 126, 1, 2, 127, -128]);
    assert_eq!(out.expanded_scale, None);
}

#[test]
fn sentinel_routes() {
    let out = moe_init_routing(
        &input(&[1., 2.], 1, &[0, -1, 2, 0], 2),
        &counted(3, ExpertTokensNumType::Count),
    )
    .unwrap();
    assert_eq!(out.valid_rows, 3);
    assert_eq!(unquantized(&out.expanded_x), [1., 2., 2., 0.]);
    assert_eq!(out.expanded_row_idx, [0, -1, 2, 1]);
    assert_eq!(out.expert_tokens.unwrap(), [2, 0, 1]);
}

#[test]
fn gating_softmax_top_k() {
    let logits = [0f32, 3f32.ln(), 2f32.ln(), f32::NEG_INFINITY];
    let g = moe_gating_top_k_softmax(&logits, 4, 2, false, None).unwrap();
    assert_eq!(g.expert_idx, [1, 2]);
    assert!((g.weights[0] - 0.5).abs() < 1e-7 && (g.weights[1] - 1. / 3.).abs() < 1e-7);
    let g = moe_gating_top_k_softmax(&logits, 4, 2, true, None).unwrap();
    assert_eq!(g.expert_idx, [1, 2]);
    assert!((g.weights[0] - 0.6).abs() < 1e-7 && (g.weights[1] - 0.4).abs() < 1e-7);
    // A finished row routes every slot to E, an invalid route.
    let g = moe_gating_top_k_softmax(&logits, 4, 2, false, Some(&[true])).unwrap();
    assert_eq!(g.expert_idx, [4, 4]);
}

#[test]
fn unpermute_identity_expert() {
    let routed = moe_init_routing(
        &input(&X, 2, &IDS, 2),
        &counted(4, ExpertTokensNumType::Count),
    )
    .unwrap();
    let expert_out = unquantized(&routed.expanded_x);
    let w = [0.5, 0.5, 0.25, 0.75, 1., 0.];
    let out = moe_token_unpermute(
        &expert_out,
        2,
        &routed.expanded_row_idx,
        Some(&w),
        2,
        routed.valid_rows,
    )
    .unwrap();
    assert_eq!(out, X);
}

#[test]
fn finalize_with_skips_and_bias() {
    // Token 0 -> rows 0 (expert 1) and -1; token 1 -> rows 1 (expert 0) and 2 (expert 1), row 2
    // past valid_rows = 2 contributes nothing, bias included.
    let expert_out = [1., 2., 3., 4., 100., 100.];
    let idx = [0, -1, 1, 2];
    let experts = [1, 0, 0, 1];
    let bias = [10., 20., 30., 40.];
    let skip1 = [0.5, 0.5, 1., 1.];
    let skip2 = [0.25, 0.25, 2., 2.];
    let w = [2., 3., 0.5, 7.];
    let out = moe_finalize_routing(&FinalizeRoutingInput {
        expert_out: &expert_out,
        hidden_size: 2,
        valid_rows: 2,
        expanded_row_idx: &idx,
        k: 2,
        weights: Some(&w),
        expert_idx: Some(&experts),
        skip1: Some(&skip1),
        skip2: Some(&skip2),
        bias: Some(&bias),
    })
    .unwrap();
    // token 0: 0.75 + 2 * (1 + 30), 0.75 + 2 * (2 + 40)
    // token 1: 3 + 0.5 * (3 + 10), 3 + 0.5 * (4 + 20)
    assert_eq!(out, [62.75, 84.75, 9.5, 15.]);
}

fn err_of(r: Result<MoeInitRoutingOutput<f32>, MoeError>) -> MoeError {
    r.expect_err("the call must be refused")
}

#[test]
fn every_rule_is_a_typed_error() {
    let run = |attrs: MoeInitRoutingAttrs| moe_init_routing(&input(&X, 2, &IDS, 2), &attrs);
    let base = MoeInitRoutingAttrs::new(4);
    let cases: Vec<(MoeInitRoutingAttrs, &str, &str)> = vec![
        (
            MoeInitRoutingAttrs::new(0),
            "attribute",
            "1 <= expert_num <= 10240",
        ),
        (
            MoeInitRoutingAttrs::new(10241),
            "attribute",
            "1 <= expert_num <= 10240",
        ),
        (
            MoeInitRoutingAttrs {
                expert_tokens_num_type: ExpertTokensNumType::KeyValue,
                ..MoeInitRoutingAttrs::new(5121)
            },
            "attribute",
            "5120",
        ),
        (
            MoeInitRoutingAttrs {
                active_num: -2,
                ..base.clone()
            },
            "attribute",
            "active_num",
        ),
        (
            MoeInitRoutingAttrs {
                active_expert_range: Some([2, 2]),
                ..base.clone()
            },
            "attribute",
            "start < end",
        ),
        (
            MoeInitRoutingAttrs {
                active_expert_range: Some([0, 5]),
                ..base.clone()
            },
            "attribute",
            "end <= expert_num",
        ),
        (
            MoeInitRoutingAttrs {
                drop_pad_mode: DropPadMode::DropPad,
                expert_capacity: 4,
                expert_tokens_num_type: ExpertTokensNumType::Count,
                ..base.clone()
            },
            "attribute",
            "1 <= expert_capacity <= N",
        ),
        (
            MoeInitRoutingAttrs {
                drop_pad_mode: DropPadMode::DropPad,
                expert_capacity: 2,
                expert_tokens_num_type: ExpertTokensNumType::Count,
                active_expert_range: Some([0, 3]),
                ..base.clone()
            },
            "combination",
            "active_expert_range = [0, expert_num)",
        ),
        (
            MoeInitRoutingAttrs {
                drop_pad_mode: DropPadMode::DropPad,
                expert_capacity: 2,
                expert_tokens_num_type: ExpertTokensNumType::Count,
                row_idx_type: RowIdxType::Scatter,
                ..base.clone()
            },
            "combination",
            "row_idx_type 0",
        ),
        (
            MoeInitRoutingAttrs {
                drop_pad_mode: DropPadMode::DropPad,
                expert_capacity: 2,
                ..base.clone()
            },
            "combination",
            "expert_tokens_num_type 1",
        ),
        (
            MoeInitRoutingAttrs {
                quant_mode: QuantMode::Static,
                ..base.clone()
            },
            "shape",
            "requires it",
        ),
    ];
    for (attrs, kind, rule) in cases {
        let e = err_of(run(attrs.clone()));
        assert_eq!(e.kind(), kind, "{attrs:?}: {e}");
        assert!(e.to_string().contains(rule), "{attrs:?}: {e}");
    }
    // i8 x with quantisation.
    let x8 = [1i8, 2, 3, 4, 5, 6];
    let e = moe_init_routing(
        &input(&x8, 2, &IDS, 2),
        &MoeInitRoutingAttrs {
            quant_mode: QuantMode::Dynamic,
            ..base.clone()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("i8 x cannot be quantised"), "{e}");
    // Shapes.
    let e = err_of(moe_init_routing(&input(&X[..5], 2, &IDS, 2), &base));
    assert_eq!(e.kind(), "shape");
    let e = err_of(moe_init_routing(&input(&X, 2, &IDS[..5], 2), &base));
    assert!(e.to_string().contains("expert_idx"), "{e}");
    let bad_scale = MoeInitRoutingInput {
        scale: Some(&[1., 2.]),
        ..input(&X, 2, &IDS, 2)
    };
    let e = err_of(moe_init_routing(&bad_scale, &base));
    assert!(e.to_string().contains("[N] = [3]"), "{e}");
    let offset_without_static = MoeInitRoutingInput {
        offset: Some(&[1.]),
        ..input(&X, 2, &IDS, 2)
    };
    assert_eq!(
        err_of(moe_init_routing(&offset_without_static, &base)).kind(),
        "shape"
    );
    // Integer attributes outside their enums.
    assert!(QuantMode::try_from(2).is_err());
    assert!(RowIdxType::try_from(-1).is_err());
    assert_eq!(
        ExpertTokensNumType::try_from(2).unwrap(),
        ExpertTokensNumType::KeyValue
    );
    // Non-finite values to quantise name their row and column.
    let nan_x = [1., 2., 3., f32::NAN, 5., 6.];
    let dynamic = MoeInitRoutingAttrs {
        quant_mode: QuantMode::Dynamic,
        ..base.clone()
    };
    match err_of(moe_init_routing(&input(&nan_x, 2, &IDS, 2), &dynamic)) {
        MoeError::NonFinite { row, col, .. } => assert_eq!((row, col), (1, 1)),
        e => panic!("{e}"),
    }
    let inf_x = [1., 2., 3., 4., f32::INFINITY, 6.];
    match err_of(moe_init_routing(&input(&inf_x, 2, &IDS, 2), &dynamic)) {
        MoeError::NonFinite { row, col, .. } => assert_eq!((row, col), (2, 0)),
        e => panic!("{e}"),
    }
    // Static: inf saturates (a defined value), NaN is refused.
    let stat = MoeInitRoutingAttrs {
        quant_mode: QuantMode::Static,
        ..base.clone()
    };
    let inp = MoeInitRoutingInput {
        scale: Some(&[1.]),
        offset: Some(&[0.]),
        ..input(&inf_x, 2, &IDS, 2)
    };
    let out = moe_init_routing(&inp, &stat).unwrap();
    assert_eq!(
        int8(&out.expanded_x),
        [1, 2, 127, 6, 3, 4, 127, 6, 1, 2, 3, 4]
    );
    let inp = MoeInitRoutingInput {
        scale: Some(&[1.]),
        offset: Some(&[0.]),
        ..input(&nan_x, 2, &IDS, 2)
    };
    assert_eq!(err_of(moe_init_routing(&inp, &stat)).kind(), "non_finite");
}

#[test]
fn gating_and_unpermute_errors() {
    let logits = [0f32, 1., f32::NAN, 2.];
    let e = moe_gating_top_k_softmax(&logits, 2, 1, false, None).unwrap_err();
    assert!(
        matches!(e, MoeError::NonFinite { row: 1, col: 0, .. }),
        "{e}"
    );
    let e = moe_gating_top_k_softmax(&[0f32, 1.], 2, 3, false, None).unwrap_err();
    assert_eq!(e.kind(), "attribute");
    let e = moe_gating_top_k_softmax(&[0f32, 1., 2.], 2, 1, false, None).unwrap_err();
    assert_eq!(e.kind(), "shape");
    let e = moe_gating_top_k_softmax(&[f32::NEG_INFINITY; 2], 2, 1, false, None).unwrap_err();
    assert_eq!(e.kind(), "non_finite");
    let p = GroupedTopKParams {
        k: 2,
        k_group: 1,
        group_count: 3,
        ..GroupedTopKParams::default()
    };
    let e = moe_gating_top_k(&[0f32; 8], 8, None, &p).unwrap_err();
    assert!(e.to_string().contains("divide E"), "{e}");
    let e = moe_token_unpermute(&[1f32, 2.], 1, &[0, -2], None, 2, 2).unwrap_err();
    assert!(matches!(e, MoeError::Index { position: 1, .. }), "{e}");
    let e = moe_token_unpermute(&[1f32, 2.], 1, &[0, 1], None, 2, 3).unwrap_err();
    assert_eq!(e.kind(), "shape");
}

#[test]
fn grouped_gating_deepseek_v3() {
    // E = 8 in 4 groups of 2, keep 2 groups, k = 2, sigmoid scores, top-2-sum groups.
    // Logits chosen so that sigmoid values are easy: logit 0 -> 0.5.
    let logits = [0f32, 0., 1., -2., 2., -5., -3., -3.];
    let s: Vec<f32> = logits.iter().map(|&l| 1. / (1. + (-l).exp())).collect();
    // Correction bias lifts group 3.
    let bias = [0., 0., 0., 0., 0., 0., 0.5, 0.5];
    let p = GroupedTopKParams {
        k: 2,
        k_group: 2,
        group_count: 4,
        routed_scaling_factor: 2.5,
        ..GroupedTopKParams::default()
    };
    let g = moe_gating_top_k(&logits, 8, Some(&bias), &p).unwrap();
    // Biased top-2 group sums: g0 = 0.5 + 0.5 = 1.0, g1 = 0.731 + 0.119 = 0.850,
    // g2 = 0.881 + 0.007 = 0.887, g3 = 2 * (0.047 + 0.5) = 1.095. Kept: g3, g0. Biased scores
    // there: 0.5, 0.5, 0.547, 0.547: experts 6 and 7 (a tie, the lower id first).
    assert_eq!(g.expert_idx, [6, 7]);
    // Weights from the unbiased scores, renormalised, times 2.5: s6 = s7, so 1.25 each.
    let w = s[6] / (s[6] + s[7] + 1e-20) * 2.5;
    assert!((w - 1.25).abs() < 1e-6);
    assert!((g.weights[0] - w).abs() < 1e-6 && (g.weights[1] - w).abs() < 1e-6);
    // Without the bias: g0 = 1.0 and g2 = 0.887 are kept (g3 = 0.095): experts 0, 1, 4, 5;
    // top-2: 4 (0.881), then 0 (0.5, tied with 1, the lower id).
    let g = moe_gating_top_k(&logits, 8, None, &p).unwrap();
    assert_eq!(g.expert_idx, [4, 0]);
    assert!((g.weights[0] - s[4] / (s[4] + 0.5) * 2.5).abs() < 1e-6);
    // Max group scores instead: g0 = 0.5, g1 = 0.731, g2 = 0.881, g3 = 0.047: keep g2, g1:
    // top-2 = 4, 2.
    let max = GroupedTopKParams {
        group_select_mode: GroupSelectMode::Max,
        renorm: false,
        routed_scaling_factor: 1.0,
        ..p
    };
    let g = moe_gating_top_k(&logits, 8, None, &max).unwrap();
    assert_eq!(g.expert_idx, [4, 2]);
    assert_eq!(g.weights, [s[4], s[2]]);
}

#[test]
fn only_placed_rows_are_quantised() {
    // Row 1 holds a NaN but no route places it (its only route is invalid): every
    // quantisation path accepts the call, and the NaN row is refused once it is placed.
    let x = [1., f32::NAN];
    let dynamic = MoeInitRoutingAttrs {
        quant_mode: QuantMode::Dynamic,
        ..MoeInitRoutingAttrs::new(2)
    };
    let stat = MoeInitRoutingAttrs {
        quant_mode: QuantMode::Static,
        ..MoeInitRoutingAttrs::new(2)
    };
    let per_expert = [1., 1.];
    type Case<'a> = (
        &'a MoeInitRoutingAttrs,
        Option<&'a [f32]>,
        Option<&'a [f32]>,
    );
    let cases: [Case; 4] = [
        (&dynamic, None, None),
        (&dynamic, Some(&[1.]), None),
        (&dynamic, Some(&per_expert), None),
        (&stat, Some(&[1.]), Some(&[0.])),
    ];
    for (attrs, scale, offset) in cases {
        let inp = MoeInitRoutingInput {
            scale,
            offset,
            ..input(&x, 1, &[0, -1], 1)
        };
        let out = moe_init_routing(&inp, attrs).unwrap();
        let q = if attrs.quant_mode == QuantMode::Static {
            1
        } else {
            127
        };
        assert_eq!(int8(&out.expanded_x), [q, 0], "{attrs:?} {scale:?}");
        let inp = MoeInitRoutingInput {
            scale,
            offset,
            ..input(&x, 1, &[0, 1], 1)
        };
        match moe_init_routing(&inp, attrs).unwrap_err() {
            MoeError::NonFinite { row, col, .. } => assert_eq!((row, col), (1, 0)),
            e => panic!("{e}"),
        }
    }
    // A row dropped by active_num is not read either.
    let active = MoeInitRoutingAttrs {
        active_num: 1,
        ..dynamic.clone()
    };
    let out = moe_init_routing(&input(&x, 1, &[0, 0], 1), &active).unwrap();
    assert_eq!(int8(&out.expanded_x), [127]);
}

#[test]
fn dynamic_scale_underflow_gives_zeros() {
    // max|v| / 127 underflows to 0 in f32: q = 0, s = 0 (0 is the nearest dequantised value).
    let x = [1e-44f32, 0.];
    let attrs = MoeInitRoutingAttrs {
        quant_mode: QuantMode::Dynamic,
        ..MoeInitRoutingAttrs::new(1)
    };
    let out = moe_init_routing(&input(&x, 2, &[0], 1), &attrs).unwrap();
    assert_eq!(int8(&out.expanded_x), [0, 0]);
    assert_eq!(out.expanded_scale.unwrap(), [0.0]);
}

#[test]
fn a_non_finite_smooth_scale_is_named() {
    let attrs = MoeInitRoutingAttrs {
        quant_mode: QuantMode::Dynamic,
        ..MoeInitRoutingAttrs::new(2)
    };
    let smooth = [1., 1., 1., f32::INFINITY];
    let inp = MoeInitRoutingInput {
        scale: Some(&smooth),
        ..input(&[1f32, 2.], 2, &[0], 1)
    };
    match moe_init_routing(&inp, &attrs).unwrap_err() {
        MoeError::NonFinite {
            tensor, row, col, ..
        } => assert_eq!((tensor, row, col), ("scale", 1, 1)),
        e => panic!("{e}"),
    }
    // A product that overflows f32 names x and says why.
    let inp = MoeInitRoutingInput {
        scale: Some(&[2., 1.]),
        ..input(&[3e38f32, 1.], 2, &[0], 1)
    };
    let e = moe_init_routing(&inp, &attrs).unwrap_err();
    assert!(e.to_string().contains("overflowing"), "{e}");
}
