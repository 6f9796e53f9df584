//! `nucleus generate --model DIR` on a Hugging Face folder written at run time (a tiny random
//! Qwen3 checkpoint with MiniMind's tokenizer from ../shared), and `--threads`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{Device, Tensor};
use nucleus_engine::{load_hf_folder, CausalLm, SeqInput};

fn nucleus(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nucleus"));
    cmd.args(args)
        .env_remove("NUCLEUS_MODEL")
        .env_remove("NUCLEUS_NUM_THREADS")
        .env_remove("RAYON_NUM_THREADS");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run nucleus")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

struct Folder(PathBuf);

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A 2-layer Qwen3 (hidden 64, 4 heads of 32, 2 kv heads) with deterministic pseudo-random
/// weights, tied embeddings, and MiniMind's tokenizer (6,400 ids, EOS `<|im_end|>` = 2).
fn qwen3_folder(tag: &str, model_type: &str) -> Folder {
    let dir = std::env::temp_dir().join(format!("nucleus-cli-hf-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let config = serde_json::json!({
        "model_type": model_type, "vocab_size": 6400, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        "tie_word_embeddings": true, "attention_bias": false, "use_sliding_window": false,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"
    });
    let moe = model_type == "qwen3_moe";
    let mut config = config;
    if moe {
        config["num_experts"] = serde_json::json!(4);
        config["num_experts_per_tok"] = serde_json::json!(2);
        config["moe_intermediate_size"] = serde_json::json!(48);
        config["norm_topk_prob"] = serde_json::json!(true);
    }
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut values = |n: usize, scale: f32, offset: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                offset + scale * ((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            })
            .collect()
    };
    let mut tensors = HashMap::new();
    let mut put = |name: String, shape: &[usize], scale: f32, offset: f32| {
        let n = shape.iter().product();
        let t = Tensor::from_vec(values(n, scale, offset), shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(candle_core::DType::BF16))
            .expect("tensor");
        tensors.insert(name, t);
    };
    put("model.embed_tokens.weight".into(), &[6400, 64], 0.5, 0.0);
    put("model.norm.weight".into(), &[64], 0.1, 1.0);
    for i in 0..2 {
        let p = format!("model.layers.{i}");
        put(format!("{p}.input_layernorm.weight"), &[64], 0.1, 1.0);
        put(
            format!("{p}.post_attention_layernorm.weight"),
            &[64],
            0.1,
            1.0,
        );
        put(format!("{p}.self_attn.q_norm.weight"), &[32], 0.1, 1.0);
        put(format!("{p}.self_attn.k_norm.weight"), &[32], 0.1, 1.0);
        put(
            format!("{p}.self_attn.q_proj.weight"),
            &[128, 64],
            0.125,
            0.0,
        );
        put(
            format!("{p}.self_attn.k_proj.weight"),
            &[64, 64],
            0.125,
            0.0,
        );
        put(
            format!("{p}.self_attn.v_proj.weight"),
            &[64, 64],
            0.125,
            0.0,
        );
        put(
            format!("{p}.self_attn.o_proj.weight"),
            &[64, 128],
            0.09,
            0.0,
        );
        if moe {
            put(format!("{p}.mlp.gate.weight"), &[4, 64], 0.5, 0.0);
            for e in 0..4 {
                let x = format!("{p}.mlp.experts.{e}");
                put(format!("{x}.gate_proj.weight"), &[48, 64], 0.125, 0.0);
                put(format!("{x}.up_proj.weight"), &[48, 64], 0.125, 0.0);
                put(format!("{x}.down_proj.weight"), &[64, 48], 0.14, 0.0);
            }
        } else {
            put(format!("{p}.mlp.gate_proj.weight"), &[96, 64], 0.125, 0.0);
            put(format!("{p}.mlp.up_proj.weight"), &[96, 64], 0.125, 0.0);
            put(format!("{p}.mlp.down_proj.weight"), &[64, 96], 0.1, 0.0);
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).expect("save");
    let tok =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/minimind-tokenizer");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tok.join(f), dir.join(f)).expect("copy the tokenizer");
    }
    Folder(dir)
}

/// The greedy continuation of the token ids `prompt` with the library directly: argmax of each
/// step's logits (ties to the lower id), `max_tokens` of them, or until EOS when `stop_at_eos`.
fn greedy_ids(
    loaded: &nucleus_engine::LoadedModel,
    prompt: &[u32],
    max_tokens: usize,
    stop_at_eos: bool,
) -> Vec<u32> {
    let mut cache = loaded.model.new_cache();
    let mut pending = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let logits: Vec<f32> = loaded
            .model
            .forward(&mut [SeqInput {
                tokens: &pending,
                cache: &mut cache,
            }])
            .and_then(|t| Ok(t.squeeze(0)?.to_vec1()?))
            .expect("forward");
        let next = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .expect("a row") as u32;
        if stop_at_eos && loaded.tokenizer.eos_token_ids.contains(&next) {
            break;
        }
        out.push(next);
        pending = vec![next];
    }
    out
}

/// The greedy completion of `prompt` computed with the library directly, until EOS or
/// `max_tokens`, decoded after the prompt's text with special tokens skipped.
fn greedy_with_the_library(dir: &Path, prompt: &str, max_tokens: usize) -> String {
    let loaded = load_hf_folder(dir, &Device::Cpu).expect("load");
    let tok = &loaded.tokenizer.tokenizer;
    let ids = tok.encode(prompt, true).expect("encode").get_ids().to_vec();
    let out = greedy_ids(&loaded, &ids, max_tokens, true);
    tok.decode(&out, true).expect("decode")
}

#[test]
fn generate_runs_a_hugging_face_folder_greedily_whatever_the_thread_count() {
    for model_type in ["qwen3", "qwen3_moe"] {
        generate_greedily(model_type);
    }
}

/// `generate` at temperature 0 on a tiny folder of `model_type` equals the library's greedy
/// loop, with 1 and 2 threads.
fn generate_greedily(model_type: &str) {
    let folder = qwen3_folder("greedy", model_type);
    let dir = folder.0.to_str().expect("utf-8 path");
    let expected = greedy_with_the_library(&folder.0, "Hello world", 12);
    assert!(!expected.is_empty());
    let mut outputs = Vec::new();
    for threads in ["1", "2"] {
        let out = nucleus(
            &[
                "generate",
                "--model",
                dir,
                "--prompt",
                "Hello world",
                "--temperature",
                "0",
                "--max-tokens",
                "12",
                "--threads",
                threads,
            ],
            &[],
        );
        let stderr = text(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(stderr.contains("decode: "), "{stderr}");
        outputs.push(text(&out.stdout));
    }
    assert_eq!(
        outputs[0], outputs[1],
        "{model_type}: --threads 1 and 2 differ"
    );
    assert_eq!(outputs[0].trim_end_matches('\n'), expected, "{model_type}");
}

#[test]
fn bad_folders_and_thread_counts_are_one_error_line() {
    let folder = qwen3_folder("mamba", "mamba");
    let dir = folder.0.to_str().expect("utf-8 path");
    let out = nucleus(&["generate", "--model", dir, "--prompt", "x"], &[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(
            "model_type `mamba` is not supported; supported: llama, qwen2, qwen3, qwen3_moe, \
             minimind"
        ),
        "{stderr}"
    );

    let out = nucleus(&["generate", "--prompt", "x", "--threads", "0"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let out = nucleus(
        &["generate", "--prompt", "x", "--model", dir],
        &[("NUCLEUS_NUM_THREADS", "many")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "error: invalid request: NUCLEUS_NUM_THREADS=`many` is not a thread count between 1 \
         and 1024\n"
    );
}

/// The token ids of `--format json` output.
fn json_ids(out: &Output) -> Vec<Vec<u64>> {
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            v["token_ids"]
                .as_array()
                .expect("token_ids")
                .iter()
                .map(|x| x.as_u64().expect("an id"))
                .collect()
        })
        .collect()
}

#[test]
fn generation_config_gives_the_defaults_of_flags_not_given() {
    let folder = qwen3_folder("genconfig", "qwen3");
    let dir = folder.0.to_str().expect("utf-8 path");
    // Greedy and 5 tokens from the model's generation_config.json (do_sample is ignored, as
    // vLLM ignores it); EOS never comes in 5 tokens of this random model with `Hello world`.
    std::fs::write(
        folder.0.join("generation_config.json"),
        r#"{"do_sample": true, "temperature": 0.0, "max_new_tokens": 5, "top_p": null}"#,
    )
    .expect("write");
    let greedy = |n: usize| greedy_with_the_library(&folder.0, "Hello world", n);
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            dir,
            "--prompt",
            "Hello world",
            "--format",
            "json",
        ];
        args.extend_from_slice(extra);
        nucleus(&args, &[])
    };
    let out = run(&[]);
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("generation_config.json: temperature=0, max_new_tokens=5\n"),
        "{stderr}"
    );
    let taken = json_ids(&out);
    assert_eq!(taken[0].len(), 5);
    // The same as the flags given explicitly, and as the library's greedy loop.
    let explicit = run(&[
        "--temperature",
        "0",
        "--max-tokens",
        "5",
        "--generation-config",
        "vllm",
    ]);
    assert!(!text(&explicit.stderr).contains("defaults from"));
    assert_eq!(json_ids(&explicit), taken);
    let v: serde_json::Value =
        serde_json::from_str(text(&out.stdout).lines().next().unwrap()).unwrap();
    assert_eq!(v["text"].as_str().unwrap(), greedy(5));
    // A flag wins over the file; the note lists only what was taken.
    let out = run(&["--max-tokens", "3"]);
    assert!(
        text(&out.stderr).contains("generation_config.json: temperature=0\n"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(json_ids(&out)[0], taken[0][..3]);
    // Another folder's file.
    let other = folder.0.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(
        other.join("generation_config.json"),
        r#"{"temperature": 0, "max_new_tokens": 2}"#,
    )
    .unwrap();
    let out = run(&["--generation-config", other.to_str().unwrap()]);
    assert_eq!(json_ids(&out)[0], taken[0][..2]);
    // A folder without the file, and a bad value, are errors.
    let out = run(&["--generation-config", "/nonexistent-nucleus-dir"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("not a folder (nor its generation_config.json)"),
        "{}",
        text(&out.stderr)
    );
    let empty = folder.0.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = run(&["--generation-config", empty.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("no generation_config.json there"));
    // The file itself names its folder.
    let file = other.join("generation_config.json");
    let out = run(&["--generation-config", file.to_str().unwrap()]);
    assert_eq!(json_ids(&out)[0], taken[0][..2]);
    std::fs::write(
        folder.0.join("generation_config.json"),
        r#"{"temperature": -1}"#,
    )
    .unwrap();
    let out = run(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("`temperature` is -1, expected a number >= 0"),
        "{}",
        text(&out.stderr)
    );
}

/// The first JSON completion of a successful `--format json` run.
fn first_json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_str(text(&out.stdout).lines().next().expect("a line")).expect("JSON")
}

#[test]
fn chat_renders_minimind_s_template_and_ends_at_every_end_of_generation_id() {
    let folder = qwen3_folder("chat", "qwen3");
    let dir = folder.0.to_str().expect("utf-8 path");
    // MiniMind's template (tokenizer_config.json): system, user, then the assistant header
    // with an empty think block unless `open_thinking` is true.
    let rendered = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                    <|im_start|>assistant\n<think>\n\n</think>\n\n";
    let base = [
        "generate",
        "--model",
        dir,
        "--chat",
        "--system",
        "S",
        "--prompt",
        "Hi",
        "--temperature",
        "0",
        "--max-tokens",
        "3",
    ];
    let out = nucleus(&[&base[..], &["--echo"]].concat(), &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with(rendered),
        "{}",
        text(&out.stdout)
    );

    // The prompt is the rendered text tokenised without added BOS, special tokens parsed; the
    // completion is the library's greedy continuation of exactly those ids.
    let loaded = load_hf_folder(&folder.0, &Device::Cpu).expect("load");
    let ids = loaded
        .tokenizer
        .encode(rendered, false, true)
        .expect("encode");
    assert_eq!(ids[0], 1, "<|im_start|> is one token");
    let c = first_json(&nucleus(&[&base[..], &["--format", "json"]].concat(), &[]));
    assert_eq!(c["usage"]["prompt_tokens"], ids.len());
    let greedy: Vec<u64> = greedy_ids(&loaded, &ids, 3, false)
        .into_iter()
        .map(u64::from)
        .collect();
    let got: Vec<u64> = c["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(got, greedy);

    // --chat-template-kwargs reaches the template.
    let out = nucleus(
        &[
            &base[..],
            &[
                "--echo",
                "--chat-template-kwargs",
                r#"{"open_thinking": true}"#,
            ],
        ]
        .concat(),
        &[],
    );
    assert!(text(&out.stdout)
        .starts_with("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"));

    // A --messages conversation with list-of-parts content is joined with "\n" (vLLM).
    let messages = folder.0.join("messages.json");
    std::fs::write(
        &messages,
        r#"[{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]"#,
    )
    .unwrap();
    let c = first_json(&nucleus(
        &[
            "generate",
            "--model",
            dir,
            "--messages",
            messages.to_str().unwrap(),
            "--temperature",
            "0",
            "--max-tokens",
            "1",
            "--format",
            "json",
        ],
        &[],
    ));
    let joined = "<|im_start|>user\nH\ni<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
    assert_eq!(
        c["usage"]["prompt_tokens"],
        loaded.tokenizer.encode(joined, false, true).unwrap().len()
    );

    // End of generation: `<|im_end|>` (2, the EOS) and `<|endoftext|>` (0, on llama.cpp's
    // end-of-generation list) both end the completion.
    for id in ["0", "2"] {
        let bias = format!("{id}=100");
        let c = first_json(&nucleus(
            &[&base[..], &["--format", "json", "--logit-bias", &bias]].concat(),
            &[],
        ));
        assert_eq!(c["finish_reason"], "eos", "{c}");
        assert_eq!(
            c["token_ids"],
            serde_json::json!([id.parse::<u32>().unwrap()])
        );
    }

    // Chat flags without chat, and bad kwargs, are usage errors.
    for args in [
        &["generate", "--model", dir, "--prompt", "x", "--system", "S"][..],
        &[
            "generate",
            "--model",
            dir,
            "--chat",
            "--prompt",
            "x",
            "--chat-template-kwargs",
            "[1]",
        ],
        &[
            "generate",
            "--model",
            dir,
            "--messages",
            "m.json",
            "--prompt",
            "x",
        ],
    ] {
        let out = nucleus(args, &[]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}
