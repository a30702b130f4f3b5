//! The §3 layout of a whole chat (docs/design.md): the memory block in the
//! system or the first user turn, a request's own system prompt in the
//! header, earlier turns after the memory block, the question last — checked against the chat template rendered
//! independently, identical in kv and prompt mode, and the cached header of
//! a system prompt equal to its fresh prefill (SmolLM2 + MiniLM, CPU).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

use std::sync::Arc;

use inferscale_engine::bert::Bert;
use inferscale_engine::{CpuBackend, Engine, EngineConfig};
use inferscale_memory::{
    ANSWER_INSTRUCTION, Chat, Composer, Memory, MemoryTurn, MemoryUnit, Mode, Prompts, Session, ShardSpec,
};
use inferscale_model::Message;

fn session(dir: &std::path::Path) -> Session<CpuBackend> {
    session_in(dir, MemoryTurn::DEFAULT)
}

fn session_in(dir: &std::path::Path, turn: MemoryTurn) -> Session<CpuBackend> {
    let files = inferscale_model::open("smollm2").unwrap();
    let embedder = Bert::load(&CpuBackend, inferscale_model::encoder::open("minilm").unwrap()).unwrap();
    let engine = Engine::new(CpuBackend, &files, EngineConfig { kv_blocks: 512, max_batch_tokens: 512 }).unwrap();
    let spec = ShardSpec { window: 0, fingerprint: "smollm2-chat-test".into() };
    let (memory, _) = Memory::open(dir, spec, &engine).unwrap();
    Session::new(Arc::new(files), engine, embedder, memory, &Prompts::new(turn, None, None)).unwrap()
}

fn units() -> Vec<MemoryUnit> {
    [("u0", "Caroline", "I adopted a grey cat named Miso."), ("u1", "Caroline", "I'm moving to Lisbon in September.")]
        .iter()
        .map(|&(id, speaker, text)| MemoryUnit {
            id: id.into(),
            speaker: speaker.into(),
            text: text.into(),
            ..Default::default()
        })
        .collect()
}

fn chat(system: Option<&str>, history: &[(&str, &str)], question: &str) -> Chat {
    Chat {
        system: system.map(str::to_string),
        history: history.iter().map(|&(r, c)| Message::new(r, c)).collect(),
        question: question.into(),
        raw: false,
    }
}

const SYSTEM: &str = "Always answer in French.";

/// What the model's chat template renders for a conversation with the
/// memory block `lines` where `turn` puts it: ending the system turn, or
/// leading the first user turn (shared with the first earlier user message).
fn rendered(s: &Session<CpuBackend>, turn: MemoryTurn, system: &str, lines: &str, c: &Chat) -> String {
    let mut messages = Vec::new();
    let mut history = c.history.iter().peekable();
    match turn {
        MemoryTurn::System => messages.push(Message::new("system", &format!("{system}\n{lines}"))),
        MemoryTurn::User => {
            messages.push(Message::new("system", system));
            match history.next_if(|m| m.role == "user") {
                Some(m) => messages.push(Message::new("user", &format!("{lines}\n{}", m.content))),
                None if c.history.is_empty() => {
                    let question = format!("{lines}\n{ANSWER_INSTRUCTION} {}", c.question);
                    messages.push(Message::new("user", &question));
                    return s.files().chat_template.as_ref().unwrap().render(&messages, true).unwrap();
                }
                None => messages.push(Message::new("user", lines)),
            }
        }
    }
    messages.extend(history.cloned());
    messages.push(Message::new("user", &format!("{ANSWER_INSTRUCTION} {}", c.question)));
    s.files().chat_template.as_ref().unwrap().render(&messages, true).unwrap()
}

/// Header, facts and tail decode to exactly what the model's chat template
/// renders for the conversation, in both memory turns, with and without
/// earlier turns (opening with the user or the assistant), under the
/// configured system prompt and a request's own.
#[test]
fn a_chat_is_laid_out_as_the_template_renders_it() {
    for turn in [MemoryTurn::System, MemoryTurn::User] {
        let dir = tempfile::tempdir().unwrap();
        let mut s = session_in(dir.path(), turn);
        s.ingest("ana", &units(), false).unwrap();
        let facts: Vec<usize> = vec![1, 0];
        let stored = s.memory().facts("ana").unwrap();
        let lines: String = facts
            .iter()
            .rev()
            .map(|&i| format!("{}\n", Composer::turn_text(&stored[i].unit.speaker, "", &stored[i].unit.text)))
            .collect();
        let histories: [&[(&str, &str)]; 3] = [
            &[],
            &[("user", "My name is Ana."), ("assistant", "Nice to meet you, Ana!")],
            &[("assistant", "Hello! How can I help?")],
        ];
        for system in [None, Some(SYSTEM)] {
            for history in histories {
                let c = chat(system, history, "Where am I moving?");
                let tail = s.tail(&c).unwrap();
                let p = s.prepare_under(&c, "ana", &facts, Mode::Prompt, 0.0, &tail).unwrap();
                let text = s.tokenizer().decode(p.seq.tokens(), false).unwrap();
                let want = rendered(&s, turn, system.unwrap_or(turn.default_system_prompt()), &lines, &c);
                assert_eq!(text, want, "{turn:?}, system {system:?}, history {history:?}");
            }
        }
    }
}

/// kv and prompt mode hold the same tokens at the same positions under a
/// request's own header and history; they differ only in how the facts'
/// KV got there.
#[test]
fn kv_and_prompt_mode_lay_out_the_same_chat() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = session(dir.path());
    s.ingest("ana", &units(), false).unwrap();
    let c = chat(Some(SYSTEM), &[("user", "Hi, I'm Ana."), ("assistant", "Hello Ana.")], "Where am I moving?");
    let tail = s.tail(&c).unwrap();
    let kv = s.prepare_under(&c, "ana", &[1, 0], Mode::Kv, 0.0, &tail).unwrap();
    let prompt = s.prepare_under(&c, "ana", &[1, 0], Mode::Prompt, 0.0, &tail).unwrap();
    assert_eq!(kv.seq.tokens(), prompt.seq.tokens());
    assert_eq!(kv.seq.positions(), prompt.seq.positions());
    assert_eq!(kv.fact_ids, prompt.fact_ids);
    // What each prefills beyond the facts is the tail, the same in both.
    assert_eq!(kv.seq.pending(), tail.len());
    assert_eq!(prompt.seq.pending(), tail.len() + kv.memory_tokens);
    assert_eq!(kv.header_tokens, s.composer().header_for(SYSTEM).unwrap().len());
}

/// A system prompt's header is prefilled by its first request, then served
/// from the cache: the same logits as a prefill of the whole prompt from
/// scratch; past the cache's budget the least recently used header goes.
#[test]
fn request_system_prompts_have_cached_headers() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = session(dir.path());
    let block = inferscale_engine::kv_cache::BLOCK_SIZE;
    let header_blocks = s.composer().header_for(SYSTEM).unwrap().len().div_ceil(block);
    s.set_header_cache(header_blocks);
    let c = chat(Some(SYSTEM), &[], "What is two plus two?");
    let tail = s.tail(&c).unwrap();
    let mut first = s.prepare_under(&c, "ana", &[], Mode::None, 0.0, &tail).unwrap();
    assert!(!first.header_cached, "the first request prefills its header");
    let mut again = s.prepare_under(&c, "ana", &[], Mode::None, 0.0, &tail).unwrap();
    assert!(again.header_cached, "the second finds it cached");
    assert_eq!(s.header_len(&c).unwrap(), again.header_tokens);
    let mut whole = s.composer().header_for(SYSTEM).unwrap();
    whole.extend(&tail);
    let mut scratch = s.engine().new_sequence(whole).unwrap();
    let want = s.engine_mut().prefill(&mut scratch).unwrap();
    for p in [&mut first, &mut again] {
        assert_eq!(p.seq.tokens(), scratch.tokens());
        let got = s.engine_mut().prefill(&mut p.seq).unwrap();
        assert_eq!(got, want, "a forked cached header computes what a fresh prefill does");
    }
    // The configured system prompt is the session's own header, never cached here.
    let configured = chat(Some(inferscale_memory::SYSTEM_PROMPT), &[], "What is two plus two?");
    let default = s.prepare_under(&configured, "ana", &[], Mode::None, 0.0, &tail).unwrap();
    assert!(default.header_cached);
    // A second system prompt takes the only room: the first is evicted.
    let other = chat(Some("Answer like a pirate."), &[], "What is two plus two?");
    let p = s.prepare_under(&other, "ana", &[], Mode::None, 0.0, &tail).unwrap();
    assert!(!p.header_cached);
    assert!(s.prepare_under(&other, "ana", &[], Mode::None, 0.0, &tail).unwrap().header_cached);
    assert!(!s.prepare_under(&c, "ana", &[], Mode::None, 0.0, &tail).unwrap().header_cached);
    // Without a cache, every such request prefills its header.
    s.set_header_cache(0);
    assert!(!s.prepare_under(&c, "ana", &[], Mode::None, 0.0, &tail).unwrap().header_cached);
}

/// A completion is the raw prompt after the memory, no template around it:
/// in prompt mode the sequence is exactly the facts' lines then the prompt,
/// and its logits those of a prefill of that text from scratch.
#[test]
fn a_completion_is_the_raw_prompt_after_the_memory() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = session(dir.path());
    s.set_header_cache(8);
    s.ingest("ana", &units(), false).unwrap();
    let c = Chat { question: "Caroline is moving to".into(), raw: true, ..Chat::default() };
    let tail = s.tail(&c).unwrap();
    let start = s.tokenizer().encode("", true).unwrap();
    assert_eq!(s.header_len(&c).unwrap(), start.len());
    let mut p = s.prepare_under(&c, "ana", &[1], Mode::Prompt, 0.0, &tail).unwrap();
    let text = s.tokenizer().decode(p.seq.tokens(), false).unwrap();
    assert_eq!(text, "Caroline: I'm moving to Lisbon in September.\nCaroline is moving to");
    let mut scratch = s.engine().new_sequence(p.seq.tokens().to_vec()).unwrap();
    let want = s.engine_mut().prefill(&mut scratch).unwrap();
    assert_eq!(s.engine_mut().prefill(&mut p.seq).unwrap(), want);
    // kv mode: the same tokens, the fact's KV injected instead.
    let kv = s.prepare_under(&c, "ana", &[1], Mode::Kv, 0.0, &tail).unwrap();
    assert_eq!(kv.seq.tokens(), scratch.tokens());
    assert_eq!(kv.seq.pending(), tail.len());
}
