//! The token bitmask's in-place apply kernel against a per-token loop (the obvious way) and two
//! floors: one write of the row (`fill(-inf)`) and one read of it (a max). One row, vocab
//! 32,000 and 151,936; masks with every token allowed, 1% allowed (a grammar in the middle
//! of a JSON string or number), and half allowed at random.
//!
//! `cargo bench -p nucleus-sampling --bench bitmask`

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use nucleus_sampling::{apply_token_bitmask_inplace, bitmask_words};

/// xorshift64: fixed, reproducible masks.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

fn mask(n: usize, kind: &str) -> Vec<u32> {
    let mut next = rng(0x2545_f491_4f6c_dd1d);
    let mut words = vec![0u32; bitmask_words(n)];
    for t in 0..n {
        let allow = match kind {
            "all" => true,
            "1%" => next().is_multiple_of(100),
            _ => next() & 1 == 1,
        };
        if allow {
            words[t / 32] |= 1 << (t % 32);
        }
    }
    words
}

/// The per-token loop: test each token's bit, write -inf when it is clear.
fn per_token(row: &mut [f32], mask: &[u32]) {
    for (t, x) in row.iter_mut().enumerate() {
        if mask[t / 32] >> (t % 32) & 1 == 0 {
            *x = f32::NEG_INFINITY;
        }
    }
}

fn bitmask(c: &mut Criterion) {
    for n in [32_000usize, 151_936] {
        let mut next = rng(7);
        let logits: Vec<f32> = (0..n)
            .map(|_| (next() % 2000) as f32 / 100.0 - 10.0)
            .collect();
        let mut row = logits.clone();
        let mut group = c.benchmark_group(format!("bitmask/vocab{n}"));
        group
            .sample_size(30)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1));
        group.bench_function("floor: fill the row", |b| {
            b.iter(|| row.fill(std::hint::black_box(f32::NEG_INFINITY)))
        });
        group.bench_function("floor: max of the row", |b| {
            b.iter(|| {
                std::hint::black_box(&logits).chunks_exact(16).fold(
                    [f32::NEG_INFINITY; 16],
                    |mut m, c| {
                        for (a, &x) in m.iter_mut().zip(c) {
                            *a = if x > *a { x } else { *a };
                        }
                        m
                    },
                )
            })
        });
        for kind in ["all", "1%", "50%"] {
            let m = mask(n, kind);
            // Masking is idempotent: after the first call the row holds the masked values,
            // and every later call does the same work (the kernel never reads the row).
            group.bench_function(BenchmarkId::new("apply_token_bitmask_inplace", kind), |b| {
                b.iter(|| apply_token_bitmask_inplace(&mut row, std::hint::black_box(&m)))
            });
            group.bench_function(BenchmarkId::new("per-token loop", kind), |b| {
                b.iter(|| per_token(&mut row, std::hint::black_box(&m)))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bitmask);
criterion_main!(benches);
