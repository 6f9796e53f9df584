#![no_main]
//! `cargo +nightly fuzz run jsonl_speculative_verify`: see
//! `nucleus_cli::fuzz::jsonl_speculative_verify`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| nucleus_cli::fuzz::jsonl_speculative_verify(data));
