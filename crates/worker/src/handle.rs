//! What a worker's RPCs hold to reach its engine: the command channel to
//! the thread that runs the protocol, the metrics, the device links and how
//! it dials other workers. The gRPC service and the shard transfers share
//! it (`service.rs`, `transfer.rs`), neither knowing the other's type.

use std::sync::Arc;
use std::sync::mpsc::Sender;

use inferscale_proto::tls::Security;
use tokio::sync::oneshot;
use tonic::Status;

use crate::error::WorkerError;
use crate::link::Links;
use crate::metrics::WorkerMetrics;
use crate::protocol::Command;

#[derive(Clone)]
pub(crate) struct Handle {
    pub(crate) tx: Sender<Command>,
    pub(crate) metrics: Arc<WorkerMetrics>,
    /// Device links for shard moves' KV (see [`crate::link`]), if any.
    pub(crate) links: Option<Arc<dyn Links>>,
    /// How this worker dials others (shard moves): plaintext or mutual TLS.
    pub(crate) security: Security,
}

impl Handle {
    /// Hands `c` to the protocol's thread.
    pub(crate) fn send(&self, c: Command) -> Result<(), Status> {
        self.tx.send(c).map_err(|_| Status::from(WorkerError::Shutdown))
    }

    /// Hands the command `make` builds to the protocol's thread and waits
    /// for its reply.
    pub(crate) async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (reply, rx) = oneshot::channel();
        self.send(make(reply))?;
        rx.await.map_err(|_| Status::from(WorkerError::Shutdown))
    }
}
