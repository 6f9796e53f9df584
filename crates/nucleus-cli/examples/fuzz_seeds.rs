//! Writes the seed inputs of the cargo-fuzz targets (README.md, "Fuzzing") into a folder, one
//! subfolder per target:
//!
//! ```sh
//! cargo run -p nucleus-cli --example fuzz_seeds -- fuzz/seeds
//! ```
//!
//! Every seed is made here (tiny random GGUF models and safetensors calls, JSON lines and
//! grammars written by hand), none is read from the shared folder, so the minimised corpus that
//! grows from them and is committed under `fuzz/corpus/` holds no copy of a shared file. The
//! seeds are small (the GGUF models are a few KiB) so that libFuzzer's `-max_len` stays small.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

fn main() -> anyhow::Result<()> {
    let out = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("fuzz/seeds"));
    gguf_seeds(&out.join("gguf"))?;
    safetensors_seeds(&out.join("safetensors"))?;
    write_all(&out.join("jsonl_sample"), &JSONL_SAMPLE)?;
    write_all(&out.join("jsonl_top_k_top_p_sample"), &JSONL_NPU)?;
    write_all(&out.join("jsonl_moe_init_routing"), &JSONL_MOE)?;
    write_all(&out.join("jsonl_speculative_verify"), &JSONL_VERIFY)?;
    grammar_seeds(&out.join("grammar"))?;
    println!("seeds written to {}", out.display());
    Ok(())
}

fn write_all(dir: &Path, items: &[&str]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (i, item) in items.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:03}")), item.as_bytes())?;
    }
    Ok(())
}

/// A deterministic pseudo-random f32 in [-1, 1) (xorshift), for weights.
fn weights(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn qtensor(rows: usize, cols: usize, dtype: GgmlDType, seed: u64) -> anyhow::Result<QTensor> {
    let shape: Vec<usize> = if rows == 0 {
        vec![cols]
    } else {
        vec![rows, cols]
    };
    let n = shape.iter().product();
    let t = Tensor::from_vec(weights(n, seed), shape, &Device::Cpu)?;
    Ok(QTensor::quantize(&t, dtype)?)
}

/// A one-layer Llama with `hidden` columns and the given tokenizer metadata.
fn tiny_llama(
    hidden: usize,
    dtype: GgmlDType,
    tokenizer: Vec<(String, Value)>,
    vocab: usize,
) -> anyhow::Result<Vec<u8>> {
    let (heads, kv_heads, ffn) = (2usize, 1usize, 2 * hidden);
    let head_dim = hidden / heads;
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("general.alignment".into(), Value::U32(32)),
        ("llama.embedding_length".into(), Value::U32(hidden as u32)),
        ("llama.block_count".into(), Value::U32(1)),
        (
            "llama.attention.head_count".into(),
            Value::U32(heads as u32),
        ),
        (
            "llama.attention.head_count_kv".into(),
            Value::U32(kv_heads as u32),
        ),
        ("llama.feed_forward_length".into(), Value::U32(ffn as u32)),
        ("llama.context_length".into(), Value::U32(64)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
        ("llama.rope.freq_base".into(), Value::F32(10_000.0)),
    ];
    md.extend(tokenizer);
    let kv = kv_heads * head_dim;
    let norm = |seed| qtensor(0, hidden, GgmlDType::F32, seed);
    let tensors: Vec<(String, QTensor)> = vec![
        (
            "token_embd.weight".into(),
            qtensor(vocab, hidden, dtype, 1)?,
        ),
        ("blk.0.attn_norm.weight".into(), norm(2)?),
        (
            "blk.0.attn_q.weight".into(),
            qtensor(hidden, hidden, dtype, 3)?,
        ),
        ("blk.0.attn_k.weight".into(), qtensor(kv, hidden, dtype, 4)?),
        ("blk.0.attn_v.weight".into(), qtensor(kv, hidden, dtype, 5)?),
        (
            "blk.0.attn_output.weight".into(),
            qtensor(hidden, hidden, dtype, 6)?,
        ),
        ("blk.0.ffn_norm.weight".into(), norm(7)?),
        (
            "blk.0.ffn_gate.weight".into(),
            qtensor(ffn, hidden, dtype, 8)?,
        ),
        (
            "blk.0.ffn_up.weight".into(),
            qtensor(ffn, hidden, dtype, 9)?,
        ),
        (
            "blk.0.ffn_down.weight".into(),
            qtensor(hidden, ffn, dtype, 10)?,
        ),
        ("output_norm.weight".into(), norm(11)?),
    ];
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut bytes = Vec::new();
    gguf_file::write(&mut std::io::Cursor::new(&mut bytes), &md, &ts)?;
    Ok(bytes)
}

fn strings(items: &[&str]) -> Value {
    Value::Array(items.iter().map(|s| Value::String(s.to_string())).collect())
}

/// SentencePiece (`llama`) tokenizer metadata: `<unk> <s> </s>`, the bytes E7 8C AB, pieces.
fn llama_tokenizer() -> (Vec<(String, Value)>, usize) {
    let tokens = [
        "<unk>", "<s>", "</s>", "<0xE7>", "<0x8C>", "<0xAB>", "▁", "a", "b", "▁a", "ab", "▁ab",
    ];
    let n = tokens.len();
    let types: Vec<Value> = (0..n)
        .map(|i| {
            Value::I32(match i {
                0 => 2,
                1 | 2 => 3,
                3..=5 => 6,
                _ => 1,
            })
        })
        .collect();
    let scores: Vec<Value> = (0..n).map(|i| Value::F32(-(i as f32))).collect();
    (
        vec![
            ("tokenizer.ggml.model".into(), Value::String("llama".into())),
            ("tokenizer.ggml.tokens".into(), strings(&tokens)),
            ("tokenizer.ggml.scores".into(), Value::Array(scores)),
            ("tokenizer.ggml.token_type".into(), Value::Array(types)),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
            ("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)),
        ],
        n,
    )
}

/// Byte-level BPE (`gpt2`) tokenizer metadata with merges.
fn gpt2_tokenizer() -> (Vec<(String, Value)>, usize) {
    let tokens = ["a", "b", "Ġ", "ab", "Ġa", "<|endoftext|>"];
    let n = tokens.len();
    (
        vec![
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            ("tokenizer.ggml.tokens".into(), strings(&tokens)),
            ("tokenizer.ggml.merges".into(), strings(&["a b", "Ġ a"])),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(vec![
                    Value::I32(1),
                    Value::I32(1),
                    Value::I32(1),
                    Value::I32(1),
                    Value::I32(1),
                    Value::I32(3),
                ]),
            ),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(5)),
            ("tokenizer.ggml.padding_token_id".into(), Value::U32(5)),
        ],
        n,
    )
}

fn gguf_seeds(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let (llama, n) = llama_tokenizer();
    std::fs::write(
        dir.join("llama-f32.gguf"),
        tiny_llama(8, GgmlDType::F32, llama.clone(), n)?,
    )?;
    std::fs::write(
        dir.join("llama-q8_0.gguf"),
        tiny_llama(32, GgmlDType::Q8_0, llama, n)?,
    )?;
    let (gpt2, n) = gpt2_tokenizer();
    std::fs::write(
        dir.join("gpt2-f16.gguf"),
        tiny_llama(8, GgmlDType::F16, gpt2, n)?,
    )?;
    // Headers only: nested arrays, every value type, no tensors.
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("a.u8".into(), Value::U8(1)),
        ("a.i8".into(), Value::I8(-1)),
        ("a.u16".into(), Value::U16(2)),
        ("a.i16".into(), Value::I16(-2)),
        ("a.i32".into(), Value::I32(-3)),
        ("a.u64".into(), Value::U64(4)),
        ("a.i64".into(), Value::I64(-4)),
        ("a.f64".into(), Value::F64(0.5)),
        ("a.bool".into(), Value::Bool(true)),
        (
            "a.nested".into(),
            Value::Array(vec![Value::Array(vec![Value::Array(vec![Value::U8(7)])])]),
        ),
    ];
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut bytes = Vec::new();
    gguf_file::write(&mut std::io::Cursor::new(&mut bytes), &md, &[])?;
    std::fs::write(dir.join("header-only.gguf"), bytes)?;
    std::fs::write(dir.join("magic-only.gguf"), b"GGUF\x03\x00\x00\x00")?;
    Ok(())
}

/// One safetensors file of `(name, dtype, shape, bytes)` tensors.
fn safetensors(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> anyhow::Result<Vec<u8>> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            Ok((
                name.to_string(),
                TensorView::new(*dtype, shape.clone(), data)?,
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(safetensors::serialize(views, None)?)
}

fn le<T: Copy, const W: usize>(values: &[T], to: impl Fn(T) -> [u8; W]) -> Vec<u8> {
    values.iter().flat_map(|&v| to(v)).collect()
}

/// Seeds of the `safetensors` target: a selector byte (which command, which attributes), then
/// the file (see `nucleus_cli::fuzz::safetensors`).
fn safetensors_seeds(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let f32s = |v: &[f32]| le(v, f32::to_le_bytes);
    let logits = f32s(&[1.0, -2.0, 0.5, 3.0, 0.0, 0.25, -1.0, 2.0]);
    let half: Vec<u8> = [1.0f32, -2.0, 0.5, 3.0]
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    let bhalf: Vec<u8> = [1.0f32, -2.0, 0.5, 3.0]
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    let mut seeds: Vec<(u8, Vec<u8>)> = vec![
        (
            0,
            safetensors(&[("logits", Dtype::F32, vec![2, 4], logits.clone())])?,
        ),
        (
            3,
            safetensors(&[("logits", Dtype::F16, vec![1, 4], half.clone())])?,
        ),
        (
            6,
            safetensors(&[("logits", Dtype::BF16, vec![2, 2], bhalf)])?,
        ),
    ];
    let npu = safetensors(&[
        ("logits", Dtype::F32, vec![2, 4], logits.clone()),
        (
            "top_k",
            Dtype::I32,
            vec![2],
            le(&[2i32, 4], i32::to_le_bytes),
        ),
        ("top_p", Dtype::F32, vec![2], f32s(&[0.9, 1.0])),
        (
            "q",
            Dtype::F32,
            vec![2, 4],
            f32s(&[1.0, 0.5, 2.0, 0.1, 0.3, 0.3, 0.3, 0.3]),
        ),
        ("min_ps", Dtype::F32, vec![2], f32s(&[0.0, 0.1])),
    ])?;
    seeds.push((1, npu));
    let npu64 = safetensors(&[
        ("logits", Dtype::F16, vec![1, 4], half),
        ("top_k", Dtype::I64, vec![1], le(&[3i64], i64::to_le_bytes)),
        ("top_p", Dtype::F32, vec![1], f32s(&[0.5])),
    ])?;
    seeds.push((4, npu64));
    let moe = safetensors(&[
        ("x", Dtype::F32, vec![2, 4], logits),
        (
            "expert_idx",
            Dtype::I32,
            vec![2, 2],
            le(&[0i32, 1, 1, 2], i32::to_le_bytes),
        ),
    ])?;
    seeds.push((2, moe.clone()));
    seeds.push((5, moe));
    for (i, (selector, file)) in seeds.into_iter().enumerate() {
        let mut bytes = vec![selector];
        bytes.extend(file);
        std::fs::write(dir.join(format!("seed-{i:03}")), bytes)?;
    }
    Ok(())
}

const JSONL_SAMPLE: [&str; 10] = [
    r#"{"logits": [1.5, "-inf", 0.2], "params": {"temperature": 0.7, "top_p": 0.9, "seed": 42}, "prompt_ids": [2], "output_ids": [0], "position": 2, "eos_token_ids": [1], "stop_token_ids": [], "vocab_size": 3}"#,
    "{\"logits\": [0.1, 0.2, 0.3, 0.4]}\n{\"probs\": [1, 2, 3, 0]}\n\n{\"logits\": [1, 2], \"params\": {\"temperature\": 0}}\n",
    r#"{"logits": [3, 1, 2, 0, -1], "params": {"top_k": 2, "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"1": 5.0}, "n": 3, "logprobs": 2, "logprobs_kind": "raw", "seed": 7}, "prompt_ids": [0, 1], "output_ids": [1, 1]}"#,
    r#"{"logits": [1, 2, 3, 4], "params": {"allowed_token_ids": [0, 2], "bad_words": [[1, 2], [3]], "min_tokens": 2}, "output_ids": [1], "eos_token_ids": [3]}"#,
    r#"{"logits": [1, 2, 3], "chain": [{"top_k": {"k": 2}}, {"temperature": {"t": 0.5}}, {"sample": {"seed": 1, "n": 2, "logprobs": 1}}]}"#,
    r#"{"logits": [1, 2, 3], "chain": [{"repetition_penalty": {"penalty": 1.5}}, {"min_p": {"p": 0.2}}, {"top_p": {"p": 0.5}}, {"greedy": {}}], "prompt_ids": [2]}"#,
    "\u{feff}{\"logits\": [\"nan\", 1]}\n{\"logits\": [\"inf\"]}\n{\"logits\": [1e39]}\n",
    r#"{"probs": [0.5, 0.25, 0.25], "params": {"temperature": 1, "seed": 18446744073709551615}}"#,
    r#"{"logits": [], "vocab_size": 0}"#,
    "not json\n[1, 2]\n{\"logits\": [1], \"unknown\": 1}\n",
];

const JSONL_VERIFY: [&str; 6] = [
    r#"{"draft_token_ids": [2, 0], "draft_probs": [[0.1, 0.2, 0.6, 0.1], [0.5, 0.2, 0.2, 0.1]], "target_logits": [[1, 0, 2, 0], [0.5, 0, 0, 1], [0, 0, 0, 3]], "params": {"temperature": 0.8, "top_p": 0.95, "seed": 7}, "prompt_ids": [1], "output_ids": [3], "position": 2, "vocab_size": 4}"#,
    r#"{"draft_token_ids": [1], "target_logits": [[1, 2, 3], [3, 2, 1]], "chain": [{"repetition_penalty": {"penalty": 1.3}}, {"dry": {"multiplier": 0.8}}, {"mirostat_v2": {"seed": 3}}], "output_ids": [1, 1]}"#,
    r#"{"draft_token_ids": [], "target_probs": [[0.1, 0.9]], "params": {"min_p": 0.2}}"#,
    r#"{"draft_token_ids": [0, 0], "target_logits": [[5, 0], [5, 0], [5, 0]], "params": {"temperature": 0, "min_tokens": 2}, "eos_token_ids": [1], "stop_token_ids": [0]}"#,
    r#"{"draft_token_ids": [1], "draft_probs": [[1, 0]], "target_logits": [["-inf", "nan"], [1, 2]]}"#,
    "{\"draft_token_ids\": [9], \"target_logits\": [[1]]}\n\n{\"draft_token_ids\": [0], \"target_probs\": [[1], [1]], \"chain\": [{\"greedy\": {}}]}\n",
];

const JSONL_NPU: [&str; 5] = [
    r#"{"logits": [[1.0, 2.0, 3.0, 0.5], [0.1, 0.2, 0.3, 0.4]], "top_k": [2, 4], "top_p": [0.9, 1.0]}"#,
    r#"{"logits": [[1, 3, 2, 3]], "top_k": [2], "top_p": [1.0], "q": [[1, 1, 0.5, 1]], "eps": 1e-8, "is_need_logits": true, "min_ps": null, "ks_max": 1024, "input_is_logits": true, "q_indexing": "token_id"}"#,
    r#"{"logits": [[0.2, 0.3, 0.5]], "top_k": [1], "top_p": [0.5], "min_ps": [0.1], "input_is_logits": false, "q_indexing": "sorted_rank", "q": [[1, 2, 3]], "top_k_guess": 8}"#,
    r#"{"logits": [["-inf", "inf", "nan"]], "top_k": [3], "top_p": [0.5]}"#,
    "{\"logits\": [[1]], \"top_k\": [-1], \"top_p\": [2]}\n{}\n",
];

const JSONL_MOE: [&str; 6] = [
    r#"{"x": [[1.0, -1.0], [2.0, 0.5]], "expert_idx": [[0, 1], [1, 2]], "expert_num": 3}"#,
    r#"{"x": [[1.0, -1.0], [2.0, 0.5]], "expert_idx": [[0, 1], [1, 0]], "expert_num": 2, "active_num": 3, "row_idx_type": 1, "expert_tokens_num_type": 2, "expert_tokens_num_flag": true}"#,
    r#"{"x": [[1, 2, 3, 4], [5, 6, 7, 8]], "expert_idx": [[1], [1]], "expert_num": 2, "expert_capacity": 1, "drop_pad_mode": 1, "expert_tokens_num_type": 1, "expert_tokens_num_flag": true, "quant_mode": 0, "scale": [0.5], "offset": [0.1]}"#,
    r#"{"x": [[1, 2], [3, 4]], "x_dtype": "i8", "expert_idx": [[0], [-1]], "expert_num": 4, "active_expert_range": [0, 2]}"#,
    r#"{"x": [[1, 2], [3, 4]], "x_dtype": "bf16", "expert_idx": [[0], [1]], "expert_num": 2, "quant_mode": 1, "scale": [[1, 2]]}"#,
    "{\"x\": [[1]], \"expert_idx\": [[5]], \"expert_num\": 1}\n[]\n",
];

fn grammar_seeds(dir: &Path) -> anyhow::Result<()> {
    // Seed layout (nucleus_cli::fuzz::Grammar::run): kind byte, options byte, the grammar,
    // then optionally a NUL and a text to validate.
    let schemas = [
        r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "mood": {"enum": ["happy", "sad"]}, "friends": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["name", "age"], "additionalProperties": false}"#,
        r##"{"$defs": {"node": {"type": "object", "properties": {"value": {"type": "number"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}"##,
        r#"{"anyOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"type": "null"}, {"const": [1, {"a": true}]}]}"#,
        r#"{"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "integer", "multipleOf": 3}], "minItems": 1}"#,
        r#"{"allOf": [{"type": "object", "properties": {"a": {"type": "string", "format": "date-time"}}}, {"required": ["a"]}]}"#,
        r##"{"$ref": "#"}"##,
        r#"{"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "x-guidance": {"whitespace_flexible": false}}"#,
        r#"{"oneOf": [{"type": "integer"}]}"#,
        "true",
        "false",
    ];
    let regexes = [
        "yes|no",
        "[0-9]{3}-[0-9]{4}",
        r"(\w+@\w+\.(com|org))?",
        "a{2,5}b*c+",
        "(?i)hello [^x]{0,3}",
        "a{1000}{1000}",
        "",
    ];
    let lark = [
        "start: \"yes\" | \"no\"\n",
        "start: expr\nexpr: expr \"+\" term | term\nterm: NUMBER\nNUMBER: /[0-9]+/\n",
        "%ignore /[ \\t]+/\nstart: item+\nitem: WORD | \"(\" item* \")\"\nWORD: /[a-z]+/\n",
        "start: obj\nobj: %json {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}}\n",
        "start: r0\nr0: r1\nr1: r2\nr2: \"x\"\n",
        "?start: a?\n!a.2: \"a\"i ~ 2..3\n",
        "start: start\n",
    ];
    let texts = [r#"{"name": "Tom", "age": 3}"#, "yes", "1+2+3", "(a b (c))"];
    let mut seeds: Vec<Vec<u8>> = Vec::new();
    let mut push = |kind: u8, grammar: &str, text: Option<&str>| {
        for options in 0..3u8 {
            let mut bytes = vec![kind, options];
            bytes.extend(grammar.as_bytes());
            if let Some(text) = text {
                bytes.push(0);
                bytes.extend(text.as_bytes());
            }
            seeds.push(bytes);
        }
    };
    for (i, s) in schemas.iter().enumerate() {
        push(0, s, (i == 0).then_some(texts[0]));
    }
    for (i, r) in regexes.iter().enumerate() {
        push(1, r, (i == 0).then_some(texts[1]));
    }
    for (i, l) in lark.iter().enumerate() {
        push(
            2,
            l,
            [None, Some(texts[2]), Some(texts[3])]
                .get(i)
                .copied()
                .flatten(),
        );
    }
    std::fs::create_dir_all(dir)?;
    for (i, bytes) in seeds.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:03}")), bytes)?;
    }
    Ok(())
}
