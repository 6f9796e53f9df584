//! What the operator commands (`nucleus top-k-top-p-sample`, `nucleus moe-init-routing`) share:
//! one JSON line is one call; a call that fails is answered `{"error": {"kind", "message"}}`
//! ([`CallError`]); `--attrs` is a JSON object inline or in a file ([`read_attrs`]).

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::answer::Reply;
use crate::input::{read_file, shown_path, MaxInputBytes};
use crate::sample::input::Object;
use crate::sample::{from_json, JsonError, RunError};

/// Why a call got no answer: `kind` is a stable snake_case name (`invalid_json`,
/// `invalid_call`, or the operator's own kinds), `message` says what was wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallError {
    /// A stable snake_case name.
    pub kind: &'static str,
    /// What was wrong, in words (the violated rule).
    pub message: String,
}

impl CallError {
    /// A call error of this kind.
    pub fn new(kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// `invalid_call`: JSON of the wrong shape, or a tensor file of the wrong contents.
    pub fn invalid_call(message: impl Into<String>) -> Self {
        Self::new("invalid_call", message)
    }
}

impl crate::answer::ErrorAnswer for CallError {
    fn kind(&self) -> &str {
        self.kind
    }
    fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

/// Why the tensors of a safetensors call were not taken: a call error, which is the call's
/// answer, or a tensor whose copy out of the file cannot be held in memory, which ends the
/// run with one `error:` line (exit status 1).
#[derive(Debug)]
pub enum TensorsError {
    /// A wrong, missing or unknown tensor, rank or dtype: answered.
    Call(CallError),
    /// A copy the machine cannot hold: the message.
    Memory(String),
}

impl From<CallError> for TensorsError {
    fn from(e: CallError) -> Self {
        TensorsError::Call(e)
    }
}

impl From<crate::input::TensorCopyError<CallError>> for TensorsError {
    fn from(e: crate::input::TensorCopyError<CallError>) -> Self {
        match e {
            crate::input::TensorCopyError::Memory(m) => TensorsError::Memory(m),
            crate::input::TensorCopyError::Value(e) => TensorsError::Call(e),
        }
    }
}

/// One output line (without its newline): the answer, or `{"error": {...}}`; an
/// `allocation` error line when the answer cannot be held in memory.
pub fn line<A: Serialize>(result: &Result<A, CallError>) -> Vec<u8> {
    crate::answer::to_line(&Reply(result.as_ref()))
}

/// Parses one JSON line into a call: `invalid_json` when it is not JSON, `invalid_call` when it
/// is JSON of the wrong shape (the message starts with the JSON path of the bad value).
pub fn parse_call<C: DeserializeOwned>(text: &[u8]) -> Result<C, CallError> {
    std::str::from_utf8(text)
        .map_err(|e| CallError::new("invalid_json", format!("not valid JSON: not UTF-8 ({e})")))?;
    match from_json::<Object<C>>(text) {
        Ok(Object(call)) => Ok(call),
        Err(JsonError::Shape(message)) => Err(CallError::new(
            crate::sample::input::allocation_kind(&message, "invalid_call"),
            message,
        )),
        Err(JsonError::Syntax(e)) => Err(CallError::new(
            "invalid_json",
            format!("not valid JSON: {e}"),
        )),
    }
}

/// Reads `--attrs`: the path of an existing file holding a JSON object (read within
/// `limit`), else the object itself.
///
/// # Errors
/// [`RunError::Usage`] for inline text that starts with `{` but is not a valid object (naming
/// the bad field: `--attrs: expert_num: invalid type: ...`, or saying it is not JSON);
/// [`RunError::Input`] for a file that cannot be read, is larger than `limit`, or does not
/// hold a valid object, and for text that is neither an existing file nor JSON (a missing
/// file).
pub fn read_attrs<A: DeserializeOwned>(text: &str, limit: MaxInputBytes) -> Result<A, RunError> {
    let path = Path::new(text);
    let from_file = !text.trim_start().starts_with('{') && path.exists();
    if !from_file {
        return match from_json::<Object<A>>(text.as_bytes()) {
            Ok(Object(a)) => Ok(a),
            Err(JsonError::Shape(m)) => Err(RunError::Usage(format!("--attrs: {m}"))),
            Err(JsonError::Syntax(e)) => {
                let message = format!("--attrs is neither a readable file nor a JSON object: {e}");
                // Text that starts like an object is a flag value outside its type (exit
                // status 2); anything else is taken for a file that is missing (1).
                Err(if text.trim_start().starts_with('{') {
                    RunError::Usage(message)
                } else {
                    RunError::Input(message)
                })
            }
        };
    }
    let bytes = read_file("--attrs", path, limit).map_err(|e| RunError::Input(e.to_string()))?;
    let source = format!("--attrs file {}", shown_path(path));
    match from_json::<Object<A>>(&bytes) {
        Ok(Object(a)) => Ok(a),
        Err(JsonError::Shape(m)) => Err(RunError::Input(format!("{source}: {m}"))),
        Err(JsonError::Syntax(e)) => Err(RunError::Input(format!("{source}: invalid JSON: {e}"))),
    }
}
