//! A server over stories260K (../shared/models) on a free loopback port, for the tests.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use nucleus_engine::{load_model, CausalLm, Device, Engine, EngineConfig, GenerationDefaults};
use nucleus_server::{ServedModel, Server, ServerConfig};

/// stories260K, a real tiny Llama with its tokenizer.
pub fn stories() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K.gguf")
}

/// Starts a server over stories260K, its model passed through `wrap`, with these defaults
/// and the config `tweak` changes; returns its base URL. It runs until the process ends.
pub fn start_with(
    wrap: impl FnOnce(Box<dyn CausalLm>) -> Box<dyn CausalLm>,
    defaults: GenerationDefaults,
    tweak: impl FnOnce(&mut ServerConfig),
) -> String {
    let path = stories();
    let loaded = load_model(&path, &Device::Cpu).expect("stories260K loads");
    let context = loaded.model.config().context_length;
    let engine = Engine::new(
        wrap(loaded.model),
        loaded.tokenizer,
        EngineConfig::default(),
    );
    let mut config = ServerConfig {
        addr: "127.0.0.1:0".parse().expect("address"),
        served_model_name: "stories".into(),
        max_num_seqs: 16,
        max_queue: 256,
        max_model_len: context,
        max_body_bytes: 16 << 20,
        api_key: None,
        json_schema_mode: nucleus_engine::JsonSchemaMode::Relaxed,
    };
    tweak(&mut config);
    let server = Server::start(
        config,
        ServedModel {
            engine,
            path,
            chat_template: None,
            defaults,
        },
    )
    .expect("server starts");
    let (tx, rx) = std::sync::mpsc::channel::<SocketAddr>();
    std::thread::spawn(move || {
        server
            .serve(move |addr| tx.send(addr).expect("report the address"))
            .expect("serves");
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the server listens");
    format!("http://{addr}")
}
