#![no_main]
//! `cargo +nightly fuzz run jsonl_sample`: see `nucleus_cli::fuzz::jsonl_sample`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| nucleus_cli::fuzz::jsonl_sample(data));
