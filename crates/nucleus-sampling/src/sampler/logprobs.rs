//! Log-probabilities (spec/sampling.md step 2 and "Outputs"): raw ones, `log_softmax` of the
//! row as given, captured before any processing; processed ones, `ln` of the final
//! distribution that step 11 samples from; each with its top-n list.

use super::prepare::{Prepared, Scratch, Support};
use super::select::{chunked_sum, chunked_sum_f64, dense_sum, top_k_candidates};
use super::{better, Cand, Logprobs, SampleOutput, TokenLogprob};
use crate::kernels;
use crate::params::LogprobsKind;
use crate::view::InputKind;

/// Processed log-probabilities: the sampled tokens' (already known) and the top `top` of the
/// final distribution.
pub(super) fn processed_logprobs(
    prepared: &Prepared,
    vocab: usize,
    scratch: &Scratch,
    output: &SampleOutput,
    top: usize,
) -> Logprobs {
    let best: Vec<TokenLogprob> = match prepared.support {
        Support::Greedy(token) => vec![TokenLogprob {
            token_id: token,
            logprob: 0.0,
        }],
        Support::List(n) => {
            let cand = &scratch.cand[..n];
            let z = chunked_sum(cand.iter().map(|c| (c.id as usize, c.w)));
            let mut best: Vec<Cand> = cand.iter().filter(|c| c.w > 0.0).copied().collect();
            best.sort_unstable_by(|a, b| (b.w + 0.0).total_cmp(&(a.w + 0.0)).then(a.id.cmp(&b.id)));
            best.truncate(top);
            best.iter()
                .map(|c| TokenLogprob {
                    token_id: c.id,
                    logprob: (f64::from(c.w) / z).ln(),
                })
                .collect()
        }
        Support::Dense => dense_top_logprobs(&scratch.weights[..vocab], top),
    };
    processed_logprobs_from(output, best, top)
}

/// The `top` most likely tokens of dense weights `w` (zero for removed tokens), as natural-log
/// probabilities `ln(w_i / sum w)`, most likely first, ties toward the lower id.
pub(crate) fn dense_top_logprobs(w: &[f32], top: usize) -> Vec<TokenLogprob> {
    let z = dense_sum(w);
    top_values(w, 0.0, top)
        .into_iter()
        .map(|(id, wi)| TokenLogprob {
            token_id: id,
            logprob: (f64::from(wi) / z).ln(),
        })
        .collect()
}

/// Processed [`Logprobs`]: the sampled tokens' (from `output`) and `best`, cut or padded with
/// `-inf` entries to `top`.
pub(crate) fn processed_logprobs_from(
    output: &SampleOutput,
    mut best: Vec<TokenLogprob>,
    top: usize,
) -> Logprobs {
    let sampled = std::iter::once(output.logprob)
        .chain(output.extra_samples.iter().map(|s| s.logprob))
        .collect();
    best.truncate(top);
    fill_impossible(&mut best, top);
    Logprobs {
        kind: LogprobsKind::Processed,
        sampled,
        top: best,
    }
}

/// Raw log-probabilities (spec step 2): `log_softmax` of the row as given, in f64; for
/// probability input `ln(p_i / sum p)`.
pub(crate) fn raw_logprobs(
    row: &[f32],
    kind: InputKind,
    output: &SampleOutput,
    top: usize,
) -> Logprobs {
    let floor = match kind {
        InputKind::Logits => f32::NEG_INFINITY,
        InputKind::Probs => 0.0,
    };
    // Logits: `(l - max) - ln(sum exp(l - max))`, the difference of two f32 exact in f64, so
    // the result keeps its precision however large the logits.
    let max = match kind {
        InputKind::Logits => kernels::max_bad(row).0,
        InputKind::Probs => 0.0,
    };
    let raw = |v: f32, norm: f64| -> f64 {
        match kind {
            InputKind::Logits => (f64::from(v) - f64::from(max)) - norm,
            InputKind::Probs => (f64::from(v) / norm).ln(),
        }
    };
    let norm = match kind {
        // Every logit -inf: every raw logprob is -inf.
        InputKind::Logits if max == f32::NEG_INFINITY => f64::INFINITY,
        InputKind::Logits => {
            chunked_sum_f64(row.iter().map(|&l| (f64::from(l) - f64::from(max)).exp())).ln()
        }
        InputKind::Probs => chunked_sum_f64(row.iter().map(|&p| f64::from(p))),
    };
    let sampled = output
        .tokens()
        .map(|t| raw(row[t as usize], norm))
        .collect();
    let mut best: Vec<TokenLogprob> = top_values(row, floor, top)
        .into_iter()
        .map(|(id, v)| TokenLogprob {
            token_id: id,
            logprob: raw(v, norm),
        })
        .collect();
    fill_impossible(&mut best, top);
    Logprobs {
        kind: LogprobsKind::Raw,
        sampled,
        top: best,
    }
}

/// The `n` largest values above `floor`, largest first, ties toward the lower id.
pub(crate) fn top_values(values: &[f32], floor: f32, n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut cand = Vec::new();
    top_k_candidates(values, floor, n, &mut cand);
    cand.sort_unstable_by(better);
    cand.iter().map(|c| (c.id, c.logit)).collect()
}

/// Pads a top list to `n` entries with `-inf` entries for the lowest ids not in it.
pub(crate) fn fill_impossible(best: &mut Vec<TokenLogprob>, n: usize) {
    let mut id = 0u32;
    while best.len() < n {
        if !best.iter().any(|t| t.token_id == id) {
            best.push(TokenLogprob {
                token_id: id,
                logprob: f64::NEG_INFINITY,
            });
        }
        id += 1;
    }
}
