//! The docs/design.md §3 prompt layout, the same for every mode:
//!
//! ```text
//! [header]  chat template + system prompt (+ end of the system turn and
//!           start of the user turn, in the user-turn layout)
//! [fact_1 … fact_k]  one line each ("…\n"), least relevant first
//! [tail]  end of the memory's turn, earlier turns of the chat (if any),
//!         the question in a user turn, assistant turn start
//! ```
//!
//! Where the memory block goes is [`MemoryTurn`]: at the end of the system
//! turn (the default), or at the start of the first user turn.
//!
//! Header and tail come from the model's own chat template, rendered around
//! markers and split there, so the layout works for any template. Every
//! mode uses the same token pieces, so kv and prompt mode hold identical
//! token sequences.

use inferscale_model::{ChatTemplate, Message, ModelError, ModelFiles, Tokenizer};
use inferscale_types::Input;

use crate::error::{MemoryError, Result};

/// Where the memory block goes: the start of the first user turn.
const MARKER: &str = "\u{1}INFERSCALE-USER-TURN\u{1}";
/// Where the question goes in a chat with history: its own user turn.
const QUESTION: &str = "\u{1}INFERSCALE-QUESTION\u{1}";

/// The default system prompt of the system-turn layout (the memory block
/// follows it in the system turn).
pub const SYSTEM_PROMPT: &str = "You are a helpful assistant with a long-term memory of the user. Below are \
facts from earlier conversations, one per line: who said what, and when. Use them to answer the user's question.";

/// The default system prompt of the user-turn layout, and the system prompt
/// of every memory made before the layout could be chosen.
pub const USER_TURN_SYSTEM_PROMPT: &str = "You are a helpful assistant with a long-term memory of the user. Each \
line the user sends before the question is a fact from an earlier conversation; use the facts to answer.";

/// What precedes the question in the user turn. Chosen on the LoCoMo dev
/// split with Qwen2.5-Coder-1.5B (docs/locomo.md, "Answer instruction" and
/// "Where the facts go"): short answers score far above "Answer in one
/// short sentence:" (F1 0.35–0.37 against 0.23), and naming the facts'
/// labels keeps answers from copying them while F1 rises again (0.384
/// against 0.376, kv at k = 20, window 20).
pub const ANSWER_INSTRUCTION: &str =
    "Answer in a few words, not a full sentence, without any speaker name or date label:";

/// The chat-template turn the memory block is laid out in.
///
/// In the user turn the facts read as something the user just said, in the
/// same "Speaker (date): text" form as a transcript, and small models answer
/// by continuing it (docs/locomo.md, "Where the facts go"); in the system
/// turn they are context and the question is the user's whole turn. The
/// user turn remains for chat templates without a system role and for
/// memories made before the choice existed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryTurn {
    System,
    User,
}

impl MemoryTurn {
    pub const DEFAULT: MemoryTurn = MemoryTurn::System;

    pub fn as_str(self) -> &'static str {
        match self {
            MemoryTurn::System => "system",
            MemoryTurn::User => "user",
        }
    }

    /// The default system prompt of this layout.
    pub fn default_system_prompt(self) -> &'static str {
        match self {
            MemoryTurn::System => SYSTEM_PROMPT,
            MemoryTurn::User => USER_TURN_SYSTEM_PROMPT,
        }
    }

    /// Reports written before the layout could be chosen used the user turn.
    fn legacy() -> MemoryTurn {
        MemoryTurn::User
    }
}

impl std::str::FromStr for MemoryTurn {
    type Err = MemoryError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "system" => Ok(MemoryTurn::System),
            "user" => Ok(MemoryTurn::User),
            other => Err(MemoryError::Invalid {
                what: "memory turn",
                reason: format!("`{other}` is not one of system, user"),
            }),
        }
    }
}

/// The words around the facts and where they go: the system prompt and the
/// memory turn (part of the header every fact is encoded after, so part of
/// what a memory's KV is made with), and the instruction before the
/// question (prefilled with it, free to change per request).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Prompts {
    pub system: String,
    pub instruction: String,
    #[serde(default = "MemoryTurn::legacy")]
    pub turn: MemoryTurn,
}

impl Default for Prompts {
    fn default() -> Self {
        Prompts::new(MemoryTurn::DEFAULT, None, None)
    }
}

impl Prompts {
    /// The prompts of layout `turn`, each unset one its default.
    pub fn new(turn: MemoryTurn, system: Option<String>, instruction: Option<String>) -> Prompts {
        Prompts {
            system: system.unwrap_or_else(|| turn.default_system_prompt().into()),
            instruction: instruction.unwrap_or_else(|| ANSWER_INSTRUCTION.into()),
            turn,
        }
    }

    /// What a memory's KV depends on beyond the model and the window. The
    /// user-turn layout keeps the tags of memories made before the layout
    /// could be chosen: empty for its default system prompt, else a
    /// checksum of the prompt; the system-turn layout always carries its
    /// own. A memory is so never served with a header its KV was not made
    /// after.
    pub(crate) fn kv_tag(&self) -> String {
        let crc = crc32fast::hash(self.system.as_bytes());
        match self.turn {
            MemoryTurn::User if self.system == USER_TURN_SYSTEM_PROMPT => String::new(),
            MemoryTurn::User => format!("{USER_TURN_TAG}{crc:08x}"),
            MemoryTurn::System => format!("{SYSTEM_TURN_TAG}{crc:08x}"),
        }
    }

    /// A fingerprint without the tag [`Prompts::kv_tag`] appended: what
    /// identifies the model alone.
    pub(crate) fn untagged(fingerprint: &str) -> &str {
        let at = fingerprint.find(SYSTEM_TURN_TAG).or_else(|| fingerprint.find(USER_TURN_TAG));
        at.map_or(fingerprint, |i| &fingerprint[..i])
    }
}

/// The starts of [`Prompts::kv_tag`]'s tags (a model fingerprint's own
/// characters are a family name, digits and hex, never these).
const USER_TURN_TAG: &str = "-sys";
const SYSTEM_TURN_TAG: &str = "-memsys";

/// One chat request as the layout sees it (docs/design.md §3): the
/// client's own system prompt, the earlier turns and the question.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chat {
    /// The client's system (and developer) messages, joined by blank lines.
    /// With memory it follows the memory block (the header every memory's
    /// KV is made after stays the configured one, so the KV stays valid);
    /// without, it is the template's system turn, as the client sent it.
    pub system: Option<String>,
    /// Earlier `user`/`assistant` turns, oldest first, prefilled after the
    /// memory block and before the question.
    pub history: Vec<Message>,
    /// The last user message: what retrieval ranks the facts for.
    pub question: String,
    /// A completion (`/v1/completions`): no chat template. The question is
    /// the raw prompt, laid out after the memory; the header is only the
    /// tokens the tokenizer starts every text with (BOS, if the model has
    /// one). `system` and `history` are then empty.
    pub raw: bool,
    /// The words before the question with memory: `None` for the
    /// configured instruction ([`Prompts::instruction`]), `Some("")` for
    /// none. Never used without memory.
    pub instruction: Option<String>,
}

impl Chat {
    /// A chat of one question, no system prompt of its own.
    pub fn question(text: &str) -> Chat {
        Chat { question: text.to_string(), ..Chat::default() }
    }

    /// The layout's view of a request's input (admitted: a chat ends with
    /// the user's question): system and developer messages, wherever they
    /// stand, form its system prompt; the others are the history.
    pub fn of(input: &Input, instruction: Option<String>) -> Chat {
        match input {
            Input::Prompt(p) => Chat { question: p.clone(), raw: true, instruction, ..Chat::default() },
            Input::Chat(messages) => {
                let (question, earlier) = match messages.split_last() {
                    Some((q, earlier)) => (q.content.clone(), earlier),
                    None => (String::new(), &[][..]),
                };
                let system: Vec<&str> =
                    earlier.iter().filter(|m| m.role.instructs()).map(|m| m.content.as_str()).collect();
                let history = earlier
                    .iter()
                    .filter(|m| !m.role.instructs())
                    .map(|m| Message::new(m.role.as_str(), &m.content))
                    .collect();
                let system = (!system.is_empty()).then(|| system.join("\n\n"));
                Chat { system, history, question, raw: false, instruction }
            }
        }
    }
}

/// The chat template rendered around a memory block for one system prompt
/// and history, split into the text before the facts, between the facts
/// and the question, and after the question.
#[derive(Debug, Clone)]
struct Frame {
    header: String,
    between: String,
    footer: String,
}

/// The §3 layout's token pieces for one model and one set of [`Prompts`]:
/// headers, fact lines and tails. It keeps its own copies of the tokenizer
/// and the chat template, so it borrows nothing.
pub struct Composer {
    tok: Tokenizer,
    template: ChatTemplate,
    system: String,
    turn: MemoryTurn,
    header: Vec<u32>,
    /// The configured system prompt's frame (its header tokenized above).
    frame: Frame,
    instruction: String,
}

impl Composer {
    pub fn new(files: &ModelFiles, prompts: &Prompts) -> Result<Self> {
        let missing =
            |what: &str| MemoryError::Model(ModelError::ChatTemplate(format!("{}: {what}", files.path.display())));
        let tok = files.tokenizer.as_ref().ok_or_else(|| missing("the model has no tokenizer"))?;
        let template = files.chat_template.as_ref().ok_or_else(|| missing("the model ships no chat template"))?;
        let mut c = Composer {
            tok: tok.clone(),
            template: template.clone(),
            system: prompts.system.clone(),
            turn: prompts.turn,
            header: Vec::new(),
            frame: Frame { header: String::new(), between: String::new(), footer: String::new() },
            instruction: prompts.instruction.trim().to_string(),
        };
        c.frame = c.render(None, &[]).map_err(|e| match (e, prompts.turn) {
            (MemoryError::Model(ModelError::ChatTemplate(m)), MemoryTurn::System) => missing(&format!(
                "the chat template cannot lay the memory out in the system turn ({m}); use the user turn \
                 (--memory-turn user)"
            )),
            (e, _) => e,
        })?;
        c.header = c.tok.encode(&c.frame.header, false)?;
        Ok(c)
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// The header of the configured system prompt: what every memory's KV
    /// is made after, and what every chat with memory starts with.
    pub fn header(&self) -> &[u32] {
        &self.header
    }

    /// The configured system prompt.
    pub fn system(&self) -> &str {
        &self.system
    }

    /// A completion's header: the tokens the tokenizer starts every text
    /// with (BOS, if the model has one; possibly none).
    pub fn raw_header(&self) -> Result<Vec<u32>> {
        Ok(self.tok.encode("", true)?)
    }

    /// A request without memory, whole: the chat template over the client's
    /// own messages and nothing else — no memory prompt, no instruction — as
    /// any server of the model renders it; a completion's prompt after the
    /// start tokens.
    pub fn plain(&self, chat: &Chat) -> Result<Vec<u32>> {
        if chat.raw {
            return Ok(self.tok.encode(&chat.question, true)?);
        }
        let mut messages = Vec::with_capacity(chat.history.len() + 2);
        if let Some(system) = &chat.system {
            messages.push(Message::new("system", system));
        }
        messages.extend(chat.history.iter().cloned());
        messages.push(Message::new("user", &chat.question));
        Ok(self.tok.encode(&self.template.render(&messages, true)?, false)?)
    }

    /// The messages the template renders for `client` (the request's own
    /// system prompt) and `history`, with markers where the facts and the
    /// question go. The facts end the configured system turn, or lead the
    /// first user turn: then the first earlier user message shares it (so
    /// strict user/assistant alternation holds), or, without earlier turns,
    /// the question does. The client's system prompt follows the facts in
    /// the system turn, or leads the question's turn in the user-turn
    /// layout; either way after the header, which stays the configured one.
    fn messages(&self, client: Option<&str>, history: &[Message]) -> Vec<Message> {
        let question = match (self.turn, client) {
            (MemoryTurn::User, Some(c)) => format!("{c}\n\n{QUESTION}"),
            _ => QUESTION.to_string(),
        };
        let mut history = history.iter().peekable();
        let mut messages = Vec::with_capacity(history.len() + 3);
        match self.turn {
            MemoryTurn::System => {
                let after = client.unwrap_or("");
                messages.push(Message::new("system", &format!("{}\n{MARKER}{after}", self.system)));
            }
            MemoryTurn::User => {
                messages.push(Message::new("system", &self.system));
                if history.peek().is_none() {
                    // No earlier turns: the question shares the memory's
                    // user turn, after a blank line.
                    messages.push(Message::new("user", &format!("{MARKER}\n{question}")));
                    return messages;
                }
                match history.next_if(|m| m.role == "user") {
                    Some(m) => messages.push(Message::new("user", &format!("{MARKER}\n{}", m.content))),
                    None => messages.push(Message::new("user", MARKER)),
                }
            }
        }
        messages.extend(history.cloned());
        messages.push(Message::new("user", &question));
        messages
    }

    /// The template rendered for `client` and `history`, split at the
    /// markers.
    fn render(&self, client: Option<&str>, history: &[Message]) -> Result<Frame> {
        let text = self.template.render(&self.messages(client, history), true)?;
        let dropped = || template_error("the chat template dropped a message");
        let at = text.find(MARKER).ok_or_else(dropped)?;
        let from = at + MARKER.len();
        let q = text[from..].find(QUESTION).ok_or_else(dropped)? + from;
        Ok(Frame {
            header: text[..at].to_string(),
            between: text[from..q].to_string(),
            footer: text[q + QUESTION.len()..].to_string(),
        })
    }

    /// Tokens of one fact line.
    pub fn fact(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tok.encode(&format!("{text}\n"), false)?)
    }

    /// A conversation turn as a fact line: speaker, session date, text.
    pub fn turn_text(speaker: &str, time: &str, text: &str) -> String {
        if time.is_empty() { format!("{speaker}: {text}") } else { format!("{speaker} ({time}): {text}") }
    }

    /// The tokens of a single question after the memory block.
    pub fn question(&self, text: &str) -> Result<Vec<u32>> {
        self.tail(&Chat::question(text))
    }

    /// What follows the memory block: the end of its turn, the client's
    /// system prompt and the chat's earlier turns in the template, then the
    /// instruction and the question and the assistant turn's start.
    pub fn tail(&self, chat: &Chat) -> Result<Vec<u32>> {
        if chat.raw {
            return Ok(self.tok.encode(&chat.question, false)?);
        }
        let frame = match chat.history.is_empty() && chat.system.is_none() {
            true => std::borrow::Cow::Borrowed(&self.frame),
            false => std::borrow::Cow::Owned(self.render(chat.system.as_deref(), &chat.history)?),
        };
        let instruction = chat.instruction.as_deref().unwrap_or(&self.instruction).trim();
        let lead = if instruction.is_empty() { String::new() } else { format!("{instruction} ") };
        Ok(self.tok.encode(&format!("{}{lead}{}{}", frame.between, chat.question, frame.footer), false)?)
    }
}

fn template_error(what: &str) -> MemoryError {
    MemoryError::Model(ModelError::ChatTemplate(what.to_string()))
}
