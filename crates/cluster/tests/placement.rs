//! The placement store's contract, checked on both implementations — a real
//! etcd (started here) and the embedded store — and the membership tasks
//! built on it: registration that survives a lost lease, leader election,
//! and a view that keeps serving through an etcd restart.

use std::sync::Arc;
use std::time::Duration;

use inferscale_cluster::embedded::Embedded;
use inferscale_cluster::etcd::Etcd;
use inferscale_cluster::etcd::EtcdOptions;
use inferscale_cluster::membership::{Campaign, Registration, watch_view};
use inferscale_cluster::store::{Event, Placement, Txn};
use inferscale_cluster::testing::{EtcdProcess, TestCa};
use inferscale_cluster::view::{ClusterView, Keys, Member, MemberState};
use tokio::sync::watch;

const TTL: Duration = Duration::from_secs(2);

async fn contract(store: Arc<dyn Placement>) {
    let what = store.describe();
    // Compare-and-swap: create once, then update only from the revision read.
    let created = store.txn(Txn::default().when("/t/a", 0).put("/t/a", b"1".to_vec(), 0)).await.expect("txn");
    assert!(created.succeeded, "{what}: create if absent");
    let again = store.txn(Txn::default().when("/t/a", 0).put("/t/a", b"2".to_vec(), 0)).await.expect("txn");
    assert!(!again.succeeded, "{what}: a second create must fail");
    let snap = store.range("/t/").await.expect("range");
    assert_eq!(snap.kvs.len(), 1);
    let rev = snap.kvs[0].mod_revision;
    assert_eq!(snap.kvs[0].value, b"1");
    let stale = store.txn(Txn::default().when("/t/a", rev - 1).put("/t/a", b"3".to_vec(), 0)).await.expect("txn");
    assert!(!stale.succeeded, "{what}: a stale revision must not win");
    let fresh =
        store.txn(Txn::default().when("/t/a", rev).put("/t/a", b"4".to_vec(), 0).put("/t/b", b"x".to_vec(), 0)).await;
    assert!(fresh.expect("txn").succeeded, "{what}: the read revision wins");
    let snap = store.range("/t/").await.expect("range");
    let got: Vec<(&str, &[u8])> = snap.kvs.iter().map(|kv| (kv.key.as_str(), kv.value.as_slice())).collect();
    assert_eq!(got, vec![("/t/a", &b"4"[..]), ("/t/b", &b"x"[..])], "{what}: both ops at one revision");
    assert_eq!(snap.kvs[0].mod_revision, snap.kvs[1].mod_revision);
    assert!(store.range("/u/").await.expect("range").kvs.is_empty(), "{what}: prefixes do not leak");

    // Watch from the next revision sees later changes, in order.
    let mut w = store.watch("/t/", snap.revision + 1).await.expect("watch");
    store.txn(Txn::default().delete("/t/b")).await.expect("delete");
    store.txn(Txn::default().put("/t/c", b"y".to_vec(), 0)).await.expect("put");
    store.txn(Txn::default().put("/other", b"z".to_vec(), 0)).await.expect("put");
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let batch = tokio::time::timeout(Duration::from_secs(5), w.recv())
            .await
            .expect("watch event")
            .expect("open")
            .expect("ok");
        seen.extend(batch.events);
    }
    assert!(matches!(&seen[0], Event::Delete { key, .. } if key == "/t/b"), "{what}: {seen:?}");
    assert!(matches!(&seen[1], Event::Put(kv) if kv.key == "/t/c" && kv.value == b"y"), "{what}: {seen:?}");

    // Leases: revoke deletes at once; expiry deletes within the TTL; a
    // keep-alive of an expired lease says so.
    let lease = store.grant(TTL).await.expect("grant");
    store.txn(Txn::default().put("/t/leased", b"1".to_vec(), lease)).await.expect("put");
    assert!(store.keep_alive(lease).await.expect("keep alive"), "{what}: a live lease renews");
    store.revoke(lease).await.expect("revoke");
    assert!(store.range("/t/leased").await.expect("range").kvs.is_empty(), "{what}: revoke deletes its keys");
    let lease = store.grant(TTL).await.expect("grant");
    store.txn(Txn::default().put("/t/leased", b"2".to_vec(), lease)).await.expect("put");
    tokio::time::sleep(TTL * 3).await;
    assert!(store.range("/t/leased").await.expect("range").kvs.is_empty(), "{what}: expiry deletes its keys");
    assert!(!store.keep_alive(lease).await.expect("keep alive"), "{what}: an expired lease does not renew");
}

#[tokio::test]
async fn embedded_store_keeps_the_contract() {
    contract(Embedded::in_memory()).await;
}

#[tokio::test]
async fn etcd_store_keeps_the_contract() {
    let etcd = EtcdProcess::start().await.expect("etcd");
    contract(Arc::new(Etcd::connect(&etcd.options()).await.expect("client"))).await;
}

/// etcd as production runs it: TLS only, client certificates required,
/// and authentication on. The contract holds for a client with the CA, a
/// certificate and a user's password; a wrong password, a client without
/// the password (its certificate's name is no user) and a plaintext client
/// get nothing.
#[tokio::test]
async fn etcd_over_tls_with_client_certificates_and_passwords_keeps_the_contract() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path()).expect("test CA");
    let etcd = EtcdProcess::start_tls(ca.etcd().expect("certificates")).await.expect("etcd over TLS");
    let admin = Etcd::connect(&etcd.options()).await.expect("client with a certificate");
    let mut c = admin.client().clone();
    c.user_add("root", "root-password", None).await.expect("add root");
    c.user_grant_role("root", "root").await.expect("root role");
    c.user_add("inferscale", "s3cret", None).await.expect("add user");
    c.user_grant_role("inferscale", "root").await.expect("grant");
    c.auth_enable().await.expect("enable auth");

    let with_user =
        |password: &str| EtcdOptions { user: Some(("inferscale".to_string(), password.to_string())), ..etcd.options() };
    let store = Etcd::connect(&with_user("s3cret")).await.expect("client with a user");
    contract(Arc::new(store)).await;

    let wrong = Etcd::connect(&with_user("wrong")).await;
    assert!(wrong.is_err(), "a wrong password was accepted");
    let anonymous = Etcd::connect(&etcd.options()).await.expect("lazy client");
    assert!(anonymous.range("/t/").await.is_err(), "a client without a user read keys with auth on");
    let plain = Etcd::connect(&EtcdOptions::plain(vec![etcd.endpoint()])).await.expect("lazy client");
    assert!(plain.range("/t/").await.is_err(), "a plaintext client was served by a TLS etcd");
}

#[tokio::test]
async fn embedded_store_persists_unleased_keys_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("placement.json");
    {
        let store = Embedded::open(&path).expect("open");
        store.txn(Txn::default().put("/p/user", b"home".to_vec(), 0)).await.expect("put");
        let lease = store.grant(TTL).await.expect("grant");
        store.txn(Txn::default().put("/p/member", b"w".to_vec(), lease)).await.expect("put");
    }
    let store = Embedded::open(&path).expect("reopen");
    let snap = store.range("/p/").await.expect("range");
    assert_eq!(snap.kvs.len(), 1, "{:?}", snap.kvs);
    assert_eq!((snap.kvs[0].key.as_str(), snap.kvs[0].value.as_slice()), ("/p/user", &b"home"[..]));
    std::fs::write(&path, b"{not json").expect("write");
    let err = Embedded::open(&path).err().expect("a corrupt file is an error");
    assert!(err.to_string().contains("placement.json"), "{err}");
}

fn member(name: &str) -> Member {
    Member {
        name: name.into(),
        addr: format!("127.0.0.1:{}", 1000 + name.len()),
        state: MemberState::Joining,
        gpu: None,
    }
}

async fn until(rx: &mut watch::Receiver<Arc<ClusterView>>, what: &str, f: impl Fn(&ClusterView) -> bool) {
    tokio::time::timeout(Duration::from_secs(20), rx.wait_for(|v| f(v)))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting until {what}"))
        .expect("view task alive");
}

#[tokio::test]
async fn membership_survives_lost_leases_and_etcd_restarts() {
    let mut etcd = EtcdProcess::start().await.expect("etcd");
    let store: Arc<dyn Placement> = Arc::new(Etcd::connect(&etcd.options()).await.expect("client"));
    let keys = Keys::new("/cluster-a");
    let mut view = watch_view(store.clone(), keys.clone(), 16);
    let mut w1 = Registration::spawn(store.clone(), keys.clone(), member("w1"), TTL);
    let w2 = Registration::spawn(store.clone(), keys.clone(), member("w2"), TTL);
    until(&mut view, "both workers are registered", |v| v.members.len() == 2 && v.connected).await;
    w1.registered().await;

    // The lease is lost behind the worker's back (as when etcd expired it
    // during a long partition): the worker must register again.
    let lost = w1.lease();
    store.revoke(lost).await.expect("revoke");
    until(&mut view, "w1 is gone", |v| !v.members.contains_key("w1")).await;
    until(&mut view, "w1 registered again", |v| v.members.get("w1").is_some_and(|m| m.lease != lost)).await;

    // Leaving deletes the record at once, without waiting for the TTL.
    w2.leave().await;
    until(&mut view, "w2 left", |v| !v.members.contains_key("w2")).await;

    // etcd restarts: the view keeps its last state while etcd is away, then
    // reconnects and sees changes made after the restart.
    etcd.kill();
    until(&mut view, "the view notices etcd is away", |v| !v.connected).await;
    assert!(view.borrow().members.contains_key("w1"), "the cached view keeps serving");
    etcd.restart().await.expect("restart");
    until(&mut view, "the view reconnects", |v| v.connected).await;
    let w3 = Registration::spawn(store.clone(), keys.clone(), member("w3"), TTL);
    until(&mut view, "w3 seen after the restart", |v| v.members.contains_key("w3") && v.members.contains_key("w1"))
        .await;
    drop(w3);
}

#[tokio::test]
async fn one_leader_at_a_time() {
    let mut etcd = EtcdProcess::start().await.expect("etcd");
    let store: Arc<dyn Placement> = Arc::new(Etcd::connect(&etcd.options()).await.expect("client"));
    let keys = Keys::new("/cluster-b");
    let mut view = watch_view(store.clone(), keys.clone(), 16);
    let a = Campaign::spawn(store.clone(), keys.clone(), "router-a".into(), TTL);
    let b = Campaign::spawn(store.clone(), keys.clone(), "router-b".into(), TTL);
    until(&mut view, "someone leads", |v| v.leader.is_some()).await;
    let (mut la, mut lb) = (a.subscribe(), b.subscribe());
    tokio::time::timeout(Duration::from_secs(10), async {
        while !(*la.borrow() || *lb.borrow()) {
            tokio::select! { _ = la.changed() => {}, _ = lb.changed() => {} }
        }
    })
    .await
    .expect("a campaign learns it leads");
    assert!(a.leading() != b.leading(), "exactly one leads");
    let (leader, follower) = if a.leading() { (a, b) } else { (b, a) };
    let name = view.borrow().leader.as_ref().map(|l| l.value.clone()).expect("leader");
    drop(leader);
    until(&mut view, "the other takes over", |v| v.leader.as_ref().is_some_and(|l| l.value != name)).await;
    let mut lf = follower.subscribe();
    tokio::time::timeout(Duration::from_secs(10), lf.wait_for(|&l| l)).await.expect("follower leads").expect("alive");
    assert!(follower.leading());
    // Cut off from etcd, the leader stops acting within two thirds of a TTL
    // of its last renewal — before etcd could let a rival win.
    etcd.kill();
    tokio::time::sleep(TTL.mul_f64(2.0 / 3.0) + Duration::from_millis(100)).await;
    assert!(!follower.leading(), "a leader that cannot renew must stop acting before its lease can expire");
}
