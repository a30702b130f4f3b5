//! The design.md §3 prompt layout built from text, shared by `demo` and
//! `bench ttft`:
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

use anyhow::{Context, Result};
use inferscale_model::{Message, ModelFiles, Tokenizer};

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
        let tok = files.tokenizer.as_ref().context("the model has no tokenizer")?;
        let tmpl = files.chat_template.as_ref().context("the model ships no chat template")?;
        let text = tmpl.render(&[Message::new("system", system), Message::new("user", MARKER)], true)?;
        let at = text.find(MARKER).context("the chat template dropped the user message")?;
        let header = tok.encode(&text[..at], false)?;
        Ok(Composer { tok, header, footer: text[at + MARKER.len()..].to_string() })
    }

    pub fn header(&self) -> &[u32] {
        &self.header
    }

    pub fn fact(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tok.encode(&format!("{text}\n"), false)?)
    }

    pub fn question(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tok.encode(&format!("\nAnswer in one short sentence: {text}{}", self.footer), false)?)
    }
}

/// `n` distinct synthetic facts of about 25 tokens each (deterministic).
pub fn synthetic_facts(n: usize) -> Vec<String> {
    const NAMES: &[&str] = &[
        "Caroline", "Melanie", "John", "Maria", "Deborah", "Andrew", "Jolene", "Evan", "Nate", "Audrey", "Gina", "Tim",
    ];
    const DID: &[&str] = &[
        "adopted a grey puppy",
        "ran a charity race",
        "started pottery classes",
        "painted a sunset over the harbour",
        "went camping for three nights",
        "joined a neighbourhood book club",
        "repaired an old racing bicycle",
        "baked sourdough bread for friends",
        "began learning the violin",
        "volunteered at the animal shelter",
        "planted tomatoes and basil",
    ];
    const WHERE: &[&str] = &[
        "in Lisbon",
        "near the lake",
        "at the community centre",
        "in the mountains",
        "downtown",
        "at the beach",
        "in Chicago",
    ];
    const WHEN: &[&str] =
        &["on 8 May 2023", "last Saturday", "in early June", "during the winter holidays", "two weeks ago"];
    (0..n)
        .map(|i| {
            let name = NAMES[i % NAMES.len()];
            let friend = NAMES[(i / NAMES.len() + i + 3) % NAMES.len()];
            format!(
                "{name} {} {} {} with {friend}, and said it felt wonderful.",
                DID[(i * 7 + i / 11) % DID.len()],
                WHERE[(i * 3 + i / 7) % WHERE.len()],
                WHEN[(i + i / 5) % WHEN.len()]
            )
        })
        .collect()
}
