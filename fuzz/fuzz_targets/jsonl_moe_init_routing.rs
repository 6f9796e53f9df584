#![no_main]
//! `cargo +nightly fuzz run jsonl_moe_init_routing`: see `nucleus_cli::fuzz::jsonl_moe_init_routing`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| nucleus_cli::fuzz::jsonl_moe_init_routing(data));
