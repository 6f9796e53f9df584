//! `SamplingParams::n` and `SamplingParams::logprobs`, in one test binary: hand-worked rows,
//! options and errors (`worked`), and random rows against the f64 oracle with chi-square
//! statistics and batch and thread invariance (`oracle`).

#[path = "../common/mod.rs"]
mod common;

mod oracle;
mod worked;
