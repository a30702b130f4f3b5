//! InferScale's gRPC API (`proto/inferscale.proto`), generated with tonic;
//! the one conversion between the API's messages and the shared words of
//! `inferscale-types`; the error kinds a worker attaches to a status so that
//! callers act on a kind, never on its text; and how the API's connections
//! are secured ([`tls`]).

// Generated code is not ours to lint; the rest of the crate is.
#[allow(clippy::all)]
pub mod v1 {
    tonic::include_proto!("inferscale.v1");
}

pub use v1::*;

pub mod tls;

/// The URI a gRPC client dials for `addr`: `host:port` as plain HTTP/2, or
/// a URI that already names its scheme, unchanged. Worker and etcd
/// addresses are given either way on command lines and in the cluster.
pub fn uri(addr: &str) -> String {
    if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") }
}

impl From<inferscale_types::MemoryUnit> for MemoryUnit {
    fn from(u: inferscale_types::MemoryUnit) -> Self {
        let metadata = match u.metadata.is_empty() {
            true => String::new(),
            false => serde_json::Value::Object(u.metadata).to_string(),
        };
        MemoryUnit {
            id: u.id,
            speaker: u.speaker,
            text: u.text,
            time: u.time,
            source_turn: u.source_turn,
            metadata,
            agent_id: u.agent_id,
            run_id: u.run_id,
        }
    }
}

impl TryFrom<MemoryUnit> for inferscale_types::MemoryUnit {
    /// Why `metadata` is not a JSON object.
    type Error = String;

    fn try_from(u: MemoryUnit) -> Result<Self, String> {
        let metadata = match u.metadata.is_empty() {
            true => serde_json::Map::new(),
            false => serde_json::from_str(&u.metadata)
                .map_err(|e| format!("unit {:?}: metadata is not a JSON object: {e}", u.id))?,
        };
        Ok(inferscale_types::MemoryUnit {
            id: u.id,
            speaker: u.speaker,
            text: u.text,
            time: u.time,
            source_turn: u.source_turn,
            metadata,
            agent_id: u.agent_id,
            run_id: u.run_id,
        })
    }
}

impl From<inferscale_types::Mode> for MemoryMode {
    fn from(m: inferscale_types::Mode) -> Self {
        match m {
            inferscale_types::Mode::Kv => MemoryMode::Kv,
            inferscale_types::Mode::Blend => MemoryMode::Blend,
            inferscale_types::Mode::Prompt => MemoryMode::Prompt,
            inferscale_types::Mode::None => MemoryMode::None,
        }
    }
}

impl MemoryMode {
    /// The mode a request names; an unspecified mode is `kv`, the default.
    pub fn to_mode(self) -> inferscale_types::Mode {
        match self {
            MemoryMode::Kv | MemoryMode::Unspecified => inferscale_types::Mode::Kv,
            MemoryMode::Blend => inferscale_types::Mode::Blend,
            MemoryMode::Prompt => inferscale_types::Mode::Prompt,
            MemoryMode::None => inferscale_types::Mode::None,
        }
    }
}

/// The status metadata key under which a worker names the kind of an
/// error that its code alone does not tell apart.
pub const ERROR_KIND: &str = "inferscale-error-kind";

/// Kinds of [`ERROR_KIND`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// `UNAVAILABLE` because the user's memory is moving between workers:
    /// the worker itself is fine; retry (on the user's new home).
    Moving,
    /// `RESOURCE_EXHAUSTED` because the worker's disk is full: the request
    /// changed nothing (HTTP 507), not a busy queue (429).
    DiskFull,
    /// `UNAVAILABLE` because the user's memory is damaged on this worker:
    /// another replica may serve it.
    Damaged,
    /// `UNAVAILABLE` because an earlier ingest of the user is still being
    /// undone on this worker: retry shortly.
    Unsettled,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Moving => "moving",
            ErrorKind::DiskFull => "disk-full",
            ErrorKind::Damaged => "damaged",
            ErrorKind::Unsettled => "unsettled",
        }
    }

    /// `status` marked as of this kind.
    pub fn mark(self, mut status: tonic::Status) -> tonic::Status {
        status.metadata_mut().insert(ERROR_KIND, tonic::metadata::MetadataValue::from_static(self.as_str()));
        status
    }

    /// The kind `status` is marked with, if any.
    pub fn of(status: &tonic::Status) -> Option<ErrorKind> {
        match status.metadata().get(ERROR_KIND)?.to_str().ok()? {
            "moving" => Some(ErrorKind::Moving),
            "disk-full" => Some(ErrorKind::DiskFull),
            "damaged" => Some(ErrorKind::Damaged),
            "unsettled" => Some(ErrorKind::Unsettled),
            _ => None,
        }
    }
}

/// A request's scope from its proto fields (empty: not scoped).
pub fn scope(agent_id: &str, run_id: &str) -> inferscale_types::Scope {
    let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
    inferscale_types::Scope { agent_id: some(agent_id), run_id: some(run_id) }
}
