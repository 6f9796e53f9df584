//! What the operator commands (`nucleus top-k-top-p-sample`, `nucleus moe-init-routing`) share:
//! one JSON line is one call; a call that fails is answered `{"error": {"kind", "message"}}`
//! ([`CallError`]); `--attrs` is a JSON object inline or in a file ([`read_attrs`]).

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::sample::input::Object;
use crate::sample::{from_json, JsonError};

/// Why a call got no answer: `kind` is a stable snake_case name (`invalid_json`,
/// `invalid_call`, or the operator's own kinds), `message` says what was wrong.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

#[derive(Serialize)]
struct ErrorLine<'a> {
    error: &'a CallError,
}

/// One output line (without its newline): the answer, or `{"error": {...}}`.
pub fn line<A: Serialize>(result: &Result<A, CallError>) -> Vec<u8> {
    let bytes = match result {
        Ok(answer) => serde_json::to_vec(answer),
        Err(error) => serde_json::to_vec(&ErrorLine { error }),
    };
    bytes.unwrap_or_else(|e| {
        let error = CallError::new("internal", format!("could not write the answer: {e}"));
        serde_json::to_vec(&ErrorLine { error: &error }).unwrap_or_default()
    })
}

/// Parses one JSON line into a call: `invalid_json` when it is not JSON, `invalid_call` when it
/// is JSON of the wrong shape (the message starts with the JSON path of the bad value).
pub fn parse_call<C: DeserializeOwned>(text: &[u8]) -> Result<C, CallError> {
    std::str::from_utf8(text)
        .map_err(|e| CallError::new("invalid_json", format!("not valid JSON: not UTF-8 ({e})")))?;
    match from_json::<Object<C>>(text) {
        Ok(Object(call)) => Ok(call),
        Err(JsonError::Shape(message)) => Err(CallError::invalid_call(message)),
        Err(JsonError::Syntax(e)) => Err(CallError::new(
            "invalid_json",
            format!("not valid JSON: {e}"),
        )),
    }
}

/// Reads `--attrs`: the path of a file holding a JSON object, else the object itself.
///
/// # Errors
/// A message naming the bad field (`--attrs: expert_num: invalid type: ...`), the file whose
/// JSON is invalid, or saying the text is neither a file nor JSON.
pub fn read_attrs<A: DeserializeOwned>(text: &str) -> Result<A, String> {
    let path = Path::new(text);
    let from_file = !text.trim_start().starts_with('{') && path.is_file();
    let bytes = if from_file {
        std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?
    } else {
        text.as_bytes().to_vec()
    };
    let source = if from_file {
        format!("--attrs file {}", path.display())
    } else {
        "--attrs".to_owned()
    };
    match from_json::<Object<A>>(&bytes) {
        Ok(Object(a)) => Ok(a),
        Err(JsonError::Shape(m)) => Err(format!("{source}: {m}")),
        Err(JsonError::Syntax(e)) if from_file => Err(format!("{source}: invalid JSON: {e}")),
        Err(JsonError::Syntax(e)) => Err(format!(
            "--attrs is neither a readable file nor a JSON object: {e}"
        )),
    }
}
