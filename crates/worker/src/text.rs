//! Streaming detokenization: which text a new token adds, holding back
//! what may still change — an incomplete UTF-8 character, or the start of
//! a stop string — so that streamed pieces concatenate to the final text.

use inferscale_model::Tokenizer;

/// The text streamed so far for one request.
#[derive(Debug, Default)]
pub struct TextStream {
    /// Bytes of the decoded text already sent.
    sent: usize,
}

/// What the latest token did to the text.
#[derive(Debug, PartialEq, Eq)]
pub enum Delta {
    /// New text to send (possibly empty).
    Text(String),
    /// A stop string appeared: the final piece before it, then stop.
    Stop(String),
}

impl TextStream {
    /// Decodes `generated` and returns what is new since the last call.
    pub fn push(&mut self, tok: &Tokenizer, generated: &[u32], stop: &[String]) -> inferscale_model::Result<Delta> {
        let text = tok.decode(generated, true)?;
        if let Some(at) = stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            let piece = text.get(self.sent..at).unwrap_or_default().to_string();
            self.sent = at;
            return Ok(Delta::Stop(piece));
        }
        // An incomplete character decodes to U+FFFD until its last byte comes.
        let mut safe = text.strip_suffix('\u{FFFD}').map_or(text.len(), str::len);
        // Hold back a suffix that could begin a stop string.
        let end = safe;
        for s in stop {
            for (cut, _) in s.char_indices().skip(1) {
                if text[..end].ends_with(&s[..cut]) {
                    safe = safe.min(end - cut);
                }
            }
        }
        let safe = safe.max(self.sent);
        let piece = text.get(self.sent..safe).unwrap_or_default().to_string();
        self.sent = safe;
        Ok(Delta::Text(piece))
    }

    /// The rest of the text at the end of generation (held-back bytes).
    pub fn finish(&mut self, tok: &Tokenizer, generated: &[u32]) -> inferscale_model::Result<String> {
        let text = tok.decode(generated, true)?;
        let piece = text.get(self.sent..).unwrap_or_default().to_string();
        self.sent = text.len();
        Ok(piece)
    }
}
