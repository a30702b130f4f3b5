//! The docs/design.md §3 prompt layout, the same for every mode:
//!
//! ```text
//! [header]  chat template + system prompt + start of the user turn
//! [fact_1 … fact_k]  one line each ("…\n"), least relevant first
//! [tail]  earlier turns of the chat (if any), the question, end of the
//!         user turn, assistant turn start
//! ```
//!
//! Header and tail come from the model's own chat template, rendered around
//! markers and split there, so the layout works for any template. Every
//! mode uses the same token pieces, so kv and prompt mode hold identical
//! token sequences.

use inferscale_model::{ChatTemplate, Message, ModelError, ModelFiles, Tokenizer};

use crate::error::{MemoryError, Result};

/// Where the memory block goes: the start of the first user turn.
const MARKER: &str = "\u{1}INFERSCALE-USER-TURN\u{1}";
/// Where the question goes in a chat with history: its own user turn.
const QUESTION: &str = "\u{1}INFERSCALE-QUESTION\u{1}";

pub const SYSTEM_PROMPT: &str = "You are a helpful assistant with a long-term memory of the user. Each line the \
user sends before the question is a fact from an earlier conversation; use the facts to answer.";

/// What precedes the question in the user turn. Chosen on the LoCoMo dev
/// split with Qwen2.5-Coder-1.5B (docs/locomo.md, "Answer instruction"):
/// short answers score F1 0.35–0.37 where "Answer in one short sentence:"
/// scored 0.23.
pub const ANSWER_INSTRUCTION: &str = "Answer in a few words, not a full sentence:";

/// The words around the facts: the system prompt, part of the header that
/// every fact is encoded after (so part of what a memory's KV is made with),
/// and the instruction before the question (prefilled with it, free to
/// change per request).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Prompts {
    pub system: String,
    pub instruction: String,
}

impl Default for Prompts {
    fn default() -> Self {
        Prompts { system: SYSTEM_PROMPT.into(), instruction: ANSWER_INSTRUCTION.into() }
    }
}

impl Prompts {
    /// What a memory's KV depends on beyond the model and the window: empty
    /// for the default system prompt (memories made before the prompt was
    /// configurable stay valid), else a checksum of the system prompt, so
    /// that a memory is never served with a header its KV was not made after.
    pub(crate) fn kv_tag(&self) -> String {
        if self.system == SYSTEM_PROMPT {
            String::new()
        } else {
            format!("-sys{:08x}", crc32fast::hash(self.system.as_bytes()))
        }
    }
}

/// One chat request as the layout sees it (docs/design.md §3): the system
/// prompt, the earlier turns and the question.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chat {
    /// The request's system prompt; `None`: the configured one
    /// ([`Prompts::system`]), whose header every memory's KV is made after.
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
}

impl Chat {
    /// A chat of one question under the configured system prompt.
    pub fn question(text: &str) -> Chat {
        Chat { question: text.to_string(), ..Chat::default() }
    }
}

/// The §3 layout's token pieces for one model and one set of [`Prompts`]:
/// headers, fact lines and tails. It keeps its own copies of the tokenizer
/// and the chat template, so it borrows nothing.
pub struct Composer {
    tok: Tokenizer,
    template: ChatTemplate,
    system: String,
    header: Vec<u32>,
    footer: String,
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
            header: Vec::new(),
            footer: String::new(),
            instruction: prompts.instruction.trim().to_string(),
        };
        let (head, footer) = c.split_header(&prompts.system)?;
        c.header = c.tok.encode(&head, false)?;
        c.footer = footer;
        Ok(c)
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// The header of the configured system prompt.
    pub fn header(&self) -> &[u32] {
        &self.header
    }

    /// The configured system prompt.
    pub fn system(&self) -> &str {
        &self.system
    }

    /// Whether `chat` is served under the configured system prompt's header.
    pub fn is_default_header(&self, chat: &Chat) -> bool {
        !chat.raw && chat.system.as_deref().is_none_or(|s| s == self.system)
    }

    /// The header `chat` is laid out under: a completion's start tokens,
    /// its own system prompt's header, or the configured one.
    pub fn header_of(&self, chat: &Chat) -> Result<Vec<u32>> {
        match (chat.raw, chat.system.as_deref()) {
            (true, _) => Ok(self.tok.encode("", true)?),
            (false, Some(s)) => self.header_for(s),
            (false, None) => Ok(self.header.clone()),
        }
    }

    /// The header of `system`: the chat template up to the first user
    /// turn's content.
    pub fn header_for(&self, system: &str) -> Result<Vec<u32>> {
        if system == self.system {
            return Ok(self.header.clone());
        }
        Ok(self.tok.encode(&self.split_header(system)?.0, false)?)
    }

    /// The template rendered with `system` and one user turn, split there:
    /// the header's text and the footer (end of the user turn, assistant
    /// turn start).
    fn split_header(&self, system: &str) -> Result<(String, String)> {
        let text = self.template.render(&[Message::new("system", system), Message::new("user", MARKER)], true)?;
        let at = text.find(MARKER).ok_or_else(|| template_error("the chat template dropped the user message"))?;
        Ok((text[..at].to_string(), text[at + MARKER.len()..].to_string()))
    }

    /// Tokens of one fact line.
    pub fn fact(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tok.encode(&format!("{text}\n"), false)?)
    }

    /// A conversation turn as a fact line: speaker, session date, text.
    pub fn turn_text(speaker: &str, time: &str, text: &str) -> String {
        if time.is_empty() { format!("{speaker}: {text}") } else { format!("{speaker} ({time}): {text}") }
    }

    /// The tokens of a single question under the configured header.
    pub fn question(&self, text: &str) -> Result<Vec<u32>> {
        self.tail(&Chat::question(text))
    }

    /// What follows the memory block: the chat's earlier turns in the
    /// template, then the instruction and the question in a user turn and
    /// the assistant turn's start.
    ///
    /// Without history the question shares the memory's user turn (after
    /// a blank line). With history, the first earlier user message shares
    /// it instead (the memory block leads that turn, so strict
    /// user/assistant alternation holds) and the question gets a turn of its
    /// own.
    pub fn tail(&self, chat: &Chat) -> Result<Vec<u32>> {
        if chat.raw {
            return Ok(self.tok.encode(&chat.question, false)?);
        }
        let lead = if self.instruction.is_empty() { String::new() } else { format!("{} ", self.instruction) };
        if chat.history.is_empty() {
            let footer = match chat.system.as_deref() {
                Some(s) if s != self.system => self.split_header(s)?.1,
                _ => self.footer.clone(),
            };
            return Ok(self.tok.encode(&format!("\n{lead}{}{footer}", chat.question), false)?);
        }
        let system = chat.system.as_deref().unwrap_or(&self.system);
        let mut messages = vec![Message::new("system", system)];
        let mut history = chat.history.iter();
        match chat.history.first() {
            Some(m) if m.role == "user" => {
                history.next();
                messages.push(Message::new("user", &format!("{MARKER}\n{}", m.content)));
            }
            _ => messages.push(Message::new("user", MARKER)),
        }
        messages.extend(history.cloned());
        messages.push(Message::new("user", QUESTION));
        let text = self.template.render(&messages, true)?;
        let dropped = || template_error("the chat template dropped a user message");
        let from = text.find(MARKER).ok_or_else(dropped)? + MARKER.len();
        let at = text[from..].find(QUESTION).ok_or_else(dropped)? + from;
        let (between, footer) = (&text[from..at], &text[at + QUESTION.len()..]);
        Ok(self.tok.encode(&format!("{between}{lead}{}{footer}", chat.question), false)?)
    }
}

fn template_error(what: &str) -> MemoryError {
    MemoryError::Model(ModelError::ChatTemplate(what.to_string()))
}
