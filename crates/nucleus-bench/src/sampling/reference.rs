//! The sort-based baseline, written the way PyTorch users and MiniMind sample: apply the
//! repetition penalty by gather / scatter, sort the whole row descending, softmax, cumulative
//! sum, mask the tokens below the min-p threshold, past the k-th token and past the top-p cut,
//! renormalise and draw.
//!
//! It computes what nucleus-sampling's [`distribution`](nucleus_sampling::distribution)
//! computes (spec/sampling.md steps 5, 6, 7, 8, 9, 10), with the same f32 weights
//! `exp((l - max) / T)` and f64 sums, so the two agree to rounding; the tests check it. What
//! makes it slow is the method: an O(V log V) sort and an exp of every element for every row.
//!
//! Greedy is `argmax` (the first maximum), as `torch.argmax` and Hugging Face's greedy search do.
//! The draw is inverse-CDF over the kept tokens in probability order (as a multinomial draw over
//! the sorted, masked probabilities), with one uniform from the request's Philox stream: same
//! distribution as nucleus, a different walk order, so not always the same token.
//!
//! Preconditions (the benchmark's data and parameters satisfy them; nothing is checked):
//! finite logits, valid [`SamplingParams`], context ids below the row length.

use std::cell::RefCell;

use nucleus_sampling::{philox, SamplingParams};

/// Per-thread buffers reused across rows, so the baseline is not charged for allocation.
#[derive(Default)]
struct Scratch {
    /// The penalised copy of the row.
    logits: Vec<f32>,
    /// Penalised values gathered at the context ids.
    gathered: Vec<f32>,
    /// (logit, id), sorted by logit descending, ties to the lower id.
    sorted: Vec<(f32, u32)>,
    /// `exp((l - max) / T)` in sorted order.
    weights: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The support left after the filters: `sorted[..kept]` with weights `weights[..kept]`.
enum Support {
    Greedy(u32),
    Sorted { kept: usize, z: f64 },
}

fn prepare(row: &[f32], params: &SamplingParams, context: &[u32], s: &mut Scratch) -> Support {
    // Repetition penalty, torch style: gather the context's logits, penalise, scatter back.
    // A repeated id gathers the same original value, so each distinct id is penalised once.
    let logits: &[f32] = if params.repetition_penalty != 1.0 && !context.is_empty() {
        let r = params.repetition_penalty as f32;
        s.logits.clear();
        s.logits.extend_from_slice(row);
        s.gathered.clear();
        s.gathered.extend(context.iter().map(|&id| {
            let l = row[id as usize];
            if l > 0.0 {
                l / r
            } else {
                l * r
            }
        }));
        for (&id, &l) in context.iter().zip(&s.gathered) {
            s.logits[id as usize] = l;
        }
        &s.logits
    } else {
        row
    };

    if params.is_greedy() {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        return Support::Greedy(best as u32);
    }

    // Full sort, descending, ties to the lower id (a total order, so unstable is enough).
    s.sorted.clear();
    s.sorted
        .extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
    s.sorted
        .sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));

    // Softmax numerators of the whole row, in sorted order.
    let max = s.sorted[0].0;
    let t = params.temperature as f32;
    s.weights.clear();
    s.weights
        .extend(s.sorted.iter().map(|&(l, _)| ((l - max) / t).exp()));

    // Min-p mask: p_i >= min_p * p_max is w_i >= min_p (the maximum's weight is 1), decided
    // in f64; weights fall along the sorted order, so the survivors are a prefix.
    let vocab = logits.len();
    let mut kept = vocab;
    if params.min_p > 0.0 {
        kept = s.weights.partition_point(|&w| f64::from(w) >= params.min_p);
    }

    // Top-k mask: everything after the k-th token.
    if let Ok(k) = usize::try_from(params.top_k) {
        if k > 0 {
            kept = kept.min(k);
        }
    }

    // Top-p mask on the cumulative sum of the renormalised survivors: keep a token while the
    // mass before it is below p (the smallest prefix whose mass reaches p).
    if params.top_p < 1.0 {
        let z: f64 = s.weights[..kept].iter().map(|&w| f64::from(w)).sum();
        let target = params.top_p * z;
        let mut cum = 0.0f64;
        let mut n = 0;
        while n < kept && cum < target {
            cum += f64::from(s.weights[n]);
            n += 1;
        }
        kept = n;
    }
    let z = s.weights[..kept].iter().map(|&w| f64::from(w)).sum();
    Support::Sorted { kept, z }
}

/// Samples one row the sort-based way; returns the token id.
///
/// `context`: the ids the repetition penalty looks at. The uniform is Philox4x32-10 at
/// (`params.seed` or 0, `position`, sample 0), the stream nucleus-sampling uses.
pub fn sample_row(row: &[f32], params: &SamplingParams, context: &[u32], position: u64) -> u32 {
    SCRATCH.with(|s| {
        let s = &mut *s.borrow_mut();
        match prepare(row, params, context, s) {
            Support::Greedy(token) => token,
            Support::Sorted { kept, z } => {
                let u = philox::uniform(params.seed.unwrap_or(0), position, 0);
                let target = u * z;
                let mut cum = 0.0f64;
                for (&(_, id), &w) in s.sorted[..kept].iter().zip(&s.weights) {
                    cum += f64::from(w);
                    if cum > target {
                        return id;
                    }
                }
                s.sorted[kept - 1].1
            }
        }
    })
}

/// The final probabilities the sort-based path draws from, indexed by token id (zero for
/// masked tokens; one-hot for greedy): the counterpart of [`nucleus_sampling::distribution`].
pub fn distribution(row: &[f32], params: &SamplingParams, context: &[u32]) -> Vec<f64> {
    SCRATCH.with(|s| {
        let s = &mut *s.borrow_mut();
        let mut out = vec![0.0f64; row.len()];
        match prepare(row, params, context, s) {
            Support::Greedy(token) => out[token as usize] = 1.0,
            Support::Sorted { kept, z } => {
                for (&(_, id), &w) in s.sorted[..kept].iter().zip(&s.weights) {
                    out[id as usize] = f64::from(w) / z;
                }
            }
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use nucleus_sampling::SampleRequest;

    use super::*;
    use crate::sampling::workload::{workloads, Logits, HISTORY};

    /// The baseline computes what nucleus-sampling computes: same distribution within 1e-6 for
    /// every workload, and its draws fall inside the support.
    #[test]
    fn sort_reference_distribution_equals_nucleus_distribution() {
        let logits = Logits::generate(6, 1000, 11);
        for w in workloads() {
            for i in 0..logits.batch {
                let row = logits.row(i);
                let context: &[u32] = if w.uses_history {
                    &logits.history[i]
                } else {
                    &[]
                };
                let request = SampleRequest::new(&w.params, &[], context, HISTORY as u64);
                let want = nucleus_sampling::distribution(row, &request).unwrap();
                let got = distribution(row, &w.params, context);
                let mut support = 0;
                for (id, (g, n)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - n).abs() <= 1e-6,
                        "{} row {i} id {id}: reference {g} nucleus {n}",
                        w.label()
                    );
                    assert_eq!(*g > 0.0, *n > 0.0, "{} row {i} id {id}", w.label());
                    support += usize::from(*n > 0.0);
                }
                assert!(support >= 1);
                let token = sample_row(row, &w.params, context, HISTORY as u64);
                assert!(want[token as usize] > 0.0, "{} row {i}", w.label());
            }
        }
    }

    #[test]
    fn a_repeated_context_id_is_penalised_once() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            seed: Some(1),
            ..Default::default()
        };
        let once = distribution(&[2.0, -1.0, 0.5], &params, &[0, 1]);
        let twice = distribution(&[2.0, -1.0, 0.5], &params, &[0, 1, 1, 0]);
        assert_eq!(once, twice);
        let plain = distribution(
            &[1.0, -2.0, 0.5],
            &SamplingParams {
                seed: Some(1),
                ..Default::default()
            },
            &[],
        );
        for (a, b) in once.iter().zip(&plain) {
            assert!((a - b).abs() < 1e-12);
        }
    }
}
