//! The memory API under `/v1/memories` (docs/serving.md, "Memory API"):
//! ingest (turns, facts, or Mem0-style chat messages), list, get one,
//! search with scores and metadata filters, forget one unit or a user.
//! Writes go to every writer of the user (`dispatch::write_all`); reads to the
//! worker that answers the user's reads.

use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, RawQuery, State};
use axum::http::HeaderMap;
use inferscale_proto as pb;
use inferscale_types::{MemoryUnit, Scope};
use serde::Deserialize;
use serde_json::json;

use crate::auth::scoped;
use crate::dispatch::{RETRY_FOR, RETRY_PAUSE, WorkerClient, write_all};
use crate::error::{ApiError, Result};
use crate::ingest::{Ingest, units_from_messages};
use crate::openai::IngestBody;
use crate::state::{AppState, Shared, body, tenant};
use crate::workers::{InFlight, request};
use inferscale_types::check_user;

/// A read of one user's memory: the key's tenant (to take its namespace out
/// of error messages), the scoped user id, and a client of the worker that
/// answers the user's reads, counted in flight while the read lasts.
struct Read {
    tenant: String,
    user: String,
    client: WorkerClient,
    _in_flight: InFlight,
}

impl Read {
    fn new(s: &AppState, tenant: String, user: &str) -> Result<Read> {
        check_user(user)?;
        let scoped_user = scoped(&tenant, user);
        let w = s.workers.reader(&scoped_user)?;
        Ok(Read { client: w.worker().client(), tenant, user: scoped_user, _in_flight: w })
    }

    /// A worker's refusal as the client should see it.
    fn error(&self, e: tonic::Status) -> ApiError {
        ApiError::from(e).unscope(&self.tenant)
    }
}

/// One user's units as the worker that answers their reads holds them
/// (`ids` empty: all, in stored order), and the window they were encoded
/// with.
pub(crate) async fn units(
    s: &AppState,
    tenant: String,
    user: &str,
    ids: Vec<String>,
) -> Result<(Vec<pb::MemoryUnit>, u32)> {
    let mut read = Read::new(s, tenant, user)?;
    let req = pb::ListMemoriesRequest { user: read.user.clone(), ids };
    let r = read.client.list_memories(request(req, s.defaults.deadline)).await.map_err(|e| read.error(e))?;
    let r = r.into_inner();
    Ok((r.units, r.window))
}

/// One user's units ranked for `req.query` (the worker's search: scope and
/// metadata filters in `req`, whose `user` is set here).
pub(crate) async fn search_units(
    s: &AppState,
    tenant: String,
    user: &str,
    mut req: pb::SearchMemoriesRequest,
) -> Result<Vec<pb::SearchHit>> {
    let mut read = Read::new(s, tenant, user)?;
    req.user = read.user.clone();
    let hits = read.client.search_memories(request(req, s.defaults.deadline)).await.map_err(|e| read.error(e))?;
    Ok(hits.into_inner().hits)
}

/// One unit's adds and updates, oldest first.
pub(crate) async fn unit_history(s: &AppState, tenant: String, user: &str, id: &str) -> Result<Vec<pb::HistoryEvent>> {
    let mut read = Read::new(s, tenant, user)?;
    let req = pb::UnitHistoryRequest { user: read.user.clone(), id: id.to_string() };
    let events = read.client.unit_history(request(req, s.defaults.deadline)).await.map_err(|e| read.error(e))?;
    Ok(events.into_inner().events)
}

/// `POST /v1/memories`: turns, facts and (Mem0-style) chat messages;
/// acknowledged once every writer of the user has stored them (all or
/// nothing), or with `"async": true` accepted as a job (`jobs.rs`).
pub(crate) async fn ingest(
    State(s): State<Shared>,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<axum::response::Response> {
    use axum::response::IntoResponse;
    let tenant = tenant(&s, &headers)?;
    let r: IngestBody = crate::validate::parse(&body(b, s.defaults.body_limit)?)?;
    if r.infer == Some(true) {
        return Err(ApiError::param(
            "infer",
            "this server stores units as they are and does not extract facts with a model: send \"infer\": false, \
             or send extracted facts in `facts` with their `source_turn`",
        ));
    }
    check_user(&r.user)?;
    let from_messages = units_from_messages(&r.messages, 0)?;
    if r.turns.is_empty() && r.facts.is_empty() && from_messages.is_empty() {
        return Err(ApiError::BadRequest(
            "nothing to ingest: `turns`, `facts` and `messages` (user and assistant ones) are empty".into(),
        ));
    }
    if let Some((i, _)) = r.facts.iter().enumerate().find(|(_, f)| f.source_turn.is_empty()) {
        return Err(ApiError::BadRequest(format!("facts[{i}] has no `source_turn`")));
    }
    let ids: Vec<String> = from_messages.iter().map(|u| u.id.clone()).collect();
    let mut units: Vec<MemoryUnit> = r.turns.into_iter().chain(from_messages).chain(r.facts).collect();
    // The request's metadata, agent and run go on every unit that has none
    // of its own.
    for u in &mut units {
        if u.metadata.is_empty() {
            u.metadata.clone_from(&r.metadata);
        }
        if u.agent_id.is_empty() {
            u.agent_id = r.agent_id.clone().unwrap_or_default();
        }
        if u.run_id.is_empty() {
            u.run_id = r.run_id.clone().unwrap_or_default();
        }
    }
    let ingest = Ingest::new(&tenant, r.user, r.window, units, ids);
    if r.run_async {
        return crate::jobs::start(&s, tenant, ingest);
    }
    Ok(Json(ingest.run(&s, &tenant, s.defaults.deadline).await?).into_response())
}

/// A path's parameters, or the JSON 400 every other bad input gets (axum's
/// own rejection is plain text).
fn path<T>(p: std::result::Result<Path<T>, PathRejection>) -> Result<T> {
    p.map(|Path(t)| t).map_err(|e| ApiError::BadRequest(format!("invalid path: {}", e.body_text())))
}

/// Units of a list page when the request does not say.
pub const LIST_LIMIT: usize = 100;

/// `GET /v1/memories/{user}?limit=N&cursor=ID`: the user's units in stored
/// order, a page at a time: `limit` (1–1,000, default 100) units after the
/// unit `cursor` names; `next_cursor` is set when more follow.
pub(crate) async fn list(
    State(s): State<Shared>,
    headers: HeaderMap,
    user: std::result::Result<Path<String>, PathRejection>,
    query: RawQuery,
) -> Result<Json<serde_json::Value>> {
    let user = path(user)?;
    let (limit, cursor, scope) = page(query.0.as_deref())?;
    let (units, window) = units(&s, tenant(&s, &headers)?, &user, Vec::new()).await?;
    let all = units
        .into_iter()
        .map(|u| {
            let (created_at, updated_at) = stamps(&u);
            let unit = MemoryUnit::try_from(u).map_err(ApiError::Internal)?;
            Ok((unit, created_at, updated_at))
        })
        .collect::<Result<Vec<_>>>()?;
    let all: Vec<_> = all.into_iter().filter(|(u, ..)| scope.contains(u)).collect();
    let total = all.len();
    let start = match &cursor {
        None => 0,
        Some(c) => all.iter().position(|(u, ..)| &u.id == c).map(|i| i + 1).ok_or_else(|| {
            ApiError::param("cursor", format!("{c:?} is not a unit of this user (deleted since the last page?)"))
        })?,
    };
    let end = (start + limit).min(total);
    let page = &all[start..end];
    let next = (end < total).then(|| page.last().map(|(u, ..)| u.id.clone())).flatten();
    // Each unit as stored, with when it was stored and last changed.
    let units: Vec<serde_json::Value> = page
        .iter()
        .map(|(u, created_at, updated_at)| {
            let mut v = json!(u);
            v["created_at"] = created_at.clone();
            v["updated_at"] = updated_at.clone();
            v
        })
        .collect();
    Ok(Json(json!({"user": user, "window": window, "total": total, "count": units.len(), "units": units,
                   "next_cursor": next})))
}

/// `limit`, `cursor` and the scope (`agent_id`, `run_id`) of a list's
/// query string.
fn page(query: Option<&str>) -> Result<(usize, Option<String>, Scope)> {
    let (mut limit, mut cursor, mut scope) = (LIST_LIMIT, None, Scope::default());
    for (key, value) in query_pairs(query)? {
        match key.as_str() {
            "limit" => {
                limit = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| ApiError::param("limit", format!("{value:?} is not a number in 1..=1000")))?
            }
            "cursor" if !value.is_empty() => cursor = Some(value),
            "agent_id" if !value.is_empty() => scope.agent_id = Some(value),
            "run_id" if !value.is_empty() => scope.run_id = Some(value),
            "cursor" | "agent_id" | "run_id" => {}
            other => return Err(ApiError::Unsupported(other.to_string())),
        }
    }
    Ok((limit, cursor, scope))
}

/// A query string's `key=value` pairs, values decoded.
pub(crate) fn query_pairs(query: Option<&str>) -> Result<Vec<(String, String)>> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_decode(value).ok_or_else(|| {
                ApiError::BadRequest(format!("query parameter `{key}` is not valid percent-encoded UTF-8"))
            })?;
            Ok((key.to_string(), value))
        })
        .collect()
}

/// `%XX` escapes and `+` (a space) decoded; `None` for a bad escape or
/// bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Forgets one unit of `user` (`unit` empty: all of them) on every writer
/// of the user.
pub(crate) async fn forget(s: &AppState, tenant: &str, user: &str, unit: &str) -> Result<()> {
    check_user(user)?;
    let scoped_user = scoped(tenant, user);
    // A delete waits for a move to settle: sent to both ends of a copy in
    // flight, it could be undone by the copy.
    let until = Instant::now() + RETRY_FOR;
    while s.workers.moving(&scoped_user) {
        if Instant::now() > until {
            return Err(ApiError::Unavailable("this user's memory is being moved between workers; retry".into()));
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
    let req = pb::ForgetRequest { user: scoped_user.clone(), unit_id: unit.to_string() };
    let deadline = s.defaults.deadline;
    // A replica may not have (all of) the user yet; its "not found" is fine.
    let tolerate = |e: &tonic::Status| e.code() == tonic::Code::NotFound;
    write_all(s, &scoped_user, tolerate, |mut c, _| {
        let req = request(req.clone(), deadline);
        async move { c.forget(req).await }
    })
    .await
    .map_err(|e| e.unscope(tenant))?;
    Ok(())
}

pub(crate) async fn forget_user(
    State(s): State<Shared>,
    headers: HeaderMap,
    user: std::result::Result<Path<String>, PathRejection>,
) -> Result<Json<serde_json::Value>> {
    let user = path(user)?;
    forget(&s, &tenant(&s, &headers)?, &user, "").await?;
    Ok(Json(json!({"user": user, "deleted": true})))
}

pub(crate) async fn forget_unit(
    State(s): State<Shared>,
    headers: HeaderMap,
    p: std::result::Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<serde_json::Value>> {
    let (user, unit) = path(p)?;
    if unit.is_empty() {
        return Err(ApiError::BadRequest("empty unit id".into()));
    }
    forget(&s, &tenant(&s, &headers)?, &user, &unit).await?;
    Ok(Json(json!({"user": user, "id": unit, "deleted": true})))
}

/// `GET /v1/memories/{user}/{id}`: one unit.
pub(crate) async fn get(
    State(s): State<Shared>,
    headers: HeaderMap,
    p: std::result::Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<serde_json::Value>> {
    let (user, id) = path(p)?;
    let (units, _) = units(&s, tenant(&s, &headers)?, &user, vec![id]).await?;
    let unit = units.into_iter().next().ok_or_else(|| ApiError::Internal("the worker sent no unit".into()))?;
    Ok(Json(unit_json(&user, unit, None)?))
}

/// `POST /v1/memories/search`.
#[derive(Debug, Deserialize)]
pub(crate) struct SearchBody {
    #[serde(alias = "user_id")]
    user: String,
    query: String,
    #[serde(alias = "limit")]
    top_k: Option<u32>,
    threshold: Option<f32>,
    #[serde(default)]
    filters: serde_json::Map<String, serde_json::Value>,
    agent_id: Option<String>,
    run_id: Option<String>,
}

/// Results of a search when the request does not say.
pub const SEARCH_TOP_K: u32 = 10;

/// `POST /v1/memories/search`: the user's units ranked for `query`, with
/// scores (cosine similarity), at least `threshold`, matching `filters`.
pub(crate) async fn search(
    State(s): State<Shared>,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>> {
    let tenant = tenant(&s, &headers)?;
    let r: SearchBody = crate::validate::parse(&body(b, s.defaults.body_limit)?)?;
    let filters = match r.filters.is_empty() {
        true => String::new(),
        false => serde_json::Value::Object(r.filters).to_string(),
    };
    let req = pb::SearchMemoriesRequest {
        user: String::new(),
        query: r.query,
        top_k: r.top_k.unwrap_or(SEARCH_TOP_K),
        threshold: r.threshold,
        filters,
        agent_id: r.agent_id.unwrap_or_default(),
        run_id: r.run_id.unwrap_or_default(),
    };
    let hits = search_units(&s, tenant, &r.user, req).await?;
    let results = hits
        .into_iter()
        .map(|h| {
            let unit = h.unit.ok_or_else(|| ApiError::Internal("a search hit without its unit".into()))?;
            unit_json(&r.user, unit, Some(h.score))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Json(json!({"results": results})))
}

/// `PUT /v1/memories/{user}/{id}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UpdateBody {
    #[serde(alias = "memory", alias = "data")]
    text: Option<String>,
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

/// `PUT /v1/memories/{user}/{id}`: a new text (its KV re-encoded in the
/// unit's place) and/or new metadata, on every writer of the user.
pub(crate) async fn update(
    State(s): State<Shared>,
    headers: HeaderMap,
    p: std::result::Result<Path<(String, String)>, PathRejection>,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>> {
    let (user, id) = path(p)?;
    let tenant = tenant(&s, &headers)?;
    check_user(&user)?;
    let r: UpdateBody = crate::validate::parse(&body(b, s.defaults.body_limit)?)?;
    let resp = update_unit(&s, &tenant, &user, &id, r.text, r.metadata).await?;
    Ok(Json(json!({"id": id, "user": user, "updated": resp.changed, "encoded_tokens": resp.encoded_tokens})))
}

/// Changes one unit of `user`: a new text (its KV re-encoded in the unit's
/// place) and/or new metadata, on every writer of the user.
pub(crate) async fn update_unit(
    s: &AppState,
    tenant: &str,
    user: &str,
    id: &str,
    text: Option<String>,
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
) -> Result<pb::UpdateMemoryResponse> {
    if text.is_none() && metadata.is_none() {
        return Err(ApiError::BadRequest("nothing to update: send `text` and/or `metadata`".into()));
    }
    let scoped_user = scoped(tenant, user);
    let req = pb::UpdateMemoryRequest {
        user: scoped_user.clone(),
        id: id.to_string(),
        text,
        metadata: metadata.map(|m| serde_json::Value::Object(m).to_string()),
        defer_kv: false,
    };
    let deadline = s.defaults.deadline;
    // A replica that does not have the unit yet takes it with the update's
    // ingest's retry, or from the home on a move; its "not found" is fine.
    let tolerate = |e: &tonic::Status| e.code() == tonic::Code::NotFound;
    write_all(s, &scoped_user, tolerate, |mut c, home| {
        let req = request(pb::UpdateMemoryRequest { defer_kv: !home, ..req.clone() }, deadline);
        async move { c.update_memory(req).await }
    })
    .await
    .map_err(|e| e.unscope(tenant))
}

/// `GET /v1/memories/{user}/{id}/history`: the unit's adds and updates,
/// oldest first (Mem0's history; a deleted unit's history is deleted with
/// it).
pub(crate) async fn history(
    State(s): State<Shared>,
    headers: HeaderMap,
    p: std::result::Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<serde_json::Value>> {
    let (user, id) = path(p)?;
    let events = unit_history(&s, tenant(&s, &headers)?, &user, &id).await?;
    let meta = |m: &str| serde_json::from_str::<serde_json::Value>(m).unwrap_or(serde_json::Value::Null);
    let history: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            json!({"event": e.event, "created_at": inferscale_types::time::rfc3339(e.at_ms), "at_ms": e.at_ms,
                   "old_memory": e.old_text, "new_memory": e.new_text,
                   "old_metadata": e.old_metadata.as_deref().map(meta), "new_metadata": meta(&e.new_metadata)})
        })
        .collect();
    Ok(Json(json!({"id": id, "user": user, "history": history})))
}

/// When a unit read from a worker was stored and last changed, as RFC 3339
/// (`null` when the store kept no history for it).
pub(crate) fn stamps(u: &pb::MemoryUnit) -> (serde_json::Value, serde_json::Value) {
    let at = |ms: u64| if ms == 0 { serde_json::Value::Null } else { json!(inferscale_types::time::rfc3339(ms)) };
    (at(u.created_ms), at(u.updated_ms))
}

/// A unit as the memory API shows it: its fields, with Mem0's names
/// (`memory` for the text, `user_id`) beside ours, and when it was stored
/// and last changed.
fn unit_json(user: &str, unit: pb::MemoryUnit, score: Option<f32>) -> Result<serde_json::Value> {
    let (created_at, updated_at) = stamps(&unit);
    let u = MemoryUnit::try_from(unit).map_err(ApiError::Internal)?;
    let mut v = json!({"id": u.id, "memory": u.text, "text": u.text, "speaker": u.speaker, "time": u.time,
                       "metadata": u.metadata, "user_id": user, "created_at": created_at,
                       "updated_at": updated_at});
    for (k, s) in [("agent_id", &u.agent_id), ("run_id", &u.run_id)] {
        if !s.is_empty() {
            v[k] = json!(s);
        }
    }
    if !u.source_turn.is_empty() {
        v["source_turn"] = json!(u.source_turn);
    }
    if let Some(score) = score {
        v["score"] = json!(score);
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_pages_parse_limit_and_cursor() {
        let all = Scope::default();
        assert_eq!(page(None).ok(), Some((LIST_LIMIT, None, all.clone())));
        assert_eq!(page(Some("limit=5&cursor=D1%3A3")).ok(), Some((5, Some("D1:3".into()), all.clone())));
        assert_eq!(page(Some("cursor=a+b")).ok(), Some((LIST_LIMIT, Some("a b".into()), all)));
        let agent = Scope { agent_id: Some("coach".into()), run_id: None };
        assert_eq!(page(Some("agent_id=coach")).ok(), Some((LIST_LIMIT, None, agent)));
        for bad in ["limit=0", "limit=1001", "limit=x", "cursor=%zz", "cursor=%ff", "page=2"] {
            assert!(page(Some(bad)).is_err(), "{bad}");
        }
    }
}
