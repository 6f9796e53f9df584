//! Chat mode of `nucleus generate` (`--chat`, `--system`, `--messages`, `--chat-template`,
//! `--chat-template-kwargs`) and `nucleus chat-template`, on
//! [`nucleus_engine::ChatTemplate`].
//!
//! A rendered conversation is tokenised without the tokenizer's own BOS / EOS
//! (`add_special_tokens = false`) and with special-token spellings parsed as tokens: the
//! template writes the special tokens it wants, as Hugging Face's
//! `apply_chat_template(tokenize=True)` and vLLM's chat endpoint tokenise it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;
use nucleus_engine::{
    messages_from_openai, ChatTemplate, HubEnv, ModelTokenizer, Prompt, RenderOptions,
};
use serde_json::{json, Map, Value};

use crate::input::{read_file, shown_path, InputLimit, MaxInputBytes};
use crate::report::Output;
use crate::usage::UsageError;

/// The chat flags of one run, read and checked before the model loads.
#[derive(Debug, Clone)]
pub struct ChatInput {
    /// `--chat-template FILE`, read.
    template: Option<ChatTemplate>,
    /// `--chat-template-kwargs`.
    kwargs: Map<String, Value>,
    /// `--system`.
    system: Option<String>,
    /// `--messages`: one whole conversation, and its tools.
    conversation: Option<(Vec<Value>, Option<Value>)>,
}

/// `--chat-template-kwargs JSON`: a JSON object, else a [`UsageError`].
pub fn parse_kwargs(text: Option<&str>) -> Result<Map<String, Value>> {
    let Some(text) = text else {
        return Ok(Map::new());
    };
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => {
            if let Some(k) = map.keys().find(|k| {
                matches!(
                    k.as_str(),
                    "messages" | "tools" | "documents" | "add_generation_prompt"
                )
            }) {
                return Err(UsageError::new(format!(
                    "--chat-template-kwargs: `{k}` is set by nucleus itself (the conversation, \
                     its tools, --no-generation-prompt), not a template variable to pass"
                ))
                .into());
            }
            Ok(map)
        }
        Ok(other) => Err(UsageError::new(format!(
            "--chat-template-kwargs must be a JSON object, got {}",
            crate::input::shown(&other.to_string())
        ))
        .into()),
        Err(e) => Err(UsageError::new(format!("--chat-template-kwargs is not JSON: {e}")).into()),
    }
}

/// Reads a `--messages FILE.json` conversation in the OpenAI format (a list of messages, or an
/// object with `messages` and optionally `tools`); list-of-parts `content` is flattened to
/// text as vLLM does ([`messages_from_openai`]).
///
/// # Errors
/// An unreadable file, one larger than `limit`, not JSON, or not a conversation.
pub fn read_conversation(path: &Path, limit: MaxInputBytes) -> Result<(Vec<Value>, Option<Value>)> {
    let bytes = read_file("--messages", path, limit)?;
    let value: Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("--messages {} is not JSON", shown_path(path)))?;
    let tools = value.get("tools").filter(|t| !t.is_null()).cloned();
    if let Some(t) = &tools {
        if !t.is_array() {
            anyhow::bail!(
                "--messages {}: `tools` must be a list of tools, got {}",
                shown_path(path),
                crate::input::shown(&t.to_string())
            );
        }
    }
    let messages =
        messages_from_openai(&value).with_context(|| format!("--messages {}", shown_path(path)))?;
    if messages.is_empty() {
        anyhow::bail!(
            "--messages {}: the conversation holds no messages",
            shown_path(path)
        );
    }
    Ok((messages, tools))
}

impl ChatInput {
    /// The chat flags of `generate`; `None` unless `--chat` or `--messages`.
    ///
    /// # Errors
    /// Bad `--chat-template-kwargs` (usage), an unreadable template or conversation file.
    pub fn from_args(args: &crate::generate::GenerateArgs) -> Result<Option<Self>> {
        if !(args.chat || args.messages.is_some()) {
            return Ok(None);
        }
        let kwargs = parse_kwargs(args.chat_template_kwargs.as_deref())?;
        let template = args
            .chat_template
            .as_deref()
            .map(read_template)
            .transpose()?;
        let conversation = args
            .messages
            .as_deref()
            .map(|p| read_conversation(p, args.limit.max_input_bytes))
            .transpose()?;
        Ok(Some(Self {
            template,
            kwargs,
            system: args.system.clone(),
            conversation,
        }))
    }

    /// The requests: each prompt as one user message (after `--system`), or the one
    /// `--messages` conversation, rendered with a generation prompt and tokenised. Returns
    /// (the rendered text, the prompt's token ids) per request.
    ///
    /// # Errors
    /// A model without a chat template (and no `--chat-template`); a template that fails.
    pub fn prompts(
        &self,
        model: &Path,
        tokenizer: &ModelTokenizer,
        prompts: &[String],
    ) -> Result<Vec<(String, Prompt)>> {
        let template = template_for(self.template.as_ref(), model)?;
        let conversations: Vec<(Vec<Value>, Option<Value>)> = match &self.conversation {
            Some(c) => vec![c.clone()],
            None => prompts
                .iter()
                .map(|p| {
                    let mut messages = Vec::new();
                    if let Some(system) = &self.system {
                        messages.push(json!({"role": "system", "content": system}));
                    }
                    messages.push(json!({"role": "user", "content": p}));
                    (messages, None)
                })
                .collect(),
        };
        conversations
            .into_iter()
            .map(|(messages, tools)| {
                let text = render(&template, tokenizer, &messages, tools, &self.kwargs, true)?;
                let ids = tokenizer.encode(&text, false, true)?;
                Ok((text, Prompt::Tokens(ids)))
            })
            .collect()
    }
}

/// `--chat-template FILE`, its errors naming the flag.
fn read_template(path: &Path) -> Result<ChatTemplate> {
    ChatTemplate::from_file(path).with_context(|| format!("--chat-template {}", shown_path(path)))
}

/// The template to use: `explicit` (`--chat-template`), else the model's.
fn template_for(explicit: Option<&ChatTemplate>, model: &Path) -> Result<ChatTemplate> {
    if let Some(t) = explicit {
        return Ok(t.clone());
    }
    ChatTemplate::for_model(model)?.ok_or_else(|| {
        anyhow::anyhow!(
            "{} has no chat template (tokenizer_config.json `chat_template`, \
             chat_template.jinja, chat_template.json or GGUF `tokenizer.chat_template`); pass \
             --chat-template FILE",
            shown_path(model)
        )
    })
}

/// Renders `messages` with the tokenizer's BOS / EOS texts.
fn render(
    template: &ChatTemplate,
    tokenizer: &ModelTokenizer,
    messages: &[Value],
    tools: Option<Value>,
    kwargs: &Map<String, Value>,
    add_generation_prompt: bool,
) -> Result<String> {
    let opts = RenderOptions {
        add_generation_prompt,
        bos_token: tokenizer.bos_token.clone(),
        eos_token: tokenizer.eos_token.clone(),
        tools,
        kwargs: kwargs.clone(),
    };
    Ok(template.render(messages, &opts)?)
}

/// The flags of `nucleus chat-template`.
#[derive(Args, Debug)]
pub struct ChatTemplateArgs {
    /// The model whose template and BOS / EOS texts are used: a GGUF file, a model folder, a
    /// tokenizer.json, or a hub id (as `generate --model`).
    #[arg(long, value_name = "M")]
    pub model: String,
    /// The conversation: a JSON list of OpenAI-format messages (or an object with `messages`
    /// and `tools`).
    #[arg(long, value_name = "FILE.json")]
    pub messages: PathBuf,
    /// Do not end with the assistant turn's header (`add_generation_prompt = false`).
    #[arg(long)]
    pub no_generation_prompt: bool,
    /// A Jinja file (or a JSON file with `chat_template`) instead of the model's template.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Variables the template reads, as a JSON object (`{"enable_thinking": false}`).
    #[arg(long, value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
    /// `--max-input-bytes`: most bytes of the --messages file.
    #[command(flatten)]
    pub limit: InputLimit,
}

/// Runs `nucleus chat-template`: prints the rendered text exactly (no newline added).
///
/// # Errors
/// Bad kwargs (usage, exit 2); a model, template or conversation that cannot be used.
pub fn chat_template_command(args: &ChatTemplateArgs) -> Result<ExitCode> {
    let kwargs = parse_kwargs(args.chat_template_kwargs.as_deref())?;
    let explicit = args
        .chat_template
        .as_deref()
        .map(read_template)
        .transpose()?;
    let (messages, tools) = read_conversation(&args.messages, args.limit.max_input_bytes)?;
    let path = nucleus_engine::hub::resolve(Some(&args.model), &HubEnv::from_env(), true)?;
    let tokenizer = nucleus_engine::load_tokenizer(&path)?;
    let template = template_for(explicit.as_ref(), &path)?;
    let text = render(
        &template,
        &tokenizer,
        &messages,
        tools,
        &kwargs,
        !args.no_generation_prompt,
    )?;
    let mut out = Output(std::io::stdout().lock());
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}
