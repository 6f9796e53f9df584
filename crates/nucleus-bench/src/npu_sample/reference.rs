//! The literal, sort-based way to compute `npu_top_k_top_p_sample` (the spec's formulas as a
//! PyTorch user writes them): sort the whole row descending (stable: ties to the lower id),
//! keep the first `k`, softmax, cumulative sum, remove where `cumsum - p > top_p`, then
//! `argmax(probs / (q + eps))` or `argmax(probs)`.
//!
//! A baseline for `nucleus bench npu-sample`, not an oracle: the softmax is f32 `exp` and the
//! sums f64 in sorted order, so at an exact top-p boundary its rounding may decide otherwise
//! than nucleus-sampling's exact decisions (never on the benchmark's data, which the benchmark
//! checks). Preconditions: finite logits, `q` entries `>= 0`; `min_ps` is not supported (the
//! benchmark does not use it).

use std::cell::RefCell;

/// Per-thread buffers reused across rows: (value, id) pairs, weights.
type Buffers = (Vec<(f32, u32)>, Vec<f32>);

thread_local! {
    static SCRATCH: RefCell<Buffers> = RefCell::new(Default::default());
}

/// One row's result: the chosen id.
pub fn sample_row(row: &[f32], top_k: i32, top_p: f32, q: Option<&[f32]>, eps: f64) -> u32 {
    SCRATCH.with(|s| {
        let (sorted, w) = &mut *s.borrow_mut();
        sorted.clear();
        sorted.extend(row.iter().enumerate().map(|(i, &l)| (l, i as u32)));
        // A stable descending sort: larger value first, ties by id.
        sorted.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let v = row.len();
        let mut kept = if top_k >= 1 && top_k as usize <= v.min(1024) {
            top_k as usize
        } else {
            v
        };
        let max = sorted[0].0;
        w.clear();
        w.extend(sorted[..kept].iter().map(|&(l, _)| (l - max).exp()));
        let z: f64 = w.iter().map(|&x| f64::from(x)).sum();
        if top_p <= 0.0 {
            kept = 1;
        } else if top_p < 1.0 {
            let mut cum = 0.0f64;
            for (j, &x) in w[..kept].iter().enumerate() {
                let p = f64::from(x) / z;
                cum += p;
                if cum - p > f64::from(top_p) {
                    kept = j;
                    break;
                }
            }
        }
        let mut best = (f64::NEG_INFINITY, sorted[0].1);
        for (j, &(_, id)) in sorted[..kept].iter().enumerate() {
            let p = f64::from(w[j]) / z;
            let score = match q {
                Some(q) => p / (f64::from(q[id as usize]) + eps),
                None => p,
            };
            if score > best.0 {
                best = (score, id);
            }
        }
        best.1
    })
}
