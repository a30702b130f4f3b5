//! The one error type of the worker crate, and its gRPC status.

use inferscale_engine::EngineError;
use inferscale_memory::MemoryError;
use inferscale_types::Refusal;

use crate::scheduler::AdmitError;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A request parameter at fault (named, for OpenAI's `param`); nothing
    /// was stored or run.
    #[error(transparent)]
    Refused(#[from] Refusal),

    /// Memory units or their layout that the store refuses (an empty
    /// text, an id too long, a unit that cannot fit the context); nothing
    /// was stored.
    #[error("invalid {what}: {reason}")]
    InvalidMemory { what: &'static str, reason: String },

    /// The engine a worker hands generation to (vLLM) refused the request.
    #[error("the engine refused the request: {0}")]
    EngineRefused(String),

    #[error("unknown user `{0}`")]
    UnknownUser(String),

    #[error("user {user:?} has no memory unit {id:?}")]
    UnknownUnit { user: String, id: String },

    /// The request was refused by admission (queue full, too large).
    #[error(transparent)]
    Admit(#[from] AdmitError),

    #[error("deadline of {0} ms exceeded")]
    Deadline(u64),

    /// The user's memory was forgotten while the request (a chat or an
    /// ingest) waited.
    #[error("the memory of user {0:?} was forgotten while the request waited")]
    Forgotten(String),

    /// The user's memory is moving between workers: its writes wait for the
    /// move to end, and once it has moved away its requests belong to its
    /// new home. Retryable.
    #[error("the memory of user {0:?} is moving between workers; retry")]
    Moving(String),

    /// The user's stored memory is damaged on this worker (refused until
    /// repaired; a replica may serve it).
    #[error("the memory of user {0:?} is damaged on this worker and unavailable until it is repaired")]
    Damaged(String),

    /// An earlier ingest of the user is still being undone. Retryable.
    #[error("an earlier ingest of user {0:?} is still being undone; retry shortly")]
    Unsettled(String),

    /// The worker's disk is full: the request changed nothing.
    #[error("the server's disk is full: the request changed nothing; retry later")]
    DiskFull,

    /// The engine thread has stopped (shutdown or a fatal error).
    #[error("the worker is shutting down")]
    Shutdown,

    #[error(transparent)]
    Memory(MemoryError),

    #[error(transparent)]
    Engine(#[from] EngineError),

    #[error(transparent)]
    Model(#[from] inferscale_model::ModelError),

    #[error("{0}")]
    Startup(String),

    /// A device-to-device link of a shard move failed (see [`crate::link`]).
    #[error("link: {0}")]
    Link(String),

    /// The engine a worker hands generation to (vLLM, in vLLM mode) is
    /// unreachable or failed the request. Retryable.
    #[error("engine: {0}")]
    Upstream(String),

    /// A fault of this worker that the caller cannot fix.
    #[error("{0}")]
    Internal(String),
}

impl From<MemoryError> for WorkerError {
    fn from(e: MemoryError) -> Self {
        match e {
            MemoryError::Invalid { what, reason } => WorkerError::InvalidMemory { what, reason },
            MemoryError::UnknownUser(u) => WorkerError::UnknownUser(u),
            MemoryError::UnknownFact { user, id } => WorkerError::UnknownUnit { user, id },
            MemoryError::UserDamaged(u) => WorkerError::Damaged(u),
            MemoryError::Unsettled(u) => WorkerError::Unsettled(u),
            MemoryError::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull => WorkerError::DiskFull,
            other => WorkerError::Memory(other),
        }
    }
}

pub type Result<T> = std::result::Result<T, WorkerError>;

impl From<WorkerError> for tonic::Status {
    fn from(e: WorkerError) -> Self {
        use tonic::Code;
        let code = match &e {
            WorkerError::Refused(_) | WorkerError::InvalidMemory { .. } | WorkerError::EngineRefused(_) => {
                Code::InvalidArgument
            }
            WorkerError::UnknownUser(_) | WorkerError::UnknownUnit { .. } => Code::NotFound,
            WorkerError::Admit(AdmitError::QueueFull(_)) => Code::ResourceExhausted,
            WorkerError::Admit(AdmitError::TooLarge { .. }) | WorkerError::Admit(AdmitError::Empty(_)) => {
                Code::InvalidArgument
            }
            WorkerError::Admit(AdmitError::Duplicate(_)) => Code::AlreadyExists,
            WorkerError::Deadline(_) => Code::DeadlineExceeded,
            WorkerError::Forgotten(_) => Code::Aborted,
            WorkerError::Shutdown
            | WorkerError::Moving(_)
            | WorkerError::Link(_)
            | WorkerError::Upstream(_)
            | WorkerError::Damaged(_)
            | WorkerError::Unsettled(_) => Code::Unavailable,
            WorkerError::DiskFull => Code::ResourceExhausted,
            WorkerError::Memory(_)
            | WorkerError::Engine(_)
            | WorkerError::Model(_)
            | WorkerError::Startup(_)
            | WorkerError::Internal(_) => Code::Internal,
        };
        // A store failure's text names server files: it goes to the log,
        // the caller gets what happened without them.
        let message = match &e {
            WorkerError::Memory(m) => {
                tracing::error!(error = %m, "the memory store failed a request");
                match m {
                    MemoryError::Io { source, .. } => {
                        format!(
                            "the worker's memory store failed: an I/O error ({}); details in its log",
                            source.kind()
                        )
                    }
                    _ => "the worker's memory store failed; details in its log".to_string(),
                }
            }
            other => other.to_string(),
        };
        let status = tonic::Status::new(code, message);
        match e {
            WorkerError::Refused(r) => inferscale_proto::refused(&r),
            // The code alone reads as "worker down"; the kind tells a router
            // to retry without re-probing the worker's health.
            WorkerError::Moving(_) => inferscale_proto::ErrorKind::Moving.mark(status),
            WorkerError::Damaged(_) => inferscale_proto::ErrorKind::Damaged.mark(status),
            WorkerError::Unsettled(_) => inferscale_proto::ErrorKind::Unsettled.mark(status),
            WorkerError::DiskFull => inferscale_proto::ErrorKind::DiskFull.mark(status),
            _ => status,
        }
    }
}
