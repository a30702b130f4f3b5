//! The §3 layout of a whole chat (docs/design.md): the memory block in the
//! system or the first user turn after the configured header, a request's
//! own system prompt after the memory block, earlier turns after that, the
//! question last — checked against the chat template rendered
//! independently, identical in kv and prompt mode; and a chat without
//! memory rendered exactly as the template renders the client's messages
//! (SmolLM2 + MiniLM, CPU).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

use std::sync::Arc;

use inferscale_engine::bert::Bert;
use inferscale_engine::{CpuBackend, Engine, EngineConfig};
use inferscale_memory::{
    ANSWER_INSTRUCTION, Chat, Composer, Facts, Memory, MemoryTurn, MemoryUnit, Mode, Prompts, QUESTION_BATCH, Recall,
    Scope, Session, ShardSpec,
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
        instruction: None,
    }
}

fn prepare(s: &mut Session<CpuBackend>, c: &Chat, facts: &[usize], mode: Mode) -> inferscale_memory::Prepared {
    let tail = s.tail(c, mode).unwrap();
    s.prepare_chat(c, Facts::new("ana", facts, Recall::of(mode)), &tail).unwrap()
}

const SYSTEM: &str = "Always answer in French.";

/// What the model's chat template renders for a conversation with the
/// memory block `lines` where `turn` puts it: ending the system turn (the
/// client's system prompt right after it), or leading the first user turn
/// (shared with the first earlier user message; the client's system prompt
/// then leads the question's turn).
fn rendered(s: &Session<CpuBackend>, turn: MemoryTurn, lines: &str, c: &Chat, instruction: &str) -> String {
    let configured = turn.default_system_prompt();
    let lead = if instruction.is_empty() { String::new() } else { format!("{instruction} ") };
    let question = match (turn, &c.system) {
        (MemoryTurn::User, Some(client)) => format!("{client}\n\n{lead}{}", c.question),
        _ => format!("{lead}{}", c.question),
    };
    let mut messages = Vec::new();
    let mut history = c.history.iter().peekable();
    match turn {
        MemoryTurn::System => {
            let client = c.system.as_deref().unwrap_or("");
            messages.push(Message::new("system", &format!("{configured}\n{lines}{client}")));
        }
        MemoryTurn::User => {
            messages.push(Message::new("system", configured));
            match history.next_if(|m| m.role == "user") {
                Some(m) => messages.push(Message::new("user", &format!("{lines}\n{}", m.content))),
                None if c.history.is_empty() => {
                    messages.push(Message::new("user", &format!("{lines}\n{question}")));
                    return s.files().chat_template.as_ref().unwrap().render(&messages, true).unwrap();
                }
                None => messages.push(Message::new("user", lines)),
            }
        }
    }
    messages.extend(history.cloned());
    messages.push(Message::new("user", &question));
    s.files().chat_template.as_ref().unwrap().render(&messages, true).unwrap()
}

/// Header, facts and tail decode to exactly what the model's chat template
/// renders for the conversation, in both memory turns, with and without
/// earlier turns (opening with the user or the assistant), with and without
/// a system prompt of the request's own, under the configured instruction,
/// another, or none. The header is always the configured one.
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
        let instructions =
            [(None, ANSWER_INSTRUCTION), (Some("Reply in one word:"), "Reply in one word:"), (Some(""), "")];
        for system in [None, Some(SYSTEM)] {
            for history in histories {
                for (asked, used) in instructions {
                    let mut c = chat(system, history, "Where am I moving?");
                    c.instruction = asked.map(str::to_string);
                    let p = prepare(&mut s, &c, &facts, Mode::Prompt);
                    assert_eq!(p.header_tokens, s.composer().header().len());
                    let text = s.tokenizer().decode(p.seq.tokens(), false).unwrap();
                    let want = rendered(&s, turn, &lines, &c, used);
                    assert_eq!(text, want, "{turn:?}, system {system:?}, history {history:?}, instruction {asked:?}");
                }
            }
        }
    }
}

/// Without memory a chat is the template over the client's own messages
/// and nothing else — no memory prompt, no instruction — with or without a
/// system prompt and history, and its whole prompt is computed (no header).
#[test]
fn a_chat_without_memory_is_only_the_clients_messages() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = session(dir.path());
    s.ingest("ana", &units(), false).unwrap();
    let template = s.files().chat_template.clone().unwrap();
    for system in [None, Some("You are a helpful assistant.")] {
        for history in [&[][..], &[("user", "Hi."), ("assistant", "Hello!")][..]] {
            let mut c = chat(system, history, "Write a detailed 200-word story.");
            c.instruction = Some("ignored without memory:".into());
            let p = prepare(&mut s, &c, &[], Mode::None);
            let mut messages: Vec<Message> = system.map(|t| Message::new("system", t)).into_iter().collect();
            messages.extend(c.history.iter().cloned());
            messages.push(Message::new("user", &c.question));
            let want = s.tokenizer().encode(&template.render(&messages, true).unwrap(), false).unwrap();
            assert_eq!(p.seq.tokens(), want, "system {system:?}, history {history:?}");
            assert_eq!((p.header_tokens, p.memory_tokens, p.seq.pending()), (0, 0, want.len()));
            assert!(p.fact_ids.is_empty());
        }
    }
    // A completion without memory: the start tokens, then the prompt.
    let c = Chat { question: "Once upon a time".into(), raw: true, ..Chat::default() };
    let p = prepare(&mut s, &c, &[], Mode::None);
    assert_eq!(p.seq.tokens(), s.tokenizer().encode("Once upon a time", true).unwrap());
}

/// kv and prompt mode hold the same tokens at the same positions under a
/// request's own system prompt and history; they differ only in how the
/// facts' KV got there.
#[test]
fn kv_and_prompt_mode_lay_out_the_same_chat() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = session(dir.path());
    s.ingest("ana", &units(), false).unwrap();
    let c = chat(Some(SYSTEM), &[("user", "Hi, I'm Ana."), ("assistant", "Hello Ana.")], "Where am I moving?");
    let tail = s.tail(&c, Mode::Kv).unwrap();
    let kv = prepare(&mut s, &c, &[1, 0], Mode::Kv);
    let prompt = prepare(&mut s, &c, &[1, 0], Mode::Prompt);
    assert_eq!(kv.seq.tokens(), prompt.seq.tokens());
    assert_eq!(kv.seq.positions(), prompt.seq.positions());
    assert_eq!(kv.fact_ids, prompt.fact_ids);
    // What each prefills beyond the facts is the tail, the same in both.
    assert_eq!(kv.seq.pending(), tail.len());
    assert_eq!(prompt.seq.pending(), tail.len() + kv.memory_tokens);
    assert_eq!(kv.header_tokens, s.composer().header().len());
    assert!(kv.header_cached);
}

/// A completion is the raw prompt after the memory, no template around it:
/// in prompt mode the sequence is exactly the facts' lines then the prompt,
/// and its logits those of a prefill of that text from scratch.
#[test]
fn a_completion_is_the_raw_prompt_after_the_memory() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = session(dir.path());
    s.ingest("ana", &units(), false).unwrap();
    let c = Chat { question: "Caroline is moving to".into(), raw: true, ..Chat::default() };
    let tail = s.tail(&c, Mode::Prompt).unwrap();
    let start = s.tokenizer().encode("", true).unwrap();
    assert_eq!(s.header_len(&c, Mode::Prompt), start.len());
    let mut p = prepare(&mut s, &c, &[1], Mode::Prompt);
    let text = s.tokenizer().decode(p.seq.tokens(), false).unwrap();
    assert_eq!(text, "Caroline: I'm moving to Lisbon in September.\nCaroline is moving to");
    let mut scratch = s.engine().new_sequence(p.seq.tokens().to_vec()).unwrap();
    let want = s.engine_mut().prefill(&mut scratch).unwrap();
    assert_eq!(s.engine_mut().prefill(&mut p.seq).unwrap(), want);
    // kv mode: the same tokens, the fact's KV injected instead.
    let kv = prepare(&mut s, &c, &[1], Mode::Kv);
    assert_eq!(kv.seq.tokens(), scratch.tokens());
    assert_eq!(kv.seq.pending(), tail.len());
}

/// A serving engine embeds the questions that arrived together in one
/// batch and retrieves for each with its embedding: every request gets the
/// facts, in the order, that embedding its question alone gives, across
/// users, scopes and a user without memory.
#[test]
fn questions_embedded_together_retrieve_what_each_retrieves_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = session(dir.path());
    s.ingest("ana", &units(), false).unwrap();
    let more: Vec<MemoryUnit> = [
        ("b0", "a", "Ben plays the cello in a quartet."),
        ("b1", "a", "Ben's sister lives in Oslo."),
        ("b2", "b", "Ben is allergic to peanuts."),
    ]
    .iter()
    .map(|&(id, agent, text)| MemoryUnit {
        id: id.into(),
        speaker: "Ben".into(),
        text: text.into(),
        agent_id: agent.into(),
        ..Default::default()
    })
    .collect();
    s.ingest("ben", &more, false).unwrap();
    let all = Scope::default();
    let agent_a = Scope { agent_id: Some("a".into()), run_id: None };
    let asks = [
        ("ana", "Where is Caroline moving?", 2, &all),
        ("ben", "What can't Ben eat?", 3, &all),
        ("ben", "Which instrument does Ben play?", 1, &agent_a),
        ("nobody", "Anything?", 2, &all),
        ("ana", "What is the cat called?", 1, &all),
    ];
    let questions: Vec<&str> = asks.iter().map(|a| a.1).collect();
    let batch = s.embed_questions(&questions).unwrap();
    assert_eq!(batch.len(), asks.len());
    for (&(user, question, k, scope), embedding) in asks.iter().zip(&batch) {
        let alone = s.embed_questions(&[question]).unwrap().pop().unwrap();
        let worst = alone.iter().zip(embedding).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "{question:?}: batched embedding off by {worst}");
        let got = s.retrieve_embedded(user, question, embedding, k, scope).unwrap();
        assert_eq!(got, s.retrieve_in(user, question, k, scope).unwrap(), "{question:?}");
        let expected_len = match user {
            "nobody" => 0,
            _ => k,
        };
        assert_eq!(got.len(), expected_len, "{question:?}");
    }
    // More questions than one pass takes: the same vectors, in order.
    let many: Vec<&str> = questions.iter().cycle().take(2 * QUESTION_BATCH + 3).copied().collect();
    let passes = s.embed_questions(&many).unwrap();
    assert_eq!(passes.len(), many.len());
    for (i, v) in passes.iter().enumerate() {
        let worst = v.iter().zip(&batch[i % asks.len()]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "question {i} of {}: off by {worst}", many.len());
    }
    // Agent a's facts only: b2 (agent b) never comes back for agent a.
    let facts = s.memory().facts("ben").unwrap();
    let got = s.retrieve_embedded("ben", asks[2].1, &batch[2], 3, &agent_a).unwrap();
    assert_eq!(got.len(), 2);
    assert!(got.iter().all(|&i| facts[i].unit.agent_id == "a"));
}
