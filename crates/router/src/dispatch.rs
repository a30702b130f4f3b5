//! Dispatch: which worker a request goes to and what happens when it
//! fails — a generation retried before its first token (on another worker
//! without memory, on the user's current reader with it), a write sent to
//! every writer of the user and retried while the user moves or fails
//! over. Calls to a worker that hangs are abandoned once it is fenced.

use std::sync::Arc;
use std::time::{Duration, Instant};

use inferscale_proto as pb;
use tracing::{Instrument, info_span};

use crate::error::{ApiError, Result};
use crate::state::AppState;
use crate::workers::{InFlight, request};

/// How long a request keeps retrying a user's memory while it moves
/// between workers or its home fails over to its replica.
pub(crate) const RETRY_FOR: Duration = Duration::from_secs(15);
pub(crate) const RETRY_PAUSE: Duration = Duration::from_millis(150);

/// Whether a failed call means the worker itself is unreachable (rather
/// than a refusal it answered with): its health is then re-probed before
/// it gets more requests.
fn unreachable(e: &tonic::Status) -> bool {
    // A marked refusal (moving, damaged) comes from a worker that is up.
    (e.code() == tonic::Code::Unavailable && pb::ErrorKind::of(e).is_none()) || crate::error::connection_lost(e)
}

/// Awaits `fut`, unless the cluster view changes first so that `gone`
/// holds (then `None`): a call to a worker that hangs rather than fails is
/// abandoned once the leader fences that worker.
async fn unless_view<T>(
    changes: &mut tokio::sync::watch::Receiver<Arc<inferscale_cluster::ClusterView>>,
    gone: impl Fn(&inferscale_cluster::ClusterView) -> bool,
    fut: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            r = &mut fut => return Some(r),
            Ok(()) = changes.changed() => {
                if gone(&changes.borrow_and_update()) {
                    return None;
                }
            }
        }
    }
}

/// Sends `req` to a worker and waits for its first event (`spread` — the
/// client's user id, if any — spreads requests without memory). Nothing has been
/// streamed to the client yet, so a retryable failure is retried: a
/// request without memory once, on another worker; a request with memory
/// for up to [`RETRY_FOR`], on whichever worker answers the user's reads
/// by then (its new home after a move, its replica after a crash). A
/// worker that leaves the view before its first event (fenced: it hangs)
/// counts as a failure to connect.
pub(crate) async fn start(
    s: &AppState,
    req: &pb::GenerateRequest,
    spread: &str,
) -> Result<(InFlight, tonic::Streaming<pb::GenerateEvent>, Option<pb::GenerateEvent>)> {
    let memory = req.mode != pb::MemoryMode::None as i32;
    let until = Instant::now() + RETRY_FOR;
    let (mut tried, mut damaged, mut refused) = (Vec::new(), Vec::new(), None);
    let mut changes = s.workers.subscribe();
    loop {
        changes.mark_unchanged();
        let picked = match memory {
            false => s.workers.any(spread, &tried),
            // Workers where the user's memory is damaged are skipped: a
            // replica may hold it whole.
            true => s.workers.reader_skipping(&req.user, &damaged),
        };
        let w = match picked {
            Ok(w) => w,
            // Waiting helps only while the memory moves (it lands soon): a
            // user whose workers are known down is told at once (503,
            // Retry-After), not after the retry window.
            Err(e) if memory && e.retryable() && Instant::now() < until && s.workers.moving(&req.user) => {
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
            // No other worker holds it whole: the damaged one's answer says why.
            Err(e) => return Err(refused.take().unwrap_or(e)),
        };
        let span = info_span!("route", worker = %w.worker().name, attempt = tried.len() as i64 + 1, memory);
        let name = w.worker().name.clone();
        let attempt = async {
            let mut stream =
                w.worker().client().generate(request(req.clone(), s.defaults.deadline)).await?.into_inner();
            let first = stream.message().await?;
            Ok::<_, tonic::Status>((stream, first))
        };
        let left = |v: &inferscale_cluster::ClusterView| !v.alive(&name);
        let attempt = unless_view(&mut changes, left, attempt.instrument(span)).await;
        let attempt = attempt.unwrap_or_else(|| Err(tonic::Status::unavailable(format!("worker {name} was fenced"))));
        match attempt {
            Ok((stream, first)) => return Ok((w, stream, first)),
            Err(status) => {
                if unreachable(&status) {
                    w.worker().mark_down();
                }
                let is_damaged = pb::ErrorKind::of(&status) == Some(pb::ErrorKind::Damaged);
                let e = ApiError::from(status);
                if is_damaged {
                    damaged.push(w.worker().name.clone());
                    refused = Some(ApiError::Unavailable(e.to_string()));
                    continue;
                }
                let again = match memory {
                    false => tried.is_empty(),
                    true => Instant::now() < until,
                };
                if !(e.retryable() && again) {
                    return Err(e);
                }
                tried.push(w.worker().name.clone());
                if memory {
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }
}

/// Runs `call` on every writer of `user` at once (told whether it is the
/// home) and succeeds when all do, returning the home's answer. A retryable failure (a writer frozen by a
/// move, or unreachable until the view drops it) is retried for up to
/// [`RETRY_FOR`] against the writers of the view by then; the calls are
/// idempotent (ingest skips units it has), so a retry stores nothing twice.
/// When the view changes the user's writers mid-call (a hung writer was
/// fenced), the calls are abandoned and sent to the new writers: a write
/// is acknowledged by the writers of the view it completes in.
/// `tolerate` lets a non-home writer's error count as success (a replica
/// that does not have what is being deleted).
pub(crate) async fn write_all<T, F, Fut>(
    s: &AppState,
    user: &str,
    tolerate: fn(&tonic::Status) -> bool,
    call: F,
) -> Result<T>
where
    F: Fn(WorkerClient, bool) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
{
    let until = Instant::now() + RETRY_FOR;
    let mut changes = s.workers.subscribe();
    loop {
        changes.mark_unchanged();
        let writers = s.workers.writers(user)?;
        let names: Vec<&str> = writers.iter().map(|w| w.name.as_str()).collect();
        let calls = writers.iter().enumerate().map(|(i, w)| call(w.client(), i == 0));
        let moved = |v: &inferscale_cluster::ClusterView| v.writers(user, s.workers.replicates()) != names;
        let results = unless_view(&mut changes, moved, futures_util::future::join_all(calls)).await;
        let Some(results) = results else {
            if Instant::now() < until {
                continue;
            }
            return Err(ApiError::Unavailable("this user's writers kept changing; retry".into()));
        };
        let mut home = None;
        let mut failed = None;
        for (i, (r, w)) in results.into_iter().zip(&writers).enumerate() {
            match r {
                Ok(resp) if i == 0 => home = Some(resp.into_inner()),
                Ok(_) => {}
                Err(e) if i > 0 && tolerate(&e) => {}
                Err(e) => {
                    if unreachable(&e) {
                        w.mark_down();
                    }
                    failed.get_or_insert(e);
                }
            }
        }
        // Every writer known down and nothing moving: no retry can land
        // before one comes back, so the caller hears it now.
        let all_down = writers.iter().all(|w| !w.is_healthy() && w.unreachable_for().is_some());
        match (failed, home) {
            (None, Some(answer)) => return Ok(answer),
            (Some(e), _) if all_down && !s.workers.moving(user) => return Err(e.into()),
            (Some(e), _) if ApiError::from(e.clone()).retryable() && Instant::now() < until => {
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            (Some(e), _) => return Err(e.into()),
            (None, None) => return Err(ApiError::Internal("no answer from the user's home worker".into())),
        }
    }
}

pub(crate) type WorkerClient = inferscale_proto::worker_client::WorkerClient<tonic::transport::Channel>;

#[cfg(test)]
mod tests;
