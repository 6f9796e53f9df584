//! How many bytes the commands' work needs (a sampled row, an operator call), checked before
//! the work with [`can_allocate`] so that a request the machine cannot hold is refused with a
//! message instead of aborting midway. The checks themselves are nucleus-bench's
//! ([`nucleus_bench::memory`]), shared with the benchmarks' buffers, and re-exported here.

use nucleus_bench::memory::total as sum;
pub use nucleus_bench::memory::{
    can_allocate, can_allocate_checked, gib, memory_and_swap, refusal, with_margin,
};

/// Keeps the forward pass's freed buffers in the process instead of returning them to the
/// kernel (glibc on Linux; elsewhere nothing): allocations of up to 32 MiB come from the heap
/// rather than a mapping of their own, and up to 256 MiB of free memory at the heap's top stays
/// there (`mallopt`'s `M_MMAP_THRESHOLD`, at most 32 MiB on 64-bit glibc, and
/// `M_TRIM_THRESHOLD`). candle allocates every op's output afresh; with glibc's defaults each
/// of a prefill's multi-megabyte buffers was mapped, faulted in page by page and unmapped
/// again, 0.4 to 0.5 s of an 8 s prefill on the 0.85 B Q8_0 model (BENCHMARKS.md, "Prefill
/// kernels and the allocator"), for about 20 MiB more resident memory. When glibc refuses the
/// first setting, the second is not made either (setting it alone would pin the mapping
/// threshold at its 128 KiB default). Call once, before the work starts.
pub fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets the allocator's parameters; it is called before any other
    // thread exists (the start of `main`).
    unsafe {
        if libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1 {
            libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
        }
    }
}

/// `count * each` bytes, `None` on overflow.
fn times(count: usize, each: usize) -> Option<usize> {
    count.checked_mul(each)
}

/// The most `nucleus_sampling::sample_row` (or `sample_batch`'s work on one row, or
/// `distribution`) may allocate for one row of `vocab` values under `params`, from its
/// per-thread scratch (`sampler/prepare.rs`'s `Scratch`), sized by what the parameters switch on:
/// the dense f32 weights (4 bytes per entry, always counted); with a mask, bias or penalty,
/// the row's f32 working copy, the occurrence counts and two bitsets (8.25);
/// with top-p or min-p, a candidate (12 bytes) per entry, once per chunk and once merged, and
/// its weight and logit (8): 32 per entry; with top-k, that for `k` entries, plus one list of
/// `k` per thread; a 16-bit row's f32 copy (`widened`, 4); the top logprobs and the `n`
/// samples. Without margin: see [`with_margin`].
pub fn sampler_row_bytes(
    vocab: usize,
    params: &nucleus_sampling::SamplingParams,
    widened: bool,
) -> Option<usize> {
    if params.uses_extended() {
        return extended_row_bytes(vocab, params, widened);
    }
    // The sampler's `modifies_logits`, leaving out the context it also looks at (so a penalty
    // on a row without context counts too).
    let modifies = params.allowed_token_ids.is_some()
        || !params.bad_words.is_empty()
        || params.min_tokens > 0
        || !params.logit_bias.is_empty()
        || params.repetition_penalty != 1.0
        || params.frequency_penalty != 0.0
        || params.presence_penalty != 0.0;
    let greedy = params.is_greedy();
    let k = usize::try_from(params.top_k).unwrap_or(0).min(vocab);
    let k_on = !greedy && k > 0 && k < vocab;
    let listed = if !greedy && (params.top_p < 1.0 || params.min_p > 0.0) {
        vocab
    } else if k_on {
        k
    } else {
        0
    };
    let threads = rayon::current_num_threads();
    sum(&[
        times(vocab, 4),
        if modifies {
            times(vocab, 8).and_then(|b| b.checked_add(vocab / 4))
        } else {
            Some(0)
        },
        times(listed, 32),
        if k_on {
            times(threads, k).and_then(|n| n.checked_mul(12))
        } else {
            Some(0)
        },
        if widened { times(vocab, 4) } else { Some(0) },
        params
            .logprobs
            .map_or(Some(0), |top| times(top.min(vocab), 32)),
        times(params.n, 16),
    ])
}

/// The most a `nucleus_sampling::chain::SamplerChain` of `configs` may allocate for one row
/// of `vocab` values (`chain/`): its f32 copy of the row and its weights (8 bytes per entry),
/// and the buffers the processors keep, per entry (upper bounds, growth included): `top_k`
/// 16 (+8 for `min_keep`), `top_p` 24, `min_p` 8, `typical` 8 plus 256 KiB of histograms,
/// `epsilon` / `eta` 12, `xtc` 16, `dynatemp` 4, `top_h` 4 plus 128 KiB, the `mirostat`
/// selection 28 and `adaptive_p` 4. DRY and the n-gram bans keep the sequence (bounded by the
/// context, not the row). Without margin.
pub fn chain_row_bytes(
    vocab: usize,
    configs: &[nucleus_sampling::chain::ProcessorConfig],
) -> Option<usize> {
    use nucleus_sampling::chain::ProcessorConfig as C;
    let mut fixed = 0usize;
    let per_entry = configs.iter().try_fold(8usize, |b, c| {
        b.checked_add(match c {
            C::TopK { .. } => 24,
            C::TopP { .. } => 24,
            C::MinP { .. } => 8,
            C::Typical { .. } => {
                fixed += 256 << 10;
                8
            }
            C::Epsilon { .. } | C::Eta { .. } => 12,
            C::Xtc { .. } => 16,
            C::Dynatemp { .. } => 4,
            C::TopH { .. } => {
                fixed += 128 << 10;
                4
            }
            C::Mirostat { .. } => 28,
            C::AdaptiveP { .. } => 4,
            _ => 0,
        })
    })?;
    times(vocab, per_entry)?.checked_add(fixed)
}

/// [`sampler_row_bytes`] for a request with extended fields, which runs on
/// `SamplerChain::from_params`: the chain's row copy and weights, the buffers of the filters
/// it holds (as [`chain_row_bytes`]), a 16-bit row's copy, logprobs and samples.
fn extended_row_bytes(
    vocab: usize,
    p: &nucleus_sampling::SamplingParams,
    widened: bool,
) -> Option<usize> {
    let on = |b: bool, each: usize| if b { each } else { 0 };
    let sampled = !p.is_greedy();
    let filters = sampled && p.mirostat == 0;
    let per_entry = 8
        + on(filters && p.top_k > 0, 24)
        + on(filters && p.top_p < 1.0, 24)
        + on(filters && p.min_p > 0.0, 8)
        + on(filters && p.typical_p < 1.0, 8)
        + on(filters && p.epsilon_cutoff > 0.0, 12)
        + on(filters && p.eta_cutoff > 0.0, 12)
        + on(filters && p.xtc_probability > 0.0, 16)
        + on(sampled && p.dynatemp_range > 0.0, 4)
        + on(sampled && p.mirostat == 1, 28)
        + on(widened, 4);
    sum(&[
        times(vocab, per_entry),
        Some(if filters && p.typical_p < 1.0 {
            256 << 10
        } else {
            0
        }),
        p.logprobs.map_or(Some(0), |top| times(top.min(vocab), 32)),
        times(p.n, 16),
    ])
}

/// The most `nucleus_sampling::npu::top_k_top_p_sample` may allocate in one row's per-thread
/// scratch (`npu/mod.rs`'s `sample_row`) for a row of `vocab` values with these parameters: with
/// top-k on (`1 <= top_k <= min(vocab, ks_max, 1024)`) or only the first token kept, a list
/// of at most 1,024 candidates (and as much again while it is cut back); with top-p or min-p
/// alone, a candidate per entry (12 bytes, up to twice that as the list grows) and the f32
/// weights (4): 28 per entry; with neither, the f32 weights.
pub fn npu_row_bytes(
    vocab: usize,
    top_k: i32,
    top_p: f32,
    min_p: Option<f32>,
    ks_max: i64,
) -> Option<usize> {
    let ks = usize::try_from(ks_max.clamp(0, 1024)).unwrap_or(1024);
    let k_on = usize::try_from(top_k).is_ok_and(|k| k >= 1 && k <= vocab.min(ks));
    let first_only = top_p <= 0.0 || min_p.is_some_and(|m| m >= 1.0);
    let filtered = (top_p > 0.0 && top_p < 1.0) || min_p.is_some_and(|m| m > 0.0 && m < 1.0);
    if first_only || k_on {
        Some(2 * 1024 * 24)
    } else if filtered {
        times(vocab, 28)
    } else {
        times(vocab, 4)
    }
}

/// The most `nucleus_sampling::npu::top_k_top_p_sample` may allocate for a `[batch, vocab]`
/// call (`npu/mod.rs`): the `[batch, vocab]` f32 `logits_top_kp_select` with `is_need_logits`;
/// per thread that works on a row, the largest row scratch (`row_scratch`:
/// [`npu_row_bytes`]) and a 16-bit row's f32 copy (`widened`, 4 bytes per entry); the
/// results, ids and statuses per row. Without margin.
pub fn npu_call_bytes(
    batch: usize,
    vocab: usize,
    is_need_logits: bool,
    widened: bool,
    row_scratch: usize,
) -> Option<usize> {
    let threads = rayon::current_num_threads().min(batch).max(1);
    let per_thread = row_scratch.checked_add(if widened { times(vocab, 4)? } else { 0 })?;
    sum(&[
        if is_need_logits {
            times(batch, vocab).and_then(|n| n.checked_mul(4))
        } else {
            Some(0)
        },
        times(threads, per_thread),
        times(batch, 128),
    ])
}

/// What nucleus-moe's `moe_init_routing` allocates besides `expanded_x` (which it reserves
/// itself) for `num_rows` tokens of `hidden` values with `k` routes each into `rows` output
/// rows (`init_routing.rs`): the routes' counting sort (a bucket, the order and the positions,
/// 4 bytes per route each), the row indices (4 per route), the expanded scales and the
/// per-row flags (5 per output row), and an int8 copy of `x` with its scales and flags when
/// quantising (1 per value, 6 per token). Without margin.
pub fn moe_scratch_bytes(num_rows: usize, hidden: usize, k: usize, rows: usize) -> Option<usize> {
    let routes = num_rows.checked_mul(k)?;
    sum(&[
        times(routes, 16),
        times(rows, 5),
        times(num_rows, hidden),
        times(num_rows, 6),
    ])
}
