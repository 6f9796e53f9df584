//! # nucleus-engine
//!
//! Models and the generation loop around nucleus-sampling.

pub mod detokenize;
pub mod engine;
pub mod error;
pub mod hub;
pub mod kv_cache;
pub mod load;
pub mod model;
pub mod tokenizer;

pub use candle_core::Device;
pub use engine::{
    Engine, EngineConfig, FinishReason, Metrics, Prompt, Request, RequestInfo, StepOutput,
};
pub use error::{EngineError, Result};
pub use kv_cache::KvCache;
pub use load::{load_gguf, LoadedModel};
pub use model::{LlamaConfig, LlamaModel, SeqInput};
pub use nucleus_sampling::SamplingParams;
pub use tokenizer::{GgufTokenizer, TokenizerKind};
