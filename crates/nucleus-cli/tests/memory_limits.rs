//! Requests within the input limits whose memory the machine cannot hold are an answer or one
//! `error:` line, never an abort ("memory allocation of N bytes failed", exit status 134):
//! a tensor copied out of a safetensors file, the outputs and working memory an operator
//! allocates inside, `generate`'s KV cache, `bench moe`'s buffers. Each case runs under an
//! address-space limit (`ulimit -v`) with the threads that count against it fixed, scaled
//! down so that it takes a fraction of a second.

mod common;

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::process::Output;

use common::{run_under_ulimit, temp_dir, text};
use serde_json::Value;

/// Writes a safetensors file of `tensors` (name, dtype, shape), each filled with zeros
/// without writing them (a sparse file), but for the `tail` bytes written at the very end.
fn sparse_tensors(path: &Path, tensors: &[(&str, &str, &[usize], usize)], tail: &[u8]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for &(name, dtype, shape, width) in tensors {
        let bytes = shape.iter().product::<usize>() * width;
        header.insert(
            name.into(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut json = Value::Object(header).to_string();
    while !json.len().is_multiple_of(8) {
        json.push(' ');
    }
    let mut file = std::fs::File::create(path).unwrap();
    file.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    file.write_all(json.as_bytes()).unwrap();
    let end = 8 + json.len() as u64 + offset as u64;
    file.set_len(end).unwrap();
    file.seek(SeekFrom::Start(end - tail.len() as u64)).unwrap();
    file.write_all(tail).unwrap();
}

/// Asserts one `error: ...` line holding `needle`, exit status 1 and no answer.
fn assert_one_error_line(out: &Output, needle: &str) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{:?}: {err}", out.status);
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains(needle), "{needle:?} not in {err}");
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
}

/// 200 MB of f32 in a file within the default 1 GiB limit, under a 350 MB address space:
/// the file's bytes are read, their copy cannot be had. Before, each command aborted with
/// "memory allocation of 200000000 bytes failed".
#[test]
fn a_tensor_copy_the_machine_cannot_hold_is_one_error_line() {
    let dir = temp_dir("copy");
    let v = 50_000_000;
    let sample = dir.join("sample.safetensors");
    sparse_tensors(&sample, &[("logits", "F32", &[1, v], 4)], &[]);
    let npu = dir.join("npu.safetensors");
    sparse_tensors(
        &npu,
        &[
            ("logits", "F32", &[1, v], 4),
            ("top_k", "I32", &[1], 4),
            ("top_p", "F32", &[1], 4),
        ],
        &[],
    );
    let moe = dir.join("moe.safetensors");
    sparse_tensors(
        &moe,
        &[("x", "F32", &[1, v], 4), ("expert_idx", "I32", &[1, 1], 4)],
        &[],
    );
    let runs: [(&[&str], &Path, &str); 3] = [
        (&["sample", "--logits"], &sample, "tensor `logits`"),
        (
            &["top-k-top-p-sample", "--tensors"],
            &npu,
            "tensor `logits`",
        ),
        (&["moe-init-routing", "--tensors"], &moe, "tensor `x`"),
    ];
    for (command, path, tensor) in runs {
        let mut args = command.to_vec();
        args.push(path.to_str().unwrap());
        if command[0] == "moe-init-routing" {
            args.extend_from_slice(&["--attrs", r#"{"expert_num": 1}"#]);
        }
        let out = run_under_ulimit(350_000, &args, None);
        assert_one_error_line(
            &out,
            &format!("cannot hold {tensor} in memory: {v} values of 4 bytes (200000000 bytes)"),
        );
    }
}
