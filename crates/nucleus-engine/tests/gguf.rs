//! Corrupt GGUF files are refused, never run: our parser (`nucleus_engine::gguf::read_content`)
//! against candle's on the real stories260K, then one test per check, each writing a small
//! corruption of stories260K and asserting the error names the field and the value. Messages are
//! short and carry no raw control characters, whatever the file holds.

mod common;

use std::io::Cursor;
use std::path::Path;

use anyhow::Result;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::Device;
use common::raw::{Md, RawGguf, RawTensor};
use common::TempFile;
use nucleus_engine::error::MAX_MESSAGE_BYTES;
use nucleus_engine::gguf::read_content;
use nucleus_engine::{load_gguf, EngineError, LoadedModel, SeqInput};

const BOS: &str = "tokenizer.ggml.bos_token_id";
const EOS: &str = "tokenizer.ggml.eos_token_id";

fn stories() -> RawGguf {
    RawGguf::from_file(&common::stories260k()).expect("stories260K reads")
}

/// A message fit for a terminal: short, no raw control or format characters.
fn assert_clean(message: &str) {
    assert!(
        message.len() <= MAX_MESSAGE_BYTES,
        "{} bytes: {}",
        message.len(),
        message.chars().take(200).collect::<String>()
    );
    assert!(
        !message.chars().any(|c| c.is_control() || c == '\u{202e}'),
        "raw control character in {message:?}"
    );
}

/// Writes `raw` and loads it.
fn load(raw: &RawGguf) -> (TempFile, nucleus_engine::Result<LoadedModel>) {
    let file = TempFile(common::temp_path("corrupt.gguf"));
    raw.write(&file.0).expect("write the test file");
    let result = load_gguf(&file.0, &Device::Cpu);
    (file, result)
}

/// The `InvalidModel` message of loading `raw`, checked to name the file and to be clean.
fn refused(raw: &RawGguf) -> String {
    match load(raw) {
        (file, Err(EngineError::InvalidModel { path, message })) => {
            assert_eq!(path, file.0);
            assert_clean(&message);
            message
        }
        (_, Err(other)) => panic!("expected InvalidModel, got {other:?}"),
        (_, Ok(_)) => panic!("loaded"),
    }
}

/// Asserts `message` contains `part`.
fn has(message: &str, part: &str) {
    assert!(message.contains(part), "{part:?} not in {message:?}");
}

/// The model's logits after the tokens of "Once upon a".
fn logits(loaded: &LoadedModel) -> Vec<f32> {
    let mut cache = loaded.model.new_cache();
    let out = loaded
        .model
        .forward(&mut [SeqInput {
            tokens: &[1, 403, 407, 261],
            cache: &mut cache,
        }])
        .unwrap();
    out.squeeze(0).unwrap().to_vec1().unwrap()
}

#[test]
fn parser_agrees_with_candle_on_stories260k() -> Result<()> {
    let path = common::stories260k();
    let mut reader = std::io::BufReader::new(std::fs::File::open(&path)?);
    let ours = read_content(&mut reader, &path)?;
    let mut reader = std::io::BufReader::new(std::fs::File::open(&path)?);
    let theirs = gguf_file::Content::read(&mut reader)?;

    assert_eq!(format!("{:?}", ours.magic), format!("{:?}", theirs.magic));
    assert_eq!(ours.tensor_data_offset, theirs.tensor_data_offset);
    let sorted = |c: &gguf_file::Content| {
        let mut md: Vec<String> = c
            .metadata
            .iter()
            .map(|(k, v)| format!("{k} = {v:?}"))
            .collect();
        md.sort();
        md
    };
    assert_eq!(ours.metadata.len(), 19);
    assert_eq!(sorted(&ours), sorted(&theirs));
    assert_eq!(ours.tensor_infos.len(), 48);
    assert_eq!(ours.tensor_infos.len(), theirs.tensor_infos.len());
    for (name, t) in &theirs.tensor_infos {
        let o = &ours.tensor_infos[name];
        assert_eq!(
            (o.ggml_dtype, o.shape.dims(), o.offset),
            (t.ggml_dtype, t.shape.dims(), t.offset),
            "{name}"
        );
    }
    // And candle reads the same tensor data through our description.
    let mut reader = std::io::BufReader::new(std::fs::File::open(&path)?);
    let a = ours.tensor(&mut reader, "blk.4.ffn_down.weight", &Device::Cpu)?;
    let b = theirs.tensor(&mut reader, "blk.4.ffn_down.weight", &Device::Cpu)?;
    assert_eq!(a.data()?, b.data()?);
    Ok(())
}

#[test]
fn rewritten_copies_load_without_warnings_and_compute_the_same_logits() -> Result<()> {
    let original = load_gguf(&common::stories260k(), &Device::Cpu)?;
    assert!(original.warnings.is_empty(), "{:?}", original.warnings);
    let reference = logits(&original);
    // Our test writer, unchanged; as GGUF version 2; laid out for alignments 8 and 64.
    let mut v2 = stories();
    v2.version = 2;
    let mut a8 = stories();
    a8.set_value("general.alignment", Value::U32(8)).relayout(8);
    let mut a64 = stories();
    a64.set_value("general.alignment", Value::U32(64))
        .relayout(64);
    for (what, raw) in [
        ("copy", stories()),
        ("v2", v2),
        ("align 8", a8),
        ("align 64", a64),
    ] {
        let (_file, loaded) = load(&raw);
        let loaded = loaded.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(loaded.warnings.is_empty(), "{what}: {:?}", loaded.warnings);
        assert_eq!(logits(&loaded), reference, "{what}");
    }
    Ok(())
}

#[test]
fn ggml_type_ids_map_to_the_types_candle_gives_them() {
    for id in (0..=40).chain([u32::MAX]) {
        let raw = RawGguf {
            version: 3,
            metadata: vec![],
            tensors: vec![RawTensor {
                name: b"t".to_vec(),
                ne: vec![256],
                ggml_type: id,
                offset: 0,
            }],
            pad_to: 32,
            data: vec![0; 2048],
            n_tensors: None,
            n_kv: None,
        };
        let bytes = raw.to_bytes();
        let theirs = gguf_file::Content::read(&mut Cursor::new(&bytes))
            .map(|c| c.tensor_infos["t"].ggml_dtype);
        let ours = read_content(&mut Cursor::new(&bytes), Path::new("t.gguf"))
            .map(|c| c.tensor_infos["t"].ggml_dtype);
        match (ours, theirs) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "id {id}"),
            (Err(EngineError::InvalidModel { message, .. }), Err(_)) => {
                assert_eq!(
                    message,
                    format!("tensor `t` has ggml type {id}, which is unknown or not supported")
                );
            }
            (ours, theirs) => panic!("id {id}: ours {ours:?}, candle's {theirs:?}"),
        }
    }
}

#[test]
fn zero_alignment_is_refused_naming_the_key() {
    let mut raw = stories();
    raw.set_value("general.alignment", Value::U32(0));
    let m = refused(&raw);
    assert_eq!(
        m,
        "metadata `general.alignment` is 0; it must be a power of two, at least 8"
    );
}

#[test]
fn alignments_that_are_not_powers_of_two_from_8_are_refused() {
    for a in [3u32, 12, 24, 48, 100, 0x8000_0001] {
        let mut raw = stories();
        raw.set_value("general.alignment", Value::U32(a));
        has(
            &refused(&raw),
            &format!("metadata `general.alignment` is {a}, not a power of two"),
        );
    }
    for a in [1u32, 2, 4] {
        let mut raw = stories();
        raw.set_value("general.alignment", Value::U32(a));
        has(
            &refused(&raw),
            &format!("metadata `general.alignment` is {a}, not a multiple of 8"),
        );
    }
}

#[test]
fn alignment_of_a_type_other_than_uint32_is_refused() {
    for (v, shown) in [
        (Value::U64(32), "uint64 32"),
        (Value::I32(32), "int32 32"),
        (Value::U8(32), "uint8 32"),
        (Value::U16(32), "uint16 32"),
        (Value::F32(32.0), "float32 32"),
        (Value::String("32".into()), "string `32`"),
    ] {
        let mut raw = stories();
        raw.set_value("general.alignment", v);
        assert_eq!(
            refused(&raw),
            format!("metadata `general.alignment` is {shown}; the GGUF spec says it is a uint32")
        );
    }
}

#[test]
fn misaligned_tensor_offsets_are_refused() {
    // These used to load and run on shifted weights (NaN or garbage text, exit status 0).
    for delta in [1u64, 4, 8, 16] {
        let mut raw = stories();
        let t = raw.tensor_mut("blk.0.attn_q.weight");
        t.offset += delta;
        let offset = t.offset;
        has(
            &refused(&raw),
            &format!(
                "tensor `blk.0.attn_q.weight` has data offset {offset}, not a multiple of the \
                 alignment 32"
            ),
        );
    }
    // A multiple of 32 in a file aligned to 64.
    let mut raw = stories();
    raw.set_value("general.alignment", Value::U32(64))
        .relayout(64);
    let t = raw.tensor_mut("output_norm.weight");
    t.offset += 32;
    let offset = t.offset;
    has(
        &refused(&raw),
        &format!(
            "tensor `output_norm.weight` has data offset {offset}, not a multiple of the \
             alignment 64"
        ),
    );
}

#[test]
fn overlapping_tensor_data_is_refused() {
    // Same offset, and a start inside the other tensor.
    for shift in [0u64, 32] {
        let mut raw = stories();
        let q = raw.tensor_mut("blk.0.attn_q.weight").offset;
        raw.tensor_mut("blk.0.attn_k.weight").offset = q + shift;
        let m = refused(&raw);
        has(&m, "overlap");
        has(&m, "`blk.0.attn_q.weight`");
        has(&m, "`blk.0.attn_k.weight`");
    }
}

#[test]
fn tensor_data_past_the_end_of_the_file_is_refused() {
    // The last tensor's data one byte short.
    let mut raw = stories();
    let last = raw.tensors.iter().max_by_key(|t| t.offset).unwrap().clone();
    let end = last.offset + common::raw::tensor_bytes(&last.ne, last.ggml_type);
    raw.data.truncate(end as usize - 1);
    let name = String::from_utf8(last.name.clone()).unwrap();
    let m = refused(&raw);
    has(&m, &format!("tensor `{name}` needs"));
    has(&m, "past the end of the file");
    // Offsets beyond the end, and one whose sum with the data offset overflows.
    for offset in [raw.data.len() as u64 * 2 / 32 * 32, u64::MAX - 31] {
        let mut raw = stories();
        raw.tensor_mut("blk.1.ffn_up.weight").offset = offset;
        let m = refused(&raw);
        has(
            &m,
            &format!("tensor `blk.1.ffn_up.weight` needs 44032 bytes at data offset {offset}"),
        );
        has(&m, "past the end of the file");
    }
}

#[test]
fn element_counts_and_byte_sizes_that_overflow_are_refused() {
    let name = "blk.0.attn_q.weight"; // f32
    for (ne, part) in [
        (
            vec![1u64 << 32, 1 << 32],
            "has more elements than an int64 holds",
        ),
        (vec![1 << 62, 2], "has more elements than an int64 holds"),
        (
            vec![1 << 63],
            "dimension 0 is 9223372036854775808, more than an int64 holds",
        ),
        (vec![u64::MAX, 1], "dimension 0 is 18446744073709551615"),
        (vec![1 << 62], "has a size in bytes that overflows"),
    ] {
        let mut raw = stories();
        raw.tensor_mut(name).ne = ne.clone();
        let m = refused(&raw);
        has(&m, &format!("tensor `{name}`"));
        has(&m, part);
    }
}

#[test]
fn rows_that_are_not_whole_blocks_are_refused() {
    for (name, ne, ty, part) in [
        (
            "blk.0.ffn_down.weight",
            vec![172, 64],
            8,
            "of type Q8_0 has rows of 172 elements (dimension 0), not a multiple of its block \
             size 32",
        ),
        (
            "blk.0.attn_q.weight",
            vec![64, 64],
            12,
            "of type Q4K has rows of 64 elements (dimension 0), not a multiple of its block \
             size 256",
        ),
        // 33 elements: not even the element count is whole blocks.
        (
            "output_norm.weight",
            vec![33],
            8,
            "of type Q8_0 has rows of 33 elements (dimension 0), not a multiple of its block \
             size 32",
        ),
        // 1,024 elements are 32 whole Q8_0 blocks, but rows of 16 are not.
        (
            "blk.0.attn_q.weight",
            vec![16, 64],
            8,
            "has rows of 16 elements (dimension 0), not a multiple of its block size 32",
        ),
    ] {
        let mut raw = stories();
        let t = raw.tensor_mut(name);
        t.ne = ne;
        t.ggml_type = ty;
        let m = refused(&raw);
        has(&m, &format!("tensor `{name}` "));
        has(&m, part);
    }
}

#[test]
fn duplicate_metadata_keys_are_refused() {
    let mut raw = stories();
    raw.metadata
        .push((b"llama.block_count".to_vec(), Md::V(Value::U32(4))));
    let i = raw.metadata.len() - 1;
    assert_eq!(
        refused(&raw),
        format!(
            "metadata key `llama.block_count` appears twice (again as entry {i}); llama.cpp \
             refuses duplicate keys too"
        )
    );
}

#[test]
fn duplicate_tensor_names_are_refused() {
    let mut raw = stories();
    raw.tensors[7].name = raw.tensors[3].name.clone();
    let name = String::from_utf8(raw.tensors[3].name.clone()).unwrap();
    assert_eq!(
        refused(&raw),
        format!(
            "tensor 7 repeats the name `{name}` of an earlier tensor; llama.cpp refuses \
             duplicate tensor names too"
        )
    );
}

#[test]
fn unknown_ggml_types_are_refused() {
    for ty in [4u32, 5, 16, 29, 31, 39, 1000, u32::MAX] {
        let mut raw = stories();
        raw.tensor_mut("blk.2.attn_v.weight").ggml_type = ty;
        assert_eq!(
            refused(&raw),
            format!(
                "tensor `blk.2.attn_v.weight` has ggml type {ty}, which is unknown or not \
                 supported"
            )
        );
    }
}

#[test]
fn more_than_four_dimensions_are_refused() {
    for ne in [vec![64u64, 64, 1, 1, 1], vec![1; 1000]] {
        let n = ne.len();
        let mut raw = stories();
        raw.tensor_mut("blk.0.attn_q.weight").ne = ne;
        assert_eq!(
            refused(&raw),
            format!("tensor `blk.0.attn_q.weight` has {n} dimensions; ggml allows at most 4")
        );
    }
}

#[test]
fn unknown_value_types_and_bools_other_than_0_and_1_are_refused() {
    for ty in [13u32, 1000, u32::MAX] {
        let mut raw = stories();
        raw.set("general.name", Md::Raw { ty, bytes: vec![] });
        assert_eq!(
            refused(&raw),
            format!("metadata `general.name` has value type {ty}, which is unknown")
        );
    }
    let mut raw = stories();
    raw.set(
        "tokenizer.ggml.add_bos_token",
        Md::Raw {
            ty: 7,
            bytes: vec![2],
        },
    );
    assert_eq!(
        refused(&raw),
        "metadata `tokenizer.ggml.add_bos_token` is a bool stored as the byte 2; the GGUF spec \
         allows only 0 and 1"
    );
    let mut bytes = 13u32.to_le_bytes().to_vec();
    bytes.extend(0u64.to_le_bytes());
    let mut raw = stories();
    raw.set("general.tags", Md::Raw { ty: 9, bytes });
    assert_eq!(
        refused(&raw),
        "metadata `general.tags` is an array of value type 13, which is unknown"
    );
}

#[test]
fn other_magics_and_versions_are_refused() {
    for (version, part) in [
        (0u32, "GGUF version 0 is not a version".to_string()),
        (1, "GGUF version 1 is not supported".to_string()),
        (
            4,
            "GGUF version 4 is not supported (versions 2 and 3 are)".to_string(),
        ),
        (
            0x0300_0000,
            "GGUF version 0x03000000: the file is probably of the other byte order".to_string(),
        ),
    ] {
        let mut raw = stories();
        raw.version = version;
        has(&refused(&raw), &part);
    }
    let mut bytes = stories().to_bytes();
    bytes[..4].copy_from_slice(b"GG\x1bG");
    let m = match read_content(&mut Cursor::new(&bytes), Path::new("m.gguf")) {
        Err(EngineError::InvalidModel { message, .. }) => message,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        m,
        r"not a GGUF file: it starts with `GG\u{1b}G`, not `GGUF`"
    );
}

#[test]
fn every_truncation_and_random_corruptions_of_the_header_are_errors_not_panics() {
    let bytes = std::fs::read(common::stories260k()).unwrap();
    let path = Path::new("stories.gguf");
    let data_offset = read_content(&mut Cursor::new(&bytes), path)
        .unwrap()
        .tensor_data_offset as usize;
    let cuts = (0..=data_offset).chain((data_offset..bytes.len()).step_by(4099));
    for cut in cuts {
        match read_content(&mut Cursor::new(&bytes[..cut]), path) {
            Err(EngineError::InvalidModel { message, .. }) => assert_clean(&message),
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
    // Deterministic pseudo-random byte changes in the header (a tiny in-process fuzz run; the
    // cargo-fuzz target runs the same function on any bytes).
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut file = bytes.clone();
    for _ in 0..3000 {
        let changes: Vec<(usize, u8)> = (0..1 + next() % 4)
            .map(|_| ((next() % data_offset as u64) as usize, next() as u8))
            .collect();
        for &(i, b) in &changes {
            file[i] = b;
        }
        match read_content(&mut Cursor::new(&file), path) {
            Ok(_) => {}
            Err(EngineError::InvalidModel { message, .. }) => assert_clean(&message),
            Err(other) => panic!("{changes:?}: {other:?}"),
        }
        file[..data_offset].copy_from_slice(&bytes[..data_offset]);
    }
}

#[test]
fn control_bytes_and_invalid_utf8_in_names_and_values_are_escaped() {
    // A tensor name with an escape sequence, a bell and invalid UTF-8.
    let mut raw = stories();
    raw.tensor_mut("blk.0.attn_q.weight").name = b"blk.0\x1b[2J\x07\xff\xfe".to_vec();
    let i = raw
        .tensors
        .iter()
        .position(|t| t.name.starts_with(b"blk.0\x1b"))
        .unwrap();
    assert_eq!(
        refused(&raw),
        format!(r"the name of tensor {i}, `blk.0\u{{1b}}[2J\u{{7}}\xff\xfe`, is not valid UTF-8")
    );
    // Valid UTF-8 with control characters, in a message about the tensor.
    let mut raw = stories();
    for name in ["blk.1.attn_q.weight", "blk.1.attn_k.weight"] {
        raw.tensor_mut(name).name = "t\x1b]0;owned\x07\n\u{202e}".as_bytes().to_vec();
    }
    has(
        &refused(&raw),
        r"repeats the name `t\u{1b}]0;owned\u{7}\n\u{202e}` of an earlier tensor",
    );
    // A key with invalid UTF-8, and one with control characters and an unknown value type.
    let mut raw = stories();
    raw.entry_mut("general.architecture").0 = b"general.\x1b[31mname\xc0".to_vec();
    has(
        &refused(&raw),
        r"`general.\u{1b}[31mname\xc0`, is not valid UTF-8",
    );
    let mut raw = stories();
    raw.set(
        "x\x1b[1m\r\u{7f}",
        Md::Raw {
            ty: 13,
            bytes: vec![],
        },
    );
    assert_eq!(
        refused(&raw),
        r"metadata `x\u{1b}[1m\r\u{7f}` has value type 13, which is unknown"
    );
    // String values: an architecture and a tokenizer kind (`Unsupported`), invalid UTF-8 shown
    // as the replacement character it was decoded to.
    for (key, value, part) in [
        (
            "general.architecture",
            b"llama\x1b[2J\xff\x00x".to_vec(),
            r"architecture `llama\u{1b}[2J�\0x` (general.architecture)",
        ),
        (
            "tokenizer.ggml.model",
            "\u{202e}bert\t".as_bytes().to_vec(),
            r"tokenizer kind `\u{202e}bert\t` (tokenizer.ggml.model)",
        ),
    ] {
        let mut raw = stories();
        let mut bytes = Vec::new();
        common::raw::gguf_string(&mut bytes, &value);
        raw.set(key, Md::Raw { ty: 8, bytes });
        match load(&raw).1 {
            Err(EngineError::Unsupported(m)) => {
                has(&m, part);
                // Both name the file (the tokenizer's did not).
                has(&m, "corrupt.gguf: ");
                assert!(
                    !m.chars().any(|c| c.is_control() || c == '\u{202e}'),
                    "{m:?}"
                );
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    // Long names and strings are cut.
    let mut raw = stories();
    raw.tensor_mut("output_norm.weight").name = vec![b'n'; 1_000_000];
    has(&refused(&raw), "is 1000000 bytes long, more than 63");
    let mut raw = stories();
    raw.set_value(
        "general.architecture",
        Value::String("\x1b".repeat(1_000_000)),
    );
    match load(&raw).1 {
        Err(EngineError::Unsupported(m)) => {
            has(&m, "… (1000000 bytes) (general.architecture)");
            assert!(m.len() < 300, "{} bytes", m.len());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_huge_array_where_a_scalar_belongs_makes_a_short_message() {
    // 300,000 strings (~3 MB): formatted whole, this made messages of megabytes.
    let big = Value::Array(
        (0..300_000)
            .map(|i| Value::String(format!("tok\n{i}")))
            .collect(),
    );
    for (key, expected) in [
        ("general.alignment", "a uint32"),
        ("general.architecture", "expected a string"),
        ("llama.block_count", "expected a non-negative integer"),
        (
            "llama.attention.layer_norm_rms_epsilon",
            "expected a number",
        ),
        ("tokenizer.ggml.add_bos_token", "expected a bool"),
        (BOS, "expected an integer token id"),
        (
            "tokenizer.ggml.unknown_token_id",
            "expected an integer token id",
        ),
    ] {
        let mut raw = stories();
        raw.set_value(key, big.clone());
        let m = refused(&raw);
        has(&m, &format!("metadata `{key}` is array of 300000 string"));
        has(&m, expected);
    }
    // A per-token array whose elements are arrays, and a megabyte string where a count belongs.
    let mut raw = stories();
    raw.set_value(
        "tokenizer.ggml.scores",
        Value::Array(vec![Value::Array(vec![Value::U32(7); 1000]); 512]),
    );
    has(
        &refused(&raw),
        "`tokenizer.ggml.scores`[0] is array of 1000 uint32",
    );
    let mut raw = stories();
    raw.set_value("llama.block_count", Value::String("7\n".repeat(500_000)));
    let m = refused(&raw);
    has(&m, r"metadata `llama.block_count` is string `7\n7\n");
    has(&m, "… (1000000 bytes), expected a non-negative integer");
}

#[test]
fn bos_or_eos_outside_the_vocabulary_is_refused() {
    for (key, value, shown) in [
        (BOS, Value::U32(512), "512"),
        (EOS, Value::U32(100_000), "100000"),
        (BOS, Value::I32(-5), "-5"),
        (EOS, Value::U64(1 << 40), "1099511627776"),
        (BOS, Value::I64(i64::MIN), "-9223372036854775808"),
    ] {
        let mut raw = stories();
        raw.set_value(key, value);
        assert_eq!(
            refused(&raw),
            format!(
                "tokenizer: metadata `{key}` is {shown}, outside the vocabulary of 512 tokens \
                 (`tokenizer.ggml.tokens`)"
            )
        );
    }
}

#[test]
fn minus_one_and_all_ones_special_ids_mean_no_token() -> Result<()> {
    let mut raw = stories();
    raw.set_value(EOS, Value::I32(-1))
        .set_value("tokenizer.ggml.padding_token_id", Value::U32(u32::MAX))
        .set_value("tokenizer.ggml.cls_token_id", Value::I64(-1));
    let (_file, loaded) = load(&raw);
    let loaded = loaded?;
    // No EOS id; generation still ends at `</s>` (2), whose text is in llama.cpp's
    // end-of-generation list (`EOG_TOKEN_TEXTS`).
    assert_eq!(loaded.tokenizer.eos_token, None);
    assert_eq!(loaded.tokenizer.eos_token_ids, [2]);
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    Ok(())
}

#[test]
fn other_special_ids_outside_the_vocabulary_are_one_warning_each() -> Result<()> {
    let original = load_gguf(&common::stories260k(), &Device::Cpu)?;
    let bad = [
        (
            "tokenizer.ggml.padding_token_id",
            Value::U32(99_999),
            "99999",
        ),
        ("tokenizer.ggml.seperator_token_id", Value::U32(512), "512"),
        (
            "tokenizer.ggml.separator_token_id",
            Value::I32(1000),
            "1000",
        ),
        ("tokenizer.ggml.unknown_token_id", Value::U64(600), "600"),
        ("tokenizer.ggml.cls_token_id", Value::I16(-7), "-7"),
    ];
    let mut raw = stories();
    for (key, value, _) in &bad {
        raw.set_value(key, value.clone());
    }
    raw.set_value("tokenizer.ggml.mask_token_id", Value::U32(3));
    let (_file, loaded) = load(&raw);
    let loaded = loaded?;
    assert_eq!(loaded.warnings.len(), bad.len(), "{:?}", loaded.warnings);
    for (key, _, shown) in bad {
        let mine: Vec<&String> = loaded
            .warnings
            .iter()
            .filter(|w| w.contains(&format!("`{key}`")))
            .collect();
        assert_eq!(mine.len(), 1, "{key}: {:?}", loaded.warnings);
        assert_eq!(
            *mine[0],
            format!(
                "bad special token: metadata `{key}` is {shown}, outside the vocabulary of 512 \
                 tokens; ignored, as llama.cpp does"
            )
        );
    }
    assert_eq!(loaded.tokenizer.warnings, loaded.warnings);
    // The ids are ignored: the same tokenizer and model as the original (unknown: `<unk>`).
    let ids = |l: &LoadedModel| {
        l.tokenizer
            .tokenizer
            .encode("Once upon a time, 世界", true)
            .unwrap()
            .get_ids()
            .to_vec()
    };
    assert_eq!(ids(&loaded), ids(&original));
    assert_eq!(logits(&loaded), logits(&original));
    Ok(())
}

#[test]
fn a_special_id_that_is_not_an_integer_is_an_error_if_read_else_a_warning() -> Result<()> {
    let mut raw = stories();
    raw.set_value(
        "tokenizer.ggml.unknown_token_id",
        Value::String("zero".into()),
    );
    assert_eq!(
        refused(&raw),
        "tokenizer: metadata `tokenizer.ggml.unknown_token_id` is string `zero`, expected an \
         integer token id"
    );
    let mut raw = stories();
    raw.set_value(
        "tokenizer.ggml.padding_token_id",
        Value::String("zero".into()),
    );
    let (_file, loaded) = load(&raw);
    assert_eq!(
        loaded?.warnings,
        [
            "metadata `tokenizer.ggml.padding_token_id` is string `zero`, expected an integer \
          token id; ignored"
        ]
    );
    Ok(())
}

#[test]
fn many_bad_special_ids_make_at_most_17_warnings() -> Result<()> {
    let mut raw = stories();
    for i in 0..40 {
        raw.set_value(
            &format!("tokenizer.ggml.x{i:02}_token_id"),
            Value::U32(70_000),
        );
    }
    let (_file, loaded) = load(&raw);
    let warnings = loaded?.warnings;
    assert_eq!(warnings.len(), 17);
    has(&warnings[0], "`tokenizer.ggml.x00_token_id` is 70000");
    assert_eq!(warnings[16], "... and 24 more bad special tokens, ignored");
    Ok(())
}

/// Deriving SentencePiece merges looks up both parts of every split of every piece: quadratic
/// in a piece's length (a 10 MB piece took hours). Past a budget the file is refused at once,
/// naming the longest piece; a long piece within it loads.
#[test]
fn pieces_too_long_to_derive_merges_from_are_refused_at_once() -> Result<()> {
    let with_piece = |len: usize| {
        let mut raw = stories();
        let (_, md) = raw.entry_mut("tokenizer.ggml.tokens");
        let Md::V(Value::Array(tokens)) = md else {
            panic!("tokens are an array")
        };
        tokens[100] = Value::String("A".repeat(len));
        raw
    };
    let raw = with_piece(50_000);
    let (_, Md::V(Value::Array(tokens))) = raw
        .metadata
        .iter()
        .find(|(k, _)| k == b"tokenizer.ggml.tokens")
        .unwrap()
        .clone()
    else {
        panic!("tokens")
    };
    let squares: u64 = tokens
        .iter()
        .map(|t| match t {
            Value::String(s) => (s.len() as u64).pow(2),
            _ => 0,
        })
        .sum();
    assert!(squares > 1 << 31);
    let started = std::time::Instant::now();
    let m = refused(&raw);
    assert!(started.elapsed().as_secs() < 5, "{:?}", started.elapsed());
    assert_eq!(
        m,
        format!(
            "tokenizer: the pieces of `tokenizer.ggml.tokens` are too long to derive \
             SentencePiece merges from: their squared lengths add up to {squares} bytes, more \
             than 2147483648 (the longest, token 100, is 50000 bytes; real vocabularies add up \
             to less than 10^8)"
        )
    );
    let (_file, loaded) = load(&with_piece(4_000));
    loaded?;
    Ok(())
}

/// A file holding tensors the model does not use (a `llama.block_count` below its layers) is
/// refused, as llama.cpp refuses it ("wrong number of tensors"); it used to load and ignore
/// the last layer.
#[test]
fn tensors_the_model_does_not_use_are_refused() {
    let original = load_gguf(&common::stories260k(), &Device::Cpu).expect("loads");
    let layers = original.model.config().n_layer;
    let mut raw = stories();
    raw.set_value("llama.block_count", Value::U32(layers as u32 - 1));
    let m = refused(&raw);
    let last = layers - 1;
    assert_eq!(
        m,
        format!(
            "tensor `blk.{last}.attn_k.weight` is not part of a {last}-layer llama model \
             (`llama.block_count` {last}); 9 of the file's {} tensors are unused, which \
             llama.cpp refuses too",
            raw.tensors.len()
        )
    );
}
