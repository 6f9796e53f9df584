//! `nucleus serve`: an OpenAI-compatible HTTP server over [`nucleus_engine::Engine`], with
//! continuous batching.
//!
//! Routes (vLLM's and llama.cpp's servers serve the same): `POST /v1/completions`,
//! `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`
//! (Prometheus), `POST /tokenize`, `POST /detokenize`, and `GET /`.
//!
//! The engine runs on its own thread ([`worker`]), never on the async runtime: handlers
//! parse and tokenise a request, send it as a [`worker::Job`] over a channel and read its
//! events back; a handler that goes away (the client closed the stream or the connection)
//! drops its receiver, which cancels the job before the engine's next step. At most
//! `max_num_seqs` jobs run at once and at most `max_queue` wait; a request beyond that is
//! refused at once with 503 and `Retry-After`.
//!
//! Every answer that is not a success has OpenAI's error shape (`{"error": {"message",
//! "type", "param", "code"}}`, [`error::ApiError`]); a panic while handling one request is
//! answered 500 and the server goes on.

pub mod error;
pub mod metrics;
pub mod protocol;
mod routes;
pub mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use nucleus_engine::{ChatTemplate, Engine, GenerationDefaults, ModelTokenizer};

/// What `nucleus serve` serves with.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The address to listen on (`--host`, `--port`; port 0 picks a free one).
    pub addr: SocketAddr,
    /// The model's name in answers and in `/v1/models` (`--served-model-name`); requests
    /// naming another model get a 404.
    pub served_model_name: String,
    /// The most requests running at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// The most requests waiting (`--max-queue`).
    pub max_queue: usize,
    /// The most tokens of prompt and completion together (`--max-model-len`).
    pub max_model_len: usize,
    /// The largest request body in bytes (`--max-body-bytes`); a larger one is a 400.
    pub max_body_bytes: usize,
    /// With a key, every route but `/health`, `/v1/models` and `/` needs
    /// `Authorization: Bearer KEY` (401 otherwise), as llama.cpp's server does.
    pub api_key: Option<String>,
    /// What to do with a JSON Schema (`response_format`, `structured_outputs`, `guided_json`)
    /// llguidance cannot compile exactly (`nucleus serve --json-schema-mode`): relaxed
    /// compiles the narrowest schema it can that contains it; strict answers 400. Either way
    /// each choice reports the exact validator's verdict in `nucleus_schema`.
    pub json_schema_mode: nucleus_engine::JsonSchemaMode,
}

/// The model and what goes with it.
pub struct ServedModel {
    /// The engine over the loaded model.
    pub engine: Engine,
    /// The model's path (shown as `root` in `/v1/models`).
    pub path: PathBuf,
    /// Its chat template, if it has one (chat requests are a 400 otherwise).
    pub chat_template: Option<ChatTemplate>,
    /// generation_config.json's defaults, used for fields a request leaves out.
    pub defaults: GenerationDefaults,
}

/// The state the handlers share.
pub(crate) struct AppState {
    pub(crate) config: ServerConfig,
    pub(crate) tokenizer: ModelTokenizer,
    pub(crate) chat_template: Option<ChatTemplate>,
    pub(crate) defaults: GenerationDefaults,
    pub(crate) vocab_size: usize,
    pub(crate) root: String,
    pub(crate) created: u64,
    pub(crate) jobs: std::sync::Mutex<std::sync::mpsc::Sender<worker::Job>>,
    pub(crate) counts: Arc<worker::Counts>,
    pub(crate) metrics: Arc<metrics::Metrics>,
    /// The engine's grammar compiler (`None` when the tokenizer cannot serve grammars: the
    /// engine then answers): handlers compile a request's grammar before it reaches the
    /// engine thread, so compiling never pauses the running requests.
    pub(crate) grammars: Option<Arc<nucleus_grammar::GrammarCompiler>>,
}

/// A server whose engine thread is running: its router, ready to serve.
pub struct Server {
    state: Arc<AppState>,
    engine_thread: std::thread::JoinHandle<()>,
}

impl Server {
    /// Starts the engine thread over `model`.
    ///
    /// # Errors
    /// `max_model_len` beyond the model's context or 0; `max_num_seqs` 0; the metrics
    /// registry (not expected); the thread cannot be spawned.
    pub fn start(config: ServerConfig, model: ServedModel) -> anyhow::Result<Self> {
        let context = model.engine.model().config().context_length;
        if config.max_model_len == 0 || config.max_model_len > context {
            anyhow::bail!(
                "--max-model-len {} must be in 1..={context} (the model's context)",
                config.max_model_len
            );
        }
        if config.max_num_seqs == 0 {
            anyhow::bail!("--max-num-seqs must be at least 1");
        }
        let metrics = Arc::new(metrics::Metrics::new(&config.served_model_name)?);
        let counts = Arc::new(worker::Counts::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let tokenizer = model.engine.tokenizer().clone();
        let rows = model.engine.model().config().vocab_size;
        let tok_vocab = tokenizer.tokenizer.get_vocab_size(true);
        let vocab_size = if tok_vocab > 0 && tok_vocab < rows {
            tok_vocab
        } else {
            rows
        };
        let worker_config = worker::WorkerConfig {
            max_num_seqs: config.max_num_seqs,
        };
        let (c, m) = (counts.clone(), metrics.clone());
        let mut engine = model.engine;
        let grammars = engine.shared_grammar_compiler().ok();
        // The step loop runs on a thread of a rayon pool of its own, the size of the global
        // one (`--threads`): the model's and the sampler's parallel work inside a step then
        // starts from a pool thread, inline or stolen, instead of being injected from outside
        // and waited for (a futex wake and a sleep per parallel call: most of a small model's
        // step, `perf` showed). A pool of its own leaves the global one to the HTTP threads.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(rayon::current_num_threads())
            .thread_name(|i| format!("nucleus-engine-{i}"))
            .build()?;
        let engine_thread = std::thread::Builder::new()
            .name("nucleus-engine".into())
            .spawn(move || pool.install(move || worker::run(engine, rx, worker_config, c, m)))?;
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Self {
            state: Arc::new(AppState {
                root: model.path.display().to_string(),
                config,
                tokenizer,
                chat_template: model.chat_template,
                defaults: model.defaults,
                vocab_size,
                created,
                jobs: std::sync::Mutex::new(tx),
                counts,
                metrics,
                grammars,
            }),
            engine_thread,
        })
    }

    /// The router over this server's state.
    pub fn router(&self) -> axum::Router {
        routes::router(self.state.clone())
    }

    /// Serves on `config.addr` until Ctrl-C (or SIGTERM); calls `on_listen` with the bound
    /// address first (port 0 picks one).
    ///
    /// # Errors
    /// The address cannot be bound; the runtime cannot start.
    pub fn serve(self, on_listen: impl FnOnce(SocketAddr)) -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("nucleus-http")
            .build()?;
        let app = self.router();
        let addr = self.state.config.addr;
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
            on_listen(listener.local_addr()?);
            // TCP_NODELAY, as uvicorn (vLLM's server) sets it: a stream's small SSE events
            // go out at once instead of waiting for the client's delayed ACK (Nagle's
            // algorithm held them up to 40 ms each).
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::warn!("cannot set TCP_NODELAY on a connection: {e}");
                }
            });
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown_signal())
                .await?;
            anyhow::Ok(())
        })?;
        // Closing the job channel ends the engine thread once its jobs are done.
        drop(self.state);
        let _ = self.engine_thread.join();
        Ok(())
    }
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
