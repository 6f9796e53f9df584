//! Spec/sampling.md steps 3-5 on one row: hard constraints (`allowed_token_ids`, the token
//! bitmask, `bad_words`, `min_tokens`), `logit_bias`, then the repetition, frequency and
//! presence penalties. Either on a per-thread copy of the row ([`Dense`]), or, when few ids
//! change and the request is greedy or top-k, on a sparse list of the modified ids
//! ([`Sparse`]), whose values the scan's candidates are merged with. The same function
//! ([`modify`]) computes both, so their values are the same bits.

use super::prepare::Scratch;
use super::scan::compact;
use super::{rank_key, rank_key_of, Cand, SampleRequest, LIST_FRACTION};
use crate::error::SampleError;
use crate::params::LOGIT_BIAS_LIMIT;

/// Lists the ids that steps 3-5 may change in `scratch.mod_ids` (first-seen order), marks
/// them in `scratch.mark`, and returns `true`
/// when the sparse path applies: at most `vocab / LIST_FRACTION - keep` such ids. Otherwise
/// nothing stays marked and it returns `false` (a copy of the row is then cheaper). Not for
/// `allowed_token_ids`, which changes every id.
pub(super) fn list_modified_ids(
    vocab: usize,
    keep: usize,
    request: &SampleRequest<'_>,
    scratch: &mut Scratch,
) -> bool {
    let params = request.params;
    let output = request.output_ids;
    let limit = (vocab / LIST_FRACTION).saturating_sub(keep);
    let ids = &mut scratch.mod_ids;
    ids.clear();
    let bad_words = params.bad_words.iter().filter_map(|w| w.last());
    let stops = request
        .stop_token_ids
        .iter()
        .filter(|_| output.len() < params.min_tokens);
    let bias = params.logit_bias.keys();
    let repeated = request
        .prompt_ids
        .iter()
        .chain(output)
        .filter(|_| params.repetition_penalty != 1.0);
    let counted = output
        .iter()
        .filter(|_| params.frequency_penalty != 0.0 || params.presence_penalty != 0.0);
    let words = vocab.div_ceil(64);
    if scratch.mark.len() < words {
        scratch.mark.resize(words, 0);
    }
    let mark = &mut scratch.mark;
    for &id in bad_words
        .chain(stops)
        .chain(bias)
        .chain(repeated)
        .chain(counted)
    {
        let (word, bit) = (id as usize / 64, 1u64 << (id % 64));
        if mark[word] & bit == 0 {
            if ids.len() == limit {
                for &id in ids.iter() {
                    mark[id as usize / 64] = 0;
                }
                ids.clear();
                return false;
            }
            mark[word] |= bit;
            ids.push(id);
        }
    }
    true
}

/// The values of `scratch.mod_ids` after steps 3-5, into `scratch.mod_vals`: computed exactly
/// as on a copy of the row ([`modify`] on the listed ids only).
///
/// # Errors
/// As [`modify`].
pub(super) fn apply_sparse_modifications(
    row: &[f32],
    floor: f32,
    request: &SampleRequest<'_>,
    scratch: &mut Scratch,
) -> Result<(), SampleError> {
    scratch.mod_vals.clear();
    scratch
        .mod_vals
        .extend(scratch.mod_ids.iter().map(|&id| row[id as usize]));
    let params = request.params;
    if params.bad_words.is_empty()
        && params.logit_bias.is_empty()
        && (request.output_ids.len() >= params.min_tokens || request.stop_token_ids.is_empty())
        && params.frequency_penalty == 0.0
        && params.presence_penalty == 0.0
    {
        // Only the repetition penalty: the listed ids are exactly the distinct prompt and
        // output ids, each penalised once, as `modify` does.
        let penalty = params.repetition_penalty;
        let r = penalty as f32;
        for (&id, l) in scratch.mod_ids.iter().zip(scratch.mod_vals.iter_mut()) {
            let before = *l;
            *l = repetition_penalized(before, r);
            if before.is_finite() && !l.is_finite() {
                return Err(SampleError::PenaltyOverflow {
                    token_id: id,
                    logit: before,
                    penalty,
                });
            }
        }
        return Ok(());
    }
    // A small open-addressing table id -> slot (a few KiB: stays in cache).
    let ids = &scratch.mod_ids;
    let bits = (2 * ids.len()).next_power_of_two().max(16).trailing_zeros();
    let table = &mut scratch.slot_table;
    table.clear();
    table.resize(1 << bits, u64::MAX);
    for (slot, &id) in ids.iter().enumerate() {
        let mut h = slot_hash(id, bits);
        while table[h] != u64::MAX {
            h = (h + 1) & (table.len() - 1);
        }
        table[h] = (u64::from(id) << 32) | slot as u64;
    }
    let mut slots = Sparse {
        table: &scratch.slot_table,
        bits,
        vals: &mut scratch.mod_vals,
    };
    modify(
        &mut slots,
        floor,
        request,
        row.len(),
        &mut scratch.seen,
        &mut scratch.counts,
    )
}

/// Adds the modified ids with their modified values to the scan's candidates (the best
/// `keep` unmodified ids) and keeps the best `keep` of both.
pub(super) fn merge_modifications(floor: f32, keep: usize, scratch: &mut Scratch) {
    let (ids, vals, cand) = (&scratch.mod_ids, &scratch.mod_vals, &mut scratch.cand);
    // With `keep` candidates already, a modified id must beat the worst of them.
    let worst = if cand.len() >= keep {
        cand.iter().map(rank_key).max()
    } else {
        None
    };
    for (&id, &v) in ids.iter().zip(vals) {
        if v > floor && worst.is_none_or(|w| rank_key_of(v, id) < w) {
            cand.push(Cand {
                logit: v,
                id,
                w: 0.0,
            });
        }
    }
    if cand.len() > keep {
        compact(cand, keep);
    }
}

/// Writable logits by token id: a dense row, or the sparse list of modified ids.
trait Slots {
    fn slot(&mut self, id: u32) -> &mut f32;
}

struct Dense<'a>(&'a mut [f32]);

impl Slots for Dense<'_> {
    #[inline]
    fn slot(&mut self, id: u32) -> &mut f32 {
        &mut self.0[id as usize]
    }
}

struct Sparse<'a> {
    /// Open-addressing table of `id << 32 | index in vals` (`u64::MAX`: empty), `2^bits` long.
    table: &'a [u64],
    bits: u32,
    vals: &'a mut [f32],
}

/// The home slot of `id` in a table of `2^bits` entries (Fibonacci hashing).
#[inline]
fn slot_hash(id: u32, bits: u32) -> usize {
    (id.wrapping_mul(0x9E37_79B9) >> (32 - bits)) as usize
}

impl Slots for Sparse<'_> {
    #[inline]
    fn slot(&mut self, id: u32) -> &mut f32 {
        // Every id steps 3-5 touch was listed by `list_modified_ids`, so the probe ends.
        let mask = self.table.len() - 1;
        let mut h = slot_hash(id, self.bits);
        loop {
            let e = self.table[h];
            if (e >> 32) as u32 == id || e == u64::MAX {
                debug_assert_ne!(e, u64::MAX, "id {id} was not listed");
                let slot = if e == u64::MAX { 0 } else { e as u32 as usize };
                return &mut self.vals[slot];
            }
            h = (h + 1) & mask;
        }
    }
}

/// Copies `row` into `logits` (only `allowed_token_ids` kept, when given) and applies steps
/// 3-5 to the copy ([`modify`]).
///
/// # Errors
/// As [`modify`].
pub(super) fn apply_constraints_bias_penalties(
    row: &[f32],
    floor: f32,
    request: &SampleRequest<'_>,
    logits: &mut Vec<f32>,
    scratch: &mut Scratch,
) -> Result<(), SampleError> {
    let vocab = row.len();
    logits.clear();
    // Step 3: allowed_token_ids.
    match &request.params.allowed_token_ids {
        Some(allowed) => {
            logits.resize(vocab, floor);
            for &id in allowed {
                logits[id as usize] = row[id as usize];
            }
        }
        None => logits.extend_from_slice(row),
    }
    // Step 3: the token bitmask.
    if let Some(mask) = request.token_bitmask {
        crate::bitmask::mask_row(
            &mut logits[..vocab],
            &mask[..crate::bitmask::bitmask_words(vocab)],
            floor,
        );
    }
    modify(
        &mut Dense(&mut logits[..vocab]),
        floor,
        request,
        vocab,
        &mut scratch.seen,
        &mut scratch.counts,
    )
}

/// The repetition penalty of one logit: `l > 0 ? l / r : l * r` (CTRL; Hugging Face's
/// `RepetitionPenaltyLogitsProcessor`), with `-inf` (a removed token) left `-inf`: an `r` that
/// rounds to 0 in f32 (a penalty below about 1.4e-45) would otherwise make `-inf * 0`, NaN, and
/// the row a `NonFiniteLogits` error that no input caused. (A finite logit leaving the f32
/// range, `0 * inf` included, is the caller's `PenaltyOverflow`.)
#[inline]
pub(crate) fn repetition_penalized(l: f32, r: f32) -> f32 {
    if l > 0.0 {
        l / r
    } else if l == f32::NEG_INFINITY {
        l
    } else {
        l * r
    }
}

/// Applies, in the order of spec/sampling.md: step 3, the hard constraints `bad_words` and
/// `min_tokens` (set to `floor`); step 4, `logit_bias` added (clamped to ±100); step 5, the
/// repetition penalty `l > 0 ? l / r : l * r` once per distinct prompt or output id (CTRL;
/// Hugging Face's `RepetitionPenaltyLogitsProcessor`), then
/// `l -= count * frequency + (count > 0) * presence` over the output ids (OpenAI's
/// definitions). `seen` and `counts` are all-zero scratch buffers, left all zero.
///
/// # Errors
/// [`SampleError::PenaltyOverflow`] when the repetition penalty takes a finite logit out of
/// the f32 range.
fn modify(
    logits: &mut impl Slots,
    floor: f32,
    request: &SampleRequest<'_>,
    vocab: usize,
    seen: &mut Vec<u64>,
    counts: &mut Vec<u32>,
) -> Result<(), SampleError> {
    let params = request.params;
    let output = request.output_ids;
    for words in &params.bad_words {
        if let Some((&last, prefix)) = words.split_last() {
            if output.ends_with(prefix) {
                *logits.slot(last) = floor;
            }
        }
    }
    if output.len() < params.min_tokens {
        for &id in request.stop_token_ids {
            *logits.slot(id) = floor;
        }
    }
    // Step 4: logit bias.
    for (&id, &bias) in &params.logit_bias {
        let l = logits.slot(id);
        *l = (f64::from(*l) + bias.clamp(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)) as f32;
    }
    // Step 5: repetition penalty, each distinct id of prompt + output once.
    let words = vocab.div_ceil(64);
    if seen.len() < words {
        seen.resize(words, 0);
    }
    let mut overflow = None;
    let penalty = params.repetition_penalty;
    if penalty != 1.0 {
        let r = penalty as f32;
        let ids = || request.prompt_ids.iter().chain(output);
        for &id in ids() {
            let (word, bit) = (id as usize / 64, 1u64 << (id % 64));
            if seen[word] & bit == 0 {
                seen[word] |= bit;
                let l = logits.slot(id);
                let before = *l;
                *l = repetition_penalized(before, r);
                if before.is_finite() && !l.is_finite() && overflow.is_none() {
                    overflow = Some(SampleError::PenaltyOverflow {
                        token_id: id,
                        logit: before,
                        penalty,
                    });
                }
            }
        }
        for &id in ids() {
            seen[id as usize / 64] = 0;
        }
    }
    // Step 5, continued: frequency and presence over the output ids.
    let (frequency, presence) = (params.frequency_penalty, params.presence_penalty);
    if frequency != 0.0 || presence != 0.0 {
        if counts.len() < vocab {
            counts.resize(vocab, 0);
        }
        for &id in output {
            counts[id as usize] += 1;
        }
        for &id in output {
            let count = std::mem::take(&mut counts[id as usize]);
            if count > 0 {
                let l = logits.slot(id);
                *l = (f64::from(*l) - (f64::from(count) * frequency + presence)) as f32;
            }
        }
    }
    overflow.map_or(Ok(()), Err)
}

/// Whether any of steps 3-5 changes a logit of this request.
pub(super) fn modifies_logits(request: &SampleRequest<'_>) -> bool {
    let p = request.params;
    let has_context = !(request.prompt_ids.is_empty() && request.output_ids.is_empty());
    p.allowed_token_ids.is_some()
        || request.token_bitmask.is_some()
        || !p.bad_words.is_empty()
        || (request.output_ids.len() < p.min_tokens && !request.stop_token_ids.is_empty())
        || !p.logit_bias.is_empty()
        || (p.repetition_penalty != 1.0 && has_context)
        || ((p.frequency_penalty != 0.0 || p.presence_penalty != 0.0)
            && !request.output_ids.is_empty())
}
