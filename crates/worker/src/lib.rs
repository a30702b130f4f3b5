//! The worker (docs/design.md §4): one engine, one memory shard, continuous
//! batching across users, behind the gRPC `Worker` service.
//!
//! Layers: `scheduler` is pure decision logic (request ids and token and
//! block counts, no tensors, no I/O) so that it can be tested exhaustively;
//! `protocol` is the worker protocol, one dispatcher for every engine
//! behind the [`MemoryHost`] trait; `engine_thread` is our engine's host,
//! which carries out the scheduler's steps (vLLM's is the vLLM connector's
//! front); `service` turns gRPC calls into protocol commands; [`transfer`] streams
//! shards between workers for the cluster's rebalancer; `frames` cuts a
//! shard into fixed-size frames for device-to-device (NCCL) transfer over
//! a [`link`]; [`http`] serves [`metrics`] and the health probes.

mod cold;
mod config;
mod engine_thread;
mod error;
mod frames;
mod handle;
pub mod http;
mod kv_reader;
pub mod link;
pub mod metrics;
mod protocol;
mod scheduler;
mod service;
pub mod text;
mod throttle;
pub mod transfer;

pub use config::{COLD_KV_WAIT, ColdKv, KV_READERS, PrefixCache, WorkerConfig};
pub use engine_thread::WorkerParts;
pub use error::{Result, WorkerError};
/// How the worker API is secured (mutual TLS or plaintext), for hosts that serve it.
pub use inferscale_proto::tls::{Security, TlsFiles};
pub use protocol::{
    Change, Embedded, Event, Events, FactSources, Finished, GenerateJob, Holdings, Load, MAX_EMBED_INPUTS,
    MAX_INGEST_UNITS, MAX_SEARCH_TOP_K, MemoryHost, ProtocolConfig, SearchQuery, Shard, Stats, Timings, Usage,
    finish_reason,
};
pub use scheduler::{AdmitError, RequestSpec, Scheduler, SchedulerConfig, Step, StepItem};
pub use service::{WorkerInfo, WorkerService, spawn, spawn_host};
