//! A small HTTP/1.1 client for the router, on hyper-util's pooled client.
//!
//! Connections are kept alive and reused (one per concurrent user in a
//! closed loop), so a measured request pays no TCP handshake, as a real
//! OpenAI client with a connection pool would not. Streamed chats are read
//! frame by frame so the time to the first token is taken when its SSE
//! chunk arrives, not when the body ends.

use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::Client as Pool;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
pub use inferscale_types::FactSources;
use inferscale_types::sse::{DONE, SseParser, error_message};
use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};

/// A client of one router (`http://host:port`, with or without `/v1`).
#[derive(Clone)]
pub struct Client {
    pool: Pool<HttpConnector, Full<Bytes>>,
    /// `http://host:port[/prefix]`, without the trailing `/v1`.
    base: String,
    auth: Option<HeaderValue>,
    timeout: Duration,
}

/// What one streamed chat completion measured.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Ok(Sample),
    Failed(Failure),
}

/// A request that finished: its timings and output size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// From sending the request to the first SSE chunk carrying a token.
    pub ttft: Duration,
    /// From sending the request to `[DONE]`.
    pub e2e: Duration,
    /// `usage.completion_tokens`, or the token chunks counted when the
    /// server sent no usage chunk.
    pub output_tokens: u64,
    /// `usage.memory.sources`: where the server found the facts' KV (kv
    /// and blend requests on the native engine).
    pub sources: Option<FactSources>,
    /// From the start of the point to sending the request (set by the
    /// runner; zero outside a measured point): places the request in the
    /// point's timeline.
    pub sent: Duration,
}

/// A request that failed, keyed for the report by `status`: the HTTP
/// status (`"429"`), the `code` of an SSE error object, `"io"` (could not
/// send or read), `"timeout"`, or `"incomplete"` (stream ended before
/// `[DONE]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub status: String,
    pub message: String,
}

impl Failure {
    fn outcome(status: impl Into<String>, message: impl Into<String>) -> Outcome {
        Outcome::Failed(Failure { status: status.into(), message: message.into() })
    }
}

impl Client {
    /// `url` is `http://host:port`, optionally with a path prefix and a
    /// trailing `/v1`; `timeout` bounds each whole exchange.
    pub fn new(url: &str, api_key: Option<&str>, timeout: Duration) -> Result<Client> {
        let bad = |reason: &str| Error::Url { url: url.to_string(), reason: reason.to_string() };
        let uri: Uri = url.parse().map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => return Err(bad("https is not supported; put the router on plain http (loopback)")),
            _ => return Err(bad("expected http://host:port")),
        }
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        let path = uri.path().trim_end_matches('/');
        let path = path.strip_suffix("/v1").unwrap_or(path);
        let auth = match api_key {
            Some(k) => {
                let mut v = HeaderValue::from_str(&format!("Bearer {k}"))
                    .map_err(|_| Error::Config("the API key holds characters not allowed in a header".into()))?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let pool = Pool::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(90)).build(connector);
        Ok(Client { pool, base: format!("http://{authority}{path}"), auth, timeout })
    }

    fn request(&self, method: Method, path: &str, body: Option<&Value>) -> Result<Request<Full<Bytes>>> {
        let url = format!("{}{path}", self.base);
        let mut b = Request::builder().method(method).uri(&url);
        if let Some(v) = &self.auth {
            b = b.header(header::AUTHORIZATION, v.clone());
        }
        let bytes = match body {
            Some(v) => {
                b = b.header(header::CONTENT_TYPE, "application/json");
                Bytes::from(serde_json::to_vec(v)?)
            }
            None => Bytes::new(),
        };
        b.body(Full::new(bytes)).map_err(|e| Error::Url { url, reason: e.to_string() })
    }

    /// One whole exchange: (status, body). Transport failures are errors;
    /// HTTP error statuses are returned for the caller to judge.
    pub async fn call(&self, method: Method, path: &str, body: Option<&Value>) -> Result<(u16, Bytes)> {
        let what = format!("{method} {path}");
        let req = self.request(method, path, body)?;
        let exchange = async {
            let resp = self.pool.request(req).await.map_err(|e| transport(&e))?;
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
            Ok::<_, String>((status, body))
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(reason)) => Err(Error::Http { what, reason: format!("{reason} (is the router at {}?)", self.base) }),
            Err(_) => Err(Error::Http { what, reason: format!("no answer within {:?}", self.timeout) }),
        }
    }

    /// `call` that wants a 2xx JSON answer.
    pub async fn json(&self, method: Method, path: &str, body: Option<&Value>) -> Result<Value> {
        let what = format!("{method} {path}");
        let (status, bytes) = self.call(method, path, body).await?;
        if !(200..300).contains(&status) {
            return Err(Error::Status { what, status, body: String::from_utf8_lossy(&bytes).into_owned() });
        }
        Ok(serde_json::from_slice(&bytes)?)
    }

    /// The served model, as `GET /v1/models` lists it first.
    pub async fn model(&self) -> Result<String> {
        let v = self.json(Method::GET, "/v1/models", None).await?;
        v["data"][0]["id"].as_str().map(str::to_string).ok_or_else(|| Error::Status {
            what: "GET /v1/models".into(),
            status: 200,
            body: format!("no model listed: {v}"),
        })
    }

    /// Sends one streamed chat completion (`body` must ask for `stream`)
    /// and times it. Never fails: every way a request can go wrong is an
    /// [`Outcome::Failed`] for the report.
    pub async fn chat_stream(&self, body: &Value) -> Outcome {
        let req = match self.request(Method::POST, "/v1/chat/completions", Some(body)) {
            Ok(r) => r,
            Err(e) => return Failure::outcome("io", e.to_string()),
        };
        match tokio::time::timeout(self.timeout, self.stream(req)).await {
            Ok(o) => o,
            Err(_) => Failure::outcome("timeout", format!("no [DONE] within {:?}", self.timeout)),
        }
    }

    async fn stream(&self, req: Request<Full<Bytes>>) -> Outcome {
        let start = Instant::now();
        let resp = match self.pool.request(req).await {
            Ok(r) => r,
            Err(e) => return Failure::outcome("io", transport(&e)),
        };
        let status = resp.status();
        if !status.is_success() {
            let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            return Failure::outcome(status.as_u16().to_string(), error_message(&body));
        }
        let mut body = resp.into_body();
        let mut sse = SseParser::default();
        let mut state = StreamState::default();
        while let Some(frame) = body.frame().await {
            let frame = match frame {
                Ok(f) => f,
                Err(e) => return Failure::outcome("io", format!("reading the stream: {e}")),
            };
            let Some(data) = frame.data_ref() else { continue };
            for event in sse.push(data) {
                if let Some(fail) = state.event(&event, start.elapsed()) {
                    return Outcome::Failed(fail);
                }
                if state.done {
                    let e2e = start.elapsed();
                    let ttft = state.first.unwrap_or(e2e);
                    let output_tokens = state.usage.unwrap_or(state.tokens);
                    return Outcome::Ok(Sample {
                        ttft,
                        e2e,
                        output_tokens,
                        sources: state.sources,
                        sent: Duration::ZERO,
                    });
                }
            }
        }
        Failure::outcome("incomplete", "the stream ended before [DONE]")
    }
}

/// hyper-util's error with its cause (the bare one says only "client error").
fn transport(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

/// What a stream has said so far.
#[derive(Default)]
struct StreamState {
    /// When the first token (or, for an empty answer, the finish) arrived.
    first: Option<Duration>,
    tokens: u64,
    usage: Option<u64>,
    sources: Option<FactSources>,
    done: bool,
}

impl StreamState {
    /// Takes one SSE `data` payload; a failure ends the request.
    fn event(&mut self, data: &str, at: Duration) -> Option<Failure> {
        if data == DONE {
            self.done = true;
            return None;
        }
        let v: Value = match serde_json::from_str(data) {
            Ok(v) => v,
            Err(e) => return Some(Failure { status: "io".into(), message: format!("SSE data is not JSON: {e}") }),
        };
        if let Some(err) = v.get("error") {
            let status = match &err["code"] {
                Value::Number(n) => n.to_string(),
                Value::String(s) if !s.is_empty() => s.clone(),
                _ => "sse".to_string(),
            };
            let message = err["message"].as_str().unwrap_or("SSE error without a message").to_string();
            return Some(Failure { status, message });
        }
        let choice = &v["choices"][0];
        // Any chunk with `content` is one token's event, even an empty one
        // (a partial UTF-8 character): the token exists, so TTFT is taken.
        if choice["delta"]["content"].is_string() {
            self.tokens += 1;
            self.first.get_or_insert(at);
        }
        if choice["finish_reason"].is_string() {
            self.first.get_or_insert(at);
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            self.usage = Some(n);
        }
        if let Ok(s) = FactSources::deserialize(&v["usage"]["memory"]["sources"]) {
            self.sources = Some(s);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_state_takes_ttft_usage_and_errors() {
        let ms = Duration::from_millis;
        let mut s = StreamState::default();
        let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}"#;
        assert_eq!(s.event(role, ms(40)), None);
        let more = r#"{"choices":[{"index":0,"delta":{"content":" there"},"finish_reason":null}]}"#;
        assert_eq!(s.event(more, ms(50)), None);
        let fin = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#;
        assert_eq!(s.event(fin, ms(60)), None);
        assert_eq!(s.event(r#"{"choices":[],"usage":{"completion_tokens":3}}"#, ms(61)), None);
        assert_eq!(s.event("[DONE]", ms(62)), None);
        assert_eq!((s.first, s.tokens, s.usage, s.done), (Some(ms(40)), 2, Some(3), true));
        assert_eq!(s.sources, None, "a usage without memory sources");

        let mut s = StreamState::default();
        let usage = r#"{"choices":[],"usage":{"completion_tokens":1,"memory":{"mode":"kv",
            "sources":{"device":3,"host":1,"disk":0,"prefilled":2}}}}"#;
        assert_eq!(s.event(usage, ms(9)), None);
        let want = FactSources { device: 3, host: 1, disk: 0, prefilled: 2 };
        assert_eq!(s.sources, Some(want));
        assert_eq!((want.class(), want.total()), ("prefilled", 6));
        assert_eq!(FactSources { device: 2, host: 1, ..Default::default() }.class(), "host");
        assert_eq!(FactSources::default().class(), "none");

        let mut s = StreamState::default();
        let err = r#"{"error":{"message":"queue full","type":"rate_limit","code":429}}"#;
        assert_eq!(s.event(err, ms(5)), Some(Failure { status: "429".into(), message: "queue full".into() }));
    }

    #[test]
    fn urls_with_or_without_v1() {
        let t = Duration::from_secs(1);
        for u in
            ["http://127.0.0.1:8080", "http://127.0.0.1:8080/", "http://127.0.0.1:8080/v1", "http://127.0.0.1:8080/v1/"]
        {
            assert_eq!(Client::new(u, None, t).expect(u).base, "http://127.0.0.1:8080");
        }
        assert_eq!(Client::new("http://h:1/api/v1", None, t).expect("prefix").base, "http://h:1/api");
        assert!(matches!(Client::new("https://h:1", None, t), Err(Error::Url { .. })));
        assert!(matches!(Client::new("h:1", None, t), Err(Error::Url { .. })));
        assert!(matches!(Client::new("http://h:1", Some("a\nb"), t), Err(Error::Config(_))));
    }
}
