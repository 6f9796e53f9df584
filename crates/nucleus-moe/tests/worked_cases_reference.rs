//! The reference of `tests/reference` against every worked case of spec/moe_routing.md
//! ("Worked cases"), exact values: proves the oracle that `random_vs_reference.rs` trusts.

mod reference;

use reference::{
    finalize, gating_top_k_softmax, init_routing, RefAttrs, RefFinalize, RefInput, RefOutput, RefX,
};

/// The common inputs: x = [[1,10],[2,20],[3,30]], expert_idx = [[2,0],[1,2],[0,1]], E = 4.
fn common(scale: Option<Vec<f32>>) -> RefInput {
    RefInput {
        x: vec![1., 10., 2., 20., 3., 30.],
        x_is_i8: false,
        n: 3,
        h: 2,
        expert_idx: vec![2, 0, 1, 2, 0, 1],
        k: 2,
        scale,
        offset: None,
    }
}

fn floats(o: &RefOutput) -> &[f32] {
    match &o.expanded_x {
        RefX::Float(v) => v,
        RefX::Int8(_) => panic!("expected float rows"),
    }
}

fn int8(o: &RefOutput) -> &[i8] {
    match &o.expanded_x {
        RefX::Int8(v) => v,
        RefX::Float(_) => panic!("expected int8 rows"),
    }
}

#[test]
fn route_order_of_the_common_inputs() {
    assert_eq!(
        reference::route_order(&[2, 0, 1, 2, 0, 1], 0, 4),
        vec![1, 4, 2, 5, 0, 3]
    );
}

#[test]
fn dropless_gather_count() {
    let a = RefAttrs {
        expert_tokens_num_type: 1,
        expert_tokens_num_flag: true,
        ..RefAttrs::new(4)
    };
    let o = init_routing(&common(None), &a).unwrap();
    assert_eq!(
        floats(&o),
        &[1., 10., 3., 30., 2., 20., 3., 30., 1., 10., 2., 20.]
    );
    assert_eq!(o.expanded_x_shape, vec![6, 2]);
    assert_eq!(o.expanded_row_idx, vec![4, 0, 2, 5, 1, 3]);
    assert_eq!(o.expert_tokens, Some(vec![2, 2, 2, 0]));
    assert_eq!(o.expanded_scale, None);
    assert_eq!(o.valid_rows, 6);
}

#[test]
fn dropless_scatter_cumsum() {
    let a = RefAttrs {
        expert_tokens_num_type: 0,
        expert_tokens_num_flag: true,
        row_idx_type: 1,
        ..RefAttrs::new(4)
    };
    let o = init_routing(&common(None), &a).unwrap();
    assert_eq!(o.expanded_row_idx, vec![1, 4, 2, 5, 0, 3]);
    assert_eq!(o.expert_tokens, Some(vec![2, 4, 6, 6]));
}

#[test]
fn key_value_with_per_row_scale() {
    let a = RefAttrs {
        expert_tokens_num_type: 2,
        expert_tokens_num_flag: true,
        ..RefAttrs::new(4)
    };
    let o = init_routing(&common(Some(vec![0.5, 0.25, 0.125])), &a).unwrap();
    assert_eq!(o.expert_tokens, Some(vec![0, 2, 1, 2, 2, 2, 0, 0]));
    assert_eq!(
        o.expanded_scale,
        Some(vec![0.5, 0.125, 0.25, 0.125, 0.5, 0.25])
    );
}

#[test]
fn active_num_4() {
    let a = RefAttrs {
        active_num: 4,
        expert_tokens_num_type: 1,
        expert_tokens_num_flag: true,
        ..RefAttrs::new(4)
    };
    let o = init_routing(&common(None), &a).unwrap();
    assert_eq!(floats(&o), &[1., 10., 3., 30., 2., 20., 3., 30.]);
    assert_eq!(o.expanded_x_shape, vec![4, 2]);
    assert_eq!(o.expanded_row_idx, vec![4, 0, 2, 5, 1, 3]);
    assert_eq!(o.expert_tokens, Some(vec![2, 2, 2, 0]));
    assert_eq!(o.valid_rows, 4);
}

#[test]
fn active_expert_range_1_3() {
    let input = RefInput {
        x: vec![1., 1.5, 2., 2.5, 3., 3.5, 4., 4.5],
        x_is_i8: false,
        n: 4,
        h: 2,
        expert_idx: vec![0, 3, 1, 2, 3, 1, 2, 0],
        k: 2,
        scale: None,
        offset: None,
    };
    let a = RefAttrs {
        active_expert_range: Some([1, 3]),
        expert_tokens_num_type: 1,
        expert_tokens_num_flag: true,
        ..RefAttrs::new(4)
    };
    let o = init_routing(&input, &a).unwrap();
    assert_eq!(o.valid_rows, 4);
    assert_eq!(o.expanded_x_shape, vec![8, 2]);
    let mut want = vec![2., 2.5, 3., 3.5, 2., 2.5, 4., 4.5];
    want.resize(16, 0.0); // rows past the valid count are zeros
    assert_eq!(floats(&o), &want[..]);
    assert_eq!(o.expanded_row_idx, vec![-1, -1, 0, 2, -1, 1, 3, -1]);
    assert_eq!(o.expert_tokens, Some(vec![2, 2]));
    // The sorted tail: ids >= end ascending (j 1, 4: expert 3), then ids < start in route order.
    assert_eq!(
        reference::route_order(&input.expert_idx, 1, 3),
        vec![2, 5, 3, 6, 1, 4, 0, 7]
    );
}

#[test]
fn drop_pad_capacity_2() {
    let input = RefInput {
        x: vec![1., -1., 2., -2., 3., -3., 4., -4.],
        x_is_i8: false,
        n: 4,
        h: 2,
        expert_idx: vec![0, 1, 0, 2, 1, 0, 0, 2],
        k: 2,
        scale: Some(vec![1., 2., 3., 4.]),
        offset: None,
    };
    let a = RefAttrs {
        drop_pad_mode: 1,
        expert_capacity: 2,
        expert_tokens_num_type: 1,
        expert_tokens_num_flag: true,
        ..RefAttrs::new(4)
    };
    let o = init_routing(&input, &a).unwrap();
    assert_eq!(o.expanded_x_shape, vec![4, 2, 2]);
    assert_eq!(
        floats(&o),
        &[1., -1., 2., -2., 1., -1., 3., -3., 2., -2., 4., -4., 0., 0., 0., 0.]
    );
    assert_eq!(o.expanded_row_idx, vec![0, 2, 1, 4, 3, -1, -1, 5]);
    assert_eq!(o.expert_tokens, Some(vec![4, 2, 2, 0]));
    assert_eq!(o.expanded_scale, Some(vec![1., 2., 1., 3., 2., 4., 0., 0.]));
    assert_eq!(o.valid_rows, 8);
}

#[test]
fn dynamic_int8() {
    let input = RefInput {
        x: vec![254., 5., -3., -127., 62.5, 0.5],
        x_is_i8: false,
        n: 2,
        h: 3,
        expert_idx: vec![1, 0],
        k: 1,
        scale: None,
        offset: None,
    };
    let a = RefAttrs {
        quant_mode: 1,
        ..RefAttrs::new(2)
    };
    let o = init_routing(&input, &a).unwrap();
    assert_eq!(int8(&o), &[-127, 62, 0, 127, 2, -2]);
    assert_eq!(o.expanded_scale, Some(vec![1.0, 2.0]));
    assert_eq!(o.expanded_row_idx, vec![1, 0]);
}

#[test]
fn static_int8() {
    let input = RefInput {
        x: vec![0.25, 1., 100., -70., -0.75, 0., -1.25, 63.],
        x_is_i8: false,
        n: 2,
        h: 4,
        expert_idx: vec![1, 0],
        k: 1,
        scale: Some(vec![2.]),
        offset: Some(vec![0.5]),
    };
    let a = RefAttrs {
        quant_mode: 0,
        ..RefAttrs::new(2)
    };
    let o = init_routing(&input, &a).unwrap();
    assert_eq!(int8(&o), &[-1, 0, -2, 126, 1, 2, 127, -128]);
    assert_eq!(o.expanded_scale, None);
}

#[test]
fn sentinel_minus_one() {
    let input = RefInput {
        x: vec![1., 2.],
        x_is_i8: false,
        n: 2,
        h: 1,
        expert_idx: vec![0, -1, 2, 0],
        k: 2,
        scale: None,
        offset: None,
    };
    let a = RefAttrs {
        expert_tokens_num_type: 1,
        expert_tokens_num_flag: true,
        ..RefAttrs::new(3)
    };
    let o = init_routing(&input, &a).unwrap();
    assert_eq!(o.valid_rows, 3);
    assert_eq!(floats(&o), &[1., 2., 2., 0.]);
    assert_eq!(o.expanded_row_idx, vec![0, -1, 2, 1]);
    assert_eq!(o.expert_tokens, Some(vec![2, 0, 1]));
}

#[test]
fn gating_softmax_top2() {
    let logits = [0.0, 3f32.ln(), 2f32.ln(), f32::NEG_INFINITY];
    let close = |a: &[f64], b: &[f64]| {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6)
    };
    let g = gating_top_k_softmax(&logits, 4, 2, false, None).unwrap();
    assert_eq!(g.expert_idx, vec![1, 2]);
    assert!(close(&g.weights, &[0.5, 1.0 / 3.0]), "{:?}", g.weights);
    let g = gating_top_k_softmax(&logits, 4, 2, true, None).unwrap();
    assert_eq!(g.expert_idx, vec![1, 2]);
    assert!(close(&g.weights, &[0.6, 0.4]), "{:?}", g.weights);
    // A finished row gets expert id E.
    let g = gating_top_k_softmax(&logits, 4, 2, false, Some(&[true])).unwrap();
    assert_eq!(g.expert_idx, vec![4, 4]);
}

#[test]
fn unpermute_identity_expert() {
    let a = RefAttrs::new(4);
    let o = init_routing(&common(None), &a).unwrap();
    assert_eq!(o.expanded_row_idx, vec![4, 0, 2, 5, 1, 3]);
    let w = [0.5, 0.5, 0.25, 0.75, 1., 0.];
    let (out, _) = finalize(&RefFinalize {
        expert_out: floats(&o),
        h: 2,
        valid_rows: o.valid_rows,
        expanded_row_idx: &o.expanded_row_idx,
        k: 2,
        weights: Some(&w),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(out, vec![1., 10., 2., 20., 3., 30.]);
}

#[test]
fn reference_refuses_the_listed_rules() {
    let ok = RefAttrs::new(4);
    assert!(init_routing(&common(None), &ok).is_ok());
    let bad = [
        RefAttrs::new(0),
        RefAttrs::new(10241),
        RefAttrs {
            expert_tokens_num_type: 2,
            ..RefAttrs::new(5121)
        },
        RefAttrs {
            active_num: -2,
            ..RefAttrs::new(4)
        },
        RefAttrs {
            active_expert_range: Some([2, 2]),
            ..RefAttrs::new(4)
        },
        RefAttrs {
            active_expert_range: Some([0, 5]),
            ..RefAttrs::new(4)
        },
        RefAttrs {
            drop_pad_mode: 1,
            expert_capacity: 4,
            expert_tokens_num_type: 1,
            ..RefAttrs::new(4)
        },
        RefAttrs {
            drop_pad_mode: 1,
            expert_capacity: 2,
            expert_tokens_num_type: 0,
            ..RefAttrs::new(4)
        },
        RefAttrs {
            drop_pad_mode: 1,
            expert_capacity: 2,
            expert_tokens_num_type: 1,
            row_idx_type: 1,
            ..RefAttrs::new(4)
        },
        RefAttrs {
            drop_pad_mode: 1,
            expert_capacity: 2,
            expert_tokens_num_type: 1,
            active_expert_range: Some([0, 3]),
            ..RefAttrs::new(4)
        },
        RefAttrs {
            quant_mode: 0,
            ..RefAttrs::new(4)
        },
    ];
    for a in &bad {
        assert!(init_routing(&common(None), a).is_err(), "{a:?}");
    }
    // i8 x with quantisation.
    let mut i8x = common(None);
    i8x.x_is_i8 = true;
    let dynamic = RefAttrs {
        quant_mode: 1,
        ..RefAttrs::new(4)
    };
    assert!(init_routing(&i8x, &dynamic).is_err());
    assert!(init_routing(&i8x, &RefAttrs::new(4)).is_ok());
}
