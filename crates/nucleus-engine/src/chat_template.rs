//! Chat templates, found and rendered as Hugging Face's `apply_chat_template` does.
//!
//! A chat model's prompt is a conversation rendered by a Jinja template that ships with the
//! model. [`ChatTemplate::for_model`] finds it (a model folder, a tokenizer.json beside one, or
//! a GGUF file), [`ChatTemplate::from_file`] reads one named by the user, and
//! [`ChatTemplate::render`] renders a list of messages with [`RenderOptions`] (generation
//! prompt, BOS / EOS strings, tools, extra variables such as Qwen3's `enable_thinking`).
//! [`messages_from_openai`] turns an OpenAI chat-completions `messages` list into the messages a
//! template expects, as vLLM does.
//!
//! Rendering follows transformers' `utils/chat_template_utils.py`
//! (`_cached_compile_jinja_template` and `render_jinja_template`), on minijinja instead of
//! Jinja2:
//!
//! - `trim_blocks` and `lstrip_blocks` on, `keep_trailing_newline` off (Jinja2's default, which
//!   transformers keeps), no HTML auto-escaping;
//! - the `loopcontrols` extension (`{% break %}`, `{% continue %}`); transformers'
//!   `{% generation %}` … `{% endgeneration %}` tag (which only marks assistant text for
//!   `return_assistant_tokens_mask`) renders its body unchanged;
//! - the globals `raise_exception(message)` (a [`EngineError::ChatTemplate`] carrying the
//!   message) and `strftime_now(format)` (see [`strftime_now`]'s rules);
//! - the `tojson` filter of transformers, which is Python's `json.dumps(x, ensure_ascii=False,
//!   indent=None, separators=None, sort_keys=False)` rather than Jinja's HTML-safe one (see
//!   [`tojson`]);
//! - Python's string methods (`.strip()`, `.startswith()`, `.split()`, …) through
//!   minijinja-contrib's `pycompat`, and Python's spelling of `None`, `True` and `False` when a
//!   template prints them.
//!
//! What differs from Jinja2 is minijinja's: a few rarely used Jinja2 / Python features are
//! missing, and errors are minijinja's messages.

use std::fmt::Write as _;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{AutoEscape, Environment, Error as JinjaError, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::error::{bounded, quote, shown_path, EngineError, Result};

/// The deepest nesting of arrays and objects accepted in the messages, tools and extra
/// variables given to [`ChatTemplate::render`], and printed by [`tojson`]: serde_json's own
/// parsing limit (128), so whatever serde_json parsed from text passes, and a value built deeper
/// in code is refused instead of overflowing the stack.
pub const MAX_JSON_DEPTH: usize = 128;

/// The default template's name among named templates (transformers' `get_chat_template`).
pub const DEFAULT_TEMPLATE_NAME: &str = "default";

/// A chat template: its Jinja source and where it came from.
///
/// `origin` names the template in every error: a file path, `DIR/tokenizer_config.json` (with
/// the template's name when it was one of several), or `FILE.gguf: tokenizer.chat_template`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplate {
    /// Where the template came from (see the type's doc).
    pub origin: String,
    /// The Jinja source.
    pub source: String,
}

/// What [`ChatTemplate::render`] passes to a template besides the messages.
///
/// The template sees the variables `messages`, `tools` (`None` when not given, as transformers
/// passes it), `documents` (always `None`), `add_generation_prompt`, `bos_token` and
/// `eos_token` (each defined only when given, as transformers' special-tokens map has only the
/// tokens a tokenizer defines), and every entry of `kwargs`. An entry of `kwargs` named
/// `bos_token` or `eos_token` wins over the field (transformers merges
/// `{**special_tokens_map, **kwargs}`); one named `messages`, `tools`, `documents` or
/// `add_generation_prompt` is an error (in Python, a duplicate keyword argument).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderOptions {
    /// End the prompt with the assistant turn's header (the template decides what that is).
    pub add_generation_prompt: bool,
    /// The BOS token's text (`{{ bos_token }}`), if the tokenizer has one.
    pub bos_token: Option<String>,
    /// The EOS token's text (`{{ eos_token }}`), if the tokenizer has one.
    pub eos_token: Option<String>,
    /// The tools (JSON schemas, usually a list of `{"type": "function", "function": {...}}`).
    pub tools: Option<Json>,
    /// Extra variables (the CLI's `--chat-template-kwargs`), e.g. `{"enable_thinking": false}`.
    pub kwargs: Map<String, Json>,
}

/// A [`EngineError::ChatTemplate`] with a [`bounded`] message.
fn template_error(message: impl Into<String>) -> EngineError {
    EngineError::ChatTemplate(bounded(message))
}

impl ChatTemplate {
    /// A template from its source and a name for its origin (used in errors).
    pub fn new(origin: impl Into<String>, source: impl Into<String>) -> Self {
        Self {
            origin: origin.into(),
            source: source.into(),
        }
    }

    /// The template in `path` (the CLI's `--chat-template FILE`).
    ///
    /// A file whose name ends in `.json` is read as a `tokenizer_config.json` or
    /// `chat_template.json`: its `chat_template` field (a string, or a list of `{"name",
    /// "template"}`, of which `default` is taken). Any other file is the Jinja source itself.
    ///
    /// # Errors
    ///
    /// [`EngineError::Io`] when the file cannot be read; [`EngineError::ChatTemplate`] when it is
    /// not UTF-8, or a JSON file without a usable `chat_template`.
    pub fn from_file(path: &Path) -> Result<Self> {
        if path.extension().is_some_and(|e| e == "json") {
            return match from_json_file(path, None)? {
                Some(t) => Ok(t),
                None => Err(template_error(format!(
                    "{} has no `chat_template`",
                    shown_path(path)
                ))),
            };
        }
        read_text(path).map(|source| Self::new(shown_path(path), source))
    }

    /// The default template of the model at `path`: [`ChatTemplate::for_model_named`] with no
    /// name.
    pub fn for_model(path: &Path) -> Result<Option<Self>> {
        Self::for_model_named(path, None)
    }

    /// The template named `name` (`None`: the default) of the model at `path`, or `None` when
    /// the model has none.
    ///
    /// `path` is a GGUF file (a file starting with the magic `GGUF`), a model folder, or a file
    /// in one (a tokenizer.json: then its folder is searched).
    ///
    /// - A GGUF file: the metadata key `tokenizer.chat_template`, or
    ///   `tokenizer.chat_template.<name>` for a named one (llama.cpp's keys), read with the
    ///   checked header parser [`crate::gguf::read_content`]; no tensor is loaded.
    /// - A folder, in transformers' precedence (`tokenization_utils_base.py`,
    ///   `PreTrainedTokenizerBase._from_pretrained`: "If independent chat template file(s)
    ///   exist, they take priority over template entries in the tokenizer config"):
    ///   1. the separate template files `chat_template.jinja` (the default) and
    ///      `additional_chat_templates/<name>.jinja` (named ones): when any of them exists, they
    ///      alone are the model's templates;
    ///   2. else `tokenizer_config.json`'s `chat_template`: a string (the default), or a list
    ///      of `{"name", "template"}` objects;
    ///   3. else the legacy processor file `chat_template.json` (`{"chat_template": ...}`,
    ///      `processing_utils.py`, `ProcessorMixin.get_processor_dict`): a tokenizer never reads
    ///      it, so it is only the fallback for a folder whose tokenizer has no template.
    ///
    /// Among named templates, `name` picks one and `None` picks `default` (transformers'
    /// `get_chat_template`; its other rule, `tool_use` when tools are given, is the caller's:
    /// pass `Some("tool_use")`).
    ///
    /// # Errors
    ///
    /// [`EngineError::Io`] when a file cannot be read; [`EngineError::InvalidModel`] for a
    /// corrupt GGUF header; [`EngineError::ChatTemplate`] for a tokenizer_config.json that is not
    /// JSON, a `chat_template` of the wrong type, named templates without the one asked for
    /// (the message lists the names), or a template that is not UTF-8.
    pub fn for_model_named(path: &Path, name: Option<&str>) -> Result<Option<Self>> {
        if path.is_file() {
            if is_gguf(path)? {
                return from_gguf(path, name);
            }
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            return from_folder(dir, name);
        }
        if path.is_dir() {
            return from_folder(path, name);
        }
        Err(EngineError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
        })
    }

    /// Renders `messages` with `opts`, as transformers' `render_jinja_template` does (see the
    /// module doc for the environment).
    ///
    /// Each message is passed as given (role, content and any other field, e.g. `tool_calls`),
    /// objects keeping their keys' order.
    ///
    /// # Errors
    ///
    /// [`EngineError::ChatTemplate`] naming the origin, the line and the problem when the
    /// template does not parse, fails while rendering, or calls `raise_exception` (its message
    /// is given); when an input nests deeper than [`MAX_JSON_DEPTH`]; when `opts.kwargs` holds a
    /// reserved name.
    pub fn render(&self, messages: &[Json], opts: &RenderOptions) -> Result<String> {
        for (i, m) in messages.iter().enumerate() {
            check_depth(m, &format!("message {i}"))?;
        }
        if let Some(tools) = &opts.tools {
            check_depth(tools, "the tools")?;
        }
        let mut ctx: Map<String, Json> = Map::new();
        if let Some(b) = &opts.bos_token {
            ctx.insert("bos_token".into(), Json::String(b.clone()));
        }
        if let Some(e) = &opts.eos_token {
            ctx.insert("eos_token".into(), Json::String(e.clone()));
        }
        for (k, v) in &opts.kwargs {
            if matches!(
                k.as_str(),
                "messages" | "tools" | "documents" | "add_generation_prompt"
            ) {
                return Err(template_error(format!(
                    "the extra variable {} is one the renderer sets itself",
                    quote(k.as_bytes())
                )));
            }
            check_depth(v, &format!("the extra variable {}", quote(k.as_bytes())))?;
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert("tools".into(), opts.tools.clone().unwrap_or(Json::Null));
        ctx.insert("documents".into(), Json::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(opts.add_generation_prompt),
        );

        let env = environment();
        let source = rewrite_generation_tags(&self.source);
        let tmpl = env
            .template_from_named_str(&self.origin, &source)
            .map_err(|e| self.error(&e))?;
        let mut out = CappedOutput {
            bytes: Vec::new(),
            over: false,
        };
        match tmpl.render_captured_to(Value::from_serialize(&ctx), &mut out) {
            Ok(_) => {}
            Err(_) if out.over => {
                return Err(template_error(format!(
                    "{}: the rendered text is longer than {MAX_RENDERED_BYTES} bytes",
                    self.origin
                )))
            }
            Err(e) => return Err(self.error(&e)),
        }
        // The output is written from `str`s only.
        String::from_utf8(out.bytes)
            .map_err(|e| template_error(format!("{}: rendered text: {e}", self.origin)))
    }

    /// The template's error for a minijinja error: origin, line, kind and detail, one line.
    fn error(&self, e: &JinjaError) -> EngineError {
        let mut msg = self.origin.clone();
        // The innermost error names the real place (an include or macro call wraps it).
        let mut inner: &JinjaError = e;
        while let Some(src) = std::error::Error::source(inner) {
            match src.downcast_ref::<JinjaError>() {
                Some(next) => inner = next,
                None => break,
            }
        }
        if let Some(line) = inner.line().or(e.line()) {
            let _ = write!(msg, ", line {line}");
        }
        match (inner.kind(), inner.detail()) {
            (ErrorKind::InvalidOperation, Some(d)) if d.starts_with(RAISED) => {
                let _ = write!(msg, ": raise_exception: {}", &d[RAISED.len()..]);
            }
            (kind, Some(d)) => {
                let _ = write!(msg, ": {kind}: {d}");
            }
            (kind, None) => {
                let _ = write!(msg, ": {kind}");
            }
        }
        template_error(msg)
    }
}

/// The most bytes a rendered conversation may have (64 MiB): a template that writes more (a
/// loop without end in sight) is an error, not a prompt no model could take.
pub const MAX_RENDERED_BYTES: usize = 64 << 20;

/// The most instructions one rendering may run (minijinja's fuel): about 2 s of a loop that
/// does nothing; real templates over long conversations need well under 10^6. A template that
/// runs longer (nested loops over `range`) is an error naming it. Memory a template builds in
/// its own variables (a string doubled 40 times) is not bounded: a template is code, trusted as
/// transformers trusts it.
pub const MAX_TEMPLATE_FUEL: u64 = 50_000_000;

/// The rendered text, refusing more than [`MAX_RENDERED_BYTES`].
struct CappedOutput {
    bytes: Vec<u8>,
    over: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() > MAX_RENDERED_BYTES - self.bytes.len() {
            self.over = true;
            return Err(std::io::Error::other("the rendered text is too long"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The prefix that marks an error raised by the template's `raise_exception`.
const RAISED: &str = "\u{1}raise_exception\u{1}";

/// The minijinja environment of transformers' `_cached_compile_jinja_template`.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(MAX_TEMPLATE_FUEL));
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson_filter);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<Value, JinjaError> {
            Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                format!("{RAISED}{message}"),
            ))
        },
    );
    env.add_function(
        "strftime_now",
        |format: String| -> Result<String, JinjaError> {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            strftime_now(&format, secs).map_err(|m| JinjaError::new(ErrorKind::InvalidOperation, m))
        },
    );
    env
}

/// Prints values as Jinja2 on Python does where minijinja's spelling differs: `None`, `True`,
/// `False`; an undefined value prints nothing (Jinja2's default `Undefined`).
fn python_formatter(
    out: &mut minijinja::Output,
    state: &minijinja::State,
    value: &Value,
) -> Result<(), JinjaError> {
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(JinjaError::from),
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(JinjaError::from),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => out.write_str(&python_float(f)).map_err(JinjaError::from),
            Err(_) => minijinja::escape_formatter(out, state, value),
        },
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' `AssistantTracker` extension) as
/// `{% if true %}` / `{% endif %}`, whitespace-control marks kept: the body renders as it is.
fn rewrite_generation_tags(source: &str) -> std::borrow::Cow<'_, str> {
    if !source.contains("generation") {
        return source.into();
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out.into();
        };
        let inner = &tag[2..end];
        let body = inner.trim_start_matches(['-', '+']);
        let body = body.trim_end_matches(['-', '+']);
        let word = body.trim();
        let replacement = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let lead = &inner[..inner.len() - inner.trim_start_matches(['-', '+']).len()];
                let trail = &inner[inner.trim_end_matches(['-', '+']).len()..];
                let _ = write!(out, "{{%{lead} {r} {trail}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out.into()
}

/// Refuses a value nested deeper than [`MAX_JSON_DEPTH`], walking it without recursion.
fn check_depth(v: &Json, what: &str) -> Result<()> {
    let mut stack: Vec<(&Json, usize)> = vec![(v, 1)];
    while let Some((v, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Json>> = match v {
            Json::Array(a) => Box::new(a.iter()),
            Json::Object(o) => Box::new(o.values()),
            _ => continue,
        };
        if depth > MAX_JSON_DEPTH {
            return Err(template_error(format!(
                "{what} nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
            )));
        }
        stack.extend(children.map(|c| (c, depth + 1)));
    }
    Ok(())
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, its arguments positional in that order or by keyword.
fn tojson_filter(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, JinjaError> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(JinjaError::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments (ensure_ascii, indent, separators, sort_keys)",
        ));
    }
    let mut given: [Option<Value>; 4] = Default::default();
    for (slot, v) in given.iter_mut().zip(args.iter()) {
        *slot = Some(v.clone());
    }
    for (i, name) in NAMES.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if given[i].is_some() {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument {name}"),
                ));
            }
            given[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let bad = |m: String| JinjaError::new(ErrorKind::InvalidOperation, m);
    let [ensure_ascii, indent, separators, sort_keys] = given;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.is_integer() => {
            let n = v.as_i64().unwrap_or(0);
            Some(" ".repeat(usize::try_from(n).unwrap_or(0).min(64)))
        }
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                return Err(bad(format!(
                    "tojson: indent must be an int or a string, not {v}"
                )))
            }
        },
    };
    let separators = match separators {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()
                .map_err(|_| bad("tojson: separators must be a pair of strings".into()))?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("tojson: separators must be a pair of strings".into()))?;
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => Some((item, key)),
                Err(_) => return Err(bad("tojson: separators must be a pair of strings".into())),
            }
        }
    };
    let opts = JsonOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        separators: separators.unwrap_or_else(|| {
            let item = if indent.is_some() { "," } else { ", " };
            (item.to_string(), ": ".to_string())
        }),
        indent,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0).map_err(bad)?;
    Ok(out)
}

/// The options of [`tojson`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonOptions {
    /// Escape every non-ASCII character as `\uXXXX` (a surrogate pair above U+FFFF).
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(s)`: each array element and object member on its own line,
    /// indented by `s` once per level (Python's `indent=n` is `n` spaces; `0` or less is `""`).
    pub indent: Option<String>,
    /// The item and key separators: Python's default is `(", ", ": ")`, and `(",", ": ")` when
    /// indenting.
    pub separators: (String, String),
    /// Object members sorted by key (by code point) instead of in insertion order.
    pub sort_keys: bool,
}

impl Default for JsonOptions {
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            separators: (", ".into(), ": ".into()),
            sort_keys: false,
        }
    }
}

/// `value` as Python's `json.dumps(value, ensure_ascii=..., indent=..., separators=...,
/// sort_keys=...)` writes it: the `tojson` filter of every chat template (transformers'
/// `chat_template_utils.py` replaces Jinja's HTML-escaping `tojson` with `json.dumps`).
///
/// - Objects in insertion order (or sorted, `sort_keys`), keys as strings: a number, boolean or
///   `None` key as Python converts it (`1`, `true`, `null`).
/// - Strings: `"` and `\` escaped, `\n`, `\r`, `\t`, `\b`, `\f` as such, other control
///   characters as `\u00XX`; nothing else (no HTML escaping of `<`, `>`, `&`, `'`), unless
///   `ensure_ascii`.
/// - Integers as integers; floats as Python's `repr`: the shortest round-trip digits, with a
///   `.0` when integral (`1.0`), in exponent form `1e+20` from 1e16 and below 1e-4;
///   `NaN`, `Infinity`, `-Infinity` as Python writes them.
/// - Empty arrays and objects are `[]` and `{}` even when indenting.
///
/// The template filter applies this to template values; this function takes a JSON value.
///
/// # Errors
///
/// A value JSON cannot hold (in a template: an undefined value, bytes, a function), or one
/// nested deeper than [`MAX_JSON_DEPTH`].
pub fn tojson(value: &Json, opts: &JsonOptions) -> std::result::Result<String, String> {
    let mut out = String::new();
    write_json(&mut out, &Value::from_serialize(value), opts, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    value: &Value,
    opts: &JsonOptions,
    depth: usize,
) -> std::result::Result<(), String> {
    if depth > MAX_JSON_DEPTH {
        return Err(format!(
            "tojson: the value nests deeper than {MAX_JSON_DEPTH} levels"
        ));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone()).map_err(|e| format!("tojson: {e}"))?;
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or(""), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value
                .try_iter()
                .map_err(|e| format!("tojson: {e}"))?
                .collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.separators.0);
                }
                newline(out, depth + 1);
                write_json(out, item, opts, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut members: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter().map_err(|e| format!("tojson: {e}"))? {
                let item = value.get_item(&key).map_err(|e| format!("tojson: {e}"))?;
                members.push((json_key(&key)?, item));
            }
            if opts.sort_keys {
                members.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if members.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, v)) in members.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.separators.0);
                }
                newline(out, depth + 1);
                write_json_str(out, k, opts.ensure_ascii);
                out.push_str(&opts.separators.1);
                write_json(out, v, opts, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Undefined => {
            return Err("tojson: an undefined value is not JSON serializable".into())
        }
        other => {
            return Err(format!(
                "tojson: a value of type {other} is not JSON serializable"
            ))
        }
    }
    Ok(())
}

/// An object key as Python's `json.dumps` converts it.
fn json_key(key: &Value) -> std::result::Result<String, String> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or("").to_string()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number if key.is_integer() => Ok(key.to_string()),
        ValueKind::Number => f64::try_from(key.clone())
            .map(python_float)
            .map_err(|e| format!("tojson: {e}")),
        other => Err(format!(
            "tojson: keys must be str, int, float, bool or None, not {other}"
        )),
    }
}

/// A JSON string literal as Python's `json.dumps` writes it (`py_encode_basestring` /
/// `py_encode_basestring_ascii`).
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr` writes it: the shortest digits that read back to the same
/// value, in fixed notation when the decimal exponent is in `-4..16` (with `.0` when
/// integral), else as `d.ddde±XX` (at least two exponent digits).
pub fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: `-1.2345e-7`.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if f < 0.0 { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let body = if exp >= 0 {
            let point = exp as usize + 1;
            if digits.len() <= point {
                format!("{digits}{}.0", "0".repeat(point - digits.len()))
            } else {
                format!("{}.{}", &digits[..point], &digits[point..])
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

/// `strftime_now(format)`: the time `unix_secs` (the clock, in UTC: not the local time that
/// Python's `datetime.now()` gives) formatted as C's `strftime` does for the directives
/// `%Y %y %m %d %e %j %H %I %M %S %p %a %A %b %B %h %%` and glibc's unpadded `%-d %-m %-H %-I
/// %-M %-S %-j` (what chat templates use: Llama 3's `"%d %b %Y"`), in the C locale.
///
/// # Errors
///
/// Any other directive, named.
pub fn strftime_now(format: &str, unix_secs: u64) -> std::result::Result<String, String> {
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (unix_secs / 86_400) as i64;
    let secs = unix_secs % 86_400;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut d = chars
            .next()
            .ok_or("strftime_now: the format ends with `%`")?;
        let pad = if d == '-' {
            d = chars
                .next()
                .ok_or("strftime_now: the format ends with `%-`")?;
            false
        } else {
            true
        };
        let num = |out: &mut String, v: i64, width: usize| {
            if pad {
                let _ = write!(out, "{v:0width$}");
            } else {
                let _ = write!(out, "{v}");
            }
        };
        match (d, pad) {
            ('Y', true) => num(&mut out, year, 4),
            ('y', true) => num(&mut out, year.rem_euclid(100), 2),
            ('m', _) => num(&mut out, month, 2),
            ('d', _) => num(&mut out, day, 2),
            ('e', true) => {
                let _ = write!(out, "{day:2}");
            }
            ('j', _) => num(&mut out, yday, 3),
            ('H', _) => num(&mut out, hour as i64, 2),
            ('I', _) => num(&mut out, hour12 as i64, 2),
            ('M', _) => num(&mut out, minute as i64, 2),
            ('S', _) => num(&mut out, second as i64, 2),
            ('p', true) => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            ('a', true) => out.push_str(&DAYS[weekday][..3]),
            ('A', true) => out.push_str(DAYS[weekday]),
            ('b' | 'h', true) => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            ('B', true) => out.push_str(MONTHS[(month - 1) as usize]),
            ('%', true) => out.push('%'),
            _ => {
                return Err(format!(
                    "strftime_now: the directive `%{}{d}` is not supported",
                    if pad { "" } else { "-" }
                ))
            }
        }
    }
    Ok(out)
}

/// Reads a UTF-8 text file.
fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    String::from_utf8(bytes)
        .map_err(|_| template_error(format!("{} is not UTF-8 text", shown_path(path))))
}

/// Whether `path` starts with the GGUF magic.
fn is_gguf(path: &Path) -> Result<bool> {
    use std::io::Read;
    let io = |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut magic = [0u8; 4];
    let mut f = File::open(path).map_err(io)?;
    let mut got = 0;
    while got < 4 {
        let n = f.read(&mut magic[got..]).map_err(io)?;
        if n == 0 {
            return Ok(false);
        }
        got += n;
    }
    Ok(&magic == b"GGUF")
}

/// The template in a GGUF file's metadata.
fn from_gguf(path: &Path, name: Option<&str>) -> Result<Option<ChatTemplate>> {
    let file = File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let content = crate::gguf::read_content(&mut BufReader::new(file), path)?;
    let key = match name {
        None | Some(DEFAULT_TEMPLATE_NAME) => "tokenizer.chat_template".to_string(),
        Some(n) => format!("tokenizer.chat_template.{n}"),
    };
    match crate::gguf::md_str(&content, &key) {
        Ok(Some(s)) => Ok(Some(ChatTemplate::new(
            format!("{}: {key}", shown_path(path)),
            s,
        ))),
        Ok(None) if name.is_some_and(|n| n != DEFAULT_TEMPLATE_NAME) => {
            Err(template_error(format!(
                "{} has no chat template named {} (no key {})",
                shown_path(path),
                quote(name.unwrap_or("").as_bytes()),
                quote(key.as_bytes())
            )))
        }
        Ok(None) => Ok(None),
        Err(m) => Err(crate::error::invalid(path, m)),
    }
}

/// The templates of a folder, in transformers' precedence (see [`ChatTemplate::for_model_named`]).
fn from_folder(dir: &Path, name: Option<&str>) -> Result<Option<ChatTemplate>> {
    // 1. Separate template files.
    let jinja = dir.join("chat_template.jinja");
    let extra_dir = dir.join("additional_chat_templates");
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    if jinja.is_file() {
        files.push((DEFAULT_TEMPLATE_NAME.to_string(), jinja));
    }
    if extra_dir.is_dir() {
        let entries = std::fs::read_dir(&extra_dir).map_err(|source| EngineError::Io {
            path: extra_dir.clone(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| EngineError::Io {
                path: extra_dir.clone(),
                source,
            })?;
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "jinja") && path.is_file() {
                if let Some(stem) = path.file_stem().and_then(|s| s.to_str()) {
                    files.push((stem.to_string(), path.clone()));
                }
            }
        }
    }
    if !files.is_empty() {
        let wanted = name.unwrap_or(DEFAULT_TEMPLATE_NAME);
        return match files.iter().find(|(n, _)| n == wanted) {
            Some((_, path)) => ChatTemplate::from_file(path).map(Some),
            None if name.is_none() => Err(no_default(dir, files.iter().map(|f| &f.0))),
            None => Err(no_such_name(dir, wanted, files.iter().map(|f| &f.0))),
        };
    }
    // 2. tokenizer_config.json.
    let config = dir.join("tokenizer_config.json");
    if config.is_file() {
        if let Some(t) = from_json_file(&config, name)? {
            return Ok(Some(t));
        }
    }
    // 3. The processor's legacy chat_template.json.
    let legacy = dir.join("chat_template.json");
    if legacy.is_file() {
        return from_json_file(&legacy, name);
    }
    Ok(None)
}

fn names_list<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let mut all: Vec<String> = names.map(|n| quote(n.as_bytes())).collect();
    all.truncate(16);
    all.join(", ")
}

fn no_default<'a>(dir: &Path, names: impl Iterator<Item = &'a String>) -> EngineError {
    template_error(format!(
        "{} has chat templates named {} but none named `default`, the one nucleus uses",
        shown_path(dir),
        names_list(names)
    ))
}

fn no_such_name<'a>(
    dir: &Path,
    name: &str,
    names: impl Iterator<Item = &'a String>,
) -> EngineError {
    template_error(format!(
        "{} has no chat template named {}; it has {}",
        shown_path(dir),
        quote(name.as_bytes()),
        names_list(names)
    ))
}

/// The `chat_template` field of a JSON file (tokenizer_config.json or chat_template.json): a
/// string, or a list of `{"name", "template"}` (transformers saves several templates so); `None`
/// when the field is absent or null.
fn from_json_file(path: &Path, name: Option<&str>) -> Result<Option<ChatTemplate>> {
    let text = read_text(path)?;
    let json: Json = serde_json::from_str(&text)
        .map_err(|e| template_error(format!("{} is not JSON: {e}", shown_path(path))))?;
    let shown = shown_path(path);
    let field = match &json {
        Json::Object(o) => o.get("chat_template"),
        _ => return Err(template_error(format!("{shown} is not a JSON object"))),
    };
    match field {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => match name {
            None | Some(DEFAULT_TEMPLATE_NAME) => Ok(Some(ChatTemplate::new(shown, s.clone()))),
            Some(n) => Err(template_error(format!(
                "{shown} has one chat template, not one named {}",
                quote(n.as_bytes())
            ))),
        },
        Some(Json::Array(list)) => {
            let mut named: Vec<(String, String)> = Vec::new();
            for (i, item) in list.iter().enumerate() {
                match (
                    item.get("name").and_then(Json::as_str),
                    item.get("template").and_then(Json::as_str),
                ) {
                    (Some(n), Some(t)) => named.push((n.to_string(), t.to_string())),
                    _ => {
                        return Err(template_error(format!(
                            "{shown}: chat_template[{i}] is not an object with string fields \
                             `name` and `template`"
                        )))
                    }
                }
            }
            let wanted = name.unwrap_or(DEFAULT_TEMPLATE_NAME);
            match named.iter().find(|(n, _)| n == wanted) {
                Some((n, t)) => Ok(Some(ChatTemplate::new(
                    format!("{shown} (template {})", quote(n.as_bytes())),
                    t.clone(),
                ))),
                None if name.is_none() => Err(no_default(path, named.iter().map(|f| &f.0))),
                None => Err(no_such_name(path, wanted, named.iter().map(|f| &f.0))),
            }
        }
        Some(_) => Err(template_error(format!(
            "{shown}: chat_template is neither a string nor a list of named templates"
        ))),
    }
}

/// The roles [`messages_from_openai`] accepts (OpenAI's chat-completions roles).
pub const OPENAI_ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The messages of an OpenAI chat-completions request, as a chat template expects them (the
/// conversion of vLLM's `vllm/entrypoints/chat_utils.py`, `parse_chat_messages` with the
/// "string" content format).
///
/// `v` is a JSON list of messages, or an object with a `messages` list. Each message is an
/// object with a `role` (one of [`OPENAI_ROLES`]) and a `content`:
///
/// - a string: kept;
/// - a list of parts: each an object with a `type`; the `text` of the `text` parts joined with
///   `"\n"` into one string (vLLM's `_parse_chat_message_content_parts`: `"\n".join(texts)`);
///   any other part (`image_url`, `input_audio`, …) is [`EngineError::InvalidRequest`];
/// - null or absent: only for `assistant` (a message with `tool_calls`), kept as given.
///
/// Every other field (`name`, `tool_calls`, `tool_call_id`, `reasoning_content`, …) is kept as
/// given, except that a `tool_calls[j].function.arguments` string is parsed into its JSON value
/// and an empty or null one becomes `{}` (vLLM's `_postprocess_messages`: templates expect the
/// arguments as an object, which they print with `tojson`).
///
/// # Errors
///
/// [`EngineError::InvalidRequest`] naming the message's index: not a list, a message not an
/// object, a missing or unknown role, content of the wrong type, a part without a string
/// `text`, tool-call arguments that are not JSON.
pub fn messages_from_openai(v: &Json) -> Result<Vec<Json>> {
    let bad = |m: String| EngineError::InvalidRequest(bounded(m));
    let list = match v {
        Json::Array(a) => a,
        Json::Object(o) => match o.get("messages") {
            Some(Json::Array(a)) => a,
            Some(_) => return Err(bad("`messages` is not a list".into())),
            None => return Err(bad("the object has no `messages` list".into())),
        },
        _ => {
            return Err(bad(
                "the messages are neither a list nor an object with a `messages` list".into(),
            ))
        }
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Json::Object(obj) = m else {
            return Err(bad(format!("message {i} is not an object")));
        };
        let role = match obj.get("role") {
            Some(Json::String(r)) => r.as_str(),
            Some(_) => return Err(bad(format!("message {i}: `role` is not a string"))),
            None => return Err(bad(format!("message {i} has no `role`"))),
        };
        if !OPENAI_ROLES.contains(&role) {
            return Err(bad(format!(
                "message {i}: unknown role {} (expected one of system, developer, user, \
                 assistant, tool)",
                quote(role.as_bytes())
            )));
        }
        let mut msg = obj.clone();
        match obj.get("content") {
            Some(Json::String(_)) => {}
            None | Some(Json::Null) if role == "assistant" => {}
            None | Some(Json::Null) => {
                return Err(bad(format!(
                    "message {i} ({role}) has no content (only an assistant message may have \
                     null content)"
                )))
            }
            Some(Json::Array(parts)) => {
                let mut texts: Vec<&str> = Vec::with_capacity(parts.len());
                for (j, part) in parts.iter().enumerate() {
                    let kind = part.get("type").and_then(Json::as_str);
                    match kind {
                        Some("text") => match part.get("text") {
                            Some(Json::String(t)) => texts.push(t),
                            _ => {
                                return Err(bad(format!(
                                    "message {i}, content part {j}: a text part without a \
                                     string `text`"
                                )))
                            }
                        },
                        Some(other) => {
                            return Err(EngineError::InvalidRequest(bounded(format!(
                                "message {i}, content part {j}: parts of type {} are not \
                                 supported (only text parts)",
                                quote(other.as_bytes())
                            ))))
                        }
                        None => {
                            return Err(bad(format!(
                                "message {i}, content part {j} has no string `type`"
                            )))
                        }
                    }
                }
                msg.insert("content".into(), Json::String(texts.join("\n")));
            }
            Some(_) => {
                return Err(bad(format!(
                    "message {i}: `content` is neither a string, a list of parts nor null"
                )))
            }
        }
        if role == "assistant" {
            if let Some(Json::Array(calls)) = msg.get_mut("tool_calls") {
                for (j, call) in calls.iter_mut().enumerate() {
                    let Some(Json::Object(function)) = call.get_mut("function") else {
                        continue;
                    };
                    let parsed = match function.get("arguments") {
                        None | Some(Json::Null) => Json::Object(Map::new()),
                        Some(Json::String(s)) if s.is_empty() => Json::Object(Map::new()),
                        Some(Json::String(s)) => serde_json::from_str(s).map_err(|e| {
                            bad(format!(
                                "message {i}, tool call {j}: the arguments are not JSON: {e}"
                            ))
                        })?,
                        Some(other) => other.clone(),
                    };
                    function.insert("arguments".into(), parsed);
                }
            }
        }
        out.push(Json::Object(msg));
    }
    Ok(out)
}
