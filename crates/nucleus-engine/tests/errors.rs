//! Bad files and bad requests are `EngineError`s, never panics, and a rejected request changes no
//! cache.

mod common;

use anyhow::Result;
use candle_core::quantized::gguf_file::Value;
use candle_core::Device;
use common::TempFile;
use nucleus_engine::{load_gguf, EngineError, LoadedModel, SeqInput};

fn expect_invalid_model(result: nucleus_engine::Result<LoadedModel>, what: &str) -> String {
    match result {
        Err(EngineError::InvalidModel { message, .. }) => message,
        Err(other) => panic!("{what}: expected InvalidModel, got {other:?}"),
        Ok(_) => panic!("{what}: loaded"),
    }
}

#[test]
fn truncated_files_are_invalid_models() -> Result<()> {
    let path = common::stories260k();
    let bytes = std::fs::read(&path)?;
    // Inside the magic, the header counts, the metadata (tokens), the tensor infos, the tensor
    // data, and one byte short of the end.
    for cut in [
        0,
        3,
        10,
        30,
        2_000,
        13_000,
        14_100,
        200_000,
        bytes.len() - 1,
    ] {
        let file = TempFile(common::temp_path(&format!("cut{cut}.gguf")));
        std::fs::write(&file.0, &bytes[..cut])?;
        expect_invalid_model(load_gguf(&file.0, &Device::Cpu), &format!("cut at {cut}"));
    }
    Ok(())
}

#[test]
fn zero_alignment_is_an_invalid_model_not_a_panic() -> Result<()> {
    let path = common::stories260k();
    // candle's parser divides by `general.alignment`.
    let file = TempFile(common::temp_path("align0.gguf"));
    common::rewrite_gguf(
        &path,
        &file.0,
        |md| common::set_metadata(md, "general.alignment", Value::U32(0)),
        |_, t| Ok(Some(t)),
    )?;
    let message = expect_invalid_model(load_gguf(&file.0, &Device::Cpu), "alignment 0");
    assert_eq!(
        message,
        "metadata `general.alignment` is 0; it must be a power of two, at least 8"
    );
    Ok(())
}

#[test]
fn model_paths_that_are_not_regular_files_are_named() -> Result<()> {
    use nucleus_engine::hub::resolve_model;
    use std::path::Path;
    let not_found = |p: &Path| match resolve_model(Some(p)) {
        Err(EngineError::ModelNotFound(m)) => m,
        other => panic!("{}: expected ModelNotFound, got {other:?}", p.display()),
    };
    // `/dev/zero` used to be reported as "does not exist".
    assert_eq!(
        not_found(Path::new("/dev/zero")),
        "/dev/zero: is not a regular file or directory (a character device); pass a GGUF file \
         or a Hugging Face model folder"
    );
    let fifo = TempFile(common::temp_path("model.fifo"));
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo.0)
        .status()?
        .success());
    assert_eq!(
        not_found(&fifo.0),
        format!(
            "{}: is not a regular file or directory (a FIFO); pass a GGUF file or a Hugging \
             Face model folder",
            fifo.0.display()
        )
    );
    // load_gguf refuses them too, without opening them (opening a FIFO blocks until a writer
    // comes; a device has no length).
    for (path, kind) in [
        (fifo.0.as_path(), "a FIFO"),
        (Path::new("/dev/zero"), "a character device"),
        (Path::new("/tmp"), "a directory"),
    ] {
        let message = expect_invalid_model(load_gguf(path, &Device::Cpu), kind);
        assert_eq!(message, format!("not a regular file ({kind})"));
    }
    // A directory is a Hugging Face model folder, for `load_model`.
    let dir = std::env::temp_dir();
    assert_eq!(resolve_model(Some(&dir))?, dir);
    let missing = common::temp_path("missing.gguf");
    assert_eq!(
        not_found(&missing),
        format!("{}: does not exist", missing.display())
    );
    Ok(())
}

#[test]
fn non_gguf_and_missing_files() -> Result<()> {
    let file = TempFile(common::temp_path("not-a-model.gguf"));
    std::fs::write(
        &file.0,
        b"this is a text file, not a GGUF model\n".repeat(10),
    )?;
    let message = expect_invalid_model(load_gguf(&file.0, &Device::Cpu), "text file");
    assert!(message.contains("GGUF"), "{message}");

    let missing = common::temp_path("does-not-exist.gguf");
    match load_gguf(&missing, &Device::Cpu) {
        Err(EngineError::Io { path, .. }) => assert_eq!(path, missing),
        other => panic!("expected Io, got {other:?}"),
    }
    Ok(())
}

#[test]
fn missing_tensor_wrong_shape_and_missing_key_are_named() -> Result<()> {
    let path = common::stories260k();
    let file = TempFile(common::temp_path("no-ffn-up.gguf"));
    common::rewrite_gguf(
        &path,
        &file.0,
        |_| {},
        |name, t| Ok((name != "blk.2.ffn_up.weight").then_some(t)),
    )?;
    let message = expect_invalid_model(load_gguf(&file.0, &Device::Cpu), "missing tensor");
    assert!(message.contains("blk.2.ffn_up.weight"), "{message}");

    // Metadata saying 16 heads (and kv heads) of 4: attn_k [32, 64] should then be [64, 64].
    let file = TempFile(common::temp_path("bad-shape.gguf"));
    common::rewrite_gguf(
        &path,
        &file.0,
        |md| {
            common::set_metadata(md, "llama.attention.head_count", Value::U32(16));
            common::set_metadata(md, "llama.attention.head_count_kv", Value::U32(16));
            common::set_metadata(md, "llama.rope.dimension_count", Value::U32(4));
        },
        |_, t| Ok(Some(t)),
    )?;
    let message = expect_invalid_model(load_gguf(&file.0, &Device::Cpu), "bad shape");
    assert!(message.contains("blk.0.attn_k.weight"), "{message}");

    let file = TempFile(common::temp_path("no-block-count.gguf"));
    common::rewrite_gguf(
        &path,
        &file.0,
        |md| md.retain(|(k, _)| k != "llama.block_count"),
        |_, t| Ok(Some(t)),
    )?;
    let message = expect_invalid_model(load_gguf(&file.0, &Device::Cpu), "missing key");
    assert!(message.contains("llama.block_count"), "{message}");

    let file = TempFile(common::temp_path("string-heads.gguf"));
    common::rewrite_gguf(
        &path,
        &file.0,
        |md| {
            common::set_metadata(
                md,
                "llama.attention.head_count",
                Value::String("eight".to_string()),
            )
        },
        |_, t| Ok(Some(t)),
    )?;
    let message = expect_invalid_model(load_gguf(&file.0, &Device::Cpu), "mistyped key");
    assert!(message.contains("llama.attention.head_count"), "{message}");
    Ok(())
}

#[test]
fn other_architectures_and_tokenizers_are_unsupported() -> Result<()> {
    let path = common::stories260k();
    let file = TempFile(common::temp_path("falcon.gguf"));
    common::rewrite_gguf(
        &path,
        &file.0,
        |md| {
            common::set_metadata(
                md,
                "general.architecture",
                Value::String("falcon".to_string()),
            )
        },
        |_, t| Ok(Some(t)),
    )?;
    assert!(matches!(
        load_gguf(&file.0, &Device::Cpu),
        Err(EngineError::Unsupported(m)) if m.contains("falcon")
    ));

    let file = TempFile(common::temp_path("bert-tok.gguf"));
    common::rewrite_gguf(
        &path,
        &file.0,
        |md| {
            common::set_metadata(
                md,
                "tokenizer.ggml.model",
                Value::String("bert".to_string()),
            )
        },
        |_, t| Ok(Some(t)),
    )?;
    assert!(matches!(
        load_gguf(&file.0, &Device::Cpu),
        Err(EngineError::Unsupported(m)) if m.contains("bert")
    ));
    Ok(())
}

#[test]
fn bad_requests_are_errors_and_change_no_cache() -> Result<()> {
    let path = common::stories260k();
    // The same model with a context length of 16.
    let file = TempFile(common::temp_path("ctx16.gguf"));
    common::rewrite_gguf(
        &path,
        &file.0,
        |md| common::set_metadata(md, "llama.context_length", Value::U32(16)),
        |_, t| Ok(Some(t)),
    )?;
    let model = load_gguf(&file.0, &Device::Cpu)?.model;
    let vocab = model.config().vocab_size as u32;
    let invalid = |r: nucleus_engine::Result<candle_core::Tensor>, what: &str| match r {
        Err(EngineError::InvalidRequest(m)) => m,
        other => panic!("{what}: expected InvalidRequest, got {other:?}"),
    };

    let mut cache = model.new_cache();
    invalid(
        model.forward(&mut [SeqInput {
            tokens: &[1, vocab],
            cache: &mut cache,
        }]),
        "token id = vocab",
    );
    invalid(
        model.forward(&mut [SeqInput {
            tokens: &[u32::MAX],
            cache: &mut cache,
        }]),
        "token id u32::MAX",
    );
    invalid(
        model.forward(&mut [SeqInput {
            tokens: &[],
            cache: &mut cache,
        }]),
        "no tokens",
    );
    invalid(model.forward(&mut []), "empty batch");
    invalid(
        model.forward(&mut [SeqInput {
            tokens: &[1; 17],
            cache: &mut cache,
        }]),
        "17 tokens in a context of 16",
    );
    assert!(cache.is_empty());

    model.forward(&mut [SeqInput {
        tokens: &[1; 10],
        cache: &mut cache,
    }])?;
    // One bad sequence rejects the whole batch before any cache changes.
    let mut other = model.new_cache();
    let message = invalid(
        model.forward(&mut [
            SeqInput {
                tokens: &[5],
                cache: &mut other,
            },
            SeqInput {
                tokens: &[1; 7],
                cache: &mut cache,
            },
        ]),
        "10 + 7 tokens in a context of 16",
    );
    assert!(message.contains("sequence 1"), "{message}");
    assert_eq!((other.len(), cache.len()), (0, 10));
    // Exactly filling the context is fine.
    model.forward(&mut [SeqInput {
        tokens: &[1; 6],
        cache: &mut cache,
    }])?;
    assert_eq!(cache.len(), 16);

    // A cache of another shape.
    let mut foreign =
        nucleus_engine::KvCache::new(2, 4, 8, 16, nucleus_engine::KvCacheDtype::F32, &Device::Cpu);
    invalid(
        model.forward(&mut [SeqInput {
            tokens: &[1],
            cache: &mut foreign,
        }]),
        "foreign cache",
    );
    Ok(())
}

/// A model path is user text: messages show it escaped (control bytes as `\u{1b}`, invalid
/// UTF-8 as `\xff`) and cut after 256 bytes, whichever message names it.
#[test]
fn model_paths_in_messages_are_escaped_and_cut() {
    use std::os::unix::ffi::OsStrExt;
    let hostile =
        std::path::PathBuf::from(std::ffi::OsStr::from_bytes(b"/tmp/bad\x1b[31m\x07\xffname"));
    let e = nucleus_engine::hub::resolve_model(Some(&hostile)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "no model available: /tmp/bad\\u{1b}[31m\\u{7}\\xffname: does not exist"
    );
    let long = std::path::PathBuf::from(format!(
        "/tmp/{}",
        format!("{}/", "d".repeat(49)).repeat(12)
    ));
    let e = nucleus_engine::hub::resolve_model(Some(&long))
        .unwrap_err()
        .to_string();
    assert!(e.len() < 256 + 60, "{} bytes: {e}", e.len());
    assert!(e.ends_with("…: does not exist"), "{e}");
    // A corrupt file under a hostile name.
    let dir = std::env::temp_dir().join(format!("nucleus-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(std::ffi::OsStr::from_bytes(b"m\x1b.gguf"));
    std::fs::write(&file, b"not gguf").unwrap();
    let e = load_gguf(&file, &Device::Cpu).unwrap_err().to_string();
    std::fs::remove_dir_all(&dir).ok();
    assert!(!e.chars().any(|c| c.is_control()), "{e:?}");
    assert!(e.contains("m\\u{1b}.gguf"), "{e}");
}
