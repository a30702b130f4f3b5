//! Ingest jobs: `POST /v1/memories` with `"async": true` answers 202 at
//! once with a job id, and the ingest runs in the router under the job
//! deadline (`Defaults::job_deadline`) instead of the request deadline.
//! `GET /v1/memories/jobs/{id}` says its status and how many of its units
//! are stored; `DELETE` cancels it: the router drops its calls, and each
//! worker, seeing its caller gone, removes what the request had stored (an
//! ingest is all or nothing, docs/serving.md). Jobs live in the router's
//! memory: a router that restarts forgets them and its calls end, so their
//! ingests are removed too; a client that gets 404 for a job it started
//! sends the request again (ids already stored are skipped).

use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use inferscale_proto as pb;
use serde_json::{Value, json};

use crate::error::{ApiError, Result};
use crate::ingest::Ingest;
use crate::job_table::{Job, JobState, MAX_RUNNING};
use crate::state::{Shared, tenant};
use crate::workers::request;

/// Starts `ingest` as a job of `tenant`: 202 with its id and where to ask.
pub(crate) fn start(s: &Shared, tenant: String, ingest: Ingest) -> Result<Response> {
    let (user, units) = (ingest.user.clone(), ingest.ids().len());
    let id = launch(s, tenant, ingest)?;
    let location = format!("/v1/memories/jobs/{id}");
    let mut r = (
        StatusCode::ACCEPTED,
        Json(json!({"job": id, "status": "running", "user": user, "units": units, "location": location})),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&location) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    Ok(r)
}

/// Starts `ingest` as a job of `tenant`; its id.
pub(crate) fn launch(s: &Shared, tenant: String, ingest: Ingest) -> Result<String> {
    if s.jobs.running() >= MAX_RUNNING {
        return Err(ApiError::Busy(format!(
            "{MAX_RUNNING} ingest jobs are running on this router: wait for one to finish"
        )));
    }
    let n = s.jobs.next.fetch_add(1, Ordering::Relaxed);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    // Unguessable enough that a job id is not a handle on another's job
    // (tenants are checked anyway).
    let salt = inferscale_cluster::ring::hash64(&[now.as_nanos().to_le_bytes(), u128::from(n).to_le_bytes()].concat());
    let id = format!("ij-{salt:016x}{n:x}");
    let job = Job {
        tenant: tenant.clone(),
        user: ingest.user.clone(),
        scoped_user: ingest.scoped_user.clone(),
        ids: ingest.ids(),
        created: now.as_secs(),
        started: Instant::now(),
        state: JobState::Running,
        abort: None,
    };
    s.jobs.lock().jobs.insert(id.clone(), job);
    let (state, job_id) = (s.clone(), id.clone());
    let task = tokio::spawn(async move {
        let deadline = state.defaults.job_deadline;
        let outcome = ingest.run(&state, &tenant, deadline).await;
        state.jobs.finish(&job_id, outcome);
    });
    if let Some(job) = s.jobs.lock().jobs.get_mut(&id) {
        job.abort = Some(task.abort_handle());
    }
    Ok(id)
}

/// `GET /v1/memories/jobs/{id}`: the job's status; while it runs, how many
/// of its units its user has (asked of the worker that answers the user's
/// reads).
pub(crate) async fn status(
    State(s): State<Shared>,
    headers: HeaderMap,
    id: std::result::Result<Path<String>, PathRejection>,
) -> Result<Json<Value>> {
    let id = job_id(id)?;
    let tenant = tenant(&s, &headers)?;
    let (mut out, running, user, ids) = {
        let mut g = s.jobs.lock();
        let job = g.job(&id, &tenant)?;
        let mut out = json!({"job": id, "user": job.user, "units": job.ids.len(), "created": job.created});
        let running = match &job.state {
            JobState::Running => {
                out["status"] = json!("running");
                out["seconds"] = json!(job.started.elapsed().as_secs_f64());
                true
            }
            JobState::Done { result, seconds } => {
                out["status"] = json!("done");
                out["result"] = result.clone();
                out["seconds"] = json!(seconds);
                false
            }
            JobState::Failed { status, message, seconds } => {
                out["status"] = json!("failed");
                out["error"] = json!({"status": status, "message": message});
                out["seconds"] = json!(seconds);
                false
            }
            JobState::Cancelled { seconds } => {
                out["status"] = json!("cancelled");
                out["seconds"] = json!(seconds);
                false
            }
        };
        (out, running, job.scoped_user.clone(), job.ids.clone())
    };
    if running {
        // Progress: the request's units the user has now (units are
        // listed as their batches are stored). Unknown when the worker
        // cannot say.
        out["stored"] = match s.workers.reader(&user) {
            Ok(w) => {
                // The user's units, of which the request's are counted (a
                // list by id fails while any is missing).
                let req = pb::ListMemoriesRequest { user, ids: Vec::new() };
                match w.worker().client().list_memories(request(req, s.defaults.deadline)).await {
                    Ok(r) => {
                        let mine: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
                        json!(r.into_inner().units.iter().filter(|u| mine.contains(u.id.as_str())).count())
                    }
                    // The job's first batch made the user, and is not stored yet.
                    Err(e) if e.code() == tonic::Code::NotFound => json!(0),
                    Err(_) => Value::Null,
                }
            }
            Err(_) => Value::Null,
        };
    }
    Ok(Json(out))
}

/// `DELETE /v1/memories/jobs/{id}`: cancels a running job; what it stored
/// is removed by the workers. A finished job is a 409 (a done one's units
/// are forgotten with `DELETE /v1/memories/{user}/{id}`).
pub(crate) async fn cancel(
    State(s): State<Shared>,
    headers: HeaderMap,
    id: std::result::Result<Path<String>, PathRejection>,
) -> Result<Json<Value>> {
    let id = job_id(id)?;
    let tenant = tenant(&s, &headers)?;
    let mut g = s.jobs.lock();
    let job = g.job(&id, &tenant)?;
    if !matches!(job.state, JobState::Running) {
        return Err(ApiError::Conflict(format!("ingest job {id} has already ended")));
    }
    if let Some(a) = job.abort.take() {
        a.abort();
    }
    let seconds = job.started.elapsed().as_secs_f64();
    job.state = JobState::Cancelled { seconds };
    let user = job.user.clone();
    g.retire(&id);
    Ok(Json(json!({"job": id, "user": user, "status": "cancelled"})))
}

fn job_id(p: std::result::Result<Path<String>, PathRejection>) -> Result<String> {
    p.map(|Path(t)| t).map_err(|e| ApiError::BadRequest(format!("invalid path: {}", e.body_text())))
}
