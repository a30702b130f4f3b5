//! Chat and text completions: a validated request run on a worker
//! (`dispatch::start`) and answered in OpenAI's shapes, whole or as
//! server-sent events, with usage, timings and — when asked — each token's
//! log-probabilities.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::{Stream, StreamExt};
use inferscale_proto as pb;
use inferscale_types::Mode;
use serde_json::{Value, json};

use crate::error::{ApiError, Result};
use crate::metrics::{Metrics, mode_index};
use crate::openai::{self, SamplingFields};
use crate::reqlog;
use crate::state::{AppState, Shared, body, now_secs, tenant, unique};
use crate::validate::{self, Kind, Validated};
use crate::workers::InFlight;

/// Response header naming the worker that served a chat request.
pub const WORKER_HEADER: &str = "x-inferscale-worker";

/// `POST /v1/chat/completions`.
pub(crate) async fn chat(
    State(s): State<Shared>,
    Extension(log): Extension<reqlog::Handle>,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    answer(s, log, &headers, b, validate::chat).await
}

/// `POST /v1/completions`.
pub(crate) async fn completions(
    State(s): State<Shared>,
    Extension(log): Extension<reqlog::Handle>,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    answer(s, log, &headers, b, validate::completion).await
}

/// An OpenAI request of either endpoint: read, checked by `check`, run.
async fn answer<T: serde::de::DeserializeOwned>(
    s: Shared,
    log: reqlog::Handle,
    headers: &HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
    check: fn(&AppState, &str, T, &SamplingFields) -> Result<Validated>,
) -> Result<Response> {
    let clock = Clock { start: Instant::now(), first: None, tokens: 0, log };
    let (tenant, parsed, sampling) = openai_request(&s, headers, b)?;
    let v = check(&s, &tenant, parsed, &sampling)?;
    generate(s, &tenant, v, clock).await
}

/// The tenant, the parsed body and its sampling fields, with the
/// parameters we do not implement refused by name.
fn openai_request<T: serde::de::DeserializeOwned>(
    s: &AppState,
    headers: &HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<(String, T, SamplingFields)> {
    let tenant = tenant(s, headers)?;
    let v = validate::object(&body(b, s.defaults.body_limit)?)?;
    let (parsed, sampling) = (validate::typed(&v)?, validate::typed(&v)?);
    validate::check_unsupported(&v)?;
    Ok((tenant, parsed, sampling))
}

/// A validated request on its way: what the worker is sent, and how the
/// answer is shaped.
struct Call {
    v: Validated,
    req: pb::GenerateRequest,
}

impl Call {
    fn mode(&self) -> Mode {
        self.v.generation.memory.mode
    }

    fn logprobs(&self) -> bool {
        self.v.generation.sampling.logprobs.is_some()
    }
}

/// Runs a validated request on a worker and answers it, streamed or whole.
async fn generate(s: Shared, tenant: &str, v: Validated, clock: Clock) -> Result<Response> {
    let deadline_ms = s.defaults.deadline.as_millis().min(u128::from(u32::MAX)) as u32;
    let call = Call { req: pb::GenerateRequest::new(&v.generation, deadline_ms), v };
    let g = &call.v.generation;
    clock.log.update(|f| {
        f.user = (!g.user.is_empty()).then(|| reqlog::user_hash(&g.user));
        f.mode = Some(g.memory.mode);
        f.k = (g.memory.mode != Mode::None).then_some(g.memory.k);
    });
    let (guard, stream, first) =
        crate::dispatch::start(&s, &call.req, &call.v.user).await.map_err(|e| e.unscope(tenant))?;
    let prefix = match call.v.kind {
        Kind::Chat => "chatcmpl",
        Kind::Text => "cmpl",
    };
    let id = format!("{prefix}-{:016x}", unique());
    let worker = guard.worker().name.clone();
    clock.log.update(|f| f.worker = Some(worker.clone()));
    let mut resp = if call.v.stream {
        let st = SseState {
            s: s.clone(),
            call,
            id,
            created: now_secs(),
            _guard: guard,
            stream,
            pending: first,
            clock,
            sent_role: false,
            text_offset: 0,
            done: false,
            _span: tracing::Span::current(),
        };
        sse(st).into_response()
    } else {
        let r = complete(&s, call, id, stream, first, clock).await;
        drop(guard);
        r?.into_response()
    };
    if let Ok(v) = header::HeaderValue::from_str(&worker) {
        resp.headers_mut().insert(WORKER_HEADER, v);
    }
    Ok(resp)
}

fn usage(mode: Mode, f: &pb::Finished) -> openai::Usage {
    let u = f.usage.unwrap_or_default();
    openai::Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        total_tokens: u.prompt_tokens + u.completion_tokens,
        // Recomputed memory tokens were computed, not taken from a cache.
        prompt_tokens_details: openai::PromptDetails {
            cached_tokens: (u.cached_tokens + u.injected_tokens).saturating_sub(u.recomputed_tokens),
        },
        memory: openai::MemoryUsage {
            mode,
            facts: u.facts,
            injected_tokens: u.injected_tokens,
            recomputed_tokens: (mode == Mode::Blend).then_some(u.recomputed_tokens),
            fact_ids: f.fact_ids.clone(),
            sources: u.sources.filter(|_| mode.injects()).map(Into::into),
        },
    }
}

fn timings(f: &pb::Finished) -> Value {
    let t = f.timings.unwrap_or_default();
    json!({"queue_ms": t.queue_ms, "retrieve_ms": t.retrieve_ms, "inject_ms": t.inject_ms,
           "prefill_ms": t.prefill_ms, "first_token_ms": t.first_token_ms, "total_ms": t.total_ms})
}

/// One token's entry in a chat answer's `logprobs.content`.
fn chat_logprob(l: &pb::Logprobs) -> Value {
    let one = |t: &pb::TokenLogprob| json!({"token": String::from_utf8_lossy(&t.token), "logprob": t.logprob, "bytes": t.token});
    let mut entry = l.chosen.as_ref().map_or(json!({}), one);
    entry["top_logprobs"] = l.top.iter().map(one).collect();
    entry
}

/// A text completion's `logprobs` for `tokens` (the legacy shape: parallel
/// lists, alternatives as `{token: logprob}`), the first starting at
/// `offset` bytes into the text.
fn text_logprobs(tokens: &[pb::Logprobs], mut offset: usize) -> Value {
    let (mut text, mut lps, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for l in tokens {
        let chosen = l.chosen.clone().unwrap_or_default();
        let piece = String::from_utf8_lossy(&chosen.token).into_owned();
        offsets.push(offset);
        offset += piece.len();
        text.push(piece);
        lps.push(chosen.logprob);
        let top: serde_json::Map<String, Value> =
            l.top.iter().map(|t| (String::from_utf8_lossy(&t.token).into_owned(), json!(t.logprob))).collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": text, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// Latency bookkeeping of one request, and its request-log line's facts.
struct Clock {
    start: Instant,
    first: Option<Instant>,
    tokens: u64,
    log: reqlog::Handle,
}

impl Clock {
    fn token(&mut self) {
        self.first.get_or_insert_with(Instant::now);
        self.tokens += 1;
    }

    fn record(&self, m: &Metrics, mode: Mode, f: &pb::Finished) {
        let i = mode_index(mode);
        m.e2e[i].observe(self.start.elapsed().as_secs_f64());
        m.prompt_tokens.fetch_add(f.usage.as_ref().map_or(0, |u| u64::from(u.prompt_tokens)), Ordering::Relaxed);
        if let Some(first) = self.first {
            m.ttft[i].observe((first - self.start).as_secs_f64());
            if self.tokens > 1 {
                m.tpot[i].observe(first.elapsed().as_secs_f64() / (self.tokens - 1) as f64);
            }
        }
        m.output_tokens.fetch_add(self.tokens, Ordering::Relaxed);
        self.log.update(|l| {
            l.prompt_tokens = f.usage.as_ref().map(|u| u.prompt_tokens);
            l.completion_tokens = Some(self.tokens);
            l.ttft_ms = self.first.map(|first| (first - self.start).as_secs_f64() * 1e3);
        });
    }
}

async fn complete(
    s: &AppState,
    call: Call,
    id: String,
    mut stream: tonic::Streaming<pb::GenerateEvent>,
    mut next: Option<pb::GenerateEvent>,
    mut clock: Clock,
) -> Result<Json<Value>> {
    use pb::generate_event::Event as E;
    let mut text = String::new();
    let mut logprobs = Vec::new();
    loop {
        match next.and_then(|e| e.event) {
            Some(E::Token(t)) => {
                clock.token();
                text.push_str(&t.text);
                logprobs.extend(t.logprobs);
            }
            Some(E::Finished(f)) => {
                let mode = call.mode();
                clock.record(&s.metrics, mode, &f);
                let usage = usage(mode, &f);
                let body = match call.v.kind {
                    Kind::Chat => serde_json::to_value(openai::ChatResponse {
                        id,
                        object: "chat.completion",
                        created: now_secs(),
                        model: s.model.clone(),
                        choices: vec![openai::Choice {
                            index: 0,
                            message: openai::AssistantMessage { role: "assistant", content: text },
                            logprobs: match call.logprobs() {
                                true => json!({"content": logprobs.iter().map(chat_logprob).collect::<Vec<_>>()}),
                                false => Value::Null,
                            },
                            finish_reason: f.reason.clone(),
                        }],
                        usage,
                        timings: timings(&f),
                    })
                    .map_err(|e| ApiError::Internal(format!("encoding the response: {e}")))?,
                    Kind::Text => {
                        let lp = if call.logprobs() { text_logprobs(&logprobs, 0) } else { Value::Null };
                        json!({
                            "id": id, "object": "text_completion", "created": now_secs(), "model": s.model,
                            "choices": [{"index": 0, "text": text, "finish_reason": f.reason, "logprobs": lp}],
                            "usage": usage, "timings": timings(&f),
                        })
                    }
                };
                return Ok(Json(body));
            }
            None => return Err(ApiError::Internal("the worker ended the stream without finishing".into())),
        }
        next = stream.message().await?;
    }
}

struct SseState {
    s: Shared,
    call: Call,
    id: String,
    created: u64,
    _guard: InFlight,
    stream: tonic::Streaming<pb::GenerateEvent>,
    pending: Option<pb::GenerateEvent>,
    clock: Clock,
    sent_role: bool,
    /// Bytes of text streamed so far (a completion's `text_offset`).
    text_offset: usize,
    done: bool,
    /// The request's span lives as long as its stream, so the trace
    /// covers the whole answer rather than the response headers.
    _span: tracing::Span,
}

/// One streamed piece: a chat `delta` (for a completion, its `content`
/// becomes the choice's `text`), its token's log-probabilities when asked
/// for, or the finish.
fn chunk(st: &SseState, delta: Value, logprobs: Option<&pb::Logprobs>, finish: Option<&str>) -> SseEvent {
    let body = match st.call.v.kind {
        Kind::Chat => {
            let lp = logprobs.map_or(Value::Null, |l| json!({"content": [chat_logprob(l)]}));
            json!({"id": st.id, "object": "chat.completion.chunk", "created": st.created, "model": st.s.model,
                   "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]})
        }
        Kind::Text => {
            let text = delta.get("content").and_then(Value::as_str).unwrap_or("");
            let lp = logprobs.map_or(Value::Null, |l| text_logprobs(std::slice::from_ref(l), st.text_offset));
            json!({"id": st.id, "object": "text_completion", "created": st.created, "model": st.s.model,
                   "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}]})
        }
    };
    SseEvent::default().data(body.to_string())
}

/// Streams OpenAI chunks; dropping this stream (the client went away)
/// drops the worker call, which cancels the request and frees its blocks.
fn sse(st: SseState) -> Sse<impl Stream<Item = std::result::Result<SseEvent, Infallible>>> {
    let events = futures_util::stream::unfold(st, |mut st| async move {
        use pb::generate_event::Event as E;
        if st.done {
            return None;
        }
        let next = match st.pending.take() {
            Some(e) => Ok(Some(e)),
            None => st.stream.message().await,
        };
        let mut out = Vec::new();
        match next {
            Ok(Some(pb::GenerateEvent { event: Some(E::Token(t)) })) => {
                st.clock.token();
                let mut delta = json!({"content": t.text});
                if !st.sent_role {
                    delta["role"] = json!("assistant");
                    st.sent_role = true;
                }
                out.push(chunk(&st, delta, t.logprobs.as_ref(), None));
                st.text_offset += t.text.len();
            }
            Ok(Some(pb::GenerateEvent { event: Some(E::Finished(f)) })) => {
                let mode = st.call.mode();
                st.clock.record(&st.s.metrics, mode, &f);
                out.push(chunk(&st, json!({}), None, Some(&f.reason)));
                if st.call.v.include_usage {
                    let object = match st.call.v.kind {
                        Kind::Chat => "chat.completion.chunk",
                        Kind::Text => "text_completion",
                    };
                    let body = json!({"id": st.id, "object": object, "created": st.created,
                                      "model": st.s.model, "choices": [], "usage": usage(mode, &f),
                                      "timings": timings(&f)});
                    out.push(SseEvent::default().data(body.to_string()));
                }
                out.push(SseEvent::default().data("[DONE]"));
                st.done = true;
            }
            Ok(_) => {
                let e = ApiError::Internal("the worker ended the stream without finishing".into());
                out.push(SseEvent::default().data(e.body().to_string()));
                st.done = true;
            }
            Err(status) => {
                out.push(SseEvent::default().data(ApiError::from(status).body().to_string()));
                st.done = true;
            }
        }
        Some((futures_util::stream::iter(out.into_iter().map(Ok)), st))
    })
    .flatten();
    Sse::new(events).keep_alive(KeepAlive::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(token: &[u8], logprob: f32, top: &[(&[u8], f32)]) -> pb::Logprobs {
        let t = |token: &[u8], logprob| pb::TokenLogprob { id: 0, token: token.to_vec(), logprob };
        pb::Logprobs { chosen: Some(t(token, logprob)), top: top.iter().map(|&(k, l)| t(k, l)).collect() }
    }

    #[test]
    fn logprobs_take_openais_chat_and_completion_shapes() {
        let l = lp(b" Paris", -0.25, &[(b" Paris", -0.25), (b" Lyon", -2.0)]);
        let c = chat_logprob(&l);
        assert_eq!(c["token"], " Paris");
        assert_eq!(c["bytes"], json!(b" Paris".to_vec()));
        assert_eq!(c["top_logprobs"][1]["token"], " Lyon");
        assert_eq!(c["top_logprobs"][1]["logprob"], -2.0);
        let t = text_logprobs(&[l, lp(b"!", -1.5, &[])], 3);
        assert_eq!(t["tokens"], json!([" Paris", "!"]));
        assert_eq!(t["token_logprobs"], json!([-0.25, -1.5]));
        assert_eq!(t["text_offset"], json!([3, 9]));
        assert_eq!(t["top_logprobs"][0][" Lyon"], -2.0);
        // A piece of a character shows as the replacement character, its bytes intact.
        let half = chat_logprob(&lp(&[0xc3], -0.1, &[]));
        assert_eq!(half["bytes"], json!([0xc3]));
        assert_eq!(half["token"], "\u{FFFD}");
    }
}
