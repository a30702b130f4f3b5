//! The cluster layer shared by routers and workers.
//!
//! - [`ring`]: consistent hashing of users onto workers (pure logic).
//! - [`store`]: the [`Placement`] trait — where membership and placement
//!   live — with two implementations, [`etcd::Etcd`] for clusters and
//!   [`embedded::Embedded`] for one node.
//! - [`view`]: the cluster as a router sees it (members, explicit placement
//!   records, the leader) and the routing decisions made from it (pure).
//! - [`membership`]: a worker's registration under a lease kept alive,
//!   leader election, and the watcher that keeps a [`view::ClusterView`]
//!   current and keeps serving the cached one when the store is away.
//! - [`plan`] and [`fence`]: the leader's decisions (what to move, copy,
//!   drop; which unreachable worker to fence), pure.

pub mod embedded;
mod error;
pub mod etcd;
pub mod fence;
pub mod membership;
pub mod plan;
pub mod ring;
pub mod store;
pub mod testing;
pub mod view;

pub use error::{ClusterError, Result};
pub use ring::{DEFAULT_VNODES, Ring, hash64};
pub use store::Placement;
pub use view::{ClusterView, Member, MemberState, PlacementRecord};
