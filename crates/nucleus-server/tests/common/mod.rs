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
    start_model(stories(), wrap, defaults, tweak)
}

/// [`start_with`] over the model file `path` (a GGUF file with its tokenizer).
pub fn start_model(
    path: PathBuf,
    wrap: impl FnOnce(Box<dyn CausalLm>) -> Box<dyn CausalLm>,
    defaults: GenerationDefaults,
    tweak: impl FnOnce(&mut ServerConfig),
) -> String {
    let loaded = load_model(&path, &Device::Cpu).expect("the model loads");
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

/// stories260K with its matrices stored as `dtype` (those whose rows are whole blocks of it;
/// the others, and the norms, stay f32), written to a new file in the temporary directory.
#[allow(dead_code)] // http.rs uses it, faults.rs does not
pub fn stories_as(dtype: candle_core::quantized::GgmlDType) -> PathBuf {
    use candle_core::quantized::{gguf_file, QTensor};
    let src = stories();
    let mut reader = std::io::BufReader::new(std::fs::File::open(&src).expect("stories260K"));
    let content = gguf_file::Content::read(&mut reader).expect("a GGUF file");
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort_by_key(|n| content.tensor_infos[*n].offset);
    let block = dtype.block_size();
    let tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|name| {
            let t = content
                .tensor(&mut reader, name, &candle_core::Device::Cpu)
                .expect("a tensor");
            let dims = t.shape().dims().to_vec();
            if dims.len() != 2 || !dims[1].is_multiple_of(block) {
                return (name.clone(), t);
            }
            let values = t.dequantize(&candle_core::Device::Cpu).expect("values");
            (
                name.clone(),
                QTensor::quantize(&values, dtype).expect("quantized"),
            )
        })
        .collect();
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let dst = std::env::temp_dir().join(format!(
        "nucleus-server-stories-{dtype:?}-{}.gguf",
        std::process::id()
    ));
    let mut out = std::io::BufWriter::new(std::fs::File::create(&dst).expect("a temporary file"));
    gguf_file::write(&mut out, &metadata, &refs).expect("written");
    std::io::Write::flush(&mut out).expect("flushed");
    dst
}
