//! Criterion version of `nucleus bench sampling`: the same data, workloads, baselines and
//! floors (`nucleus_bench::sampling`), one thread, batch 1, vocab 32,000 and 151,936.
//!
//! `cargo bench -p nucleus-bench --bench sampling` (add `-- 'vocab151936'` to filter). The
//! sampler runs in a one-thread rayon pool that the bench thread itself belongs to, so no call
//! pays a cross-thread hand-off.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use nucleus_bench::sampling::floors::Isa;
use nucleus_bench::sampling::workload::{workloads, DEFAULT_SEED};
use nucleus_bench::sampling::{Bench, Floor, Method};

fn sampling(c: &mut Criterion) {
    // This thread becomes the pool's only worker: par_iter in the sampler runs inline here.
    let _pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .use_current_thread()
        .build()
        .expect("one-thread rayon pool");
    for vocab in [32_000, 151_936] {
        let bench = Bench::new(1, vocab, DEFAULT_SEED).expect("benchmark data");
        let mut group = c.benchmark_group(format!("sampling/vocab{vocab}"));
        group
            .sample_size(20)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        let isa = Isa::best();
        for floor in [Floor::Max(isa), Floor::MaxSumExp(isa)] {
            group.bench_function(floor.name(), |b| b.iter(|| bench.floor(floor)));
        }
        for w in workloads() {
            for method in Method::ALL {
                if bench.supports(method, &w) {
                    group.bench_function(BenchmarkId::new(method.name(), w.label()), |b| {
                        b.iter(|| bench.sample(method, &w).expect("sampling"))
                    });
                }
            }
        }
        group.finish();
    }
}

criterion_group!(benches, sampling);
criterion_main!(benches);
