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

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Tokenizer {
        Tokenizer::byte_level(&[], None).expect("byte-level tokenizer")
    }

    /// Streams `text` one byte-token at a time; returns the pieces and whether a stop hit.
    fn stream(text: &str, stop: &[String]) -> (Vec<String>, bool) {
        let t = tok();
        let ids: Vec<u32> = text.bytes().map(u32::from).collect();
        let mut s = TextStream::default();
        let mut pieces = Vec::new();
        for n in 1..=ids.len() {
            match s.push(&t, &ids[..n], stop).expect("decodes") {
                Delta::Text(p) => pieces.push(p),
                Delta::Stop(p) => {
                    pieces.push(p);
                    return (pieces, true);
                }
            }
        }
        pieces.push(s.finish(&t, &ids).expect("decodes"));
        (pieces, false)
    }

    #[test]
    fn pieces_concatenate_to_the_text_and_never_split_a_character() {
        let (pieces, stopped) = stream("héllo, Ωmega", &[]);
        assert!(!stopped);
        assert_eq!(pieces.concat(), "héllo, Ωmega");
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        // 'é' is two bytes: its first byte yields nothing, its second the whole character.
        assert_eq!(&pieces[1..3], &["".to_string(), "é".to_string()]);
    }

    #[test]
    fn stop_strings_end_the_text_before_them_and_are_never_streamed() {
        let stop = vec!["END".to_string()];
        let (pieces, stopped) = stream("one EN two END three", &stop);
        assert!(stopped);
        assert_eq!(pieces.concat(), "one EN two ");
        // A partial match ("EN" before " two") is held back, then released.
        assert!(pieces.iter().all(|p| !p.contains("END")), "{pieces:?}");
        let (pieces, stopped) = stream("no stop here, E", &stop);
        assert!(!stopped);
        assert_eq!(pieces.concat(), "no stop here, E");
    }
}
