//! Chat templates: the model's own Jinja template rendered with minijinja.
//!
//! Rendering the template the model ships (GGUF `tokenizer.chat_template` or
//! `tokenizer_config.json`) is what makes our prompts byte-identical to the
//! reference tokenizer's `apply_chat_template`, default system prompt
//! included. Python string methods used by real templates (`.strip()`,
//! `.startswith()`, ...) come from minijinja-contrib's pycompat layer.

use minijinja::{Environment, ErrorKind, context};
use serde::Serialize;

use crate::error::{ModelError, Result};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.to_string(), content: content.to_string() }
    }
}

/// Templates of the supported families, for model files that ship none.
/// Each is the template its family's reference tokenizer ships, verified
/// against Jinja2 as transformers renders it (tests/golden/chat_templates.json).
pub mod builtin {
    /// ChatML as SmolLM2 ships it (with its default system prompt).
    pub const CHATML_SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// ChatML as Qwen2 Instruct ships it.
    pub const CHATML_QWEN2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// Llama-3 Instruct (BOS, header ids, trimmed content, `<|eot_id|>`).
    pub const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    /// A template by name (`chatml`, `smollm2`, `qwen2`, `llama3`).
    pub fn by_name(name: &str) -> Option<&'static str> {
        Some(match name {
            "smollm2" => CHATML_SMOLLM2,
            "chatml" | "qwen2" => CHATML_QWEN2,
            "llama3" => LLAMA3,
            _ => return None,
        })
    }
}

/// A compiled chat template (cheap to clone: the compiled template is shared).
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the strings templates may reference.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // HF renders with trim_blocks and lstrip_blocks.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| ModelError::ChatTemplate(format!("does not compile: {e}")))?;
        Ok(ChatTemplate { env, bos_token: bos_token.to_string(), eos_token: eos_token.to_string() })
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the
    /// assistant's reply begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template(NAME).map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| ModelError::ChatTemplate(format!("render failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_default_system_prompt() {
        let t = ChatTemplate::new(builtin::CHATML_SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let s = t.render(&[Message::new("user", "hi")], true).unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let s = t.render(&[Message::new("system", "S"), Message::new("user", "hi")], false).unwrap();
        assert_eq!(s, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }

    #[test]
    fn bad_template_is_an_error() {
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }
}
