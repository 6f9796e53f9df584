//! Speed measurements run by `nucleus bench` and by the criterion benchmarks in `benches/`:
//! one implementation of each workload and baseline, shared by both.
//!
//! Every run checks its flags first (a value outside its domain is a
//! [`UsageError`](crate::usage::UsageError), exit status 2), then computes the bytes of its
//! buffers with checked arithmetic and reserves them all at once ([`reserve`]) before any work
//! and before the table's first line: a size the machine cannot hold is one `error:` line,
//! exit status 1, never an abort midway.

pub mod generate;
pub mod moe;
pub mod npu_sample;
pub mod sampling;
pub mod serve;

use anyhow::{bail, Result};

/// Sums byte counts with checked arithmetic: `None` when the sum (or a part, `None`)
/// overflows `usize`.
pub(crate) fn total(parts: &[Option<usize>]) -> Option<usize> {
    parts
        .iter()
        .try_fold(0usize, |sum, &part| sum.checked_add(part?))
}

/// `a * b * c` bytes with checked arithmetic.
pub(crate) fn product(factors: &[usize]) -> Option<usize> {
    factors.iter().try_fold(1usize, |p, &f| p.checked_mul(f))
}

/// Checks that `bytes` of buffers (`None`: more than `usize` can count) can be had
/// ([`crate::memory::can_allocate`]: no more than the machine's memory and swap, and reserved
/// in one allocation that is freed again). A benchmark that cannot fit is refused before it
/// starts rather than killed midway.
///
/// # Errors
/// Either check fails: a message naming `what` and the bytes.
pub fn reserve(bytes: Option<usize>, what: &str) -> Result<()> {
    let Some(bytes) = bytes else {
        bail!("{what} need more bytes than this machine can address");
    };
    if !crate::memory::can_allocate(bytes) {
        bail!(
            "{what} need {bytes} bytes ({}) of buffers, which cannot be allocated here",
            crate::memory::gib(bytes)
        );
    }
    Ok(())
}

/// A vector of `len` elements from `values`, its memory reserved first.
///
/// # Errors
/// The reservation fails (a message naming `what`).
pub(crate) fn try_collect<T>(
    len: usize,
    values: impl Iterator<Item = T>,
    what: &str,
) -> Result<Vec<T>> {
    let mut v = Vec::new();
    if v.try_reserve_exact(len).is_err() {
        bail!(
            "{what}: {len} elements of {} bytes cannot be allocated",
            std::mem::size_of::<T>()
        );
    }
    v.extend(values.take(len));
    Ok(v)
}
