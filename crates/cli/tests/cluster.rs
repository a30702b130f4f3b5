//! The cluster end to end on loopback, with real processes: shard moves
//! between `inferscale worker` processes over gRPC (SmolLM2, CPU).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use common::{Proc, spawn};
use inferscale_proto as pb;
use pb::worker_client::WorkerClient;
use tonic::transport::Channel;

fn worker(mem: &std::path::Path) -> Proc {
    let args = ["worker", "--listen", "127.0.0.1:0", "--memory", mem.to_str().unwrap(), "--window", "2"];
    spawn(&args, "gRPC on ")
}

async fn client(addr: &str) -> WorkerClient<Channel> {
    let max = inferscale_worker::transfer::MAX_MESSAGE_BYTES;
    WorkerClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(max)
        .max_encoding_message_size(max)
}

fn unit(id: &str, speaker: &str, text: &str) -> pb::MemoryUnit {
    pb::MemoryUnit {
        id: id.into(),
        speaker: speaker.into(),
        text: text.into(),
        time: "8 May 2023".into(),
        ..Default::default()
    }
}

fn units() -> Vec<pb::MemoryUnit> {
    vec![
        unit("D1:1", "Caroline", "I adopted a grey cat named Miso last spring."),
        unit("D1:2", "Melanie", "I ran a charity race for mental health on Saturday."),
        unit("D1:3", "Caroline", "I'm moving to Lisbon in September to study counselling."),
        unit("D1:4", "Melanie", "I painted a lake at sunrise and hung it in my kitchen."),
        unit("D1:5", "Caroline", "My favourite food is spicy ramen from the corner shop."),
    ]
}

/// A greedy answer: (text, retrieved fact ids), or the status it failed with.
async fn ask(
    c: &mut WorkerClient<Channel>,
    user: &str,
    question: &str,
) -> Result<(String, Vec<String>), tonic::Status> {
    let req = pb::GenerateRequest {
        user: user.into(),
        messages: vec![pb::ChatMessage { role: "user".into(), content: question.into() }],
        mode: pb::MemoryMode::Kv as i32,
        k: 3,
        sampling: Some(pb::Sampling { max_tokens: 16, ..Default::default() }),
        ..Default::default()
    };
    let mut stream = c.generate(req).await?.into_inner();
    let mut text = String::new();
    while let Some(ev) = stream.message().await? {
        match ev.event {
            Some(pb::generate_event::Event::Token(t)) => text.push_str(&t.text),
            Some(pb::generate_event::Event::Finished(f)) => return Ok((text, f.fact_ids)),
            None => {}
        }
    }
    panic!("the stream ended without a Finished event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_moves_between_workers_and_answers_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let (wa, wb) = (worker(&dir.path().join("a")), worker(&dir.path().join("b")));
    let (mut a, mut b) = (client(&wa.addr).await, client(&wb.addr).await);
    let user = "tenant/caroline";
    a.ingest(pb::IngestRequest { user: user.into(), units: units(), ..Default::default() }).await.unwrap();
    let question = "What is the name of Caroline's cat?";
    let before = ask(&mut a, user, question).await.unwrap();

    // A damaged record is refused whole and stores nothing.
    {
        let mut s = a
            .export_shard(pb::ExportShardRequest { user: user.into(), with_kv: true, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        let mut first = s.message().await.unwrap().unwrap();
        assert!(!first.kv_header.is_empty());
        first.records[0].crc32 ^= 1;
        let bad = tokio_stream::iter(vec![first]);
        let err = b.import_shard(bad).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::DataLoss, "{err}");
        assert!(b.list_users(pb::ListUsersRequest {}).await.unwrap().into_inner().users.is_empty());
    }

    // A CPU worker has no device link: a move over NCCL is refused up
    // front on either end, and nothing moves or freezes.
    let nccl = pb::SendShardRequest {
        user: user.into(),
        to: wb.addr.clone(),
        with_kv: true,
        freeze: true,
        nccl: true,
        ..Default::default()
    };
    let err = a.send_shard(nccl).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("NCCL"), "{err}");
    {
        let req = pb::ExportShardRequest { user: user.into(), with_kv: true, ..Default::default() };
        let mut first = a.export_shard(req).await.unwrap().into_inner().message().await.unwrap().unwrap();
        first.link_id = vec![1; 128];
        first.frame_bytes = 1 << 20;
        let err = b.import_shard(tokio_stream::iter(vec![first])).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
        assert!(b.list_users(pb::ListUsersRequest {}).await.unwrap().into_inner().users.is_empty());
    }

    // The move: snapshot, freeze, catch-up, commit on b.
    let sent = a
        .send_shard(pb::SendShardRequest {
            user: user.into(),
            to: wb.addr.clone(),
            with_kv: true,
            freeze: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let imported = sent.imported.unwrap();
    assert_eq!((imported.facts, imported.with_kv, imported.kept), (5, 5, 0));
    eprintln!(
        "moved {} facts, {:.1} MB in {:.3} s ({:.0} MB/s)",
        imported.facts,
        imported.bytes as f64 / 1e6,
        sent.seconds,
        imported.bytes as f64 / 1e6 / sent.seconds
    );
    // Frozen on the source: writes wait (retryably), reads go on.
    let err = a
        .ingest(pb::IngestRequest {
            user: user.into(),
            units: vec![unit("D2:1", "Caroline", "Hi.")],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(err.message().contains("moving"), "{err}");
    assert_eq!(pb::ErrorKind::of(&err), Some(pb::ErrorKind::Moving), "{err:?}");
    assert_eq!(ask(&mut a, user, question).await.unwrap(), before);

    // Released with drop: the source refuses the user as moved instead of
    // answering without its memory; the destination answers exactly as the
    // source did, from the same facts and their moved KV.
    a.release_shard(pb::ReleaseShardRequest { user: user.into(), drop: true }).await.unwrap();
    let err = ask(&mut a, user, question).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(a.list_users(pb::ListUsersRequest {}).await.unwrap().into_inner().users.is_empty());
    assert_eq!(b.list_users(pb::ListUsersRequest {}).await.unwrap().into_inner().users, vec![user.to_string()]);
    let after = ask(&mut b, user, question).await.unwrap();
    assert_eq!(after, before, "greedy answer and retrieved facts after the move");
    let listed =
        b.list_memories(pb::ListMemoriesRequest { user: user.into(), ids: Vec::new() }).await.unwrap().into_inner();
    let ids: Vec<String> = listed.units.iter().map(|u| u.id.clone()).collect();
    assert_eq!(ids, units().iter().map(|u| u.id.clone()).collect::<Vec<_>>());
    // The destination takes the user's writes.
    b.ingest(pb::IngestRequest {
        user: user.into(),
        units: vec![unit("D2:1", "Caroline", "Hi.")],
        ..Default::default()
    })
    .await
    .unwrap();
}

// ---------------------------------------------------------------------------
// A cluster in etcd: three workers and two routers, then a fourth worker, a
// SIGKILLed worker, an etcd restart and the killed worker's return, all
// under load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inferscale_cluster::{DEFAULT_VNODES, Ring};

use common::cluster::{
    Secured, ask_http, assert_kept, cluster_router, cluster_worker, metric, settled, turns_of, user, wait_until,
};
use common::http;
use serde_json::{Value, json};

const USERS: usize = 20;
const TTL_S: &str = "3";

fn worker_of(mem: &std::path::Path, c: &Secured) -> Proc {
    cluster_worker(mem, c, &["--lease-ttl-s", TTL_S])
}

fn router_of(name: &str, c: &Secured) -> Proc {
    cluster_router(name, c, &["--lease-ttl-s", TTL_S])
}

/// One request of a load: when it ended, whose it was, and the worker
/// that answered or the error.
type Outcome = (Instant, String, Result<String, String>);

/// Closed-loop readers over every user until stopped; each outcome is
/// recorded with its time.
struct Load {
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Outcome>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(routers: &[String], threads: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..threads)
            .map(|t| {
                let (stop, log, routers) = (stop.clone(), log.clone(), routers.to_vec());
                std::thread::spawn(move || {
                    let mut i = t;
                    while !stop.load(Ordering::SeqCst) {
                        let u = user(i % USERS);
                        let r = ask_http(&routers[i % routers.len()], &u, 4).map(|(_, w)| w);
                        log.lock().unwrap().push((Instant::now(), u, r));
                        i += threads;
                    }
                })
            })
            .collect();
        Load { stop, log, threads }
    }

    fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::SeqCst);
        self.threads.into_iter().for_each(|t| t.join().unwrap());
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

fn failures(log: &[Outcome]) -> Vec<String> {
    log.iter().filter_map(|(_, u, r)| r.as_ref().err().map(|e| format!("{u}: {e}"))).collect()
}

#[test]
fn a_cluster_rebalances_fails_over_and_survives_etcd_restarts_under_load() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // etcd over TLS with client certificates, workers over mutual TLS.
    let mut c = rt.block_on(Secured::start());
    let dir = tempfile::tempdir().unwrap();
    let mut workers: Vec<Option<Proc>> =
        (0..3).map(|i| Some(worker_of(&dir.path().join(format!("w{i}")), &c))).collect();
    let r1 = router_of("router-1", &c);
    let r2 = router_of("router-2", &c);
    let routers = vec![r1.addr.clone(), r2.addr.clone()];
    let rs: Vec<&str> = routers.iter().map(String::as_str).collect();
    wait_until("three workers are active", Duration::from_secs(60), || settled(&rs, 3));

    for i in 0..USERS {
        let (s, _, b) = http(&r1.addr, "POST", "/v1/memories", turns_of(i).to_string().as_bytes());
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    }
    // Replicas receive facts as they are written; wait for nothing else to do.
    let before: Vec<(String, String)> = (0..USERS).map(|i| ask_http(&r1.addr, &user(i), 12).unwrap()).collect();
    let agree = |what: &str| {
        for i in 0..USERS {
            let (a, b) = (ask_http(rs[0], &user(i), 1).unwrap().1, ask_http(rs[1], &user(i), 1).unwrap().1);
            assert_eq!(a, b, "{what}: the two routers disagree on {}'s worker", user(i));
        }
    };
    agree("three workers");

    // 1. A fourth worker joins under load: its share of users moves to it
    // (shard with KV), no request fails, and answers stay the same.
    let load = Load::start(&routers, 2);
    std::thread::sleep(Duration::from_secs(2));
    workers.push(Some(worker_of(&dir.path().join("w3"), &c)));
    let took =
        wait_until("the fourth worker is active and every move done", Duration::from_secs(240), || settled(&rs, 4));
    std::thread::sleep(Duration::from_secs(2));
    let log = load.finish();
    let failed = failures(&log);
    assert!(failed.is_empty(), "{} of {} requests failed during the join: {failed:?}", failed.len(), log.len());
    let moves = metric(rs[0], "inferscale_migrations_total") + metric(rs[1], "inferscale_migrations_total");
    let bytes = metric(rs[0], "inferscale_migrated_bytes_total") + metric(rs[1], "inferscale_migrated_bytes_total");
    eprintln!(
        "join settled in {took:?}: {moves} moves, {:.1} MB, {} requests served meanwhile",
        bytes / 1e6,
        log.len()
    );
    let after: Vec<(String, String)> = (0..USERS).map(|i| ask_http(&r1.addr, &user(i), 12).unwrap()).collect();
    // Exactly the users whose home on the ring of four is the new worker
    // moved, and to it: consistent hashing moves nobody else. (Which users
    // those are depends on the workers' ephemeral ports; with 20 users a
    // fourth worker gets none about once in 300 runs, and then nobody moves.)
    let names: Vec<String> = workers.iter().flatten().map(|w| w.addr.clone()).collect();
    let ring = Ring::new(&names, DEFAULT_VNODES);
    let new_worker = workers[3].as_ref().unwrap().addr.clone();
    let home = |i: usize| ring.home(&format!("default/{}", user(i))).unwrap_or_default().to_string();
    let moved: Vec<usize> = (0..USERS).filter(|&i| after[i].1 != before[i].1).collect();
    let expected: Vec<usize> = (0..USERS).filter(|&i| home(i) == new_worker).collect();
    assert_eq!(moved, expected, "moved users against those the ring of four homes on the new worker {new_worker}");
    for (i, (_, w)) in after.iter().enumerate() {
        assert_eq!(*w, home(i), "{} is read from a worker other than its ring home", user(i));
    }
    for i in 0..USERS {
        assert_eq!(after[i].0, before[i].0, "{}'s greedy answer changed", user(i));
    }
    assert!(moves >= moved.len() as f64, "{moves} moves for {} moved users", moved.len());
    agree("after the join");

    // 2. SIGKILL the worker serving the most users, under load and while
    // facts are being written: its users are answered again within 5 s by
    // their replicas, and no acknowledged fact is lost.
    let mut by_worker: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, (_, w)) in after.iter().enumerate() {
        by_worker.entry(w.clone()).or_default().push(i);
    }
    let (victim, victims) =
        by_worker.iter().max_by_key(|(_, us)| us.len()).map(|(w, us)| (w.clone(), us.clone())).unwrap();
    let acked: Arc<Mutex<Vec<(usize, String)>>> = Arc::default();
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (acked, writing, r) = (acked.clone(), writing.clone(), r2.addr.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while writing.load(Ordering::SeqCst) {
                let i = n % USERS;
                let id = format!("K{n}");
                let body = json!({"user": user(i), "turns": [{"id": id, "speaker": "Sam", "text": format!("Note {n}: the bus was late."), "time": "9 May 2023"}]});
                let (s, _, _) = http(&r, "POST", "/v1/memories", body.to_string().as_bytes());
                if s == 200 {
                    acked.lock().unwrap().push((i, id));
                }
                n += 1;
            }
        })
    };
    let load = Load::start(&routers, 2);
    std::thread::sleep(Duration::from_secs(2));
    let slot = workers.iter().position(|w| w.as_ref().is_some_and(|w| w.addr == victim)).unwrap();
    let mut dead = workers[slot].take().unwrap();
    dead.child.kill().unwrap();
    let killed = Instant::now();
    let _ = dead.child.wait();
    // Each of its users is asked at once, and again until answered.
    let askers: Vec<_> = victims
        .iter()
        .map(|&i| {
            let r = r1.addr.clone();
            std::thread::spawn(move || {
                while ask_http(&r, &user(i), 4).is_err() {
                    assert!(killed.elapsed() < Duration::from_secs(60), "{} is never answered again", user(i));
                }
                (user(i), killed.elapsed())
            })
        })
        .collect();
    let back_after: BTreeMap<String, Duration> = askers.into_iter().map(|t| t.join().unwrap()).collect();
    let worst = back_after.values().max().copied().unwrap_or_default();
    eprintln!("killed {victim} ({} users): all answered again within {worst:?}", victims.len());
    assert!(worst <= Duration::from_secs(5), "a user of the killed worker waited {worst:?}: {back_after:?}");
    wait_until("the cluster settles on three workers", Duration::from_secs(120), || settled(&rs, 3));
    eprintln!(
        "re-placed (dead worker out, replicas restored) {:?} after the kill (lease TTL {TTL_S} s)",
        killed.elapsed()
    );
    writing.store(false, Ordering::SeqCst);
    writer.join().unwrap();
    let log = load.finish();
    let failed = failures(&log);
    eprintln!(
        "{} of {} requests failed around the kill: {:?}",
        failed.len(),
        log.len(),
        &failed[..failed.len().min(5)]
    );
    let acked = acked.lock().unwrap().clone();
    assert!(!acked.is_empty());
    assert_kept(&r1.addr, &acked, "after the kill");
    agree("after the kill");

    // 3. etcd restarts under load: requests keep succeeding from the cached
    // view; membership and placement recover afterwards.
    let load = Load::start(&routers, 2);
    std::thread::sleep(Duration::from_secs(1));
    c.etcd.kill();
    wait_until("the routers notice etcd is gone", Duration::from_secs(20), || {
        rs.iter().all(|r| metric(r, "inferscale_cluster_view_connected") == 0.0)
    });
    std::thread::sleep(Duration::from_secs(4));
    rt.block_on(c.etcd.restart()).unwrap();
    wait_until("the cluster recovers after etcd's restart", Duration::from_secs(60), || settled(&rs, 3));
    let log = load.finish();
    let failed = failures(&log);
    assert!(failed.is_empty(), "{} of {} requests failed across the etcd restart: {failed:?}", failed.len(), log.len());
    agree("after etcd's restart");

    // 4. The killed worker returns (with its stale memory): it rejoins, takes
    // its share back, and every acknowledged unit is still there.
    workers[slot] = Some(worker_of(&dir.path().join(format!("w{slot}")), &c));
    wait_until("the returning worker is active and settled", Duration::from_secs(240), || settled(&rs, 4));
    assert_kept(&r1.addr, &acked, "after the rejoin");
    agree("after the rejoin");

    // 5. `cluster status` shows the cluster; `cluster drain` moves a worker's
    // users away under load, after which it stops with no request failing.
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_inferscale")).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let flags = c.flags();
    let mut status_args = vec!["cluster", "status", "--json"];
    status_args.extend(flags.iter().map(String::as_str));
    let status: Value = serde_json::from_str(&cli(&status_args)).unwrap();
    let listed = status["workers"].as_array().unwrap();
    assert_eq!(listed.len(), 4, "{status}");
    assert!(listed.iter().all(|w| w["state"] == "active" && w["reachable"] == true), "{status}");
    let homes: u64 = listed.iter().map(|w| w["users_home"].as_u64().unwrap()).sum();
    assert_eq!(homes, USERS as u64, "every user has one home: {status}");
    assert!(status["leader"].is_string(), "{status}");
    let load = Load::start(&routers, 2);
    let leaving = workers[0].as_ref().unwrap().addr.clone();
    let mut drain_args = vec!["cluster", "drain", &leaving, "--wait-s", "240"];
    drain_args.extend(flags.iter().map(String::as_str));
    let said = cli(&drain_args);
    assert!(said.contains("safe to stop"), "{said}");
    let mut gone = workers[0].take().unwrap();
    gone.child.kill().unwrap();
    let _ = gone.child.wait();
    wait_until("the cluster settles after the drain", Duration::from_secs(120), || settled(&rs, 3));
    let log = load.finish();
    let failed = failures(&log);
    assert!(failed.is_empty(), "{} of {} requests failed across the drain: {failed:?}", failed.len(), log.len());
    assert_kept(&r1.addr, &acked, "after the drain");
}
