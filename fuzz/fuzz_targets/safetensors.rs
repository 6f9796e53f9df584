#![no_main]
//! `cargo +nightly fuzz run safetensors`: see `nucleus_cli::fuzz::safetensors`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| nucleus_cli::fuzz::safetensors(data));
