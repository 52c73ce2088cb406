//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the
//! matching HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// A refused or failed request, as the client sees it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type: `invalid_request_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault (`messages[2].content`), if one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `invalid_api_key`), if any.
    pub code: Option<&'static str>,
}

/// The message of an error response, kept in its extensions for the request log.
#[derive(Debug, Clone)]
pub(crate) struct ErrorNote(pub String);

/// The body of an error response.
#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// A 400 about `param` for a feature this server does not implement.
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        ApiError { code: Some("unsupported_parameter"), ..Self::invalid(Some(param), message) }
    }

    /// A 400 `context_length_exceeded`.
    pub fn context_length(message: impl Into<String>) -> Self {
        ApiError { code: Some("context_length_exceeded"), ..Self::invalid(Some("messages"), message) }
    }

    /// A 401 `invalid_api_key`.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            code: Some("invalid_api_key"),
            ..Self::invalid(None, message)
        }
    }

    /// A 404 for an unknown route.
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, code: Some("not_found"), ..Self::invalid(None, message) }
    }

    /// A 405 for a known route with another method.
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            code: Some("method_not_allowed"),
            ..Self::invalid(None, message)
        }
    }

    /// A 413 for a body over the limit.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            code: Some("request_too_large"),
            ..Self::invalid(None, format!("the request body is larger than the limit of {limit} bytes"))
        }
    }

    /// A 408: the body did not arrive within `limit`.
    pub fn timeout(limit: std::time::Duration) -> Self {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            code: Some("request_timeout"),
            ..Self::invalid(
                None,
                format!("the request body did not arrive within {:.1} s", limit.as_secs_f64()),
            )
        }
    }

    /// A 500 `server_error`: the engine failed.
    pub fn server(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// A 503: the model is loading, or the engine is shutting down or gone.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::SERVICE_UNAVAILABLE, ..Self::server(message) }
    }

    /// The JSON body, `{"error": {...}}`.
    pub fn body(&self) -> String {
        let body = ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        serde_json::to_string(&body).unwrap_or_else(|_| r#"{"error":{"message":"error"}}"#.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        let mut response =
            (self.status, [(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response();
        response.extensions_mut().insert(ErrorNote(self.message));
        if matches!(self.status, StatusCode::REQUEST_TIMEOUT | StatusCode::PAYLOAD_TOO_LARGE) {
            // The rest of the body was not read: the connection cannot carry another request.
            response
                .headers_mut()
                .insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(axum::http::header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_has_openai_shape() {
        let e = ApiError::context_length("too long");
        let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
        assert_eq!(v["error"]["message"], "too long");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        let v: serde_json::Value = serde_json::from_str(&ApiError::invalid(None, "x").body()).unwrap();
        assert!(v["error"]["param"].is_null() && v["error"]["code"].is_null());
    }
}
