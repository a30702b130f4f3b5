//! InferScale's gRPC API (`proto/inferscale.proto`) and the client side of
//! the subset of etcd's v3 API that placement uses (`proto/etcd.proto`),
//! generated with tonic.

#![allow(clippy::all)]

pub mod v1 {
    tonic::include_proto!("inferscale.v1");
}

pub mod etcd {
    tonic::include_proto!("etcdserverpb");
}

pub use v1::*;
