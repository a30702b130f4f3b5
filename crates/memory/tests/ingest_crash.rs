//! SIGKILL during ingest: a child process ingests turns one at a time and
//! prints `ack <id>` after each `Memory::ingest` returns; the parent kills it
//! mid-stream, reopens the memory, and checks that every acknowledged turn
//! is present and intact, that nothing else is half-there, and that the KV
//! it reloads (or re-encodes) is exactly what a clean encoding gives.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inferscale_engine::bert::Bert;
use inferscale_engine::{CpuBackend, Engine, EngineConfig};
use inferscale_memory::{Composer, Encoders, Memory, MemoryUnit, Prompts, ShardSpec};

const CHILD_ENV: &str = "INFERSCALE_INGEST_CRASH_CHILD";
const USER: &str = "crash-user";

fn turn(i: usize) -> MemoryUnit {
    MemoryUnit {
        id: format!("D{i}"),
        speaker: if i.is_multiple_of(2) { "Caroline" } else { "Melanie" }.into(),
        text: format!("Turn number {i}: I visited place {} and met friend {}.", i * 7 % 13, i * 5 % 11),
        time: "1:56 pm on 8 May, 2023".into(),
        source_turn: String::new(),
        ..Default::default()
    }
}

struct Stack {
    files: inferscale_model::ModelFiles,
    embedder: Bert<CpuBackend>,
}

fn stack() -> Stack {
    Stack {
        files: inferscale_model::open("smollm2").unwrap(),
        embedder: Bert::load(&CpuBackend, inferscale_model::encoder::open("minilm").unwrap()).unwrap(),
    }
}

fn engine(s: &Stack) -> Engine<CpuBackend> {
    Engine::new(CpuBackend, &s.files, EngineConfig { kv_blocks: 256, max_batch_tokens: 512 }).unwrap()
}

fn spec() -> ShardSpec {
    ShardSpec { window: 1, fingerprint: "crash-test".into() }
}

/// The child: ingest turns one by one until killed (or 60 s pass).
#[test]
fn child_ingests_until_killed() {
    let Ok(dir) = std::env::var(CHILD_ENV) else { return };
    let s = stack();
    let mut e = engine(&s);
    let composer = Composer::new(&s.files, &Prompts::default()).unwrap();
    let (mut mem, _) = Memory::open(Path::new(&dir), spec(), &e).unwrap();
    let start = mem.facts(USER).map_or(0, <[_]>::len);
    let mut enc = Encoders { engine: &mut e, embedder: &s.embedder, composer: &composer };
    let t0 = Instant::now();
    for i in start..start + 500 {
        if t0.elapsed() > Duration::from_secs(60) {
            break;
        }
        mem.ingest(USER, &[turn(i)], &mut enc).unwrap();
        println!("ack D{i}");
    }
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn sigkill_during_ingest_loses_no_acknowledged_turn() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut acked: Vec<String> = Vec::new();
    for (round, target) in [3usize, 5, 2].into_iter().enumerate() {
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_ingests_until_killed", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut child = KillOnDrop(child);
        let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
        let mut got = 0;
        while got < target {
            let line = lines.next().expect("child ended early").unwrap();
            // libtest may print the test's name on the same line before our output.
            if let Some(id) = line.find("ack ").map(|at| &line[at + 4..]) {
                acked.push(id.to_string());
                got += 1;
            }
        }
        child.0.kill().unwrap(); // SIGKILL, mid-way through the next ingest
        child.0.wait().unwrap();
        drop(child);

        let s = stack();
        let mut e = engine(&s);
        let composer = Composer::new(&s.files, &Prompts::default()).unwrap();
        let (mut mem, _warnings) = Memory::open(dir.path(), spec(), &e).unwrap();
        let facts = mem.facts(USER).unwrap().to_vec();
        let ids: Vec<&str> = facts.iter().map(|f| f.unit.id.as_str()).collect();
        assert!(ids.len() == acked.len() || ids.len() == acked.len() + 1, "round {round}: {ids:?} vs acked {acked:?}");
        assert_eq!(&ids[..acked.len()], acked.iter().map(String::as_str).collect::<Vec<_>>().as_slice());
        for (i, f) in facts.iter().enumerate() {
            assert_eq!(f.unit.text, turn(i).text, "round {round}: fact {i} intact");
        }
        // KV is either reloaded intact or re-encoded; both equal a clean encoding.
        let mut enc = Encoders { engine: &mut e, embedder: &s.embedder, composer: &composer };
        mem.ensure_kv(USER, &mut enc).unwrap();
        let last = facts.len() - 1;
        let mut context = composer.header().to_vec();
        context.extend(&facts[last - 1].tokens);
        let clean = e.encode(&context, &facts[last].tokens, context.len() as u32).unwrap();
        assert!(mem.fetch(&CpuBackend, USER, &[last]).unwrap().missing.is_empty());
        assert_eq!(
            mem.kv(USER, last).unwrap().unwrap().to_host(&CpuBackend).unwrap(),
            clean.to_host(&CpuBackend).unwrap(),
            "round {round}: KV of the last fact"
        );
        // An unacknowledged but complete fact counts as stored from now on.
        acked = ids.iter().map(|s| s.to_string()).collect();
    }
}
