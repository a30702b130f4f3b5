//! The dispatcher's own decisions, against a host that keeps units in
//! a map: both real hosts run behind it in the CLI's and the vLLM
//! front's end-to-end tests; here each ordering rule is pinned alone.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use inferscale_memory::{ImportReport, KvHeader, MemoryError, ShardRecord, StagedShard};
use inferscale_types::{Generation, Input, MemoryRequest, Message, Role, Sampling};
use tokio::sync::mpsc;
use tracing::Span;

use super::*;

#[derive(Default)]
struct MapHost {
    shard: MapShard,
    generated: Vec<String>,
    /// An engine that cannot blend (vLLM's).
    no_blend: bool,
    /// The changes reported to the host, in order.
    changes: Vec<(String, Change)>,
}

#[derive(Default)]
struct MapShard {
    units: HashMap<String, Vec<MemoryUnit>>,
    dropped: Vec<String>,
    /// The ingest under way: its user and how many units it had.
    begun: Option<(String, usize)>,
    /// Ingests committed and aborted.
    ends: Vec<bool>,
}

impl MemoryHost for MapHost {
    fn blends(&self) -> bool {
        !self.no_blend
    }
    fn generate(&mut self, job: GenerateJob, _events: Events) -> Result<()> {
        self.generated.push(job.chat.question);
        Ok(())
    }
    fn load(&self) -> Load {
        Load { running: 1, max_queue: 8, ..Load::default() }
    }
    fn with_shard<T>(&mut self, f: impl FnOnce(&mut dyn Shard) -> Result<T>) -> Result<T> {
        f(&mut self.shard)
    }
    fn memory_changed(&mut self, user: &str, change: Change) {
        self.changes.push((user.into(), change));
    }
}

impl Shard for MapShard {
    fn window(&self) -> usize {
        2
    }
    fn embed(&self, texts: &[String]) -> Result<Embedded> {
        let vectors = texts.iter().map(|t| vec![t.len() as f32]).collect();
        Ok(Embedded { vectors, tokens: texts.iter().map(String::len).sum() })
    }
    fn search(&self, q: &SearchQuery) -> Result<Vec<(StoredUnit, f32)>> {
        Ok(self.units(&q.user)?.into_iter().take(q.top_k).map(|u| (u, 1.0)).collect())
    }
    fn update(&mut self, _: &str, _: &str, change: &UnitUpdate, _: bool) -> Result<UpdateReport> {
        Ok(UpdateReport { changed: change.text.is_some(), encoded_tokens: 0 })
    }
    fn history(&self, _: &str, _: &str) -> Result<Vec<UnitEvent>> {
        Ok(Vec::new())
    }
    fn check_fits(&self, units: &[MemoryUnit]) -> Result<()> {
        match units.iter().find(|u| u.text == "huge") {
            Some(u) => Err(WorkerError::InvalidMemory { what: "unit", reason: format!("{:?} is too long", u.id) }),
            None => Ok(()),
        }
    }
    fn ingest(&mut self, user: &str, units: &[MemoryUnit], _defer_kv: bool) -> Result<IngestReport> {
        if units.iter().any(|u| u.text == "boom") {
            let reason = "injected failure".into();
            return Err(WorkerError::Memory(MemoryError::Corrupt { path: "kv.log".into(), offset: 0, reason }));
        }
        self.units.entry(user.into()).or_default().extend_from_slice(units);
        Ok(IngestReport { added: units.len(), ..Default::default() })
    }
    fn begin_ingest(&mut self, user: &str, _units: &[MemoryUnit]) -> Result<()> {
        assert!(self.begun.is_none(), "one ingest at a time");
        self.begun = Some((user.into(), self.units.get(user).map_or(0, Vec::len)));
        Ok(())
    }
    fn end_ingest(&mut self, user: &str, commit: bool) -> (bool, Result<()>) {
        let (who, had) = self.begun.take().expect("an ingest was begun");
        assert_eq!(who, user);
        let mut removed = false;
        if !commit && let Some(u) = self.units.get_mut(user) {
            removed = u.len() > had;
            u.truncate(had);
        }
        self.ends.push(commit);
        (removed, Ok(()))
    }
    fn units(&self, user: &str) -> Result<Vec<StoredUnit>> {
        let units = self.units.get(user).ok_or_else(|| WorkerError::UnknownUser(user.into()))?;
        Ok(units.iter().map(|u| StoredUnit { unit: u.clone(), ..Default::default() }).collect())
    }
    fn forget(&mut self, user: &str, _unit: Option<&str>) -> Result<()> {
        self.units.remove(user).map(drop).ok_or_else(|| WorkerError::UnknownUser(user.into()))
    }
    fn holdings(&self, _footprint: bool) -> Holdings {
        let facts = self.units.values().map(Vec::len).sum();
        Holdings { users: self.units.len(), facts, footprint: None, ..Default::default() }
    }
    fn users(&self) -> (Vec<String>, Vec<u64>) {
        self.units.iter().map(|(u, us)| (u.clone(), us.len() as u64)).unzip()
    }
    fn fact_ids(&self, user: &str) -> Vec<String> {
        self.units.get(user).map_or_else(Vec::new, |u| u.iter().map(|u| u.id.clone()).collect())
    }
    fn export_begin(&self, _user: &str) -> Result<(KvHeader, Vec<String>)> {
        Err(WorkerError::Internal("not part of these tests".into()))
    }
    fn export(&self, _: &str, _: &[String], _: bool, _: usize) -> Result<(Vec<ShardRecord>, usize)> {
        Err(WorkerError::Internal("not part of these tests".into()))
    }
    fn import_target(&self) -> Result<(PathBuf, KvHeader)> {
        Err(WorkerError::Internal("not part of these tests".into()))
    }
    fn commit_import(&mut self, _: &str, _: StagedShard) -> Result<ImportReport> {
        Err(WorkerError::Internal("not part of these tests".into()))
    }
    fn drop_user(&mut self, user: &str) -> Result<()> {
        self.units.remove(user);
        self.dropped.push(user.into());
        Ok(())
    }
}

fn protocol() -> (Protocol, Arc<WorkerMetrics>) {
    let metrics = Arc::new(WorkerMetrics::default());
    let cfg = ProtocolConfig { max_k: 50, ingest_batch: 2, max_ingest_units: 6 };
    (Protocol::new(cfg, metrics.clone()), metrics)
}

fn units(ids: &[&str]) -> Vec<MemoryUnit> {
    ids.iter().map(|&id| MemoryUnit { id: id.into(), text: format!("unit {id}"), ..Default::default() }).collect()
}

fn job(user: &str, question: &str, mode: Mode, k: usize) -> GenerateJob {
    let request = Generation {
        user: user.into(),
        input: Input::Chat(vec![Message::new(Role::User, question)]),
        memory: MemoryRequest { mode, k: k as u32, ..MemoryRequest::none() },
        sampling: Sampling { temperature: 0.0, max_tokens: 8, ..Sampling::default() },
    };
    GenerateJob::new(request, None, Instant::now(), Span::none())
}

/// A refusal's parameter, or the error itself when it is not one.
fn param(e: &WorkerError) -> std::result::Result<&str, String> {
    match e {
        WorkerError::Refused(r) => Ok(&r.param),
        other => Err(other.to_string()),
    }
}

/// Sends `job`; returns the error it was refused with, if any.
fn generate(p: &mut Protocol, host: &mut MapHost, job: GenerateJob) -> Option<WorkerError> {
    let (events, mut rx) = mpsc::unbounded_channel();
    p.handle(host, Command::Generate { job: Box::new(job), events });
    match rx.try_recv() {
        Ok(Event::Failed(e)) => Some(e),
        _ => None,
    }
}

fn ingest(
    p: &mut Protocol,
    host: &mut MapHost,
    user: &str,
    u: Vec<MemoryUnit>,
) -> oneshot::Receiver<Result<IngestReport>> {
    let (reply, rx) = oneshot::channel();
    p.handle(host, Command::Ingest { user: user.into(), window: None, units: u, defer_kv: false, reply });
    rx
}

#[test]
fn embeddings_requests_are_checked_then_answered_in_order() {
    let (mut p, _) = protocol();
    let mut host = MapHost::default();
    let mut embed = |texts: Vec<String>| {
        let (reply, mut rx) = oneshot::channel();
        p.handle(&mut host, Command::Embed { texts, reply });
        rx.try_recv().expect("answered at once")
    };
    let too_many = vec!["x".to_string(); MAX_EMBED_INPUTS + 1];
    for (bad, field, needle) in
        [(vec![], "input", "empty"), (vec!["a".into(), " ".into()], "input[1]", "empty"), (too_many, "input", "limit")]
    {
        let e = embed(bad).expect_err("refused");
        assert_eq!(param(&e), Ok(field));
        assert!(e.to_string().contains(needle), "{e} lacks {needle:?}");
    }
    let out = embed(vec!["ab".into(), "abc".into()]).expect("embedded");
    assert_eq!(out.vectors, [vec![2.0], vec![3.0]]);
    assert_eq!(out.tokens, 5);
}

#[test]
fn requests_are_checked_before_the_engine_sees_them() {
    let (mut p, metrics) = protocol();
    let mut host = MapHost::default();
    let mut wrong_window = job("ana", "Where?", Mode::Kv, 5);
    wrong_window.request.memory.window = Some(3);
    let mut no_tokens = job("ana", "Where?", Mode::Kv, 5);
    no_tokens.request.sampling.max_tokens = 0;
    let mut over = job("ana", "Where?", Mode::Blend, 5);
    over.request.memory.blend.ratio = 1.5;
    let mut nan = job("ana", "Where?", Mode::Blend, 5);
    nan.request.memory.blend.ratio = f32::NAN;
    for (bad, field, needle) in [
        (wrong_window, "window", "context window of 2 turns"),
        (no_tokens, "max_tokens", "at least 1"),
        (over, "memory.blend_ratio", "1.5 is outside 0..=1"),
        (nan, "memory.blend_ratio", "NaN is outside 0..=1"),
        (job("ana", "  ", Mode::Kv, 5), "messages[0].content", "question"),
        (job("", "Where?", Mode::Prompt, 5), "user", "is required when memory is used"),
        (job("ana", "Where?", Mode::Kv, 0), "memory.k", "0 is outside 1..=50"),
        (job("ana", "Where?", Mode::Kv, 51), "memory.k", "51 is outside 1..=50"),
    ] {
        let e = generate(&mut p, &mut host, bad).expect("refused");
        assert_eq!(param(&e), Ok(field));
        assert!(e.to_string().contains(needle), "{e} lacks {needle:?}");
    }
    assert!(host.generated.is_empty(), "the engine saw a refused request");
    assert_eq!(metrics.outcomes(), (0, 0, 8));
    // Without memory neither user nor k matters.
    assert!(generate(&mut p, &mut host, job("", "Hello?", Mode::None, 0)).is_none());
    assert_eq!(host.generated, ["Hello?"]);
    // Blend is for engines that can recompute inside their forward pass.
    assert!(generate(&mut p, &mut host, job("ana", "Blend?", Mode::Blend, 5)).is_none());
    host.no_blend = true;
    let e = generate(&mut p, &mut host, job("ana", "Blend?", Mode::Blend, 5)).expect("refused");
    assert_eq!(param(&e), Ok("memory.mode"));
    assert!(e.to_string().contains("needs the native engine"), "{e}");
    assert_eq!(host.generated, ["Hello?", "Blend?"]);
}

#[test]
fn ingests_go_in_batches_and_a_failure_stores_nothing_of_its_request() {
    let (mut p, _) = protocol();
    let mut host = MapHost::default();
    let mut rx = ingest(&mut p, &mut host, "ana", units(&["a", "b", "c", "d", "e"]));
    assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 2, "two of five stored");
    assert!(p.ingesting(), "more to go");
    assert_eq!(host.shard.fact_ids("ana"), ["a", "b"]);
    assert!(rx.try_recv().is_err(), "answered before it was stored");
    assert_eq!(p.ingest_some(&mut host, 1, false), 1, "a call stores at most what it is allowed");
    assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 2);
    assert!(!p.ingesting(), "the last batch ends it");
    assert_eq!(rx.try_recv().expect("answered").expect("stored").added, 5);
    assert_eq!(host.shard.ends, [true], "committed once, after its last batch");

    let mut bad = units(&["f", "g", "h"]);
    bad[2].text = "boom".into();
    let mut rx = ingest(&mut p, &mut host, "ana", bad);
    while p.ingest_some(&mut host, usize::MAX, false) > 0 {}
    let e = rx.try_recv().expect("answered").expect_err("failed");
    assert!(e.to_string().contains("injected failure"), "{e}");
    // The batch before the failing one was stored, then removed.
    assert_eq!(host.shard.ends, [true, false]);
    assert_eq!(host.shard.fact_ids("ana"), ["a", "b", "c", "d", "e"], "nothing of the failed request is left");
    // The host heard of each batch stored and of the removal (its queued
    // requests that retrieved the removed units fail as forgotten).
    let changes: Vec<Change> = host.changes.iter().map(|(u, c)| if u == "ana" { *c } else { panic!("{u}") }).collect();
    assert_eq!(changes, [Change::Written, Change::Written, Change::Written, Change::Written, Change::Removed]);
    // Refused whole: nothing of a request that fails validation is stored.
    let rx = ingest(&mut p, &mut host, "ana", units(&["x", "x"]));
    assert!(matches!(rx.blocking_recv(), Ok(Err(WorkerError::InvalidMemory { .. }))));
    assert!(!p.ingesting());
}

/// An ingest whose caller left (a deadline, a hang-up) stops, and what
/// it stored goes: before, it went on and was stored after its caller
/// had been told it failed (504).
#[test]
fn an_ingest_whose_caller_left_is_cancelled_and_removed() {
    let (mut p, _) = protocol();
    let mut host = MapHost::default();
    let rx = ingest(&mut p, &mut host, "ana", units(&["a", "b", "c", "d", "e"]));
    assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 2);
    assert_eq!(host.shard.fact_ids("ana"), ["a", "b"]);
    drop(rx);
    assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 0, "nothing left to do");
    assert_eq!(host.shard.ends, [false]);
    assert!(host.shard.fact_ids("ana").is_empty(), "what it stored is gone");
    // One that had not started yet is dropped without touching the memory.
    let rx = ingest(&mut p, &mut host, "bo", units(&["x"]));
    drop(rx);
    assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 0);
    assert_eq!(host.shard.ends, [false]);
    assert!(host.shard.fact_ids("bo").is_empty());
}

#[test]
fn a_request_is_refused_whole_when_one_unit_cannot_be_stored_or_it_is_too_large() {
    let (mut p, _) = protocol();
    let mut host = MapHost::default();
    let mut sent = units(&["a", "b", "c"]);
    sent[2].text = "huge".into();
    let rx = ingest(&mut p, &mut host, "ana", sent);
    assert!(
        matches!(rx.blocking_recv(), Ok(Err(WorkerError::InvalidMemory { reason, .. })) if reason.contains("\"c\" is too long"))
    );
    assert!(!p.ingesting() && host.shard.units.is_empty(), "nothing of it queued or stored");
    let rx = ingest(&mut p, &mut host, "ana", units(&["1", "2", "3", "4", "5", "6", "7"]));
    let e = rx.blocking_recv().expect("answered").expect_err("too many units");
    assert!(e.to_string().contains("7 units in one ingest request; the limit is 6"), "{e}");
    assert!(host.shard.units.is_empty());
}

#[test]
fn a_freeze_sees_every_queued_unit_then_writes_wait_until_release() {
    let (mut p, _) = protocol();
    let mut host = MapHost::default();
    let mut stored = ingest(&mut p, &mut host, "ana", units(&["a", "b", "c"]));
    let (reply, mut frozen) = oneshot::channel();
    p.handle(&mut host, Command::Shard(ShardCommand::Freeze { user: "ana".into(), reply }));
    assert!(frozen.try_recv().is_err(), "answered while an ingest of the user was queued");
    while p.ingest_some(&mut host, usize::MAX, false) > 0 {}
    assert!(stored.try_recv().is_ok_and(|r| r.is_ok()));
    assert_eq!(frozen.try_recv().expect("answered"), ["a", "b", "c"]);

    let late = ingest(&mut p, &mut host, "ana", units(&["d"]));
    assert!(matches!(late.blocking_recv(), Ok(Err(WorkerError::Moving(_)))));
    // Reads go on while frozen.
    assert!(generate(&mut p, &mut host, job("ana", "Where?", Mode::Kv, 5)).is_none());

    let (reply, released) = oneshot::channel();
    p.handle(&mut host, Command::Shard(ShardCommand::Release { user: "ana".into(), drop: true, reply }));
    assert!(released.blocking_recv().is_ok_and(|r| r.is_ok()));
    assert_eq!(host.shard.dropped, ["ana"]);
    assert_eq!(host.changes.last(), Some(&("ana".to_string(), Change::Moved)), "its unstarted requests fail as moving");
    // Moved away: its requests are refused (retryably) rather than answered without memory.
    let e = generate(&mut p, &mut host, job("ana", "Where?", Mode::Kv, 5)).expect("refused");
    assert!(matches!(e, WorkerError::Moving(_)), "{e}");
}

#[test]
fn forgetting_a_user_fails_its_queued_ingests() {
    let (mut p, _) = protocol();
    let mut host = MapHost::default();
    let first = ingest(&mut p, &mut host, "ana", units(&["a", "b", "c"]));
    assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 2);
    let (reply, forgot) = oneshot::channel();
    p.handle(&mut host, Command::Forget { user: "ana".into(), unit: None, reply });
    assert!(forgot.blocking_recv().is_ok_and(|r| r.is_ok()));
    // The rest of the ingest would bring the user back after the delete.
    assert!(matches!(first.blocking_recv(), Ok(Err(WorkerError::Forgotten(_)))));
    assert!(!p.ingesting());
    assert!(host.shard.units.is_empty());

    let (reply, stats) = oneshot::channel();
    p.handle(&mut host, Command::Stats { memory_bytes: false, reply });
    let s = stats.blocking_recv().expect("stats");
    assert_eq!((s.load.running, s.load.max_queue, s.window, s.users), (1, 8, 2, 0));
}
