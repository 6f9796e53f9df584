//! The forward pass on stories260K (../shared/models): prefill of a prompt of 64, 256 and 1,024
//! tokens into an empty cache, and one decode step after 64, 256 and 1,024 cached tokens, for
//! nucleus' `Transformer` and, in the same run, candle-transformers' `quantized_llama`
//! (`ModelWeights`: a mask built per call, the cache grown by concatenation), the baseline.
//! Per-token figures are the medians divided by the prompt length (prefill).
//!
//! `cargo bench -p nucleus-engine --bench forward` (`-- prefill` or `-- decode` to filter).
//! Threads: `NUCLEUS_NUM_THREADS`, else `RAYON_NUM_THREADS`, else the physical cores
//! (`nucleus_engine::threads::configure`, called first).

use std::path::Path;
use std::time::Duration;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use nucleus_engine::{load_gguf, CausalLm, SeqInput};

const LENGTHS: [usize; 3] = [64, 256, 1024];

fn stories() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K.gguf")
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 5) % 512).collect()
}

fn candle_model() -> ModelWeights {
    let path = stories();
    let mut file = std::fs::File::open(&path).expect("stories260K");
    let content = gguf_file::Content::read(&mut file).expect("gguf");
    ModelWeights::from_gguf(content, &mut file, &Device::Cpu).expect("candle model")
}

fn forward(c: &mut Criterion) {
    let (threads, source) = nucleus_engine::threads::configure(None).expect("thread count");
    eprintln!("forward bench: {threads} threads ({source:?})");
    let loaded = load_gguf(&stories(), &Device::Cpu).expect("stories260K");
    let model = &loaded.model;

    let mut group = c.benchmark_group("prefill");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for n in LENGTHS {
        let tokens = prompt(n);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("nucleus", n), &tokens, |b, tokens| {
            b.iter(|| {
                let mut cache = model.new_cache();
                model
                    .forward(&mut [SeqInput {
                        tokens,
                        cache: &mut cache,
                    }])
                    .expect("forward")
            })
        });
        let candle = candle_model();
        group.bench_with_input(
            BenchmarkId::new("candle-transformers", n),
            &tokens,
            |b, tokens| {
                let input = Tensor::new(tokens.as_slice(), &Device::Cpu)
                    .and_then(|t| t.unsqueeze(0))
                    .expect("input");
                b.iter(|| {
                    // A fresh clone has an empty cache: the prefill starts at position 0.
                    let mut m = candle.clone();
                    m.forward(&input, 0).expect("candle forward")
                })
            },
        );
    }
    group.finish();

    let mut group = c.benchmark_group("decode");
    group
        .sample_size(30)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for n in LENGTHS {
        let tokens = prompt(n);
        let mut cache = model.new_cache();
        model
            .forward(&mut [SeqInput {
                tokens: &tokens,
                cache: &mut cache,
            }])
            .expect("prefill");
        group.bench_function(BenchmarkId::new("nucleus", n), |b| {
            b.iter(|| {
                let out = model
                    .forward(&mut [SeqInput {
                        tokens: &[7],
                        cache: &mut cache,
                    }])
                    .expect("decode");
                cache.truncate(n);
                out
            })
        });
        let mut prefilled = candle_model();
        let input = Tensor::new(tokens.as_slice(), &Device::Cpu)
            .and_then(|t| t.unsqueeze(0))
            .expect("input");
        prefilled.forward(&input, 0).expect("candle prefill");
        let next = Tensor::new(&[7u32], &Device::Cpu)
            .and_then(|t| t.unsqueeze(0))
            .expect("input");
        group.bench_function(BenchmarkId::new("candle-transformers", n), |b| {
            b.iter(|| {
                // The clone shares the prefilled cache; its forward concatenates a new one.
                let mut m = prefilled.clone();
                m.forward(&next, n).expect("candle decode")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, forward);
criterion_main!(benches);
