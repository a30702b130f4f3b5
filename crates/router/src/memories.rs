//! The memory API under `/v1/memories` (docs/serving.md, "Memory API"):
//! ingest (turns, facts, or Mem0-style chat messages), list, get one,
//! search with scores and metadata filters, forget one unit or a user.
//! Writes go to every writer of the user (`api::write_all`); reads to the
//! worker that answers the user's reads.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
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

use crate::api::{AppState, RETRY_FOR, RETRY_PAUSE, Shared, WorkerClient, body, tenant, write_all};
use crate::auth::scoped;
use crate::error::{ApiError, Result};
use crate::openai::{self, IngestBody};
use crate::workers::{InFlight, request};

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
        openai::check_user(user)?;
        let scoped_user = scoped(&tenant, user);
        let w = s.workers.reader(&scoped_user)?;
        Ok(Read { client: w.worker().client(), tenant, user: scoped_user, _in_flight: w })
    }

    /// A worker's refusal as the client should see it.
    fn error(&self, e: tonic::Status) -> ApiError {
        ApiError::from(e).unscope(&self.tenant)
    }
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
    let r: IngestBody = openai::parse(&body(b, s.defaults.body_limit)?)?;
    openai::check_user(&r.user)?;
    let from_messages = units_from_messages(&r.messages)?;
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
    let units: Vec<pb::MemoryUnit> = units.into_iter().map(pb::MemoryUnit::from).collect();
    let scoped_user = scoped(&tenant, &r.user);
    let req = pb::IngestRequest { user: scoped_user.clone(), window: r.window, units, defer_kv: false };
    let ingest = Ingest { user: r.user, scoped_user, req, message_ids: ids };
    if r.run_async {
        return crate::jobs::start(&s, tenant, ingest);
    }
    Ok(Json(ingest.run(&s, &tenant, s.defaults.deadline).await?).into_response())
}

/// An ingest request, checked and ready to send.
pub(crate) struct Ingest {
    /// The user as the client named it, and as the workers know it.
    pub(crate) user: String,
    pub(crate) scoped_user: String,
    req: pb::IngestRequest,
    /// The ids given to units made from chat messages.
    message_ids: Vec<String>,
}

impl Ingest {
    /// Every unit id of the request.
    pub(crate) fn ids(&self) -> Vec<String> {
        self.req.units.iter().map(|u| u.id.clone()).collect()
    }

    /// Sends it to every writer of the user, each call bounded by
    /// `deadline`; the answer's body.
    pub(crate) async fn run(
        &self,
        s: &AppState,
        tenant: &str,
        deadline: std::time::Duration,
    ) -> Result<serde_json::Value> {
        // Copies other than the home's store facts only; their KV is encoded
        // if they ever serve.
        let resp = write_all(
            s,
            &self.scoped_user,
            |_| false,
            |mut c, home| {
                let req = request(pb::IngestRequest { defer_kv: !home, ..self.req.clone() }, deadline);
                async move { c.ingest(req).await }
            },
        )
        .await
        .map_err(|e| e.unscope(tenant))?;
        s.metrics.ingested_units.fetch_add(u64::from(resp.added), Ordering::Relaxed);
        let mut out = json!({"user": self.user, "added": resp.added, "skipped": resp.skipped,
                             "encoded_tokens": resp.encoded_tokens});
        if !self.message_ids.is_empty() {
            out["ids"] = json!(self.message_ids);
        }
        Ok(out)
    }
}

/// Memory units from an OpenAI message list (Mem0's `add(messages)`): each
/// user or assistant message is a turn, its speaker the message's `name`
/// or its role; system and developer messages are instructions, not
/// memories, and are skipped. A message's id is derived from its role,
/// name, text and how many identical messages precede it in the list, so
/// re-sending a list stores nothing twice.
fn units_from_messages(messages: &[openai::Message]) -> Result<Vec<MemoryUnit>> {
    let mut seen: HashMap<u64, u32> = HashMap::new();
    let mut units = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let speaker = match m.role.as_str() {
            "system" | "developer" => continue,
            "user" => "User",
            "assistant" => "Assistant",
            other => return Err(ApiError::BadRequest(format!("messages[{i}].role {other:?} is not supported"))),
        };
        let speaker = m.name.clone().unwrap_or_else(|| speaker.to_string());
        let text = m.content.text()?;
        let key = [m.role.as_bytes(), b"\0", speaker.as_bytes(), b"\0", text.as_bytes()].concat();
        let base = inferscale_cluster::ring::hash64(&key);
        let n = seen.entry(base).or_default();
        let occurrence = [base.to_le_bytes(), u64::from(*n).to_le_bytes()].concat();
        let id = format!("msg-{:016x}", inferscale_cluster::ring::hash64(&occurrence));
        *n += 1;
        units.push(MemoryUnit { id, speaker, text, ..Default::default() });
    }
    Ok(units)
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
    let mut read = Read::new(&s, tenant(&s, &headers)?, &user)?;
    let (limit, cursor, scope) = page(query.0.as_deref())?;
    let req = pb::ListMemoriesRequest { user: read.user.clone(), ids: Vec::new() };
    let r = read.client.list_memories(request(req, s.defaults.deadline)).await.map_err(|e| read.error(e))?.into_inner();
    let all = r
        .units
        .into_iter()
        .map(MemoryUnit::try_from)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(ApiError::Internal)?;
    let all: Vec<MemoryUnit> = all.into_iter().filter(|u| scope.contains(u)).collect();
    let total = all.len();
    let start = match &cursor {
        None => 0,
        Some(c) => all.iter().position(|u| &u.id == c).map(|i| i + 1).ok_or_else(|| ApiError::Param {
            param: "cursor",
            message: format!("{c:?} is not a unit of this user (deleted since the last page?)"),
        })?,
    };
    let end = (start + limit).min(total);
    let units = &all[start..end];
    let next = (end < total).then(|| units.last().map(|u| u.id.clone())).flatten();
    Ok(Json(json!({"user": user, "window": r.window, "total": total, "count": units.len(), "units": units,
                   "next_cursor": next})))
}

/// `limit`, `cursor` and the scope (`agent_id`, `run_id`) of a list's
/// query string.
fn page(query: Option<&str>) -> Result<(usize, Option<String>, Scope)> {
    let (mut limit, mut cursor, mut scope) = (LIST_LIMIT, None, Scope::default());
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value).ok_or_else(|| {
            ApiError::BadRequest(format!("query parameter `{key}` is not valid percent-encoded UTF-8"))
        })?;
        match key {
            "limit" => {
                limit = value.parse().ok().filter(|n| (1..=1000).contains(n)).ok_or_else(|| ApiError::Param {
                    param: "limit",
                    message: format!("{value:?} is not a number in 1..=1000"),
                })?
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

async fn forget(s: &AppState, headers: &HeaderMap, user: &str, unit: String) -> Result<Json<serde_json::Value>> {
    let tenant = tenant(s, headers)?;
    openai::check_user(user)?;
    let scoped_user = scoped(&tenant, user);
    // A delete waits for a move to settle: sent to both ends of a copy in
    // flight, it could be undone by the copy.
    let until = Instant::now() + RETRY_FOR;
    while s.workers.moving(&scoped_user) {
        if Instant::now() > until {
            return Err(ApiError::Unavailable("this user's memory is being moved between workers; retry".into()));
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
    let req = pb::ForgetRequest { user: scoped_user.clone(), unit_id: unit.clone() };
    let deadline = s.defaults.deadline;
    // A replica may not have (all of) the user yet; its "not found" is fine.
    let tolerate = |e: &tonic::Status| e.code() == tonic::Code::NotFound;
    write_all(s, &scoped_user, tolerate, |mut c, _| {
        let req = request(req.clone(), deadline);
        async move { c.forget(req).await }
    })
    .await
    .map_err(|e| e.unscope(&tenant))?;
    Ok(Json(if unit.is_empty() {
        json!({"user": user, "deleted": true})
    } else {
        json!({"user": user, "id": unit, "deleted": true})
    }))
}

pub(crate) async fn forget_user(
    State(s): State<Shared>,
    headers: HeaderMap,
    user: std::result::Result<Path<String>, PathRejection>,
) -> Result<Json<serde_json::Value>> {
    forget(&s, &headers, &path(user)?, String::new()).await
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
    forget(&s, &headers, &user, unit).await
}

/// `GET /v1/memories/{user}/{id}`: one unit.
pub(crate) async fn get(
    State(s): State<Shared>,
    headers: HeaderMap,
    p: std::result::Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<serde_json::Value>> {
    let (user, id) = path(p)?;
    let mut read = Read::new(&s, tenant(&s, &headers)?, &user)?;
    let req = pb::ListMemoriesRequest { user: read.user.clone(), ids: vec![id] };
    let r = read.client.list_memories(request(req, s.defaults.deadline)).await.map_err(|e| read.error(e))?.into_inner();
    let unit = r.units.into_iter().next().ok_or_else(|| ApiError::Internal("the worker sent no unit".into()))?;
    Ok(Json(unit_json(&user, MemoryUnit::try_from(unit).map_err(ApiError::Internal)?, None)))
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
    let r: SearchBody = openai::parse(&body(b, s.defaults.body_limit)?)?;
    let mut read = Read::new(&s, tenant, &r.user)?;
    let filters = match r.filters.is_empty() {
        true => String::new(),
        false => serde_json::Value::Object(r.filters).to_string(),
    };
    let req = pb::SearchMemoriesRequest {
        user: read.user.clone(),
        query: r.query,
        top_k: r.top_k.unwrap_or(SEARCH_TOP_K),
        threshold: r.threshold,
        filters,
        agent_id: r.agent_id.unwrap_or_default(),
        run_id: r.run_id.unwrap_or_default(),
    };
    let hits = read.client.search_memories(request(req, s.defaults.deadline)).await.map_err(|e| read.error(e))?;
    let hits = hits.into_inner().hits;
    let results = hits
        .into_iter()
        .map(|h| {
            let unit = h.unit.ok_or_else(|| ApiError::Internal("a search hit without its unit".into()))?;
            Ok(unit_json(&r.user, MemoryUnit::try_from(unit).map_err(ApiError::Internal)?, Some(h.score)))
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
    openai::check_user(&user)?;
    let r: UpdateBody = openai::parse(&body(b, s.defaults.body_limit)?)?;
    if r.text.is_none() && r.metadata.is_none() {
        return Err(ApiError::BadRequest("nothing to update: send `text` and/or `metadata`".into()));
    }
    let scoped_user = scoped(&tenant, &user);
    let req = pb::UpdateMemoryRequest {
        user: scoped_user.clone(),
        id: id.clone(),
        text: r.text,
        metadata: r.metadata.map(|m| serde_json::Value::Object(m).to_string()),
        defer_kv: false,
    };
    let deadline = s.defaults.deadline;
    // A replica that does not have the unit yet takes it with the update's
    // ingest's retry, or from the home on a move; its "not found" is fine.
    let tolerate = |e: &tonic::Status| e.code() == tonic::Code::NotFound;
    let resp = write_all(&s, &scoped_user, tolerate, |mut c, home| {
        let req = request(pb::UpdateMemoryRequest { defer_kv: !home, ..req.clone() }, deadline);
        async move { c.update_memory(req).await }
    })
    .await
    .map_err(|e| e.unscope(&tenant))?;
    Ok(Json(json!({"id": id, "user": user, "updated": resp.changed, "encoded_tokens": resp.encoded_tokens})))
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
    let mut read = Read::new(&s, tenant(&s, &headers)?, &user)?;
    let req = pb::UnitHistoryRequest { user: read.user.clone(), id: id.clone() };
    let events = read.client.unit_history(request(req, s.defaults.deadline)).await.map_err(|e| read.error(e))?;
    let events = events.into_inner().events;
    let meta = |m: &str| serde_json::from_str::<serde_json::Value>(m).unwrap_or(serde_json::Value::Null);
    let history: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            json!({"event": e.event, "created_at": rfc3339(e.at_ms), "at_ms": e.at_ms,
                   "old_memory": e.old_text, "new_memory": e.new_text,
                   "old_metadata": e.old_metadata.as_deref().map(meta), "new_metadata": meta(&e.new_metadata)})
        })
        .collect();
    Ok(Json(json!({"id": id, "user": user, "history": history})))
}

/// Milliseconds since the Unix epoch as RFC 3339 UTC (`…T…Z`, milliseconds).
fn rfc3339(ms: u64) -> String {
    let (days, rest) = ((ms / 86_400_000) as i64, ms % 86_400_000);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, sec, milli) = (rest / 3_600_000, rest / 60_000 % 60, rest / 1000 % 60, rest % 1000);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{sec:02}.{milli:03}Z")
}

/// A unit as the memory API shows it: its fields, with Mem0's names
/// (`memory` for the text, `user_id`) beside ours.
fn unit_json(user: &str, u: MemoryUnit, score: Option<f32>) -> serde_json::Value {
    let mut v = json!({"id": u.id, "memory": u.text, "text": u.text, "speaker": u.speaker, "time": u.time,
                       "metadata": u.metadata, "user_id": user});
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
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(v: serde_json::Value) -> Vec<openai::Message> {
        serde_json::from_value(v).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn messages_become_turns_with_stable_ids() {
        let list = messages(json!([
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "I love hiking."},
            {"role": "assistant", "name": "Coach", "content": "Great!"},
            {"role": "user", "content": "I love hiking."},
        ]));
        let units = units_from_messages(&list).unwrap_or_else(|e| panic!("{e}"));
        let speakers: Vec<&str> = units.iter().map(|u| u.speaker.as_str()).collect();
        assert_eq!(speakers, ["User", "Coach", "User"]);
        assert_eq!(units[2].text, "I love hiking.");
        // Identical messages get distinct ids; the same list the same ids.
        assert_ne!(units[0].id, units[2].id);
        let again = units_from_messages(&list).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(units.iter().map(|u| &u.id).collect::<Vec<_>>(), again.iter().map(|u| &u.id).collect::<Vec<_>>());
        let tool = messages(json!([{"role": "tool", "content": "x"}]));
        assert!(units_from_messages(&tool).is_err());
    }

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_281_818_123), "2026-12-03T07:10:18.123Z");
    }

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
