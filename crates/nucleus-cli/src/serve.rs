//! `nucleus serve`: the OpenAI-compatible server of nucleus-server over a model (README.md,
//! "nucleus serve").

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use nucleus_engine::{load_model, ChatTemplate, Engine, EngineConfig};
use nucleus_server::{ServedModel, Server, ServerConfig};

use crate::generate::GenerationConfigSource;
use crate::report;
use crate::usage::UsageError;

/// The flags of `nucleus serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The model: a GGUF file, a Hugging Face folder or a hub id (default: $NUCLEUS_MODEL).
    #[arg(long)]
    pub model: Option<String>,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// The port (0: any free port; the one taken is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The model's name in answers and in /v1/models (default: the --model value).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// The most requests running at once; more wait.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_num_seqs: u32,
    /// The most requests waiting; beyond that a request is refused with 503 and Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// The most tokens of prompt and completion together (default: the model's context).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// The largest request body in bytes; a larger one is a 400.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health, /v1/models and /.
    #[arg(long, env = "NUCLEUS_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Where sampling defaults come from: auto (the model folder's generation_config.json),
    /// vllm (none), or a folder holding a generation_config.json.
    #[arg(long, default_value = "auto")]
    pub generation_config: String,
    /// What to do with a JSON Schema llguidance cannot compile exactly: `relaxed` (the
    /// default) compiles the narrowest schema it can that contains it, `strict` answers 400.
    /// Each choice under a JSON Schema reports the exact validator's verdict in
    /// `nucleus_schema`.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = crate::grammar::SchemaMode::Relaxed)]
    pub json_schema_mode: crate::grammar::SchemaMode,
    /// The KV cache's element type: `f16` (the default, as llama.cpp's; half the memory) or
    /// `f32` (keys and values exactly as computed).
    #[arg(long, value_name = "DTYPE", default_value = "f16", value_parser = crate::model::parse_kv_cache_dtype)]
    pub kv_cache_dtype: nucleus_engine::KvCacheDtype,
    /// `--threads`.
    #[command(flatten)]
    pub threads: crate::threads::Threads,
}

/// Runs `nucleus serve` until Ctrl-C or SIGTERM.
///
/// # Errors
/// The model cannot be resolved or loaded; the flags are out of range (usage, exit 2); the
/// address cannot be bound.
pub fn run(args: &ServeArgs) -> Result<ExitCode> {
    if args.api_key.as_deref() == Some("") {
        return Err(UsageError::new("--api-key is empty").into());
    }
    if args.max_body_bytes == 0 {
        return Err(UsageError::new("--max-body-bytes 0 refuses every request").into());
    }
    if args.served_model_name.as_deref() == Some("") {
        return Err(UsageError::new("--served-model-name is empty").into());
    }
    let generation_config = GenerationConfigSource::parse(&args.generation_config)?;
    let path = crate::model::resolve(args.model.as_deref())?;
    let loaded = load_model(&path, &crate::generate::candle_device())?;
    for warning in &loaded.warnings {
        report::warning(warning);
    }
    let (defaults, _) = generation_config.defaults(&path)?;
    let chat_template = ChatTemplate::for_model(&path)?;
    if chat_template.is_none() {
        report::note("the model has no chat template: /v1/chat/completions answers 400");
    }
    let context = loaded.model.config().context_length;
    let max_model_len = args.max_model_len.unwrap_or(context);
    if max_model_len == 0 || max_model_len > context {
        return Err(UsageError::new(format!(
            "--max-model-len {max_model_len} must be in 1..={context} (the model's context)"
        ))
        .into());
    }
    let engine = Engine::new(
        loaded.model,
        loaded.tokenizer,
        EngineConfig {
            kv_cache_dtype: args.kv_cache_dtype,
            ..EngineConfig::default()
        },
    );
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .clone()
            .unwrap_or_else(|| path.display().to_string())
    });
    let config = ServerConfig {
        addr: SocketAddr::new(args.host, args.port),
        served_model_name: name,
        max_num_seqs: args.max_num_seqs as usize,
        max_queue: args.max_queue,
        max_model_len,
        max_body_bytes: args.max_body_bytes,
        api_key: args.api_key.clone(),
        json_schema_mode: args.json_schema_mode.into(),
    };
    let server = Server::start(
        config,
        ServedModel {
            engine,
            path,
            chat_template,
            defaults,
        },
    )?;
    server.serve(|addr| {
        // One line on stderr that scripts (and the tests) wait for.
        eprintln!("nucleus serve: listening on http://{addr}");
    })?;
    Ok(ExitCode::SUCCESS)
}
