//! Messages are one line, escaped and bounded wherever they come from: every `error:` line on
//! stderr has its control characters escaped and is cut after 1 KiB (an unknown key of
//! `--params` or `--attrs` wrote raw ESC and BEL, and a 100 KB key a 200 KB line), and every
//! error answer's message is cut at the same bound (JSON escapes control characters itself).

mod common;

use common::{
    f32_bytes, i32_bytes, nucleus, run_subcommand, shared, temp_dir, text, write_tensors,
};
use safetensors::Dtype;
use serde_json::Value;

/// The bound of a message, and what the cut adds (`...`).
const MAX: usize = 1024 + 3;

/// Asserts one `error: ...` line on stderr, escaped and bounded, that holds `needle`; returns it.
fn one_escaped_line(stderr: &[u8], needle: &str) -> String {
    let err = text(stderr);
    assert!(err.starts_with("error: "), "{err:?}");
    assert_eq!(err.lines().count(), 1, "{err:?}");
    let line = err.strip_suffix('\n').expect("a whole line");
    assert!(!line.chars().any(char::is_control), "raw control: {line:?}");
    assert!(line.len() <= "error: ".len() + MAX, "{} bytes", line.len());
    assert!(line.contains(needle), "{needle:?} not in {line:?}");
    line.to_string()
}

#[test]
fn control_characters_in_an_error_line_are_escaped_and_a_long_one_is_cut() {
    let dir = temp_dir("escaped");
    let logits = dir.join("ok.safetensors");
    write_tensors(
        &logits,
        &[("logits", Dtype::F32, vec![1, 2], f32_bytes(&[1.0, 2.0]))],
    );
    let npu = dir.join("npu.safetensors");
    write_tensors(
        &npu,
        &[
            ("logits", Dtype::F32, vec![1, 2], f32_bytes(&[1.0, 2.0])),
            ("top_k", Dtype::I32, vec![1], i32_bytes(&[1])),
            ("top_p", Dtype::F32, vec![1], f32_bytes(&[1.0])),
        ],
    );
    let moe = dir.join("moe.safetensors");
    write_tensors(
        &moe,
        &[
            ("x", Dtype::F32, vec![1, 1], f32_bytes(&[1.0])),
            ("expert_idx", Dtype::I32, vec![1, 1], i32_bytes(&[0])),
        ],
    );
    let escaped = r"\u{1b}[2J\u{7}";
    // JSON's escapes of ESC and BEL: the key itself holds the raw characters.
    let key = r#"{"\u001b[2J\u0007": 1}"#;
    let long = format!("{{\"{}\": 1}}", "k".repeat(100_000));
    let attrs_file = dir.join("attrs.json");
    let (logits, npu, moe) = (
        logits.to_str().unwrap(),
        npu.to_str().unwrap(),
        moe.to_str().unwrap(),
    );
    for (object, needle) in [(key, escaped), (long.as_str(), "kkkk")] {
        std::fs::write(dir.join("p.json"), object).unwrap();
        std::fs::write(&attrs_file, object).unwrap();
        let params = dir.join("p.json");
        let attrs = attrs_file.to_str().unwrap();
        let runs: [&[&str]; 5] = [
            &[
                "sample",
                "--logits",
                logits,
                "--params",
                params.to_str().unwrap(),
            ],
            &["top-k-top-p-sample", "--tensors", npu, "--attrs", object],
            &["top-k-top-p-sample", "--tensors", npu, "--attrs", attrs],
            &["moe-init-routing", "--tensors", moe, "--attrs", object],
            &["moe-init-routing", "--tensors", moe, "--attrs", attrs],
        ];
        for args in runs {
            let out = nucleus().args(args).output().unwrap();
            assert!(matches!(out.status.code(), Some(1 | 2)), "{:?}", out.status);
            one_escaped_line(&out.stderr, needle);
        }
    }
}

#[test]
fn a_control_character_in_a_tokenizer_s_vocabulary_is_escaped() {
    let dir = temp_dir("tokenizer");
    let mut tokenizer: Value = serde_json::from_str(
        &std::fs::read_to_string(shared("models/minimind-tokenizer/tokenizer.json")).unwrap(),
    )
    .unwrap();
    let vocab = tokenizer["model"]["vocab"].as_object_mut().unwrap();
    let id = vocab.len();
    vocab.insert("\u{1b}[31m".into(), id.into());
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let text_file = dir.join("t.txt");
    std::fs::write(&text_file, "yes").unwrap();
    let out = nucleus()
        .args(["grammar", "validate", "--regex", "yes", "--text"])
        .arg(&text_file)
        .arg("--tokenizer")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // Before: "missing char: <raw ESC> decoding ...".
    one_escaped_line(&out.stderr, r"\u{1b}[31m");
}

/// The error answer of one line given to `command`.
fn error_answer(command: &str, line: &str) -> (String, String) {
    let out = run_subcommand(command, &[], &format!("{line}\n"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        answer["error"]["kind"].as_str().unwrap().to_string(),
        answer["error"]["message"].as_str().unwrap().to_string(),
    )
}

#[test]
fn an_error_answer_s_message_is_cut_at_the_bound() {
    let k = "k".repeat(100_000);
    let cases = [
        // Before: 200 KB (the field is quoted twice).
        ("sample", format!(r#"{{"logits": [1], "{k}": 1}}"#)),
        (
            "sample",
            format!(r#"{{"logits": [1], "params": {{"logprobs_kind": "{k}"}}}}"#),
        ),
        ("sample", format!(r#"{{"logits": ["{k}"]}}"#)),
        (
            "top-k-top-p-sample",
            format!(r#"{{"logits": [[1]], "top_k": [1], "top_p": [1], "{k}": 1}}"#),
        ),
        (
            "moe-init-routing",
            format!(r#"{{"x": [[1]], "expert_idx": [[0]], "expert_num": 1, "x_dtype": "{k}"}}"#),
        ),
        (
            "moe-init-routing",
            format!(r#"{{"x": [[1]], "expert_idx": [[0]], "expert_num": 1, "{k}": 1}}"#),
        ),
    ];
    for (command, line) in cases {
        let (kind, message) = error_answer(command, &line);
        assert!(
            kind == "invalid_row" || kind == "invalid_call",
            "{command}: {kind}"
        );
        assert_eq!(message.len(), MAX, "{command}: {message:.80}");
        assert!(message.ends_with("k..."), "{command}: {message:.80}");
    }
}
