//! The memory shard with the real models (SmolLM2 + MiniLM, CPU): durable
//! ingest, reload without re-encoding, corrupt KV detected and re-encoded,
//! refusal of KV made under other settings, forgetting, user isolation and
//! bad input.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

use std::path::Path;

use inferscale_engine::bert::Bert;
use inferscale_engine::{CpuBackend, Engine, EngineConfig};
use inferscale_memory::{Composer, Encoders, Memory, MemoryError, Mode, SYSTEM_PROMPT, ShardSpec, Turn, prepare};
use inferscale_model::ModelFiles;

struct Models {
    files: ModelFiles,
    embedder: Bert<CpuBackend>,
}

fn models() -> Models {
    let files = inferscale_model::open("smollm2").unwrap();
    let embedder = Bert::load(&CpuBackend, inferscale_model::encoder::open("minilm").unwrap()).unwrap();
    Models { files, embedder }
}

fn engine(m: &Models) -> Engine<CpuBackend> {
    Engine::new(CpuBackend, &m.files, EngineConfig { kv_blocks: 512, max_batch_tokens: 512 }).unwrap()
}

fn turns(prefix: &str, n: usize) -> Vec<Turn> {
    let lines = [
        ("Caroline", "I adopted a grey cat named Miso last spring."),
        ("Melanie", "That's lovely! I ran a charity race for mental health on Saturday."),
        ("Caroline", "I'm moving to Lisbon in September to study counselling."),
        ("Melanie", "I painted a lake at sunrise and hung it in my kitchen."),
        ("Caroline", "My favourite food is spicy ramen from the corner shop."),
        ("Melanie", "We took the kids camping at the beach last weekend."),
    ];
    (0..n)
        .map(|i| {
            let (speaker, text) = lines[i % lines.len()];
            Turn {
                id: format!("{prefix}{i}"),
                speaker: speaker.into(),
                text: text.into(),
                time: "1:56 pm on 8 May, 2023".into(),
            }
        })
        .collect()
}

fn spec(window: usize) -> ShardSpec {
    ShardSpec { window, fingerprint: "smollm2-test".into() }
}

fn open(dir: &Path, e: &Engine<CpuBackend>, window: usize) -> (Memory<CpuBackend>, Vec<String>) {
    Memory::open(dir, spec(window), e).unwrap()
}

#[test]
fn ingest_is_durable_idempotent_and_reloads_without_reencoding() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, SYSTEM_PROMPT).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, 2);
    {
        let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
        let r = mem.ingest("alice", &turns("D1:", 4), &mut enc).unwrap();
        assert_eq!((r.added, r.skipped), (4, 0));
        assert!(r.encoded_tokens > 0);
        // Re-sending turns does not duplicate them.
        let r = mem.ingest("alice", &turns("D1:", 5), &mut enc).unwrap();
        assert_eq!((r.added, r.skipped), (1, 4));
    }
    let stored: Vec<_> = mem.facts("alice").unwrap().to_vec();
    assert_eq!(stored.len(), 5);
    let kv0 = mem.kv("alice", 3).unwrap().unwrap().to_host(&CpuBackend).unwrap();
    drop(mem);

    let (mut mem, warnings) = open(dir.path(), &e, 2);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(mem.facts("alice").unwrap(), &stored[..]);
    assert_eq!(mem.kv("alice", 3).unwrap().unwrap().to_host(&CpuBackend).unwrap(), kv0, "KV reloaded bit for bit");
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    assert_eq!(mem.ensure_kv("alice", &mut enc).unwrap(), 0, "nothing re-encoded after a clean restart");
}

#[test]
fn corrupt_kv_is_reported_and_reencoded_and_other_settings_are_refused() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, SYSTEM_PROMPT).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, 1);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    mem.ingest("bob", &turns("T", 3), &mut enc).unwrap();
    let want = mem.kv("bob", 2).unwrap().unwrap().to_host(&CpuBackend).unwrap();
    drop(mem);

    // Flip a byte inside the last KV record.
    let user_dir = std::fs::read_dir(dir.path().join("users")).unwrap().next().unwrap().unwrap().path();
    let kv_path = user_dir.join("kv.log");
    let mut bytes = std::fs::read(&kv_path).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 0x40;
    std::fs::write(&kv_path, &bytes).unwrap();

    let (mut mem, warnings) = open(dir.path(), &e, 1);
    assert!(warnings.iter().any(|w| w.contains("kv.log")), "{warnings:?}");
    assert!(mem.kv("bob", 2).unwrap().is_none(), "corrupt KV must not be loaded");
    assert_eq!(mem.facts("bob").unwrap().len(), 3, "facts are untouched");
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    assert!(mem.ensure_kv("bob", &mut enc).unwrap() > 0);
    assert_eq!(mem.kv("bob", 2).unwrap().unwrap().to_host(&CpuBackend).unwrap(), want, "re-encoded KV is identical");
    drop(mem);

    // KV made with window 1 is refused by a shard configured for window 0.
    let err = Memory::open(dir.path(), spec(0), &e).err().unwrap();
    assert!(matches!(err, MemoryError::KvMismatch { .. }), "{err}");
    assert!(err.to_string().contains("window 1"), "{err}");
}

#[test]
fn users_are_isolated_and_forgetting_removes_data() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, SYSTEM_PROMPT).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, 0);
    {
        let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
        mem.ingest("alice", &turns("A", 3), &mut enc).unwrap();
        mem.ingest("bob", &turns("B", 4), &mut enc).unwrap();
    }
    let mut header = e.new_sequence(composer.header().to_vec()).unwrap();
    e.prefill(&mut header).unwrap();
    let q = m.embedder.embed(&CpuBackend, &["Where is Caroline moving?"]).unwrap().remove(0);
    let question = composer.question("Where is Caroline moving?").unwrap();
    let top = mem.retrieve("alice", &q, 10).unwrap();
    assert_eq!(top.len(), 3, "alice has three facts; bob's are never candidates");
    assert_eq!(mem.facts("alice").unwrap()[top[0]].id, "A2", "the Lisbon turn ranks first");
    let p = prepare(&mut e, &mem, "alice", &top, Mode::Kv, &header, &question).unwrap();
    assert!(p.fact_ids.iter().all(|id| id.starts_with('A')), "{:?}", p.fact_ids);
    assert_eq!(p.fact_ids.last().map(String::as_str), Some("A2"), "most relevant next to the question");
    // The injected tokens are alice's facts' tokens, in prompt order.
    let alice = mem.facts("alice").unwrap();
    let mut want = composer.header().to_vec();
    for id in &p.fact_ids {
        want.extend(&alice.iter().find(|f| &f.id == id).unwrap().tokens);
    }
    want.extend(&question);
    assert_eq!(p.seq.tokens(), &want[..]);

    // Forgetting a fact, then a user, removes them from memory and disk.
    mem.forget_fact("bob", "B1").unwrap();
    assert_eq!(mem.facts("bob").unwrap().len(), 3);
    drop(mem);
    let (mut mem, _) = open(dir.path(), &e, 0);
    assert!(mem.facts("bob").unwrap().iter().all(|f| f.id != "B1"));
    let bob_dir = std::fs::read_dir(dir.path().join("users")).unwrap().count();
    mem.forget_user("bob").unwrap();
    assert_eq!(std::fs::read_dir(dir.path().join("users")).unwrap().count(), bob_dir - 1);
    assert!(matches!(mem.facts("bob"), Err(MemoryError::UnknownUser(_))));
}

#[test]
fn bad_input_is_refused_and_stores_nothing() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, SYSTEM_PROMPT).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, 0);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    mem.ingest("carol", &turns("C", 2), &mut enc).unwrap();
    let mut bad = turns("C", 3);
    bad[2].text = "   ".into();
    assert!(matches!(mem.ingest("carol", &bad, &mut enc), Err(MemoryError::Invalid { .. })));
    let dup = vec![turns("X", 1)[0].clone(), turns("X", 1)[0].clone()];
    assert!(matches!(mem.ingest("carol", &dup, &mut enc), Err(MemoryError::Invalid { .. })));
    assert!(matches!(mem.ingest("", &turns("C", 1), &mut enc), Err(MemoryError::Invalid { .. })));
    assert_eq!(mem.facts("carol").unwrap().len(), 2, "nothing stored by refused calls");
    assert!(matches!(mem.retrieve("carol", &[0.0; 384], 0), Err(MemoryError::Invalid { .. })));
    assert!(matches!(mem.retrieve("nobody", &[0.0; 384], 3), Err(MemoryError::UnknownUser(_))));
}
