//! One workload of `nucleus bench sampling`, back to back, for a profiler:
//!
//! ```sh
//! cargo build --release -p nucleus-bench --example prof
//! perf record ./target/release/examples/prof 1 3000 1   # workload (b), 3000 calls, 1 thread
//! ```
//!
//! Arguments: the workload's index in `workloads()` (0 = (a) ... 6 = (g), 7 = the max pass
//! floor, 8 = the max+sum-exp pass floor; default 4, greedy),
//! the number of calls (default 2000) and the rayon pool's threads (default 1; this thread is
//! one of them). Prints the median and 10th-percentile µs per call at batch 1 and vocab
//! 151,936 (or `$VOCAB`).
//! Unlike the benchmark, nothing else runs between calls, so caches stay warm.

use std::time::Instant;

use nucleus_bench::sampling::floors::Isa;
use nucleus_bench::sampling::workload::{workloads, DEFAULT_SEED};
use nucleus_bench::sampling::{Bench, Floor, Method};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .map(|s| s.parse().expect("a whole number"))
        .unwrap_or(default)
}

fn main() {
    let (which, calls, threads) = (arg(1, 4), arg(2, 2000).max(1), arg(3, 1));
    let _pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .use_current_thread()
        .build()
        .expect("thread pool");
    let vocab = std::env::var("VOCAB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(151_936);
    let bench = Bench::new(1, vocab, DEFAULT_SEED).expect("benchmark data");
    let all = workloads();
    // Past the workloads: 7 is the max pass floor, 8 the max+sum-exp pass floor.
    let floor = match which.checked_sub(all.len()) {
        Some(0) => Some(Floor::Max(Isa::best())),
        Some(_) => Some(Floor::MaxSumExp(Isa::best())),
        None => None,
    };
    let label = floor.map_or_else(|| all[which].label(), |f| f.name());
    // `EVICT=1`: write 16 MiB between calls (untimed), as the benchmark's other methods do.
    let evict = std::env::var_os("EVICT").is_some();
    let mut junk = vec![0u8; if evict { 16 << 20 } else { 0 }];
    let mut times: Vec<f64> = (0..calls)
        .map(|i| {
            junk.iter_mut().for_each(|b| *b = b.wrapping_add(i as u8));
            std::hint::black_box(&junk);
            let t = Instant::now();
            match floor {
                Some(f) => {
                    std::hint::black_box(bench.floor(f));
                }
                None => {
                    std::hint::black_box(
                        bench
                            .sample(Method::Nucleus, &all[which])
                            .expect("sampling"),
                    );
                }
            }
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    println!(
        "{label} median {:.1} us, p10 {:.1}",
        times[calls / 2],
        times[calls / 10]
    );
}
