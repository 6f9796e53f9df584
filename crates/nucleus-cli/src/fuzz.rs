//! What the cargo-fuzz targets run (`fuzz/fuzz_targets/*.rs`, README.md "Fuzzing"), one
//! function per target, and what the stable replay test (`tests/fuzz_corpus.rs`) runs on every
//! committed corpus file: the same code as the commands, on arbitrary bytes.
//!
//! Each function returns normally whatever the bytes; it panics only when an invariant breaks,
//! which is what the fuzzer reports: a panic or an abort inside nucleus, an answer that is not
//! one line of JSON, a JSON-lines run that answers some line twice or not at all, an error
//! message that is long or holds control characters, a grammar mask that allows a token the
//! grammar then rejects, a rollback that does not restore the start. Memory is bounded by
//! libFuzzer's `-rss_limit_mb` (2 GB by default) and `-malloc_limit_mb`, so an input that makes
//! nucleus ask for more than its size warrants is reported too.

use std::io::Cursor;
use std::path::Path;

use nucleus_grammar::{
    GrammarCompiler, GrammarError, GrammarOptions, GrammarSpec, JsonSchemaMode, TokenEnv,
    MAX_MESSAGE_LINE,
};

use crate::input::MaxInputBytes;

/// The longest error message an operator command may write, in bytes: the engine caps its
/// messages at 400 bytes and file names at 256; a JSON-path prefix and the operator's rule
/// fit in this.
const MAX_MESSAGE_BYTES: usize = 4096;

/// The `--max-input-bytes` of the JSON-lines targets: small, so that the fuzzer reaches the
/// over-long-line path.
pub const FUZZ_LINE_LIMIT: u64 = 1024;

/// Checks an error message: at most [`MAX_MESSAGE_BYTES`] bytes, no control characters.
fn check_message(message: &str) {
    assert!(
        message.len() <= MAX_MESSAGE_BYTES,
        "a {} byte message: {:.300}",
        message.len(),
        message
    );
    assert!(
        !message.chars().any(|c| c.is_control()),
        "a control character in the message {message:?}"
    );
}

/// The GGUF loader on a file's bytes: [`nucleus_engine::load_gguf_from`] (our header parser,
/// then the model and its tokenizer), which must answer a model or a typed error with a short,
/// escaped message. A model that loads must also encode and decode a text.
pub fn gguf(data: &[u8]) {
    let path = Path::new("fuzz.gguf");
    match nucleus_engine::load_gguf_from(&mut Cursor::new(data), path, &nucleus_engine::Device::Cpu)
    {
        Ok(loaded) => {
            for w in &loaded.warnings {
                check_message(w);
            }
            let tokenizer = &loaded.tokenizer.tokenizer;
            if let Ok(encoding) = tokenizer.encode("Once upon a time, 猫", true) {
                let _ = tokenizer.decode(encoding.get_ids(), true);
            }
        }
        Err(e) => check_message(&e.to_string()),
    }
}

/// The answer lines written to `out`, each checked to be one JSON object: an answer, or
/// `{"error": {"kind", "message"}}` with a message of at most [`MAX_MESSAGE_BYTES`]. Returns
/// how many there are.
fn check_answers(out: &[u8]) -> usize {
    let text = std::str::from_utf8(out).expect("answers are UTF-8");
    let mut n = 0;
    for line in text.lines() {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("an answer that is not JSON ({e}): {line:.300}"));
        let object = value.as_object().expect("every answer is an object");
        if let Some(error) = object.get("error") {
            let kind = error["kind"].as_str().expect("an error has a kind");
            assert!(!kind.is_empty());
            // JSON escapes control characters, so only the length matters here.
            let message = error["message"].as_str().expect("an error has a message");
            assert!(message.len() <= MAX_MESSAGE_BYTES, "{message:.300}");
        }
        n += 1;
    }
    n
}

/// The lines of a JSON-lines input that get an answer: those that are not blank, as the
/// commands see it (a leading byte-order mark and line endings aside, [`str::trim`] leaves
/// something, or the line is not UTF-8, or it is longer than the limit).
fn answered_lines(data: &[u8], limit: usize) -> usize {
    let data = data.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(data);
    let mut lines: Vec<&[u8]> = data.split(|&b| b == b'\n').collect();
    if lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    lines
        .into_iter()
        .filter(|line| {
            line.len() > limit || std::str::from_utf8(line).map_or(true, |l| !l.trim().is_empty())
        })
        .count()
}

/// Runs a JSON-lines command's loop (`run_jsonl`) on `data` with a line limit of
/// [`FUZZ_LINE_LIMIT`] bytes and checks that every line that should be answered is, once,
/// in JSON.
fn jsonl(
    data: &[u8],
    run: impl FnOnce(
        Box<dyn std::io::Read + Send>,
        &mut dyn std::io::Write,
        MaxInputBytes,
    ) -> Result<(), crate::sample::RunError>,
) {
    let mut out = Vec::new();
    let input = Box::new(Cursor::new(data.to_vec()));
    if let Err(e) = run(input, &mut out, MaxInputBytes(FUZZ_LINE_LIMIT)) {
        panic!("reading from memory failed: {e:?}");
    }
    let answers = check_answers(&out);
    assert_eq!(
        answers,
        answered_lines(data, FUZZ_LINE_LIMIT as usize),
        "answers for {:?}",
        String::from_utf8_lossy(&data[..data.len().min(300)])
    );
}

/// `nucleus sample` on JSON lines, without and (every other input) with `--dist`.
pub fn jsonl_sample(data: &[u8]) {
    let options = crate::sample::Options {
        dist: data.first().is_some_and(|b| b & 1 == 1),
    };
    jsonl(data, |input, out, limit| {
        crate::sample::run_jsonl(input, out, &options, limit)
    });
}

/// `nucleus top-k-top-p-sample` on JSON lines.
pub fn jsonl_top_k_top_p_sample(data: &[u8]) {
    jsonl(data, crate::npu_sample::run_jsonl);
}

/// `nucleus speculative-verify` on JSON lines.
pub fn jsonl_speculative_verify(data: &[u8]) {
    jsonl(data, crate::speculative_verify::run_jsonl);
}

/// `nucleus moe-init-routing` on JSON lines.
pub fn jsonl_moe_init_routing(data: &[u8]) {
    jsonl(data, crate::moe_init_routing::run_jsonl);
}

/// The `--attrs` the `safetensors` target gives `top-k-top-p-sample`, by selector.
const NPU_ATTRS: [&str; 3] = [
    "{}",
    r#"{"is_need_logits": true, "ks_max": 4, "eps": 0.5}"#,
    r#"{"input_is_logits": false, "q_indexing": "sorted_rank"}"#,
];

/// The `--attrs` the `safetensors` target gives `moe-init-routing`, by selector.
const MOE_ATTRS: [&str; 4] = [
    r#"{"expert_num": 4}"#,
    r#"{"expert_num": 3, "active_num": 2, "row_idx_type": 1, "expert_tokens_num_type": 2, "expert_tokens_num_flag": true}"#,
    r#"{"expert_num": 2, "expert_capacity": 1, "drop_pad_mode": 1, "expert_tokens_num_type": 1, "expert_tokens_num_flag": true, "quant_mode": 0}"#,
    r#"{"expert_num": 8, "quant_mode": 1, "active_expert_range": [1, 5]}"#,
];

/// The three operator commands on a safetensors file: the first byte picks the command
/// (`% 3`: sample, top-k-top-p-sample, moe-init-routing) and its options (`/ 3`), the rest is
/// the file. Every answer is a JSON line; a file that is not usable is one short message.
pub fn safetensors(data: &[u8]) {
    let Some((&selector, file)) = data.split_first() else {
        return;
    };
    let pick = usize::from(selector / 3);
    match selector % 3 {
        0 => {
            let options = crate::sample::Options {
                dist: pick % 2 == 1,
            };
            let mut out = Vec::new();
            match crate::sample::answer_safetensors(file, None, &mut out, &options) {
                Ok(()) => {
                    check_answers(&out);
                }
                Err(crate::sample::RunError::Input(m)) => check_message(&m),
                Err(e) => panic!("writing to memory failed: {e:?}"),
            }
        }
        1 => {
            let attrs = serde_json::from_str(NPU_ATTRS[pick % NPU_ATTRS.len()]).expect("attrs");
            match crate::npu_sample::answer_safetensors(file, &attrs) {
                Ok(result) => {
                    check_answers(&crate::npu_sample::line(&result));
                }
                Err(m) => check_message(&m),
            }
        }
        _ => {
            let attrs = serde_json::from_str(MOE_ATTRS[pick % MOE_ATTRS.len()]).expect("attrs");
            match crate::moe_init_routing::answer_safetensors(file, &attrs) {
                Ok(result) => {
                    check_answers(&crate::moe_init_routing::line(&result));
                }
                Err(m) => check_message(&m),
            }
        }
    }
}

/// Grammar compilation and use, with MiniMind's tokenizer.
pub struct Grammar {
    compiler: GrammarCompiler,
}

/// The most bytes of grammar text the target compiles: larger grammars only take longer
/// (llguidance's compile time grows with size; 100,000 alternatives take 18 s) without
/// reaching new code.
pub const MAX_FUZZ_GRAMMAR_BYTES: usize = 8 << 10;

impl Grammar {
    /// A grammar fuzzer over MiniMind's tokenizer, read from `shared` (the project's shared
    /// folder, `models/minimind-tokenizer/tokenizer.json`; EOS ids 2 and 0).
    ///
    /// # Errors
    /// The tokenizer cannot be read or used.
    pub fn new(shared: &Path) -> anyhow::Result<Self> {
        let path = shared.join("models/minimind-tokenizer/tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let env = TokenEnv::from_tokenizer(&tokenizer, &[2, 0], 6400)?;
        Ok(Self {
            compiler: GrammarCompiler::with_capacity(env, 1)?,
        })
    }

    /// Compiles and runs one grammar. The bytes are: the kind (`% 3`: JSON Schema, regex,
    /// Lark), the options (`% 3`: at most 8 whitespace characters, none, unbounded; `/ 3 % 2`:
    /// JSON Schema mode strict, relaxed), the
    /// grammar's text (lossy UTF-8, at most [`MAX_FUZZ_GRAMMAR_BYTES`]) and, after a NUL byte,
    /// a text to validate. A grammar that compiles is walked for up to 12 tokens, each chosen
    /// from its mask by the input's bytes, then rolled back to its start.
    pub fn run(&self, data: &[u8]) {
        let [kind, options, rest @ ..] = data else {
            return;
        };
        let (grammar, text) = match rest.iter().position(|&b| b == 0) {
            Some(i) => (&rest[..i], Some(&rest[i + 1..])),
            None => (rest, None),
        };
        if grammar.len() > MAX_FUZZ_GRAMMAR_BYTES {
            return;
        }
        let source = String::from_utf8_lossy(grammar).into_owned();
        let spec = match kind % 3 {
            0 => GrammarSpec::JsonSchema(source),
            1 => GrammarSpec::Regex(source),
            _ => GrammarSpec::Lark(source),
        };
        let options = GrammarOptions {
            max_whitespace: [Some(8), Some(0), None][usize::from(options % 3)],
            json_schema_mode: [JsonSchemaMode::Strict, JsonSchemaMode::Relaxed]
                [usize::from(options / 3 % 2)],
        };
        let compiled = match self.compiler.compile(&spec, &options) {
            Ok(compiled) => compiled,
            Err(e) => {
                check_grammar_error(&e);
                return;
            }
        };
        let env = self.compiler.token_env();
        let mut matcher = compiled.matcher();
        let mut row = vec![0u32; env.bitmask_words()];
        let mut start = None;
        let mut choice = data
            .iter()
            .fold(0usize, |h, &b| h.wrapping_mul(31) ^ usize::from(b));
        for _ in 0..12 {
            if let Err(e) = matcher.fill_bitmask(&mut row) {
                check_grammar_error(&e);
                break;
            }
            let allowed: Vec<u32> = (0..env.vocab_size() as u32)
                .filter(|&t| row[t as usize / 32] >> (t % 32) & 1 == 1)
                .collect();
            start.get_or_insert_with(|| row.clone());
            if allowed.is_empty() {
                break;
            }
            choice = choice
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let token = allowed[(choice >> 33) % allowed.len()];
            match matcher.commit(token) {
                Ok(()) => {}
                Err(GrammarError::TokenRejected { token, text }) => {
                    panic!("the mask allowed token {token} ({text:?}), then commit rejected it")
                }
                Err(e) => {
                    check_grammar_error(&e);
                    break;
                }
            }
        }
        if matcher.error().is_none() {
            let n = matcher.committed_len();
            matcher
                .rollback(n)
                .expect("rolling back what was committed");
            let mut again = vec![0u32; row.len()];
            matcher
                .fill_bitmask(&mut again)
                .expect("the first mask, again");
            if let Some(start) = start {
                assert_eq!(
                    again, start,
                    "rollback to the start gives the first mask again"
                );
            }
        }
        if let Some(text) = text {
            let text = String::from_utf8_lossy(text);
            if let Err(e) = nucleus_grammar::validate_text(&self.compiler, &spec, &options, &text) {
                check_grammar_error(&e);
            }
            // The exact validator on the same text: a verdict or a one-line error, no panic.
            if let Some(Err(e)) = compiled.validate_json(&text) {
                assert!(!e.message.contains('\n'), "{e}");
            }
        }
        self.compiler.clear_cache();
    }
}

/// A grammar error's message: one line, at most [`MAX_MESSAGE_LINE`] characters besides the
/// kind's prefix, no control characters.
fn check_grammar_error(e: &GrammarError) {
    let message = e.to_string();
    assert!(
        !message.contains('\n'),
        "more than one line: {message:.500}"
    );
    assert!(
        message.chars().count() <= MAX_MESSAGE_LINE + 100,
        "{} characters: {message:.300}",
        message.chars().count()
    );
    assert!(
        !message.chars().any(|c| c.is_control()),
        "a control character in {message:?}"
    );
}
