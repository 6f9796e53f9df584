//! One MoE feed-forward block (`nucleus_engine::SparseMoe`: nucleus-moe's gating, routing into
//! reused buffers, each expert on its contiguous rows, finalize) against, in the same run, the
//! per-expert gather / scatter loop candle-transformers' `qwen3_moe` runs on the CPU (softmax,
//! sort for the top k, for each expert `index_select` of its tokens, the expert, a multiply by
//! the weights, `index_add`), written here with candle ops on the same weights.
//!
//! Shape: hidden 512, 32 experts of width 256, 4 per token (a Qwen3-MoE layer scaled down to
//! fit a shared 2-core machine: 50 MB of f32 experts); 1 row (a decode step), 16 (a batch of
//! decode steps) and 256 (a prefill chunk).
//!
//! `cargo bench -p nucleus-engine --bench moe_block`.

use std::time::Duration;

use candle_core::{DType, Device, Tensor, D};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use nucleus_engine::models::MoeScratch;
use nucleus_engine::{ExpertWeights, SparseMoe};

const HIDDEN: usize = 512;
const EXPERTS: usize = 32;
const INTER: usize = 256;
const K: usize = 4;

fn random(n: usize, seed: &mut u64, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            scale * ((*seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

/// The gather / scatter baseline: `[T, H]` rows to `[T, H]`.
struct Baseline {
    router: Tensor,
    experts: Vec<[Tensor; 3]>,
}

impl Baseline {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let probs = candle_nn::ops::softmax_last_dim(&x.matmul(&self.router.t()?)?)?;
        let idx = probs
            .arg_sort_last_dim(false)?
            .narrow(D::Minus1, 0, K)?
            .contiguous()?;
        let w = probs.gather(&idx, D::Minus1)?;
        let w = w.broadcast_div(&w.sum_keepdim(D::Minus1)?)?;
        let (idx, w) = (idx.to_vec2::<u32>()?, w.to_vec2::<f32>()?);
        let mut rows = vec![Vec::new(); EXPERTS];
        let mut weights = vec![Vec::new(); EXPERTS];
        for (t, (ids, ws)) in idx.iter().zip(&w).enumerate() {
            for (&e, &wt) in ids.iter().zip(ws) {
                rows[e as usize].push(t as u32);
                weights[e as usize].push(wt);
            }
        }
        let mut y = x.zeros_like()?;
        for (e, [g, u, d]) in self.experts.iter().enumerate() {
            if rows[e].is_empty() {
                continue;
            }
            let r = Tensor::new(rows[e].as_slice(), x.device())?;
            let xe = x.index_select(&r, 0)?;
            let h = (candle_nn::ops::silu(&xe.matmul(&g.t()?)?)? * xe.matmul(&u.t()?)?)?;
            let out = h.matmul(&d.t()?)?;
            let wt = Tensor::new(weights[e].as_slice(), x.device())?.reshape(((), 1))?;
            y = y.index_add(&r, &out.broadcast_mul(&wt)?, 0)?;
        }
        Ok(y)
    }
}

fn moe_block(c: &mut Criterion) {
    let (threads, source) = nucleus_engine::threads::configure(None).expect("thread count");
    eprintln!("moe_block bench: {threads} threads ({source:?})");
    let dev = Device::Cpu;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let t = |v: Vec<f32>, r: usize, c: usize| Tensor::from_vec(v, (r, c), &dev).expect("tensor");
    let router = t(random(EXPERTS * HIDDEN, &mut seed, 0.5), EXPERTS, HIDDEN);
    let mut experts = Vec::new();
    let mut raw = Vec::new();
    for _ in 0..EXPERTS {
        let g = t(random(INTER * HIDDEN, &mut seed, 0.05), INTER, HIDDEN);
        let u = t(random(INTER * HIDDEN, &mut seed, 0.05), INTER, HIDDEN);
        let d = t(random(HIDDEN * INTER, &mut seed, 0.05), HIDDEN, INTER);
        raw.push([g.clone(), u.clone(), d.clone()]);
        experts.push(ExpertWeights {
            gate: g,
            up: u,
            down: d,
        });
    }
    let block = SparseMoe::new(router.clone(), experts, Vec::new(), K, true).expect("block");
    let baseline = Baseline {
        router,
        experts: raw,
    };

    let mut group = c.benchmark_group("moe_block");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for rows in [1usize, 16, 256] {
        let x = t(random(rows * HIDDEN, &mut seed, 1.0), rows, HIDDEN);
        // Both compute the same block.
        let ours = block.forward(&x).expect("ours");
        let theirs = baseline.forward(&x).expect("baseline");
        let diff = (ours - theirs)
            .and_then(|d| d.abs()?.flatten_all()?.max(0))
            .and_then(|m| m.to_dtype(DType::F32)?.to_scalar::<f32>())
            .expect("diff");
        assert!(diff < 1e-4, "rows {rows}: the two differ by {diff}");
        group.throughput(Throughput::Elements(rows as u64));
        let mut scratch = MoeScratch::default();
        group.bench_with_input(BenchmarkId::new("nucleus", rows), &x, |b, x| {
            b.iter(|| block.forward_with(x, &mut scratch).expect("forward"))
        });
        group.bench_with_input(
            BenchmarkId::new("candle-gather-scatter", rows),
            &x,
            |b, x| b.iter(|| baseline.forward(x).expect("forward")),
        );
    }
    group.finish();
}

criterion_group!(benches, moe_block);
criterion_main!(benches);
