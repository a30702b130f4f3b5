//! The fault suite: flipped bits at random offsets in each kind of file a
//! memory keeps (fact log, KV segment, pending record of an unfinished
//! ingest, `memory.json`), a full disk at random points of an ingest, an
//! update and a forget, and SIGKILL at random points of a mix of them.
//! After each fault the memory is opened again and every user checked:
//! every acknowledged unit is there as acknowledged ("intact"), or its user
//! is refused and named as damaged ("reported") — and then `repair` gets
//! it back or names what it could not — never missing while the user is
//! served ("silent loss"), never with units of a write that was not
//! acknowledged ("phantom"). The table of outcomes is printed (and written
//! to `$INFERSCALE_FAULT_TABLE` when set, for docs/durability.md).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use inferscale_engine::{CpuBackend, Engine};
use inferscale_memory::faults::set_write_budget;
use inferscale_memory::{Manifest, Memory, MemoryError, MemoryUnit, ShardSpec, UnitUpdate};

use common::{Models, models, user_dir};

fn open(dir: &Path, e: &Engine<CpuBackend>) -> (Memory<CpuBackend>, Vec<String>) {
    Memory::open(dir, ShardSpec { window: 1, fingerprint: "faults".into() }, e).unwrap()
}

fn unit(id: &str, text: &str) -> MemoryUnit {
    MemoryUnit {
        id: id.into(),
        speaker: "Caroline".into(),
        text: text.into(),
        time: "1:56 pm on 8 May, 2023".into(),
        ..Default::default()
    }
}

fn units(prefix: &str, n: usize) -> Vec<MemoryUnit> {
    (0..n)
        .map(|i| unit(&format!("{prefix}{i}"), &format!("Note {i} of {prefix}: drawer {} of the desk.", i % 7)))
        .collect()
}

/// What each user must hold: id → text.
type Expected = BTreeMap<String, BTreeMap<String, String>>;

fn expect(e: &mut Expected, user: &str, us: &[MemoryUnit]) {
    let m = e.entry(user.to_string()).or_default();
    us.iter().for_each(|u| {
        m.insert(u.id.clone(), u.text.clone());
    });
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        match entry.file_type().unwrap().is_dir() {
            true => copy_dir(&entry.path(), &target),
            false => {
                std::fs::copy(entry.path(), &target).unwrap();
            }
        }
    }
}

/// How one user came through a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Intact,
    /// Refused as damaged; then repaired whole.
    Repaired,
    /// Refused as damaged; repair named the records it could not recover.
    ReportedLost,
    /// Acknowledged units missing (or changed) while the user is served.
    SilentLoss,
    /// Units of a write that was never acknowledged are served.
    Phantom,
}

/// Every user of `expected` in the memory at `dir`: whether it is served
/// as expected, refused as damaged, or wrong.
fn check(dir: &Path, e: &Engine<CpuBackend>, expected: &Expected) -> BTreeMap<String, Outcome> {
    let (mem, _) = open(dir, e);
    expected
        .iter()
        .map(|(user, want)| {
            let outcome = match mem.units(user) {
                Err(MemoryError::UserDamaged(_)) => Outcome::ReportedLost,
                Err(MemoryError::UnknownUser(_)) if !want.is_empty() => Outcome::SilentLoss,
                Err(MemoryError::UnknownUser(_)) => Outcome::Intact,
                Err(err) => panic!("{user}: {err}"),
                Ok(have) => {
                    let have: BTreeMap<String, String> = have.into_iter().map(|u| (u.id, u.text)).collect();
                    match (want.iter().all(|(id, t)| have.get(id) == Some(t)), have.len() == want.len()) {
                        (true, true) => Outcome::Intact,
                        (true, false) => Outcome::Phantom,
                        (false, _) => Outcome::SilentLoss,
                    }
                }
            };
            (user.clone(), outcome)
        })
        .collect()
}

/// [`check`], then for users refused as damaged: `repair`, and whether
/// that got them back whole.
fn check_and_repair(dir: &Path, e: &Engine<CpuBackend>, expected: &Expected) -> Vec<Outcome> {
    let first = check(dir, e, expected);
    if !first.values().any(|&o| o == Outcome::ReportedLost) {
        return first.into_values().collect();
    }
    let report = inferscale_memory::repair::repair(dir, None).unwrap();
    let after = check(dir, e, expected);
    first
        .into_iter()
        .map(|(user, o)| match o {
            Outcome::ReportedLost => {
                let named = report.iter().find(|r| r.user == user).is_some_and(|r| r.lost_anything());
                match (after[&user], named) {
                    (Outcome::Intact, _) => Outcome::Repaired,
                    // What repair could not recover it named.
                    (Outcome::SilentLoss, true) => Outcome::ReportedLost,
                    (other, _) => other,
                }
            }
            o => o,
        })
        .collect()
}

#[derive(Default)]
struct Table(BTreeMap<(String, String), BTreeMap<Outcome, usize>>);

impl Table {
    fn add(&mut self, fault: &str, what: &str, outcomes: impl IntoIterator<Item = Outcome>) {
        let row = self.0.entry((fault.into(), what.into())).or_default();
        outcomes.into_iter().for_each(|o| *row.entry(o).or_default() += 1);
    }

    fn markdown(&self) -> String {
        let mut out = String::from(
            "| fault | where | users checked | intact | reported, repaired whole | reported, loss named | silent loss | phantom |\n|---|---|--:|--:|--:|--:|--:|--:|\n",
        );
        for ((fault, what), row) in &self.0 {
            let n = |o| row.get(&o).copied().unwrap_or(0);
            out.push_str(&format!(
                "| {fault} | {what} | {} | {} | {} | {} | {} | {} |\n",
                row.values().sum::<usize>(),
                n(Outcome::Intact),
                n(Outcome::Repaired),
                n(Outcome::ReportedLost),
                n(Outcome::SilentLoss),
                n(Outcome::Phantom)
            ));
        }
        out
    }

    fn silent(&self) -> usize {
        self.0
            .values()
            .map(|r| r.get(&Outcome::SilentLoss).copied().unwrap_or(0) + r.get(&Outcome::Phantom).copied().unwrap_or(0))
            .sum()
    }
}

/// The memory every fault starts from: three users (one with its KV
/// encoded), an update and a forget, and — with `pending` — an ingest of
/// u1 that stored two of its units and was never committed.
fn template(m: &Models, dir: &Path, pending: bool) -> Expected {
    let mut e = m.engine();
    let (mut mem, _) = open(dir, &e);
    let mut want = Expected::new();
    let mut enc = m.encoders(&mut e);
    let (u0, u1, u2) = (units("a", 6), units("b", 5), units("c", 5));
    mem.ingest("u0", &u0, &mut enc).unwrap();
    mem.ingest_deferred("u1", &u1, &mut enc).unwrap();
    mem.ingest_deferred("u2", &u2, &mut enc).unwrap();
    expect(&mut want, "u0", &u0);
    expect(&mut want, "u1", &u1);
    expect(&mut want, "u2", &u2);
    let change = UnitUpdate { text: Some("Moved to drawer 9.".into()), ..Default::default() };
    mem.update("u2", "c1", &change, &mut enc, false).unwrap();
    want.get_mut("u2").unwrap().insert("c1".into(), "Moved to drawer 9.".into());
    mem.forget_fact("u2", "c3").unwrap();
    want.get_mut("u2").unwrap().remove("c3");
    if pending {
        let late = units("late", 3);
        mem.begin_ingest("u1", &late).unwrap();
        mem.ingest_deferred("u1", &late[..2], &mut enc).unwrap();
        // Dropped here: as if the worker died before the commit.
    }
    drop(mem);
    Manifest { window: 1, model: "smollm2".into() }.write(dir).unwrap();
    want
}

#[test]
fn flipped_bits_in_every_file_kind_are_found_never_silently_lost() {
    let m = models(256);
    let e = m.engine();
    let root = tempfile::tempdir().unwrap();
    let (plain, with_pending) = (root.path().join("plain"), root.path().join("pending"));
    let want = template(&m, &plain, false);
    let want_pending = template(&m, &with_pending, true);
    let mut table = Table::default();
    let mut rng = Rng(0x5eed);
    const ROUNDS: usize = 24;
    // (file kind, template, the file in it)
    let kinds: [(&str, &Path, PathBuf, &Expected); 4] = [
        ("fact log", &plain, user_dir(&plain, "u2").join("facts.log"), &want),
        ("KV segment", &plain, user_dir(&plain, "u0").join("kv.log"), &want),
        ("pending ingest record", &with_pending, user_dir(&with_pending, "u1").join("ingest.pending"), &want_pending),
        ("memory.json", &plain, plain.join("memory.json"), &want),
    ];
    for (round, (kind, template, file, expected)) in
        kinds.iter().flat_map(|k| std::iter::repeat_n(k, ROUNDS)).enumerate()
    {
        let dir = root.path().join(format!("flip-{round}"));
        copy_dir(template, &dir);
        let target = dir.join(file.strip_prefix(template).unwrap());
        let mut bytes = std::fs::read(&target).unwrap();
        let at = rng.below(bytes.len() as u64) as usize;
        bytes[at] ^= 1 << rng.below(8);
        std::fs::write(&target, &bytes).unwrap();
        if *kind == "memory.json" {
            // Read before the model loads (the CLI's resolve): damage is an
            // error naming the file, never a different window or model.
            let outcome = match Manifest::read(&dir) {
                Err(MemoryError::Damaged { .. }) => Outcome::ReportedLost,
                Ok(Some(got)) if got == (Manifest { window: 1, model: "smollm2".into() }) => Outcome::Intact,
                other => panic!("memory.json byte {at}: {other:?}"),
            };
            table.add("bit flip", kind, [outcome]);
            continue;
        }
        let outcomes = check_and_repair(&dir, &e, expected);
        if *kind == "KV segment" {
            // KV is derived: damage costs a re-encoding, and what is injected
            // is never the damaged bytes (the CPU's f32 KV, re-encoded, equals
            // the template's bit for bit).
            let (mut mem, _) = open(&dir, &e);
            let (mut clean, _) = open(template, &e);
            for i in 0..6 {
                let fetched = mem.fetch(&CpuBackend, "u0", &[i]).unwrap();
                if !fetched.missing.is_empty() {
                    drop(fetched);
                    let mut e2 = m.engine();
                    let mut enc = m.encoders(&mut e2);
                    mem.ensure_kv("u0", &mut enc).unwrap();
                    assert!(mem.fetch(&CpuBackend, "u0", &[i]).unwrap().missing.is_empty());
                }
                drop(clean.fetch(&CpuBackend, "u0", &[i]).unwrap());
                let got = mem.kv("u0", i).unwrap().unwrap().to_host(&CpuBackend).unwrap();
                let want = clean.kv("u0", i).unwrap().unwrap().to_host(&CpuBackend).unwrap();
                assert_eq!(got, want, "round {round}, byte {at}: fact {i}'s KV differs from a clean encoding");
            }
        }
        table.add("bit flip", kind, outcomes);
    }
    // A full disk at random points of each kind of write.
    for (op, rounds) in [("ingest (3 batches)", 12), ("update", 8), ("forget", 8)] {
        let probe = root.path().join(format!("probe-{op}"));
        copy_dir(&plain, &probe);
        set_write_budget(Some(u64::MAX / 2));
        let _ = write_op(&m, &probe, op);
        let total = u64::MAX / 2 - inferscale_memory::faults::write_budget_left();
        set_write_budget(None);
        assert!(total > 0, "{op} wrote nothing");
        for r in 0..rounds {
            let dir = root.path().join(format!("full-{op}-{r}"));
            copy_dir(&plain, &dir);
            let budget = rng.below(total);
            set_write_budget(Some(budget));
            let acked = write_op(&m, &dir, op);
            set_write_budget(None);
            let mut expected = want.clone();
            if acked {
                apply(&mut expected, op);
            }
            let outcomes = check(&dir, &e, &expected);
            table.add("disk full", op, outcomes.into_values());
        }
    }
    // SIGKILL at random points of a mix of writes.
    kill_rounds(&e, root.path(), &mut table, &mut rng);
    let markdown = table.markdown();
    eprintln!("{markdown}");
    if let Ok(path) = std::env::var("INFERSCALE_FAULT_TABLE") {
        std::fs::write(path, &markdown).unwrap();
    }
    assert_eq!(table.silent(), 0, "acknowledged units lost silently, or phantom units served:\n{markdown}");
}

/// One write of `op` on the memory at `dir`: whether it was acknowledged
/// (returned Ok; for an ingest, committed). A failed ingest is undone as a
/// worker undoes it.
fn write_op(m: &Models, dir: &Path, op: &str) -> bool {
    let mut e = m.engine();
    let (mut mem, _) = open(dir, &e);
    let mut enc = m.encoders(&mut e);
    match op {
        "ingest (3 batches)" => {
            let new = units("new", 6);
            let r = mem.begin_ingest("u1", &new).and_then(|()| {
                for batch in new.chunks(2) {
                    mem.ingest("u1", batch, &mut enc)?;
                }
                mem.commit_ingest("u1")
            });
            if r.is_err() {
                let _ = mem.abort_ingest("u1");
            }
            r.is_ok()
        }
        "update" => {
            let change = UnitUpdate { text: Some("Now in the attic.".into()), ..Default::default() };
            mem.update("u2", "c0", &change, &mut enc, true).is_ok()
        }
        "forget" => mem.forget_fact("u1", "b2").is_ok(),
        other => panic!("unknown op {other}"),
    }
}

fn apply(expected: &mut Expected, op: &str) {
    match op {
        "ingest (3 batches)" => expect(expected, "u1", &units("new", 6)),
        "update" => {
            expected.get_mut("u2").unwrap().insert("c0".into(), "Now in the attic.".into());
        }
        "forget" => {
            expected.get_mut("u1").unwrap().remove("b2");
        }
        _ => unreachable!(),
    }
}

const CHILD_ENV: &str = "INFERSCALE_FAULTS_CHILD";

/// The child of [`kill_rounds`]: writes until killed, saying `start` before
/// each write and `ack` once it returned.
#[test]
fn child_writes_until_killed() {
    let Ok(dir) = std::env::var(CHILD_ENV) else { return };
    let m = models(256);
    let mut e = m.engine();
    let (mut mem, _) = open(Path::new(&dir), &e);
    let mut enc = m.encoders(&mut e);
    let mut rng = Rng(std::process::id() as u64);
    for i in 0..10_000 {
        match i % 3 {
            0 => {
                let new = units(&format!("k{i}-"), 4);
                println!("start ingest {i}");
                mem.begin_ingest("u0", &new).unwrap();
                for batch in new.chunks(2) {
                    mem.ingest("u0", batch, &mut enc).unwrap();
                }
                mem.commit_ingest("u0").unwrap();
                println!("ack ingest {i}");
            }
            1 => {
                let ids: Vec<String> = mem.units("u2").unwrap().into_iter().map(|u| u.id).collect();
                let id = &ids[rng.below(ids.len() as u64) as usize];
                println!("start update {id} {i}");
                let change = UnitUpdate { text: Some(format!("Text {i}.")), ..Default::default() };
                mem.update("u2", id, &change, &mut enc, true).unwrap();
                println!("ack update {id} {i}");
            }
            _ => {
                let ids: Vec<String> = mem.units("u0").unwrap().into_iter().map(|u| u.id).collect();
                let id = &ids[rng.below(ids.len() as u64) as usize];
                println!("start forget {id}");
                mem.forget_fact("u0", id).unwrap();
                println!("ack forget {id}");
            }
        }
    }
}

/// Kills a child writing to a copy of the template at random points, then
/// checks: every acknowledged write holds, and the write that was under
/// way is wholly there or wholly absent.
fn kill_rounds(e: &Engine<CpuBackend>, root: &Path, table: &mut Table, rng: &mut Rng) {
    let template = root.join("plain");
    for round in 0..6 {
        let dir = root.join(format!("kill-{round}"));
        copy_dir(&template, &dir);
        let (mem, _) = open(&dir, e);
        let mut expected: Expected = ["u0", "u1", "u2"].iter().map(|u| (u.to_string(), units_map(&mem, u))).collect();
        drop(mem);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_writes_until_killed", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let acks = 2 + rng.below(6);
        let (mut got, mut under_way) = (0, None::<String>);
        while got < acks {
            let line = lines.next().expect("the child ended early").unwrap();
            if let Some(at) = line.find("start ") {
                under_way = Some(line[at + 6..].to_string());
            } else if let Some(at) = line.find("ack ") {
                apply_ack(&mut expected, &line[at + 4..]);
                under_way = None;
                got += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(rng.below(40)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Whatever was acknowledged after the last line read is under way
        // too, as far as the parent knows: read what the pipe still holds.
        for line in lines.map_while(Result::ok) {
            if let Some(at) = line.find("start ") {
                under_way = Some(line[at + 6..].to_string());
            } else if let Some(at) = line.find("ack ") {
                apply_ack(&mut expected, &line[at + 4..]);
                under_way = None;
            }
        }
        let mut outcomes = check(&dir, e, &expected);
        // The write under way at the kill may have landed whole.
        if let Some(op) = under_way
            && outcomes.values().any(|&o| o != Outcome::Intact)
        {
            let mut landed = expected.clone();
            apply_ack(&mut landed, &op);
            let again = check(&dir, e, &landed);
            if again.values().all(|&o| o == Outcome::Intact) {
                outcomes = again;
            }
        }
        table.add("SIGKILL", "ingest, update and forget mixed", outcomes.into_values());
    }
}

fn units_map(mem: &Memory<CpuBackend>, user: &str) -> BTreeMap<String, String> {
    mem.units(user).unwrap().into_iter().map(|u| (u.id, u.text)).collect()
}

/// What an `ack` (or a `start`) line says happened.
fn apply_ack(expected: &mut Expected, line: &str) {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        ["ingest", i] => expect(expected, "u0", &units(&format!("k{i}-"), 4)),
        ["update", id, i] => {
            expected.get_mut("u2").unwrap().insert(id.to_string(), format!("Text {i}."));
        }
        ["forget", id] => {
            expected.get_mut("u0").unwrap().remove(*id);
        }
        other => panic!("unexpected line {other:?}"),
    }
}
