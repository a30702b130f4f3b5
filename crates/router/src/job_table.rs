//! The router's table of ingest jobs (`jobs.rs` runs and answers them):
//! who owns each, how it ended, the finished ones kept for a while. In
//! memory only — a router that restarts forgets its jobs.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use serde_json::Value;

use crate::error::{ApiError, Result};

/// Jobs running at once, at most (429 past it).
pub const MAX_RUNNING: usize = 64;
/// Finished jobs kept for `GET`, the oldest dropped first.
pub const KEEP_FINISHED: usize = 1_000;

#[derive(Default)]
pub struct Jobs {
    inner: Mutex<Inner>,
    pub(crate) next: AtomicU64,
}

#[derive(Default)]
pub(crate) struct Inner {
    pub(crate) jobs: HashMap<String, Job>,
    /// Finished jobs, oldest first.
    finished: VecDeque<String>,
}

pub(crate) struct Job {
    pub(crate) tenant: String,
    /// The user as the client named it, and the request's unit ids.
    pub(crate) user: String,
    pub(crate) scoped_user: String,
    pub(crate) ids: Vec<String>,
    pub(crate) created: u64,
    pub(crate) started: Instant,
    pub(crate) state: JobState,
    pub(crate) abort: Option<tokio::task::AbortHandle>,
}

pub(crate) enum JobState {
    Running,
    Done { result: Value, seconds: f64 },
    Failed { status: u16, message: String, seconds: f64 },
    Cancelled { seconds: f64 },
}

impl Jobs {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn running(&self) -> usize {
        self.lock().jobs.values().filter(|j| matches!(j.state, JobState::Running)).count()
    }

    /// Records how job `id` ended, unless it was cancelled meanwhile.
    pub(crate) fn finish(&self, id: &str, outcome: Result<Value>) {
        let mut g = self.lock();
        let Some(job) = g.jobs.get_mut(id) else { return };
        if !matches!(job.state, JobState::Running) {
            return;
        }
        let seconds = job.started.elapsed().as_secs_f64();
        job.state = match outcome {
            Ok(result) => JobState::Done { result, seconds },
            Err(e) => JobState::Failed { status: e.status().as_u16(), message: e.to_string(), seconds },
        };
        job.abort = None;
        g.retire(id);
    }
}

impl Inner {
    /// `tenant`'s job `id`: another tenant's is as unknown as a missing one.
    pub(crate) fn job(&mut self, id: &str, tenant: &str) -> Result<&mut Job> {
        self.jobs.get_mut(id).filter(|j| j.tenant == tenant).ok_or_else(|| unknown(id))
    }

    /// Counts job `id` among the finished, dropping the oldest past
    /// [`KEEP_FINISHED`].
    pub(crate) fn retire(&mut self, id: &str) {
        self.finished.push_back(id.to_string());
        while self.finished.len() > KEEP_FINISHED {
            if let Some(old) = self.finished.pop_front() {
                self.jobs.remove(&old);
            }
        }
    }
}

pub(crate) fn unknown(id: &str) -> ApiError {
    ApiError::NotFound(format!(
        "no ingest job {id:?} (finished jobs are kept for the last {KEEP_FINISHED}; a restarted router has none)"
    ))
}
