//! Spec/sampling.md step 1 and the checks that come before any processing: the parameters
//! (their ranges, and those defined on logits only with probability input, "Parameter edge
//! values"), the token bitmask's length, the context's and the parameters' token ids against
//! the vocabulary, and the values of a probability row. NaN and +inf logits are found by the
//! first pass over the row ([`super::scan`]), and [`non_finite`] names the offending id.

use super::SampleRequest;
use crate::error::{BitmaskError, SampleError};
use crate::params::SamplingParams;
use crate::view::InputKind;

/// The checks of a request against its row, before any pass over the logits, in this order:
/// [`SamplingParams::validate`]; for probability input [`check_probs_params`]; the token
/// bitmask's length; every context id (prompt, output, stop ids) and every id the parameters
/// name below `vocab = row.len()`; for probability input, every value finite and `>= 0`
/// (step 1).
///
/// # Errors
/// The first failed check: [`SampleError::InvalidParams`], [`BitmaskError::RowTooShort`],
/// [`SampleError::TokenIdOutOfRange`], [`SampleError::InvalidProbability`].
pub(super) fn check_request(
    row: &[f32],
    kind: InputKind,
    request: &SampleRequest<'_>,
) -> Result<(), SampleError> {
    let params = request.params;
    params.validate()?;
    let probs = kind == InputKind::Probs;
    if probs {
        check_probs_params(params)?;
    }
    let vocab = row.len();
    if let Some(mask) = request.token_bitmask {
        let needed = crate::bitmask::bitmask_words(vocab);
        if mask.len() < needed {
            return Err(BitmaskError::RowTooShort {
                words: mask.len(),
                needed,
                row_len: vocab,
            }
            .into());
        }
    }
    // Token ids of the context and the parameters must be below `vocab`: a vectorised max
    // per list, and the first offender only when one is out of range.
    let context = [
        ("prompt_ids", request.prompt_ids),
        ("output_ids", request.output_ids),
        ("stop_token_ids", request.stop_token_ids),
    ];
    for (field, ids) in context {
        if ids
            .iter()
            .copied()
            .max()
            .is_some_and(|m| m as usize >= vocab)
        {
            let bad = ids
                .iter()
                .copied()
                .find(|&id| id as usize >= vocab)
                .unwrap_or(0);
            return Err(SampleError::TokenIdOutOfRange {
                field,
                token_id: bad,
                vocab_size: vocab,
            });
        }
    }
    if let Some((field, bad)) = params.named_ids().find(|&(_, id)| id as usize >= vocab) {
        return Err(SampleError::TokenIdOutOfRange {
            field,
            token_id: bad,
            vocab_size: vocab,
        });
    }
    // Step 1 for probabilities: NaN, infinite or negative values.
    if probs {
        if let Some(i) = row.iter().position(|&v| !(v.is_finite() && v >= 0.0)) {
            return Err(SampleError::InvalidProbability {
                token_id: i as u32,
                value: row[i],
            });
        }
    }
    Ok(())
}

/// The error for a row holding NaN or +inf: the lowest such id.
pub(crate) fn non_finite(row: &[f32]) -> SampleError {
    let i = row
        .iter()
        .position(|&v| v.is_nan() || v == f32::INFINITY)
        .unwrap_or(0);
    SampleError::NonFiniteLogits {
        token_id: i as u32,
        value: row[i],
    }
}

/// Parameters defined on logits only are an error with probability input (spec/sampling.md,
/// "Parameter edge values"); temperature 1 is accepted as the no-op it is.
fn check_probs_params(params: &SamplingParams) -> Result<(), SampleError> {
    let logits_only = "its default (it is defined on logits, not probabilities)";
    let bad = |field: &'static str, value: String| {
        Err(SampleError::InvalidParams(crate::error::ParamError {
            field,
            value,
            allowed: logits_only,
        }))
    };
    if !params.is_greedy() && params.temperature != 1.0 {
        return bad("temperature", params.temperature.to_string());
    }
    if params.repetition_penalty != 1.0 {
        return bad("repetition_penalty", params.repetition_penalty.to_string());
    }
    if params.presence_penalty != 0.0 {
        return bad("presence_penalty", params.presence_penalty.to_string());
    }
    if params.frequency_penalty != 0.0 {
        return bad("frequency_penalty", params.frequency_penalty.to_string());
    }
    if !params.logit_bias.is_empty() {
        return bad("logit_bias", format!("{:?}", params.logit_bias));
    }
    Ok(())
}
