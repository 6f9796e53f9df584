//! The library side of the `nucleus` command-line tool: code that the `nucleus` binary shares
//! with its benchmarks. Not a stable API; the operators live in the other crates.
//!
//! - [`bench`](mod@bench): the speed measurements of `nucleus bench` (workload generators,
//!   baselines, floors, timing), also driven by `benches/sampling.rs`.
//! - [`sample`](mod@sample): `nucleus sample`, sampling real logits given as JSON lines or a
//!   safetensors tensor, one JSON answer per row.
//! - [`grammar`](mod@grammar): `nucleus grammar validate`, checking a text against a JSON
//!   Schema, a regular expression or a Lark grammar.
//! - [`npu_sample`](mod@npu_sample): `nucleus top-k-top-p-sample`, the Ascend-compatible fused
//!   top-k / top-p / exponential-sampling operator on calls given as JSON lines or a
//!   safetensors file, one JSON answer per call.
//! - [`calls`](mod@calls): what the two operator commands share (error answers, `--attrs`).
//! - [`moe_init_routing`](mod@moe_init_routing): `nucleus moe-init-routing`, nucleus-moe's
//!   MoE token routing (`npu_moe_init_routing_v2`) on calls given as JSON lines or a
//!   safetensors file, one JSON answer per call.

pub mod bench;
pub mod calls;
pub mod grammar;
pub mod moe_init_routing;
pub mod npu_sample;
pub mod sample;
