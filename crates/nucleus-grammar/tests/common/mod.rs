//! Shared test helpers: the shared tokenizers, bitmask reading, the compact JSON writer.

#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};

use nucleus_grammar::{GrammarCompiler, TokenEnv};
use tokenizers::Tokenizer;

/// A file of the project's shared folder (never copied into the repository).
pub fn shared(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(path)
}

/// MiniMind's byte-level BPE tokenizer (6,400 ids).
pub fn minimind_tokenizer() -> Tokenizer {
    let path = shared("models/minimind-tokenizer/tokenizer.json");
    Tokenizer::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// MiniMind's EOS ids: `<|im_end|>` (2) and `<|endoftext|>` (0).
pub const MINIMIND_EOS: [u32; 2] = [2, 0];

pub fn minimind_env() -> TokenEnv {
    TokenEnv::from_tokenizer(&minimind_tokenizer(), &MINIMIND_EOS, 6400).expect("MiniMind env")
}

pub fn minimind_compiler() -> GrammarCompiler {
    GrammarCompiler::new(minimind_env()).expect("MiniMind compiler")
}

/// The GGUF SentencePiece tokenizer of stories260K as nucleus-engine builds it, its EOS id and
/// the model's vocabulary size.
pub fn stories_tokenizer() -> (Tokenizer, u32, usize) {
    let path = shared("models/stories260K.gguf");
    let loaded = nucleus_engine::load_gguf(&path, &nucleus_engine::Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let eos = *loaded
        .tokenizer
        .eos_token_ids
        .first()
        .expect("stories260K has an EOS id");
    let vocab = loaded.model.config().vocab_size;
    (loaded.tokenizer.tokenizer, eos, vocab)
}

/// Whether bit `t` of a bitmask row is set.
pub fn allowed(row: &[u32], t: u32) -> bool {
    (row[t as usize / 32] >> (t % 32)) & 1 == 1
}

/// The ids set in a bitmask row, in increasing order.
pub fn allowed_ids(row: &[u32]) -> Vec<u32> {
    (0..row.len() as u32 * 32)
        .filter(|&t| allowed(row, t))
        .collect()
}

/// Writes a JSON value in the compact form with one space after `:` and `,` (outside
/// strings): `{"a": [1, 2], "b": "x,y"}`. Key order is the value's (serde_json with
/// `preserve_order`: the document's order); strings and numbers are written by serde_json.
pub fn spaced_json(value: &serde_json::Value) -> String {
    let compact = serde_json::to_string(value).expect("a Value always serialises");
    let mut out = String::with_capacity(compact.len() + compact.len() / 8);
    let mut in_string = false;
    let mut escaped = false;
    for c in compact.chars() {
        out.push(c);
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else if c == ':' || c == ',' {
            out.push(' ');
        }
    }
    out
}

/// The JSONSchemaBench sample's files (`data/jsonschema-sample/<Subset>/<name>.json`, 61 of
/// them), sorted.
pub fn sample_files() -> Vec<PathBuf> {
    let root = shared("data/jsonschema-sample");
    let mut files = Vec::new();
    for dir in std::fs::read_dir(&root).unwrap_or_else(|e| panic!("{}: {e}", root.display())) {
        let dir = dir.unwrap().path();
        if dir.is_dir() {
            for f in std::fs::read_dir(&dir).unwrap() {
                let f = f.unwrap().path();
                if f.extension().is_some_and(|e| e == "json") {
                    files.push(f);
                }
            }
        }
    }
    files.sort();
    files
}

/// `Subset/name.json`, a sample file's name in the tests' lists.
pub fn short_name(path: &Path) -> String {
    let dir = path
        .parent()
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy();
    format!("{dir}/{}", path.file_name().unwrap().to_string_lossy())
}
