//! A memory opened with `lazy_users` (what a server does) lists its users
//! and reads each when first used, with the real models (SmolLM2 + MiniLM,
//! CPU): what it serves is what an eager open serves, damage is found when
//! the user is first read (that user refused, never served as empty, its
//! files removable), idle-time reading reaches every user and queues their
//! missing KV, and an unfinished ingest is still rolled back at open.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::path::Path;

use inferscale_engine::{CpuBackend, Engine};
use inferscale_memory::{Memory, MemoryError, MemoryUnit, ShardSpec, StoreOptions};

use common::{models, user_dir};

fn units(prefix: &str, n: usize) -> Vec<MemoryUnit> {
    (0..n)
        .map(|i| MemoryUnit {
            id: format!("{prefix}{i}"),
            speaker: "Mel".into(),
            text: format!("{prefix} fact {i}: the blue kayak is kept in the shed by the lake."),
            ..Default::default()
        })
        .collect()
}

fn open(dir: &Path, e: &Engine<CpuBackend>, lazy_users: bool) -> (Memory<CpuBackend>, Vec<String>) {
    let spec = ShardSpec { window: 0, fingerprint: "smollm2-lazy".into() };
    Memory::open_with(dir, spec, e, StoreOptions { lazy_users, ..StoreOptions::default() }).unwrap()
}

/// A memory of `users`, two units each stored without KV, closed; with the
/// engine that made it.
fn stored(users: &[&str]) -> (Engine<CpuBackend>, tempfile::TempDir) {
    let m = models(256);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, false);
    let mut enc = m.encoders(&mut e);
    for user in users {
        mem.ingest_deferred(user, &units(user, 2), &mut enc).unwrap();
    }
    drop(mem);
    (e, dir)
}

/// Flips a byte `at` of the way into `user`'s fact log; returns the file as written.
fn flip(dir: &Path, user: &str, at: f64) -> Vec<u8> {
    let log = user_dir(dir, user).join("facts.log");
    let mut bytes = std::fs::read(&log).unwrap();
    let i = (bytes.len() as f64 * at) as usize;
    bytes[i] ^= 0x5a;
    std::fs::write(&log, &bytes).unwrap();
    bytes
}

#[test]
fn a_lazy_memory_reads_each_user_when_first_used_and_serves_what_an_eager_one_does() {
    let m = models(512);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, false);
    let mut enc = m.encoders(&mut e);
    for user in ["ann", "bob", "cat"] {
        mem.ingest(user, &units(user, 3), &mut enc).unwrap();
    }
    // dan's KV is left for later (a replica's copy).
    mem.ingest_deferred("dan", &units("dan", 3), &mut enc).unwrap();
    // eve's ingest never finished: begun, stored, neither committed nor undone.
    mem.begin_ingest("eve", &units("eve", 2)).unwrap();
    mem.ingest("eve", &units("eve", 2), &mut enc).unwrap();
    let eager: Vec<(String, u64)> = mem.digests().map(|(u, d)| (u.to_string(), d)).collect();
    let want_cat = mem.units("cat").unwrap();
    drop(mem);

    // A flipped byte inside bob's first fact record: damage, found when read.
    let bytes = flip(dir.path(), "bob", 0.25);
    let log = user_dir(dir.path(), "bob").join("facts.log");

    let (mut mem, warnings) = open(dir.path(), &e, true);
    // eve (an unfinished ingest) is read and rolled back at open — and so
    // checks the store's model, which one user read at open must —; the
    // others wait for their first use.
    assert!(warnings.iter().any(|w| w.contains("rolled back") && w.contains("eve")), "{warnings:?}");
    assert!(!mem.has_user("eve"), "the unfinished ingest made eve; rolled back, eve is gone");
    assert!(!warnings.iter().any(|w| w.contains("bob")), "bob is not read at open: {warnings:?}");
    assert_eq!(mem.users().count(), 4);
    assert_eq!(mem.unread_users(), 4);
    assert_eq!(mem.fact_count(), 0, "facts counted are the users read so far");

    // First use reads that user alone, and serves what the eager open did.
    assert_eq!(mem.units("cat").unwrap(), want_cat);
    assert_eq!(mem.unread_users(), 3);
    let idx = mem.fact_index("cat", "cat1").unwrap();
    assert_eq!(idx, Some(1));

    // bob's damage is found when bob is first read: refused, not served as
    // empty, and never written over; the others are unaffected.
    let err = mem.units("bob").unwrap_err();
    assert!(matches!(err, MemoryError::UserDamaged(_)), "{err}");
    assert!(mem.has_user("bob"), "a damaged user is not an unknown one");
    assert_eq!(mem.damaged().map(|(u, _)| u).collect::<Vec<_>>(), ["bob"]);
    let mut enc = m.encoders(&mut e);
    let refused = mem.ingest_deferred("bob", &units("late", 1), &mut enc).unwrap_err();
    assert!(matches!(refused, MemoryError::UserDamaged(_)), "{refused}");
    assert_eq!(std::fs::read(&log).unwrap(), bytes, "the damaged log is left as it was");

    // Idle-time reading reaches the rest; dan's missing KV is queued for the
    // background encoding, which makes it.
    let mut read = 0;
    loop {
        match mem.open_some(1) {
            0 => break,
            n => read += n,
        }
    }
    assert_eq!((read, mem.unread_users()), (2, 0), "ann and dan were left to read");
    assert_eq!(mem.fact_count(), 9);
    assert!(!mem.has_kv("dan", 0).unwrap());
    let mut encoded = 0;
    while let n @ 1.. = mem.encode_pending(16, &mut enc).unwrap() {
        encoded += n;
    }
    assert_eq!(encoded, 3, "dan's three facts were encoded in the background");
    assert!((0..3).all(|i| mem.has_kv("dan", i).unwrap()));
    let lazy: Vec<(String, u64)> = mem.digests().map(|(u, d)| (u.to_string(), d)).collect();
    let healthy: Vec<(String, u64)> = eager.into_iter().filter(|(u, _)| u != "bob" && u != "eve").collect();
    assert_eq!(lazy, healthy, "every readable user, with the same units");

    // Forgetting the damaged user removes its files, read or not.
    mem.forget_user("bob").unwrap();
    assert!(!user_dir(dir.path(), "bob").exists());
    assert!(!mem.has_user("bob"));
    assert_eq!(mem.damaged().count(), 0);
}

/// A user damaged before anything read it, forgotten without a read first:
/// its files go (reading it is what finds the damage).
#[test]
fn a_damaged_user_not_yet_read_is_forgotten_with_its_files() {
    let (e, dir) = stored(&["amy", "zed"]);
    flip(dir.path(), "zed", 0.33);

    let (mut mem, _) = open(dir.path(), &e, true);
    assert_eq!(mem.unread_users(), 1, "amy is read at open (the model check), zed is not");
    assert!(mem.has_user("zed"));
    mem.forget_user("zed").unwrap();
    assert!(!user_dir(dir.path(), "zed").exists());
    assert!(matches!(mem.units("zed").unwrap_err(), MemoryError::UnknownUser(_)));
    assert_eq!(mem.users().collect::<Vec<_>>(), ["amy"]);
}

/// Out of file descriptors, a user's first read fails with that error — the
/// user is not taken for damaged — and succeeds once descriptors are back.
/// (nextest runs each test in its own process: the lowered limit is this
/// test's alone.)
#[test]
fn a_read_without_file_descriptors_is_an_error_not_damage() {
    let (e, dir) = stored(&["amy", "kim"]);
    let (mem, _) = open(dir.path(), &e, true);
    assert_eq!(mem.unread_users(), 1);

    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write the struct given, which lives here.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    // No new descriptor at all (a new one takes the lowest free number,
    // which must be below the limit).
    let low = libc::rlimit { rlim_cur: 0, rlim_max: lim.rlim_max };
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    let err = mem.units("kim").unwrap_err();
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);

    assert!(err.out_of_files(), "{err}");
    assert_eq!(mem.damaged().count(), 0, "not taken for damage");
    assert_eq!(mem.unread_users(), 1, "kim is read again on its next use");
    assert_eq!(mem.units("kim").unwrap().len(), 2);
    assert_eq!(mem.unread_users(), 0);
}
