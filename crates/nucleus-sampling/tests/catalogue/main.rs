//! The processor catalogue (`chain/`, issue 16) and the extended `SamplingParams` fields, in one
//! test binary (one build of the shared oracle and one link instead of five): constraints,
//! entropy-based filters and temperature, repetition avoidance, the stochastic processors and
//! selections, and the fixed path's placement of the extended fields.

#[path = "../common/mod.rs"]
mod common;

mod constraints;
mod entropy;
mod params_extended;
mod repetition;
mod stochastic;
