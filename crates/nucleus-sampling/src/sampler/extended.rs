//! The `SamplingParams` path for requests that use the extended processors
//! (spec/sampling.md, "Extended processors in the fixed path"): the request runs on the
//! equivalent processor chain, [`SamplerChain::from_params`], which places each extended field
//! at its step. The chain learns the sequence as a decode loop would teach it (`reset` with the
//! prompt, `accept` with every generated id), so a stateless call gives what a chain kept
//! across the steps would give; mirostat's `mu` is the one state that cannot be recomputed from
//! the ids, so the caller carries it ([`SampleRequest::mirostat_mu`],
//! [`SampleOutput::mirostat_mu`]).
//!
//! Cost: the chain's processors (each O(vocab), DRY and no-repeat-ngram plus O(context)) plus
//! rebuilding its state from the context, O(context); buffers are allocated per call.

use super::{SampleOutput, SampleRequest};
use crate::chain::{ProcessorContext, SamplerChain};
use crate::error::{ParamError, SampleError};
use crate::view::InputKind;

/// The first extended field that is on, for the probability-input error.
fn first_extended(request: &SampleRequest<'_>) -> &'static str {
    let p = request.params;
    [
        (!p.sequence_bias.is_empty(), "sequence_bias"),
        (p.dry_enabled(), "dry_multiplier"),
        (p.no_repeat_ngram_size > 0, "no_repeat_ngram_size"),
        (p.dynatemp_range > 0.0, "dynatemp_range"),
        (p.typical_p < 1.0, "typical_p"),
        (p.top_n_sigma > 0.0, "top_n_sigma"),
        (p.epsilon_cutoff > 0.0, "epsilon_cutoff"),
        (p.eta_cutoff > 0.0, "eta_cutoff"),
        (p.xtc_probability > 0.0, "xtc_probability"),
        (p.min_keep > 1, "min_keep"),
        (p.mirostat != 0, "mirostat"),
    ]
    .into_iter()
    .find_map(|(on, field)| on.then_some(field))
    .unwrap_or("min_keep")
}

/// The chain for `request`, its state rebuilt from the context.
fn chain(kind: InputKind, request: &SampleRequest<'_>) -> Result<SamplerChain, SampleError> {
    request.params.validate()?;
    if kind == InputKind::Probs {
        let field = first_extended(request);
        return Err(ParamError::new(
            field,
            "set with probability input",
            "logits input (the extended processors are defined on logits; use a chain on ln p)",
        )
        .into());
    }
    let mut chain = SamplerChain::from_params(request.params)?;
    chain.reset(request.prompt_ids);
    for &id in request.output_ids {
        chain.accept(id);
    }
    if let Some(mu) = request.mirostat_mu {
        if !mu.is_finite() {
            return Err(ParamError::new("mirostat_mu", mu, "a finite number").into());
        }
        chain.set_mirostat_mu(mu);
    }
    Ok(chain)
}

fn context<'a>(request: &SampleRequest<'a>) -> ProcessorContext<'a> {
    let mut ctx = ProcessorContext::new(request.prompt_ids, request.output_ids, request.position)
        .with_stop_token_ids(request.stop_token_ids);
    ctx.token_bitmask = request.token_bitmask;
    ctx.sample_index = request.sample_index;
    ctx
}

/// [`super::sample_row`] for a request with extended fields.
pub(super) fn sample(
    row: &[f32],
    kind: InputKind,
    request: &SampleRequest<'_>,
) -> Result<SampleOutput, SampleError> {
    let mut chain = chain(kind, request)?;
    let mut output = chain.sample(row, &context(request), request.sample_index)?;
    if chain.mirostat_mu().is_some() {
        chain.accept(output.token);
        output.mirostat_mu = chain.mirostat_mu();
    }
    Ok(output)
}

/// [`super::distribution`] for a request with extended fields.
pub(super) fn distribution(
    row: &[f32],
    kind: InputKind,
    request: &SampleRequest<'_>,
) -> Result<Vec<f64>, SampleError> {
    let mut chain = chain(kind, request)?;
    let mut ctx = context(request);
    ctx.seed = request.params.seed.unwrap_or(0);
    chain.distribution(row, &ctx)
}
