//! A whole MoE layer on our operators equals MiniMind's MoE feed-forward (spec/moe_routing.md,
//! "The MoE layer"): gating -> `moe_init_routing` (dropless, gather) -> each expert's SwiGLU
//! MLP on its contiguous rows -> `moe_token_unpermute`, against the naive loop over experts and
//! the tokens routed to each (f64), on random weights. Bound: max |difference| <= 1e-5 * max
//! |output|.

use nucleus_moe::*;

/// SplitMix64, for reproducible random weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-a, a).
    fn uniform(&mut self, a: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }

    fn vec(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(a)).collect()
    }
}

struct Layer {
    h: usize,
    inter: usize,
    e: usize,
    k: usize,
    norm_topk_prob: bool,
    /// `[E, H]`.
    w_gate: Vec<f32>,
    /// Per expert: gate `[I, H]`, up `[I, H]`, down `[H, I]`.
    experts: Vec<[Vec<f32>; 3]>,
}

impl Layer {
    fn random(rng: &mut Rng, h: usize, inter: usize, e: usize, k: usize, norm: bool) -> Self {
        let a = 1.0 / (h as f32).sqrt();
        Layer {
            h,
            inter,
            e,
            k,
            norm_topk_prob: norm,
            w_gate: rng.vec(e * h, a),
            experts: (0..e)
                .map(|_| {
                    [
                        rng.vec(inter * h, a),
                        rng.vec(inter * h, a),
                        rng.vec(h * inter, 1.0 / (inter as f32).sqrt()),
                    ]
                })
                .collect(),
        }
    }

    /// `x @ W_gate^T`, `[T, E]` f32: the gating logits both versions start from.
    fn gate_logits(&self, x: &[f32]) -> Vec<f32> {
        x.chunks(self.h)
            .flat_map(|row| {
                self.w_gate
                    .chunks(self.h)
                    .map(|w| row.iter().zip(w).map(|(a, b)| a * b).sum::<f32>())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// MiniMind's MoE feed-forward, literally: softmax scores, top-k (ties to the lower id),
    /// optional `w / (sum + 1e-20)`, then for each expert the tokens routed to it, in f64.
    fn naive(&self, x: &[f32]) -> Vec<f32> {
        let (h, e) = (self.h, self.e);
        let logits = self.gate_logits(x);
        let t = x.len() / h;
        let mut topk = Vec::new();
        for row in logits.chunks(e) {
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let exps: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
            let z: f64 = exps.iter().sum();
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| exps[b].partial_cmp(&exps[a]).unwrap().then(a.cmp(&b)));
            let mut chosen: Vec<(usize, f64)> =
                order[..self.k].iter().map(|&i| (i, exps[i] / z)).collect();
            if self.norm_topk_prob {
                let s: f64 = chosen.iter().map(|c| c.1).sum::<f64>() + 1e-20;
                chosen.iter_mut().for_each(|c| c.1 /= s);
            }
            topk.push(chosen);
        }
        let mut y = vec![0f64; t * h];
        for (ex, [wg, wu, wd]) in self.experts.iter().enumerate() {
            for tok in 0..t {
                let Some(&(_, w)) = topk[tok].iter().find(|c| c.0 == ex) else {
                    continue;
                };
                let v = &x[tok * h..][..h];
                let act: Vec<f64> = (0..self.inter)
                    .map(|i| {
                        let g: f64 = (0..h).map(|c| wg[i * h + c] as f64 * v[c] as f64).sum();
                        let u: f64 = (0..h).map(|c| wu[i * h + c] as f64 * v[c] as f64).sum();
                        g / (1.0 + (-g).exp()) * u
                    })
                    .collect();
                for c in 0..h {
                    let d: f64 = (0..self.inter)
                        .map(|i| wd[c * self.inter + i] as f64 * act[i])
                        .sum();
                    y[tok * h + c] += w * d;
                }
            }
        }
        y.into_iter().map(|v| v as f32).collect()
    }

    /// One expert's SwiGLU MLP on `rows [R, H]` in f32, into `out [R, H]`.
    fn expert(&self, ex: usize, rows: &[f32], out: &mut [f32]) {
        let [wg, wu, wd] = &self.experts[ex];
        let (h, inter) = (self.h, self.inter);
        for (v, o) in rows.chunks(h).zip(out.chunks_mut(h)) {
            let act: Vec<f32> = (0..inter)
                .map(|i| {
                    let g: f32 = wg[i * h..][..h].iter().zip(v).map(|(a, b)| a * b).sum();
                    let u: f32 = wu[i * h..][..h].iter().zip(v).map(|(a, b)| a * b).sum();
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for (c, o) in o.iter_mut().enumerate() {
                *o = wd[c * inter..][..inter]
                    .iter()
                    .zip(&act)
                    .map(|(a, b)| a * b)
                    .sum();
            }
        }
    }

    /// The gating of both routed versions: softmax scores, top-k, optional renormalisation
    /// (`moe_gating_top_k` with one group, softmax, `routed_scaling_factor` 1).
    fn gate(&self, x: &[f32]) -> GatingOutput {
        let params = GroupedTopKParams {
            k: self.k,
            k_group: 1,
            group_count: 1,
            group_select_mode: GroupSelectMode::Max,
            renorm: self.norm_topk_prob,
            norm_type: NormType::Softmax,
            routed_scaling_factor: 1.0,
            eps: 1e-20,
        };
        moe_gating_top_k(&self.gate_logits(x), self.e, None, &params).unwrap()
    }

    /// The layer on our operators, with the experts `[start, end)` of one expert-parallel rank
    /// (the whole layer when the range is `[0, E)`).
    fn routed(&self, x: &[f32], gating: &GatingOutput, range: [i64; 2]) -> Vec<f32> {
        let h = self.h;
        let attrs = MoeInitRoutingAttrs {
            expert_tokens_num_flag: true,
            expert_tokens_num_type: ExpertTokensNumType::Count,
            active_expert_range: Some(range),
            ..MoeInitRoutingAttrs::new(self.e as i64)
        };
        let input = MoeInitRoutingInput {
            x,
            num_rows: x.len() / h,
            hidden_size: h,
            expert_idx: &gating.expert_idx,
            k: self.k,
            scale: None,
            offset: None,
        };
        let routed = moe_init_routing(&input, &attrs).unwrap();
        let ExpandedX::Unquantized(expanded) = &routed.expanded_x else {
            panic!("unquantised");
        };
        let mut expert_out = vec![0f32; expanded.len()];
        let mut row = 0;
        for (i, &count) in routed.expert_tokens.as_ref().unwrap().iter().enumerate() {
            let rows = row * h..(row + count as usize) * h;
            self.expert(
                range[0] as usize + i,
                &expanded[rows.clone()],
                &mut expert_out[rows],
            );
            row += count as usize;
        }
        assert_eq!(row, routed.valid_rows);
        moe_token_unpermute(
            &expert_out,
            h,
            &routed.expanded_row_idx,
            Some(&gating.weights),
            self.k,
            routed.valid_rows,
        )
        .unwrap()
    }
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, &x| m.max(x.abs()))
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    let scale = max_abs(want);
    assert!(scale > 0.0, "{what}: the layer's output is all zeros");
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    // `--nocapture` shows how far inside the bound each case is.
    println!(
        "{what}: max |diff| {diff:.3e} = {:.2e} x max |output| {scale:.3e}",
        diff / scale
    );
    assert!(
        diff <= 1e-5 * scale,
        "{what}: max |diff| {diff:e} > 1e-5 * max |output| {scale:e}"
    );
}

#[test]
fn routed_layer_equals_minimind_loop() {
    let mut rng = Rng(0x6d6f_655f_6c61_7972);
    // (T, H, I, E, k, norm_topk_prob): MiniMind's MoE config (E 4, k 2, norm) and others.
    for &(t, h, inter, e, k, norm) in &[
        (1, 16, 24, 4, 2, true),
        (37, 32, 48, 4, 2, true),
        (64, 24, 40, 8, 2, false),
        (50, 16, 32, 16, 4, true),
        (9, 8, 8, 8, 1, true),
        (20, 12, 16, 6, 6, false),
    ] {
        let layer = Layer::random(&mut rng, h, inter, e, k, norm);
        let x = rng.vec(t * h, 1.0);
        let want = layer.naive(&x);
        let gating = layer.gate(&x);
        let got = layer.routed(&x, &gating, [0, e as i64]);
        assert_close(&got, &want, &format!("T {t} H {h} I {inter} E {e} k {k}"));
    }
}

#[test]
fn expert_parallel_ranks_sum_to_the_layer() {
    // Two ranks, each with half the experts (`active_expert_range`); routes to the other
    // rank's experts are invalid routes there and contribute nothing, so the ranks' outputs
    // add up to the whole layer.
    let mut rng = Rng(42);
    let (t, h, inter, e, k) = (40, 16, 24, 8, 3);
    let layer = Layer::random(&mut rng, h, inter, e, k, true);
    let x = rng.vec(t * h, 1.0);
    let want = layer.naive(&x);
    let gating = layer.gate(&x);
    let a = layer.routed(&x, &gating, [0, 3]);
    let b = layer.routed(&x, &gating, [3, 8]);
    let sum: Vec<f32> = a.iter().zip(&b).map(|(p, q)| p + q).collect();
    assert_close(&sum, &want, "ranks [0, 3) + [3, 8)");
}
