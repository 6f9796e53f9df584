//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An answer that is not a success: the status, the OpenAI error body's `type`, `message`,
/// `param` (the request field at fault, when one is) and `code` (a short machine-readable
/// name, or null).
#[derive(Clone, Debug)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// `error.type`: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `unavailable_error` or `server_error` (llama.cpp's server's names).
    pub kind: &'static str,
    /// `error.message`.
    pub message: String,
    /// `error.param`: the field at fault.
    pub param: Option<String>,
    /// `error.code`: a short machine-readable name (OpenAI's is a string or null).
    pub code: Option<String>,
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// A 400 `not_supported` for a field nucleus does not serve.
    pub fn not_supported(param: &str, why: &str) -> Self {
        Self {
            code: Some("not_supported".into()),
            ..Self::bad_request(
                format!("`{param}` is not supported by nucleus: {why}"),
                Some(param),
            )
        }
    }

    /// A 401.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "authentication_error",
            message: "invalid or missing API key: send `Authorization: Bearer KEY`".into(),
            param: None,
            code: Some("invalid_api_key".into()),
        }
    }

    /// A 404.
    pub fn not_found(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "not_found_error",
            message: message.into(),
            param: param.map(str::to_string),
            code: Some("model_not_found".into()),
        }
    }

    /// A 503 with `Retry-After`: the queue is full.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "unavailable_error",
            message: message.into(),
            param: None,
            code: Some("overloaded".into()),
        }
    }

    /// A 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// The JSON body. The message is cut after [`MAX_MESSAGE_BYTES`] and `param` after
    /// [`MAX_PARAM_BYTES`] (then `...`): an error never echoes a hostile input whole.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": cut(&self.message, MAX_MESSAGE_BYTES),
            "type": self.kind,
            "param": self.param.as_deref().map(|p| cut(p, MAX_PARAM_BYTES)),
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        // RFC 6750 section 3: a 401 names the scheme it wants.
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// The longest `error.message`, in bytes (the CLI's messages are cut at the same 1 KiB).
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// The longest `error.param`, in bytes.
pub const MAX_PARAM_BYTES: usize = 256;

/// `s` cut after `max` bytes at a character boundary, with `...` when cut.
fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}
