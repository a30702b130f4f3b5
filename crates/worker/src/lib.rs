//! The worker (design.md §4): one engine, one memory shard, continuous
//! batching across users.
//!
//! So far the scheduler, which is pure decision logic — request ids and
//! token and block counts, no tensors, no I/O — so that it can be tested
//! exhaustively and the serving loop around it stays thin.

pub mod scheduler;

pub use scheduler::{AdmitError, RequestSpec, Scheduler, SchedulerConfig, Step, StepItem};
