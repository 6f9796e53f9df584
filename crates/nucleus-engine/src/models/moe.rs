//! [`SparseMoe`]: the mixture-of-experts feed-forward block of Qwen3-MoE and MiniMind, run on
//! nucleus-moe's routing operators (the seed's MoE routing inside a real model).
//!
//! # The computation (rows `h` `[T, hidden]`, f32)
//! ```text
//! router_logits = h @ Wrouter^T                              [T, E] f32
//! weights, expert_idx = moe_gating_top_k_softmax(router_logits, E, k, renorm)
//!     renorm = false: softmax over the E experts, the k largest probabilities
//!     renorm = true:  the same k experts, their probabilities divided by their sum
//! expanded_x, expanded_row_idx, expert_tokens = moe_init_routing(h, expert_idx)
//!     rows sorted by expert: expert e's rows are contiguous, expert_tokens[e] of them
//! for each expert e with rows: out_e = (silu(x_e @ Wgate_e^T) * (x_e @ Wup_e^T)) @ Wdown_e^T
//! y = moe_finalize_routing(out, expanded_row_idx, weights)   y[i] = sum_k w[i,k] out[row(i,k)]
//! y += shared_j(h) for each shared expert j                  MiniMind2 only, unweighted
//! ```
//! Sources: transformers' `Qwen3MoeSparseMoeBlock` (`models/qwen3_moe/modeling_qwen3_moe.py`:
//! `softmax(router_logits, dtype=float)`, `topk`, `/= sum` when `norm_topk_prob`), MiniMind's
//! `MOEFeedForward` (jingyaogong/minimind `model/model_minimind.py`: `w / (sum + 1e-20)` when
//! `norm_topk_prob`, even for k = 1) and MiniMind2's `MOEFeedForward` / `MoEGate` (the same
//! file before 2026-04: renormalised only when `top_k > 1`, shared experts added unweighted),
//! and llama.cpp's `llm_build_qwen3moe` (GGUF: always renormalised).
//!
//! `moe_gating_top_k_softmax` with renormalisation takes the softmax over the k chosen logits,
//! which equals the chosen probabilities divided by their sum (the common `exp(max)` and the
//! other experts' mass cancel); MiniMind's `+ 1e-20` changes no f32 value, since the chosen
//! probabilities sum to at least k / E. The order of the experts in a row (descending
//! probability, ties to the lower id) does not change the result beyond f32 rounding of the sum.
//!
//! The routing buffers (`expanded_x`, the expert outputs, `y`) live in a [`MoeScratch`] that the
//! model reuses from step to step and layer to layer.

use candle_core::{DType, Tensor};
use nucleus_moe::{
    moe_finalize_routing_into, moe_gating_top_k_softmax, moe_init_routing_into, ExpandedX,
    ExpertTokensNumType, FinalizeRoutingInput, MoeInitRoutingAttrs, MoeInitRoutingInput,
    MoeInitRoutingOutput,
};

use rayon::prelude::*;

use crate::error::{EngineError, Result};
use crate::models::transformer::{Linear, Mlp};
use crate::models::weight::Weight;

/// The MoE hyper-parameters of a model (config.json or GGUF metadata), see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// E, routed experts per MoE layer (`num_experts`, `num_local_experts`, MiniMind2's
    /// `n_routed_experts`, GGUF `expert_count`).
    pub num_experts: usize,
    /// k, experts each token is routed to (`num_experts_per_tok`, GGUF `expert_used_count`).
    pub num_experts_per_tok: usize,
    /// Inner width of each routed expert's SwiGLU (`moe_intermediate_size`, GGUF
    /// `expert_feed_forward_length`; MiniMind2's experts use `intermediate_size`).
    pub moe_intermediate_size: usize,
    /// Whether the k chosen probabilities are divided by their sum (`norm_topk_prob`; MiniMind2
    /// only when k > 1; always for GGUF `qwen3moe`).
    pub norm_topk_prob: bool,
    /// Shared experts added unweighted to every token's output (MiniMind2's
    /// `n_shared_experts`; 0 for Qwen3-MoE and MiniMind-3).
    pub n_shared_experts: usize,
    /// Inner width of each shared expert (MiniMind2: `intermediate_size`).
    pub shared_intermediate_size: usize,
    /// The layers whose feed-forward block is MoE, ascending; the others are dense with
    /// [`crate::ModelConfig::ffn_size`] (Qwen3-MoE: layer `l` is MoE iff `l` is not in
    /// `mlp_only_layers` and `(l + 1) % decoder_sparse_step == 0`).
    pub moe_layers: Vec<usize>,
}

/// Reusable buffers of [`SparseMoe::forward_with`]: `moe_init_routing`'s outputs, the experts'
/// outputs and the combined rows. Grows to the largest step seen; [`MoeScratch::bytes`] says
/// how much it holds.
#[derive(Debug, Default)]
pub struct MoeScratch {
    routing: MoeInitRoutingOutput<f32>,
    expert_out: Vec<f32>,
    combined: Vec<f32>,
}

impl MoeConfig {
    /// [`moe_routing_bytes`] of one MoE layer of this config for `rows` rows.
    pub fn routing_bytes(&self, rows: usize, hidden: usize) -> Option<usize> {
        moe_routing_bytes(
            rows,
            hidden,
            self.num_experts,
            self.num_experts_per_tok,
            self.moe_intermediate_size
                .max(self.shared_intermediate_size),
        )
    }
}

impl MoeScratch {
    /// Bytes held by the buffers (their capacities).
    pub fn bytes(&self) -> usize {
        let f = std::mem::size_of::<f32>();
        let expanded = match &self.routing.expanded_x {
            ExpandedX::Unquantized(v) => v.capacity() * f,
            ExpandedX::Int8(v) => v.capacity(),
        };
        expanded
            + self.routing.expanded_row_idx.capacity() * 4
            + (self.expert_out.capacity() + self.combined.capacity()) * f
    }
}

/// One mixture-of-experts feed-forward block (module docs): a router `[E, hidden]`, E routed
/// SwiGLU experts, optional shared experts.
///
/// Immutable, `Send + Sync`; the routing buffers are passed in ([`SparseMoe::forward_with`]).
#[derive(Debug, Clone)]
pub struct SparseMoe {
    router: Linear,
    experts: Vec<Mlp>,
    shared: Vec<Mlp>,
    hidden_size: usize,
    k: usize,
    renorm: bool,
    /// The largest inner width of an expert (shared ones included), for the memory estimate.
    widest: usize,
}

/// The three weights of one SwiGLU expert, f32 on one device: `gate` `[inter, hidden]`, `up`
/// `[inter, hidden]`, `down` `[hidden, inter]` (transformers' `gate_proj`, `up_proj`,
/// `down_proj` weights; `y = down(silu(gate x) * up x)`).
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    /// `[inter, hidden]`.
    pub gate: Tensor,
    /// `[inter, hidden]`.
    pub up: Tensor,
    /// `[hidden, inter]`.
    pub down: Tensor,
}

impl SparseMoe {
    /// A block from f32 tensors: `router` `[E, hidden]`, `experts` E routed experts, `shared`
    /// experts added unweighted, `k` experts per token, `renorm` (`norm_topk_prob`).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] when E is 0 or does not match the router's rows, k is
    /// outside `1..=E`, or an expert's shapes do not fit `hidden` (each expert may have its
    /// own inner width).
    pub fn new(
        router: Tensor,
        experts: Vec<ExpertWeights>,
        shared: Vec<ExpertWeights>,
        k: usize,
        renorm: bool,
    ) -> Result<Self> {
        let (e, hidden) = router.dims2()?;
        let bad = |m: String| Err(EngineError::InvalidRequest(format!("MoE block: {m}")));
        if e == 0 || experts.len() != e {
            return bad(format!(
                "the router has {e} rows but {} experts are given",
                experts.len()
            ));
        }
        if k == 0 || k > e {
            return bad(format!("k = {k} experts per token, outside 1..={e}"));
        }
        let mlp = |w: ExpertWeights, what: &str| -> Result<Mlp> {
            let (inter, h) = w.gate.dims2()?;
            if h != hidden || w.up.dims() != [inter, hidden] || w.down.dims() != [hidden, inter] {
                return Err(EngineError::InvalidRequest(format!(
                    "MoE block: {what} has gate {:?}, up {:?}, down {:?}; expected [I, {hidden}], \
                     [I, {hidden}], [{hidden}, I]",
                    w.gate.dims(),
                    w.up.dims(),
                    w.down.dims()
                )));
            }
            let lin = |t: Tensor| -> Result<Linear> {
                Ok(Linear {
                    weight: Weight::from_tensor(t)?,
                    bias: None,
                })
            };
            Ok(Mlp {
                gate: lin(w.gate)?,
                up: lin(w.up)?,
                down: lin(w.down)?,
            })
        };
        let experts = experts
            .into_iter()
            .enumerate()
            .map(|(i, w)| mlp(w, &format!("expert {i}")))
            .collect::<Result<Vec<_>>>()?;
        let shared = shared
            .into_iter()
            .enumerate()
            .map(|(i, w)| mlp(w, &format!("shared expert {i}")))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::from_parts(
            Linear {
                weight: Weight::from_tensor(router)?,
                bias: None,
            },
            experts,
            shared,
            hidden,
            k,
            renorm,
        ))
    }

    /// A block from weights a loader checked (shapes already match).
    pub(crate) fn from_parts(
        router: Linear,
        experts: Vec<Mlp>,
        shared: Vec<Mlp>,
        hidden_size: usize,
        k: usize,
        renorm: bool,
    ) -> Self {
        let widest = experts
            .iter()
            .chain(&shared)
            .map(|m| m.inner_size())
            .max()
            .unwrap_or(0);
        Self {
            router,
            experts,
            shared,
            hidden_size,
            k,
            renorm,
            widest,
        }
    }

    /// E, the routed experts.
    pub fn num_experts(&self) -> usize {
        self.experts.len()
    }

    /// k, experts per token.
    pub fn num_experts_per_tok(&self) -> usize {
        self.k
    }

    /// [`SparseMoe::forward_with`] with fresh buffers.
    pub fn forward(&self, h: &Tensor) -> Result<Tensor> {
        self.forward_with(h, &mut MoeScratch::default())
    }

    /// The block on rows `h` `[T, hidden]` (f32, CPU): `[T, hidden]` f32, by the module docs'
    /// computation, with `scratch`'s buffers reused.
    ///
    /// Numerics: expert outputs are combined in f32 in slot order (descending weight), as
    /// `moe_finalize_routing` does; the result equals the per-token loop (for each token, for
    /// each chosen expert, weight times the expert's output) up to f32 rounding.
    ///
    /// A row whose router logits hold a NaN or +inf, or are all -inf (its hidden state
    /// overflowed), is routed nowhere and its output row is NaN: the failure reaches that
    /// row's sequence (whose logits the sampler then refuses) and the other rows are unchanged.
    ///
    /// # Errors
    /// [`EngineError::OutOfMemory`] when the routing buffers of `T` rows
    /// ([`moe_routing_bytes`]) cannot be allocated (checked before any is),
    /// [`EngineError::Moe`] if a routing operator refuses its input (a bug: its inputs are
    /// checked here), [`EngineError::Candle`] for a tensor failure, and
    /// [`EngineError::InvalidRequest`] when `h` is not `[T, hidden]`.
    pub fn forward_with(&self, h: &Tensor, scratch: &mut MoeScratch) -> Result<Tensor> {
        let (t, hidden) = h.dims2()?;
        if hidden != self.hidden_size {
            return Err(EngineError::InvalidRequest(format!(
                "MoE block: rows of width {hidden}, expected {}",
                self.hidden_size
            )));
        }
        let e = self.experts.len();
        let bytes = moe_routing_bytes(t, hidden, e, self.k, self.widest);
        if !bytes.is_some_and(can_reserve) {
            return Err(EngineError::OutOfMemory {
                what: format!(
                    "the MoE routing of {t} rows x {} experts per token (hidden {hidden}, {e} \
                     experts)",
                    self.k
                ),
                bytes: bytes.map_or(u64::MAX, |b| b as u64),
            });
        }
        let h = h.to_dtype(DType::F32)?.contiguous()?;
        let router_logits = self.router.forward(&h)?.to_dtype(DType::F32)?; // [T, E]
        let mut router_logits = router_logits.flatten_all()?.to_vec1::<f32>()?;
        // A row whose router logits are not numbers (its hidden state overflowed or holds a
        // NaN) has no routing: it is routed nowhere and its output is NaN, so the failure
        // surfaces in its own sequence's logits (which the sampler refuses) while the other
        // rows go on, as in a dense layer.
        let mut unroutable = Vec::new();
        for (row, r) in router_logits.chunks_mut(e).enumerate() {
            if r.iter().any(|v| v.is_nan() || *v == f32::INFINITY)
                || r.iter().all(|v| *v == f32::NEG_INFINITY)
            {
                unroutable.push(row);
                r.fill(0.0);
            }
        }
        let finished = (!unroutable.is_empty()).then(|| {
            let mut f = vec![false; t];
            for &row in &unroutable {
                f[row] = true;
            }
            f
        });
        let gating =
            moe_gating_top_k_softmax(&router_logits, e, self.k, self.renorm, finished.as_deref())?;

        let x = h.flatten_all()?.to_vec1::<f32>()?;
        let attrs = MoeInitRoutingAttrs {
            expert_tokens_num_flag: true,
            expert_tokens_num_type: ExpertTokensNumType::Count,
            ..MoeInitRoutingAttrs::new(e as i64)
        };
        let input = MoeInitRoutingInput {
            x: &x,
            num_rows: t,
            hidden_size: hidden,
            expert_idx: &gating.expert_idx,
            k: self.k,
            scale: None,
            offset: None,
        };
        moe_init_routing_into(&input, &attrs, &mut scratch.routing)?;
        let routing = &scratch.routing;
        let ExpandedX::Unquantized(expanded) = &routing.expanded_x else {
            unreachable!("moe_init_routing without quantisation gives rows of x's type");
        };
        let counts = routing
            .expert_tokens
            .as_deref()
            .expect("expert_tokens_num_flag was set");
        let device = h.device();
        // Each expert with rows is one job; jobs run in parallel on the rayon pool (each
        // expert's result depends only on its rows, so the output does not depend on the
        // thread count), and their outputs are appended in expert order.
        let mut jobs = Vec::with_capacity(e);
        let mut start = 0usize;
        for (expert, &count) in counts.iter().enumerate() {
            let count = count as usize;
            if count > 0 {
                jobs.push((expert, start, count));
                start += count;
            }
        }
        let run = |&(expert, start, count): &(usize, usize, usize)| -> Result<Vec<f32>> {
            let rows = &expanded[start * hidden..(start + count) * hidden];
            self.experts[expert].forward_rows(rows, count, device)
        };
        let outputs: Vec<Vec<f32>> = if jobs.len() > 1 && rayon::current_num_threads() > 1 {
            jobs.par_iter().map(run).collect::<Result<_>>()?
        } else {
            jobs.iter().map(run).collect::<Result<_>>()?
        };
        scratch.expert_out.clear();
        for y in &outputs {
            scratch.expert_out.extend_from_slice(y);
        }
        moe_finalize_routing_into(
            &FinalizeRoutingInput {
                expert_out: &scratch.expert_out,
                hidden_size: hidden,
                valid_rows: routing.valid_rows,
                expanded_row_idx: &routing.expanded_row_idx,
                k: self.k,
                weights: Some(&gating.weights),
                expert_idx: None,
                skip1: None,
                skip2: None,
                bias: None,
            },
            &mut scratch.combined,
        )?;
        for &row in &unroutable {
            scratch.combined[row * hidden..(row + 1) * hidden].fill(f32::NAN);
        }
        let mut y = Tensor::from_slice(&scratch.combined, (t, hidden), device)?;
        for shared in &self.shared {
            y = (y + shared.forward(&h)?)?;
        }
        Ok(y)
    }
}

/// About the bytes one MoE block allocates for `rows` rows: per row the router logits
/// (`E`, twice), the row's copies (`hidden`, 3 times), and per route the gating outputs and
/// indices, its `expanded_x` row, the expert's output (twice) and the expert's intermediates
/// (`3 * inter`, the widest expert's). `None` on overflow.
pub fn moe_routing_bytes(
    rows: usize,
    hidden: usize,
    experts: usize,
    k: usize,
    inter: usize,
) -> Option<usize> {
    let per_route = hidden
        .checked_mul(3)?
        .checked_add(inter.checked_mul(3)?)?
        .checked_add(4)?;
    let per_row = experts
        .checked_mul(2)?
        .checked_add(hidden.checked_mul(3)?)?
        .checked_add(k.checked_mul(per_route)?)?;
    rows.checked_mul(per_row)?.checked_mul(4)
}

/// Whether `bytes` can be allocated now (reserved and released).
fn can_reserve(bytes: usize) -> bool {
    Vec::<u8>::new().try_reserve_exact(bytes).is_ok()
}
