//! Shared support of the `n` and `logprobs` tests (`logprobs_n/worked.rs`,
//! `logprobs_n/oracle.rs`): independent f64 computations and assertion helpers.
//!
//! `SamplingParams::n` (several samples from one processed distribution) and
//! `SamplingParams::logprobs` (top-n log-probabilities, raw or processed), against
//! spec/sampling.md ("Inputs", step 2, "Random streams", "Outputs") and the public API docs.
//!
//! The expectations are computed by these tests in f64 from the contract, or by the f64 oracle
//! in `common/oracle.rs`; never from the implementation:
//! - raw logprobs (step 2): `log_softmax` of the row as given (ids below `vocab_size`), before
//!   constraints, bias, penalties, temperature and filters; for probability input
//!   `ln(p_i / sum p)`. Compared within 1e-9.
//! - processed logprobs: `ln` of `distribution()` ("the exact final probabilities that step 11
//!   samples from ... the oracle for logprobs"), `-inf` for removed tokens, greedy one-hot (0 for
//!   the chosen token). Compared tightly (1e-12) with `ln distribution()` and within the spec's
//!   1e-6 (in probability) with the f64 oracle.
//! - `top`: the k most likely tokens of the asked kind, most likely first, ties toward the lower
//!   id, `-inf` entries for the lowest ids not listed when fewer than k tokens are possible.
//!   That is exactly "sort all ids by (logprob descending, id ascending) and take k", which is
//!   what [`ranked`] does.
//! - sample j of an n-request (sample index s) uses the Philox uniform at counter
//!   (position, s + j): it equals sample 0 of the request `.with_sample_index(s + j)`, and the
//!   spec's inverse CDF of that uniform.

use nucleus_sampling::{Logprobs, SampleOutput, SampleRequest, SamplingParams, TokenLogprob};

/// Raw logprobs of a logits row (spec step 2): `l_i - max - ln(sum_j exp(l_j - max))` in f64;
/// `-inf` stays `-inf`.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .map(|&l| f64::from(l))
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = row.iter().map(|&l| (f64::from(l) - max).exp()).sum();
    let lse = sum.ln();
    row.iter()
        .map(|&l| {
            if l == f32::NEG_INFINITY {
                f64::NEG_INFINITY
            } else {
                f64::from(l) - max - lse
            }
        })
        .collect()
}

/// Raw logprobs of a probability row: `ln(p_i / sum p)` in f64 (`-inf` for zeros).
pub fn ln_normalised(probs: &[f32]) -> Vec<f64> {
    let sum: f64 = probs.iter().map(|&p| f64::from(p)).sum();
    probs.iter().map(|&p| (f64::from(p) / sum).ln()).collect()
}

/// `ln` of each probability (`-inf` for 0).
pub fn ln_all(p: &[f64]) -> Vec<f64> {
    p.iter().map(|x| x.ln()).collect()
}

/// The contract's top list of `values` (one per id): all ids ordered by value descending, ties
/// (the `-inf` ones included) toward the lower id, the first `k`.
pub fn ranked(values: &[f64], k: usize) -> Vec<(u32, f64)> {
    let mut ids: Vec<usize> = (0..values.len()).collect();
    ids.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    ids.truncate(k);
    ids.into_iter().map(|i| (i as u32, values[i])).collect()
}

pub fn logprobs_of(out: &SampleOutput) -> &Logprobs {
    out.logprobs.as_ref().expect("logprobs were asked for")
}

pub fn pairs(top: &[TokenLogprob]) -> Vec<(u32, f64)> {
    top.iter().map(|t| (t.token_id, t.logprob)).collect()
}

/// `got == want` within `abs + rel * |want|`; `-inf` must be `-inf` exactly.
#[track_caller]
pub fn assert_value(got: f64, want: f64, abs: f64, rel: f64, what: &str) {
    if want == f64::NEG_INFINITY || got == f64::NEG_INFINITY {
        assert_eq!(got, want, "{what}: -inf mismatch");
        return;
    }
    assert!(
        (got - want).abs() <= abs + rel * want.abs(),
        "{what}: got {got}, want {want} (diff {:e})",
        (got - want).abs()
    );
}

/// Ids exactly, values within `abs + rel * |want|`.
#[track_caller]
pub fn assert_top(got: &[TokenLogprob], want: &[(u32, f64)], abs: f64, rel: f64, what: &str) {
    let got_ids: Vec<u32> = got.iter().map(|t| t.token_id).collect();
    let want_ids: Vec<u32> = want.iter().map(|w| w.0).collect();
    assert_eq!(
        got_ids,
        want_ids,
        "{what}: top ids\n got  {:?}\n want {want:?}",
        pairs(got)
    );
    for (g, w) in got.iter().zip(want) {
        assert_value(g.logprob, w.1, abs, rel, &format!("{what}: token {}", w.0));
    }
}

/// Bitwise equality of two outputs, every field (`Debug` prints each f64 in its shortest
/// round-trip form, so equal text means equal bits, -0.0 and 0.0 told apart).
pub fn same(a: &SampleOutput, b: &SampleOutput) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

pub fn sampled_logprobs(out: &SampleOutput) -> Vec<f64> {
    std::iter::once(out.logprob)
        .chain(out.extra_samples.iter().map(|s| s.logprob))
        .collect()
}

pub fn req(p: &SamplingParams) -> SampleRequest<'_> {
    SampleRequest::new(p, &[], &[], 0)
}

pub fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
}
