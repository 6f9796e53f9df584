//! Criterion version of `nucleus bench npu-sample`: the same data, scenarios, reference and
//! floor (`nucleus_bench::npu_sample`), one thread, batch 1, vocab 32,000 and 151,936.
//!
//! `cargo bench -p nucleus-bench --bench npu_sample` (add `-- 'vocab151936'` to filter). The
//! operator runs in a one-thread rayon pool that the bench thread itself belongs to.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use nucleus_bench::npu_sample::{Method, NpuBench, Scenario};
use nucleus_bench::sampling::floors::Isa;
use nucleus_bench::sampling::workload::DEFAULT_SEED;

fn npu_sample(c: &mut Criterion) {
    let _pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .use_current_thread()
        .build()
        .expect("one-thread rayon pool");
    for vocab in [32_000, 151_936] {
        let bench = NpuBench::new(1, vocab, DEFAULT_SEED).expect("benchmark data");
        let mut group = c.benchmark_group(format!("npu_sample/vocab{vocab}"));
        group
            .sample_size(20)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        group.bench_function("max pass", |b| b.iter(|| bench.floor(Isa::best())));
        for s in Scenario::ALL {
            for (method, name) in [
                (Method::Nucleus, "nucleus"),
                (Method::SortReference, "sort-ref"),
            ] {
                group.bench_function(BenchmarkId::new(name, s.label()), |b| {
                    b.iter(|| bench.sample(method, s).expect("sampling"))
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, npu_sample);
criterion_main!(benches);
