//! The cluster's process-level tests: workers and routers over a real
//! etcd, users with a few turns each, and what the tests read back
//! through a router.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use inferscale_cluster::testing::{EtcdProcess, TestCa};
use serde_json::{Value, json};

use super::{Proc, http, spawn};

/// A test cluster's etcd and certificates, as production runs them: etcd
/// serves TLS only and requires client certificates; workers serve their
/// gRPC with mutual TLS; every process presents a certificate (for
/// 127.0.0.1) from a CA made for the test.
pub struct Secured {
    pub etcd: EtcdProcess,
    flags: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Secured {
    pub async fn start() -> Secured {
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new(dir.path()).unwrap();
        let etcd_tls = ca.etcd().unwrap();
        let (cert, key) = ca.issue("node", &["127.0.0.1", "localhost"]).unwrap();
        let path = |p: &std::path::Path| p.to_str().unwrap().to_string();
        let flags = vec![
            "--etcd-ca".into(),
            path(&ca.ca()),
            "--etcd-cert".into(),
            path(&etcd_tls.client.0),
            "--etcd-key".into(),
            path(&etcd_tls.client.1),
            "--tls-cert".into(),
            path(&cert),
            "--tls-key".into(),
            path(&key),
            "--tls-ca".into(),
            path(&ca.ca()),
        ];
        let etcd = EtcdProcess::start_tls(etcd_tls).await.expect("etcd (Debian: apt-get install etcd-server)");
        Secured { etcd, flags, _dir: dir }
    }

    /// `--etcd …` and the TLS flags of etcd and of the workers' gRPC.
    pub fn flags(&self) -> Vec<String> {
        let mut f = vec!["--etcd".to_string(), self.etcd.endpoint()];
        f.extend(self.flags.iter().cloned());
        f
    }
}

/// A worker of the cluster `c` (SmolLM2, CPU, window 2), with `extra`
/// flags (`--lease-ttl-s`, …).
pub fn cluster_worker(mem: &std::path::Path, c: &Secured, extra: &[&str]) -> Proc {
    let mem = mem.to_str().unwrap();
    let flags = c.flags();
    let mut args = vec!["worker", "--listen", "127.0.0.1:0", "--memory", mem, "--window", "2"];
    args.extend(flags.iter().map(String::as_str));
    args.extend_from_slice(extra);
    spawn(&args, "gRPC on ")
}

/// A router of the cluster `c`, named `name`, with `extra` flags.
pub fn cluster_router(name: &str, c: &Secured, extra: &[&str]) -> Proc {
    let flags = c.flags();
    let mut args = vec!["router", "--listen", "127.0.0.1:0", "--name", name, "--deadline-s", "600"];
    args.extend(flags.iter().map(String::as_str));
    args.extend_from_slice(extra);
    spawn(&args, "API on ")
}

pub fn user(i: usize) -> String {
    format!("user{i}")
}

pub fn turns_of(i: usize) -> Value {
    let lines = [
        "I adopted a grey cat named Miso last spring.",
        "I ran a charity race for mental health on Saturday.",
        "I'm moving to Lisbon in September to study counselling.",
        "I painted a lake at sunrise and hung it in my kitchen.",
    ];
    let mut turns: Vec<Value> = lines
        .iter()
        .enumerate()
        .map(|(j, t)| json!({"id": format!("D1:{j}"), "speaker": "Sam", "text": t, "time": "8 May 2023"}))
        .collect();
    turns.push(json!({"id": "D1:9", "speaker": "Sam", "text": format!("My locker number is {}.", 100 + i), "time": "8 May 2023"}));
    json!({"user": user(i), "turns": turns})
}

/// A greedy answer through a router: (text, worker), or why it failed.
pub fn ask_http(router: &str, user: &str, max_tokens: u32) -> Result<(String, String), String> {
    let body = json!({"model": "smollm2", "user": user, "temperature": 0, "max_tokens": max_tokens,
                      "messages": [{"role": "user", "content": "What is my locker number?"}],
                      "memory": {"mode": "kv", "k": 3}});
    let (status, headers, b) = http(router, "POST", "/v1/chat/completions", body.to_string().as_bytes());
    if status != 200 {
        return Err(format!("{status}: {}", String::from_utf8_lossy(&b)));
    }
    let v: Value = serde_json::from_slice(&b).map_err(|e| e.to_string())?;
    let text = v["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string();
    let worker = headers.iter().find(|(k, _)| k == "x-inferscale-worker").map(|(_, v)| v.clone()).unwrap_or_default();
    Ok((text, worker))
}

pub fn metric(router: &str, name: &str) -> f64 {
    let (_, _, b) = http(router, "GET", "/metrics", b"");
    let text = String::from_utf8_lossy(&b);
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(f64::NAN)
}

pub fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out after {limit:?} waiting until {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
    t0.elapsed()
}

/// Settled: `n` workers in the ring of every router and answering its
/// health probes, no placement record (every user at its ring home), the
/// view connected. Health matters: a router sends a user's reads to its
/// replica while it counts the home down (a probe that failed as the worker
/// was starting, or under load), so until every router has seen every
/// worker answer, "where a user is read" is not yet "where it lives".
pub fn settled(routers: &[&str], n: usize) -> bool {
    routers.iter().all(|r| {
        metric(r, "inferscale_cluster_ring_workers") == n as f64
            && metric(r, "inferscale_cluster_members") == n as f64
            && metric(r, "inferscale_workers_healthy") == n as f64
            && metric(r, "inferscale_cluster_placement_records") == 0.0
            && metric(r, "inferscale_cluster_view_connected") == 1.0
    })
}

/// Waits until the leader `router` has planned two more rounds and found
/// every replica in step with its home (holding the same units) in the
/// last: until then a worker back from a crash may hold stale copies.
pub fn replicas_in_step(router: &str, limit: Duration) {
    let rounds = metric(router, "inferscale_rebalance_rounds_total");
    wait_until("every replica is in step with its home", limit, || {
        metric(router, "inferscale_rebalance_rounds_total") >= rounds + 2.0
            && metric(router, "inferscale_cluster_replicas_out_of_step") == 0.0
    });
}

/// Asserts that every acknowledged `(user index, unit id)` is stored.
pub fn assert_kept(router: &str, acked: &[(usize, String)], what: &str) {
    let mut stored: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for (i, id) in acked {
        let units = stored.entry(*i).or_insert_with(|| {
            let (s, _, b) = http(router, "GET", &format!("/v1/memories/{}?limit=1000", user(*i)), b"");
            assert_eq!(s, 200, "{what}: {}", String::from_utf8_lossy(&b));
            let v: Value = serde_json::from_slice(&b).unwrap();
            v["units"].as_array().unwrap().iter().map(|u| u["id"].as_str().unwrap().to_string()).collect()
        });
        assert!(units.contains(id), "{what}: acknowledged unit {id} of {} is lost", user(*i));
    }
}
