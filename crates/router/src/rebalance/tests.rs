//! The rebalancer's moves against fake workers and a real (in-memory)
//! placement store: the order of a move's steps, the records it writes,
//! and what a failed copy leaves behind. The plan itself is unit-tested in
//! `inferscale_cluster::plan`; here it is carried out.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use inferscale_cluster::embedded::Embedded;
use inferscale_cluster::membership::{Registration, watch_view};
use inferscale_proto::tls::Security;
use tonic::Status;

use super::*;
use crate::fake_worker::{Answer, Scripted, serve};

/// What the fake workers were asked, in order, as `"w1 send u to=ADDR"`.
type Log = Arc<Mutex<Vec<String>>>;

struct Fake {
    name: String,
    /// The users it says it holds (set once the test has chosen one).
    holds: Arc<Mutex<Vec<String>>>,
    fail_send: bool,
    log: Log,
}

impl Fake {
    fn note(&self, what: String) {
        if let Ok(mut l) = self.log.lock() {
            l.push(format!("{} {what}", self.name));
        }
    }
}

#[tonic::async_trait]
impl Scripted for Fake {
    async fn forget(&self, r: pb::ForgetRequest) -> Answer<pb::ForgetResponse> {
        self.note(format!("forget {}", r.user));
        Ok(pb::ForgetResponse::default())
    }

    async fn list_users(&self) -> Answer<pb::ListUsersResponse> {
        let users = self.holds.lock().map(|h| h.clone()).unwrap_or_default();
        Ok(pb::ListUsersResponse { users, digests: Vec::new() })
    }

    async fn send_shard(&self, r: pb::SendShardRequest) -> Answer<pb::SendShardResponse> {
        self.note(format!("send {} to={} freeze={} kv={}", r.user, r.to, r.freeze, r.with_kv));
        match self.fail_send {
            true => Err(Status::unavailable("the destination went away mid-copy")),
            false => Ok(pb::SendShardResponse::default()),
        }
    }

    async fn release_shard(&self, r: pb::ReleaseShardRequest) -> Answer<pb::ReleaseShardResponse> {
        self.note(format!("release {} drop={}", r.user, r.drop));
        Ok(pb::ReleaseShardResponse::default())
    }
}

/// Two fake workers, `w1` holding a user whose placement record says `w1`
/// while the ring says `w2`: the plan moves it. Returns the rebalancer
/// (leading), its campaign, the store, the user, w2's address and the log.
struct Cluster {
    rebalancer: Rebalancer,
    campaign: Campaign,
    store: Arc<Embedded>,
    keys: Keys,
    user: String,
    w2: String,
    log: Log,
    _registrations: Vec<Registration>,
}

async fn until(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn cluster(fail_send: bool) -> Cluster {
    let store = Embedded::in_memory();
    let keys = Keys::new("/test");
    let log: Log = Arc::default();
    let ttl = Duration::from_secs(5);
    // Which user the ring homes on w2 is known once both are members; w1
    // says it holds that user from then on.
    let holds: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut addrs = Vec::new();
    let mut registrations = Vec::new();
    for name in ["w1", "w2"] {
        let held = if name == "w1" { holds.clone() } else { Arc::default() };
        let addr = serve(Fake { name: name.into(), holds: held, fail_send, log: log.clone() }).await;
        addrs.push(addr.clone());
        let member = Member { name: name.into(), addr, state: MemberState::Active, gpu: None };
        let mut reg = Registration::spawn(store.clone(), keys.clone(), member, ttl);
        reg.registered().await;
        registrations.push(reg);
    }
    let view = watch_view(store.clone(), keys.clone(), inferscale_cluster::DEFAULT_VNODES);
    let workers = Arc::new(Workers::new(view, 1.25, false, Security::Plaintext));
    until("both members in the view", || workers.view().connected && workers.view().members.len() == 2).await;
    let v = workers.view();
    let user = (0..1000).map(|i| format!("user-{i}")).find(|u| v.ring().home(u) == Some("w2")).unwrap_or_default();
    assert!(!user.is_empty(), "some user is homed on w2");
    let record = PlacementRecord { home: "w1".into(), moving_to: None };
    let put = store.txn(Txn::default().put(keys.placement(&user), json(&record), 0)).await;
    assert!(put.is_ok_and(|r| r.succeeded));
    until("the record in the view", || workers.view().records.contains_key(&user)).await;
    if let Ok(mut h) = holds.lock() {
        h.push(user.clone());
    }
    let mut healthy = 0;
    for _ in 0..200 {
        healthy = workers.probe().await;
        if healthy == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(healthy, 2, "both fake workers answer their health checks");
    let campaign = Campaign::spawn(store.clone(), keys.clone(), "router-a".into(), ttl);
    until("leading", || campaign.leading()).await;
    let rebalancer = Rebalancer {
        store: store.clone(),
        keys: keys.clone(),
        workers,
        cfg: RebalanceConfig { replicate: false, ..Default::default() },
        stats: Arc::default(),
        nccl_failed: Default::default(),
        stale: Default::default(),
    };
    Cluster { rebalancer, campaign, store, keys, user, w2: addrs[1].clone(), log, _registrations: registrations }
}

impl Cluster {
    async fn record(&self) -> Option<PlacementRecord> {
        let key = self.keys.placement(&self.user);
        let snapshot = self.store.range(&key).await.ok()?;
        let kv = snapshot.kvs.into_iter().find(|kv| kv.key == key)?;
        serde_json::from_slice(&kv.value).ok()
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

#[tokio::test]
async fn a_move_clears_the_destination_copies_then_flips_the_record_then_releases_the_source() {
    let c = cluster(false).await;
    c.rebalancer.round(&c.campaign).await.unwrap_or_else(|e| panic!("{e}"));
    let u = &c.user;
    assert_eq!(
        c.log(),
        [
            format!("w2 forget {u}"),
            format!("w1 send {u} to={} freeze=true kv=true", c.w2),
            format!("w1 release {u} drop=true"),
        ],
        "the destination's stale copy first, then the frozen copy, then the source lets go"
    );
    assert_eq!(c.record().await, Some(PlacementRecord { home: "w2".into(), moving_to: None }));
    let stats = &c.rebalancer.stats;
    assert_eq!((stats.moves.load(Ordering::Relaxed), stats.failures.load(Ordering::Relaxed)), (1, 0));
}

#[tokio::test]
async fn a_failed_copy_puts_the_record_back_and_unfreezes_the_source() {
    let c = cluster(true).await;
    c.rebalancer.round(&c.campaign).await.unwrap_or_else(|e| panic!("{e}"));
    let u = &c.user;
    assert_eq!(
        c.log(),
        [
            format!("w2 forget {u}"),
            format!("w1 send {u} to={} freeze=true kv=true", c.w2),
            format!("w1 release {u} drop=false"),
        ],
        "the source keeps its copy and takes writes again"
    );
    assert_eq!(c.record().await, Some(PlacementRecord { home: "w1".into(), moving_to: None }), "served where it was");
    let stats = &c.rebalancer.stats;
    assert_eq!((stats.moves.load(Ordering::Relaxed), stats.failures.load(Ordering::Relaxed)), (0, 1));
}

#[tokio::test]
async fn a_router_that_does_not_lead_moves_nothing() {
    let c = cluster(false).await;
    // A second router's campaign: it does not lead while the first does.
    let other = Campaign::spawn(c.store.clone(), c.keys.clone(), "router-b".into(), Duration::from_secs(5));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!other.leading());
    c.rebalancer.round(&other).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(c.log().is_empty(), "{:?}", c.log());
    assert_eq!(c.record().await, Some(PlacementRecord { home: "w1".into(), moving_to: None }));
}
