//! Tokenizers: HF `tokenizer.json` through the `tokenizers` crate, and the
//! GPT-2-style BPE embedded in GGUF metadata turned into an equivalent
//! `tokenizers` pipeline.
//!
//! The GGUF conversion follows `tokenizer.ggml.pre`, the key llama.cpp uses
//! to record the original tokenizer's pre-tokenization: SmolLM2's `smollm`
//! splits every digit on its own before byte-level BPE, exactly as the
//! model's original `tokenizer.json` does. An unknown `pre` is an error, not
//! a guess: a wrong split silently changes every prompt.

use std::path::Path;

use serde_json::{Value, json};

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// A tokenizer plus the special-token facts generation needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos: Option<(u32, String)>,
    pub eos: Option<(u32, String)>,
    /// Ids below this have an entry; counted once, since the library
    /// counts by building the whole vocabulary map.
    known: u32,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

const GPT2_BYTE_LEVEL: &str = r#"{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}"#;
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer of a GGUF `tokenizer.ggml.pre` value.
fn pre_tokenizer_for(pre: &str) -> Option<Value> {
    let byte_level: Value = serde_json::from_str(GPT2_BYTE_LEVEL).ok()?;
    let split_then_bytes = |regex: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        ]})
    };
    Some(match pre {
        "default" | "gpt2" | "gpt-2" => byte_level,
        "smollm" | "starcoder" | "refact" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level,
        ]}),
        "llama-bpe" | "llama3" | "smaug-bpe" => split_then_bytes(LLAMA3_REGEX),
        "qwen2" => split_then_bytes(QWEN2_REGEX),
        _ => return None,
    })
}

impl Tokenizer {
    fn new(inner: tokenizers::Tokenizer, bos: Option<(u32, String)>, eos: Option<(u32, String)>) -> Self {
        let known = u32::try_from(inner.get_vocab_size(true)).unwrap_or(u32::MAX);
        Tokenizer { inner, bos, eos, known }
    }

    /// Builds the tokenizer described by GGUF `tokenizer.ggml.*` metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let path = file.path();
        let field = |name: &str, reason: String| ModelError::Config {
            path: path.to_path_buf(),
            field: name.to_string(),
            reason,
        };
        let model = file.meta("tokenizer.ggml.model").and_then(|v| v.as_str()).unwrap_or("");
        if model != "gpt2" {
            return Err(field(
                "tokenizer.ggml.model",
                format!("`{model}` is not supported (the GPT-2 byte-level BPE `gpt2` is)"),
            ));
        }
        let pre = file.meta("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
        let pre_tokenizer = pre_tokenizer_for(pre)
            .ok_or_else(|| field("tokenizer.ggml.pre", format!("pre-tokenizer `{pre}` is not supported")))?;
        let strings = |key: &str| -> Result<Vec<String>> {
            file.meta(key)
                .and_then(|v| v.as_array())
                .ok_or_else(|| field(key, "missing or not an array".into()))?
                .iter()
                .map(|v| v.as_str().map(str::to_string).ok_or_else(|| field(key, "non-string element".into())))
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<i64> = match file.meta("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
            Some(a) => a.iter().map(|v| v.as_f64().map_or(1, |x| x as i64)).collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(field(
                "tokenizer.ggml.token_type",
                format!("{} types for {} tokens", types.len(), tokens.len()),
            ));
        }
        let vocab: serde_json::Map<String, Value> =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
        // Type 3 = control (special), 4 = user-defined: both are matched whole
        // before BPE runs, as llama.cpp and HF do.
        let added: Vec<Value> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, ty))| matches!(**ty, 3 | 4))
            .map(|(id, (t, ty))| {
                json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": *ty == 3})
            })
            .collect();
        let id_of = |key: &str| -> Option<(u32, String)> {
            let id = file.meta(key)?.as_u64()? as usize;
            tokens.get(id).map(|t| (id as u32, t.clone()))
        };
        let bos = id_of("tokenizer.ggml.bos_token_id");
        let eos = id_of("tokenizer.ggml.eos_token_id");
        let add_bos = file.meta("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
        let post_processor = match (&bos, add_bos) {
            (Some((id, tok)), true) => json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tok.as_str(): {"id": tok, "ids": [id], "tokens": [tok]}},
            }),
            _ => Value::Null,
        };
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": false, "vocab": vocab, "merges": merges},
        });
        let inner = tokenizers::Tokenizer::from_bytes(spec.to_string().as_bytes())
            .map_err(|e| ModelError::Tokenizer(format!("{}: building from GGUF metadata: {e}", path.display())))?;
        Ok(Tokenizer::new(inner, bos, eos))
    }

    /// A byte-level tokenizer — one token per byte (ids 0–255), then
    /// `specials` — for random-weight models, which have no tokenizer of
    /// their own: text maps to token ids and back, so the serving path runs
    /// end to end, and a fact of n bytes is n tokens.
    pub fn byte_level(specials: &[&str], eos: Option<&str>) -> Result<Self> {
        // GPT-2's byte-to-character map, which the ByteLevel steps expect.
        let mut printable: Vec<u32> =
            (u32::from(b'!')..=u32::from(b'~')).chain(0xa1..=0xac).chain(0xae..=0xff).collect();
        let mut chars: Vec<u32> = printable.clone();
        let mut extra = 0;
        for b in 0..256u32 {
            if !printable.contains(&b) {
                printable.push(b);
                chars.push(256 + extra);
                extra += 1;
            }
        }
        let mut by_byte = vec![' '; 256];
        for (b, c) in printable.iter().zip(&chars) {
            by_byte[*b as usize] = char::from_u32(*c).unwrap_or(' ');
        }
        let mut vocab: serde_json::Map<String, Value> =
            by_byte.iter().enumerate().map(|(i, c)| (c.to_string(), json!(i))).collect();
        let added: Vec<Value> = specials
            .iter()
            .enumerate()
            .map(|(i, t)| {
                vocab.insert(t.to_string(), json!(256 + i));
                json!({"id": 256 + i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": true})
            })
            .collect();
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": false, "vocab": vocab, "merges": []},
        });
        let inner = tokenizers::Tokenizer::from_bytes(spec.to_string().as_bytes())
            .map_err(|e| ModelError::Tokenizer(format!("building the byte-level tokenizer: {e}")))?;
        let eos = eos.and_then(|e| specials.iter().position(|t| *t == e).map(|i| (256 + i as u32, e.to_string())));
        Ok(Tokenizer::new(inner, None, eos))
    }

    /// Loads an HF `tokenizer.json`; special tokens come from the model config
    /// (`bos_token_id`/`eos_token_id`), resolved to their strings here.
    pub fn from_file(path: &Path, bos_id: Option<u32>, eos_id: Option<u32>) -> Result<Self> {
        let mut inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        // Padding and truncation configured in the file are for batched
        // training; here they would silently pad or cut prompts. Callers
        // check lengths themselves.
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| ModelError::Tokenizer(format!("{}: disabling truncation: {e}", path.display())))?;
        let named = |id: Option<u32>| id.and_then(|id| inner.id_to_token(id).map(|t| (id, t)));
        let bos = named(bos_id);
        let eos = named(eos_id);
        Ok(Tokenizer::new(inner, bos, eos))
    }

    /// Encodes `text`. With `add_special_tokens` the model's post-processor
    /// runs (BOS where the model asks for it); special-token text such as
    /// `<|im_start|>` is always matched as the special token.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ModelError::Tokenizer(format!("encode: {e}")))
    }

    /// Decodes `ids`. An id the tokenizer has no entry for (a random-weight
    /// model samples from the shape's whole vocabulary, its stand-in
    /// byte-level tokenizer knows 256 bytes and a few specials) shows as
    /// `<|id|>` instead of vanishing, so such outputs stay comparable.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let run = |ids: &[u32]| {
            self.inner.decode(ids, skip_special_tokens).map_err(|e| ModelError::Tokenizer(format!("decode: {e}")))
        };
        let known = self.known;
        if ids.iter().all(|&id| id < known) {
            return run(ids);
        }
        let mut out = String::new();
        for part in ids.chunk_by(|a, b| (*a < known) == (*b < known)) {
            match part[0] < known {
                true => out.push_str(&run(part)?),
                false => part.iter().for_each(|id| out.push_str(&format!("<|{id}|>"))),
            }
        }
        Ok(out)
    }
}

impl Tokenizer {
    /// The bytes token `id` stands for — a piece of a character, possibly —
    /// as OpenAI's log-probabilities report tokens. Byte-level BPE (every
    /// generation tokenizer here) stores a token as the GPT-2 characters of
    /// its bytes, mapped back here; a special token is its text; another
    /// tokenizer's token is its decoded text.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let byte_level = matches!(self.inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_)));
        let special = self.inner.get_added_vocabulary().simple_id_to_token(id).is_some();
        match (byte_level && !special, self.inner.id_to_token(id)) {
            (true, Some(piece)) => match piece.chars().map(gpt2_byte).collect::<Option<Vec<u8>>>() {
                Some(bytes) => bytes,
                None => piece.into_bytes(),
            },
            (false, Some(piece)) if special => piece.into_bytes(),
            _ => self.decode(&[id], false).map(String::into_bytes).unwrap_or_default(),
        }
    }
}

/// The byte a GPT-2 byte-level character stands for: printable bytes are
/// themselves, the others were shifted to U+0100 and up, in order.
fn gpt2_byte(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let c = c as u32;
    if c < 256 {
        return printable(c).then_some(c as u8);
    }
    (0..=255u32).filter(|&b| !printable(b)).nth((c - 256) as usize).map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tokens_bytes_are_what_it_decodes_to() {
        let t = Tokenizer::byte_level(&["<|im_start|>"], None).expect("builds");
        for text in ["h", " ", "\n", "é"] {
            let ids = t.encode(text, false).expect("encodes");
            let bytes: Vec<u8> = ids.iter().flat_map(|&id| t.token_bytes(id)).collect();
            assert_eq!(bytes, text.as_bytes(), "{text:?}");
        }
        assert_eq!(t.token_bytes(256), b"<|im_start|>");
        assert_eq!(gpt2_byte('Ġ'), Some(b' '));
        assert_eq!(gpt2_byte('Ċ'), Some(b'\n'));
        assert_eq!(gpt2_byte('a'), Some(b'a'));
    }

    #[test]
    fn byte_level_is_one_token_per_byte_and_round_trips() {
        let t = Tokenizer::byte_level(&["<|im_start|>", "<|im_end|>"], Some("<|im_end|>")).expect("builds");
        let text = "héllo, Ω\n";
        let ids = t.encode(text, false).expect("encodes");
        assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
        assert_eq!(t.decode(&ids, true).expect("decodes"), text);
        let ids = t.encode("<|im_start|>hi<|im_end|>", false).expect("encodes");
        assert_eq!(ids, vec![256, u32::from(b'h'), u32::from(b'i'), 257]);
        assert_eq!(t.eos, Some((257, "<|im_end|>".to_string())));
        // Ids past the tokenizer's vocabulary show instead of vanishing.
        let ids = [u32::from(b'h'), 5000, 70000, u32::from(b'i'), 257];
        assert_eq!(t.decode(&ids, true).expect("decodes"), "h<|5000|><|70000|>i");
    }
}
