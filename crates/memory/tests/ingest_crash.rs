//! SIGKILL during ingest: a child process ingests turns one at a time and
//! prints `ack <id>` after each `Memory::ingest` returns; the parent kills it
//! mid-stream, reopens the memory, and checks that every acknowledged turn
//! is present and intact, that nothing else is half-there, and that the KV
//! it reloads (or re-encodes) is exactly what a clean encoding gives — in
//! the CPU's own f32 segments, and within the format's rounding in bf16
//! and fp8 segments.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inferscale_engine::bert::Bert;
use inferscale_engine::{CpuBackend, Engine, EngineConfig};
use inferscale_memory::{Composer, Encoders, KvFormat, Memory, MemoryUnit, Prompts, ShardSpec, StoreOptions};

const CHILD_ENV: &str = "INFERSCALE_INGEST_CRASH_CHILD";
/// The segment format the child writes (`f32`, `bf16`, `fp8`).
const FORMAT_ENV: &str = "INFERSCALE_INGEST_CRASH_FORMAT";
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
    let format = std::env::var(FORMAT_ENV).unwrap().parse().unwrap();
    let (mut mem, _) = open(Path::new(&dir), &e, format);
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

fn open(dir: &Path, e: &Engine<CpuBackend>, format: KvFormat) -> (Memory<CpuBackend>, Vec<String>) {
    Memory::open_with(dir, spec(), e, StoreOptions { format: Some(format), ..StoreOptions::default() }).unwrap()
}

#[test]
fn sigkill_during_ingest_loses_no_acknowledged_turn() {
    sigkill_rounds(KvFormat::F32, &[3, 5, 2]);
}

#[test]
fn sigkill_during_ingest_in_bf16_segments_loses_no_acknowledged_turn() {
    sigkill_rounds(KvFormat::Bf16, &[3, 2]);
}

#[test]
fn sigkill_during_ingest_in_fp8_segments_loses_no_acknowledged_turn() {
    sigkill_rounds(KvFormat::Fp8, &[3, 2]);
}

/// Kills a child writing `format` segments after each number of acks in
/// `rounds`, checking the memory after each kill.
fn sigkill_rounds(format: KvFormat, rounds: &[usize]) {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut acked: Vec<String> = Vec::new();
    for (round, &target) in rounds.iter().enumerate() {
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_ingests_until_killed", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .env(FORMAT_ENV, format.name())
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
        let (mut mem, _warnings) = open(dir.path(), &e, format);
        assert_eq!(mem.kv_format(USER).unwrap(), format);
        let facts = mem.facts(USER).unwrap().to_vec();
        let ids: Vec<&str> = facts.iter().map(|f| f.unit.id.as_str()).collect();
        assert!(ids.len() == acked.len() || ids.len() == acked.len() + 1, "round {round}: {ids:?} vs acked {acked:?}");
        assert_eq!(&ids[..acked.len()], acked.iter().map(String::as_str).collect::<Vec<_>>().as_slice());
        for (i, f) in facts.iter().enumerate() {
            assert_eq!(f.unit.text, turn(i).text, "round {round}: fact {i} intact");
        }
        // KV is either reloaded intact or re-encoded; both equal a clean
        // encoding (in f32; within the format's rounding otherwise). The
        // memory is reopened first so that the KV checked is read from disk.
        let mut enc = Encoders { engine: &mut e, embedder: &s.embedder, composer: &composer };
        mem.ensure_kv(USER, &mut enc).unwrap();
        drop(mem);
        let (mut mem, _) = open(dir.path(), &e, format);
        let last = facts.len() - 1;
        let mut context = composer.header().to_vec();
        context.extend(&facts[last - 1].tokens);
        let clean = e.encode(&context, &facts[last].tokens, context.len() as u32).unwrap();
        let got = mem.fetch(&CpuBackend, USER, &[last]).unwrap();
        assert!(got.missing.is_empty() && got.report.loaded == 1, "round {round}: read from disk");
        let (k, v) = mem.kv(USER, last).unwrap().unwrap().to_host(&CpuBackend).unwrap();
        let (ck, cv) = clean.to_host(&CpuBackend).unwrap();
        for (a, b) in k.iter().chain(&v).zip(ck.iter().chain(&cv)) {
            let scale = b.data.iter().fold(0f32, |m, x| m.max(x.abs()));
            let bound = match format {
                KvFormat::F32 => 0.0,
                KvFormat::Bf16 => scale / 256.0,
                KvFormat::Fp8 => scale / 16.0,
            };
            let diff = a.data.iter().zip(&b.data).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(a.shape == b.shape && diff <= bound, "round {round}: {format} KV of the last fact off by {diff}");
        }
        // An unacknowledged but complete fact counts as stored from now on.
        acked = ids.iter().map(|s| s.to_string()).collect();
    }
}
