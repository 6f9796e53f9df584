//! `moe_init_routing_into` reusing one output across calls of different shapes and modes gives
//! exactly what a fresh `moe_init_routing` gives (no stale rows, scales or token counts), also
//! on shapes large enough for the parallel row copy, and whatever the rayon thread count.

use nucleus_moe::*;

fn ids(n: usize, k: usize, e: i32, seed: u64) -> Vec<i32> {
    let mut s = seed;
    (0..n * k)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % (e as u64 + 2)) as i32 - 1
        })
        .collect()
}

#[test]
fn into_reuse_equals_fresh() {
    let mut out = MoeInitRoutingOutput::<f32>::default();
    // (N, H, K, E, attrs): large first (parallel copy), then smaller, then quantised, then
    // drop/pad, then large again.
    let calls: Vec<(usize, usize, usize, i64, MoeInitRoutingAttrs)> = vec![
        (512, 256, 4, 16, MoeInitRoutingAttrs::new(16)),
        (
            7,
            5,
            2,
            4,
            MoeInitRoutingAttrs {
                active_num: 5,
                expert_tokens_num_flag: true,
                ..MoeInitRoutingAttrs::new(4)
            },
        ),
        (
            300,
            300,
            3,
            8,
            MoeInitRoutingAttrs {
                quant_mode: QuantMode::Dynamic,
                ..MoeInitRoutingAttrs::new(8)
            },
        ),
        (
            64,
            33,
            2,
            8,
            MoeInitRoutingAttrs {
                drop_pad_mode: DropPadMode::DropPad,
                expert_capacity: 9,
                expert_tokens_num_type: ExpertTokensNumType::Count,
                expert_tokens_num_flag: true,
                ..MoeInitRoutingAttrs::new(8)
            },
        ),
        (
            512,
            256,
            4,
            16,
            MoeInitRoutingAttrs {
                row_idx_type: RowIdxType::Scatter,
                active_expert_range: Some([3, 11]),
                ..MoeInitRoutingAttrs::new(16)
            },
        ),
    ];
    for (c, (n, h, k, e, attrs)) in calls.into_iter().enumerate() {
        let x: Vec<f32> = (0..n * h).map(|i| (i % 977) as f32 - 488.0).collect();
        let expert_idx = ids(n, k, e as i32, c as u64);
        let input = MoeInitRoutingInput {
            x: &x,
            num_rows: n,
            hidden_size: h,
            expert_idx: &expert_idx,
            k,
            scale: None,
            offset: None,
        };
        let fresh = moe_init_routing(&input, &attrs).unwrap();
        moe_init_routing_into(&input, &attrs, &mut out).unwrap();
        assert_eq!(out, fresh, "call {c}");
        // The same on one thread.
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(|| moe_init_routing(&input, &attrs).unwrap());
        assert_eq!(one, fresh, "call {c}, one thread");
        // Every valid dropless row is its source row; rows past valid_rows are zeros.
        if attrs.drop_pad_mode == DropPadMode::Dropless && attrs.quant_mode == QuantMode::None {
            let ExpandedX::Unquantized(v) = &fresh.expanded_x else {
                panic!()
            };
            for (r, row) in v.chunks(h).enumerate() {
                if r >= fresh.valid_rows {
                    assert!(row.iter().all(|&z| z == 0.0), "call {c} row {r}");
                }
            }
        }
    }
}

#[test]
fn finalize_into_reuse_equals_fresh() {
    let mut out = vec![7f32; 3];
    for (c, (n, h, k)) in [(40usize, 33usize, 3usize), (2, 5, 1), (300, 512, 4)]
        .into_iter()
        .enumerate()
    {
        let x: Vec<f32> = (0..n * h).map(|i| (i % 101) as f32 * 0.25 - 12.0).collect();
        let expert_idx = ids(n, k, 8, 10 + c as u64);
        let routed = moe_init_routing(
            &MoeInitRoutingInput {
                x: &x,
                num_rows: n,
                hidden_size: h,
                expert_idx: &expert_idx,
                k,
                scale: None,
                offset: None,
            },
            &MoeInitRoutingAttrs::new(8),
        )
        .unwrap();
        let ExpandedX::Unquantized(expert_out) = &routed.expanded_x else {
            panic!()
        };
        let weights: Vec<f32> = (0..n * k).map(|j| 1.0 / (1 + j % 5) as f32).collect();
        let input = FinalizeRoutingInput {
            expert_out,
            hidden_size: h,
            valid_rows: routed.valid_rows,
            expanded_row_idx: &routed.expanded_row_idx,
            k,
            weights: Some(&weights),
            expert_idx: None,
            skip1: Some(&x),
            skip2: None,
            bias: None,
        };
        let fresh = moe_finalize_routing(&input).unwrap();
        moe_finalize_routing_into(&input, &mut out).unwrap();
        assert_eq!(out, fresh, "call {c}");
        assert_eq!(out.len(), n * h);
    }
}
