//! `nucleus tokenize` and `nucleus detokenize`: a model's tokenizer alone
//! ([`nucleus_engine::load_tokenizer`]: a GGUF file, vocab-only ones included, a model folder, a
//! tokenizer.json, or a hub id).
//!
//! As Hugging Face's `tokenizer(text)` and llama.cpp's `llama-tokenize`: BOS (and EOS) are
//! added as the tokenizer's `add_bos_token` / `add_eos_token` say unless `--no-bos`, and the
//! spellings of special tokens in the text are those tokens unless `--no-parse-special`.
//! `detokenize` decodes as Hugging Face's `tokenizer.decode(ids)` with its default
//! `skip_special_tokens=False` (special tokens spelled out) unless `--skip-special-tokens`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{ArgGroup, Args};

use crate::input::{read_file, shown_path, InputLimit};
use crate::report::Output;
use crate::usage::UsageError;

/// The flags of `nucleus tokenize`.
#[derive(Args, Debug)]
#[command(group(ArgGroup::new("source").required(true).args(["text", "file"])))]
pub struct TokenizeArgs {
    /// The model: a GGUF file, a model folder, a tokenizer.json, or a hub id (as
    /// `generate --model`).
    #[arg(long, value_name = "M")]
    pub model: String,
    /// The text to tokenise (the flag's value itself).
    #[arg(long, value_name = "T", allow_hyphen_values = true)]
    pub text: Option<String>,
    /// A file whose whole content (UTF-8) is the text (`-`: stdin).
    #[arg(long, value_name = "F")]
    pub file: Option<PathBuf>,
    /// One JSON list per line of the text (the newline, and a "\r" before it, not included).
    #[arg(long)]
    pub lines: bool,
    /// Do not add BOS (nor EOS, for tokenizers that add it).
    #[arg(long)]
    pub no_bos: bool,
    /// Spellings of special tokens in the text (`<|im_end|>`, `<s>`) are plain text.
    #[arg(long)]
    pub no_parse_special: bool,
    /// `--max-input-bytes`: most bytes of the --file.
    #[command(flatten)]
    pub limit: InputLimit,
}

/// The flags of `nucleus detokenize`.
#[derive(Args, Debug)]
pub struct DetokenizeArgs {
    /// The model: a GGUF file, a model folder, a tokenizer.json, or a hub id.
    #[arg(long, value_name = "M")]
    pub model: String,
    /// The token ids, a JSON list (`"[1, 15043]"`).
    #[arg(long, value_name = "JSON")]
    pub ids: String,
    /// Drop special tokens (BOS, EOS, control tokens) from the text.
    #[arg(long)]
    pub skip_special_tokens: bool,
}

/// Runs `nucleus tokenize`: one JSON list of ids (per line with `--lines`) on stdout.
///
/// # Errors
/// An unreadable or non-UTF-8 file, a model that cannot be found or loaded.
pub fn tokenize_command(args: &TokenizeArgs) -> Result<ExitCode> {
    let text = match (&args.text, &args.file) {
        (Some(t), _) => t.clone(),
        (None, Some(path)) => {
            let bytes = if path.as_os_str() == "-" {
                crate::input::read_stdin("--file", args.limit.max_input_bytes)?
            } else {
                read_file("--file", path, args.limit.max_input_bytes)?
            };
            String::from_utf8(bytes)
                .with_context(|| format!("--file {} is not UTF-8", shown_path(path)))?
        }
        (None, None) => unreachable_source()?,
    };
    let path = crate::model::resolve(Some(&args.model))?;
    let tokenizer = nucleus_engine::load_tokenizer(&path)?;
    let inputs: Vec<&str> = if args.lines {
        text.split_terminator('\n')
            .map(|l| l.strip_suffix('\r').unwrap_or(l))
            .collect()
    } else {
        vec![text.as_str()]
    };
    let mut out = Output(std::io::stdout().lock());
    for input in inputs {
        let ids = tokenizer.encode(input, !args.no_bos, !args.no_parse_special)?;
        serde_json::to_writer(&mut out, &ids)?;
        writeln!(out)?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// Clap's group makes one of `--text` / `--file` required; this is never reached.
fn unreachable_source() -> Result<String> {
    Err(UsageError::new("one of --text or --file is required").into())
}

/// Runs `nucleus detokenize`: the text, then a newline, on stdout.
///
/// # Errors
/// `--ids` that is not a JSON list of ids (usage, exit 2); an id outside the vocabulary; a
/// model that cannot be found or loaded.
pub fn detokenize_command(args: &DetokenizeArgs) -> Result<ExitCode> {
    let ids: Vec<u32> = serde_json::from_str(&args.ids).map_err(|e| {
        UsageError::new(format!(
            "--ids must be a JSON list of token ids (integers from 0 to {}): {e}",
            u32::MAX
        ))
    })?;
    let path = crate::model::resolve(Some(&args.model))?;
    let tokenizer = nucleus_engine::load_tokenizer(&path)?;
    let text = tokenizer.decode(&ids, args.skip_special_tokens)?;
    let mut out = Output(std::io::stdout().lock());
    writeln!(out, "{text}")?;
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}
