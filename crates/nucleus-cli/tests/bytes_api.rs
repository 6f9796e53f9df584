//! The operator commands' inputs callable on bytes in memory (for fuzzing): the safetensors
//! functions and the per-line functions give what the commands print for the same input, and
//! arbitrary bytes are an error or an answer, never a panic.

mod common;

use common::{f32_bytes, i32_bytes, nucleus, temp_dir, text, write_tensors};
use nucleus_cli::{moe_init_routing, npu_sample, sample};
use safetensors::Dtype;

fn safetensors_bytes(tensors: &[common::TensorSpec<'_>]) -> Vec<u8> {
    let dir = temp_dir("bytes");
    let path = dir.join(format!("t{}.safetensors", tensors.len()));
    write_tensors(&path, tensors);
    std::fs::read(&path).unwrap()
}

/// The command's stdout for `args` plus a safetensors file holding `bytes`.
fn command_output(args: &[&str], flag: &str, bytes: &[u8], tail: &[&str]) -> String {
    let dir = temp_dir("bytes-cli");
    let path = dir.join(format!("{}.safetensors", args[0]));
    std::fs::write(&path, bytes).unwrap();
    let out = nucleus()
        .args(args)
        .arg(flag)
        .arg(&path)
        .args(tail)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
}

#[test]
fn the_safetensors_functions_on_bytes_print_what_the_commands_print() {
    let logits = safetensors_bytes(&[(
        "logits",
        Dtype::F32,
        vec![2, 3],
        f32_bytes(&[1.0, 3.0, 2.0, 0.5, 0.25, 4.0]),
    )]);
    let params = sample::tensor::params_from_bytes(br#"{"seed": 7, "logprobs": 2}"#).unwrap();
    let options = sample::Options { dist: true };
    let mut out = Vec::new();
    sample::answer_safetensors(&logits, Some(&params), &mut out, &options).unwrap();
    let dir = temp_dir("bytes-params");
    let params_path = dir.join("p.json");
    std::fs::write(&params_path, r#"{"seed": 7, "logprobs": 2}"#).unwrap();
    assert_eq!(
        text(&out),
        command_output(
            &["sample", "--dist"],
            "--logits",
            &logits,
            &["--params", params_path.to_str().unwrap()]
        )
    );

    let npu = safetensors_bytes(&[
        (
            "logits",
            Dtype::F32,
            vec![1, 4],
            f32_bytes(&[1.0, 3.0, 2.0, 3.0]),
        ),
        ("top_k", Dtype::I32, vec![1], i32_bytes(&[2])),
        ("top_p", Dtype::F32, vec![1], f32_bytes(&[1.0])),
    ]);
    let attrs = npu_sample::AttrsInput {
        is_need_logits: Some(true),
        ..Default::default()
    };
    let answer = npu_sample::answer_safetensors(&npu, &attrs).unwrap();
    assert_eq!(
        format!("{}\n", text(&npu_sample::line(&answer))),
        command_output(
            &["top-k-top-p-sample"],
            "--tensors",
            &npu,
            &["--attrs", r#"{"is_need_logits": true}"#]
        )
    );

    let moe = safetensors_bytes(&[
        (
            "x",
            Dtype::F32,
            vec![3, 2],
            f32_bytes(&[1.0, 10.0, 2.0, 20.0, 3.0, 30.0]),
        ),
        (
            "expert_idx",
            Dtype::I32,
            vec![3, 2],
            i32_bytes(&[2, 0, 1, 2, 0, 1]),
        ),
    ]);
    let attrs = moe_init_routing::AttrsInput {
        expert_num: 4,
        ..Default::default()
    };
    let answer = moe_init_routing::answer_safetensors(&moe, &attrs).unwrap();
    assert_eq!(
        format!("{}\n", text(&moe_init_routing::line(&answer))),
        command_output(
            &["moe-init-routing"],
            "--tensors",
            &moe,
            &["--attrs", r#"{"expert_num": 4}"#]
        )
    );
}

#[test]
fn the_per_line_functions_answer_any_bytes() {
    let options = sample::Options::default();
    let cases: [&[u8]; 6] = [
        b"",
        b"{",
        b"\xff\xfe",
        b"{\"logits\": [1, 2], \"x\": [[1]]}",
        b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
        b"{\"logits\": [\"nan\"], \"top_k\": [1], \"top_p\": [1], \"expert_idx\": [[0]], \"expert_num\": 1}",
    ];
    for bytes in cases {
        for line in [
            sample::answer_line(bytes, &options),
            npu_sample::answer_line(bytes),
            moe_init_routing::answer_line(bytes),
        ] {
            let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
            assert!(v.is_object(), "{v}");
        }
    }
    // Bytes that are not safetensors are an error, not a panic.
    for bytes in [
        &b""[..],
        b"\x08\0\0\0\0\0\0\0{",
        b"\xff\xff\xff\xff\xff\xff\xff\xff",
    ] {
        assert!(npu_sample::answer_safetensors(bytes, &Default::default()).is_err());
        assert!(moe_init_routing::answer_safetensors(bytes, &Default::default()).is_err());
        let mut out = Vec::new();
        assert!(sample::answer_safetensors(bytes, None, &mut out, &options).is_err());
        assert!(out.is_empty());
    }
}
