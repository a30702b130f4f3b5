//! A full disk under `inferscale serve` (a 24 MiB tmpfs filled until writes
//! fail): ingests answer 507 and leave nothing behind, however many come;
//! reads go on; the worker says the disk is full; a restart with the disk
//! still full serves; once there is room, ingests store again. Before, a
//! full disk answered 500 and 400 by turns, kept each failed request's
//! units for good (the next ingest's pending list was renamed over the
//! last), and the worker would not start.
//!
//! Needs a tmpfs mount (root; a machine that allows it, as CI's does); the
//! fault suite (`crates/memory/tests/faults.rs`) covers a full disk at
//! every point of a write without one.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::io::Write;
use std::path::Path;
use std::process::Command;

use common::{Proc, http, json_call, spawn};
use serde_json::{Value, json};

struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs", at.to_str().unwrap()])
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Tmpfs(at.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn serve(mem: &Path, metrics: &str) -> Proc {
    let args = ["serve", "--listen", "127.0.0.1:0", "--memory", mem.to_str().unwrap(), "--window", "2"];
    spawn(&[&args[..], &["--worker-http-listen", metrics]].concat(), "API on ")
}

fn turns(prefix: &str, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            json!({"id": format!("{prefix}{i}"), "speaker": "Caroline",
                        "text": format!("Note {i}: the notebook is in drawer {i}."), "time": "1:56 pm on 8 May, 2023"})
        })
        .collect()
}

/// Fills the filesystem of `dir` until a write fails; returns the file.
fn fill(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let chunk = vec![0x5au8; 64 << 10];
    while f.write_all(&chunk).and_then(|()| f.sync_data()).is_ok() {}
    path
}

fn disk_full_gauge(metrics: &str) -> f64 {
    let (_, _, body) = http(metrics, "GET", "/metrics", b"");
    let text = String::from_utf8(body).unwrap();
    text.lines().find_map(|l| l.strip_prefix("inferscale_worker_disk_full ")).unwrap().trim().parse().unwrap()
}

#[test]
fn a_full_disk_refuses_writes_cleanly_and_serves_reads() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = Tmpfs::mount(&dir.path().join("disk"), "24m") else {
        eprintln!("skipped: this machine does not allow a tmpfs mount here (the fault suite covers a full disk)");
        return;
    };
    let mem = fs.0.join("mem");
    let metrics = "127.0.0.1:19481";
    let s = serve(&mem, metrics);
    let (status, v) = json_call(&s.addr, "POST", "/v1/memories", &json!({"user": "keep", "turns": turns("K", 4)}));
    assert_eq!(status, 200, "{v}");
    let filler = fill(&fs.0);
    for round in 0..4 {
        let (status, v) = json_call(&s.addr, "POST", "/v1/memories", &json!({"user": "bulk", "turns": turns("B", 4)}));
        assert_eq!(status, 507, "round {round}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("disk is full") && !msg.contains('/'), "a server condition, no server path: {msg}");
        let (status, v) = json_call(&s.addr, "GET", "/v1/memories/bulk", &Value::Null);
        assert!(status == 404 || v["total"] == 0, "round {round}: the refused ingest left units: {status} {v}");
    }
    assert_eq!(disk_full_gauge(metrics), 1.0);
    let (_, _, ready) = http(metrics, "GET", "/readyz", b"");
    assert!(String::from_utf8_lossy(&ready).contains("disk is full"));
    // Reads go on.
    let chat = json!({"model": "smollm2", "messages": [{"role": "user", "content": "Where is the notebook?"}],
                      "max_tokens": 4, "temperature": 0, "user": "keep", "memory": {"mode": "kv", "k": 2}});
    let (status, v) = json_call(&s.addr, "POST", "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{v}");
    drop(s); // SIGKILL, the disk still full
    let s = serve(&mem, metrics);
    let (status, v) = json_call(&s.addr, "GET", "/v1/memories/keep", &Value::Null);
    assert_eq!((status, v["total"].as_u64()), (200, Some(4)), "{v}");
    let (status, _) = json_call(&s.addr, "GET", "/v1/memories/bulk", &Value::Null);
    assert_eq!(status, 404, "nothing of the refused ingests after a restart either");
    let (status, v) = json_call(&s.addr, "POST", "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{v}");
    // Room again: ingests store again, all of them.
    std::fs::remove_file(&filler).unwrap();
    let (status, v) = json_call(&s.addr, "POST", "/v1/memories", &json!({"user": "bulk", "turns": turns("B", 4)}));
    assert_eq!((status, v["added"].as_u64()), (200, Some(4)), "{v}");
    assert_eq!(disk_full_gauge(metrics), 0.0);
}
