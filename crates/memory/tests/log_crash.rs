//! SIGKILL at an arbitrary instant never loses an acknowledged record and
//! never yields garbage: this test binary re-runs itself as a child that
//! appends and acknowledges records until the parent kills it, then checks
//! what reopening the log recovers. Each round continues the same log, so
//! recovery after a truncation is covered too.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use inferscale_memory::log::RecordLog;

const CHILD_ENV: &str = "INFERSCALE_LOG_CRASH_CHILD";
const CHILD_TEST: &str = "child_appends_until_killed";
const ROUNDS: usize = 5;
/// Per round; a healthy round takes well under a second.
const ROUND_LIMIT: Duration = Duration::from_secs(20);

/// Record `i`: 8..=4096 bytes that start with `i` and vary in length and content.
fn record(i: u64) -> Vec<u8> {
    let len = 8 + (i.wrapping_mul(2_654_435_761) % 4089) as usize;
    let mut r = i.to_le_bytes().to_vec();
    r.extend((8..len).map(|j| (i as usize).wrapping_mul(31).wrapping_add(j) as u8));
    r
}

/// The child half: does nothing unless the parent set `CHILD_ENV` to a log path.
#[test]
fn child_appends_until_killed() {
    let Some(path) = std::env::var_os(CHILD_ENV) else { return };
    let (mut log, recovery) = RecordLog::open(Path::new(&path)).unwrap();
    let start = recovery.records.len() as u64;
    let mut out = std::io::stdout().lock();
    // libtest may have printed "test name ... " without a newline.
    writeln!(out).unwrap();
    // Bounded, so an orphaned child (parent killed outright) stops by itself.
    let deadline = Instant::now() + ROUND_LIMIT;
    for i in start..start + 100_000 {
        log.append(&[&record(i)]).unwrap();
        // A write error means the parent is gone: stop.
        if writeln!(out, "ack {i}").and_then(|()| out.flush()).is_err() || Instant::now() > deadline {
            return;
        }
    }
}

/// Kills and reaps the child however the parent test ends, panics included.
struct ChildGuard(Child);

impl ChildGuard {
    fn kill(&mut self) {
        let _ = self.0.kill(); // SIGKILL on Unix; fails only if already reaped
        self.0.wait().unwrap();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The index in a child's `ack <i>` line; other lines are libtest's.
fn parse_ack(line: &str) -> Option<u64> {
    line.trim().strip_prefix("ack ").map(|n| n.parse().unwrap())
}

#[test]
fn sigkill_never_loses_acknowledged_records() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("crash.log");
    let seed = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos() as u64 | 1;
    eprintln!("log_crash seed {seed}");
    let mut rng = seed;
    let mut expected = 0u64; // records the log must hold at the start of a round
    for round in 0..ROUNDS {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let target = 50 + rng % 351;

        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", CHILD_TEST, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut child = ChildGuard(child);
        let stdout = child.0.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(i) = parse_ack(&line)
                    && tx.send(i).is_err()
                {
                    break;
                }
            }
        });

        let deadline = Instant::now() + ROUND_LIMIT;
        let mut acked = expected; // records acknowledged so far
        while acked < expected + target {
            let left = deadline.saturating_duration_since(Instant::now());
            let i = rx.recv_timeout(left).unwrap_or_else(|e| panic!("round {round}: no ack after {acked}: {e}"));
            assert_eq!(i, acked, "round {round}: acks out of order");
            acked += 1;
        }
        child.kill();
        // Acks the child printed before dying but we had not read yet count too.
        reader.join().unwrap();
        for i in rx.try_iter() {
            assert_eq!(i, acked, "round {round}: acks out of order");
            acked += 1;
        }

        if round % 2 == 1 {
            // Simulate a torn write (rare under SIGKILL alone): a frame header
            // promising more payload than follows.
            let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
            f.write_all(&[0, 1, 0, 0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
        }

        let (log, recovery) = RecordLog::open(&path).unwrap();
        let n = recovery.records.len() as u64;
        assert!(n >= acked, "round {round}: {n} records recovered, {acked} acknowledged (seed {seed})");
        assert!(n <= acked + 1, "round {round}: {n} records recovered, only {acked} acknowledged (seed {seed})");
        for (i, r) in recovery.records.iter().enumerate() {
            assert!(*r == record(i as u64), "round {round}: record {i} differs (seed {seed})");
        }
        if round % 2 == 1 {
            let (bytes, why) = (recovery.truncated_bytes, &recovery.reason);
            assert!(bytes >= 11, "round {round}: torn tail not dropped: {bytes} bytes, {why:?}");
        }
        assert_eq!(log.len_bytes(), std::fs::metadata(&path).unwrap().len());
        eprintln!("round {round}: {acked} acked, {n} recovered, {} bytes dropped", recovery.truncated_bytes);
        expected = n;
    }
}
