//! Replays every committed fuzzing input through the code its cargo-fuzz target runs
//! (`nucleus_cli::fuzz`), on the stable toolchain: the minimised corpus of each target
//! (`fuzz/corpus/<target>/`) and every crash the fuzzers found, minimised
//! (`fuzz/regressions/<target>/`, named after what broke). A regression of any of them fails
//! here without nightly or cargo-fuzz. README.md ("Fuzzing") says how the corpus was made.

use std::path::{Path, PathBuf};
use std::time::Instant;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// The files of `fuzz/corpus/<target>` and `fuzz/regressions/<target>`, sorted.
fn inputs(target: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in ["corpus", "regressions"] {
        let dir = fuzz_dir().join(dir).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("a corpus entry").path();
            if path.is_file() {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Runs `run` on every input of `target`; at least `min` of them must exist (the committed
/// corpus is not allowed to vanish unnoticed).
fn replay(target: &str, min: usize, run: impl Fn(&[u8])) {
    let files = inputs(target);
    assert!(
        files.len() >= min,
        "{target}: {} inputs in fuzz/corpus and fuzz/regressions, expected at least {min}",
        files.len()
    );
    let started = Instant::now();
    for path in &files {
        let data = std::fs::read(path).expect("read a corpus file");
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&data)));
        if result.is_err() {
            panic!(
                "{target}: {} broke an invariant (see above)",
                path.display()
            );
        }
    }
    println!(
        "{target}: {} inputs in {:.1} s",
        files.len(),
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn gguf_corpus() {
    replay("gguf", 20, nucleus_cli::fuzz::gguf);
}

#[test]
fn safetensors_corpus() {
    replay("safetensors", 20, nucleus_cli::fuzz::safetensors);
}

#[test]
fn jsonl_sample_corpus() {
    replay("jsonl_sample", 20, nucleus_cli::fuzz::jsonl_sample);
}

#[test]
fn jsonl_top_k_top_p_sample_corpus() {
    replay(
        "jsonl_top_k_top_p_sample",
        20,
        nucleus_cli::fuzz::jsonl_top_k_top_p_sample,
    );
}

#[test]
fn jsonl_speculative_verify_corpus() {
    replay(
        "jsonl_speculative_verify",
        20,
        nucleus_cli::fuzz::jsonl_speculative_verify,
    );
}

#[test]
fn jsonl_moe_init_routing_corpus() {
    replay(
        "jsonl_moe_init_routing",
        20,
        nucleus_cli::fuzz::jsonl_moe_init_routing,
    );
}

#[test]
fn grammar_corpus() {
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared");
    let fuzzer = nucleus_cli::fuzz::Grammar::new(&shared).expect("MiniMind's tokenizer");
    replay("grammar", 20, |data| fuzzer.run(data));
}
