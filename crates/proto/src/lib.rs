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

/// The URI a gRPC client dials for `addr`: `host:port` as plain HTTP/2, or
/// a URI that already names its scheme, unchanged. Worker and etcd
/// addresses are given either way on command lines and in the cluster.
pub fn uri(addr: &str) -> String {
    if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") }
}
