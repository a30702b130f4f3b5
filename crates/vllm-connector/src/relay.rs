//! Generate in vLLM mode: compose the memory layout in the core, submit
//! the prompt's token ids to the co-located vLLM server's completions API
//! with the plan in `kv_transfer_params` and the plan's `cache_salt`, and
//! relay its streamed tokens as the worker API's events.
//!
//! The answer's text is ours: vLLM streams token ids (`return_token_ids`),
//! decoded here with the model's tokenizer and cut at the request's stop
//! strings, so vLLM need not load a tokenizer at all (`--skip-tokenizer-init`)
//! and the text and finish reasons are exactly a native worker's. End of
//! sequence is passed as `stop_token_ids`, which vLLM honours either way.
//! Dropping the HTTP stream (a client that went away, a deadline, a stop
//! string) makes vLLM abort the request and free its blocks.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use inferscale_engine::FinishReason;
use inferscale_memory::Mode;
use inferscale_types::sse::{DONE, SseParser, error_message};
use inferscale_worker::metrics::WorkerMetrics;
use inferscale_worker::text::{Delta, TextStream};
use inferscale_worker::{Event, Finished, GenerateJob, Timings, Usage, WorkerError, finish_reason};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::{ConnectorError, Result};
use crate::front::{Shared, worker_error};
use crate::memory_core::Composed;

/// The HTTP side of Generate; cheap to clone into each request's task.
#[derive(Clone)]
pub(crate) struct Relay {
    shared: Arc<Shared>,
    rt: tokio::runtime::Handle,
    pool: Client<HttpConnector, Full<Bytes>>,
    completions: hyper::Uri,
}

/// How a relayed request ended other than with its last token.
enum Stop {
    /// The caller went away.
    Cancelled,
    Failed(WorkerError),
}

impl From<WorkerError> for Stop {
    fn from(e: WorkerError) -> Self {
        Stop::Failed(e)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Relay {
    pub(crate) fn new(shared: Arc<Shared>, rt: tokio::runtime::Handle) -> Result<Relay> {
        let url = format!("{}/v1/completions", shared.cfg.vllm_url);
        let completions: hyper::Uri =
            url.parse().map_err(|e| ConnectorError::Invalid { what: "vllm_url", reason: format!("{url}: {e}") })?;
        if completions.scheme_str() != Some("http") || completions.authority().is_none() {
            return Err(ConnectorError::Invalid {
                what: "vllm_url",
                reason: format!("{}: expected http://host:port (vLLM on loopback)", shared.cfg.vllm_url),
            });
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        // `Client::new` needs the runtime's context for its pool's timer.
        let _guard = rt.enter();
        let pool = Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(90)).build(connector);
        Ok(Relay { shared, rt, pool, completions })
    }

    /// Runs `job` on the front's runtime; its events go to `events`.
    pub(crate) fn spawn(&self, job: GenerateJob, events: UnboundedSender<Event>, metrics: Arc<WorkerMetrics>) {
        let relay = self.clone();
        self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
        self.rt.spawn(async move {
            let span = job.span.clone();
            let deadline = job.deadline.map(|d| (job.arrived + d, d));
            let run = relay.run(job, &events, &metrics);
            let r = match deadline {
                Some((at, d)) => match tokio::time::timeout_at(at.into(), run).await {
                    Ok(r) => r,
                    Err(_) => Err(Stop::Failed(WorkerError::Deadline(d.as_millis() as u64))),
                },
                None => run.await,
            };
            match r {
                Ok(f) => {
                    span.record("finish_reason", finish_reason(f.reason));
                    metrics.finished();
                    let _ = events.send(Event::Finished(Box::new(f)));
                }
                Err(Stop::Cancelled) => metrics.cancelled(),
                Err(Stop::Failed(e)) => {
                    span.record("otel.status_code", "error");
                    metrics.failed();
                    let _ = events.send(Event::Failed(e));
                }
            }
            relay.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        });
    }

    /// Locks the core off the runtime's threads (an ingest batch may hold it).
    async fn with_core<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut crate::memory_core::AnyCore) -> std::result::Result<T, WorkerError> + Send + 'static,
    ) -> std::result::Result<T, WorkerError> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || f(&mut *shared.lock()?))
            .await
            .map_err(|e| WorkerError::Internal(format!("a core task panicked: {e}")))?
    }

    async fn run(
        &self,
        job: GenerateJob,
        events: &UnboundedSender<Event>,
        metrics: &WorkerMetrics,
    ) -> std::result::Result<Finished, Stop> {
        let k = (job.mode() != Mode::None).then(|| job.k());
        let (user, chat, scope) = (job.user().to_string(), job.chat.clone(), job.scope().clone());
        let composed: Composed = self
            .with_core(move |g| each!(g, c => c.compose_tracked(&user, &chat, &scope, k)).map_err(worker_error))
            .await?;
        let composed_at = Instant::now();
        let plan_id = composed.plan.id.clone();
        let r = self.stream(&job, &composed, events, metrics).await;
        // The plan's load count, once; a request vLLM never ran also
        // gives its plan back (the connector drops finished ones itself).
        let failed = r.is_err();
        let id = plan_id.clone();
        let loaded = self
            .with_core(move |g| {
                Ok(each!(g, c => {
                    if failed {
                        c.finish(&id);
                    }
                    c.take_loaded(&id)
                }))
            })
            .await
            .unwrap_or(0);
        let (reason, generated, first_token, cached) = r?;
        let done = Instant::now();
        let timings = Timings {
            queue_ms: 0.0,
            retrieve_ms: ms(composed_at - job.arrived),
            inject_ms: 0.0,
            // From the submission to vLLM to its first token: vLLM's queue,
            // its load of the memory and its prefill of the question.
            prefill_ms: first_token.map_or(0.0, |t| ms(t - composed_at)),
            first_token_ms: first_token.map_or(0.0, |t| ms(t - job.arrived)),
            total_ms: ms(done - job.arrived),
        };
        if let Some(t) = first_token {
            metrics.decoded(job.mode(), generated.saturating_sub(1), (done - t).as_secs_f64());
        }
        let injected = if job.mode().injects() { loaded } else { 0 };
        Ok(Finished {
            reason,
            usage: Usage {
                prompt_tokens: composed.prompt.len(),
                injected_tokens: injected,
                // vLLM counts the connector's tokens among its cached ones.
                cached_tokens: cached.saturating_sub(injected),
                completion_tokens: generated,
                facts: composed.fact_ids.len(),
                recomputed_tokens: 0,
                sources: None,
            },
            timings,
            fact_ids: composed.fact_ids,
        })
    }

    /// The completions request for `c`: the memory plan in kv mode (the
    /// header too with no memory), the same ids without one in prompt mode.
    fn body(&self, job: &GenerateJob, c: &Composed) -> Value {
        let p = &job.params;
        let eos: &[u32] = if p.ignore_eos { &[] } else { &self.shared.eos };
        let mut body = json!({
            "model": self.shared.cfg.served_model,
            "prompt": c.prompt,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            // vLLM's seeds are signed 64-bit: the same bits, reinterpreted.
            "seed": p.seed as i64,
            "ignore_eos": p.ignore_eos,
            "stop_token_ids": eos,
            "stream": true,
            "stream_options": {"include_usage": true},
            "return_token_ids": true,
            // kv mode: the plan's salt (the scheduler side checks it); prompt
            // mode: the user's prompt namespace, never a block we injected.
            "cache_salt": if job.mode().injects() { &c.plan.salt } else { &c.prompt_salt },
            "request_id": format!("inferscale-{}", c.plan.id),
        });
        if p.top_k > 0 {
            body["top_k"] = json!(p.top_k);
        }
        // vLLM applies the same penalties and min-p (its sampler's own).
        for (name, v, neutral) in [
            ("min_p", p.min_p, 0.0),
            ("repetition_penalty", p.repetition_penalty, 1.0),
            ("presence_penalty", p.presence_penalty, 0.0),
            ("frequency_penalty", p.frequency_penalty, 0.0),
        ] {
            if v != neutral {
                body[name] = json!(v);
            }
        }
        if job.mode().injects() {
            body["kv_transfer_params"] = c.plan.to_params();
        }
        body
    }

    /// Submits `c` and relays its tokens: `(reason, tokens, first token's
    /// arrival, tokens vLLM reports cached)`.
    async fn stream(
        &self,
        job: &GenerateJob,
        c: &Composed,
        events: &UnboundedSender<Event>,
        metrics: &WorkerMetrics,
    ) -> std::result::Result<(FinishReason, usize, Option<Instant>, usize), Stop> {
        let upstream = |what: String| Stop::Failed(WorkerError::Upstream(what));
        let body = serde_json::to_vec(&self.body(job, c)).map_err(|e| WorkerError::Internal(e.to_string()))?;
        let req = Request::post(self.completions.clone())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| WorkerError::Internal(e.to_string()))?;
        let resp = tokio::select! {
            r = self.pool.request(req) => r.map_err(|e| upstream(format!(
                "vLLM at {} did not answer: {e}", self.shared.cfg.vllm_url
            )))?,
            _ = events.closed() => return Err(Stop::Cancelled),
        };
        let status = resp.status();
        let mut body = resp.into_body();
        if status != StatusCode::OK {
            let text = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let message = error_message(&text);
            return Err(Stop::Failed(match status.is_client_error() {
                true => WorkerError::EngineRefused(format!("vLLM ({status}): {message}")),
                false => WorkerError::Upstream(format!("vLLM failed the request ({status}): {message}")),
            }));
        }
        let tok = self.shared.files.tokenizer.as_ref().ok_or_else(|| WorkerError::Internal("no tokenizer".into()))?;
        let (mut sse, mut text) = (SseParser::default(), TextStream::default());
        let mut generated: Vec<u32> = Vec::new();
        let (mut first, mut cached, mut reason) = (None, 0usize, None::<FinishReason>);
        loop {
            let frame = tokio::select! {
                f = body.frame() => f,
                _ = events.closed() => return Err(Stop::Cancelled),
            };
            let Some(frame) = frame else {
                return Err(upstream("vLLM's stream ended before its last event".into()));
            };
            let frame = frame.map_err(|e| upstream(format!("reading vLLM's stream: {e}")))?;
            let Ok(data) = frame.into_data() else { continue };
            for event in sse.push(&data).iter().map(|d| SseEvent::parse(d)) {
                let v = match event {
                    SseEvent::Done => {
                        let reason =
                            reason.ok_or_else(|| upstream("vLLM's stream ended with no finish reason".into()))?;
                        return Ok((reason, generated.len(), first, cached));
                    }
                    SseEvent::Data(v) => v,
                };
                if let Some(e) = v.get("error") {
                    return Err(upstream(format!(
                        "vLLM: {}",
                        e.get("message").and_then(Value::as_str).unwrap_or("error")
                    )));
                }
                if let Some(n) = v.pointer("/usage/prompt_tokens_details/cached_tokens").and_then(Value::as_u64) {
                    cached = n as usize;
                }
                let Some(choice) = v.pointer("/choices/0") else { continue };
                let ids = choice.get("token_ids").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
                for id in ids {
                    let id = id
                        .as_u64()
                        .and_then(|i| u32::try_from(i).ok())
                        .ok_or_else(|| upstream(format!("vLLM streamed a token id that is not one: {id}")))?;
                    if first.is_none() {
                        let now = Instant::now();
                        metrics.first_token(job.mode(), (now - job.arrived).as_secs_f64());
                        first = Some(now);
                    }
                    generated.push(id);
                    let delta = text.push(tok, &generated, &job.params.stop).map_err(WorkerError::from)?;
                    let (piece, stop) = match delta {
                        Delta::Text(p) => (p, false),
                        Delta::Stop(p) => (p, true),
                    };
                    if events.send(Event::Token { id, text: piece, logprobs: None }).is_err() {
                        return Err(Stop::Cancelled);
                    }
                    if stop {
                        // Dropping the stream aborts the request in vLLM.
                        return Ok((FinishReason::Stop, generated.len(), first, cached));
                    }
                }
                match choice.get("finish_reason").and_then(Value::as_str) {
                    None => {}
                    Some("length") => reason = Some(FinishReason::Length),
                    Some("stop") => {
                        let last_is_eos = generated.last().is_some_and(|t| self.shared.eos.contains(t));
                        reason = Some(if last_is_eos { FinishReason::Eos } else { FinishReason::Stop });
                    }
                    Some(other) => return Err(upstream(format!("vLLM ended the request: {other}"))),
                }
                if reason.is_some() {
                    // The held-back text (an incomplete stop-string prefix).
                    let rest = text.finish(tok, &generated).map_err(WorkerError::from)?;
                    let id = generated.last().copied().unwrap_or(0);
                    if !rest.is_empty() && events.send(Event::Token { id, text: rest, logprobs: None }).is_err() {
                        return Err(Stop::Cancelled);
                    }
                }
            }
        }
    }
}

/// The message of an OpenAI-style error body, or the body itself.
#[derive(Debug, PartialEq)]
enum SseEvent {
    Data(Value),
    Done,
}

impl SseEvent {
    /// One `data` payload of vLLM's stream.
    fn parse(data: &str) -> SseEvent {
        if data == DONE {
            return SseEvent::Done;
        }
        let v = serde_json::from_str(data);
        SseEvent::Data(v.unwrap_or_else(|_| json!({"error": {"message": "vLLM streamed an event that is not JSON"}})))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_become_events() {
        assert_eq!(SseEvent::parse(r#"{"a": 1}"#), SseEvent::Data(json!({"a": 1})));
        assert_eq!(SseEvent::parse(DONE), SseEvent::Done);
        let SseEvent::Data(bad) = SseEvent::parse("nope") else { panic!("not JSON is an error event") };
        assert!(bad.pointer("/error/message").is_some(), "{bad}");
    }
}
