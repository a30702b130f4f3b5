//! The streaming wire format of OpenAI-compatible servers, read the same
//! way by every client of ours (the load test reading our router, the vLLM
//! relay reading vLLM): server-sent events and error bodies.

/// Splits a byte stream into SSE events' `data` payloads. Chunks may cut
/// events (and lines) anywhere, so bytes wait in `buf` until their line ends.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Vec<String>,
}

impl SseParser {
    /// Feeds bytes; returns the payloads of the events they complete (an
    /// event's `data` lines joined with `\n`, as the SSE spec has it).
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let mut line: Vec<u8> = self.buf.drain(..=nl).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            if line.is_empty() {
                if !self.data.is_empty() {
                    events.push(self.data.join("\n"));
                    self.data.clear();
                }
            } else if let Some(rest) = line.strip_prefix(b"data:") {
                let rest = rest.strip_prefix(b" ").unwrap_or(rest);
                self.data.push(String::from_utf8_lossy(rest).into_owned());
            }
            // Comments (`: keep-alive`), `event:` and `id:` lines carry nothing we use.
        }
        events
    }
}

/// The payload that ends an OpenAI-style stream.
pub const DONE: &str = "[DONE]";

/// The message of an error body: OpenAI's `error.message`, a bare
/// `message`, else the body's first 512 bytes as text.
pub fn error_message(body: &[u8]) -> String {
    let v: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let msg = v
        .as_ref()
        .and_then(|v| v.pointer("/error/message").or_else(|| v.get("message")))
        .and_then(serde_json::Value::as_str);
    match msg {
        Some(m) => m.to_string(),
        None => String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_survive_any_split() {
        let stream = b"data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":2}\r\n\r\nevent: x\ndata: one\ndata: two\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut p = SseParser::default();
            let mut got = p.push(&stream[..cut]);
            got.extend(p.push(&stream[cut..]));
            assert_eq!(got, vec!["{\"a\":1}", "{\"b\":2}", "one\ntwo", DONE], "cut at {cut}");
        }
    }

    #[test]
    fn error_bodies_give_their_message() {
        assert_eq!(error_message(br#"{"error": {"message": "too long", "code": 400}}"#), "too long");
        assert_eq!(error_message(br#"{"message": "bad"}"#), "bad");
        assert_eq!(error_message(b"plain"), "plain");
        assert_eq!(error_message(&[b'x'; 600]).len(), 512);
    }
}
