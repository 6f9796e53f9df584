#![no_main]
//! `cargo +nightly fuzz run jsonl_top_k_top_p_sample`: see `nucleus_cli::fuzz::jsonl_top_k_top_p_sample`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| nucleus_cli::fuzz::jsonl_top_k_top_p_sample(data));
