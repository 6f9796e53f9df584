//! The library side of the `nucleus` command-line tool: code that the `nucleus` binary shares
//! with its benchmarks. Not a stable API; the operators live in the other crates.
//!
//! - [`bench`](mod@bench): the flags and tables of `nucleus bench`; the measurements
//!   themselves (workloads, baselines, floors, timing) are the nucleus-bench crate's.
//! - [`sample`](mod@sample): `nucleus sample`, sampling real logits given as JSON lines or a
//!   safetensors tensor, one JSON answer per row.
//! - [`generate`](mod@generate): `nucleus generate`, text from a model: the flags of the whole
//!   sampling contract, generation_config.json defaults, text or JSON output in order.
//! - [`chat`](mod@chat): chat mode of `generate` and `nucleus chat-template`: conversations
//!   rendered with the model's chat template.
//! - [`tokenize`](mod@tokenize): `nucleus tokenize` and `nucleus detokenize`.
//! - [`model`](mod@model): `--model`, a path, a hub id or a GGUF in a hub repository.
//! - [`grammar`](mod@grammar): `nucleus grammar validate`, checking a text against a JSON
//!   Schema, a regular expression or a Lark grammar.
//! - [`npu_sample`](mod@npu_sample): `nucleus top-k-top-p-sample`, the Ascend-compatible fused
//!   top-k / top-p / exponential-sampling operator on calls given as JSON lines or a
//!   safetensors file, one JSON answer per call.
//! - [`fuzz`](mod@fuzz): what each cargo-fuzz target runs, and the corpus replay test.
//! - [`calls`](mod@calls): what the two operator commands share (error answers, `--attrs`).
//! - [`input`](mod@input): what every command that reads input shares: `--max-input-bytes`,
//!   files read within it, JSON lines read within it, echoed names escaped and capped.
//! - [`answer`](mod@answer): how the JSON-lines commands write answers (small ones serialised
//!   in parallel, large ones straight into the output).
//! - [`usage`](mod@usage): the exit statuses, and [`usage::UsageError`] for a bad flag value
//!   (exit status 2).
//! - [`report`](mod@report): `error:` and `warning:` lines on stderr, escaped and bounded and
//!   never a crash when stderr cannot be written; stdout's write errors named.
//! - [`memory`](mod@memory): how many bytes a command's work needs, checked before the work
//!   (`generate`'s KV cache, an operator's outputs) with nucleus-bench's checks.
//! - [`moe_init_routing`](mod@moe_init_routing): `nucleus moe-init-routing`, nucleus-moe's
//!   MoE token routing (`npu_moe_init_routing_v2`) on calls given as JSON lines or a
//!   safetensors file, one JSON answer per call.

pub mod answer;
pub mod bench;
pub mod calls;
pub mod chat;
pub mod fuzz;
pub mod generate;
pub mod grammar;
pub mod input;
pub mod memory;
pub mod model;
pub mod moe_init_routing;
pub mod npu_sample;
pub mod report;
pub mod sample;
pub mod serve;
pub mod speculative_verify;
pub mod threads;
pub mod tokenize;
pub mod usage;
