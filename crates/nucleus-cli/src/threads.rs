//! `--threads N`: the thread count of every command that computes (README.md, "CLI"), decided
//! once at start by [`nucleus_engine::threads::configure`], before any pool exists.

use clap::Args;

/// `--threads N` (at least 1). Without it: `NUCLEUS_NUM_THREADS`, else `RAYON_NUM_THREADS`,
/// else the physical core count.
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct Threads {
    /// Threads for the sampler, the operators and the model's matrix products and attention
    /// (1 to 1024). Default: $NUCLEUS_NUM_THREADS, else $RAYON_NUM_THREADS, else the number
    /// of physical cores
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub threads: Option<u32>,
}

impl Threads {
    /// The explicit count, if given.
    pub fn explicit(self) -> Option<usize> {
        self.threads.map(|n| n as usize)
    }
}
