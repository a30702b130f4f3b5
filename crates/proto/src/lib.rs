//! The worker's gRPC service and messages, generated from
//! `proto/inferscale.proto`.

#![allow(clippy::all)]

pub mod v1 {
    tonic::include_proto!("inferscale.v1");
}

pub use v1::*;
