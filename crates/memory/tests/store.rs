//! The tiered KV store with the real models (SmolLM2 + MiniLM, CPU): a
//! memory opens without reading KV, loads a fact's KV from its segment when
//! a request needs it (bit for bit in f32, within the format's precision in
//! bf16 and fp8), evicts the least recently used past its budget but never
//! a pinned fact, finds a corrupt record when it reads it (and re-encodes
//! that fact), reads segments of every format whatever format it writes,
//! and — with an emulated host tier — moves facts between the tiers
//! (promotions, demotions) without evicting a pinned one.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::path::Path;

use inferscale_engine::{CpuBackend, Engine};
use inferscale_memory::{Budgets, KvFormat, Memory, MemoryUnit, ShardSpec, StoreOptions, Tier};
use inferscale_model::HostTensor;

use common::{Models, models, user_dir};

fn turns(prefix: &str, n: usize) -> Vec<MemoryUnit> {
    (0..n)
        .map(|i| MemoryUnit {
            id: format!("{prefix}{i}"),
            speaker: "Caroline".into(),
            text: format!("On day {i} I walked my grey cat Miso along the river."),
            time: "1:56 pm on 8 May, 2023".into(),
            ..Default::default()
        })
        .collect()
}

fn open(dir: &Path, e: &Engine<CpuBackend>, options: StoreOptions) -> (Memory<CpuBackend>, Vec<String>) {
    Memory::open_with(dir, ShardSpec { window: 1, fingerprint: "smollm2-store".into() }, e, options).unwrap()
}

fn ingest(mem: &mut Memory<CpuBackend>, e: &mut Engine<CpuBackend>, m: &Models, user: &str, n: usize) {
    let mut enc = m.encoders(e);
    mem.ingest(user, &turns(user, n), &mut enc).unwrap();
}

type HostKv = (Vec<HostTensor>, Vec<HostTensor>);

/// Fact `i`'s KV, fetched (and so cached) if it is not.
fn kv(mem: &mut Memory<CpuBackend>, user: &str, i: usize) -> HostKv {
    let got = mem.fetch(&CpuBackend, user, &[i]).unwrap();
    assert!(got.missing.is_empty(), "fact {i} of {user} has no KV");
    mem.kv(user, i).unwrap().unwrap().to_host(&CpuBackend).unwrap()
}

fn max_abs_diff(a: &HostKv, b: &HostKv) -> (f32, f32) {
    let all = |x: &HostKv| x.0.iter().chain(&x.1).flat_map(|t| t.data.clone()).collect::<Vec<f32>>();
    let (a, b) = (all(a), all(b));
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    (diff, a.iter().map(|x| x.abs()).fold(0f32, f32::max))
}

#[test]
fn a_memory_opens_without_its_kv_and_loads_a_fact_when_needed() {
    let m = models(512);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, StoreOptions::default());
    ingest(&mut mem, &mut e, &m, "alice", 6);
    let encoded: Vec<HostKv> = (0..6).map(|i| kv(&mut mem, "alice", i)).collect();
    let per_fact = mem.footprint().kv_resident_bytes / 6;
    drop(mem);

    // Damage the tensors of a record in the middle of the segment. Only the
    // tail's checksum is read at open: the damage is found when read.
    let user_dir = std::fs::read_dir(dir.path().join("users")).unwrap().next().unwrap().unwrap().path();
    let kv_path = user_dir.join("kv.log");
    let mut bytes = std::fs::read(&kv_path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&kv_path, &bytes).unwrap();

    // A device budget of a bit more than two facts.
    let budgets = Budgets { device: Some(per_fact * 5 / 2), host: None };
    let (mut mem, warnings) = open(dir.path(), &e, StoreOptions { format: None, budgets, ..StoreOptions::default() });
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(mem.footprint().kv_resident_bytes, 0, "no KV is read at open");
    assert!((0..6).all(|i| mem.has_kv("alice", i).unwrap()), "every record is indexed");

    // The damaged record fails its check on the first read: that fact comes
    // back as missing, is counted, and is re-encoded to the same KV.
    let got = mem.fetch(&CpuBackend, "alice", &[0, 1, 2, 3, 4, 5]).unwrap();
    assert_eq!(got.missing.len(), 1, "one record was damaged");
    let damaged = got.missing[0];
    assert_eq!(mem.cache_stats().corrupt, 1);
    assert!(!mem.has_kv("alice", damaged).unwrap());
    // Six facts pinned at once: the budget is exceeded rather than a pinned
    // fact evicted.
    assert!(mem.footprint().kv_resident_bytes > per_fact * 5 / 2);
    assert!(mem.cache_stats().over_budget > 0);
    drop(got);
    let mut enc = m.encoders(&mut e);
    assert!(mem.ensure_kv("alice", &mut enc).unwrap() > 0);

    // Loads are bit for bit what was encoded (f32 segments on the CPU), and
    // with nothing pinned the device holds at most the budget, the most
    // recently used facts.
    for (i, want) in encoded.iter().enumerate() {
        assert_eq!(&kv(&mut mem, "alice", i), want, "fact {i}");
        assert!(mem.footprint().kv_resident_bytes <= per_fact * 5 / 2);
    }
    assert_eq!(mem.tier("alice", 5).unwrap(), Some(Tier::Device));
    assert_eq!(mem.tier("alice", 4).unwrap(), Some(Tier::Device));
    assert_eq!(mem.tier("alice", 0).unwrap(), None, "the least recently used left");
    let stats = mem.cache_stats();
    assert!(stats.evictions[0] >= 3 && stats.misses >= 5, "{stats:?}");
    // A hit loads nothing.
    let got = mem.fetch(&CpuBackend, "alice", &[5]).unwrap();
    assert_eq!((got.report.device_hits, got.report.loaded), (1, 0));
}

#[test]
fn every_format_is_read_whatever_format_new_segments_get() {
    let m = models(512);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let with = |format| StoreOptions { format: Some(format), ..StoreOptions::default() };

    // f32, the CPU's own values: the reference.
    let (mut mem, _) = open(dir.path(), &e, with(KvFormat::F32));
    ingest(&mut mem, &mut e, &m, "f32", 3);
    let exact: Vec<HostKv> = (0..3).map(|i| kv(&mut mem, "f32", i)).collect();
    drop(mem);

    // bf16 and fp8 segments beside it, in one memory directory.
    for (format, user) in [(KvFormat::Bf16, "bf16"), (KvFormat::Fp8, "fp8")] {
        let (mut mem, _) = open(dir.path(), &e, with(format));
        ingest(&mut mem, &mut e, &m, user, 3);
        assert_eq!(mem.kv_format(user).unwrap(), format);
        assert_eq!(mem.kv_format("f32").unwrap(), KvFormat::F32, "a segment keeps its format");
        // What is cached right after encoding is what a load reads back.
        let fresh: Vec<HostKv> =
            (0..3).map(|i| mem.kv(user, i).unwrap().unwrap().to_host(&CpuBackend).unwrap()).collect();
        drop(mem);
        let (mut mem, warnings) = open(dir.path(), &e, with(KvFormat::F32));
        assert!(warnings.is_empty(), "{warnings:?}");
        for i in 0..3 {
            let loaded = kv(&mut mem, user, i);
            assert_eq!(loaded, fresh[i], "{format} fact {i}: cached = loaded");
            // Same text, same window: the same KV as the f32 user's, within
            // the format's rounding (bf16: 2⁻⁸ relative; fp8: 2⁻⁴ of the
            // head's largest value, bounded here by the tensor's).
            let (diff, scale) = max_abs_diff(&loaded, &exact[i]);
            let bound = match format {
                KvFormat::Bf16 => scale / 256.0,
                _ => scale / 16.0,
            };
            assert!(diff > 0.0 && diff <= bound, "{format} fact {i}: max diff {diff}, bound {bound}");
        }
        assert_eq!(kv(&mut mem, "f32", 0), exact[0]);
    }
    // Segment sizes follow the format.
    let size = |user: &str| {
        let d = user_dir(dir.path(), user);
        std::fs::metadata(d.join("kv.log")).unwrap().len() as f64
    };
    let (f32_bytes, bf16_bytes, fp8_bytes) = (size("f32"), size("bf16"), size("fp8"));
    assert!((bf16_bytes / f32_bytes - 0.5).abs() < 0.02, "{bf16_bytes} vs {f32_bytes}");
    assert!((fp8_bytes / f32_bytes - 0.25).abs() < 0.02, "{fp8_bytes} vs {f32_bytes}");
}

#[test]
fn cold_facts_are_read_off_the_engine_thread_and_pasted_meanwhile() {
    use inferscale_memory::{Facts, Mode, Recall, prepare};
    use inferscale_types::Blend;
    let m = models(512);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, StoreOptions::default());
    ingest(&mut mem, &mut e, &m, "ana", 4);
    let encoded: Vec<HostKv> = (0..4).map(|i| kv(&mut mem, "ana", i)).collect();
    drop(mem);

    let (mut mem, _) = open(dir.path(), &e, StoreOptions::default());
    let got = mem.fetch_cached("ana", &[3, 1]).unwrap();
    assert_eq!((got.cold.as_slice(), got.report.loaded), (&[3, 1][..], 0), "nothing read");
    let jobs = mem.read_jobs("ana", &got.cold).unwrap();
    assert_eq!(jobs.len(), 2);
    assert!(mem.read_jobs("ana", &[3]).unwrap().is_empty(), "a fact being read is not read twice");

    // Meanwhile the request is laid out with those facts pasted: with all
    // of them pasted, kv mode is prompt mode token for token.
    let header = {
        let mut h = e.new_sequence(m.composer.header().to_vec()).unwrap();
        e.prefill(&mut h).unwrap();
        h
    };
    let question = m.composer.question("What is the cat called?").unwrap();
    let pasted = prepare(
        &mut e,
        &mem,
        &header,
        Facts { user: "ana", order: &[3, 1], paste: &[3, 1], recall: Recall::of(Mode::Kv) },
        &question,
    )
    .unwrap();
    let prompt = prepare(
        &mut e,
        &mem,
        &header,
        Facts { user: "ana", order: &[3, 1], paste: &[], recall: Recall::of(Mode::Prompt) },
        &question,
    )
    .unwrap();
    assert_eq!(pasted.seq.tokens(), prompt.seq.tokens());
    assert_eq!((pasted.fact_ids, pasted.pasted_tokens), (prompt.fact_ids, prompt.memory_tokens));
    assert!(
        prepare(
            &mut e,
            &mem,
            &header,
            Facts {
                user: "ana",
                order: &[3],
                paste: &[3],
                recall: Recall { mode: Mode::Blend, blend: Blend { ratio: 0.5, ..Blend::default() } }
            },
            &question
        )
        .is_err()
    );

    // The reads run anywhere; what they read is cached bit for bit.
    let done: Vec<_> = std::thread::spawn(move || jobs.into_iter().map(|j| j.run()).collect()).join().unwrap();
    for d in done {
        assert!(mem.complete_read(&CpuBackend, d).unwrap());
    }
    assert_eq!(mem.tier("ana", 3).unwrap(), Some(Tier::Device));
    assert_eq!(kv(&mut mem, "ana", 1), encoded[1]);

    // A read whose fact's KV was dropped meanwhile (ana1 forgotten: ana2's
    // window held it) is dropped, never cached.
    let got = mem.fetch_cached("ana", &[0, 2]).unwrap();
    assert!(got.pinned.is_empty() && got.cold == [0, 2]);
    let done: Vec<_> = mem.read_jobs("ana", &got.cold).unwrap().into_iter().map(|j| j.run()).collect();
    drop(got);
    mem.forget("ana", Some("ana1")).unwrap();
    let cached: Vec<bool> = done.into_iter().map(|d| mem.complete_read(&CpuBackend, d).unwrap()).collect();
    assert!(!cached[1], "ana2's KV was made with the forgotten text");
    let ana2 = mem.fact_index("ana", "ana2").unwrap().unwrap();
    assert!(mem.tier("ana", ana2).unwrap().is_none() && !mem.has_kv("ana", ana2).unwrap());
    assert_eq!(mem.cache_stats().corrupt, 0);
}

/// A unit may be as long as one record holds in the memory's formats: a
/// compact format takes longer units, unless an older, wider segment is
/// there (every user's units must fit their own segment).
#[test]
fn the_longest_unit_follows_the_widest_segment_format() {
    let m = models(512);
    let mut e = m.engine();
    let header = m.composer.header().len();
    let with = |format| StoreOptions { format: Some(format), ..StoreOptions::default() };
    let limits: Vec<usize> = KvFormat::ALL
        .iter()
        .map(|&f| {
            let dir = tempfile::tempdir().unwrap();
            open(dir.path(), &e, with(f)).0.max_fact_tokens(header)
        })
        .collect();
    // SmolLM2: 30 layers × 192 values, K and V; 64 MiB records less a reserve.
    assert_eq!(limits[0], 1_454, "f32");
    assert!(limits[1] == 2 * limits[0] + 1 || limits[1] == 2 * limits[0], "bf16 {limits:?}");
    assert!(limits[2] >= 4 * limits[0] - 1, "fp8 {limits:?}");

    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, with(KvFormat::F32));
    ingest(&mut mem, &mut e, &m, "old", 1);
    drop(mem);
    let (mem, _) = open(dir.path(), &e, with(KvFormat::Fp8));
    assert_eq!(mem.max_fact_tokens(header), limits[0], "an f32 segment is still there");
}

#[test]
fn an_fp8_segment_of_the_first_layout_is_re_encoded_never_read() {
    let m = models(512);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let fp8 = StoreOptions { format: Some(KvFormat::Fp8), ..StoreOptions::default() };
    let (mut mem, _) = open(dir.path(), &e, fp8);
    ingest(&mut mem, &mut e, &m, "old", 3);
    let fresh: Vec<HostKv> = (0..3).map(|i| kv(&mut mem, "old", i)).collect();
    drop(mem);

    // Rewrite the segment as the first fp8 layout wrote it: a header with no
    // layout, and per record one scale per tensor and KV head, then codes
    // (all 0x38 = 1.0 here: read as they are, every value would be the
    // scale, 1).
    let user_dir = std::fs::read_dir(dir.path().join("users")).unwrap().next().unwrap().unwrap().path();
    let kv_path = user_dir.join("kv.log");
    let (mut log, rec) = inferscale_memory::log::RecordLog::open(&kv_path).unwrap();
    let mut header: serde_json::Value = serde_json::from_slice(&rec.records[0]).unwrap();
    assert_eq!(header["layout"], 2, "{header}");
    header.as_object_mut().unwrap().remove("layout");
    let (layers, kv_dim, head_dim) = (
        header["layers"].as_u64().unwrap() as usize,
        header["kv_dim"].as_u64().unwrap() as usize,
        header["head_dim"].as_u64().unwrap() as usize,
    );
    let word = |b: &[u8], at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize;
    let mut records = vec![serde_json::to_vec(&header).unwrap()];
    for r in &rec.records[1..] {
        let id = word(r, 0);
        let tokens = word(r, 4 + id);
        let head = 8 + id + 4 * tokens + 4;
        let mut old = r[..head].to_vec();
        (0..2 * layers * (kv_dim / head_dim)).for_each(|_| old.extend_from_slice(&1f32.to_le_bytes()));
        old.extend(std::iter::repeat_n(0x38u8, 2 * layers * tokens * kv_dim));
        records.push(old);
    }
    log.rewrite(&records).unwrap();
    drop(log);

    // Opened again: the segment is named, emptied, and its facts encoded
    // anew — to exactly the KV fp8 made before — never read as stored.
    let (mut mem, warnings) = open(dir.path(), &e, fp8);
    assert!(warnings.iter().any(|w| w.contains("first fp8 layout") && w.contains("re-encoded")), "{warnings:?}");
    assert_eq!(mem.kv_format("old").unwrap(), KvFormat::Fp8);
    assert!((0..3).all(|i| !mem.has_kv("old", i).unwrap()), "no record of the old layout is indexed");
    let mut enc = m.encoders(&mut e);
    assert!(mem.ensure_kv("old", &mut enc).unwrap() > 0);
    for (i, want) in fresh.iter().enumerate() {
        assert_eq!(&kv(&mut mem, "old", i), want, "fact {i}");
    }
    drop(mem);
    let (_, warnings) = open(dir.path(), &e, StoreOptions { format: Some(KvFormat::Fp8), ..StoreOptions::default() });
    assert!(warnings.is_empty(), "rewritten in the current layout: {warnings:?}");
}

/// A device tier that turns over (issue 48), through the memory on the CPU
/// with an emulated host tier and tiny budgets: a host-tier fact hit
/// `promote_after` times is read onto the device by a promotion job, the
/// device's least recently used unpinned fact leaves it — demoted, read
/// again into the host tier and counted as no miss — and a pinned fact
/// never leaves; a promotion that only pinned facts could make room for is
/// not started; a demotion whose fact a request read meanwhile is dropped.
/// What moves is the encoded KV bit for bit.
#[test]
fn promotions_and_demotions_under_tiny_budgets_never_evict_a_pinned_fact() {
    let m = models(512);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, StoreOptions::default());
    ingest(&mut mem, &mut e, &m, "ana", 6);
    let encoded: Vec<HostKv> = (0..6).map(|i| kv(&mut mem, "ana", i)).collect();
    let per_fact = mem.footprint().kv_resident_bytes / 6;
    drop(mem);

    // Room for two facts on the device and three in the host tier.
    let budgets = Budgets { device: Some(per_fact * 2), host: Some(per_fact * 3) };
    let options = StoreOptions { budgets, promote_after: 2, emulated_host_tier: true, ..StoreOptions::default() };
    let (mut mem, _) = open(dir.path(), &e, options);
    let tiers =
        |mem: &Memory<CpuBackend>| -> Vec<Option<Tier>> { (0..6).map(|i| mem.tier("ana", i).unwrap()).collect() };
    // Reads fill the device first, then the host tier.
    drop(mem.fetch(&CpuBackend, "ana", &[0, 1]).unwrap());
    drop(mem.fetch(&CpuBackend, "ana", &[2, 3, 4]).unwrap());
    let (d, h) = (Some(Tier::Device), Some(Tier::Host));
    assert_eq!(tiers(&mem), [d, d, h, h, h, None]);
    let misses = mem.cache_stats().misses;
    assert_eq!(misses, 5);

    // Fact 0 pinned (a request holds it), then fact 1 used: the pinned fact
    // is the device's least recently used. Fact 2 hit twice in the host tier.
    let pin0 = mem.fetch(&CpuBackend, "ana", &[0]).unwrap();
    assert_eq!(pin0.report.device_hits, 1);
    drop(mem.fetch(&CpuBackend, "ana", &[1]).unwrap());
    assert!(mem.promotion_jobs(8).is_empty(), "nothing due yet");
    drop(mem.fetch(&CpuBackend, "ana", &[2]).unwrap());
    assert!(mem.promotion_jobs(8).is_empty(), "one host-tier hit is not enough");
    drop(mem.fetch(&CpuBackend, "ana", &[2]).unwrap());
    let jobs = mem.promotion_jobs(8);
    assert_eq!(jobs.len(), 1, "fact 2 is due");
    for done in jobs.into_iter().map(|j| j.run()) {
        assert!(mem.complete_read(&CpuBackend, done).unwrap());
    }
    // Fact 2 is on the device; fact 1, the unpinned one, left it; the
    // pinned fact 0 stayed although it was used before fact 1.
    assert_eq!(tiers(&mem), [d, None, d, h, h, None]);
    let stats = mem.cache_stats();
    assert_eq!((stats.promoted, stats.demoted, stats.misses), (1, 0, misses), "a promotion is no miss");

    // Fact 1 is demoted: read again into the host tier, no miss.
    let jobs = mem.promotion_jobs(8);
    assert_eq!(jobs.len(), 1, "fact 1's demotion");
    for done in jobs.into_iter().map(|j| j.run()) {
        assert!(mem.complete_read(&CpuBackend, done).unwrap());
    }
    assert_eq!(tiers(&mem), [d, h, d, h, h, None]);
    let stats = mem.cache_stats();
    assert_eq!((stats.promoted, stats.demoted, stats.misses), (1, 1, misses), "a demotion is no miss");
    assert!(mem.cache_stats().over_budget == 0);

    // Both device facts pinned: fact 3, hit twice in the host tier, is not
    // promoted (only pinned facts could make room), and nothing moves.
    let pin2 = mem.fetch(&CpuBackend, "ana", &[2]).unwrap();
    drop(mem.fetch(&CpuBackend, "ana", &[3]).unwrap());
    drop(mem.fetch(&CpuBackend, "ana", &[3]).unwrap());
    assert!(mem.promotion_jobs(8).is_empty(), "pins leave the device no room");
    assert_eq!(tiers(&mem), [d, h, d, h, h, None]);

    // Fact 0 released and used after pinned fact 2: fact 3, hit twice more,
    // is promoted over fact 0. Fact 0's demotion is under way when a request
    // reads it back: the request's copy stays, the demotion's is dropped.
    drop(pin0);
    drop(mem.fetch(&CpuBackend, "ana", &[0]).unwrap());
    drop(mem.fetch(&CpuBackend, "ana", &[3]).unwrap());
    drop(mem.fetch(&CpuBackend, "ana", &[3]).unwrap());
    let jobs = mem.promotion_jobs(8);
    assert_eq!(jobs.len(), 1, "fact 3 is due");
    for done in jobs.into_iter().map(|j| j.run()) {
        assert!(mem.complete_read(&CpuBackend, done).unwrap());
    }
    assert_eq!(tiers(&mem)[..4], [None, h, d, d], "fact 0 left, pinned fact 2 stayed");
    let demotion = mem.promotion_jobs(8);
    assert_eq!(demotion.len(), 1, "fact 0's demotion");
    let back = mem.fetch(&CpuBackend, "ana", &[0]).unwrap();
    assert_eq!(back.report.loaded, 1, "a request reads fact 0 from disk");
    drop(back);
    for done in demotion.into_iter().map(|j| j.run()) {
        assert!(!mem.complete_read(&CpuBackend, done).unwrap(), "fact 0 is cached already");
    }
    assert_eq!(mem.tier("ana", 0).unwrap(), h);
    assert_eq!(mem.cache_stats().demoted, 1);
    drop(pin2);

    // What moved between the tiers is what was encoded, bit for bit.
    for (i, want) in encoded.iter().enumerate() {
        assert_eq!(&kv(&mut mem, "ana", i), want, "fact {i}");
    }
}

/// The bytes of the last values of fact `kv`'s last value tensor (its
/// last token's, in the last layer: made from its whole context, unlike a
/// first layer's keys, which depend on the token alone), as an f32
/// segment stores them: a signature to look for in the file.
fn signature(kv: &HostKv) -> Vec<u8> {
    let last = &kv.1[kv.1.len() - 1].data;
    last[last.len() - 16..].iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn holds(path: &Path, needle: &[u8]) -> bool {
    std::fs::read(path).unwrap().windows(needle.len()).any(|w| w == needle)
}

/// Forgetting a fact erases its KV record (and those of the facts whose
/// window held it) where they lie: the segment is not copied, the other
/// records keep their place and are read back as they were, the erased
/// bytes are gone from the file, and a reopen finds nothing to warn
/// about. Once the erased records outgrow the live ones, the segment is
/// compacted into a new file of the live records.
#[test]
fn forgetting_erases_kv_in_place_and_compacts_once_the_dead_outgrow_the_live() {
    use std::os::unix::fs::MetadataExt;
    let m = models(512);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let f32s = StoreOptions { format: Some(KvFormat::F32), ..StoreOptions::default() };
    let (mut mem, _) = open(dir.path(), &e, f32s);
    ingest(&mut mem, &mut e, &m, "ana", 8);
    let encoded: Vec<HostKv> = (0..8).map(|i| kv(&mut mem, "ana", i)).collect();
    let kv_path = user_dir(dir.path(), "ana").join("kv.log");
    let before = std::fs::metadata(&kv_path).unwrap();
    assert!(encoded.iter().all(|k| holds(&kv_path, &signature(k))));

    // ana0 goes, and ana1's KV with it (its window of one held ana0).
    mem.forget("ana", Some("ana0")).unwrap();
    let after = std::fs::metadata(&kv_path).unwrap();
    assert_eq!((after.ino(), after.len()), (before.ino(), before.len()), "erased in place, not rewritten");
    assert!(!holds(&kv_path, &signature(&encoded[0])) && !holds(&kv_path, &signature(&encoded[1])));
    assert!(encoded[2..].iter().all(|k| holds(&kv_path, &signature(k))));
    drop(mem);
    let (mut mem, warnings) = open(dir.path(), &e, f32s);
    assert!(warnings.is_empty(), "{warnings:?}");
    let ids: Vec<String> = mem.facts("ana").unwrap().iter().map(|f| f.unit.id.clone()).collect();
    assert_eq!(ids[0], "ana1");
    assert!(!mem.has_kv("ana", 0).unwrap(), "ana1's KV held the forgotten text");
    for (i, want) in encoded.iter().enumerate().skip(2) {
        assert_eq!(&kv(&mut mem, "ana", i - 1), want, "ana{i} read back from where it was");
    }

    // ana2 (with ana3): four of eight records dead, not more than the live.
    mem.forget("ana", Some("ana2")).unwrap();
    assert_eq!(std::fs::metadata(&kv_path).unwrap().ino(), before.ino());
    // ana4 (with ana5): six dead against two live, so the segment is
    // compacted: a new file of ana6's and ana7's records.
    mem.forget("ana", Some("ana4")).unwrap();
    let compacted = std::fs::metadata(&kv_path).unwrap();
    assert_ne!(compacted.ino(), before.ino(), "compacted into a new file");
    assert!(compacted.len() < before.len() / 3, "{} of {} bytes", compacted.len(), before.len());
    drop(mem);
    let (mut mem, warnings) = open(dir.path(), &e, f32s);
    assert!(warnings.is_empty(), "{warnings:?}");
    let ids: Vec<String> = mem.facts("ana").unwrap().iter().map(|f| f.unit.id.clone()).collect();
    assert_eq!(ids, ["ana1", "ana3", "ana5", "ana6", "ana7"]);
    let with_kv: Vec<bool> = (0..5).map(|i| mem.has_kv("ana", i).unwrap()).collect();
    assert_eq!(with_kv, [false, false, false, true, true]);
    assert_eq!(kv(&mut mem, "ana", 3), encoded[6]);
    assert_eq!(kv(&mut mem, "ana", 4), encoded[7]);
    // Facts re-encoded after the forgets land behind the compacted records.
    let mut enc = m.encoders(&mut e);
    assert!(mem.ensure_kv("ana", &mut enc).unwrap() > 0);
    assert!((0..5).all(|i| mem.has_kv("ana", i).unwrap()));
    assert_eq!(kv(&mut mem, "ana", 4), encoded[7]);
    assert_eq!(mem.cache_stats().corrupt, 0);
}

/// A restart reads back what the tiers held (`resident.rs`): the list
/// names the device tier's facts, then the host tier's, most recently used
/// first; after a reopen the reads it makes put each fact back in its tier
/// (a host-tier fact there even when the device has room), bit for bit, as
/// no miss; users not read yet wait for a call that may
/// read them; a fact forgotten since is skipped; a warm read never evicts
/// what a request read (it is cached only where its tier has room); and a
/// damaged list is ignored with a warning.
#[test]
fn a_restart_reads_back_what_the_tiers_held() {
    use inferscale_memory::user_dir_name;
    let m = models(512);
    let mut e = m.engine();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, StoreOptions::default());
    ingest(&mut mem, &mut e, &m, "ana", 6);
    ingest(&mut mem, &mut e, &m, "ben", 3);
    let ana: Vec<HostKv> = (0..6).map(|i| kv(&mut mem, "ana", i)).collect();
    let ben0 = kv(&mut mem, "ben", 0);
    (1..3).for_each(|i| drop(kv(&mut mem, "ben", i)));
    let per_fact = mem.footprint().kv_resident_bytes / 9;
    drop(mem);

    // Room for two facts on the device and three in the host tier.
    let budgets = Budgets { device: Some(per_fact * 2), host: Some(per_fact * 3) };
    let options = StoreOptions { budgets, emulated_host_tier: true, lazy_users: true, ..StoreOptions::default() };
    let (d, h) = (Some(Tier::Device), Some(Tier::Host));
    let (mut mem, _) = open(dir.path(), &e, options);
    drop(mem.fetch(&CpuBackend, "ana", &[0, 1]).unwrap());
    drop(mem.fetch(&CpuBackend, "ana", &[2]).unwrap());
    drop(mem.fetch(&CpuBackend, "ben", &[0, 1]).unwrap());
    drop(mem.fetch(&CpuBackend, "ana", &[0]).unwrap());
    assert_eq!((0..3).map(|i| mem.tier("ana", i).unwrap()).collect::<Vec<_>>(), [d, d, h]);
    assert!(mem.resident_changed());
    assert_eq!(mem.save_resident().unwrap(), 5);
    assert!(!mem.resident_changed(), "nothing changed since");
    drop(mem.fetch(&CpuBackend, "ana", &[0]).unwrap());
    assert!(mem.resident_changed(), "a hit changes the order");
    let line =
        |t: &str, user: &str, i: usize| format!("{t} {} {}", user_dir_name(user), user_dir_name(&format!("{user}{i}")));
    let saved = std::fs::read_to_string(dir.path().join("resident")).unwrap();
    let body: Vec<&str> = saved.lines().skip(1).take(5).collect();
    let want =
        [line("d", "ana", 0), line("d", "ana", 1), line("h", "ben", 1), line("h", "ben", 0), line("h", "ana", 2)];
    assert_eq!(body, want, "device then host, most recently used first");
    drop(mem);

    // ben1 is forgotten while the server is down (its window held ben0
    // only: ben0 keeps its KV).
    let (mut mem, _) = open(dir.path(), &e, StoreOptions::default());
    mem.forget("ben", Some("ben1")).unwrap();
    drop(mem);

    let (mut mem, _) = open(dir.path(), &e, options);
    assert_eq!(mem.warm_left(), 0, "opening does not read the list");
    assert_eq!(mem.load_resident(), None);
    assert_eq!(mem.warm_left(), 5);
    // Read lazily, "ana" (the first user) is read at open, "ben" not yet:
    // without leave to read users, only ana's facts are read back.
    let jobs = mem.warm_jobs(8, 0);
    assert_eq!(jobs.len(), 3, "ana0, ana1, ana2");
    assert_eq!(mem.warm_left(), 2, "ben's two wait in their place");
    let mut jobs: Vec<_> = jobs.into_iter().map(|j| j.run()).collect();
    let more = mem.warm_jobs(8, 8);
    assert_eq!(more.len(), 1, "ben0; ben1 is forgotten");
    assert_eq!(mem.warm_left(), 0);
    jobs.extend(more.into_iter().map(|j| j.run()));
    for done in jobs {
        assert!(mem.complete_read(&CpuBackend, done).unwrap());
    }
    let stats = mem.cache_stats();
    assert_eq!((stats.warmed, stats.misses), (4, 0), "warm reads are no misses");
    assert_eq!((0..6).map(|i| mem.tier("ana", i).unwrap()).collect::<Vec<_>>(), [d, d, h, None, None, None]);
    assert_eq!(mem.tier("ben", 0).unwrap(), h);
    let got = mem.fetch(&CpuBackend, "ana", &[0, 1]).unwrap();
    assert_eq!((got.report.device_hits, got.report.loaded), (2, 0), "a request finds them on the device");
    drop(got);
    for (i, want) in ana.iter().enumerate().take(3) {
        assert_eq!(&kv(&mut mem, "ana", i), want, "ana{i}");
    }
    assert_eq!(kv(&mut mem, "ben", 0), ben0);
    drop(mem);

    // A request reads ana3 and ana4 onto the device before the warm-up:
    // the warm reads bound there go to the host tier, and what finds no
    // room is not cached; nothing a request read leaves.
    let (mut mem, _) = open(dir.path(), &e, options);
    assert_eq!(mem.load_resident(), None);
    drop(mem.fetch(&CpuBackend, "ana", &[3, 4]).unwrap());
    let mut cached = Vec::new();
    while mem.warm_left() > 0 {
        for done in mem.warm_jobs(8, 8).into_iter().map(|j| j.run()) {
            cached.push(mem.complete_read(&CpuBackend, done).unwrap());
        }
    }
    assert_eq!(cached, [true, true, true, false], "ana0, ana1, ben0 fit the host tier; ana2 does not");
    assert_eq!((0..6).map(|i| mem.tier("ana", i).unwrap()).collect::<Vec<_>>(), [h, h, None, d, d, None]);
    assert_eq!(mem.tier("ben", 0).unwrap(), h);
    assert_eq!(mem.cache_stats().evictions, [0, 0], "a warm read evicts nothing");
    drop(mem);

    // With room on the device for every fact, the host tier's facts still
    // go back to the host tier: the device's room is left to requests.
    let roomy = Budgets { device: Some(per_fact * 6), ..budgets };
    let (mut mem, _) = open(dir.path(), &e, StoreOptions { budgets: roomy, ..options });
    assert_eq!(mem.load_resident(), None);
    while mem.warm_left() > 0 {
        for done in mem.warm_jobs(8, 8).into_iter().map(|j| j.run()) {
            assert!(mem.complete_read(&CpuBackend, done).unwrap());
        }
    }
    assert_eq!((0..3).map(|i| mem.tier("ana", i).unwrap()).collect::<Vec<_>>(), [d, d, h]);
    assert_eq!(mem.tier("ben", 0).unwrap(), h);
    drop(mem);

    // A damaged list is ignored, with a warning naming it.
    let path = dir.path().join("resident");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[30] ^= 0x04;
    std::fs::write(&path, bytes).unwrap();
    let (mut mem, _) = open(dir.path(), &e, options);
    let warning = mem.load_resident();
    assert_eq!(mem.warm_left(), 0);
    assert!(warning.as_ref().is_some_and(|w| w.contains("resident") && w.contains("checksum mismatch")), "{warning:?}");
}
