//! The straightforward way to compute the benchmark's MoE routing calls (spec/moe_routing.md,
//! as a PyTorch user writes them): `moe_init_routing` in its dropless / gather / count mode as a
//! stable argsort of the routes by expert id (`sort_by_key`) and one loop that copies each
//! placed route's row, fills the gather index and counts the routes per expert; dynamic int8 as
//! the same loop quantising every expanded row (so each token's row is quantised once per
//! route); `moe_token_unpermute` as a loop over tokens and their K routes accumulating in f32.
//! Everything on the calling thread.
//!
//! A baseline for `nucleus bench moe`, not an oracle (the benchmark checks that it agrees with
//! nucleus-moe exactly on its data). Preconditions: `expert_idx` is `[N, K]`, `x` is `[N, H]`,
//! every `x` value finite; the active expert range is `[0, E)` (ids outside it are routes that
//! are not placed, as in the spec).

use nucleus_moe::{Element, FloatElement};

/// The outputs of [`init_routing`] / [`init_routing_dynamic_int8`], buffers reused across
/// calls (their capacities are kept).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routed<E> {
    /// `expanded_x [N * K, H]`: the placed routes' rows in sorted order, then zero rows.
    pub expanded_x: Vec<E>,
    /// `expanded_row_idx [N * K]`, gather: the row of route `j`, -1 if not placed.
    pub expanded_row_idx: Vec<i32>,
    /// `expert_tokens [E]`: routes per expert (count).
    pub expert_tokens: Vec<i64>,
    /// `expanded_scale [N * K]`: dynamic int8 only, the dequantisation scale of each row (0
    /// for the zero rows); empty otherwise.
    pub expanded_scale: Vec<f32>,
    /// Rows of `expanded_x` holding placed routes.
    pub valid_rows: usize,
}

/// The routes `j = i*K + k` in the spec's order: a stable sort by expert id, ids in `[0, E)`
/// and `>= E` ascending, then the negative ids in route order.
pub fn sort_routes(expert_idx: &[i32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..expert_idx.len()).collect();
    order.sort_by_key(|&j| {
        let id = expert_idx[j];
        if id < 0 {
            i64::MAX
        } else {
            i64::from(id)
        }
    });
    order
}

/// Walks the sorted routes that land on an expert in `[0, experts)`: fills the gather index
/// and the counts of `out` and calls `place(token)` once per placed route, in row order.
fn place_routes<E>(
    expert_idx: &[i32],
    k: usize,
    experts: usize,
    out: &mut Routed<E>,
    mut place: impl FnMut(usize, &mut Routed<E>),
) {
    let nk = expert_idx.len();
    out.expanded_x.clear();
    out.expanded_scale.clear();
    out.expanded_row_idx.clear();
    out.expanded_row_idx.resize(nk, -1);
    out.expert_tokens.clear();
    out.expert_tokens.resize(experts, 0);
    out.valid_rows = 0;
    for j in sort_routes(expert_idx) {
        let id = expert_idx[j];
        if id < 0 || id as usize >= experts {
            // Ids past E and negative ids sort last: nothing more is placed.
            break;
        }
        out.expanded_row_idx[j] = out.valid_rows as i32;
        out.expert_tokens[id as usize] += 1;
        out.valid_rows += 1;
        place(j / k, out);
    }
}

/// `moe_init_routing`, dropless, gather index, count `expert_tokens`, no quantisation, into
/// `out`: `x [N, H]`, `expert_idx [N, K]`, E = `experts`.
pub fn init_routing<T: Element>(
    x: &[T],
    h: usize,
    expert_idx: &[i32],
    k: usize,
    experts: usize,
    out: &mut Routed<T>,
) {
    // Room for every row at once: grown row by row, the vector doubled past its length (a
    // 606 MB expanded_x took 1 GB), beyond what `nucleus bench moe` reserved.
    out.expanded_x.clear();
    out.expanded_x.reserve_exact(expert_idx.len() * h);
    place_routes(expert_idx, k, experts, out, |i, out| {
        out.expanded_x.extend_from_slice(&x[i * h..(i + 1) * h]);
    });
    out.expanded_x.resize(expert_idx.len() * h, T::default());
}

/// As [`init_routing`] with dynamic int8 quantisation (quant_mode 1, no smooth scale): each
/// expanded row `v` becomes `round_half_even(v / s)` with `s = max|v| / 127` (0 and 0 for an
/// all-zero row), and `s` goes to `expanded_scale`.
pub fn init_routing_dynamic_int8<T: Element>(
    x: &[T],
    h: usize,
    expert_idx: &[i32],
    k: usize,
    experts: usize,
    out: &mut Routed<i8>,
) {
    // Reserved at once, as in `init_routing`.
    out.expanded_x.clear();
    out.expanded_x.reserve_exact(expert_idx.len() * h);
    out.expanded_scale.clear();
    out.expanded_scale.reserve_exact(expert_idx.len());
    place_routes(expert_idx, k, experts, out, |i, out| {
        let row = &x[i * h..(i + 1) * h];
        let max = row.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        let s = max / 127.0;
        out.expanded_scale.push(s);
        if s == 0.0 {
            out.expanded_x.resize(out.expanded_x.len() + h, 0);
        } else {
            out.expanded_x.extend(
                row.iter()
                    .map(|v| (v.to_f32() / s).round_ties_even().clamp(-128.0, 127.0) as i8),
            );
        }
    });
    out.expanded_x.resize(expert_idx.len() * h, 0);
    out.expanded_scale.resize(expert_idx.len(), 0.0);
}

/// `moe_token_unpermute`: `out[i] = sum_k w[i,k] * expert_out[expanded_row_idx[i*K + k]]`,
/// accumulated in f32 in slot order and rounded once; an index of -1 or at or past
/// `valid_rows` contributes nothing. Returns `out [N, H]` (a new vector, as the operator does).
pub fn unpermute<T: FloatElement>(
    expert_out: &[T],
    h: usize,
    expanded_row_idx: &[i32],
    weights: &[f32],
    k: usize,
    valid_rows: usize,
) -> Vec<T> {
    let n = expanded_row_idx.len() / k;
    let mut out = Vec::with_capacity(n * h);
    let mut acc = vec![0f32; h];
    for i in 0..n {
        acc.fill(0.0);
        for j in i * k..(i + 1) * k {
            let r = expanded_row_idx[j];
            if r < 0 || r as usize >= valid_rows {
                continue;
            }
            let w = weights[j];
            let row = &expert_out[r as usize * h..][..h];
            for (a, v) in acc.iter_mut().zip(row) {
                *a += w * v.to_f32();
            }
        }
        out.extend(acc.iter().map(|&a| T::from_f32(a)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec's first worked case: x = [[1,10],[2,20],[3,30]], ids [[2,0],[1,2],[0,1]], E 4.
    #[test]
    fn matches_the_spec_worked_case() {
        let x = [1f32, 10., 2., 20., 3., 30.];
        let ids = [2, 0, 1, 2, 0, 1];
        let mut out = Routed::default();
        init_routing(&x, 2, &ids, 2, 4, &mut out);
        assert_eq!(
            out.expanded_x,
            [1., 10., 3., 30., 2., 20., 3., 30., 1., 10., 2., 20.]
        );
        assert_eq!(out.expanded_row_idx, [4, 0, 2, 5, 1, 3]);
        assert_eq!(out.expert_tokens, [2, 2, 2, 0]);
        assert_eq!(out.valid_rows, 6);
        let w = [0.5, 0.5, 0.25, 0.75, 1.0, 0.0];
        let back = unpermute(&out.expanded_x, 2, &out.expanded_row_idx, &w, 2, 6);
        assert_eq!(back, x);
    }

    /// The spec's sentinel case: a -1 route is not placed; its row is zeros at the end.
    #[test]
    fn skips_negative_ids() {
        let x = [1f32, 2.];
        let ids = [0, -1, 2, 0];
        let mut out = Routed::default();
        init_routing(&x, 1, &ids, 2, 3, &mut out);
        assert_eq!(out.expanded_x, [1., 2., 2., 0.]);
        assert_eq!(out.expanded_row_idx, [0, -1, 2, 1]);
        assert_eq!(out.expert_tokens, [2, 0, 1]);
        assert_eq!(out.valid_rows, 3);
    }

    /// The spec's dynamic int8 case.
    #[test]
    fn dynamic_int8_matches_the_spec() {
        let x = [254f32, 5., -3., -127., 62.5, 0.5];
        let mut out = Routed::default();
        init_routing_dynamic_int8(&x, 3, &[1, 0], 1, 2, &mut out);
        assert_eq!(out.expanded_x, [-127, 62, 0, 127, 2, -2]);
        assert_eq!(out.expanded_scale, [1.0, 2.0]);
        assert_eq!(out.expanded_row_idx, [1, 0]);
    }
}
