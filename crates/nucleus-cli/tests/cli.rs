//! `nucleus generate` as a user runs it: output format, exit codes, errors without panics.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The shared stories260K model, else the default model through the hub cache.
fn model_path() -> PathBuf {
    let shared =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K.gguf");
    if shared.is_file() {
        return shared;
    }
    nucleus_engine::hub::resolve_model(None)
        .unwrap_or_else(|e| panic!("test model {} not found, and {e}", shared.display()))
}

fn nucleus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env_remove("NUCLEUS_MODEL")
        // No hub cache, no network: the hub fallback must fail cleanly.
        .env(
            "HF_HOME",
            std::env::temp_dir().join("nucleus-cli-test-no-hub"),
        )
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run nucleus")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn assert_clean_failure(out: &Output) {
    assert!(!out.status.success(), "expected failure");
    let err = text(&out.stderr);
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(!err.contains("stack backtrace"), "backtrace: {err}");
    assert!(!err.contains("internal error"), "internal error: {err}");
}

#[test]
fn greedy_generate_prints_the_story_and_stats() {
    let model = model_path();
    let out = nucleus(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--temperature",
        "0",
        "--max-tokens",
        "40",
        "--echo",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("Once upon a time, there was a little girl named Lily."),
        "{stdout:?}"
    );
    let stderr = text(&out.stderr);
    assert!(stderr.contains("prefill: 5 tokens"), "{stderr}");
    assert!(stderr.contains("decode: "), "{stderr}");
    assert!(
        stderr.contains("finish reason length, 40 tokens"),
        "{stderr}"
    );
}

#[test]
fn several_prompts_print_whole_completions_under_headers() {
    let model = model_path();
    let args = [
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "",
        "--prompt",
        "Tom had a dog",
        "--n",
        "2",
        "--seed",
        "42",
        "--max-tokens",
        "20",
    ];
    let out = nucleus(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for header in [
        "--- request 0 sample 0 ---",
        "--- request 0 sample 1 ---",
        "--- request 1 sample 0 ---",
        "--- request 1 sample 1 ---",
    ] {
        assert_eq!(stdout.matches(header).count(), 1, "{header} in {stdout}");
    }
    let stderr = text(&out.stderr);
    assert_eq!(stderr.matches("finish reason").count(), 4, "{stderr}");
    // Same seed, same prompts: the same output again.
    let again = nucleus(&args);
    assert_eq!(text(&again.stdout), stdout);
}

#[test]
fn bad_flags_fail_with_usage() {
    let out = nucleus(&["generate", "--prompt", "x", "--top-p", "banana"]);
    assert_clean_failure(&out);
    assert_eq!(out.status.code(), Some(2));
    let out = nucleus(&["generate"]);
    assert_clean_failure(&out);
    let out = nucleus(&["frobnicate"]);
    assert_clean_failure(&out);
}

#[test]
fn out_of_range_parameters_are_named() {
    let model = model_path();
    let out = nucleus(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "x",
        "--top-p",
        "1.5",
    ]);
    assert_clean_failure(&out);
    assert!(text(&out.stderr).contains("top_p"), "{}", text(&out.stderr));
}

#[test]
fn missing_model_names_the_flag() {
    let out = nucleus(&[
        "generate",
        "--prompt",
        "x",
        "--model",
        "/nonexistent/m.gguf",
    ]);
    assert_clean_failure(&out);
    assert!(text(&out.stderr).contains("/nonexistent/m.gguf"));
    // No --model, no NUCLEUS_MODEL, no hub: the error says to pass --model.
    let out = nucleus(&["generate", "--prompt", "x"]);
    assert_clean_failure(&out);
    assert!(
        text(&out.stderr).contains("--model"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn corrupt_model_is_a_short_error() {
    let dir = std::env::temp_dir().join(format!("nucleus-cli-corrupt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bytes = std::fs::read(model_path()).unwrap();
    let cases: [(&str, &[u8]); 3] = [
        ("truncated.gguf", &bytes[..bytes.len() / 3]),
        ("header-only.gguf", &bytes[..64]),
        ("text.gguf", b"this is not a gguf file"),
    ];
    for (name, data) in cases {
        let path = dir.join(name);
        std::fs::write(&path, data).unwrap();
        let out = nucleus(&[
            "generate",
            "--prompt",
            "x",
            "--model",
            path.to_str().unwrap(),
        ]);
        assert_clean_failure(&out);
        assert!(
            text(&out.stderr).starts_with("error:"),
            "{name}: {}",
            text(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A copy of the model whose final norm is NaN: every logits row is NaN.
fn nan_model(dst: &std::path::Path) {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    let mut reader = std::io::BufReader::new(std::fs::File::open(model_path()).unwrap());
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let mut tensors = Vec::new();
    for name in content.tensor_infos.keys() {
        let mut t = content.tensor(&mut reader, name, &Device::Cpu).unwrap();
        if name == "output_norm.weight" {
            let n = t.shape().elem_count();
            let nan = Tensor::from_vec(vec![f32::NAN; n], n, &Device::Cpu).unwrap();
            t = QTensor::quantize(&nan, GgmlDType::F32).unwrap();
        }
        tensors.push((name.clone(), t));
    }
    let md: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(dst).unwrap();
    gguf_file::write(&mut out, &md, &ts).unwrap();
}

#[test]
fn failed_completions_are_reported_and_exit_nonzero() {
    let path = std::env::temp_dir().join(format!("nucleus-cli-nan-{}.gguf", std::process::id()));
    nan_model(&path);
    let out = nucleus(&[
        "generate",
        "--prompt",
        "Once",
        "--model",
        path.to_str().unwrap(),
    ]);
    std::fs::remove_file(&path).ok();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("request 0 sample 0: finish reason error: non-finite logit NaN"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn corrupt_model_error_is_one_line_even_with_rust_backtrace() {
    let path = std::env::temp_dir().join(format!("nucleus-cli-text-{}.gguf", std::process::id()));
    std::fs::write(&path, b"GGUF but not really a model file at all").unwrap();
    let out = nucleus(&[
        "generate",
        "--prompt",
        "x",
        "--model",
        path.to_str().unwrap(),
    ]);
    std::fs::remove_file(&path).ok();
    assert_clean_failure(&out);
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn negative_numbers_get_range_errors_and_seeds_are_reported() {
    let model = model_path();
    let model = model.to_str().unwrap();
    let out = nucleus(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "x",
        "--temperature",
        "-1",
    ]);
    assert_clean_failure(&out);
    assert!(
        text(&out.stderr).contains("temperature"),
        "{}",
        text(&out.stderr)
    );
    let out = nucleus(&[
        "generate", "--model", model, "--prompt", "x", "--n", "100000",
    ]);
    assert_clean_failure(&out);
    assert!(
        text(&out.stderr).contains("n must be in 1..=1024"),
        "{}",
        text(&out.stderr)
    );
    // Without --seed the drawn seed is printed, and passing it back reproduces the text.
    let args = [
        "generate",
        "--model",
        model,
        "--prompt",
        "Tom",
        "--max-tokens",
        "20",
    ];
    let first = nucleus(&args);
    assert!(first.status.success());
    let err = text(&first.stderr);
    let seed = err
        .lines()
        .find_map(|l| l.strip_prefix("request 0: seed "))
        .unwrap_or_else(|| panic!("no seed line in {err}"))
        .to_string();
    let again = nucleus(&[&args[..], &["--seed", &seed]].concat());
    assert_eq!(text(&again.stdout), text(&first.stdout));
}

/// Runs `nucleus` like [`nucleus`] but with `NUCLEUS_MODEL` set to `model`.
fn nucleus_with_model_env(args: &[&str], model: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args(args)
        .env("NUCLEUS_MODEL", model)
        .env(
            "HF_HOME",
            std::env::temp_dir().join("nucleus-cli-test-no-hub"),
        )
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run nucleus")
}

#[test]
fn model_paths_from_the_environment_and_special_files_are_named() {
    // A path from NUCLEUS_MODEL says so (it used to read like a --model path).
    let missing =
        std::env::temp_dir().join(format!("nucleus-cli-missing-{}.gguf", std::process::id()));
    let out = nucleus_with_model_env(&["generate", "--prompt", "x"], &missing);
    assert_clean_failure(&out);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        format!(
            "error: no model available: NUCLEUS_MODEL={}: does not exist\n",
            missing.display()
        )
    );
    // /dev/zero is not a file that does not exist, nor a model to read forever.
    let out = nucleus_with_model_env(
        &["generate", "--prompt", "x"],
        std::path::Path::new("/dev/zero"),
    );
    assert_clean_failure(&out);
    assert_eq!(
        text(&out.stderr),
        "error: no model available: NUCLEUS_MODEL=/dev/zero: is not a regular file or \
         directory (a character device); pass a GGUF file or a Hugging Face model folder\n"
    );
    let out = nucleus(&["generate", "--prompt", "x", "--model", "/dev/zero"]);
    assert_clean_failure(&out);
    assert_eq!(
        text(&out.stderr),
        "error: no model available: /dev/zero: is not a regular file or directory (a \
         character device); pass a GGUF file or a Hugging Face model folder\n"
    );
}

/// A copy of the model whose `tokenizer.ggml.padding_token_id` lies outside the vocabulary.
fn bad_padding_model(dst: &std::path::Path) {
    use candle_core::quantized::{gguf_file, QTensor};
    use candle_core::Device;
    let mut reader = std::io::BufReader::new(std::fs::File::open(model_path()).unwrap());
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort_by_key(|n| content.tensor_infos[*n].offset);
    let tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|n| {
            (
                n.clone(),
                content.tensor(&mut reader, n, &Device::Cpu).unwrap(),
            )
        })
        .collect();
    let padding = gguf_file::Value::U32(99_999);
    let key = "tokenizer.ggml.padding_token_id";
    let mut md: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .filter(|(k, _)| k.as_str() != key)
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    md.push((key, &padding));
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(dst).unwrap();
    gguf_file::write(&mut out, &md, &ts).unwrap();
}

#[test]
fn warnings_about_the_model_go_to_stderr_and_the_run_goes_on() {
    let path = std::env::temp_dir().join(format!("nucleus-cli-pad-{}.gguf", std::process::id()));
    bad_padding_model(&path);
    let args = |model: &str| {
        [
            "generate",
            "--model",
            model,
            "--prompt",
            "Once upon a time",
            "--temperature",
            "0",
            "--max-tokens",
            "20",
        ]
        .map(String::from)
    };
    let run = |model: &str| {
        let a = args(model);
        nucleus(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let bad = run(path.to_str().unwrap());
    let good = run(model_path().to_str().unwrap());
    // grammar validate loads the model the same way.
    let text_file = path.with_extension("txt");
    std::fs::write(&text_file, "yes").unwrap();
    let validate = nucleus(&[
        "grammar",
        "validate",
        "--regex",
        "yes",
        "--text",
        text_file.to_str().unwrap(),
        "--model",
        path.to_str().unwrap(),
    ]);
    std::fs::remove_file(&path).ok();
    std::fs::remove_file(&text_file).ok();
    let warning = "warning: bad special token: metadata `tokenizer.ggml.padding_token_id` is \
                   99999, outside the vocabulary of 512 tokens; ignored, as llama.cpp does";
    for (what, out) in [("generate", &bad), ("grammar validate", &validate)] {
        assert!(out.status.success(), "{what}: {}", text(&out.stderr));
        let err = text(&out.stderr);
        let warnings: Vec<&str> = err.lines().filter(|l| l.starts_with("warning:")).collect();
        assert_eq!(warnings, [warning], "{what}: {err}");
    }
    assert!(!text(&good.stderr).contains("warning:"));
    assert_eq!(text(&bad.stdout), text(&good.stdout));
}
