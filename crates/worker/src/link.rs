//! Device-to-device links for shard moves: the transport a shard's KV takes
//! between two workers whose GPUs share a host (NCCL send/recv on CUDA
//! workers), beside the gRPC stream that carries everything else.
//!
//! The worker knows links only through these two traits, so it stays free
//! of any device library: the binary that builds a CUDA worker hands it an
//! implementation ([`crate::WorkerService::with_links`]); a worker without
//! one refuses a move over a link and takes shards over gRPC alone.
//!
//! A link is two ranks: the sending worker makes the id
//! ([`Links::new_id`]) and joins as the sender, the receiving worker learns
//! the id from the shard's first chunk and joins as the receiver. Frames
//! then go across in the order and sizes the shard's manifest gives
//! (`crate::frames`). Every call that waits on the peer has a deadline:
//! a peer that dies or never joins is an error, not a hung thread.

use crate::error::Result;

/// Makes and joins links; one per worker, shared by its moves.
pub trait Links: Send + Sync {
    /// A fresh link id, made by the sending side.
    fn new_id(&self) -> Result<Vec<u8>>;
    /// Joins link `id` as the sender (`sender`) or the receiver, for frames
    /// of at most `frame_bytes`; returns once both ends have joined.
    /// Blocking: call it off the async runtime.
    fn connect(&self, id: &[u8], sender: bool, frame_bytes: usize) -> Result<Box<dyn FrameLink>>;
}

/// One joined end of a link. Blocking calls, each with the link's deadline.
pub trait FrameLink: Send {
    /// Sends the next frame.
    fn send(&mut self, frame: &[u8]) -> Result<()>;
    /// Receives the peer's next frame, of `len` bytes.
    fn recv(&mut self, len: usize) -> Result<Vec<u8>>;
}
