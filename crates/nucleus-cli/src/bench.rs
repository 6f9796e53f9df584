//! Speed measurements run by `nucleus bench` and by the criterion benchmarks in `benches/`:
//! one implementation of each workload and baseline, shared by both.

pub mod moe;
pub mod npu_sample;
pub mod sampling;
