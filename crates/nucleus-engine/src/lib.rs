//! # nucleus-engine
//!
//! Models and the generation loop around nucleus-sampling: what runs between the user's
//! request and the logits, and between the sampled token and the streamed text.
//!
//! - [`load_model`] reads a model from a Hugging Face folder ([`load_hf_folder`]: config.json,
//!   safetensors weights, tokenizer.json; `model_type` llama, qwen2, qwen3, qwen3_moe,
//!   minimind) or a GGUF file
//!   ([`load_gguf`]: llama.cpp's format, its header through our checked parser,
//!   [`gguf::read_content`], which refuses corrupt files; arch `llama`, `qwen2`, `qwen3` or `qwen3moe`,
//!   f32 or any quantized type candle supports; the tokenizer built from the metadata), giving
//!   a model behind the one interface the engine sees, [`CausalLm`], its [`ModelTokenizer`]
//!   and the warnings of what was ignored ([`LoadedModel::warnings`]). Loaders live in [`loader`], the model in
//!   [`models`]: one decoder-only [`Transformer`] parameterised by its [`ModelConfig`], dense or
//!   mixture-of-experts ([`SparseMoe`], on nucleus-moe's routing operators).
//! - [`load_tokenizer`] reads a tokenizer alone (a GGUF file, vocab-only ones included, a Hugging
//!   Face folder or a tokenizer.json): GGUF tokenizers of the SentencePiece (`llama`) and
//!   byte-level BPE (`gpt2`, pre-tokenizer by `tokenizer.ggml.pre`) kinds, as llama.cpp's
//!   `llama-vocab.cpp` tokenizes them; [`ModelTokenizer::encode`] / [`ModelTokenizer::decode`]
//!   and the end-of-generation ids ([`ModelTokenizer::eos_token_ids`]).
//! - [`CausalLm::forward`] runs the new tokens of many sequences in one pass: the linear
//!   layers on all rows at once, attention per sequence over its own [`KvCache`].
//! - [`Engine`] takes [`Request`]s (prompt, [`SamplingParams`], max_tokens, stop token ids,
//!   stop strings, n) and advances every live sequence one token per [`Engine::step`], sampling
//!   all rows with one `nucleus_sampling::sample_batch` call; requests join and leave between
//!   steps. Text is detokenised incrementally ([`detokenize`]).
//! - [`ChatTemplate`] finds a model's chat template (tokenizer_config.json, chat_template.jinja,
//!   GGUF metadata) and renders a conversation as Hugging Face's `apply_chat_template` does;
//!   [`messages_from_openai`] takes OpenAI-style messages.
//! - [`hub::resolve`] finds a model as the Hugging Face tools do: a path, a hub id
//!   (`OWNER/NAME[@REVISION]`, `REPO:FILE.gguf`, `REPO:Q4_K_M`), `$NUCLEUS_MODEL`, or the
//!   default model, through the hub cache and the settings of [`HubEnv`] (`HF_HOME`,
//!   `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_HUB_OFFLINE`, `HF_TOKEN`).
//!
//! A generation loop:
//!
//! ```no_run
//! use nucleus_engine::{load_model, Device, Engine, EngineConfig, Request, SamplingParams};
//!
//! let loaded = load_model("stories260K.gguf".as_ref(), &Device::Cpu)?;
//! let mut engine = Engine::new(loaded.model, loaded.tokenizer, EngineConfig::default());
//! engine.add_request(Request {
//!     params: SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(42), ..Default::default() },
//!     max_tokens: 64,
//!     ..Request::new("Once upon a time")
//! })?;
//! while engine.has_unfinished() {
//!     for out in engine.step()? {
//!         print!("{}", out.text);
//!         if let Some(reason) = out.finish {
//!             println!("\n[{reason}]");
//!         }
//!     }
//! }
//! # Ok::<(), nucleus_engine::EngineError>(())
//! ```

pub mod chat_template;
pub mod detokenize;
pub mod engine;
pub mod error;
pub mod generation_config;
pub mod gguf;
pub mod hub;
pub mod kv_cache;
pub mod loader;
pub mod models;
pub mod threads;
pub mod tokenizer;

pub use candle_core::Device;
pub use chat_template::{messages_from_openai, ChatTemplate, RenderOptions};
pub use engine::{
    Engine, EngineConfig, FinishReason, Metrics, Prompt, Request, RequestInfo, StepOutput,
    MAX_SAMPLES_PER_REQUEST,
};
pub use error::{EngineError, Result};
pub use generation_config::GenerationDefaults;
pub use hub::HubEnv;
pub use kv_cache::{KvCache, KvCacheDtype};
pub use loader::{
    load_gguf, load_gguf_from, load_gguf_tokenizer, load_hf_folder, load_hf_tokenizer, load_model,
    load_tokenizer, load_tokenizer_json, LoadedModel,
};
pub use models::{
    moe_routing_bytes, CausalLm, ExpertWeights, ModelConfig, MoeConfig, RopeConfig, RopeLayout,
    RopeScaling, SeqInput, SparseMoe, Transformer,
};
pub use nucleus_grammar::{GrammarOptions, GrammarSpec, JsonSchemaMode};
pub use nucleus_sampling::SamplingParams;
pub use tokenizer::{supported_pre_types, ModelTokenizer, TokenizerKind, EOG_TOKEN_TEXTS};
