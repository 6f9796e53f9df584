//! Exact validation of a JSON text against a JSON Schema, with the
//! [`jsonschema`](https://docs.rs/jsonschema/0.61) crate: the final check of a completion
//! generated under a schema, whether the grammar was strict or relaxed
//! ([`crate::JsonSchemaMode`]).
//!
//! Semantics are the JSON Schema specification's (drafts 4, 6, 7, 2019-09 and 2020-12), as the
//! `jsonschema` crate implements them: the draft is the one the schema's `$schema` names,
//! 2020-12 when it names none (draft 7 when such a schema is not valid 2020-12, as with
//! array-form `items`: it was written for an earlier draft); `format` is asserted (`should_validate_formats(true)`: `email`,
//! `date-time`, `date`, `time`, `uuid`, `ipv4`, `ipv6`, `uri`, ...), unknown `format` values
//! are annotations that constrain nothing; no reference is ever fetched (no network, no files:
//! a `$ref` that leaves the document is an error when the validator is built).

use std::fmt;

use serde_json::Value;

use crate::depth::{json_text_depth, schema_depth, MAX_GRAMMAR_DEPTH};
use crate::error::one_line;

/// The stack that building a validator and validating run on (only the pages used are
/// committed): `jsonschema` recurses on the schema's and the instance's nesting, both bounded
/// by [`MAX_GRAMMAR_DEPTH`] here.
const VALIDATOR_STACK_BYTES: usize = 64 << 20;
/// Grow onto a fresh stack when less than this is left.
const VALIDATOR_RED_ZONE_BYTES: usize = 8 << 20;

/// The verdict of the exact validator on one JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchemaVerdict {
    /// The text is JSON and the schema accepts it.
    Valid,
    /// The text is not JSON, or the schema rejects it. `Display` writes
    /// `invalid at /a/0/b: <message>` (`invalid at the root: ...` for the empty pointer).
    Invalid {
        /// The JSON pointer (RFC 6901) of the first value found invalid: `""` for the whole
        /// document (and for text that is not JSON), `/a/0/b` for key `b` of the first item of
        /// key `a`.
        instance_path: String,
        /// What is wrong, one line of at most [`crate::MAX_MESSAGE_LINE`] characters:
        /// `jsonschema`'s message (`"x" is not a "email"`, `"a" is a required property`), or
        /// `not JSON: <serde_json's message>` for text that does not parse.
        message: String,
    },
}

impl SchemaVerdict {
    /// Whether the verdict is [`SchemaVerdict::Valid`].
    pub fn is_valid(&self) -> bool {
        matches!(self, SchemaVerdict::Valid)
    }
}

impl fmt::Display for SchemaVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SchemaVerdict::Valid => f.write_str("valid"),
            SchemaVerdict::Invalid {
                instance_path,
                message,
            } if instance_path.is_empty() => write!(f, "invalid at the root: {message}"),
            SchemaVerdict::Invalid {
                instance_path,
                message,
            } => write!(f, "invalid at {instance_path}: {message}"),
        }
    }
}

/// The validator could not give a verdict: the schema cannot be built into a validator (it is
/// not JSON, it nests deeper than [`MAX_GRAMMAR_DEPTH`], its `$schema` names no known draft, it
/// breaks its meta-schema, a `$ref` cannot be resolved within the document, a `pattern` is not
/// a regular expression), or the instance nests deeper than [`MAX_GRAMMAR_DEPTH`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("JSON Schema validator: {message}")]
pub struct SchemaValidatorError {
    /// What went wrong, one line (`jsonschema`'s message where it is its error).
    pub message: String,
}

impl SchemaValidatorError {
    fn new(message: impl AsRef<str>) -> Self {
        SchemaValidatorError {
            message: one_line(message.as_ref()),
        }
    }
}

/// A JSON Schema built once into a `jsonschema` validator, to validate many texts.
/// `Send + Sync`. [`crate::CompiledGrammar::validate_json`] keeps one per compiled grammar.
pub struct SchemaValidator {
    validator: jsonschema::Validator,
}

impl fmt::Debug for SchemaValidator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SchemaValidator")
            .field("draft", &self.validator.draft())
            .finish_non_exhaustive()
    }
}

/// Runs `f` with at least [`VALIDATOR_RED_ZONE_BYTES`] of stack.
fn on_validator_stack<R>(f: impl FnOnce() -> R) -> R {
    stacker::maybe_grow(VALIDATOR_RED_ZONE_BYTES, VALIDATOR_STACK_BYTES, f)
}

/// Parses JSON `text` whose nesting is at most [`MAX_GRAMMAR_DEPTH`] (serde_json's own limit of
/// 128 is lifted: the depth is checked first). `Ok(Err(message))` for text that is not JSON.
fn parse_bounded(text: &str, what: &str) -> Result<Result<Value, String>, SchemaValidatorError> {
    let depth = json_text_depth(text.as_bytes());
    if depth > MAX_GRAMMAR_DEPTH {
        return Err(SchemaValidatorError::new(format!(
            "the {what} nests {depth} levels of arrays and objects; the limit is \
             {MAX_GRAMMAR_DEPTH}"
        )));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    de.disable_recursion_limit();
    Ok(serde::Deserialize::deserialize(&mut de)
        .and_then(|v: Value| de.end().map(|()| v))
        .map_err(|e| e.to_string()))
}

impl SchemaValidator {
    /// Builds the validator for the JSON Schema `schema` (JSON text).
    ///
    /// Errors: [`SchemaValidatorError`] when the text is not JSON, nests deeper than
    /// [`MAX_GRAMMAR_DEPTH`], or `jsonschema` cannot build it (see the error's docs).
    pub fn new(schema: &str) -> Result<Self, SchemaValidatorError> {
        on_validator_stack(|| {
            let value = parse_bounded(schema, "schema")?
                .map_err(|e| SchemaValidatorError::new(format!("the schema is not JSON: {e}")))?;
            Self::build(&value)
        })
    }

    /// Builds the validator for the JSON Schema `schema`.
    ///
    /// Errors: as [`SchemaValidator::new`].
    pub fn from_value(schema: &Value) -> Result<Self, SchemaValidatorError> {
        on_validator_stack(|| Self::build(schema))
    }

    fn build(schema: &Value) -> Result<Self, SchemaValidatorError> {
        let depth = schema_depth(schema);
        if depth > MAX_GRAMMAR_DEPTH as u64 {
            return Err(SchemaValidatorError::new(format!(
                "the schema nests up to {depth} levels of subschemas and `$ref`s; the limit is \
                 {MAX_GRAMMAR_DEPTH}"
            )));
        }
        let build = |draft: Option<jsonschema::Draft>| {
            std::panic::catch_unwind(|| {
                let mut options = jsonschema::options();
                if let Some(draft) = draft {
                    options = options.with_draft(draft);
                }
                options
                    .should_validate_formats(true)
                    .offline()
                    .build(schema)
            })
            .map_err(|_| {
                SchemaValidatorError::new("internal error: building the validator panicked")
            })
        };
        let built = match build(None)? {
            // A schema that names no draft and is not valid 2020-12 (array-form `items`,
            // `additionalItems` beside it) was most likely written for an earlier draft: draft
            // 7 is tried before giving up (and its semantics used, `$ref` siblings ignored).
            Err(_) if schema.get("$schema").is_none() && schema.is_object() => {
                match build(Some(jsonschema::Draft::Draft7))? {
                    Ok(v) => Ok(v),
                    Err(_) => build(None)?,
                }
            }
            built => built,
        };
        let validator = built.map_err(|e| SchemaValidatorError::new(e.to_string()))?;
        Ok(SchemaValidator { validator })
    }

    /// Validates the JSON text `instance`: [`SchemaVerdict::Invalid`] with the pointer and
    /// message of the first error `jsonschema` finds, or with pointer `""` and
    /// `not JSON: ...` for text that does not parse.
    ///
    /// Errors: [`SchemaValidatorError`] only for text nested deeper than
    /// [`MAX_GRAMMAR_DEPTH`], where no verdict is given.
    pub fn validate(&self, instance: &str) -> Result<SchemaVerdict, SchemaValidatorError> {
        on_validator_stack(|| {
            let value = match parse_bounded(instance, "instance")? {
                Ok(value) => value,
                Err(e) => {
                    return Ok(SchemaVerdict::Invalid {
                        instance_path: String::new(),
                        message: one_line(&format!("not JSON: {e}")),
                    })
                }
            };
            Ok(self.validate_value(&value))
        })
    }

    /// Validates a parsed instance.
    pub fn validate_value(&self, instance: &Value) -> SchemaVerdict {
        on_validator_stack(|| match self.validator.validate(instance) {
            Ok(()) => SchemaVerdict::Valid,
            Err(e) => SchemaVerdict::Invalid {
                instance_path: e.instance_path().as_str().to_string(),
                message: one_line(&e.to_string()),
            },
        })
    }
}

/// Validates the JSON text `instance` against the JSON Schema `schema` (JSON text), building
/// the validator for this call only: to validate many texts under one schema, keep a
/// [`SchemaValidator`] (or use [`crate::CompiledGrammar::validate_json`], which caches one).
///
/// ```
/// use nucleus_grammar::{validate_json_instance, SchemaVerdict};
///
/// let schema = r#"{"type": "object", "properties": {"to": {"type": "string", "format": "email"}}}"#;
/// assert_eq!(validate_json_instance(schema, r#"{"to": "a@example.com"}"#)?, SchemaVerdict::Valid);
/// let verdict = validate_json_instance(schema, r#"{"to": "nobody"}"#)?;
/// assert_eq!(verdict.to_string(), r#"invalid at /to: "nobody" is not a "email""#);
/// # Ok::<(), nucleus_grammar::SchemaValidatorError>(())
/// ```
///
/// Errors: as [`SchemaValidator::new`] and [`SchemaValidator::validate`].
pub fn validate_json_instance(
    schema: &str,
    instance: &str,
) -> Result<SchemaVerdict, SchemaValidatorError> {
    SchemaValidator::new(schema)?.validate(instance)
}
