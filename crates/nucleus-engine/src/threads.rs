//! The process's thread count, decided once, before any thread pool exists.
//!
//! Three pools compute in a nucleus process: rayon's global pool (the sampler's batches,
//! candle's CPU ops), candle's matmul parallelism (`gemm` through rayon, sized per call by
//! `candle_core::utils::get_num_threads`) and candle's barrier pool (its CPU flash attention and
//! quantized matmuls). Left alone, candle sizes them from `RAYON_NUM_THREADS` or, when that is
//! unset, by asking the OS for the core count on every matmul (candle 0.11's
//! `default_num_threads` reads `/proc/cpuinfo` and the affinity mask each time: dozens of file
//! opens per generated token). [`configure`] decides the count once, in this order:
//!
//! 1. the explicit value (the CLI's `--threads N`);
//! 2. `NUCLEUS_NUM_THREADS`;
//! 3. `RAYON_NUM_THREADS` (rayon's and candle's own variable);
//! 4. the number of physical cores (`num_cpus::get_physical`), at most the CPUs this process
//!    may run on (`std::thread::available_parallelism`, which honours the affinity mask and
//!    cgroup quotas).
//!
//! and then sets `RAYON_NUM_THREADS` and `CANDLE_NUM_THREADS` to it (so candle reads a number
//! from the environment, never the OS) and builds rayon's global pool of that size.

use crate::error::{EngineError, Result};

/// Where the thread count came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadsSource {
    /// The explicit value (`--threads`).
    Explicit,
    /// `NUCLEUS_NUM_THREADS`.
    NucleusEnv,
    /// `RAYON_NUM_THREADS`.
    RayonEnv,
    /// The physical core count.
    PhysicalCores,
}

/// The variable nucleus reads its thread count from.
pub const NUCLEUS_NUM_THREADS: &str = "NUCLEUS_NUM_THREADS";

/// The most threads [`decide`] accepts. Each pool gets this many OS threads (and candle's
/// spin before they sleep), so a count far above the cores (`NUCLEUS_NUM_THREADS=99999`: tens of
/// thousands of threads) would take the machine rather than speed anything up.
pub const MAX_THREADS: usize = 1024;

/// The thread count `configure` would choose, and where it comes from, without changing
/// anything.
///
/// # Errors
/// [`EngineError::InvalidRequest`] when `explicit` is 0 or above [`MAX_THREADS`], or an
/// environment variable of the order is set to something other than an integer in
/// `1..=MAX_THREADS` (named with its value).
pub fn decide(explicit: Option<usize>) -> Result<(usize, ThreadsSource)> {
    if let Some(n) = explicit {
        if n == 0 || n > MAX_THREADS {
            return Err(EngineError::InvalidRequest(format!(
                "the thread count {n} is not between 1 and {MAX_THREADS}"
            )));
        }
        return Ok((n, ThreadsSource::Explicit));
    }
    for (var, source) in [
        (NUCLEUS_NUM_THREADS, ThreadsSource::NucleusEnv),
        ("RAYON_NUM_THREADS", ThreadsSource::RayonEnv),
    ] {
        if let Some(value) = std::env::var_os(var) {
            let text = value.to_string_lossy();
            return match text.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_THREADS).contains(&n) => Ok((n, source)),
                _ => Err(EngineError::InvalidRequest(format!(
                    "{var}={} is not a thread count between 1 and {MAX_THREADS}",
                    crate::error::quote(text.as_bytes())
                ))),
            };
        }
    }
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok((
        num_cpus::get_physical().clamp(1, allowed),
        ThreadsSource::PhysicalCores,
    ))
}

/// Decides the thread count ([`decide`]), exports it as `RAYON_NUM_THREADS` and
/// `CANDLE_NUM_THREADS`, and builds rayon's global pool with it. Returns the count and its
/// source.
///
/// Call it first thing in `main`, before any other thread exists: it changes the process's
/// environment, which is only sound while no other thread reads it. If rayon's global pool was
/// already built (by an earlier call or by other code), the pool keeps its size; the
/// environment still guides candle.
///
/// # Errors
/// As [`decide`].
pub fn configure(explicit: Option<usize>) -> Result<(usize, ThreadsSource)> {
    let (n, source) = decide(explicit)?;
    let value = n.to_string();
    std::env::set_var("RAYON_NUM_THREADS", &value);
    std::env::set_var("CANDLE_NUM_THREADS", &value);
    // An error only means the global pool exists already.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
    tracing::debug!(threads = n, ?source, "thread count");
    Ok((n, source))
}
