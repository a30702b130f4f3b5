//! Cluster logic shared by the router and the workers (design.md §4).
//!
//! So far the pure decision part: [`ring`], which maps users to workers by
//! consistent hashing with virtual nodes and bounded load. Membership and
//! placement records (etcd or the embedded store) build on it.

pub mod ring;

pub use ring::Ring;
