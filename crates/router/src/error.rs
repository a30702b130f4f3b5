//! The one error type of the router, rendered as an OpenAI-style JSON error.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use inferscale_types::Refusal;
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Malformed or invalid request (400).
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    NotFound(String),
    /// The path exists, not with this method (405).
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("request body is larger than the limit of {0} bytes")]
    TooLarge(usize),
    /// Every worker that could serve the request is busy (429).
    #[error("{0}")]
    Busy(String),
    /// No worker that holds the user's memory is reachable (503).
    #[error("{0}")]
    Unavailable(String),
    /// The worker's disk is full: the request changed nothing (507).
    #[error("{0}")]
    InsufficientStorage(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Internal(String),
    /// A request parameter this server does not implement (400, `param`
    /// names it).
    #[error("`{0}` is not supported by this server")]
    Unsupported(String),
    /// An invalid value of a named request parameter (400, `param` names
    /// it): the router's own refusal or the worker's, in the same words
    /// (`inferscale_types::admit`).
    #[error(transparent)]
    Refused(#[from] Refusal),
}

impl ApiError {
    /// A refusal naming `param`.
    pub fn param(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::Refused(Refusal::new(param, message))
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) | ApiError::Unsupported(_) | ApiError::Refused(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::InsufficientStorage(_) => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ApiError::BadRequest(_)
            | ApiError::TooLarge(_)
            | ApiError::MethodNotAllowed(_)
            | ApiError::Unsupported(_)
            | ApiError::Refused(_) => "invalid_request_error",
            ApiError::Unauthorized(_) => "authentication_error",
            ApiError::NotFound(_) => "not_found_error",
            ApiError::Busy(_) => "rate_limit_error",
            ApiError::Conflict(_) => "conflict_error",
            ApiError::Unavailable(_)
            | ApiError::InsufficientStorage(_)
            | ApiError::Timeout(_)
            | ApiError::Internal(_) => "server_error",
        }
    }

    /// The request field at fault, when one is (OpenAI's `param`).
    fn param_name(&self) -> Option<&str> {
        match self {
            ApiError::Unsupported(p) => Some(p),
            ApiError::Refused(r) => Some(&r.param),
            _ => None,
        }
    }

    /// The JSON body OpenAI clients parse: `{"error": {message, type,
    /// param, code}}`; `code` is the HTTP status.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.to_string(),
            "type": self.kind(),
            "param": self.param_name(),
            "code": self.status().as_u16(),
        }})
    }

    /// Seconds a client should wait before retrying (`Retry-After`), for
    /// the statuses that invite a retry.
    fn retry_after(&self) -> Option<u32> {
        match self {
            ApiError::Busy(_) => Some(1),
            ApiError::Unavailable(_) => Some(2),
            ApiError::InsufficientStorage(_) => Some(30),
            _ => None,
        }
    }

    /// The error with `tenant`'s namespace taken out of user ids in its
    /// message: workers see scoped ids, clients their own.
    pub fn unscope(self, tenant: &str) -> ApiError {
        let scope = format!("`{tenant}/");
        let fix = |m: String| m.replace(&scope, "`").replace(&format!("\"{tenant}/"), "\"");
        match self {
            ApiError::BadRequest(m) => ApiError::BadRequest(fix(m)),
            ApiError::NotFound(m) => ApiError::NotFound(fix(m)),
            ApiError::Conflict(m) => ApiError::Conflict(fix(m)),
            ApiError::Internal(m) => ApiError::Internal(fix(m)),
            ApiError::Unavailable(m) => ApiError::Unavailable(fix(m)),
            ApiError::Refused(r) => ApiError::Refused(Refusal { message: fix(r.message), ..r }),
            other => other,
        }
    }

    /// Whether the request may be retried on another worker.
    pub fn retryable(&self) -> bool {
        matches!(self, ApiError::Unavailable(_))
    }
}

impl ApiError {
    /// The response with a body `body` makes of the error (another API's
    /// shape of it), its status and `Retry-After` kept.
    pub(crate) fn into_response_with(self, body: impl FnOnce(&ApiError) -> serde_json::Value) -> Response {
        let mut resp = (self.status(), Json(body(&self))).into_response();
        if let Some(secs) = self.retry_after() {
            resp.headers_mut().insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        resp.extensions_mut().insert(crate::reqlog::ErrorReason(self.to_string()));
        resp
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.into_response_with(ApiError::body)
    }
}

impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> Self {
        use tonic::Code;
        let msg = s.message().to_string();
        match s.code() {
            // A refusal's parameter travels beside its text (`param: message`).
            Code::InvalidArgument if inferscale_proto::refused_param(&s).is_some() => {
                let param = inferscale_proto::refused_param(&s).unwrap_or_default();
                let message = msg.strip_prefix(&format!("`{param}`: ")).unwrap_or(&msg).to_string();
                ApiError::Refused(Refusal { param, message })
            }
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => ApiError::BadRequest(msg),
            Code::NotFound => ApiError::NotFound(msg),
            Code::ResourceExhausted
                if inferscale_proto::ErrorKind::of(&s) == Some(inferscale_proto::ErrorKind::DiskFull) =>
            {
                ApiError::InsufficientStorage(msg)
            }
            Code::ResourceExhausted => ApiError::Busy(msg),
            Code::DeadlineExceeded => ApiError::Timeout(msg),
            // tonic reports the router's own call deadline as a cancellation.
            Code::Cancelled if msg.contains("Timeout expired") => {
                ApiError::Timeout("the worker did not answer within the deadline".into())
            }
            Code::AlreadyExists | Code::Aborted => ApiError::Conflict(msg),
            // The worker answered: it is up, the user's memory is not.
            Code::Unavailable if inferscale_proto::ErrorKind::of(&s).is_some() => ApiError::Unavailable(msg),
            Code::Unavailable => ApiError::Unavailable(format!("worker unavailable: {msg}")),
            _ if connection_lost(&s) => ApiError::Unavailable(format!("lost the connection to the worker: {msg}")),
            Code::Unauthenticated | Code::PermissionDenied => ApiError::Unauthorized(msg),
            _ => ApiError::Internal(format!("worker error: {msg}")),
        }
    }
}

/// Whether the connection broke under the call (the worker died
/// mid-request): tonic reports it as `Unknown` with the transport's words.
pub(crate) fn connection_lost(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::Unknown
        && (s.message().contains("h2 protocol error") || s.message().contains("transport error"))
}

pub type Result<T> = std::result::Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_have_openais_shape_and_retryable_ones_say_when() {
        let e = ApiError::Unsupported("logprobs".into());
        let b = e.body();
        assert_eq!(b["error"]["param"], "logprobs");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["code"], 400);
        assert!(b["error"]["message"].as_str().is_some_and(|m| m.contains("`logprobs`")), "{b}");
        assert_eq!(ApiError::NotFound("x".into()).body()["error"]["param"], serde_json::Value::Null);
        let busy = ApiError::Busy("queue full".into()).into_response();
        assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(busy.headers().get(axum::http::header::RETRY_AFTER).and_then(|v| v.to_str().ok()), Some("1"));
        let down = ApiError::Unavailable("no worker".into()).into_response();
        assert!(down.headers().contains_key(axum::http::header::RETRY_AFTER));
        let bad = ApiError::BadRequest("no".into()).into_response();
        assert!(!bad.headers().contains_key(axum::http::header::RETRY_AFTER));
    }

    #[test]
    fn a_workers_refusal_keeps_its_param_and_words() {
        let r = Refusal::new("memory.k", "0 is outside 1..=200");
        let e = ApiError::from(inferscale_proto::refused(&r));
        let b = e.body();
        assert_eq!(b["error"]["param"], "memory.k");
        assert_eq!(b["error"]["message"], r.to_string());
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        // A tenant's namespace comes out of the words as from any other error.
        let e = ApiError::param("user", "`t1/ana` has no memory").unscope("t1");
        assert_eq!(e.to_string(), "`user`: `ana` has no memory");
    }
}
