//! `nucleus tokenize`, `detokenize` and `chat-template` on llama.cpp's vocab-only GGUF files
//! and MiniMind's tokenizer from ../shared; expected ids from llama.cpp's own `.out` files and
//! templates rendered by hand from their rules.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn shared(rel: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(rel)
        .to_string_lossy()
        .into_owned()
}

fn vocab(name: &str) -> String {
    shared(&format!("models/vocab/ggml-vocab-{name}.gguf"))
}

fn nucleus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run nucleus")
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("UTF-8")
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nucleus-tokchat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// The first test strings of a `.inp` file and their ids from `.out` (llama.cpp's
/// `__ggml_vocab_test__` format: each string is followed by a separator line).
fn cases(name: &str, n: usize) -> Vec<(String, String)> {
    let inp = std::fs::read_to_string(vocab(name) + ".inp").unwrap();
    let out = std::fs::read_to_string(vocab(name) + ".out").unwrap();
    let strings: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    strings
        .iter()
        .zip(out.lines())
        .filter(|(s, _)| !s.is_empty() && !s.contains('\n'))
        .take(n)
        .map(|(s, ids)| {
            let ids: Vec<u32> = ids.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (s.to_string(), serde_json::to_string(&ids).unwrap())
        })
        .collect()
}

#[test]
fn tokenize_gives_llama_cpp_s_ids_and_detokenize_inverts_it() {
    for name in [
        "llama-bpe",
        "qwen2",
        "gpt-2",
        "deepseek-llm",
        "llama-spm",
        "phi-3",
    ] {
        for (text, expected) in cases(name, 3) {
            let ids = stdout(&nucleus(&[
                "tokenize",
                "--model",
                &vocab(name),
                "--text",
                &text,
                "--no-bos",
                "--no-parse-special",
            ]));
            assert_eq!(ids, format!("{expected}\n"), "{name}: {text:?}");
        }
    }
    // Through a file, one list per line.
    let file = temp("lines.txt");
    std::fs::write(&file, "Hello world\r\n Hello\n").unwrap();
    let lines = stdout(&nucleus(&[
        "tokenize",
        "--model",
        &vocab("qwen2"),
        "--file",
        file.to_str().unwrap(),
        "--lines",
    ]));
    assert_eq!(lines, "[9707,1879]\n[21927]\n");
    // detokenize of Llama 2's ids with BOS: the text, BOS spelled out unless skipped.
    let ids = stdout(&nucleus(&[
        "tokenize",
        "--model",
        &vocab("llama-spm"),
        "--text",
        "Hello world",
    ]));
    assert_eq!(ids, "[1,15043,3186]\n");
    let back = |extra: &[&str]| {
        stdout(&nucleus(
            &[
                &[
                    "detokenize",
                    "--model",
                    &vocab("llama-spm"),
                    "--ids",
                    ids.trim(),
                ][..],
                extra,
            ]
            .concat(),
        ))
    };
    assert_eq!(back(&[]), "<s> Hello world\n");
    assert_eq!(back(&["--skip-special-tokens"]), "Hello world\n");
}

#[test]
fn special_tokens_are_parsed_unless_told_not_to() {
    let run = |extra: &[&str]| {
        stdout(&nucleus(
            &[
                &[
                    "tokenize",
                    "--model",
                    &vocab("qwen2"),
                    "--text",
                    "a<|im_end|>",
                ][..],
                extra,
            ]
            .concat(),
        ))
    };
    // Qwen2 adds no BOS (llama.cpp's default for the qwen2 pre-tokenizer).
    assert_eq!(run(&[]), "[64,151645]\n");
    assert_ne!(run(&["--no-parse-special"]), "[64,151645]\n");
    assert!(!run(&["--no-parse-special"]).contains("151645"));
    // MiniMind's tokenizer.json (a Hugging Face tokenizer file).
    let minimind = shared("models/minimind-tokenizer/tokenizer.json");
    let ids = stdout(&nucleus(&[
        "tokenize",
        "--model",
        &minimind,
        "--text",
        "<|im_start|>hi",
    ]));
    assert!(ids.starts_with("[1,"), "{ids}");
}

#[test]
fn bad_ids_and_models_are_errors() {
    let out = nucleus(&["detokenize", "--model", &vocab("qwen2"), "--ids", "[1, -2]"]);
    assert_eq!(out.status.code(), Some(2));
    let out = nucleus(&[
        "detokenize",
        "--model",
        &vocab("qwen2"),
        "--ids",
        "[999999]",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("id 999999 at position 0"));
    let out = nucleus(&[
        "tokenize",
        "--model",
        "/nonexistent/model.gguf",
        "--text",
        "x",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let out = nucleus(&["tokenize", "--model", &vocab("qwen2")]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn chat_templates_render_as_their_rules_say() {
    let conversation = temp("conversation.json");
    std::fs::write(
        &conversation,
        r#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]"#,
    )
    .unwrap();
    let c = conversation.to_str().unwrap();
    let render = |model: &str, extra: &[&str]| {
        stdout(&nucleus(
            &[
                &["chat-template", "--model", model, "--messages", c][..],
                extra,
            ]
            .concat(),
        ))
    };
    // Qwen2 (ChatML): every turn `<|im_start|>ROLE\n...<|im_end|>\n`, then the assistant header.
    let qwen = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n";
    assert_eq!(
        render(&vocab("qwen2"), &[]),
        format!("{qwen}<|im_start|>assistant\n")
    );
    assert_eq!(render(&vocab("qwen2"), &["--no-generation-prompt"]), qwen);
    // Phi-3: BOS text, system messages dropped, every user turn followed by the assistant tag.
    assert_eq!(
        render(&vocab("phi-3"), &[]),
        "<s><|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nBye<|end|>\n\
         <|assistant|>\n"
    );
    // MiniMind, with a tool call whose JSON holds ' and < (printed by Python's json.dumps, no
    // HTML escaping).
    let tools = temp("tools.json");
    std::fs::write(
        &tools,
        r#"[{"role": "user", "content": "Find it"},
            {"role": "assistant", "content": null, "tool_calls": [{"type": "function",
              "function": {"name": "search", "arguments": "{\"q\": \"it's <b>\", \"n\": 2}"}}]},
            {"role": "tool", "content": "none"}]"#,
    )
    .unwrap();
    let minimind = shared("models/minimind-tokenizer/tokenizer.json");
    let out = stdout(&nucleus(&[
        "chat-template",
        "--model",
        &minimind,
        "--messages",
        tools.to_str().unwrap(),
    ]));
    assert_eq!(
        out,
        "<|im_start|>user\nFind it<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n\
         <tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"it's <b>\", \"n\": 2}}\n\
         </tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nnone\n</tool_response>\
         <|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    // --chat-template replaces the model's; a broken one names its file and line.
    let template = temp("t.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}[{{ m.role }}]{% endfor %}",
    )
    .unwrap();
    let t = template.to_str().unwrap();
    assert_eq!(
        render(&vocab("qwen2"), &["--chat-template", t]),
        "[system][user][assistant][user]"
    );
    std::fs::write(&template, "line one\n{% if %}").unwrap();
    let out = nucleus(&[
        "chat-template",
        "--model",
        &vocab("qwen2"),
        "--messages",
        c,
        "--chat-template",
        t,
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("t.jinja") && err.contains("line 2"), "{err}");
    // A model without a template says so.
    let out = nucleus(&[
        "chat-template",
        "--model",
        &shared("models/stories260K.gguf"),
        "--messages",
        c,
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no chat template"));
    // An empty conversation is an error.
    let empty = temp("empty.json");
    std::fs::write(&empty, "[]").unwrap();
    let out = nucleus(&[
        "chat-template",
        "--model",
        &vocab("qwen2"),
        "--messages",
        empty.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds no messages"));
}
