//! Nothing acknowledged is lost silently: a flipped byte in a user's fact
//! log is damage — the user is refused, every other user served, and
//! nothing is cut away — and `repair` gets every record back; an ingest
//! that fails part way (an I/O error, a full disk) leaves nothing behind
//! and never blocks the next one.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::path::Path;

use inferscale_engine::{CpuBackend, Engine};
use inferscale_memory::{Memory, MemoryError, MemoryUnit, ShardSpec};

use common::{Models, models, user_dir};

fn open(dir: &Path, e: &Engine<CpuBackend>) -> (Memory<CpuBackend>, Vec<String>) {
    Memory::open(dir, ShardSpec { window: 1, fingerprint: "durability".into() }, e).unwrap()
}

fn units(prefix: &str, n: usize) -> Vec<MemoryUnit> {
    (0..n)
        .map(|i| MemoryUnit {
            id: format!("{prefix}{i}"),
            speaker: "Caroline".into(),
            text: format!("Note {i}: the blue notebook is in drawer {} of the desk.", i % 7),
            time: "1:56 pm on 8 May, 2023".into(),
            ..Default::default()
        })
        .collect()
}

/// Stores `n` units for `user`, facts only (their KV is not what these
/// tests are about).
fn store(mem: &mut Memory<CpuBackend>, e: &mut Engine<CpuBackend>, m: &Models, user: &str, n: usize) {
    let mut enc = m.encoders(e);
    mem.ingest_deferred(user, &units(user, n), &mut enc).unwrap();
}

fn ids(mem: &Memory<CpuBackend>, user: &str) -> Vec<String> {
    mem.units(user).unwrap().into_iter().map(|u| u.id).collect()
}

/// The repro: one byte flipped a third of the way into a user's
/// fact log (21 acknowledged units). Before, the log was cut there and 14
/// units were gone with a warning about a "torn tail".
#[test]
fn a_flipped_byte_in_a_fact_log_is_damage_and_repair_gets_every_unit_back() {
    let m = models(256);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e);
    store(&mut mem, &mut e, &m, "alice", 21);
    store(&mut mem, &mut e, &m, "bob", 3);
    let want = ids(&mem, "alice");
    drop(mem);

    let log = user_dir(dir.path(), "alice").join("facts.log");
    let mut bytes = std::fs::read(&log).unwrap();
    let at = bytes.len() / 3;
    bytes[at] ^= 0x5a;
    std::fs::write(&log, &bytes).unwrap();

    // Damage is not a torn tail: nothing is cut, the user is refused, the
    // other user served.
    let (mut mem, warnings) = open(dir.path(), &e);
    assert!(warnings.iter().any(|w| w.contains("alice") && w.contains("damaged")), "{warnings:?}");
    assert_eq!(std::fs::read(&log).unwrap(), bytes, "the damaged log is left as it was");
    for err in [mem.units("alice").unwrap_err(), mem.fact_index("alice", "alice0").unwrap_err()] {
        assert!(matches!(err, MemoryError::UserDamaged(_)), "{err}");
        assert!(!err.to_string().contains('/'), "no server path for a client: {err}");
    }
    let mut enc = m.encoders(&mut e);
    let refused = mem.ingest_deferred("alice", &units("late", 1), &mut enc).unwrap_err();
    assert!(matches!(refused, MemoryError::UserDamaged(_)), "never written over: {refused}");
    assert!(mem.has_user("alice"), "a damaged user is not an unknown one");
    assert_eq!(ids(&mem, "bob").len(), 3);
    assert_eq!(mem.damaged().map(|(u, _)| u).collect::<Vec<_>>(), ["alice"]);
    assert!(matches!(inferscale_memory::repair::repair(dir.path(), None), Err(MemoryError::Locked { .. })));
    drop(mem);

    // Repair: the one damaged byte is corrected; every unit is back.
    let report = inferscale_memory::repair::repair(dir.path(), None).unwrap();
    assert_eq!(report.len(), 1, "{report:?}");
    assert_eq!(report[0].user, "alice");
    assert!(!report[0].lost_anything(), "{report:?}");
    assert_eq!(report[0].files[0].corrected.len(), 1, "{report:?}");
    assert!(report[0].files[0].backup.as_ref().is_some_and(|b| std::fs::read(b).unwrap() == bytes));
    let (mem, warnings) = open(dir.path(), &e);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(ids(&mem, "alice"), want);
    drop(mem);
    assert_eq!(inferscale_memory::repair::repair(dir.path(), None).unwrap().len(), 0, "nothing left to mend");
}

/// Damage no correction can undo loses that record alone, and repair says
/// which unit it was (the KV segment still names it).
#[test]
fn unrecoverable_damage_costs_one_record_and_is_named() {
    let m = models(256);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e);
    let mut enc = m.encoders(&mut e);
    mem.ingest("carol", &units("carol", 6), &mut enc).unwrap();
    let want = ids(&mem, "carol");
    drop(mem);
    let log = user_dir(dir.path(), "carol").join("facts.log");
    let mut bytes = std::fs::read(&log).unwrap();
    // Wreck 30 bytes in the middle of the third record.
    let frames = frame_starts(&bytes);
    (frames[2] + 40..frames[2] + 70).for_each(|i| bytes[i] ^= 0xa5);
    std::fs::write(&log, &bytes).unwrap();
    let report = inferscale_memory::repair::repair(dir.path(), Some("carol")).unwrap();
    assert!(report[0].lost_anything());
    assert_eq!(report[0].lost_units, [want[2].clone()], "{report:?}");
    let (mem, warnings) = open(dir.path(), &e);
    assert!(warnings.is_empty(), "{warnings:?}");
    let mut rest = want.clone();
    rest.remove(2);
    assert_eq!(ids(&mem, "carol"), rest);
}

/// Where each frame of a record log starts.
fn frame_starts(bytes: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut at = 8;
    while at + 8 <= bytes.len() {
        out.push(at);
        at += 8 + u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    }
    out
}

/// Idle-time scrubbing finds a damaged KV record before a read does: the
/// record is dropped and its fact re-encoded to the same KV (f32 on the
/// CPU), and a pass over everything twice finds nothing more.
#[test]
fn the_scrub_finds_a_damaged_kv_record_before_a_read() {
    let m = models(256);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e);
    let mut enc = m.encoders(&mut e);
    mem.ingest("dan", &units("dan", 5), &mut enc).unwrap();
    store(&mut mem, &mut e, &m, "eve", 2); // no KV: nothing to check
    let before: Vec<_> = (0..5).map(|i| mem.kv("dan", i).unwrap().unwrap().to_host(&CpuBackend).unwrap()).collect();
    drop(mem);
    let kv = user_dir(dir.path(), "dan").join("kv.log");
    let mut bytes = std::fs::read(&kv).unwrap();
    let frames = frame_starts(&bytes);
    bytes[frames[3] + 200] ^= 0x08; // the third fact's record (the first is the header)
    std::fs::write(&kv, &bytes).unwrap();
    let (mut mem, warnings) = open(dir.path(), &e);
    assert!(warnings.is_empty(), "a record's checksum is not read at open: {warnings:?}");
    assert!((0..5).all(|i| mem.has_kv("dan", i).unwrap()));
    assert_eq!(mem.scrub_step(u64::MAX), 1);
    assert!(!mem.has_kv("dan", 2).unwrap(), "the damaged record is dropped");
    assert_eq!(mem.scrub_step(u64::MAX), 0, "nothing more on the next pass");
    assert_eq!(mem.cache_stats().corrupt, 1);
    let mut enc = m.encoders(&mut e);
    assert!(mem.encode_pending(10, &mut enc).unwrap() > 0, "re-encoded in idle time");
    let got = mem.fetch(&CpuBackend, "dan", &[0, 1, 2, 3, 4]).unwrap();
    assert!(got.missing.is_empty());
    drop(got);
    for (i, want) in before.iter().enumerate() {
        assert_eq!(&mem.kv("dan", i).unwrap().unwrap().to_host(&CpuBackend).unwrap(), want, "fact {i}");
    }
}
