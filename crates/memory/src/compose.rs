//! The design.md §3 prompt layout, the same for every mode:
//!
//! ```text
//! [header]  chat template + system instructions + start of the user turn
//! [fact_1 … fact_k]  one line each ("- …\n"), least relevant first
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

pub struct Composer<'a> {
    tok: &'a Tokenizer,
    header: Vec<u32>,
    footer: String,
}

impl<'a> Composer<'a> {
    pub fn new(files: &'a ModelFiles, system: &str) -> Result<Self> {
        let missing =
            |what: &str| MemoryError::Model(ModelError::ChatTemplate(format!("{}: {what}", files.path.display())));
        let tok = files.tokenizer.as_ref().ok_or_else(|| missing("the model has no tokenizer"))?;
        let tmpl = files.chat_template.as_ref().ok_or_else(|| missing("the model ships no chat template"))?;
        let text = tmpl.render(&[Message::new("system", system), Message::new("user", MARKER)], true)?;
        let at = text.find(MARKER).ok_or_else(|| missing("the chat template dropped the user message"))?;
        let header = tok.encode(&text[..at], false)?;
        Ok(Composer { tok, header, footer: text[at + MARKER.len()..].to_string() })
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
        Ok(self.tok.encode(&format!("\nAnswer in one short sentence: {text}{}", self.footer), false)?)
    }
}
