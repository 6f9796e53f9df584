//! Quantizes a GGUF file with llama.cpp's `llama_model_quantize`, the function its
//! `llama-quantize` tool runs (llama.cpp's source as llama-cpp-sys-2 vendors it leaves the
//! tool itself out), with llama.cpp's default parameters but the file type:
//!
//! ```sh
//! cargo build --release -p nucleus-bench --features llama-cpp --example llama_quantize
//! ./target/release/examples/llama_quantize IN-f16.gguf OUT-q4_k_m.gguf q4_k_m [THREADS]
//! ```
//!
//! Types: `q4_k_m` (llama.cpp's `LLAMA_FTYPE_MOSTLY_Q4_K_M`, its mix of Q4_K and Q6_K),
//! `q4_0`, `q8_0`. THREADS: 0 (the default) lets llama.cpp take the hardware's threads.
//! scripts/make-random-llama.py runs it for `--types q4_k_m`.

use std::ffi::CString;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: llama_quantize IN.gguf OUT.gguf q4_k_m|q4_0|q8_0 [THREADS]";
    if !(4..=5).contains(&args.len()) {
        eprintln!("{usage}");
        return ExitCode::from(2);
    }
    let ftype = match args[3].as_str() {
        "q4_k_m" => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q4_K_M,
        "q4_0" => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q4_0,
        "q8_0" => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q8_0,
        other => {
            eprintln!("error: unknown type {other}; {usage}");
            return ExitCode::from(2);
        }
    };
    let threads = match args.get(4).map(|t| t.parse::<i32>()) {
        None => 0,
        Some(Ok(t)) if t >= 0 => t,
        Some(_) => {
            eprintln!("error: THREADS must be a whole number, 0 or more; {usage}");
            return ExitCode::from(2);
        }
    };
    let (Ok(input), Ok(output)) = (
        CString::new(args[1].as_str()),
        CString::new(args[2].as_str()),
    ) else {
        eprintln!("error: a path with a NUL byte");
        return ExitCode::from(2);
    };
    if !std::path::Path::new(&args[1]).is_file() {
        eprintln!("error: no file {}", args[1]);
        return ExitCode::FAILURE;
    }
    // SAFETY: llama.cpp's C API, called as its own tool calls it: the backend initialised
    // once, default parameters from llama.cpp, NUL-terminated paths that outlive the call.
    let status = unsafe {
        llama_cpp_sys_2::llama_backend_init();
        let mut params = llama_cpp_sys_2::llama_model_quantize_default_params();
        params.ftype = ftype;
        params.nthread = threads;
        let status =
            llama_cpp_sys_2::llama_model_quantize(input.as_ptr(), output.as_ptr(), &params);
        llama_cpp_sys_2::llama_backend_free();
        status
    };
    if status != 0 {
        eprintln!("error: llama_model_quantize failed (status {status})");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
