//! The benchmark harness of nucleus: the speed measurements that `nucleus bench` runs and
//! that the criterion benchmarks in `benches/` drive, one implementation of each workload and
//! baseline, shared by both.
//!
//! - [`sampling`]: nucleus-sampling against a sort-based reference and candle's
//!   `LogitsProcessor` (feature `candle-baseline`, on by default) on seeded synthetic logits,
//!   against a max pass and a max + sum-of-exp pass ([`sampling::floors`]); the chain
//!   processors alone ([`sampling::processors`]).
//! - [`npu_sample`]: the Ascend-compatible fused top-k / top-p operator against the literal
//!   sort-based computation.
//! - [`moe`]: nucleus-moe's routing operators against a reference and memory-copy floors.
//! - [`serve`]: the load driver of `nucleus bench serve` (an OpenAI-compatible server under
//!   streams, hang-ups and a soak).
//! - [`generate`]: a model's whole decode loop (load, prefill, decode, resident memory)
//!   against the floor of reading its weights once, optionally beside llama.cpp (feature
//!   `llama-cpp`).
//!
//! Each measurement takes a typed parameter struct and returns typed results; printing is the
//! caller's (the `nucleus` tool prints Markdown tables). Every run checks its parameters first
//! (a value outside its domain is a [`ParamError`], which the tool reports as a usage error,
//! exit status 2), then computes the bytes of its buffers with checked arithmetic
//! ([`memory::total`], [`memory::product`]) and reserves them all at once ([`reserve`])
//! before any work: a size the machine cannot hold is an error, never an abort midway.
//!
//! Timing is interleaved ([`sampling::interleaved_medians`]): every round runs every job once,
//! so a slow spell of a shared machine falls on all of them alike and the ratios stay fair.

pub mod generate;
pub mod memory;
pub mod moe;
pub mod npu_sample;
pub mod sampling;
pub mod serve;

use std::fmt;

use anyhow::{bail, Result};

/// A parameter outside its domain (`--batch must be at least 1`), or a combination that has
/// no effect. The message names the parameter as the `nucleus bench` flag that sets it.
/// Runs return it inside their `anyhow::Error`; callers find it by downcasting
/// ([`is_param_error`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamError(pub String);

impl ParamError {
    /// A parameter error with this message.
    pub fn new(message: impl Into<String>) -> Self {
        ParamError(message.into())
    }
}

impl fmt::Display for ParamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParamError {}

/// Whether `e` (or one of its causes) is a [`ParamError`].
pub fn is_param_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<ParamError>().is_some())
}

/// Checks that `bytes` of buffers (`None`: more than `usize` can count) can be had
/// ([`memory::can_allocate`]: no more than the machine's memory and swap, and reserved in one
/// allocation that is freed again). A benchmark that cannot fit is refused before it starts
/// rather than killed midway.
///
/// # Errors
/// Either check fails: a message naming `what` and the bytes.
pub fn reserve(bytes: Option<usize>, what: &str) -> Result<()> {
    let Some(bytes) = bytes else {
        bail!("{what} need more bytes than this machine can address");
    };
    if !memory::can_allocate(bytes) {
        bail!(
            "{what} need {bytes} bytes ({}) of buffers, which cannot be allocated here",
            memory::gib(bytes)
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
