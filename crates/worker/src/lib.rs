//! The worker (design.md §4): one engine, one memory shard, continuous
//! batching across users, behind the gRPC `Worker` service.
//!
//! Layers: [`scheduler`] is pure decision logic (request ids and token and
//! block counts, no tensors, no I/O) so that it can be tested exhaustively;
//! [`core`] is the engine thread that carries out its steps; [`service`]
//! turns gRPC calls into commands for that thread; [`transfer`] streams
//! shards between workers for the cluster's rebalancer; [`frames`] cuts a
//! shard into fixed-size frames for device-to-device (NCCL) transfer over
//! a [`link`]; [`http`] serves [`metrics`] and the health probes.

pub mod core;
pub mod error;
pub mod frames;
pub mod http;
pub mod link;
pub mod metrics;
pub mod scheduler;
pub mod service;
pub mod text;
pub mod transfer;

pub use core::{WorkerConfig, WorkerParts};
pub use error::{Result, WorkerError};
pub use scheduler::{AdmitError, RequestSpec, Scheduler, SchedulerConfig, Step, StepItem};
pub use service::{WorkerInfo, WorkerService, spawn, spawn_handler};
