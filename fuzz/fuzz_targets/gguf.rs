#![no_main]
//! `cargo +nightly fuzz run gguf`: see `nucleus_cli::fuzz::gguf`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| nucleus_cli::fuzz::gguf(data));
