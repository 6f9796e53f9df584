//! Chat templates: found as transformers finds them, rendered as `apply_chat_template` renders
//! them. Every expected string is written by hand from the template's own rules (the templates
//! are quoted in the comments), not copied from the renderer.

use std::path::{Path, PathBuf};

use nucleus_engine::chat_template::{python_float, strftime_now, tojson, JsonOptions};
use nucleus_engine::{messages_from_openai, ChatTemplate, EngineError, RenderOptions};
use serde_json::{json, Value};

fn shared(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(rel)
}

fn qwen2() -> ChatTemplate {
    ChatTemplate::for_model(&shared("models/vocab/ggml-vocab-qwen2.gguf"))
        .unwrap()
        .expect("the Qwen2 GGUF has a chat template")
}

fn phi3() -> ChatTemplate {
    ChatTemplate::for_model(&shared("models/vocab/ggml-vocab-phi-3.gguf"))
        .unwrap()
        .expect("the Phi-3 GGUF has a chat template")
}

fn minimind() -> ChatTemplate {
    // Through the tokenizer.json path: its folder is searched.
    ChatTemplate::for_model(&shared("models/minimind-tokenizer/tokenizer.json"))
        .unwrap()
        .expect("MiniMind's tokenizer_config.json has a chat template")
}

fn msgs(v: Value) -> Vec<Value> {
    messages_from_openai(&v).unwrap()
}

fn gen() -> RenderOptions {
    RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    }
}

/// A fresh scratch folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("chat_template")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn template_message(e: EngineError) -> String {
    match e {
        EngineError::ChatTemplate(m) => m,
        other => panic!("expected a chat-template error, got {other:?}"),
    }
}

// Qwen2 (GGUF metadata): no newlines in the template, so trim / lstrip change nothing.
// {% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}
//   {{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}
// {{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}
// {% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}

#[test]
fn qwen2_gguf_template_system_user_with_generation_prompt() {
    let t = qwen2();
    assert!(t
        .origin
        .ends_with("ggml-vocab-qwen2.gguf: tokenizer.chat_template"));
    let m = msgs(json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"}
    ]));
    assert_eq!(
        t.render(&m, &gen()).unwrap(),
        "<|im_start|>system\nYou are terse.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn qwen2_gguf_template_multi_turn_without_generation_prompt_adds_default_system() {
    let m = msgs(json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"}
    ]));
    assert_eq!(
        qwen2().render(&m, &RenderOptions::default()).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n\
         <|im_start|>user\n2+2?<|im_end|>\n"
    );
}

// Phi-3 (GGUF metadata):
// {{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}
//   {{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}
// {% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\n'}}
// {% endif %}{% endfor %}
// System messages are dropped; the generation prompt is always there (after each user turn).

#[test]
fn phi3_gguf_template_drops_system_and_prints_bos() {
    let m = msgs(json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"}
    ]));
    let opts = RenderOptions {
        bos_token: Some("<s>".into()),
        eos_token: Some("<|endoftext|>".into()),
        ..gen()
    };
    assert_eq!(
        phi3().render(&m, &opts).unwrap(),
        "<s><|user|>\nHi<|end|>\n<|assistant|>\n"
    );
}

#[test]
fn phi3_gguf_template_multi_turn_and_undefined_bos_prints_nothing() {
    let m = msgs(json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"}
    ]));
    assert_eq!(
        phi3().render(&m, &RenderOptions::default()).unwrap(),
        "<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n"
    );
}

// MiniMind (tokenizer_config.json): every tag is `{%-` / `{{-`, so with trim_blocks all the
// template's own whitespace disappears and only the quoted strings are printed.

#[test]
fn minimind_template_system_user_with_generation_prompt() {
    let t = minimind();
    assert!(t.origin.ends_with("tokenizer_config.json"), "{}", t.origin);
    let m = msgs(json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"}
    ]));
    // No tools: the system message once at the top; in the loop the first system message
    // prints nothing; the generation prompt without open_thinking closes an empty think block.
    assert_eq!(
        t.render(&m, &gen()).unwrap(),
        "<|im_start|>system\nYou are terse.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
}

#[test]
fn minimind_open_thinking_kwarg_leaves_the_think_block_open() {
    let m = msgs(json!([{"role": "user", "content": "Hi"}]));
    let with = |v: Value| {
        let mut opts = gen();
        opts.kwargs.insert("open_thinking".into(), v);
        minimind().render(&m, &opts).unwrap()
    };
    // `open_thinking is defined and open_thinking is true` -> '<think>\n'
    assert_eq!(
        with(json!(true)),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    );
    assert_eq!(
        with(json!(false)),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
}

#[test]
fn minimind_multi_turn_splits_reasoning_with_python_string_methods() {
    // The assistant's content holds a think block: reasoning_content =
    // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') = "plan",
    // content = content.split('</think>')[-1].lstrip('\n') = "Answer".
    let m = msgs(json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nAnswer"}
    ]));
    assert_eq!(
        minimind().render(&m, &RenderOptions::default()).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n\
         <|im_start|>user\nWhy?<|im_end|>\n\
         <|im_start|>assistant\n<think>\nplan\n</think>\n\nAnswer<|im_end|>\n"
    );
}

#[test]
fn minimind_tool_call_arguments_and_tools_print_through_python_tojson() {
    let request = json!({"messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Find it"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {
                "name": "search",
                "arguments": "{\"q\": \"it's <b> & co\", \"n\": 1.0, \"k\": 3}"
            }}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "found é 中"}
    ]});
    let tools = json!([{"type": "function", "function": {
        "name": "search",
        "description": "Find <things> & 'stuff'",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}
    }}]);
    let opts = RenderOptions {
        tools: Some(tools),
        ..gen()
    };
    let out = minimind().render(&msgs(request), &opts).unwrap();
    let expected = String::new()
        // tools: system header, the system message and '\n\n', the tools block.
        + "<|im_start|>system\nS\n\n"
        + "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        + "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        + "\n{\"type\": \"function\", \"function\": {\"name\": \"search\", "
        + "\"description\": \"Find <things> & 'stuff'\", \"parameters\": {\"type\": \"object\", "
        + "\"properties\": {\"q\": {\"type\": \"string\"}}}}}"
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        + "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        + "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        + "<|im_start|>user\nFind it<|im_end|>\n"
        // null content -> '' (not a string); no '\n' before the first call (content empty);
        // the arguments, parsed from the OpenAI string, printed with tojson.
        + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        + "<tool_call>\n{\"name\": \"search\", \"arguments\": "
        + "{\"q\": \"it's <b> & co\", \"n\": 1.0, \"k\": 3}}\n</tool_call><|im_end|>\n"
        // the tool message after a non-tool one opens a user turn; the last one closes it.
        + "<|im_start|>user\n<tool_response>\nfound é 中\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    assert_eq!(out, expected);
}

// tojson, as Python's json.dumps(x, ensure_ascii=False, ...).

fn render_one(source: &str, x: Value) -> String {
    let mut opts = RenderOptions::default();
    opts.kwargs.insert("x".into(), x);
    ChatTemplate::new("test", source)
        .render(&[], &opts)
        .unwrap()
}

fn tricky() -> Value {
    serde_json::from_str(
        r#"{"z": {"b": 1, "a": [1.0, 0.5, 1e20, -2, true, null]},
            "s": "it's <a> & é 中 \"q\"\n\u0001", "e": [], "o": {}}"#,
    )
    .unwrap()
}

#[test]
fn tojson_is_python_json_dumps_insertion_order_no_html_escaping() {
    assert_eq!(
        render_one("{{ x|tojson }}", tricky()),
        r#"{"z": {"b": 1, "a": [1.0, 0.5, 1e+20, -2, true, null]}, "s": "it's <a> & é 中 \"q\"\n\u0001", "e": [], "o": {}}"#
    );
}

#[test]
fn tojson_indent_uses_python_separators_and_keeps_empty_containers() {
    let expected = r#"{
  "z": {
    "b": 1,
    "a": [
      1.0,
      0.5,
      1e+20,
      -2,
      true,
      null
    ]
  },
  "s": "it's <a> & é 中 \"q\"\n\u0001",
  "e": [],
  "o": {}
}"#;
    assert_eq!(render_one("{{ x|tojson(indent=2) }}", tricky()), expected);
    // A string indent is used as it is; indent=0 puts each item on its own line, unindented.
    assert_eq!(
        render_one("{{ x|tojson(indent='\t') }}", json!({"a": [1]})),
        "{\n\t\"a\": [\n\t\t1\n\t]\n}"
    );
    assert_eq!(
        render_one("{{ x|tojson(indent=0) }}", json!([1, 2])),
        "[\n1,\n2\n]"
    );
}

#[test]
fn tojson_sort_keys_ensure_ascii_separators_and_positional_arguments() {
    assert_eq!(
        render_one(
            "{{ x|tojson(sort_keys=true) }}",
            json!({"b": 1, "a": {"d": 2, "c": 3}})
        ),
        r#"{"a": {"c": 3, "d": 2}, "b": 1}"#
    );
    assert_eq!(
        render_one(
            "{{ x|tojson(ensure_ascii=true) }}",
            json!(["é 中 😀", "\u{7f}"])
        ),
        r#"["\u00e9 \u4e2d \ud83d\ude00", "\u007f"]"#
    );
    assert_eq!(
        render_one(
            "{{ x|tojson(separators=[',', ':']) }}",
            json!({"a": [1, 2]})
        ),
        r#"{"a":[1,2]}"#
    );
    // transformers' signature is tojson(x, ensure_ascii=False, indent=None, ...): the first
    // positional argument is ensure_ascii.
    assert_eq!(
        render_one("{{ x|tojson(false, 1) }}", json!({"a": "é"})),
        "{\n \"a\": \"é\"\n}"
    );
}

#[test]
fn tojson_floats_print_as_python_repr() {
    for (f, s) in [
        (1.0, "1.0"),
        (0.5, "0.5"),
        (1e20, "1e+20"),
        (1e16, "1e+16"),
        (1e15, "1000000000000000.0"),
        (123.456, "123.456"),
        (0.0001, "0.0001"),
        (1e-5, "1e-05"),
        (1.5e300, "1.5e+300"),
        (-2.5e-7, "-2.5e-07"),
        (0.1 + 0.2, "0.30000000000000004"),
        (-0.0, "-0.0"),
        (f64::NAN, "NaN"),
        (f64::INFINITY, "Infinity"),
        (f64::NEG_INFINITY, "-Infinity"),
    ] {
        assert_eq!(python_float(f), s, "{f:e}");
    }
    let v = json!({"k": [1, 2.0], "s": "<&>"});
    assert_eq!(
        tojson(&v, &JsonOptions::default()).unwrap(),
        r#"{"k": [1, 2.0], "s": "<&>"}"#
    );
}

#[test]
fn templates_print_none_true_false_as_python() {
    assert_eq!(
        render_one(
            "{{ x.a }} {{ x.b }} {{ x.c }} {{ x.d }} {{ x.e }}",
            json!({"a": null, "b": true, "c": false, "d": 2.0, "e": 3})
        ),
        "None True False 2.0 3"
    );
}

#[test]
fn generation_tags_render_their_body() {
    let t = ChatTemplate::new(
        "gen",
        "{% for m in messages %}{%- generation -%} [{{ m.content }}] {%- endgeneration %}{% endfor %}",
    );
    let m = msgs(json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]));
    assert_eq!(t.render(&m, &RenderOptions::default()).unwrap(), "[a][b]");
}

#[test]
fn trim_blocks_and_lstrip_blocks_as_hugging_face_sets_them() {
    // trim_blocks eats the newline after a block tag, lstrip_blocks the indentation before
    // one; a trailing newline at the end of the template is dropped (keep_trailing_newline off).
    let t = ChatTemplate::new(
        "ws",
        "{% for m in messages %}\n    {% if true %}\n<{{ m.content }}>\n    {% endif %}\n{% endfor %}\n",
    );
    let m = msgs(json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]));
    assert_eq!(
        t.render(&m, &RenderOptions::default()).unwrap(),
        "<a>\n<b>\n"
    );
}

// Finding templates.

#[test]
fn chat_template_jinja_beside_tokenizer_config_takes_precedence() {
    let dir = scratch("precedence");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": "CONFIG"}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("chat_template.json"),
        r#"{"chat_template": "LEGACY"}"#,
    )
    .unwrap();
    let t = ChatTemplate::for_model(&dir).unwrap().unwrap();
    assert_eq!(t.source, "CONFIG");
    assert!(t.origin.ends_with("tokenizer_config.json"));

    std::fs::write(dir.join("chat_template.jinja"), "JINJA").unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    let t = ChatTemplate::for_model(&dir.join("tokenizer.json"))
        .unwrap()
        .unwrap();
    assert_eq!(t.source, "JINJA");
    assert!(t.origin.ends_with("chat_template.jinja"));

    // The processor's legacy chat_template.json only when the tokenizer has no template.
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"bos_token": "<s>"}"#).unwrap();
    let t = ChatTemplate::for_model(&dir).unwrap().unwrap();
    assert_eq!(t.source, "LEGACY");

    std::fs::remove_file(dir.join("chat_template.json")).unwrap();
    assert_eq!(ChatTemplate::for_model(&dir).unwrap(), None);
}

#[test]
fn additional_chat_templates_files_are_named_templates() {
    let dir = scratch("additional");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": "CONFIG"}"#,
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("additional_chat_templates")).unwrap();
    std::fs::write(
        dir.join("additional_chat_templates/tool_use.jinja"),
        "TOOLS",
    )
    .unwrap();
    std::fs::write(dir.join("chat_template.jinja"), "JINJA").unwrap();
    let named = ChatTemplate::for_model_named(&dir, Some("tool_use"))
        .unwrap()
        .unwrap();
    assert_eq!(named.source, "TOOLS");
    assert_eq!(
        ChatTemplate::for_model(&dir).unwrap().unwrap().source,
        "JINJA"
    );
}

#[test]
fn tokenizer_config_list_of_named_templates() {
    let dir = scratch("named");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}"#,
    )
    .unwrap();
    assert_eq!(ChatTemplate::for_model(&dir).unwrap().unwrap().source, "D");
    let t = ChatTemplate::for_model_named(&dir, Some("tool_use"))
        .unwrap()
        .unwrap();
    assert_eq!(t.source, "T");
    assert!(t.origin.contains("`tool_use`"), "{}", t.origin);
    let e = template_message(ChatTemplate::for_model_named(&dir, Some("rag")).unwrap_err());
    assert!(
        e.contains("`rag`") && e.contains("`default`, `tool_use`"),
        "{e}"
    );

    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "tool_use", "template": "T"}]}"#,
    )
    .unwrap();
    let e = template_message(ChatTemplate::for_model(&dir).unwrap_err());
    assert!(e.contains("none named `default`"), "{e}");

    std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": 3}"#).unwrap();
    let e = template_message(ChatTemplate::for_model(&dir).unwrap_err());
    assert!(e.contains("neither a string nor a list"), "{e}");
}

#[test]
fn from_file_reads_jinja_or_a_json_config() {
    let dir = scratch("from_file");
    std::fs::write(dir.join("t.jinja"), "{{ messages|length }}").unwrap();
    let t = ChatTemplate::from_file(&dir.join("t.jinja")).unwrap();
    assert_eq!(
        t.render(&msgs(json!([])), &RenderOptions::default())
            .unwrap(),
        "0"
    );
    std::fs::write(dir.join("c.json"), r#"{"chat_template": "X"}"#).unwrap();
    assert_eq!(
        ChatTemplate::from_file(&dir.join("c.json")).unwrap().source,
        "X"
    );
    assert!(matches!(
        ChatTemplate::from_file(&dir.join("missing.jinja")),
        Err(EngineError::Io { .. })
    ));
}

#[test]
fn gguf_without_the_named_template_is_an_error_naming_the_key() {
    let path = shared("models/vocab/ggml-vocab-qwen2.gguf");
    let e = template_message(ChatTemplate::for_model_named(&path, Some("rag")).unwrap_err());
    assert!(e.contains("tokenizer.chat_template.rag"), "{e}");
}

// Errors.

#[test]
fn syntax_error_names_the_origin_and_line() {
    let dir = scratch("syntax");
    let path = dir.join("chat_template.jinja");
    std::fs::write(
        &path,
        "{{ bos_token }}\n{% for m in messages %}\n{{ m.content }\n",
    )
    .unwrap();
    let t = ChatTemplate::for_model(&dir).unwrap().unwrap();
    let e = template_message(t.render(&[], &RenderOptions::default()).unwrap_err());
    assert!(e.contains("chat_template.jinja"), "{e}");
    assert!(e.contains("line 3"), "{e}");
    assert!(e.contains("syntax error"), "{e}");
}

#[test]
fn raise_exception_gives_its_message() {
    let t = ChatTemplate::new(
        "tokenizer_config.json",
        "{% for m in messages %}\n{% if m.role == 'tool' %}\n{{ raise_exception('Tool messages are not supported!') }}\n{% endif %}\n{% endfor %}",
    );
    let m = msgs(json!([{"role": "tool", "content": "x"}]));
    let e = template_message(t.render(&m, &RenderOptions::default()).unwrap_err());
    assert!(
        e.starts_with(
            "tokenizer_config.json, line 3: raise_exception: Tool messages are not supported!"
        ),
        "{e}"
    );
}

#[test]
fn reserved_kwargs_and_unknown_methods_are_errors() {
    let t = ChatTemplate::new("t", "{{ messages }}");
    let mut opts = RenderOptions::default();
    opts.kwargs.insert("messages".into(), json!([]));
    assert!(template_message(t.render(&[], &opts).unwrap_err()).contains("`messages`"));
    let t = ChatTemplate::new("t", "{{ 'a'.no_such_method() }}");
    let e = template_message(t.render(&[], &RenderOptions::default()).unwrap_err());
    assert!(e.starts_with("t, line 1:"), "{e}");
}

#[test]
fn deeply_nested_messages_are_refused_without_overflowing_the_stack() {
    // serde_json refuses text nested deeper than 128 levels.
    let text = format!("{}{}", "[".repeat(200), "]".repeat(200));
    assert!(serde_json::from_str::<Value>(&text).is_err());
    // A value built in code is refused by the renderer.
    let mut v = json!("x");
    for _ in 0..100_000 {
        v = Value::Array(vec![v]);
    }
    // (Not json!: it serialises its values recursively.)
    let mut message = serde_json::Map::new();
    message.insert("role".into(), json!("user"));
    message.insert("content".into(), v);
    let m = vec![Value::Object(message)];
    let e = template_message(
        ChatTemplate::new("t", "{{ messages }}")
            .render(&m, &RenderOptions::default())
            .unwrap_err(),
    );
    assert!(
        e.contains("message 0") && e.contains("deeper than 128"),
        "{e}"
    );
    // Dropping a 100,000-deep serde_json value recurses; leak it instead.
    std::mem::forget(m);
}

// OpenAI messages.

#[test]
fn openai_text_parts_are_joined_with_newlines() {
    let m = msgs(json!([{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}
    ], "name": "u1"}]));
    assert_eq!(
        m,
        vec![json!({"role": "user", "content": "a\nb", "name": "u1"})]
    );
}

#[test]
fn openai_bad_shapes_are_typed_errors_naming_the_message() {
    let invalid = |v: Value| match messages_from_openai(&v) {
        Err(EngineError::InvalidRequest(m)) => m,
        other => panic!("expected InvalidRequest, got {other:?}"),
    };
    assert!(invalid(json!("hi")).contains("neither a list"));
    assert!(invalid(json!({"messages": 3})).contains("not a list"));
    assert!(
        invalid(json!([{"role": "user", "content": "a"}, {"content": "b"}]))
            .contains("message 1 has no `role`")
    );
    assert!(invalid(json!([{"role": "wizard", "content": "b"}])).contains("unknown role `wizard`"));
    assert!(invalid(json!([{"role": "user", "content": 3}])).contains("message 0: `content`"));
    assert!(invalid(json!([{"role": "user"}])).contains("message 0 (user) has no content"));
    assert!(
        invalid(json!([{"role": "user", "content": [{"type": "text"}]}]))
            .contains("content part 0")
    );
    assert!(invalid(json!([7])).contains("message 0 is not an object"));
    assert!(invalid(
        json!([{"role": "assistant", "content": null, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}
        ]}])
    )
    .contains("message 0, tool call 0"));
    match messages_from_openai(&json!([{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:..."}}
    ]}])) {
        Err(EngineError::InvalidRequest(m)) => assert!(m.contains("`image_url`"), "{m}"),
        other => panic!("expected InvalidRequest, got {other:?}"),
    }
}

#[test]
fn openai_tool_call_arguments_become_objects() {
    let m = msgs(json!([{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": 2}"}},
        {"type": "function", "function": {"name": "g", "arguments": ""}},
        {"type": "function", "function": {"name": "h", "arguments": {"x": 1}}}
    ]}]));
    let calls = m[0]["tool_calls"].as_array().unwrap();
    assert_eq!(
        serde_json::to_string(&calls[0]["function"]["arguments"]).unwrap(),
        r#"{"b":1,"a":2}"#
    );
    assert_eq!(calls[1]["function"]["arguments"], json!({}));
    assert_eq!(calls[2]["function"]["arguments"], json!({"x": 1}));
}

#[test]
fn strftime_now_formats_utc_as_c_strftime() {
    assert_eq!(strftime_now("%d %b %Y", 0).unwrap(), "01 Jan 1970");
    // 1,700,000,000 s = Tuesday 2023-11-14 22:13:20 UTC, day 318 of the year.
    assert_eq!(
        strftime_now("%A %a %-d %B %Y %H:%M:%S %j %I%p %y %e%%", 1_700_000_000).unwrap(),
        "Tuesday Tue 14 November 2023 22:13:20 318 10PM 23 14%"
    );
    // 2024-03-01 00:00:00 UTC: a leap year's day 61.
    assert_eq!(
        strftime_now("%Y-%m-%d %j", 1_709_251_200).unwrap(),
        "2024-03-01 061"
    );
    assert!(strftime_now("%Q", 0).unwrap_err().contains("%Q"));
    // The template global works (its value depends on the clock).
    let out = ChatTemplate::new("t", "{{ strftime_now('%Y') }}")
        .render(&[], &RenderOptions::default())
        .unwrap();
    assert_eq!(out.len(), 4);
}

#[test]
fn kwargs_bos_token_wins_over_the_field_as_in_transformers() {
    // transformers renders with {**special_tokens_map, **kwargs}.
    let m = msgs(json!([{"role": "user", "content": "Hi"}]));
    let mut opts = RenderOptions {
        bos_token: Some("<s>".into()),
        ..Default::default()
    };
    opts.kwargs.insert("bos_token".into(), json!("<BOS>"));
    assert_eq!(
        phi3().render(&m, &opts).unwrap(),
        "<BOS><|user|>\nHi<|end|>\n<|assistant|>\n"
    );
}

#[test]
fn templates_that_run_or_write_without_end_are_errors() {
    let messages = [serde_json::json!({"role": "user", "content": "x"})];
    let opts = RenderOptions::default();
    // 10^8 loop steps: past the fuel.
    let nested = ChatTemplate::new(
        "nested.jinja",
        "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
    );
    let e = nested.render(&messages, &opts).unwrap_err().to_string();
    assert!(e.contains("nested.jinja"), "{e}");
    // 100 MB of output: past the 64 MiB cap, refused as it is written.
    let long = ChatTemplate::new(
        "long.jinja",
        "{% for i in range(3000) %}{{ 'x' * 40000 }}{% endfor %}",
    );
    let e = long.render(&messages, &opts).unwrap_err().to_string();
    assert!(
        e.contains("long.jinja: the rendered text is longer than 67108864 bytes"),
        "{e}"
    );
}
