//! Whether a number of bytes can be had, asked before the work that needs them, so that a
//! request the machine cannot hold is refused with a message instead of aborting midway
//! ("memory allocation of N bytes failed" is an abort in Rust).
//!
//! [`can_allocate`] is the one check: the benchmarks' buffers ([`crate::reserve`]), and in
//! the `nucleus` tool `generate`'s KV cache and the outputs and working memory of an operator
//! call that the libraries allocate inside (`nucleus sample`, `top-k-top-p-sample`,
//! `moe-init-routing`) all go through it. Byte counts are summed and multiplied with checked
//! arithmetic ([`total`], [`product`]): `None` stands for more than `usize` can count.

use std::sync::OnceLock;

/// Whether `bytes` can be had here: no more than the machine's memory and swap (Linux:
/// `MemTotal + SwapTotal` of `/proc/meminfo`, so the answer does not depend on the overcommit
/// setting), and reserved in one allocation that is freed again at once (nothing is touched,
/// so this costs no time; an address-space limit, `ulimit -v`, refuses it).
///
/// The reservation is released before the work runs, so another thread may take the memory
/// in between: this is a check of what the process can hold, not a promise.
pub fn can_allocate(bytes: usize) -> bool {
    if memory_and_swap().is_some_and(|m| bytes as u64 > m) {
        return false;
    }
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(bytes).is_ok()
}

/// [`can_allocate`] of a byte count that may have overflowed (`None`: more than `usize` can
/// count, which cannot be had).
pub fn can_allocate_checked(bytes: Option<usize>) -> bool {
    bytes.is_some_and(can_allocate)
}

/// `bytes` with a margin for what an estimate does not see (allocator rounding, small
/// buffers): a quarter more, plus 1 MiB; saturating.
pub fn with_margin(bytes: usize) -> usize {
    bytes.saturating_add(bytes / 4).saturating_add(1 << 20)
}

/// The machine's memory and swap in bytes (`MemTotal + SwapTotal` of `/proc/meminfo`, read
/// once); `None` where that file is not there or not understood.
pub fn memory_and_swap() -> Option<u64> {
    static TOTAL: OnceLock<Option<u64>> = OnceLock::new();
    *TOTAL.get_or_init(|| {
        let info = std::fs::read_to_string("/proc/meminfo").ok()?;
        let kb = |key: &str| -> Option<u64> {
            let line = info.lines().find(|l| l.starts_with(key))?;
            line[key.len()..]
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        };
        kb("MemTotal:")?
            .checked_add(kb("SwapTotal:").unwrap_or(0))?
            .checked_mul(1024)
    })
}

/// `bytes` as GiB with one decimal, for messages (`20.0 GiB`).
pub fn gib(bytes: usize) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// The message for work that needs `bytes` (with margin; `None`: more than `usize` counts)
/// that cannot be had: `WHAT needs about N bytes (X GiB), which cannot be allocated here`.
pub fn refusal(what: &str, bytes: Option<usize>) -> String {
    match bytes {
        Some(b) => format!(
            "{what} needs about {b} bytes ({}), which cannot be allocated here",
            gib(b)
        ),
        None => format!("{what} needs more bytes than this machine can address"),
    }
}

/// Sums byte counts with checked arithmetic: `None` when the sum (or a part, `None`)
/// overflows `usize`.
pub fn total(parts: &[Option<usize>]) -> Option<usize> {
    parts
        .iter()
        .try_fold(0usize, |sum, &part| sum.checked_add(part?))
}

/// The product of `factors` (`a * b * c` bytes) with checked arithmetic: `None` on overflow.
pub fn product(factors: &[usize]) -> Option<usize> {
    factors.iter().try_fold(1usize, |p, &f| p.checked_mul(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_sizes_can_be_had_and_impossible_ones_cannot() {
        assert!(can_allocate(1 << 20));
        assert!(!can_allocate(usize::MAX));
        assert!(!can_allocate_checked(None));
        assert_eq!(with_margin(4 << 20), (5 << 20) + (1 << 20));
        assert_eq!(with_margin(usize::MAX), usize::MAX);
        assert_eq!(gib(3 << 29), "1.5 GiB");
        assert_eq!(total(&[Some(1), Some(2)]), Some(3));
        assert_eq!(total(&[Some(usize::MAX), Some(1)]), None);
        assert_eq!(total(&[Some(1), None]), None);
        assert_eq!(product(&[2, 3, 4]), Some(24));
        assert_eq!(product(&[usize::MAX, 2]), None);
    }
}
