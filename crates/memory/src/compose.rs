//! The docs/design.md §3 prompt layout, the same for every mode:
//!
//! ```text
//! [header]  chat template + system instructions + start of the user turn
//! [fact_1 … fact_k]  one line each ("…\n"), least relevant first
//! [question + end of the user turn + assistant turn start]
//! ```
//!
//! The header and footer come from the model's own chat template, split
//! around a marker, so the layout works for any template. Both modes use the
//! same token pieces, so kv and prompt mode hold identical token sequences.

use inferscale_model::{Message, ModelError, ModelFiles, Tokenizer};

use crate::error::{MemoryError, Result};

const MARKER: &str = "\u{1}INFERSCALE-USER-TURN\u{1}";

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

/// The §3 layout's token pieces for one model and one set of [`Prompts`]:
/// the header, fact lines and questions. It keeps its own copy of the
/// tokenizer, so it borrows nothing.
pub struct Composer {
    tok: Tokenizer,
    header: Vec<u32>,
    footer: String,
    instruction: String,
}

impl Composer {
    pub fn new(files: &ModelFiles, prompts: &Prompts) -> Result<Self> {
        let system = prompts.system.as_str();
        let missing =
            |what: &str| MemoryError::Model(ModelError::ChatTemplate(format!("{}: {what}", files.path.display())));
        let tok = files.tokenizer.as_ref().ok_or_else(|| missing("the model has no tokenizer"))?;
        let tmpl = files.chat_template.as_ref().ok_or_else(|| missing("the model ships no chat template"))?;
        let text = tmpl.render(&[Message::new("system", system), Message::new("user", MARKER)], true)?;
        let at = text.find(MARKER).ok_or_else(|| missing("the chat template dropped the user message"))?;
        let header = tok.encode(&text[..at], false)?;
        Ok(Composer {
            tok: tok.clone(),
            header,
            footer: text[at + MARKER.len()..].to_string(),
            instruction: prompts.instruction.trim().to_string(),
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    pub fn header(&self) -> &[u32] {
        &self.header
    }

    /// Tokens of one fact line.
    pub fn fact(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tok.encode(&format!("{text}\n"), false)?)
    }

    /// A conversation turn as a fact line: speaker, session date, text.
    pub fn turn_text(speaker: &str, time: &str, text: &str) -> String {
        if time.is_empty() { format!("{speaker}: {text}") } else { format!("{speaker} ({time}): {text}") }
    }

    pub fn question(&self, text: &str) -> Result<Vec<u32>> {
        let lead = if self.instruction.is_empty() { String::new() } else { format!("{} ", self.instruction) };
        Ok(self.tok.encode(&format!("\n{lead}{text}{}", self.footer), false)?)
    }
}
