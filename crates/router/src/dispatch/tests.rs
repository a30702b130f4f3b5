//! Dispatch's decisions against fake workers: real gRPC on loopback, each
//! worker answering from a script, so that every retry rule is pinned
//! without a model or a cluster.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use inferscale_types::Refusal;
use tonic::Status;

use super::*;
use crate::fake_worker::{Answer, Events, Scripted, serve};
use crate::state::Defaults;
use crate::workers::Workers;

/// How a fake worker answers what it is asked to generate or store.
#[derive(Debug, Clone, Copy)]
enum Script {
    Serve,
    /// Up (its health check says ready) but answering every call with a
    /// plain `Unavailable`, as a worker shutting down does.
    Unavailable,
    /// The user's memory is damaged there.
    Damaged,
    /// A refusal of the request, naming a parameter.
    Refuse,
}

struct Fake {
    script: Script,
    calls: Arc<AtomicUsize>,
}

impl Fake {
    fn answer(&self) -> std::result::Result<(), Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match self.script {
            Script::Serve => Ok(()),
            Script::Unavailable => Err(Status::unavailable("going away")),
            Script::Damaged => Err(pb::ErrorKind::Damaged.mark(Status::unavailable("this user's memory is damaged"))),
            Script::Refuse => Err(pb::refused(&Refusal::new("memory.k", "7 is outside 1..=5"))),
        }
    }
}

#[tonic::async_trait]
impl Scripted for Fake {
    async fn ingest(&self, _: pb::IngestRequest) -> Answer<pb::IngestResponse> {
        self.answer()?;
        Ok(pb::IngestResponse { added: 1, ..Default::default() })
    }

    async fn generate(&self, _: pb::GenerateRequest) -> Answer<Events> {
        self.answer()?;
        let done = pb::GenerateEvent { event: Some(pb::generate_event::Event::Finished(Default::default())) };
        Ok(Box::pin(futures_util::stream::iter([Ok(done)])))
    }
}

/// A router state over one fake worker per script (all probed healthy),
/// and each worker's count of scripted calls, by worker name.
async fn router(scripts: &[Script]) -> (AppState, Vec<(String, Arc<AtomicUsize>)>) {
    let mut addrs = Vec::new();
    let mut calls = Vec::new();
    for &script in scripts {
        let count = Arc::new(AtomicUsize::new(0));
        let addr = serve(Fake { script, calls: count.clone() }).await;
        calls.push((addr.clone(), count));
        addrs.push(addr);
    }
    let workers = Workers::fixed(&addrs, 1.25, Default::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(workers.probe().await, scripts.len(), "every fake worker answers its health check");
    let state = AppState {
        workers: Arc::new(workers),
        keys: Default::default(),
        model: "fake".into(),
        defaults: Defaults::default(),
        metrics: Default::default(),
        rebalance: Default::default(),
        jobs: Default::default(),
    };
    (state, calls)
}

fn generate(user: &str, mode: pb::MemoryMode) -> pb::GenerateRequest {
    pb::GenerateRequest { user: user.into(), mode: mode as i32, ..Default::default() }
}

fn count(calls: &[(String, Arc<AtomicUsize>)], i: usize) -> usize {
    calls[i].1.load(Ordering::SeqCst)
}

#[tokio::test]
async fn a_request_without_memory_moves_on_when_its_worker_goes_away() {
    let (s, calls) = router(&[Script::Unavailable, Script::Serve]).await;
    for i in 0..20 {
        let spread = format!("client-{i}");
        let r = start(&s, &generate("", pb::MemoryMode::None), &spread).await;
        let (w, _, first) = r.unwrap_or_else(|e| panic!("{spread}: {e}"));
        assert_eq!(w.worker().name, calls[1].0, "{spread}: served by the worker that serves");
        assert!(first.is_some(), "{spread}: the first event came back");
    }
    // The failing worker was tried at most once: its `Unavailable` marks
    // it down until its next probe.
    assert!(count(&calls, 0) <= 1, "tried {} times", count(&calls, 0));
    assert_eq!(count(&calls, 1), 20);
    assert!(!s.workers.all().iter().any(|w| w.name == calls[0].0 && w.is_healthy()));
}

#[tokio::test]
async fn a_refusal_is_answered_at_once_with_its_parameter() {
    let (s, calls) = router(&[Script::Refuse]).await;
    let t = std::time::Instant::now();
    let e = start(&s, &generate("acme/ana", pb::MemoryMode::Kv), "ana").await.err();
    match e {
        Some(ApiError::Refused(r)) => {
            assert_eq!((r.param.as_str(), r.message.as_str()), ("memory.k", "7 is outside 1..=5"))
        }
        other => panic!("expected a refusal naming memory.k, got {other:?}"),
    }
    assert_eq!(count(&calls, 0), 1, "a refusal is not retried");
    assert!(t.elapsed() < RETRY_PAUSE * 4, "answered in {:?}", t.elapsed());
}

#[tokio::test]
async fn a_damaged_memory_with_no_other_copy_is_a_503_at_once() {
    let (s, calls) = router(&[Script::Damaged]).await;
    let t = std::time::Instant::now();
    let e = start(&s, &generate("acme/ana", pb::MemoryMode::Kv), "ana").await.err();
    assert!(matches!(&e, Some(ApiError::Unavailable(m)) if m.contains("damaged")), "{e:?}");
    assert_eq!(count(&calls, 0), 1);
    assert!(t.elapsed() < RETRY_FOR / 10, "answered in {:?}", t.elapsed());
    // The worker is up: a damaged user does not take it out of service.
    assert!(s.workers.all()[0].is_healthy());
}

#[tokio::test]
async fn a_write_is_acknowledged_by_its_writer_and_a_refusal_is_not_retried() {
    let ingest = |mut c: WorkerClient, _home: bool| async move { c.ingest(pb::IngestRequest::default()).await };
    let (s, calls) = router(&[Script::Serve]).await;
    let r = write_all(&s, "acme/ana", |_| false, ingest).await;
    assert_eq!(r.map(|a| a.added).ok(), Some(1));
    assert_eq!(count(&calls, 0), 1);

    let (s, calls) = router(&[Script::Refuse]).await;
    let e = write_all(&s, "acme/ana", |_| false, ingest).await.err();
    assert!(matches!(&e, Some(ApiError::Refused(r)) if r.param == "memory.k"), "{e:?}");
    assert_eq!(count(&calls, 0), 1, "a refusal is final");
}
