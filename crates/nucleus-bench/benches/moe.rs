//! Criterion version of `nucleus bench moe`: the same data, jobs, reference and floors
//! (`nucleus_bench::moe`), bf16, K 8, E 256, one thread, one group per shape: N = 1, 8,
//! 64 (decode) and 4,096 (prefill) at H = 2,048 and 7,168.
//!
//! `cargo bench -p nucleus-bench --bench moe` (add `-- 'N4096_H7168'` to filter). The operators
//! run in a one-thread rayon pool that the bench thread itself belongs to. The prefill groups
//! take 10 flat samples of one call each (a call takes 10-400 ms), so the whole bench finishes
//! in a few minutes.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use half::bf16;
use nucleus_bench::moe::{Job, MoeBench, Shape};
use nucleus_bench::sampling::workload::DEFAULT_SEED;

fn moe(c: &mut Criterion) {
    let _pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .use_current_thread()
        .build()
        .expect("one-thread rayon pool");
    for h in [2048, 7168] {
        for n in [1, 8, 64, 4096] {
            let shape = Shape { n, h, k: 8, e: 256 };
            let bench = MoeBench::<bf16>::new(shape, DEFAULT_SEED).expect("benchmark data");
            let mut group = c.benchmark_group(format!("moe/N{n}_H{h}"));
            if n >= 1024 {
                group
                    .sampling_mode(SamplingMode::Flat)
                    .sample_size(10)
                    .warm_up_time(Duration::from_millis(300))
                    .measurement_time(Duration::from_secs(1));
            } else {
                group
                    .sample_size(20)
                    .warm_up_time(Duration::from_millis(300))
                    .measurement_time(Duration::from_millis(700));
            }
            for job in Job::measured(1) {
                group.bench_function(job.name(), |b| {
                    b.iter(|| bench.run_job(job).expect("benchmark job"))
                });
            }
            group.finish();
        }
    }
}

criterion_group!(benches, moe);
criterion_main!(benches);
