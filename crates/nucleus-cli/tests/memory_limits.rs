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

use common::{run_under_ulimit, shared, temp_dir, text};
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

/// The answers of a run that succeeded.
fn answers(out: &Output) -> Vec<Value> {
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        text(&out.stderr)
    );
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:.200}")))
        .collect()
}

/// Asserts an `allocation` error answer whose message holds `needle`.
fn assert_allocation(answer: &Value, needle: &str) {
    assert_eq!(answer["error"]["kind"], "allocation", "{answer:.300}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "{needle:?} not in {message}");
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

/// A JSON line of 10 million logits (20 MB) whose sampling the machine cannot hold under a
/// 300 MB address space is answered with kind `allocation`, and the next line still is:
/// `--dist`'s f64 per entry, and the fused operator's `[B, V]` output and candidate list
/// (top-p over equal logits keeps them all). Before, both aborted ("memory allocation of
/// 80000008 bytes failed" in `distribution_kind`; 100663296 bytes growing the candidates).
#[test]
fn a_line_whose_outputs_the_machine_cannot_hold_is_an_allocation_answer() {
    let dir = temp_dir("outputs");
    let ones = {
        let mut s = String::with_capacity(20_000_000);
        s.push('1');
        for _ in 1..10_000_000 {
            s.push_str(",1");
        }
        s
    };
    let sample = dir.join("sample.jsonl");
    std::fs::write(
        &sample,
        format!("{{\"logits\": [{ones}]}}\n{{\"logits\": [1, 3, 2], \"params\": {{\"temperature\": 0}}}}\n"),
    )
    .unwrap();
    let npu = dir.join("npu.jsonl");
    std::fs::write(
        &npu,
        format!(
            "{{\"logits\": [[{ones}]], \"top_k\": [0], \"top_p\": [0.5], \"is_need_logits\": true}}\n{{\"logits\": [[1, 3]], \"top_k\": [1], \"top_p\": [1]}}\n"
        ),
    )
    .unwrap();
    // Speculative verification: the target's f64 distribution and residual per entry.
    let verify = dir.join("verify.jsonl");
    std::fs::write(
        &verify,
        format!(
            "{{\"draft_token_ids\": [], \"target_logits\": [[{ones}]]}}\n{{\"draft_token_ids\": [1], \"target_logits\": [[1, 3], [3, 1]], \"params\": {{\"temperature\": 0}}}}\n"
        ),
    )
    .unwrap();
    drop(ones);
    let got = answers(&run_under_ulimit(
        300_000,
        &["sample", "--dist"],
        Some(&sample),
    ));
    assert_eq!(got.len(), 2);
    assert_allocation(&got[0], "sampling the row");
    assert_eq!(got[1]["tokens"], serde_json::json!([1]));
    let got = answers(&run_under_ulimit(
        300_000,
        &["top-k-top-p-sample"],
        Some(&npu),
    ));
    assert_eq!(got.len(), 2);
    assert_allocation(&got[0], "the call on [1, 10000000]");
    assert_eq!(got[1]["logits_select_idx"], serde_json::json!([1]));
    let got = answers(&run_under_ulimit(
        300_000,
        &["speculative-verify"],
        Some(&verify),
    ));
    assert_eq!(got.len(), 2);
    assert_allocation(&got[0], "verifying the draft");
    assert_eq!(got[1]["tokens"], serde_json::json!([1, 0]));
}

/// The same checks on the safetensors paths: a `[1, 10,000,000]` tensor (40 MB) under a
/// 200 MB address space. Before: "memory allocation of 80000000 bytes failed" (the dist) and
/// "... 25165824 bytes failed" (the candidates).
#[test]
fn a_tensor_whose_outputs_the_machine_cannot_hold_is_an_allocation_answer() {
    let dir = temp_dir("tensor-outputs");
    let v = 10_000_000;
    let sample = dir.join("sample.safetensors");
    sparse_tensors(&sample, &[("logits", "F32", &[1, v], 4)], &[]);
    let npu = dir.join("npu.safetensors");
    // top_k 0 (off) and top_p 0.5 at the end of the file; the logits are zeros.
    let mut tail = 0i32.to_le_bytes().to_vec();
    tail.extend_from_slice(&0.5f32.to_le_bytes());
    sparse_tensors(
        &npu,
        &[
            ("logits", "F32", &[1, v], 4),
            ("top_k", "I32", &[1], 4),
            ("top_p", "F32", &[1], 4),
        ],
        &tail,
    );
    let got = answers(&run_under_ulimit(
        200_000,
        &["sample", "--dist", "--logits", sample.to_str().unwrap()],
        None,
    ));
    assert_eq!(got.len(), 1);
    assert_allocation(&got[0], "the --dist of 1 row(s) of 10000000");
    let got = answers(&run_under_ulimit(
        200_000,
        &[
            "top-k-top-p-sample",
            "--tensors",
            npu.to_str().unwrap(),
            "--attrs",
            r#"{"is_need_logits": true}"#,
        ],
        None,
    ));
    assert_eq!(got.len(), 1);
    assert_allocation(&got[0], "the call on [1, 10000000]");
}

/// Eight prompts x `--n 1024` x 2,000 tokens need a 20 GiB KV cache with stories260K: refused
/// at once with the numbers, where the run went on for 38 s under a 600 MB address space
/// before aborting ("memory allocation of 4096 bytes failed"). A run that fits still runs.
#[test]
fn generate_refuses_a_kv_cache_the_machine_cannot_hold_before_any_work() {
    let model = shared("models/stories260K.gguf");
    let mut args = vec!["generate", "--model", &model];
    for prompt in ["x1", "x2", "x3", "x4", "x5", "x6", "x7", "x8"] {
        args.extend_from_slice(&["--prompt", prompt]);
    }
    args.extend_from_slice(&["--n", "1024", "--max-tokens", "2000", "--seed", "1"]);
    let started = std::time::Instant::now();
    let out = run_under_ulimit(600_000, &args, None);
    assert_one_error_line(
        &out,
        "the KV cache of this run needs 10738728960 bytes (10.0 GiB), which cannot be allocated here: 8192 sequences (8 prompt(s) x --n 1024), each of up to 2048 positions",
    );
    assert!(
        text(&out.stderr).contains("x 2 bytes, --kv-cache-dtype f16)"),
        "{}",
        text(&out.stderr)
    );
    // An f32 cache takes twice the bytes.
    args.extend_from_slice(&["--kv-cache-dtype", "f32"]);
    let out = run_under_ulimit(600_000, &args, None);
    assert_one_error_line(
        &out,
        "the KV cache of this run needs 21477457920 bytes (20.0 GiB), which cannot be allocated here",
    );
    assert!(
        text(&out.stderr).contains("x 4 bytes, --kv-cache-dtype f32)"),
        "{}",
        text(&out.stderr)
    );
    assert!(started.elapsed().as_secs() < 10, "{:?}", started.elapsed());
    let out = run_under_ulimit(
        600_000,
        &[
            "generate",
            "--model",
            &model,
            "--prompt",
            "x",
            "--n",
            "4",
            "--max-tokens",
            "8",
            "--seed",
            "1",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// `bench moe` checks every buffer of its largest shape before the table's first line, on
/// the pool's thread (whose malloc arena counts too): under a limit it either refuses at once
/// (no table) or completes. Before, N 2,048 x H 1,024 under 200 MB passed the check, printed
/// the header and failed with `error: N 2048, H 1024: N 2048, H 1024, K 8 need ...` (the
/// shape twice); the reference's `expanded_x` also grew past its length (606 MB took 1 GB).
#[test]
fn bench_moe_refuses_before_the_table_or_completes() {
    let args = [
        "bench", "moe", "--rows", "2048", "--hidden", "1024", "--iters", "1",
    ];
    let out = run_under_ulimit(200_000, &args, None);
    assert_one_error_line(
        &out,
        "the largest shape, N 2048 x H 1024 x K 8, and its outputs need",
    );
    let out = run_under_ulimit(300_000, &args, None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert_eq!(
        table
            .lines()
            .filter(|l| l.starts_with("| 2048 | 1024 |"))
            .count(),
        4,
        "{table}"
    );
}

/// A Hugging Face folder whose f32 weights the machine cannot hold: a bf16 embedding of
/// 4,194,304 × 64 (a 512 MiB sparse file, mapped, not read) needs 1 GiB in f32. Under a
/// ~977 MiB address space the load is refused before any tensor is converted (the allocation
/// inside candle used to abort the process with exit 134).
#[test]
fn a_model_folder_whose_weights_the_machine_cannot_hold_is_one_error_line() {
    let dir = temp_dir("hf-oom");
    std::fs::create_dir_all(&dir).unwrap();
    let config = serde_json::json!({
        "model_type": "llama", "vocab_size": 4_194_304, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    sparse_tensors(
        &dir.join("model.safetensors"),
        &[("model.embed_tokens.weight", "BF16", &[4_194_304, 64], 2)],
        &[],
    );
    let model = dir.to_str().unwrap();
    let out = run_under_ulimit(
        1_000_000,
        &[
            "generate",
            "--model",
            model,
            "--prompt",
            "x",
            "--threads",
            "2",
        ],
        None,
    );
    assert_one_error_line(&out, "cannot hold the weights of");
    assert!(
        text(&out.stderr).contains("(536870912 bytes)"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// An MoE model's routing buffers for the largest forward are part of `generate`'s up-front
/// check: a qwen3_moe folder of 10,240 experts with all 10,240 per token (zeros, a sparse
/// file) needs ~8 MB of routing per row, so `--n 1024` (1,024 decode rows in one forward)
/// needs ~8.4 GB and is refused with the numbers, where it used to abort ("memory allocation
/// of 41943040 bytes failed", exit 134); `--n 2` runs.
#[test]
fn generate_refuses_moe_routing_the_machine_cannot_hold() {
    let dir = temp_dir("moe-oom");
    std::fs::create_dir_all(&dir).unwrap();
    let config = serde_json::json!({
        "model_type": "qwen3_moe", "vocab_size": 6400, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "num_experts": 10240,
        "num_experts_per_tok": 10240, "moe_intermediate_size": 1, "norm_topk_prob": true
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let p = "model.layers.0";
    let names: Vec<(String, &[usize])> = vec![
        ("model.embed_tokens.weight".into(), &[6400, 64]),
        ("model.norm.weight".into(), &[64]),
        (format!("{p}.input_layernorm.weight"), &[64]),
        (format!("{p}.post_attention_layernorm.weight"), &[64]),
        (format!("{p}.self_attn.q_proj.weight"), &[64, 64]),
        (format!("{p}.self_attn.k_proj.weight"), &[32, 64]),
        (format!("{p}.self_attn.v_proj.weight"), &[32, 64]),
        (format!("{p}.self_attn.o_proj.weight"), &[64, 64]),
        (format!("{p}.self_attn.q_norm.weight"), &[16]),
        (format!("{p}.self_attn.k_norm.weight"), &[16]),
        (format!("{p}.mlp.gate.weight"), &[10240, 64]),
        (format!("{p}.mlp.experts.gate_up_proj"), &[10240, 2, 64]),
        (format!("{p}.mlp.experts.down_proj"), &[10240, 64, 1]),
    ];
    let tensors: Vec<(&str, &str, &[usize], usize)> = names
        .iter()
        .map(|(n, s)| (n.as_str(), "F32", *s, 4))
        .collect();
    sparse_tensors(&dir.join("model.safetensors"), &tensors, &[]);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(
            shared(&format!("models/minimind-tokenizer/{f}")),
            dir.join(f),
        )
        .unwrap();
    }
    let model = dir.to_str().unwrap();
    let args = |n: &'static str| {
        vec![
            "generate",
            "--model",
            model,
            "--prompt",
            "x",
            "--n",
            n,
            "--max-tokens",
            "2",
            "--seed",
            "1",
        ]
    };
    let out = run_under_ulimit(2_000_000, &args("1024"), None);
    assert_one_error_line(
        &out,
        "its largest forward (1024 rows) also needs 8431337472 bytes (7.9 GiB) for an MoE \
         layer's routing (10240 experts per token, 10240 experts)",
    );
    let out = run_under_ulimit(2_000_000, &args("2"), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}
