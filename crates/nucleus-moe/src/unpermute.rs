//! `moe_token_unpermute` and `moe_finalize_routing`: spec/moe_routing.md, "The ops around it".

use rayon::prelude::*;

use crate::{FloatElement, MoeError, PARALLEL_MIN_BYTES};

/// The tensors of [`moe_finalize_routing`], flat and row-major.
#[derive(Clone, Copy, Debug)]
pub struct FinalizeRoutingInput<'a, T> {
    /// `expert_out [R, H]`: the experts' outputs, row `r` for `expanded_x` row `r` (R >= the
    /// valid row count).
    pub expert_out: &'a [T],
    /// H (>= 1).
    pub hidden_size: usize,
    /// Rows of `expert_out` that hold results ([`MoeInitRoutingOutput::valid_rows`]); an index
    /// at or past it contributes nothing (a route dropped by `active_num`).
    ///
    /// [`MoeInitRoutingOutput::valid_rows`]: crate::MoeInitRoutingOutput::valid_rows
    pub valid_rows: usize,
    /// The gather `expanded_row_idx [N * K]` of `moe_init_routing` (`row_idx_type` 0): route
    /// `j = i*K + k` went to row `expanded_row_idx[j]`, -1 if it was not placed.
    pub expanded_row_idx: &'a [i32],
    /// K (>= 1).
    pub k: usize,
    /// `weights [N, K]` f32 (the gating weights); `None` weighs every route 1.
    pub weights: Option<&'a [f32]>,
    /// `expert_idx [N, K]`: the expert of each route, read only to index `bias`.
    pub expert_idx: Option<&'a [i32]>,
    /// `skip1 [N, H]`, added to the output (optional).
    pub skip1: Option<&'a [T]>,
    /// `skip2 [N, H]`, added to the output (optional).
    pub skip2: Option<&'a [T]>,
    /// `bias [E, H]`, each expert's output bias, added inside the weight (optional; needs
    /// `expert_idx`).
    pub bias: Option<&'a [T]>,
}

/// Combines each token's expert outputs: spec/moe_routing.md, `moe_token_unpermute`:
/// `out[i] = sum_k w[i,k] * expert_out[expanded_row_idx[i*K + k]]` (torch_npu's
/// `npu_moe_token_unpermute` with a gather index).
///
/// `expert_out [R, H]` (f32, f16 or bf16), `expanded_row_idx [N * K]` i32 (gather),
/// `weights [N, K]` f32 or `None` (weight 1). An index of -1, or one at or past `valid_rows`,
/// contributes nothing; a token with no placed route gets zeros. Sums are accumulated in f32 in
/// slot order `k = 0..K` and rounded once to `T`. Returns `out [N, H]`. Tokens are combined in
/// parallel when the output is large; the result does not depend on the thread count. To write
/// into a buffer reused from call to call, use [`moe_finalize_routing_into`].
///
/// # Errors
/// [`MoeError`]: `H == 0` or `K == 0`; `expert_out` not a multiple of H; `valid_rows > R`;
/// `expanded_row_idx` not a multiple of K; `weights` not `[N, K]`; an index below -1.
pub fn moe_token_unpermute<T: FloatElement>(
    expert_out: &[T],
    hidden_size: usize,
    expanded_row_idx: &[i32],
    weights: Option<&[f32]>,
    k: usize,
    valid_rows: usize,
) -> Result<Vec<T>, MoeError> {
    moe_finalize_routing(&FinalizeRoutingInput {
        expert_out,
        hidden_size,
        valid_rows,
        expanded_row_idx,
        k,
        weights,
        expert_idx: None,
        skip1: None,
        skip2: None,
        bias: None,
    })
}

/// [`moe_token_unpermute`] with skip connections and an expert bias: spec/moe_routing.md,
/// `moe_finalize_routing` (torch_npu's `npu_moe_finalize_routing`, with our gather index):
/// `out[i] = skip1[i] + skip2[i] + sum_k w[i,k] * (expert_out[idx] + bias[expert_idx[i,k]])`,
/// accumulated in f32 in that order; routes not placed (index -1 or `>= valid_rows`) contribute
/// nothing, bias included. Returns `out [N, H]`.
///
/// # Errors
/// Those of [`moe_token_unpermute`], and: `skip1` / `skip2` not `[N, H]`; `bias` not `[E, H]`
/// with E >= 1; `bias` without `expert_idx`; `expert_idx` not `[N, K]`; a placed route whose
/// expert id is outside `[0, E)`.
pub fn moe_finalize_routing<T: FloatElement>(
    input: &FinalizeRoutingInput<'_, T>,
) -> Result<Vec<T>, MoeError> {
    let mut out = Vec::new();
    moe_finalize_routing_into(input, &mut out)?;
    Ok(out)
}

/// [`moe_finalize_routing`] into `out`, which is set to `[N, H]` (no allocation when its
/// capacity suffices: an engine reuses one buffer across steps). On error `out` may have been
/// cleared.
pub fn moe_finalize_routing_into<'a, T: FloatElement>(
    input: &FinalizeRoutingInput<'a, T>,
    out: &mut Vec<T>,
) -> Result<(), MoeError> {
    let (h, k) = (input.hidden_size, input.k);
    if h == 0 {
        return Err(MoeError::shape(
            "expert_out",
            "the hidden size H must be at least 1",
        ));
    }
    if k == 0 {
        return Err(MoeError::shape(
            "expanded_row_idx",
            "K (experts per row) must be at least 1",
        ));
    }
    if !input.expert_out.len().is_multiple_of(h) {
        return Err(MoeError::shape(
            "expert_out",
            format!(
                "expert_out must be [R, H] with H = {h}, got {} elements (not a multiple of H)",
                input.expert_out.len()
            ),
        ));
    }
    let r = input.expert_out.len() / h;
    if input.valid_rows > r {
        return Err(MoeError::shape(
            "expert_out",
            format!(
                "valid_rows = {} but expert_out has only {r} rows",
                input.valid_rows
            ),
        ));
    }
    let idx = input.expanded_row_idx;
    if !idx.len().is_multiple_of(k) {
        return Err(MoeError::shape(
            "expanded_row_idx",
            format!(
                "expanded_row_idx must be [N * K] with K = {k}, got {} elements",
                idx.len()
            ),
        ));
    }
    let n = idx.len() / k;
    if let Some(w) = input.weights {
        if w.len() != n * k {
            return Err(MoeError::shape(
                "weights",
                format!(
                    "weights must be [N, K] = [{n}, {k}], got {} elements",
                    w.len()
                ),
            ));
        }
    }
    if let Some(position) = idx.iter().position(|&v| v < -1) {
        return Err(MoeError::Index {
            tensor: "expanded_row_idx",
            position,
            value: idx[position] as i64,
            rule: "a gather index is -1 (not placed) or a row of expert_out",
        });
    }
    for (name, skip) in [("skip1", input.skip1), ("skip2", input.skip2)] {
        if let Some(s) = skip {
            if s.len() != n * h {
                return Err(MoeError::shape(
                    name,
                    format!(
                        "{name} must be [N, H] = [{n}, {h}], got {} elements",
                        s.len()
                    ),
                ));
            }
        }
    }
    if let Some(e) = input.expert_idx {
        if e.len() != n * k {
            return Err(MoeError::shape(
                "expert_idx",
                format!(
                    "expert_idx must be [N, K] = [{n}, {k}], got {} elements",
                    e.len()
                ),
            ));
        }
    }
    let placed = |j: usize| idx[j] >= 0 && (idx[j] as usize) < input.valid_rows;
    if let Some(b) = input.bias {
        if b.is_empty() || !b.len().is_multiple_of(h) {
            return Err(MoeError::shape(
                "bias",
                format!(
                    "bias must be [E, H] with E >= 1 and H = {h}, got {} elements",
                    b.len()
                ),
            ));
        }
        let Some(experts) = input.expert_idx else {
            return Err(MoeError::combination(
                "bias needs expert_idx (the expert of each route)",
                "expert_idx not given",
            ));
        };
        let e = b.len() / h;
        if let Some(position) =
            (0..n * k).find(|&j| placed(j) && !(0..e as i64).contains(&(experts[j] as i64)))
        {
            return Err(MoeError::Index {
                tensor: "expert_idx",
                position,
                value: experts[position] as i64,
                rule: "the expert of a placed route must be a row of bias, in [0, E)",
            });
        }
    }

    let shape = || format!("[N, H] = [{n}, {h}]");
    let len = n.checked_mul(h).ok_or_else(|| MoeError::Allocation {
        tensor: "out",
        bytes: n as u128 * h as u128 * std::mem::size_of::<T>() as u128,
        shape: shape(),
    })?;
    MoeError::reserve(out, len, "out", shape)?;
    out.resize(len, T::default());
    // Per token: its skips and its placed routes (weight, expert_out row, bias row).
    let token = |i: usize, dst: &mut [T], routes: &mut Vec<Route<'a, T>>| {
        routes.clear();
        for j in i * k..(i + 1) * k {
            if placed(j) {
                let bias = input.bias.map(|b| {
                    let e = input.expert_idx.expect("checked")[j] as usize;
                    &b[e * h..][..h]
                });
                routes.push(Route {
                    w: input.weights.map_or(1.0, |w| w[j]),
                    row: &input.expert_out[idx[j] as usize * h..][..h],
                    bias,
                });
            }
        }
        let skip1 = input.skip1.map(|s| &s[i * h..][..h]);
        let skip2 = input.skip2.map(|s| &s[i * h..][..h]);
        combine_token(dst, skip1, skip2, routes);
    };
    let bytes = (n * k * h) * std::mem::size_of::<T>();
    if bytes >= PARALLEL_MIN_BYTES && n > 1 {
        out.par_chunks_mut(h)
            .enumerate()
            .for_each_init(Vec::new, |routes, (i, dst)| token(i, dst, routes));
    } else {
        let mut routes = Vec::new();
        for (i, dst) in out.chunks_mut(h).enumerate() {
            token(i, dst, &mut routes);
        }
    }
    Ok(())
}

/// One placed route of a token: its weight, its `expert_out` row and its expert's bias row.
struct Route<'a, T> {
    w: f32,
    row: &'a [T],
    bias: Option<&'a [T]>,
}

/// Columns summed in registers at a time.
const COLUMNS: usize = 64;

/// `dst = skip1 + skip2 + sum_r w_r * (row_r + bias_r)`, each column accumulated in f32 in
/// exactly that order (from 0), then rounded once to `T`. Columns go in blocks of [`COLUMNS`]
/// whose sums stay in registers while the routes' rows stream past. No FMA: the result is the
/// same bit for bit on every instruction set.
#[inline(always)]
fn combine_generic<T: FloatElement>(
    dst: &mut [T],
    skip1: Option<&[T]>,
    skip2: Option<&[T]>,
    routes: &[Route<'_, T>],
) {
    let h = dst.len();
    let mut c0 = 0;
    while c0 < h {
        let n = COLUMNS.min(h - c0);
        let cols = c0..c0 + n;
        let mut acc = [0f32; COLUMNS];
        let acc = &mut acc[..n];
        for s in [skip1, skip2].into_iter().flatten() {
            for (a, &v) in acc.iter_mut().zip(&s[cols.clone()]) {
                *a += v.to_f32();
            }
        }
        for r in routes {
            let w = r.w;
            match r.bias {
                Some(b) => {
                    for ((a, &v), &c) in acc
                        .iter_mut()
                        .zip(&r.row[cols.clone()])
                        .zip(&b[cols.clone()])
                    {
                        *a += w * (v.to_f32() + c.to_f32());
                    }
                }
                None => {
                    for (a, &v) in acc.iter_mut().zip(&r.row[cols.clone()]) {
                        *a += w * v.to_f32();
                    }
                }
            }
        }
        for (d, &a) in dst[cols].iter_mut().zip(acc.iter()) {
            *d = T::from_f32(a);
        }
        c0 += n;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn combine_avx512<T: FloatElement>(
    dst: &mut [T],
    skip1: Option<&[T]>,
    skip2: Option<&[T]>,
    routes: &[Route<'_, T>],
) {
    combine_generic(dst, skip1, skip2, routes)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn combine_avx2<T: FloatElement>(
    dst: &mut [T],
    skip1: Option<&[T]>,
    skip2: Option<&[T]>,
    routes: &[Route<'_, T>],
) {
    combine_generic(dst, skip1, skip2, routes)
}

/// [`combine_generic`] compiled for the widest vectors the CPU has (same results on each).
fn combine_token<T: FloatElement>(
    dst: &mut [T],
    skip1: Option<&[T]>,
    skip2: Option<&[T]>,
    routes: &[Route<'_, T>],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { combine_avx512(dst, skip1, skip2, routes) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { combine_avx2(dst, skip1, skip2, routes) };
        }
    }
    combine_generic(dst, skip1, skip2, routes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Every compiled variant of the combine kernel gives the same bits (the random tests
    /// against the reference run whichever variant the test machine picks).
    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        let h = 200; // three full blocks of 64 columns and a partial one
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        };
        let rows: Vec<Vec<bf16>> = (0..5)
            .map(|_| (0..h).map(|_| bf16::from_f32(next())).collect())
            .collect();
        let bias: Vec<bf16> = (0..h).map(|_| bf16::from_f32(next())).collect();
        let skip: Vec<bf16> = (0..h).map(|_| bf16::from_f32(next())).collect();
        let routes: Vec<Route<'_, bf16>> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| Route {
                w: next(),
                row: r,
                bias: (i % 2 == 0).then_some(&bias[..]),
            })
            .collect();
        let mut want = vec![bf16::ZERO; h];
        combine_generic(&mut want, Some(&skip), Some(&skip), &routes);
        let mut got = vec![bf16::ZERO; h];
        combine_token(&mut got, Some(&skip), Some(&skip), &routes);
        assert_eq!(got, want);
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                got.fill(bf16::ZERO);
                // SAFETY: AVX2 is present (checked).
                unsafe { combine_avx2(&mut got, Some(&skip), Some(&skip), &routes) };
                assert_eq!(got, want, "avx2");
            }
            if std::is_x86_feature_detected!("avx512f") {
                got.fill(bf16::ZERO);
                // SAFETY: AVX-512F is present (checked).
                unsafe { combine_avx512(&mut got, Some(&skip), Some(&skip), &routes) };
                assert_eq!(got, want, "avx512f");
            }
        }
        // And the literal per-element sum, in the documented order.
        for c in 0..h {
            let mut a = 0f32;
            a += skip[c].to_f32();
            a += skip[c].to_f32();
            for r in &routes {
                let b = r.bias.map_or(0.0, |b| b[c].to_f32());
                a += if r.bias.is_some() {
                    r.w * (r.row[c].to_f32() + b)
                } else {
                    r.w * r.row[c].to_f32()
                };
            }
            assert_eq!(want[c], bf16::from_f32(a), "column {c}");
        }
    }
}
