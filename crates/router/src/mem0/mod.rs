//! Mem0's hosted REST API (v1, v2 and v3 paths, with their trailing
//! slashes) mapped onto our memory API, so that a Mem0 client — `mem0ai`'s
//! `MemoryClient(host=…)` — works by changing its host. docs/serving.md,
//! "Mem0 compatibility", lists every call: supported, how it differs, or
//! refused.
//!
//! A Mem0 memory is one of our units; its id carries its user ([`ids`]), so
//! `GET /v1/memories/{id}/` routes like any read. Filters ([`filter`]) are
//! evaluated here over the units of the users they name. Errors carry
//! Mem0's `detail` beside our OpenAI-shaped `error`.

pub mod filter;
pub mod ids;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, RawQuery, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing};
use inferscale_proto as pb;
use inferscale_types::MemoryUnit;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::ingest::{Ingest, units_from_messages};
use crate::memories;
use crate::openai;
use crate::state::{Shared, body, tenant, unique};
use filter::{Filter, Record};

/// The Mem0 routes, merged into the app's router.
pub(crate) fn routes() -> Router<Shared> {
    Router::new()
        .route("/v1/ping/", routing::get(ping))
        .route("/v1/memories/", routing::post(add).get(list_v1).delete(delete_all))
        .route("/v3/memories/add/", routing::post(add))
        .route("/v2/memories/", routing::post(list))
        .route("/v3/memories/", routing::post(list))
        .route("/v1/memories/search/", routing::post(search))
        .route("/v2/memories/search/", routing::post(search))
        .route("/v3/memories/search/", routing::post(search))
        .route("/v1/memories/{id}/", routing::get(get).put(update).delete(delete))
        .route("/v1/memories/{id}/history/", routing::get(history))
        .route("/v2/entities/{kind}/{name}/", routing::delete(delete_entity))
}

/// An error as Mem0's clients read it: `{"detail": message}` (their
/// exceptions carry `detail`), beside our `error` object, same status.
pub(crate) struct Mem0Error(ApiError);

impl From<ApiError> for Mem0Error {
    fn from(e: ApiError) -> Self {
        Mem0Error(e)
    }
}

impl IntoResponse for Mem0Error {
    fn into_response(self) -> Response {
        let mut resp = self.0.into_response_with(|e| {
            let mut b = e.body();
            b["detail"] = json!(e.to_string());
            b
        });
        resp.headers_mut().insert("x-inferscale-api", axum::http::HeaderValue::from_static("mem0"));
        resp
    }
}

type Result<T> = std::result::Result<T, Mem0Error>;

fn invalid(param: &str, message: impl Into<String>) -> Mem0Error {
    Mem0Error(ApiError::param(param, message))
}

/// Mem0's default page size, and the largest page.
const PAGE_SIZE: usize = 100;
const MAX_PAGE_SIZE: usize = 1000;
/// Mem0's defaults for search: results, and the least score returned.
const SEARCH_TOP_K: usize = 10;
const SEARCH_THRESHOLD: f32 = 0.1;
/// Units a search ranks per user before filters: the worker's largest
/// search.
const SEARCH_POOL: u32 = 1000;

/// `GET /v1/ping/`: what Mem0's client asks when it starts. It requires an
/// organisation and a project: both are the API key's tenant.
async fn ping(State(s): State<Shared>, headers: HeaderMap) -> Result<Json<Value>> {
    let tenant = tenant(&s, &headers)?;
    Ok(Json(json!({"status": "ok", "org_id": tenant, "project_id": tenant, "user_email": null})))
}

/// Mem0's `messages`: a string (one user message), one message, or a list.
fn messages(v: Value) -> Result<Vec<openai::Message>> {
    let list = match v {
        Value::String(text) => return Ok(vec![openai::Message::user(text)]),
        Value::Object(_) => vec![v],
        Value::Array(list) => list,
        other => {
            return Err(invalid("messages", format!("expected a string, a message or a list of them, got {other}")));
        }
    };
    list.into_iter()
        .enumerate()
        .map(|(i, m)| {
            serde_json::from_value(m).map_err(|e| invalid(&format!("messages[{i}]"), format!("invalid message: {e}")))
        })
        .collect()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddBody {
    messages: Value,
    user_id: Option<String>,
    agent_id: Option<String>,
    run_id: Option<String>,
    app_id: Option<String>,
    #[serde(default)]
    metadata: Map<String, Value>,
    infer: Option<bool>,
    async_mode: Option<bool>,
    /// Response-shape selectors of Mem0's: the answer is always v1.1's.
    #[serde(rename = "version")]
    _version: Option<String>,
    #[serde(rename = "output_format")]
    _output_format: Option<String>,
}

/// `POST /v1/memories/`, `POST /v3/memories/add/`: each user and assistant
/// message stored as it is, one memory each (Mem0's `infer: false`); every
/// call stores new memories, as Mem0's does. Inference (`infer: true`,
/// Mem0's default: facts extracted by an LLM) is refused, not ignored.
async fn add(
    State(s): State<Shared>,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    let tenant = tenant(&s, &headers)?;
    let r: AddBody = crate::validate::parse(&body(b, s.defaults.body_limit)?)?;
    if r.infer != Some(false) {
        return Err(invalid(
            "infer",
            "this server stores messages as they are and does not extract facts with a model: send \"infer\": \
             false (Mem0's client: add(..., infer=False))",
        ));
    }
    if r.app_id.is_some() {
        return Err(invalid("app_id", "is not supported: scope memories with agent_id or run_id"));
    }
    let user = r.user_id.filter(|u| !u.is_empty()).ok_or_else(|| {
        invalid("user_id", "is required: memories are stored per user (send user_id, with agent_id or run_id to scope)")
    })?;
    inferscale_types::check_user(&user).map_err(ApiError::from)?;
    let messages = messages(r.messages)?;
    let mut units = units_from_messages(&messages, unique() | 1)?;
    if units.is_empty() {
        return Err(invalid("messages", "has no user or assistant message to store"));
    }
    for u in &mut units {
        u.metadata.clone_from(&r.metadata);
        u.agent_id = r.agent_id.clone().unwrap_or_default();
        u.run_id = r.run_id.clone().unwrap_or_default();
    }
    let results: Vec<Value> = units
        .iter()
        .map(|u| json!({"id": ids::encode(&user, &u.id), "memory": u.text, "data": {"memory": u.text}, "event": "ADD"}))
        .collect();
    let ingest = Ingest::new(&tenant, user, None, units, Vec::new());
    if r.async_mode == Some(true) {
        let job = crate::jobs::launch(&s, tenant, ingest)?;
        let location = format!("/v1/memories/jobs/{job}");
        return Ok(Json(json!({"status": "PENDING", "event_id": job, "location": location, "results": results,
                              "message": "queued: the memories are stored when the job at `location` succeeds"}))
        .into_response());
    }
    ingest.run(&s, &tenant, s.defaults.deadline).await?;
    Ok(Json(json!({"results": results})).into_response())
}

/// A page of a list: 1-based number and size.
fn paging(query: Option<&str>, body_page: Option<usize>, body_size: Option<usize>) -> Result<(usize, usize)> {
    let (mut page, mut size) = (body_page.unwrap_or(1), body_size.unwrap_or(PAGE_SIZE));
    for (k, v) in memories::query_pairs(query)? {
        match k.as_str() {
            "page" => page = v.parse().map_err(|_| invalid("page", format!("{v:?} is not a page number")))?,
            "page_size" => size = v.parse().map_err(|_| invalid("page_size", format!("{v:?} is not a number")))?,
            _ => {}
        }
    }
    if page == 0 {
        return Err(invalid("page", "pages are numbered from 1"));
    }
    if !(1..=MAX_PAGE_SIZE).contains(&size) {
        return Err(invalid("page_size", format!("{size} is outside 1..={MAX_PAGE_SIZE}")));
    }
    Ok((page, size))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListBody {
    filters: Option<Value>,
    page: Option<usize>,
    page_size: Option<usize>,
}

/// `POST /v2/memories/`, `POST /v3/memories/`: the memories `filters`
/// selects, oldest first, a page at a time.
async fn list(
    State(s): State<Shared>,
    headers: HeaderMap,
    query: RawQuery,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Json<Value>> {
    let tenant = tenant(&s, &headers)?;
    let r: ListBody = crate::validate::parse(&body(b, s.defaults.body_limit)?)?;
    let (page, size) = paging(query.0.as_deref(), r.page, r.page_size)?;
    let filter = parse_filters(r.filters.as_ref())?;
    let path = "/v3/memories/";
    page_of(&s, &tenant, &filter, page, size, path).await.map(Json)
}

/// `GET /v1/memories/?user_id=…&agent_id=…&run_id=…&page=…&page_size=…`:
/// Mem0's v1 list, as [`list`] with those ids as the filter.
async fn list_v1(State(s): State<Shared>, headers: HeaderMap, query: RawQuery) -> Result<Json<Value>> {
    let tenant = tenant(&s, &headers)?;
    let (page, size) = paging(query.0.as_deref(), None, None)?;
    let filter = entity_filter(query.0.as_deref())?;
    page_of(&s, &tenant, &filter, page, size, "/v1/memories/").await.map(Json)
}

/// The `user_id`, `agent_id` and `run_id` of a query string as a filter.
fn entity_filter(query: Option<&str>) -> Result<Filter> {
    let mut all = Map::new();
    for (k, v) in memories::query_pairs(query)? {
        match k.as_str() {
            "user_id" | "agent_id" | "run_id" => {
                all.insert(k, json!(v));
            }
            "app_id" => return Err(invalid("app_id", "is not supported: scope memories with agent_id or run_id")),
            "filters" => {
                return Err(invalid("filters", "is not taken in a query string: send user_id, agent_id or run_id"));
            }
            "page" | "page_size" | "delete_linked" => {}
            other => return Err(Mem0Error(ApiError::Unsupported(other.to_string()))),
        }
    }
    parse_filters(Some(&Value::Object(all)))
}

/// A `filters` value, which must name whose memories it reads.
fn parse_filters(v: Option<&Value>) -> Result<Filter> {
    let f = Filter::parse(v.unwrap_or(&json!({}))).map_err(|e| invalid("filters", e))?;
    match f.users() {
        Some(users) if !users.is_empty() => Ok(f),
        _ => Err(invalid(
            "filters",
            "must name the user (user_id as a value or with `in`): memories are stored per user; agent_id and \
             run_id narrow within a user",
        )),
    }
}

/// One memory read from a worker, for filters and replies.
struct Read {
    user: String,
    unit: MemoryUnit,
    created_ms: u64,
    updated_ms: u64,
    score: Option<f32>,
}

impl Read {
    fn from_pb(user: &str, u: pb::MemoryUnit, score: Option<f32>) -> Result<Read> {
        let (created_ms, updated_ms) = (u.created_ms, u.updated_ms);
        let unit = MemoryUnit::try_from(u).map_err(ApiError::Internal)?;
        Ok(Read { user: user.to_string(), unit, created_ms, updated_ms, score })
    }

    fn id(&self) -> String {
        ids::encode(&self.user, &self.unit.id)
    }

    fn passes(&self, f: &Filter) -> bool {
        let id = self.id();
        f.matches(&Record {
            id: &id,
            user_id: &self.user,
            agent_id: &self.unit.agent_id,
            run_id: &self.unit.run_id,
            memory: &self.unit.text,
            metadata: &self.unit.metadata,
            created_ms: self.created_ms,
            updated_ms: self.updated_ms,
        })
    }

    /// Mem0's memory object.
    fn json(&self) -> Value {
        let opt = |s: &str| if s.is_empty() { Value::Null } else { json!(s) };
        let at = |ms: u64| if ms == 0 { Value::Null } else { json!(inferscale_types::time::rfc3339(ms)) };
        let mut v = json!({
            "id": self.id(), "memory": self.unit.text, "user_id": self.user,
            "agent_id": opt(&self.unit.agent_id), "run_id": opt(&self.unit.run_id), "app_id": null,
            "metadata": if self.unit.metadata.is_empty() { Value::Null } else { json!(self.unit.metadata) },
            "categories": [], "created_at": at(self.created_ms), "updated_at": at(self.updated_ms),
            "expiration_date": null,
        });
        if let Some(score) = self.score {
            v["score"] = json!(score);
        }
        v
    }
}

/// Whether a worker's error says the user has no memory (a read of them
/// is then empty, as Mem0's are).
fn no_memory(e: &ApiError) -> bool {
    matches!(e, ApiError::NotFound(m) if m.contains("unknown user"))
}

/// Every memory of the users `f` names that passes it, oldest first.
async fn select(s: &Shared, tenant: &str, f: &Filter) -> Result<Vec<Read>> {
    let mut out = Vec::new();
    for user in f.users().unwrap_or_default() {
        let units = match memories::units(s, tenant.to_string(), &user, Vec::new()).await {
            Ok((units, _)) => units,
            Err(e) if no_memory(&e) => continue,
            Err(e) => return Err(e.into()),
        };
        for u in units {
            let m = Read::from_pb(&user, u, None)?;
            if m.passes(f) {
                out.push(m);
            }
        }
    }
    out.sort_by_key(|m| m.created_ms);
    Ok(out)
}

async fn page_of(s: &Shared, tenant: &str, f: &Filter, page: usize, size: usize, path: &str) -> Result<Value> {
    let all = select(s, tenant, f).await?;
    let start = (page - 1).saturating_mul(size).min(all.len());
    let end = start.saturating_add(size).min(all.len());
    let link = |p: usize| json!(format!("{path}?page={p}&page_size={size}"));
    Ok(json!({
        "count": all.len(),
        "next": if end < all.len() { link(page + 1) } else { Value::Null },
        "previous": if page > 1 { link(page - 1) } else { Value::Null },
        "results": all[start..end].iter().map(Read::json).collect::<Vec<_>>(),
    }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SearchBody {
    query: String,
    filters: Option<Value>,
    #[serde(alias = "limit")]
    top_k: Option<usize>,
    threshold: Option<f32>,
    #[serde(default)]
    rerank: bool,
    /// v1's ids beside the filters.
    user_id: Option<String>,
    agent_id: Option<String>,
    run_id: Option<String>,
    #[serde(rename = "version")]
    _version: Option<String>,
    #[serde(rename = "output_format")]
    _output_format: Option<String>,
}

/// `POST /v{1,2,3}/memories/search/`: the memories `filters` selects,
/// ranked by the cosine similarity of their embedding to the query's,
/// at least `threshold` (Mem0's default 0.1), best first.
async fn search(
    State(s): State<Shared>,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Json<Value>> {
    let tenant = tenant(&s, &headers)?;
    let r: SearchBody = crate::validate::parse(&body(b, s.defaults.body_limit)?)?;
    if r.rerank {
        return Err(invalid("rerank", "is not supported: results are ranked by similarity to the query"));
    }
    let top_k = r.top_k.unwrap_or(SEARCH_TOP_K);
    if !(1..=SEARCH_POOL as usize).contains(&top_k) {
        return Err(invalid("top_k", format!("{top_k} is outside 1..={SEARCH_POOL}")));
    }
    // v1 names the ids beside the filters: both must hold.
    let mut all = vec![r.filters.clone().unwrap_or_else(|| json!({}))];
    for (k, v) in [("user_id", &r.user_id), ("agent_id", &r.agent_id), ("run_id", &r.run_id)] {
        if let Some(v) = v {
            all.push(json!({k: v}));
        }
    }
    let filter = parse_filters(Some(&json!({"AND": all})))?;
    let threshold = r.threshold.unwrap_or(SEARCH_THRESHOLD);
    let mut hits = Vec::new();
    for user in filter.users().unwrap_or_default() {
        let req = pb::SearchMemoriesRequest {
            query: r.query.clone(),
            top_k: SEARCH_POOL,
            threshold: Some(threshold),
            ..Default::default()
        };
        let found = match memories::search_units(&s, tenant.clone(), &user, req).await {
            Ok(found) => found,
            Err(e) if no_memory(&e) => continue,
            Err(e) => return Err(e.into()),
        };
        for h in found {
            let unit = h.unit.ok_or_else(|| ApiError::Internal("a search hit without its unit".into()))?;
            let m = Read::from_pb(&user, unit, Some(h.score))?;
            if m.passes(&filter) {
                hits.push(m);
            }
        }
    }
    hits.sort_by(|a, b| b.score.unwrap_or(0.0).total_cmp(&a.score.unwrap_or(0.0)));
    hits.truncate(top_k);
    Ok(Json(json!({"results": hits.iter().map(Read::json).collect::<Vec<_>>()})))
}

/// The user and unit of a Mem0 id in a path, or a 404 naming it.
fn memory_id(p: std::result::Result<Path<String>, PathRejection>) -> Result<(String, String, String)> {
    let Path(id) = p.map_err(|e| ApiError::BadRequest(format!("invalid path: {}", e.body_text())))?;
    let (user, unit) = ids::decode(&id).ok_or_else(|| missing(&id))?;
    Ok((id, user, unit))
}

/// One memory, or a 404 naming its id (whatever the worker's words).
async fn read_one(s: &Shared, tenant: &str, id: &str, user: &str, unit: &str) -> Result<Read> {
    let (units, _) =
        memories::units(s, tenant.to_string(), user, vec![unit.to_string()]).await.map_err(as_missing(id))?;
    let u = units.into_iter().next().ok_or_else(|| missing(id))?;
    Read::from_pb(user, u, None)
}

/// The 404 of memory `id`, whatever the worker's words (an unknown user or
/// unit): Mem0 names the memory.
fn missing(id: &str) -> ApiError {
    ApiError::NotFound(format!("memory `{id}` not found"))
}

/// A worker's error on memory `id`, its "not found" as [`missing`].
fn as_missing(id: &str) -> impl Fn(ApiError) -> ApiError + '_ {
    move |e| match e {
        ApiError::NotFound(_) => missing(id),
        e => e,
    }
}

/// `GET /v1/memories/{id}/`.
async fn get(
    State(s): State<Shared>,
    headers: HeaderMap,
    p: std::result::Result<Path<String>, PathRejection>,
) -> Result<Json<Value>> {
    let tenant = tenant(&s, &headers)?;
    let (id, user, unit) = memory_id(p)?;
    Ok(Json(read_one(&s, &tenant, &id, &user, &unit).await?.json()))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateBody {
    #[serde(alias = "memory", alias = "data")]
    text: Option<String>,
    metadata: Option<Map<String, Value>>,
}

/// `PUT /v1/memories/{id}/`: a new text and/or metadata; the memory as it
/// is now.
async fn update(
    State(s): State<Shared>,
    headers: HeaderMap,
    p: std::result::Result<Path<String>, PathRejection>,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Json<Value>> {
    let tenant = tenant(&s, &headers)?;
    let (id, user, unit) = memory_id(p)?;
    let r: UpdateBody = crate::validate::parse(&body(b, s.defaults.body_limit)?)?;
    memories::update_unit(&s, &tenant, &user, &unit, r.text, r.metadata).await.map_err(as_missing(&id))?;
    Ok(Json(read_one(&s, &tenant, &id, &user, &unit).await?.json()))
}

/// `DELETE /v1/memories/{id}/`.
async fn delete(
    State(s): State<Shared>,
    headers: HeaderMap,
    p: std::result::Result<Path<String>, PathRejection>,
) -> Result<Json<Value>> {
    let tenant = tenant(&s, &headers)?;
    let (id, user, unit) = memory_id(p)?;
    memories::forget(&s, &tenant, &user, &unit).await.map_err(as_missing(&id))?;
    Ok(Json(json!({"message": "Memory deleted successfully!", "id": id})))
}

/// `GET /v1/memories/{id}/history/`: its adds and updates, oldest first.
async fn history(
    State(s): State<Shared>,
    headers: HeaderMap,
    p: std::result::Result<Path<String>, PathRejection>,
) -> Result<Json<Value>> {
    let tenant = tenant(&s, &headers)?;
    let (id, user, unit) = memory_id(p)?;
    let m = read_one(&s, &tenant, &id, &user, &unit).await?;
    let events = memories::unit_history(&s, tenant, &user, &unit).await?;
    let meta = |m: &str| serde_json::from_str::<Value>(m).unwrap_or(Value::Null);
    let opt = |s: &str| if s.is_empty() { Value::Null } else { json!(s) };
    let entries: Vec<Value> = events
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let at = inferscale_types::time::rfc3339(e.at_ms);
            json!({"id": format!("{id}.h{i}"), "memory_id": id, "event": e.event, "old_memory": e.old_text,
                   "new_memory": e.new_text, "input": [], "user_id": user, "agent_id": opt(&m.unit.agent_id),
                   "run_id": opt(&m.unit.run_id), "app_id": null, "metadata": meta(&e.new_metadata),
                   "categories": [], "created_at": at, "updated_at": at})
        })
        .collect();
    Ok(Json(Value::Array(entries)))
}

/// `DELETE /v1/memories/?user_id=…[&agent_id=…][&run_id=…]`: every memory
/// of the user, or of one agent or run of theirs. Deleting what is already
/// gone succeeds (the call is idempotent, so a client may retry it).
async fn delete_all(State(s): State<Shared>, headers: HeaderMap, query: RawQuery) -> Result<Json<Value>> {
    let tenant = tenant(&s, &headers)?;
    let filter = entity_filter(query.0.as_deref())?;
    let whole_user = matches!(&filter, Filter::Entity(filter::Entity::User, _));
    let mut deleted = 0;
    if whole_user {
        for user in filter.users().unwrap_or_default() {
            match memories::forget(&s, &tenant, &user, "").await {
                Ok(()) => deleted += 1,
                Err(e) if no_memory(&e) => {}
                Err(e) => return Err(e.into()),
            }
        }
        return Ok(Json(json!({"message": "Memories deleted successfully!", "users_deleted": deleted})));
    }
    for m in select(&s, &tenant, &filter).await? {
        match memories::forget(&s, &tenant, &m.user, &m.unit.id).await {
            Ok(()) => deleted += 1,
            Err(ApiError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Json(json!({"message": "Memories deleted successfully!", "memories_deleted": deleted})))
}

/// `DELETE /v2/entities/user/{name}/`: a user and all their memories
/// (idempotent). Agents and runs are scopes within a user here, not
/// entities of their own: delete them with `DELETE /v1/memories/`.
async fn delete_entity(
    State(s): State<Shared>,
    headers: HeaderMap,
    p: std::result::Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<Value>> {
    let tenant = tenant(&s, &headers)?;
    let Path((kind, name)) = p.map_err(|e| ApiError::BadRequest(format!("invalid path: {}", e.body_text())))?;
    if kind != "user" {
        return Err(invalid(
            "entity_type",
            format!("`{kind}` entities are scopes within a user here: DELETE /v1/memories/?user_id=…&{kind}_id={name}"),
        ));
    }
    match memories::forget(&s, &tenant, &name, "").await {
        Ok(()) | Err(ApiError::NotFound(_)) => Ok(Json(json!({"message": "Entity deleted successfully!"}))),
        Err(e) => Err(e.into()),
    }
}
