//! The memory shard with the real models (SmolLM2 + MiniLM, CPU): durable
//! ingest, reload without re-encoding, corrupt KV detected and re-encoded,
//! refusal of KV made under other settings, forgetting, user isolation and
//! bad input.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

use std::path::Path;

use inferscale_engine::bert::Bert;
use inferscale_engine::{CpuBackend, Engine, EngineConfig};
use inferscale_memory::{
    Composer, Encoders, Facts, Memory, MemoryError, MemoryTurn, MemoryUnit, Mode, Prompts, Query, Recall, Retriever,
    ShardSpec, UnitUpdate, prepare,
};
use inferscale_model::{HostTensor, ModelFiles};

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

fn turns(prefix: &str, n: usize) -> Vec<MemoryUnit> {
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
            MemoryUnit {
                id: format!("{prefix}{i}"),
                speaker: speaker.into(),
                text: text.into(),
                time: "1:56 pm on 8 May, 2023".into(),
                source_turn: String::new(),
                ..Default::default()
            }
        })
        .collect()
}

fn query<'a>(text: &'a str, embedding: &'a [f32]) -> Query<'a> {
    Query { text, embedding }
}

fn spec(window: usize) -> ShardSpec {
    ShardSpec { window, fingerprint: "smollm2-test".into() }
}

fn open(dir: &Path, e: &Engine<CpuBackend>, window: usize) -> (Memory<CpuBackend>, Vec<String>) {
    Memory::open(dir, spec(window), e).unwrap()
}

type HostKv = (Vec<HostTensor>, Vec<HostTensor>);

/// Fact `i` of `user`'s KV as host tensors, from the cache or read from its
/// segment (`None`: it has none).
fn stored_kv(mem: &mut Memory<CpuBackend>, user: &str, i: usize) -> Option<HostKv> {
    if !mem.has_kv(user, i).unwrap() {
        return None;
    }
    let got = mem.fetch(&CpuBackend, user, &[i]).unwrap();
    assert!(got.missing.is_empty(), "fact {i} of {user} failed its read");
    Some(mem.kv(user, i).unwrap().unwrap().to_host(&CpuBackend).unwrap())
}

#[test]
fn ingest_is_durable_idempotent_and_reloads_without_reencoding() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
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
    let kv0 = stored_kv(&mut mem, "alice", 3).unwrap();
    drop(mem);

    let (mut mem, warnings) = open(dir.path(), &e, 2);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(mem.facts("alice").unwrap(), &stored[..]);
    assert!(mem.kv("alice", 3).unwrap().is_none(), "opening reads no KV");
    assert_eq!(stored_kv(&mut mem, "alice", 3).unwrap(), kv0, "KV reloaded bit for bit");
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    assert_eq!(mem.ensure_kv("alice", &mut enc).unwrap(), 0, "nothing re-encoded after a clean restart");
}

#[test]
fn corrupt_kv_is_reported_and_reencoded_and_other_settings_are_refused() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, 1);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    mem.ingest("bob", &turns("T", 3), &mut enc).unwrap();
    let want = stored_kv(&mut mem, "bob", 2).unwrap();
    drop(mem);

    // Flip a byte inside the last KV record.
    let user_dir = std::fs::read_dir(dir.path().join("users")).unwrap().next().unwrap().unwrap().path();
    let kv_path = user_dir.join("kv.log");
    let mut bytes = std::fs::read(&kv_path).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 0x40;
    std::fs::write(&kv_path, &bytes).unwrap();

    // Opening reads the last record's length, not its checksum (a record
    // is megabytes, a node has thousands of users): the damage is found by
    // the first read, counted, and that KV never loaded.
    let (mut mem, warnings) = open(dir.path(), &e, 1);
    assert!(warnings.is_empty(), "{warnings:?}");
    let got = mem.fetch(&CpuBackend, "bob", &[2]).unwrap();
    assert_eq!(got.missing, [2], "corrupt KV must not be loaded");
    drop(got);
    assert_eq!(mem.cache_stats().corrupt, 1, "the damage is counted");
    assert!(!mem.has_kv("bob", 2).unwrap() && mem.kv("bob", 2).unwrap().is_none());
    assert_eq!(mem.facts("bob").unwrap().len(), 3, "facts are untouched");
    let len = std::fs::metadata(&kv_path).unwrap().len();
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    assert!(mem.ensure_kv("bob", &mut enc).unwrap() > 0);
    assert_eq!(stored_kv(&mut mem, "bob", 2).unwrap(), want, "re-encoded KV is identical");
    // The damaged record was the segment's last: it was cut before the
    // re-encoded one was appended, in its place.
    assert_eq!(std::fs::metadata(&kv_path).unwrap().len(), len);
    drop(mem);
    let (mut mem, warnings) = open(dir.path(), &e, 1);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(stored_kv(&mut mem, "bob", 2).unwrap(), want, "read back after a restart");
    drop(mem);

    // KV made with window 1 is refused by a shard configured for window 0.
    let err = Memory::open(dir.path(), spec(0), &e).err().unwrap();
    assert!(matches!(err, MemoryError::KvMismatch { .. }), "{err}");
    assert!(err.to_string().contains("window 1"), "{err}");
    assert!(!err.to_string().contains("memory turn"), "no layout hint for another window: {err}");

    // KV made under another prompt layout is refused too, with what to do.
    let other_layout = ShardSpec { window: 1, fingerprint: "smollm2-test-memsys0badcafe".into() };
    let err = Memory::open(dir.path(), other_layout, &e).err().unwrap();
    assert!(matches!(err, MemoryError::KvMismatch { .. }), "{err}");
    assert!(err.to_string().contains("--memory-turn") && err.to_string().contains("kv.log"), "{err}");
}

/// The memory turn and the system prompt are part of what a memory's KV is
/// made with; the user turn under its default prompt keeps the tag of
/// memories made before the turn could be chosen (none).
#[test]
fn the_prompt_layout_tags_the_kv() {
    let m = models();
    let base = inferscale_memory::fingerprint(&m.files).unwrap();
    let tag = |turn, system: Option<&str>| {
        ShardSpec::new(&m.files, 0, &Prompts::new(turn, system.map(str::to_string), None)).unwrap().fingerprint
    };
    assert_eq!(tag(MemoryTurn::User, None), base);
    let all = [
        tag(MemoryTurn::User, None),
        tag(MemoryTurn::User, Some("Be brief.")),
        tag(MemoryTurn::System, None),
        tag(MemoryTurn::System, Some("Be brief.")),
    ];
    for (i, a) in all.iter().enumerate() {
        assert!(a.starts_with(&base), "{a}");
        assert!(all[i + 1..].iter().all(|b| b != a), "{all:?}");
    }
    // The instruction is prefilled with the question: free to change.
    let other = Prompts::new(MemoryTurn::System, None, Some("Reply tersely:".into()));
    assert_eq!(ShardSpec::new(&m.files, 0, &other).unwrap().fingerprint, tag(MemoryTurn::System, None));
}

#[test]
fn users_are_isolated_and_forgetting_removes_data() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
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
    let top = mem.retrieve(&CpuBackend, "alice", query("Where is Caroline moving?", &q), 10).unwrap();
    assert_eq!(top.len(), 3, "alice has three facts; bob's are never candidates");
    assert_eq!(mem.facts("alice").unwrap()[top[0]].unit.id, "A2", "the Lisbon turn ranks first");
    // Bob's request is in flight while alice's is prepared.
    let qb = m.embedder.embed(&CpuBackend, &["Where did Melanie go camping?"]).unwrap().remove(0);
    let bob_top = mem.retrieve(&CpuBackend, "bob", query("Where did Melanie go camping?", &qb), 10).unwrap();
    let pb = prepare(
        &mut e,
        &mem,
        &header,
        Facts { user: "bob", order: &bob_top, paste: &[], recall: Recall::of(Mode::Kv) },
        &question,
    )
    .unwrap();
    let p = prepare(
        &mut e,
        &mem,
        &header,
        Facts { user: "alice", order: &top, paste: &[], recall: Recall::of(Mode::Kv) },
        &question,
    )
    .unwrap();
    assert!(p.fact_ids.iter().all(|id| id.starts_with('A')), "{:?}", p.fact_ids);
    // The blocks alice's request wrote are its own: apart from the header's
    // full blocks, shared read-only by every request, none is bob's or the
    // header's, and none is shared with anything else.
    let shared = composer.header().len() / inferscale_engine::kv_cache::BLOCK_SIZE;
    let header_blocks = &header.block_table().blocks()[..shared];
    assert_eq!(&p.seq.block_table().blocks()[..shared], header_blocks);
    let written = &p.seq.block_table().blocks()[shared..];
    assert!(!written.is_empty());
    for b in written {
        assert!(!pb.seq.block_table().blocks().contains(b), "block {b} is also bob's");
        assert!(!header.block_table().blocks().contains(b), "block {b} is the header's");
        assert_eq!(e.pool().refcount(*b), 1, "block {b} is shared");
    }
    // And they hold alice's KV: the injected span equals her facts' KV
    // injected alone into a fresh sequence.
    let alice_chunks: Vec<_> = p
        .fact_ids
        .iter()
        .map(|id| {
            let i = mem.facts("alice").unwrap().iter().position(|f| &f.unit.id == id).unwrap();
            mem.kv("alice", i).unwrap().unwrap()
        })
        .collect();
    let mut alone = e.fork(&header).unwrap();
    e.inject(&mut alone, &alice_chunks).unwrap();
    let (got, _) = e.cached_kv(&p.seq, 0).unwrap();
    let (want, _) = e.cached_kv(&alone, 0).unwrap();
    assert_eq!(got.data, want.data, "alice's cache holds exactly her facts' KV");
    drop(pb);
    assert_eq!(p.fact_ids.last().map(String::as_str), Some("A2"), "most relevant next to the question");
    // The injected tokens are alice's facts' tokens, in prompt order.
    let alice = mem.facts("alice").unwrap();
    let mut want = composer.header().to_vec();
    for id in &p.fact_ids {
        want.extend(&alice.iter().find(|f| &f.unit.id == id).unwrap().tokens);
    }
    want.extend(&question);
    assert_eq!(p.seq.tokens(), &want[..]);

    // Retrieval follows the facts: its index (made by the first retrieval)
    // is rebuilt after an ingest and after a forget.
    {
        let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
        mem.ingest("alice", &turns("A", 5), &mut enc).unwrap();
    }
    assert_eq!(mem.retrieve(&CpuBackend, "alice", query("Where is Caroline moving?", &q), 10).unwrap().len(), 5);

    // Forgetting a fact, then a user, removes them from memory and disk.
    mem.forget_fact("bob", "B1").unwrap();
    assert_eq!(mem.facts("bob").unwrap().len(), 3);
    let after = mem.retrieve(&CpuBackend, "bob", query("Where did Melanie go camping?", &qb), 10).unwrap();
    assert_eq!(after.len(), 3);
    assert!(after.iter().all(|&i| mem.facts("bob").unwrap()[i].unit.id != "B1"), "{after:?}");
    drop(mem);
    let (mut mem, _) = open(dir.path(), &e, 0);
    assert!(mem.facts("bob").unwrap().iter().all(|f| f.unit.id != "B1"));
    let bob_dir = std::fs::read_dir(dir.path().join("users")).unwrap().count();
    mem.forget_user("bob").unwrap();
    assert_eq!(std::fs::read_dir(dir.path().join("users")).unwrap().count(), bob_dir - 1);
    assert!(matches!(mem.facts("bob"), Err(MemoryError::UnknownUser(_))));
}

/// Each retriever ranks the user's facts: dense by meaning, lexical by shared
/// words (facts sharing none follow in dense order), hybrid by both; the
/// lexical index follows the facts as the dense one does.
#[test]
fn every_retriever_ranks_the_users_facts() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, 0);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    mem.ingest_deferred("u", &turns("T", 6), &mut enc).unwrap();
    assert_eq!(mem.retriever(), Retriever::Hybrid, "the default");
    let ids = |mem: &Memory<CpuBackend>, text: &str, k: usize| -> Vec<String> {
        let q = m.embedder.embed(&CpuBackend, &[text]).unwrap().remove(0);
        let top = mem.retrieve(&CpuBackend, "u", query(text, &q), k).unwrap();
        top.iter().map(|&i| mem.facts("u").unwrap()[i].unit.id.clone()).collect()
    };
    for r in Retriever::ALL {
        mem.set_retriever(r);
        assert_eq!(ids(&mem, "Which city is Caroline moving to for her studies?", 1), ["T2"], "{r}");
        assert_eq!(ids(&mem, "What is the name of the cat?", 1), ["T0"], "{r}");
        let all = ids(&mem, "What did Melanie paint?", 10);
        assert_eq!(all.len(), 6, "{r}: every fact is ranked once: {all:?}");
        assert_eq!(all[0], "T3", "{r}");
    }
    mem.set_retriever(Retriever::Lexical);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    let new = MemoryUnit {
        id: "T9".into(),
        speaker: "Melanie".into(),
        text: "Our dog Biscuit ate my homework.".into(),
        ..Default::default()
    };
    mem.ingest_deferred("u", &[new], &mut enc).unwrap();
    assert_eq!(ids(&mem, "What is Biscuit?", 1), ["T9"], "an ingest rebuilds the lexical index");
    mem.forget_fact("u", "T9").unwrap();
    assert_ne!(ids(&mem, "What is Biscuit?", 1), ["T9"], "a forget does too");
}

/// Dense ranking is exact whoever runs it: a user of a few facts is ranked
/// on the host, one of more than 256 by the backend (its device index, on
/// a GPU); both give the facts of highest inner product first and, among
/// equal facts (the same line stored again), the older first.
#[test]
fn dense_ranking_is_exact_and_breaks_ties_to_the_older_fact_for_small_and_large_users() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, 0);
    mem.set_retriever(Retriever::Dense);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    // Six lines; the large user holds each fifty times (300 facts).
    mem.ingest_deferred("small", &turns("S", 6), &mut enc).unwrap();
    mem.ingest_deferred("large", &turns("L", 300), &mut enc).unwrap();
    let text = "What did Melanie paint?";
    let q = m.embedder.embed(&CpuBackend, &[text]).unwrap().remove(0);
    for (user, n) in [("small", 6), ("large", 300)] {
        // The reference: f64 inner products, a stable sort (older first).
        let facts = mem.facts(user).unwrap();
        let score = |i: usize| -> f64 { facts[i].embedding.iter().zip(&q).map(|(a, b)| *a as f64 * *b as f64).sum() };
        let mut want: Vec<usize> = (0..n).collect();
        want.sort_by(|&a, &b| score(b).total_cmp(&score(a)));
        for k in [1, 10, n] {
            let got = mem.retrieve(&CpuBackend, user, query(text, &q), k).unwrap();
            assert_eq!(got, want[..k.min(n)], "{user}, k = {k}");
        }
    }
    // The painting (line 3) first, its fifty copies — equal embeddings,
    // so equal scores — oldest first.
    let large = mem.facts("large").unwrap();
    assert!((0..50).all(|c| large[6 * c + 3].embedding == large[3].embedding), "copies embed alike");
    let top = mem.retrieve(&CpuBackend, "large", query(text, &q), 50).unwrap();
    assert_eq!(top, (0..50).map(|c| 6 * c + 3).collect::<Vec<_>>());
}

#[test]
fn bad_input_is_refused_and_stores_nothing() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
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
    // A unit too long to encode (the context) or to store (a KV record) is
    // refused before anything of its call is stored, naming it and the limit.
    let max = mem.max_fact_tokens(composer.header().len());
    assert!(max > 500 && max < 8192, "SmolLM2's limit is its KV record's: {max}");
    let mut long = turns("L", 2);
    long[1].text = "banana ".repeat(max + 10);
    let e = mem.ingest("carol", &long, &mut enc).unwrap_err().to_string();
    assert!(e.contains("\"L1\"") && e.contains(&format!("at most {max}")), "{e}");
    assert!(mem.check_fits(&long, &composer).is_err());
    mem.check_fits(&long[..1], &composer).unwrap();
    // Ids are printable; a turn and a fact with one id are told apart.
    let mut nul = turns("N", 1);
    nul[0].id = "N\u{0}1".into();
    let e = mem.ingest("carol", &nul, &mut enc).unwrap_err().to_string();
    assert!(e.contains("control characters"), "{e}");
    let mut pair = turns("P", 1);
    pair.push(MemoryUnit { source_turn: pair[0].id.clone(), ..pair[0].clone() });
    let e = mem.ingest("carol", &pair, &mut enc).unwrap_err().to_string();
    assert!(e.contains("appears twice"), "{e}");
    assert_eq!(mem.facts("carol").unwrap().len(), 2, "nothing stored by refused calls");
    assert!(matches!(mem.retrieve(&CpuBackend, "carol", query("?", &[0.0; 384]), 0), Err(MemoryError::Invalid { .. })));
    assert!(matches!(
        mem.retrieve(&CpuBackend, "nobody", query("?", &[0.0; 384]), 3),
        Err(MemoryError::UnknownUser(_))
    ));
}

#[test]
fn supplied_facts_are_encoded_after_their_source_turns_context() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, 2);
    let fact = MemoryUnit {
        id: "F1".into(),
        speaker: "Caroline".into(),
        text: "Caroline is moving to Lisbon in September.".into(),
        time: "1:56 pm on 8 May, 2023".into(),
        source_turn: "T2".into(),
        ..Default::default()
    };
    {
        let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
        mem.ingest("u", &turns("T", 6), &mut enc).unwrap();
        let r = mem.ingest("u", std::slice::from_ref(&fact), &mut enc).unwrap();
        assert_eq!((r.added, r.skipped), (1, 0));
        let again = mem.ingest("u", std::slice::from_ref(&fact), &mut enc).unwrap();
        assert_eq!((again.added, again.skipped), (0, 1), "ingest is idempotent by fact id");
        let mut selfish = fact.clone();
        selfish.id = "F2".into();
        selfish.source_turn = "F2".into();
        assert!(matches!(mem.ingest("u", &[selfish], &mut enc), Err(MemoryError::Invalid { .. })));
    }
    let facts = mem.facts("u").unwrap().to_vec();
    assert_eq!(facts.len(), 7);
    let stored = facts.last().unwrap();
    assert_eq!((stored.unit.id.as_str(), stored.unit.source_turn.as_str()), ("F1", "T2"));

    // The stored KV is the fact encoded after [header][T0][T1] (window 2
    // before T2), not after the two units stored just before the fact.
    let (k, _) = mem.kv("u", 6).unwrap().unwrap().to_host(e.backend()).unwrap();
    let encode_after = |e: &mut Engine<CpuBackend>, units: &[usize]| {
        let mut ctx = composer.header().to_vec();
        units.iter().for_each(|&i| ctx.extend(&facts[i].tokens));
        let chunk = e.encode(&ctx, &stored.tokens, ctx.len() as u32).unwrap();
        chunk.to_host(e.backend()).unwrap().0
    };
    let rel = |a: &[f32], b: &[f32]| {
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        (num / b.iter().map(|y| y * y).sum::<f32>()).sqrt()
    };
    let source = encode_after(&mut e, &[0, 1]);
    let recent = encode_after(&mut e, &[4, 5]);
    for layer in [0, k.len() / 2, k.len() - 1] {
        assert!(rel(&k[layer].data, &source[layer].data) < 1e-5, "layer {layer}: not the source turn's context");
    }
    assert!(rel(&k[k.len() - 1].data, &recent[k.len() - 1].data) > 1e-3, "control: another context differs");

    // One writer at a time: a second open of the directory is refused.
    let second = Memory::open(dir.path(), spec(2), &e);
    assert!(matches!(second, Err(MemoryError::Locked { .. })), "{:?}", second.err());
    // The source turn survives a restart.
    drop(mem);
    let (mem, _) = open(dir.path(), &e, 2);
    assert_eq!(mem.facts("u").unwrap()[6].unit.source_turn, "T2");
}

fn kv_of(m: &mut Memory<CpuBackend>, user: &str, id: &str) -> Option<Vec<f32>> {
    let i = m.facts(user).unwrap().iter().position(|f| f.unit.id == id)?;
    let (k, v) = stored_kv(m, user, i)?;
    Some(k.iter().chain(&v).flat_map(|t| t.data.iter().copied()).collect())
}

#[test]
fn a_shard_moves_between_memories_with_its_kv_and_keeps_units_sent_meanwhile() {
    use inferscale_memory::{ShardRecord, Staging};
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (mut a, _) = open(da.path(), &e, 2);
    let (mut b, _) = open(db.path(), &e, 2);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    a.ingest("u", &turns("t", 5), &mut enc).unwrap();
    // A stale copy at the destination: a unit the source no longer has
    // (forgotten there while this copy was away).
    b.ingest("u", &turns("stale", 1), &mut enc).unwrap();
    let since = inferscale_memory::write_seq();
    // A unit that reached the destination while the copy ran.
    let late = turns("late", 1);
    b.ingest("u", &late, &mut enc).unwrap();

    // Export one record per batch, as a slow link would.
    let ids = a.fact_ids("u");
    let mut staging = Staging::create(b.dir(), "u", b.kv_header(), a.kv_header(), since).unwrap();
    let mut at = 0;
    while at < ids.len() {
        let (records, used) = a.export("u", &ids[at..], true, 1).unwrap();
        assert_eq!((records.len(), used), (1, 1));
        staging.append(&records).unwrap();
        at += used;
    }
    let staged = staging.finish().unwrap();
    let report = b.commit_import("u", staged).unwrap();
    assert_eq!((report.facts, report.with_kv, report.kept, report.dropped), (6, 5, 1, 1));
    let mut want = ids.clone();
    want.push("late0".into());
    assert_eq!(b.fact_ids("u"), want, "the shard's units, then the one that came during the copy; the stale one gone");
    for id in &ids {
        assert_eq!(kv_of(&mut b, "u", id), kv_of(&mut a, "u", id), "{id}: KV moved bit for bit");
    }
    assert!(kv_of(&mut b, "u", "late0").is_none(), "a kept unit's context changed: its KV is re-encoded");
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    assert!(b.ensure_kv("u", &mut enc).unwrap() > 0);
    // The source, given the same unit last, encodes it the same way.
    a.ingest("u", &late, &mut enc).unwrap();
    let (x, y) = (kv_of(&mut a, "u", "late0").unwrap(), kv_of(&mut b, "u", "late0").unwrap());
    let diff = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
    assert!(diff <= 1e-5, "re-encoded KV differs by {diff}");

    // The import is durable: a restart loads it with its KV.
    drop(b);
    let (mut b, warnings) = open(db.path(), &e, 2);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(b.fact_ids("u"), want);
    assert_eq!(kv_of(&mut b, "u", &ids[0]), kv_of(&mut a, "u", &ids[0]));

    // KV made with another window is refused before anything is staged.
    let dc = tempfile::tempdir().unwrap();
    let (c, _) = open(dc.path(), &e, 3);
    let err = Staging::create(c.dir(), "u", c.kv_header(), a.kv_header(), 0).err().expect("refused");
    assert!(matches!(err, MemoryError::KvMismatch { .. }), "{err}");
    // A record whose KV is another fact's is refused, and the staging is removed.
    let mut staging = Staging::create(b.dir(), "v", b.kv_header(), a.kv_header(), 0).unwrap();
    let (mut records, _) = a.export("u", &ids[..2], true, usize::MAX).unwrap();
    records[0].kv = std::mem::take(&mut records[1].kv);
    let bad = ShardRecord { fact: records[0].fact.clone(), kv: records[0].kv.clone() };
    assert!(staging.append(&[bad]).is_err(), "mismatched KV must be refused");
    drop(staging);
    assert_eq!(std::fs::read_dir(db.path().join("staging")).unwrap().count(), 0, "staging cleaned up");
    assert!(!b.has_user("v"));
}

#[test]
fn an_import_interrupted_between_its_renames_is_undone_on_open() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
    let d = tempfile::tempdir().unwrap();
    let (mut a, _) = open(d.path(), &e, 0);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    a.ingest("u", &turns("t", 2), &mut enc).unwrap();
    drop(a);
    // The state a crash right after the first rename leaves.
    let users = d.path().join("users");
    let name = std::fs::read_dir(&users).unwrap().next().unwrap().unwrap().file_name();
    std::fs::create_dir_all(d.path().join("trash")).unwrap();
    std::fs::rename(users.join(&name), d.path().join("trash").join(&name)).unwrap();
    std::fs::create_dir_all(d.path().join("staging/x")).unwrap();
    let (a, warnings) = open(d.path(), &e, 0);
    assert_eq!(a.fact_ids("u"), vec!["t0", "t1"]);
    assert!(warnings.iter().any(|w| w.contains("restored")), "{warnings:?}");
    assert!(!d.path().join("staging").exists());
}

/// Every fact's KV of `user`, by id, as host tensors.
fn kv_by_id(mem: &mut Memory<CpuBackend>, user: &str) -> Vec<(String, Vec<HostTensor>)> {
    let ids: Vec<String> = mem.facts(user).unwrap().iter().map(|f| f.unit.id.clone()).collect();
    (0..ids.len())
        .map(|i| {
            let (k, v) = stored_kv(mem, user, i).expect("KV encoded");
            (ids[i].clone(), k.into_iter().chain(v).collect())
        })
        .collect()
}

/// Forgetting a unit drops the KV of every fact whose context window held
/// it (and of the fact it was the source turn of); what is re-encoded is
/// bit for bit what an ingest of the remaining units makes, and the
/// forgotten text is in no file. The same for an update's old text.
#[test]
fn forget_and_update_leave_no_kv_derived_from_the_old_text() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
    let window = 2;
    let mut units = turns("G", 6);
    // An extracted fact whose source turn is the unit forgotten below.
    units.push(MemoryUnit {
        id: "F1".into(),
        speaker: "Caroline".into(),
        text: "Caroline is moving to Lisbon.".into(),
        source_turn: "G2".into(),
        ..Default::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, window);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    mem.ingest("ana", &units, &mut enc).unwrap();
    let before = kv_by_id(&mut mem, "ana");

    mem.forget("ana", Some("G2")).unwrap();
    let facts = mem.facts("ana").unwrap().to_vec();
    let dropped: Vec<&str> =
        (0..facts.len()).filter(|&i| !mem.has_kv("ana", i).unwrap()).map(|i| facts[i].unit.id.as_str()).collect();
    assert_eq!(dropped, ["G3", "G4", "F1"], "the window of G3 and G4 held G2; F1's source turn was G2");
    // The segment on disk holds none of them either: a restart does not bring them back.
    drop(mem);
    let (mut mem, _) = open(dir.path(), &e, window);
    let facts = mem.facts("ana").unwrap().to_vec();
    let missing = (0..facts.len()).filter(|&i| !mem.has_kv("ana", i).unwrap()).count();
    assert_eq!(missing, 3);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    assert!(mem.ensure_kv("ana", &mut enc).unwrap() > 0);
    let after = kv_by_id(&mut mem, "ana");
    for (id, kv) in &after {
        let old = &before.iter().find(|(i, _)| i == id).unwrap().1;
        assert_eq!(kv == old, !["G3", "G4", "F1"].contains(&id.as_str()), "{id}: re-encoded exactly the dependents");
    }
    // A fresh memory of the remaining units makes the same KV, bit for bit.
    let remaining: Vec<MemoryUnit> = units.iter().filter(|u| u.id != "G2").cloned().collect();
    let fresh_dir = tempfile::tempdir().unwrap();
    let (mut fresh, _) = open(fresh_dir.path(), &e, window);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    fresh.ingest("ana", &remaining, &mut enc).unwrap();
    assert!(kv_by_id(&mut fresh, "ana") == after, "KV after forget = KV of an ingest without the unit");
    let forgotten = units[2].text.as_bytes();
    for entry in walk(dir.path()) {
        let bytes = std::fs::read(&entry).unwrap();
        assert!(!bytes.windows(forgotten.len()).any(|w| w == forgotten), "{} holds the text", entry.display());
    }

    // Updating G3's text re-encodes G4 and G5 (their windows held it) with the new text.
    let change = UnitUpdate { text: Some("I'm moving to Porto instead, in October.".into()), metadata: None };
    mem.update("ana", "G3", &change, &mut enc, true).unwrap();
    fresh.update("ana", "G3", &change, &mut enc, true).unwrap();
    let updated: Vec<MemoryUnit> = mem.facts("ana").unwrap().iter().map(|f| f.unit.clone()).collect();
    let again_dir = tempfile::tempdir().unwrap();
    let (mut again, _) = open(again_dir.path(), &e, window);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    again.ingest("ana", &updated, &mut enc).unwrap();
    assert!(
        kv_by_id(&mut mem, "ana") == kv_by_id(&mut again, "ana"),
        "KV after update = KV of an ingest of the new text"
    );
}

/// A write to a user whose other facts still lack KV (a replica's copy,
/// now served) encodes only what it made or changed: its latency never
/// includes that backlog, which the background encodes; and the KV every
/// fact ends with is, bit for bit, what one ingest of the units makes.
#[test]
fn a_write_encodes_its_own_facts_and_leaves_the_backlog_to_the_background() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
    let window = 2;
    let units = turns("R", 6);
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, window);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    mem.ingest_deferred("rae", &units[..4], &mut enc).unwrap();
    let lacking = |mem: &Memory<CpuBackend>| -> Vec<usize> {
        (0..mem.facts("rae").unwrap().len()).filter(|&i| !mem.has_kv("rae", i).unwrap()).collect()
    };
    let tokens = |mem: &Memory<CpuBackend>, i: usize| mem.facts("rae").unwrap()[i].tokens.len();

    let r = mem.ingest("rae", &units[4..5], &mut enc).unwrap();
    assert_eq!(lacking(&mem), [0, 1, 2, 3], "the backlog is left as it was");
    let header = composer.header().len();
    assert_eq!(
        r.encoded_tokens,
        header + tokens(&mem, 2) + tokens(&mem, 3) + tokens(&mem, 4),
        "the new fact alone, after its window's two turns"
    );

    // R2's new text drops its KV and that of R3 and R4 (their windows held
    // it): those are made again, R0 and R1 are still the background's.
    let change = UnitUpdate { text: Some("I'm moving to Porto instead, in October.".into()), metadata: None };
    let r = mem.update("rae", "R2", &change, &mut enc, true).unwrap();
    assert_eq!(lacking(&mem), [0, 1]);
    let want = 3 * header + tokens(&mem, 0) + 2 * tokens(&mem, 1) + 3 * tokens(&mem, 2) + 2 * tokens(&mem, 3);
    assert_eq!(r.encoded_tokens, want + tokens(&mem, 4), "R2, R3 and R4 with their windows");

    let mut encoded = 0;
    while let n @ 1.. = mem.encode_pending(16, &mut enc).unwrap() {
        encoded += n;
    }
    assert_eq!((encoded, lacking(&mem)), (2, vec![]), "the background made the backlog's KV");
    let updated: Vec<MemoryUnit> = mem.facts("rae").unwrap().iter().map(|f| f.unit.clone()).collect();
    let once_dir = tempfile::tempdir().unwrap();
    let (mut once, _) = open(once_dir.path(), &e, window);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    once.ingest("rae", &updated, &mut enc).unwrap();
    assert!(kv_by_id(&mut mem, "rae") == kv_by_id(&mut once, "rae"), "the KV one ingest of the units makes");
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() { out.extend(walk(&path)) } else { out.push(path) }
    }
    out
}

/// An ingest begun and not committed — the process died between its
/// batches, or a batch failed — leaves nothing of its request: at the next
/// open (a crash), or at once (`abort_ingest`), its units and their KV are
/// removed, earlier requests are untouched, and the retried request stores
/// it all. Before ingests were begun and committed, the first batches of a
/// request stayed (the repro of the issue: 16 of 120 units after a kill).
#[test]
fn an_ingest_not_committed_leaves_nothing_of_its_request() {
    let m = models();
    let mut e = engine(&m);
    let composer = Composer::new(&m.files, &Prompts::default()).unwrap();
    let window = 2;
    let dir = tempfile::tempdir().unwrap();
    let (mut mem, _) = open(dir.path(), &e, window);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    let first = turns("A", 3);
    mem.begin_ingest("ana", &first).unwrap();
    mem.ingest("ana", &first, &mut enc).unwrap();
    mem.commit_ingest("ana").unwrap();
    let committed = kv_by_id(&mut mem, "ana");

    // A second request of six units, stored in three batches; the process
    // dies after the second (the memory is dropped without a commit).
    let second = turns("B", 6);
    mem.begin_ingest("ana", &second).unwrap();
    mem.ingest("ana", &second[..2], &mut enc).unwrap();
    mem.ingest("ana", &second[2..4], &mut enc).unwrap();
    assert_eq!(mem.facts("ana").unwrap().len(), 7, "visible while stored");
    drop(mem);
    let (mut mem, warnings) = open(dir.path(), &e, window);
    assert!(warnings.iter().any(|w| w.contains("rolled back an unfinished ingest")), "{warnings:?}");
    let ids: Vec<String> = mem.facts("ana").unwrap().iter().map(|f| f.unit.id.clone()).collect();
    assert_eq!(ids, ["A0", "A1", "A2"], "nothing of the unfinished request");
    assert!(kv_by_id(&mut mem, "ana") == committed, "the committed request's KV is untouched");
    // Neither log keeps a record of them: not the text, not a KV record
    // (which starts with its fact's id, length first).
    // (B3's line is not among the first request's three.)
    let text = second[3].text.as_bytes();
    let kv_record = [&2u32.to_le_bytes()[..], b"B3"].concat();
    for entry in walk(dir.path()) {
        let bytes = std::fs::read(&entry).unwrap();
        let holds = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        assert!(!holds(text) && !holds(&kv_record), "{} holds a rolled-back unit", entry.display());
    }
    drop(mem);
    // Reopening again finds nothing more to undo.
    let (mut mem, warnings) = open(dir.path(), &e, window);
    assert!(warnings.is_empty(), "{warnings:?}");

    // The retry stores all of it, as a fresh ingest of both requests would.
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    mem.begin_ingest("ana", &second).unwrap();
    let r = mem.ingest("ana", &second, &mut enc).unwrap();
    mem.commit_ingest("ana").unwrap();
    assert_eq!(r.added, 6);

    // Aborted at once: a failed request's stored batches go, with the KV
    // of committed units whose window held them (none here: they come
    // after), and units sent before are kept.
    let third = turns("C", 4);
    mem.begin_ingest("ana", &third).unwrap();
    mem.ingest("ana", &third[..2], &mut enc).unwrap();
    assert_eq!(mem.abort_ingest("ana").unwrap(), 2);
    assert_eq!(mem.facts("ana").unwrap().len(), 9);
    let fresh_dir = tempfile::tempdir().unwrap();
    let (mut fresh, _) = open(fresh_dir.path(), &e, window);
    let mut enc = Encoders { engine: &mut e, embedder: &m.embedder, composer: &composer };
    fresh.ingest("ana", &[first, second].concat(), &mut enc).unwrap();
    assert!(kv_by_id(&mut mem, "ana") == kv_by_id(&mut fresh, "ana"), "KV = that of the committed requests alone");

    // A new user whose first ingest never committed is not left behind empty.
    let new = turns("N", 2);
    mem.begin_ingest("bo", &new).unwrap();
    mem.ingest("bo", &new[..1], &mut enc).unwrap();
    drop(mem);
    let (mem, _) = open(dir.path(), &e, window);
    assert!(mem.facts("bo").is_err(), "the user the ingest created is gone");
    assert_eq!(mem.users().count(), 1);
}
