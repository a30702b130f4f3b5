//! Tokenizer and chat-template checks against the reference renderings in
//! tests/golden (transformers; see make_golden.py and make_chat_golden.py).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use inferscale_model::chat::builtin;
use inferscale_model::{ChatTemplate, Message};
use serde::Deserialize;

fn golden(name: &str) -> serde_json::Value {
    let path = common::golden_path(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

#[derive(Deserialize)]
struct ChatCase {
    template: String,
    source: String,
    bos_token: String,
    eos_token: String,
    messages: Vec<Msg>,
    add_generation_prompt: bool,
    rendered: String,
}

#[derive(Deserialize)]
struct Msg {
    role: String,
    content: String,
}

#[test]
fn builtin_templates_render_like_transformers() {
    let cases: Vec<ChatCase> = serde_json::from_value(golden("chat_templates.json")["cases"].clone()).unwrap();
    assert!(cases.len() >= 18);
    for c in cases {
        let src = builtin::by_name(&c.template).unwrap();
        assert_eq!(src, c.source, "built-in `{}` differs from the golden's source", c.template);
        let t = ChatTemplate::new(src, &c.bos_token, &c.eos_token).unwrap();
        let msgs: Vec<Message> = c.messages.iter().map(|m| Message::new(&m.role, &m.content)).collect();
        let got = t.render(&msgs, c.add_generation_prompt).unwrap();
        assert_eq!(got, c.rendered, "template {} gen={}", c.template, c.add_generation_prompt);
    }
}

/// SmolLM2's GGUF tokenizer and template, fetched on first use.
#[test]
fn smollm2_tokenizer_and_template_match_reference() {
    let files = inferscale_model::open("smollm2").unwrap();
    let tok = files.tokenizer.as_ref().unwrap();
    assert_eq!(tok.bos.as_ref().map(|b| b.0), Some(1));
    assert_eq!(tok.eos.as_ref().map(|b| b.0), Some(2));
    check_against_golden(&files, "smollm2.json");
}

/// Qwen2.5-Coder-1.5B-Instruct's GGUF tokenizer (the `qwen2` pre-tokenizer,
/// 151,936 tokens) and its own chat template. Needs the 1.1 GB model, so it
/// runs on request: `cargo nextest run --run-ignored only -E 'test(qwen)'`.
#[test]
#[ignore = "needs Qwen2.5-Coder-1.5B (1.1 GB): inferscale fetch qwen2.5-coder-1.5b"]
fn qwen_tokenizer_and_template_match_reference() {
    let files = inferscale_model::open("qwen2.5-coder-1.5b").unwrap();
    assert_eq!(files.config.vocab_size, 151_936);
    check_against_golden(&files, "qwen2.5-coder-1.5b.json");
}

/// The golden's tokenizations, chat renderings and prompt ids (raw prompts:
/// with the special tokens the model's metadata asks for).
fn check_against_golden(files: &inferscale_model::ModelFiles, name: &str) {
    let tok = files.tokenizer.as_ref().unwrap();
    let tmpl = files.chat_template.as_ref().unwrap();
    let g = golden(name);
    for t in g["tokenize"].as_array().unwrap() {
        let text = t["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(t["ids"].clone()).unwrap();
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got, want, "tokenizing {text:?}");
        // Special-token text decodes back only when specials are kept.
        assert_eq!(tok.decode(&got, false).unwrap(), text, "round trip of {text:?}");
    }
    for c in g["cases"].as_array().unwrap() {
        let prompt = c["prompt"].as_str().unwrap();
        let rendered = c["rendered"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(c["input_ids"].clone()).unwrap();
        let ids = if c["chat"].as_bool().unwrap() {
            let text = tmpl.render(&[Message::new("user", prompt)], true).unwrap();
            assert_eq!(text, rendered, "chat rendering of {prompt:?}");
            tok.encode(&text, false).unwrap()
        } else {
            assert_eq!(prompt, rendered);
            tok.encode(prompt, true).unwrap()
        };
        assert_eq!(ids, want, "input ids of {:?}", c["name"]);
    }
}
