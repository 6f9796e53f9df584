#![no_main]
//! `cargo +nightly fuzz run grammar`: see `nucleus_cli::fuzz::Grammar`. The tokenizer is
//! MiniMind's, read from the shared folder beside the repository (never copied into it).

use std::sync::OnceLock;

static GRAMMAR: OnceLock<nucleus_cli::fuzz::Grammar> = OnceLock::new();

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let fuzzer = GRAMMAR.get_or_init(|| {
        let shared = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared");
        nucleus_cli::fuzz::Grammar::new(&shared).expect("the MiniMind tokenizer in ../shared")
    });
    fuzzer.run(data);
});
