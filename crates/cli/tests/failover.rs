//! Failover under a mixed read/write load, on loopback with real processes
//! (etcd, one router, two SmolLM2 workers on the CPU) and the default
//! 30 s lease: a worker killed with SIGKILL is fenced by the leader within
//! seconds, so its users' writes go on without waiting for its lease; a
//! worker paused long enough to be fenced comes back as a joining worker
//! and never serves the copy that missed writes meanwhile.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::{
    Secured, ask_http, assert_kept, cluster_router, cluster_worker, metric, replicas_in_step, settled, turns_of, user,
    wait_until,
};
use common::http;
use serde_json::json;

const USERS: usize = 4;
/// Per user, how much longer than usual a client may wait for a write (a
/// read) to succeed across the kill: its longest wait (see
/// [`unavailable`]) less the median latency before the kill. On two CPU
/// cores a request takes ~0.5–2 s by itself; that is service time, not
/// unavailability, and is not counted (the raw waits are printed too).
const WRITE_BOUND: Duration = Duration::from_secs(5);
const READ_BOUND: Duration = Duration::from_secs(2);
/// The same, for reads and writes, when the home hangs (SIGSTOP) instead:
/// its health probe must time out (2 s) before the fence clock (2 s)
/// starts, and calls in flight to it are abandoned when it is fenced. The
/// pause lasts 8 s past the fence, so a call left hanging would wait far
/// longer than this.
const PAUSED_BOUND: Duration = Duration::from_secs(7);
/// Each reader's pause between requests, and each writer's: a load two
/// CPU cores serve on one worker with room to spare (a write encodes KV on
/// the home and, in the background, on the replica: most of the CPU), so
/// that the waits measured are failover, not queueing.
const THINK: Duration = Duration::from_millis(300);
const WRITE_THINK: Duration = Duration::from_secs(2);

/// A request's start and end, and whether it succeeded.
type Outcome = (Instant, Instant, bool);

/// One closed-loop writer and one closed-loop reader per user, through
/// `router`, until stopped. Writers add one turn per request and keep the
/// ids that were acknowledged.
struct MixedLoad {
    stop: Arc<AtomicBool>,
    writes: Arc<Mutex<BTreeMap<usize, Vec<Outcome>>>>,
    reads: Arc<Mutex<BTreeMap<usize, Vec<Outcome>>>>,
    acked: Arc<Mutex<Vec<(usize, String)>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl MixedLoad {
    fn start(router: &str, tag: &'static str) -> MixedLoad {
        let stop = Arc::new(AtomicBool::new(false));
        let writes: Arc<Mutex<BTreeMap<usize, Vec<Outcome>>>> = Arc::default();
        let reads: Arc<Mutex<BTreeMap<usize, Vec<Outcome>>>> = Arc::default();
        let acked: Arc<Mutex<Vec<(usize, String)>>> = Arc::default();
        let mut threads = Vec::new();
        for i in 0..USERS {
            let (halt, writes, acked, r) = (stop.clone(), writes.clone(), acked.clone(), router.to_string());
            threads.push(std::thread::spawn(move || {
                let mut n = 0;
                while !halt.load(Ordering::SeqCst) {
                    let id = format!("{tag}{n}");
                    let text = format!("Note {n}: the bus was late again.");
                    let body = json!({"user": user(i), "turns": [{"id": id, "speaker": "Sam", "text": text, "time": "9 May 2023"}]});
                    let t0 = Instant::now();
                    let (s, _, b) = http(&r, "POST", "/v1/memories", body.to_string().as_bytes());
                    if s == 200 {
                        acked.lock().unwrap().push((i, id));
                    } else {
                        eprintln!("write of {} failed: {s} {}", user(i), String::from_utf8_lossy(&b));
                    }
                    writes.lock().unwrap().entry(i).or_default().push((t0, Instant::now(), s == 200));
                    n += 1;
                    std::thread::sleep(WRITE_THINK);
                }
            }));
            let (halt, reads, r) = (stop.clone(), reads.clone(), router.to_string());
            threads.push(std::thread::spawn(move || {
                while !halt.load(Ordering::SeqCst) {
                    let t0 = Instant::now();
                    let ok =
                        ask_http(&r, &user(i), 1).inspect_err(|e| eprintln!("read of {} failed: {e}", user(i))).is_ok();
                    reads.lock().unwrap().entry(i).or_default().push((t0, Instant::now(), ok));
                    std::thread::sleep(THINK);
                }
            }));
        }
        MixedLoad { stop, writes, reads, acked, threads }
    }

    /// Stops the load; returns (writes, reads, acknowledged ids).
    #[allow(clippy::type_complexity)]
    fn finish(self) -> (BTreeMap<usize, Vec<Outcome>>, BTreeMap<usize, Vec<Outcome>>, Vec<(usize, String)>) {
        self.stop.store(true, Ordering::SeqCst);
        self.threads.into_iter().for_each(|t| t.join().unwrap());
        let take = |m: &Mutex<BTreeMap<usize, Vec<Outcome>>>| std::mem::take(&mut *m.lock().unwrap());
        (take(&self.writes), take(&self.reads), std::mem::take(&mut *self.acked.lock().unwrap()))
    }
}

/// Per user, the longest a client waited for a success around the fault:
/// from the start of its first attempt after its previous success (failed
/// attempts are retried at once, after the think time) to the end of the
/// success, over the attempts that ended after `from`. A request the
/// router held and retried during the failover counts whole, from its
/// start (before the kill, for those in flight then); an attempt still
/// unanswered at `until` counts to `until`.
fn unavailable(outcomes: &BTreeMap<usize, Vec<Outcome>>, from: Instant, until: Instant) -> BTreeMap<usize, Duration> {
    longest_waits(outcomes, from, until).into_iter().map(|(i, (_, wait))| (i, wait)).collect()
}

/// [`unavailable`]'s waits with when each began, for the log: which
/// phase of a failover (the fence, the retry, the move back) a long wait
/// fell in.
fn longest_waits(
    outcomes: &BTreeMap<usize, Vec<Outcome>>,
    from: Instant,
    until: Instant,
) -> BTreeMap<usize, (Instant, Duration)> {
    (0..USERS)
        .map(|i| {
            let mut worst = (from, Duration::ZERO);
            let mut wanting: Option<Instant> = None;
            for &(start, end, ok) in outcomes.get(&i).map(Vec::as_slice).unwrap_or_default() {
                let since = *wanting.get_or_insert(start);
                if ok {
                    if end > from && end - since > worst.1 {
                        worst = (since, end - since);
                    }
                    wanting = None;
                }
            }
            if let Some(since) = wanting
                && until.saturating_duration_since(since) > worst.1
            {
                worst = (since, until.saturating_duration_since(since));
            }
            (i, worst)
        })
        .collect()
}

/// One line per user: its longest wait, from and to, in seconds after `t0`
/// (negative: begun before it).
fn print_waits(what: &str, outcomes: &BTreeMap<usize, Vec<Outcome>>, t0: Instant, until: Instant) {
    let at = |t: Instant| {
        if t >= t0 { (t - t0).as_secs_f64() } else { -(t0 - t).as_secs_f64() }
    };
    for (i, (since, wait)) in longest_waits(outcomes, t0, until) {
        eprintln!(
            "  {} longest {what} wait: {:.2} s, from {:+.2} s to {:+.2} s",
            user(i),
            wait.as_secs_f64(),
            at(since),
            at(since + wait)
        );
    }
}

fn failed(outcomes: &BTreeMap<usize, Vec<Outcome>>) -> usize {
    outcomes.values().flatten().filter(|(_, _, ok)| !ok).count()
}

/// The median latency of the successful requests that ended before `t`.
fn p50_before(outcomes: &BTreeMap<usize, Vec<Outcome>>, t: Instant) -> Duration {
    let mut l: Vec<Duration> =
        outcomes.values().flatten().filter(|(_, e, ok)| *ok && *e < t).map(|(s, e, _)| *e - *s).collect();
    l.sort();
    l.get(l.len() / 2).copied().unwrap_or_default()
}

/// Each wait less the usual latency.
fn over(waits: &BTreeMap<usize, Duration>, usual: Duration) -> BTreeMap<usize, Duration> {
    waits.iter().map(|(&i, &w)| (i, w.saturating_sub(usual))).collect()
}

fn worst(d: &BTreeMap<usize, Duration>) -> Duration {
    d.values().max().copied().unwrap_or_default()
}

/// The worker each user's reads go to now.
fn homes(router: &str) -> BTreeMap<usize, String> {
    (0..USERS).map(|i| (i, ask_http(router, &user(i), 1).unwrap().1)).collect()
}

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig} {pid}");
}

#[test]
fn writes_fail_over_in_seconds_and_a_fenced_worker_never_serves_its_stale_copy() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // etcd over TLS with client certificates, workers over mutual TLS.
    let c = rt.block_on(Secured::start());
    let dir = tempfile::tempdir().unwrap();
    // The default lease TTL (30 s): every failover below must come from
    // fencing, well before the lease could expire.
    let mut workers: Vec<Option<common::Proc>> =
        (0..2).map(|i| Some(cluster_worker(&dir.path().join(format!("w{i}")), &c, &[]))).collect();
    let router = cluster_router("router-1", &c, &[]);
    let r = router.addr.as_str();
    wait_until("two workers are active", Duration::from_secs(60), || settled(&[r], 2));
    for i in 0..USERS {
        let (s, _, b) = http(r, "POST", "/v1/memories", turns_of(i).to_string().as_bytes());
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    }

    // 1. SIGKILL the home of about half the users under load.
    let before = homes(r);
    let mut by_worker: BTreeMap<&str, usize> = BTreeMap::new();
    before.values().for_each(|w| *by_worker.entry(w.as_str()).or_default() += 1);
    let (victim, n) = by_worker.iter().max_by_key(|(_, n)| **n).map(|(w, n)| (w.to_string(), *n)).unwrap();
    let load = MixedLoad::start(r, "K");
    std::thread::sleep(Duration::from_secs(5));
    let slot = workers.iter().position(|w| w.as_ref().is_some_and(|w| w.addr == victim)).unwrap();
    let mut dead = workers[slot].take().unwrap();
    dead.child.kill().unwrap();
    let killed = Instant::now();
    let _ = dead.child.wait();
    std::thread::sleep(Duration::from_secs(12));
    let (writes, reads, acked) = load.finish();
    let end = Instant::now();
    let (w_wait, r_wait) = (unavailable(&writes, killed, end), unavailable(&reads, killed, end));
    let (w_usual, r_usual) = (p50_before(&writes, killed), p50_before(&reads, killed));
    let (w_gap, r_gap) = (over(&w_wait, w_usual), over(&r_wait, r_usual));
    eprintln!("before the kill: p50 write {:.2} s, p50 read {:.2} s", w_usual.as_secs_f64(), r_usual.as_secs_f64());
    eprintln!(
        "killed {victim}, home of {n} of {USERS} users; per user, the longest wait for a success (over the usual):"
    );
    for i in 0..USERS {
        eprintln!(
            "  {} (home {}): writes {:.2} s ({:.2} s), reads {:.2} s ({:.2} s)",
            user(i),
            if before[&i] == victim { "killed" } else { "alive" },
            w_wait[&i].as_secs_f64(),
            w_gap[&i].as_secs_f64(),
            r_wait[&i].as_secs_f64(),
            r_gap[&i].as_secs_f64()
        );
    }
    eprintln!(
        "{} writes ({} failed), {} reads ({} failed) in {:.1} s",
        writes.values().flatten().count(),
        failed(&writes),
        reads.values().flatten().count(),
        failed(&reads),
        (end - killed).as_secs_f64() + 5.0
    );
    print_waits("write", &writes, killed, end);
    print_waits("read", &reads, killed, end);
    assert_eq!(metric(r, "inferscale_cluster_fenced_total"), 1.0, "the killed worker is fenced, not expired");
    assert!(worst(&w_gap) <= WRITE_BOUND, "write unavailability per user {w_gap:?} exceeds {WRITE_BOUND:?}");
    assert!(worst(&r_gap) <= READ_BOUND, "read unavailability per user {r_gap:?} exceeds {READ_BOUND:?}");
    assert_kept(r, &acked, "after the kill");
    let mut all_acked = acked;

    // 2. The killed worker returns with its memory as it was at the kill;
    // it joins and takes its users back with their whole memory.
    workers[slot] = Some(cluster_worker(&dir.path().join(format!("w{slot}")), &c, &[]));
    wait_until("the returning worker is active and settled", Duration::from_secs(240), || settled(&[r], 2));
    // Where it became a replica, its stale copy (missing the writes made
    // since the kill) is replaced by its home's.
    replicas_in_step(r, Duration::from_secs(120));
    assert_kept(r, &all_acked, "after the return");

    // 3. SIGSTOP the home of the most users (alive, but answering nothing)
    // under load: it is fenced as a dead one would be, and its users are
    // served by their replicas — which must hold every acknowledged write.
    // Resumed, it finds its lease revoked, registers again as joining, and
    // its copy, which missed the writes made meanwhile, is replaced before
    // it serves anyone: every acknowledged write is read back through the
    // router.
    let mut by_worker: BTreeMap<String, usize> = BTreeMap::new();
    homes(r).into_values().for_each(|w| *by_worker.entry(w).or_default() += 1);
    let busiest = by_worker.iter().max_by_key(|(_, n)| **n).map(|(w, _)| w.clone()).unwrap();
    let load = MixedLoad::start(r, "P");
    std::thread::sleep(Duration::from_secs(2));
    let paused = workers.iter().flatten().find(|w| w.addr == busiest).unwrap();
    signal(paused.child.id(), "-STOP");
    let stopped = Instant::now();
    wait_until("the paused worker is fenced", Duration::from_secs(20), || {
        metric(r, "inferscale_cluster_fenced_total") == 2.0
    });
    let fenced_after = stopped.elapsed();
    // Its users, read from their replicas, have everything acknowledged.
    let mut so_far = all_acked.clone();
    so_far.extend(load.acked.lock().unwrap().iter().cloned());
    assert_kept(r, &so_far, "read from the replicas while the home is paused");
    std::thread::sleep(Duration::from_secs(8));
    signal(paused.child.id(), "-CONT");
    let resumed = stopped.elapsed();
    let took = wait_until("the resumed worker rejoined and settled", Duration::from_secs(240), || settled(&[r], 2));
    replicas_in_step(r, Duration::from_secs(120));
    let (writes, reads, acked) = load.finish();
    let end = Instant::now();
    let w_gap = over(&unavailable(&writes, stopped, end), w_usual);
    let r_gap = over(&unavailable(&reads, stopped, end), r_usual);
    eprintln!(
        "paused worker fenced {:.1} s after SIGSTOP; rejoined and settled {:.1} s after SIGCONT; {} writes ({} failed), \
         {} reads ({} failed); longest wait over the usual: writes {:.2} s, reads {:.2} s",
        fenced_after.as_secs_f64(),
        took.as_secs_f64(),
        writes.values().flatten().count(),
        failed(&writes),
        reads.values().flatten().count(),
        failed(&reads),
        worst(&w_gap).as_secs_f64(),
        worst(&r_gap).as_secs_f64(),
    );
    eprintln!(
        "in seconds after SIGSTOP: fenced {:+.2}, SIGCONT {:+.2}, settled {:+.2}",
        fenced_after.as_secs_f64(),
        resumed.as_secs_f64(),
        (resumed + took).as_secs_f64()
    );
    print_waits("write", &writes, stopped, end);
    print_waits("read", &reads, stopped, end);
    assert!(worst(&w_gap) <= PAUSED_BOUND, "writes waited {w_gap:?} on a paused home");
    assert!(worst(&r_gap) <= PAUSED_BOUND, "reads waited {r_gap:?} on a paused home");
    assert!(!acked.is_empty());
    all_acked.extend(acked);
    assert_kept(r, &all_acked, "after the paused worker rejoined");
    drop(c);
}
