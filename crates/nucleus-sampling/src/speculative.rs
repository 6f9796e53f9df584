//! Speculative-decoding verification: accept or reject a draft model's `K` tokens against the
//! target model's `K + 1` rows, exactly (Leviathan et al. 2023, "Fast Inference from
//! Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
//! Decoding with Speculative Sampling"; the rule of FlashInfer's `chain_speculative_sampling` and
//! of vLLM's rejection sampler, `vllm/v1/sample/rejection_sampler.py`).
//!
//! For draft position `i = 0, 1, ...`, with `p_i` the target's final distribution of row `i`
//! ([`crate::distribution`] of the request's parameters or [`SamplerChain::distribution`] of
//! its chain, in the context `output_ids + draft[..i]`, at position `position + i`) and `q_i`
//! the draft's:
//! - the drafted token `x_i` is accepted when `p_i(x_i) / q_i(x_i) >= u`, `u` the request's
//!   Philox uniform at `(seed, position + i, 0)` with draw kind [`philox::draw::SPEC_ACCEPT`]
//!   (spec/sampling.md, "Random streams": counter word 3 = 2), i.e. with probability
//!   `min(1, p_i(x_i) / q_i(x_i))` (vLLM's `target_prob / draft_prob >= uniform_prob`);
//! - on the first rejection, the token is drawn from the residual `max(0, p_i - q_i)`
//!   normalised, by inverse CDF in token-id order with the uniform of draw kind
//!   [`philox::draw::SPEC_RESIDUAL`] (word 3 = 3) at `position + i`, and verification stops;
//! - after `K` acceptances the bonus token is drawn from `p_K` the same way (kind 3 at
//!   `position + K`).
//!
//! Every draw depends only on the seed and the position of the token it decides, so the
//! result does not depend on the batch, its order or the thread count. Each emitted token is
//! distributed exactly as the target's distribution at its place (the theorem of both papers).
//!
//! Greedy (temperature below [`crate::GREEDY_TEMPERATURE`]): the target's distribution is
//! one-hot at its argmax, so a draft token is accepted exactly when it is the argmax, and the
//! residual is the argmax. No draft distribution (n-gram or prompt-lookup drafts): the draft is
//! one-hot on its token, `q_i(x_i) = 1`, so `x_i` is accepted with probability `p_i(x_i)` and the
//! residual is `p_i` without `x_i`.

use crate::chain::{ProcessorContext, SamplerChain};
use crate::error::{ParamError, SampleError};
use crate::params::SamplingParams;
use crate::philox;
use crate::sampler::{distribution, distribution_from_probs, os_seed, SampleRequest};

/// The target model's `K + 1` rows, row-major, `vocab_size` values each.
#[derive(Clone, Copy, Debug)]
pub enum TargetRows<'a> {
    /// Logits (f32), processed with the request's parameters as [`crate::distribution`] does
    /// (or by its chain, [`SamplerChain::distribution`]).
    Logits(&'a [f32]),
    /// Probabilities (f32), as [`crate::distribution_from_probs`] takes them (with
    /// [`Verifier::Params`] only: a chain's processors act on logits).
    Probs(&'a [f32]),
}

/// How the target's rows become its final distributions.
#[derive(Clone, Copy, Debug)]
pub enum Verifier<'a> {
    /// The request's sampling parameters (the seed is `params.seed`, drawn from the OS when
    /// absent). Refused: `mirostat != 0` (its `mu` is a chain's state: use
    /// [`Verifier::Chain`]), `n != 1` and `logprobs` (the answer holds one log-probability per
    /// emitted token).
    Params(&'a SamplingParams),
    /// A processor chain in its state before the draft: reset with `prompt_ids` and told each
    /// id of `output_ids` ([`SamplerChain::accept`]), as a decode loop keeps it. It is cloned,
    /// never changed: row `i` is the clone told the accepted draft tokens `draft[..i]` (each
    /// after its own row's distribution, so a mirostat `mu` moves as in a sequential loop).
    /// The seed is the selection's (`sample`, `mirostat`, `adaptive_p`; drawn from the OS when
    /// absent; 0 for `greedy`, which draws nothing). Refused: a selection with `n != 1` or
    /// `logprobs`. [`verify_chain`] also hands back the chain advanced past the emitted
    /// tokens.
    Chain(&'a SamplerChain),
}

/// One request's verification.
#[derive(Clone, Copy, Debug)]
pub struct VerifyRequest<'a> {
    /// The request's parameters or chain.
    pub verifier: Verifier<'a>,
    /// The prompt's token ids.
    pub prompt_ids: &'a [u32],
    /// The token ids generated before the draft.
    pub output_ids: &'a [u32],
    /// Stop (and EOS) token ids, banned while fewer than `min_tokens` ids are generated
    /// ([`SampleRequest::stop_token_ids`]); counted with the drafted tokens before each row.
    pub stop_token_ids: &'a [u32],
    /// Index, in the whole sequence (prompt included), of the first draft token.
    pub position: u64,
    /// The `K` drafted token ids, each below `vocab_size`.
    pub draft_token_ids: &'a [u32],
    /// The draft model's distributions, `K` rows of `vocab_size` f32 probabilities
    /// (non-negative, finite; each row is divided by its f64 sum), or `None` for a one-hot
    /// draft (n-gram / prompt lookup).
    pub draft_probs: Option<&'a [f32]>,
    /// The target model's `K + 1` rows.
    pub target: TargetRows<'a>,
    /// Ids per row.
    pub vocab_size: usize,
}

impl<'a> VerifyRequest<'a> {
    /// A request with parameters, no context and a one-hot draft: set the other fields
    /// directly.
    pub fn new(
        verifier: Verifier<'a>,
        draft_token_ids: &'a [u32],
        target: TargetRows<'a>,
        vocab_size: usize,
    ) -> Self {
        Self {
            verifier,
            prompt_ids: &[],
            output_ids: &[],
            stop_token_ids: &[],
            position: 0,
            draft_token_ids,
            draft_probs: None,
            target,
            vocab_size,
        }
    }
}

/// The result of [`verify`].
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyOutput {
    /// How many draft tokens were accepted (`0..=K`).
    pub accepted: usize,
    /// The emitted tokens: the `accepted` draft tokens, then the residual or bonus token
    /// (`accepted + 1` ids).
    pub tokens: Vec<u32>,
    /// The natural-log probability of each emitted token under the target's processed
    /// distribution at its place (`accepted + 1` values).
    pub logprobs: Vec<f64>,
    /// The seed the draws used.
    pub seed: u64,
}

/// Verifies one request's draft (module doc).
///
/// # Errors
/// - [`SampleError::InvalidParams`] for a shape that does not fit (`target` not `(K + 1) *
///   vocab_size` values, `draft_probs` not `K * vocab_size`, `vocab_size` 0), a draft row
///   with a NaN, infinite or negative value or a zero sum, a drafted token whose draft
///   probability is 0 (`draft_probs`: it cannot have been drawn), target probabilities with
///   a chain, and the refused parameters of [`Verifier`].
/// - [`SampleError::TokenIdOutOfRange`] for a drafted id `>= vocab_size` (field
///   `"draft_token_ids"`).
/// - [`SampleError::InvalidParams`] naming `position` when `position + K` overflows u64.
/// - [`SampleError::NonFiniteLogits`], [`SampleError::InvalidProbability`] or
///   [`SampleError::NoCandidates`] for a target row that is bad as given (any of the `K + 1`
///   rows, whatever the draws).
/// - [`SampleError::SeedUnavailable`] when no seed is given and the OS has none.
/// - Any error of [`crate::distribution`] or [`SamplerChain::distribution`] on a target row
///   (NaN logits, no candidates, a context id out of range, ...).
pub fn verify(request: &VerifyRequest<'_>) -> Result<VerifyOutput, SampleError> {
    run(request).map(|(out, _)| out)
}

/// [`verify`] with a chain that is advanced on success: `chain` (in its state before the
/// draft, as [`Verifier::Chain`] says) becomes the chain after the emitted tokens, each told
/// after its own row's distribution, as a sequential decode loop would leave it. On an error
/// the chain is unchanged. `request.verifier` is ignored (the chain is `chain`).
///
/// # Errors
/// As [`verify`].
pub fn verify_chain(
    request: &VerifyRequest<'_>,
    chain: &mut SamplerChain,
) -> Result<VerifyOutput, SampleError> {
    let request = VerifyRequest {
        verifier: Verifier::Chain(chain),
        ..*request
    };
    let (out, advanced) = run(&request)?;
    if let Some(advanced) = advanced {
        *chain = advanced;
    }
    Ok(out)
}

/// [`verify`] for a batch of requests, in parallel on the current rayon pool: result `i` is
/// request `i`'s, bit for bit what [`verify`] gives it alone (every draw depends only on its
/// own seed and positions), whatever the batch, its order or the thread count. A request's
/// error leaves the others computed.
pub fn verify_batch(requests: &[VerifyRequest<'_>]) -> Vec<Result<VerifyOutput, SampleError>> {
    use rayon::prelude::*;
    requests.par_iter().map(verify).collect()
}

/// Refuses `n != 1`, top log-probabilities and raw log-probabilities, which verification does
/// not produce.
fn check_single(
    n: usize,
    logprobs: Option<usize>,
    kind: crate::params::LogprobsKind,
) -> Result<(), SampleError> {
    if kind != crate::params::LogprobsKind::Processed {
        return Err(ParamError::new(
            "logprobs_kind",
            kind.as_str(),
            "\"processed\" in speculative verification (the answer holds each emitted token's \
             processed log-probability)",
        )
        .into());
    }
    if n != 1 {
        return Err(ParamError::new(
            "n",
            n,
            "1 in speculative verification (one sequence per request)",
        )
        .into());
    }
    if let Some(k) = logprobs {
        return Err(ParamError::new(
            "logprobs",
            k,
            "absent in speculative verification (the answer holds each emitted token's \
             processed log-probability)",
        )
        .into());
    }
    Ok(())
}

/// The target's final distribution of one row.
enum Target<'a> {
    Params {
        params: &'a SamplingParams,
        probs: bool,
    },
    Chain(Box<SamplerChain>),
}

/// The verification, and for a chain the chain after the emitted tokens.
fn run(request: &VerifyRequest<'_>) -> Result<(VerifyOutput, Option<SamplerChain>), SampleError> {
    let v = request.vocab_size;
    let draft = request.draft_token_ids;
    let k = draft.len();
    if v == 0 {
        return Err(ParamError::new("vocab_size", v, ">= 1").into());
    }
    let (rows, probs_input) = match request.target {
        TargetRows::Logits(r) => (r, false),
        TargetRows::Probs(r) => (r, true),
    };
    let (mut target, seed) = match request.verifier {
        Verifier::Params(params) => {
            params.validate()?;
            if params.mirostat != 0 {
                return Err(ParamError::new(
                    "mirostat",
                    params.mirostat,
                    "0 with parameters in speculative verification (mirostat's mu is a \
                     chain's state: verify with a chain)",
                )
                .into());
            }
            check_single(params.n, params.logprobs, params.logprobs_kind)?;
            (
                Target::Params {
                    params,
                    probs: probs_input,
                },
                params.seed,
            )
        }
        Verifier::Chain(chain) => {
            let selection = chain.selection();
            selection.validate()?;
            let (top, kind) = selection.logprobs();
            check_single(selection.n(), top, kind)?;
            if probs_input {
                return Err(ParamError::new(
                    "target",
                    "probabilities",
                    "logits with a chain (its processors act on logits)",
                )
                .into());
            }
            let seed = match selection.draw_seed() {
                Some(seed) => seed,
                None => Some(0),
            };
            (Target::Chain(Box::new(chain.clone())), seed)
        }
    };
    if Some(rows.len()) != (k + 1).checked_mul(v) {
        return Err(ParamError::new(
            "target",
            format!("{} values for K = {k}, vocab_size {v}", rows.len()),
            "(K + 1) * vocab_size values",
        )
        .into());
    }
    if let Some(&token_id) = draft.iter().find(|&&t| t as usize >= v) {
        return Err(SampleError::TokenIdOutOfRange {
            field: "draft_token_ids",
            token_id,
            vocab_size: v,
        });
    }
    if let Some(q) = request.draft_probs {
        if Some(q.len()) != k.checked_mul(v) {
            return Err(ParamError::new(
                "draft_probs",
                format!("{} values for K = {k}, vocab_size {v}", q.len()),
                "K * vocab_size values",
            )
            .into());
        }
    }
    if request.position.checked_add(k as u64).is_none() {
        return Err(ParamError::new(
            "position",
            request.position,
            "at most 2^64 - 1 - K (every emitted token needs its own position)",
        )
        .into());
    }
    // Every target row is checked as a row, not only those the verification reaches, so that
    // a bad row is an error whatever the draws (rows after the first rejection are not
    // processed: errors that only processing finds, such as a penalty overflow, come from
    // the rows reached).
    for row in rows.chunks_exact(v) {
        check_row(row, probs_input)?;
    }
    let seed = match seed {
        Some(s) => s,
        None => os_seed()?,
    };
    let mut context: Vec<u32> = Vec::with_capacity(request.output_ids.len() + k + 1);
    context.extend_from_slice(request.output_ids);
    let mut out = VerifyOutput {
        accepted: 0,
        tokens: Vec::with_capacity(k + 1),
        logprobs: Vec::with_capacity(k + 1),
        seed,
    };
    for i in 0..=k {
        let position = request.position + i as u64;
        let row = &rows[i * v..(i + 1) * v];
        let p = match &mut target {
            Target::Params { params, probs } => {
                let req = SampleRequest::new(params, request.prompt_ids, &context, position)
                    .with_stop_token_ids(request.stop_token_ids);
                if *probs {
                    distribution_from_probs(row, &req)?
                } else {
                    distribution(row, &req)?
                }
            }
            Target::Chain(chain) => {
                let mut ctx = ProcessorContext::new(request.prompt_ids, &context, position)
                    .with_stop_token_ids(request.stop_token_ids);
                ctx.seed = seed;
                chain.distribution(row, &ctx)?
            }
        };
        let residual_u = philox::uniform_kind(seed, position, 0, philox::draw::SPEC_RESIDUAL);
        let (token, done) = if i == k {
            // Every draft token accepted: the bonus token from the last target row.
            (inverse_cdf(&p, residual_u), true)
        } else {
            let x = draft[i];
            let q = draft_row(request.draft_probs, i, v, x)?;
            let q_x = q.as_ref().map_or(1.0, |q| q[x as usize]);
            let u = philox::uniform_kind(seed, position, 0, philox::draw::SPEC_ACCEPT);
            if p[x as usize] / q_x >= u {
                out.accepted += 1;
                (x, false)
            } else {
                // Rejected: the residual max(0, p - q), normalised.
                let residual: Vec<f64> = match &q {
                    Some(q) => p.iter().zip(q).map(|(&a, &b)| (a - b).max(0.0)).collect(),
                    None => {
                        let mut r = p.clone();
                        r[x as usize] = 0.0;
                        r
                    }
                };
                // The residual is positive wherever p > q, and a rejection needs
                // p(x) < q(x); a sum of 0 can only come from rounding, where p itself is
                // the limit.
                let t = if residual.iter().any(|&r| r > 0.0) {
                    inverse_cdf(&residual, residual_u)
                } else {
                    inverse_cdf(&p, residual_u)
                };
                (t, true)
            }
        };
        out.tokens.push(token);
        out.logprobs.push(p[token as usize].ln());
        context.push(token);
        if let Target::Chain(chain) = &mut target {
            chain.accept(token);
        }
        if done {
            break;
        }
    }
    let chain = match target {
        Target::Chain(chain) => Some(*chain),
        Target::Params { .. } => None,
    };
    Ok((out, chain))
}

/// Step 1 of spec/sampling.md on one target row: NaN or `+inf` logits, or probabilities that
/// are NaN, infinite or negative; and a row with no candidate at all (every logit `-inf`,
/// every probability 0).
fn check_row(row: &[f32], probs: bool) -> Result<(), SampleError> {
    if probs {
        if let Some(i) = row.iter().position(|&p| !(p.is_finite() && p >= 0.0)) {
            return Err(SampleError::InvalidProbability {
                token_id: i as u32,
                value: row[i],
            });
        }
        if row.iter().all(|&p| p == 0.0) {
            return Err(SampleError::NoCandidates);
        }
    } else {
        if row.iter().any(|&l| l.is_nan() || l == f32::INFINITY) {
            return Err(crate::sampler::non_finite(row));
        }
        if row.iter().all(|&l| l == f32::NEG_INFINITY) {
            return Err(SampleError::NoCandidates);
        }
    }
    Ok(())
}

/// Draft row `i` as f64 probabilities (divided by the row's sum), checked; `None` for a one-hot
/// draft.
fn draft_row(
    probs: Option<&[f32]>,
    i: usize,
    v: usize,
    x: u32,
) -> Result<Option<Vec<f64>>, SampleError> {
    let Some(probs) = probs else {
        return Ok(None);
    };
    let row = &probs[i * v..(i + 1) * v];
    if let Some((id, &bad)) = row
        .iter()
        .enumerate()
        .find(|(_, &q)| !(q.is_finite() && q >= 0.0))
    {
        return Err(ParamError::new(
            "draft_probs",
            format!("{bad} (row {i}, id {id})"),
            "finite and >= 0",
        )
        .into());
    }
    let sum: f64 = row.iter().map(|&q| f64::from(q)).sum();
    if sum <= 0.0 {
        return Err(ParamError::new(
            "draft_probs",
            format!("row {i} sums to {sum}"),
            "rows with a positive sum",
        )
        .into());
    }
    if row[x as usize] == 0.0 {
        return Err(ParamError::new(
            "draft_probs",
            format!("0 at the drafted token {x} (row {i})"),
            "> 0 at each drafted token (a token of probability 0 cannot have been drawn)",
        )
        .into());
    }
    Ok(Some(row.iter().map(|&q| f64::from(q) / sum).collect()))
}

/// Inverse-CDF selection in token-id order over non-negative f64 weights: the first id whose
/// running sum exceeds `u * total`; if rounding leaves the total below, the last id with a
/// positive weight.
fn inverse_cdf(w: &[f64], u: f64) -> u32 {
    let total: f64 = w.iter().sum();
    let target = u * total;
    let mut acc = 0.0f64;
    for (i, &x) in w.iter().enumerate() {
        acc += x;
        if acc > target {
            return i as u32;
        }
    }
    w.iter().rposition(|&x| x > 0.0).unwrap_or(0) as u32
}
