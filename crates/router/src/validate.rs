//! What an OpenAI request may ask, checked before a worker sees it: the
//! JSON body (a bad field named by its path), the parameters we do not
//! implement (refused by name, never ignored), and the request turned into
//! the one request vocabulary ([`Generation`]) and admitted by the rules
//! the worker applies too ([`inferscale_types::admit`]). Every refusal
//! names its parameter (OpenAI's `param`).

use inferscale_types::{
    Blend, BlendSelect, Generation, Input, Limits, MemoryRequest, Message, Mode, Role, Sampling, Scope, check_user,
};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::auth::scoped;
use crate::error::{ApiError, Result};
use crate::openai::{self, ChatRequest, CompletionRequest, MemoryOptions, SamplingFields};
use crate::state::AppState;

/// Parses a JSON body; an error names the offending field (as `param`).
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T> {
    typed(&object(body)?)
}

/// A body as a JSON object, read once. Broken JSON, or JSON that is not an
/// object, is the body's fault as a whole; only a well-formed value of the
/// wrong kind is a field's ([`typed`]).
pub fn object(body: &[u8]) -> Result<Value> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::BadRequest("request body is not valid UTF-8".into()));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(ApiError::BadRequest("invalid JSON body: expected a JSON object".into())),
        Err(e) => Err(ApiError::BadRequest(format!("invalid JSON body: {e}"))),
    }
}

/// `v` as a `T`; an error names the offending field (as `param`).
pub fn typed<T: DeserializeOwned>(v: &Value) -> Result<T> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        match path.as_str() {
            "." | "" => ApiError::BadRequest(format!("invalid JSON body: {inner}")),
            // serde's own words start "invalid type"/"invalid value"/…
            _ => ApiError::param(path, inner.to_string()),
        }
    })
}

/// OpenAI parameters we do not implement. Unknown fields outside this list
/// are ignored (clients send vendor extensions).
const UNSUPPORTED: &[&str] = &[
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "logit_bias",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "best_of",
    "echo",
    "suffix",
];

/// Refuses the first of [`UNSUPPORTED`] that a (parsed, so valid JSON)
/// body sets to anything but its neutral value (null, false, 0, an empty
/// list or object, `"auto"` or `"none"` tool choice, `{"type": "text"}`
/// response format): a client that asks for what we do not do is told so,
/// naming the parameter, rather than answered as if it had not asked.
pub fn check_unsupported(body: &Value) -> Result<()> {
    let Value::Object(other) = body else { return Ok(()) };
    for &name in UNSUPPORTED {
        let Some(v) = other.get(name) else { continue };
        let neutral = match v {
            Value::Null | Value::Bool(false) => true,
            Value::Number(n) => n.as_f64() == Some(0.0) || (name == "best_of" && n.as_f64() == Some(1.0)),
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty() || (name == "response_format" && o.get("type") == Some(&"text".into())),
            Value::String(s) => matches!((name, s.as_str()), ("tool_choice" | "function_call", "none" | "auto")),
            Value::Bool(true) => false,
        };
        if !neutral {
            return Err(ApiError::Unsupported(name.to_string()));
        }
    }
    Ok(())
}

/// Which OpenAI endpoint a generation answers: the response shapes differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/chat/completions`: `chat.completion` objects, `message`/`delta`.
    Chat,
    /// `/v1/completions`: `text_completion` objects, `text`.
    Text,
}

/// A request admitted, ready for a worker.
pub struct Validated {
    /// The user scoped by the key's tenant.
    pub generation: Generation,
    pub kind: Kind,
    pub stream: bool,
    pub include_usage: bool,
    /// The client's own user id (empty for none).
    pub user: String,
}

/// A message's text: a string or text parts; null only where `null_ok`
/// (an assistant message that made tool calls).
pub fn content_text(v: &Value, param: &str, null_ok: bool) -> Result<String> {
    match v {
        Value::String(t) => Ok(t.clone()),
        Value::Null if null_ok => Ok(String::new()),
        Value::Array(parts) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => Ok(t),
                (kind, _) => Err(ApiError::param(
                    format!("{param}[{j}]"),
                    format!("a part of type {} is not supported (text parts only)", kind.unwrap_or("(none)")),
                )),
            })
            .collect::<Result<Vec<&str>>>()
            .map(|t| t.concat()),
        _ => Err(ApiError::param(param, "must be a string or a list of text parts")),
    }
}

/// A chat request's messages, roles parsed.
fn messages(r: &[openai::Message]) -> Result<Vec<Message>> {
    r.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = Role::parse(&m.role, i)?;
            let content = content_text(&m.content, &format!("messages[{i}].content"), role == Role::Assistant)?;
            Ok(Message { role, content })
        })
        .collect()
}

/// `stop`: a string or a list of strings.
fn stops(v: Option<&Value>) -> Result<Vec<String>> {
    let bad = || ApiError::param("stop", "must be a string or a list of strings");
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => a.iter().map(|s| s.as_str().map(str::to_string).ok_or_else(bad)).collect(),
        Some(_) => Err(bad()),
    }
}

/// The sampling a request asks for, OpenAI's defaults where it says nothing.
fn sampling(f: &SamplingFields, max_tokens: Option<u32>, default_max: u32, logprobs: Option<u32>) -> Result<Sampling> {
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(k) => return Err(ApiError::param("top_k", format!("{k}: must be -1 (no cut) or positive"))),
    };
    let d = Sampling::default();
    Ok(Sampling {
        temperature: f.temperature.unwrap_or(d.temperature),
        top_p: f.top_p.unwrap_or(d.top_p),
        top_k,
        min_p: f.min_p.unwrap_or(d.min_p),
        repetition_penalty: f.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: f.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: f.frequency_penalty.unwrap_or(d.frequency_penalty),
        // Unseeded requests differ from one another, as OpenAI's do.
        seed: f.seed.unwrap_or_else(crate::state::unique),
        max_tokens: max_tokens.unwrap_or(default_max),
        max_tokens_defaulted: max_tokens.is_none(),
        stop: stops(f.stop.as_ref())?,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        logprobs,
    })
}

/// How a request uses memory: a request without a user has none to use, so
/// unless it names a memory mode it is answered without.
fn memory(s: &AppState, m: Option<MemoryOptions>, user: Option<&str>) -> Result<MemoryRequest> {
    let m = m.unwrap_or_default();
    let mode = match (m.mode, user) {
        (Some(mode), _) => mode,
        (None, None) => Mode::None,
        (None, Some(_)) => s.defaults.mode,
    };
    if mode != Mode::Blend
        && let Some((param, _)) = [
            ("memory.blend_ratio", m.blend_ratio.is_some()),
            ("memory.blend_focus", m.blend_focus.is_some()),
            ("memory.blend_select", m.blend_select.is_some()),
        ]
        .into_iter()
        .find(|(_, set)| *set)
    {
        return Err(ApiError::param(param, format!("applies to memory.mode \"blend\", not \"{mode}\"")));
    }
    Ok(MemoryRequest {
        mode,
        k: m.k.map_or(s.defaults.k, |k| u32::try_from(k).unwrap_or(u32::MAX)),
        window: m.window,
        blend: Blend {
            ratio: m.blend_ratio.unwrap_or(s.defaults.blend_ratio),
            focus: m.blend_focus.unwrap_or(inferscale_types::DEFAULT_BLEND_FOCUS),
            select: match m.blend_select.as_deref() {
                Some(name) => BlendSelect::parse(name, "memory.blend_select").map_err(ApiError::from)?,
                None => BlendSelect::default(),
            },
        },
        scope: Scope { agent_id: m.agent_id, run_id: m.run_id },
        instruction: m.instruction,
    })
}

/// Admits `g` (the client's user id in it) under `tenant`: the model, `n`,
/// the user id's form, then the shared rules; the user is then scoped.
fn admit(s: &AppState, tenant: &str, model: &str, n: Option<u32>, mut g: Generation) -> Result<Generation> {
    if model != s.model {
        return Err(ApiError::NotFound(format!("model `{model}` does not exist; this server serves `{}`", s.model)));
    }
    if n.is_some_and(|n| n != 1) {
        return Err(ApiError::param("n", "only 1 choice per request is supported"));
    }
    if !g.user.is_empty() {
        check_user(&g.user)?;
    }
    inferscale_types::admit(&g, &Limits { max_k: s.defaults.max_k })?;
    if !g.user.is_empty() {
        g.user = scoped(tenant, &g.user);
    }
    Ok(g)
}

/// `POST /v1/chat/completions`, checked.
pub fn chat(s: &AppState, tenant: &str, r: ChatRequest, f: &SamplingFields) -> Result<Validated> {
    let logprobs = match (r.logprobs, r.top_logprobs) {
        (Some(true), n) => Some(n.unwrap_or(0)),
        (_, Some(n)) if n > 0 => return Err(ApiError::param("top_logprobs", "requires `logprobs: true`")),
        _ => None,
    };
    let max_tokens = r.max_completion_tokens.or(r.max_tokens);
    let generation = Generation {
        user: r.user.clone().unwrap_or_default(),
        input: Input::Chat(messages(&r.messages)?),
        memory: memory(s, r.memory, r.user.as_deref())?,
        sampling: sampling(f, max_tokens, s.defaults.max_tokens, logprobs)?,
    };
    let include_usage = r.stream_options.is_some_and(|o| o.include_usage);
    Ok(Validated {
        generation: admit(s, tenant, &r.model, r.n, generation)?,
        kind: Kind::Chat,
        stream: r.stream,
        include_usage,
        user: r.user.unwrap_or_default(),
    })
}

/// `POST /v1/completions`, checked.
pub fn completion(s: &AppState, tenant: &str, r: CompletionRequest, f: &SamplingFields) -> Result<Validated> {
    let prompt = r.prompt.text()?;
    let max_tokens = Some(r.max_tokens.unwrap_or(openai::COMPLETION_MAX_TOKENS));
    let generation = Generation {
        user: r.user.clone().unwrap_or_default(),
        input: Input::Prompt(prompt),
        memory: memory(s, r.memory, r.user.as_deref())?,
        sampling: sampling(f, max_tokens, s.defaults.max_tokens, r.logprobs)?,
    };
    let include_usage = r.stream_options.is_some_and(|o| o.include_usage);
    Ok(Validated {
        generation: admit(s, tenant, &r.model, r.n, generation)?,
        kind: Kind::Text,
        stream: r.stream,
        include_usage,
        user: r.user.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: &str) -> Option<String> {
        match object(body.as_bytes()).and_then(|v| check_unsupported(&v)) {
            Ok(()) => None,
            Err(ApiError::Unsupported(p)) => Some(p),
            Err(e) => panic!("unexpected error {e}"),
        }
    }

    #[test]
    fn parameters_we_do_not_implement_are_refused_by_name_unless_neutral() {
        assert_eq!(refused(r#"{"tools": [{"type": "function"}]}"#).as_deref(), Some("tools"));
        assert_eq!(refused(r#"{"response_format": {"type": "json_object"}}"#).as_deref(), Some("response_format"));
        assert_eq!(refused(r#"{"tool_choice": "required"}"#).as_deref(), Some("tool_choice"));
        assert_eq!(refused(r#"{"logit_bias": {"42": 5}}"#).as_deref(), Some("logit_bias"));
        // What a client sends when it does not ask for the feature.
        assert_eq!(refused(r#"{"tools": [], "tool_choice": "none", "best_of": 1}"#), None);
        assert_eq!(refused(r#"{"response_format": {"type": "text"}, "logit_bias": {}}"#), None);
        // Implemented now: not refused.
        assert_eq!(refused(r#"{"logprobs": true, "top_logprobs": 3, "presence_penalty": 0.5}"#), None);
        // Unknown fields are vendor extensions: ignored.
        assert_eq!(refused(r#"{"my_extension": true}"#), None);
    }

    #[test]
    fn contents_and_stops_take_openais_shapes_and_name_the_field_otherwise() {
        let parts = serde_json::json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]);
        assert_eq!(content_text(&parts, "messages[0].content", false).ok().as_deref(), Some("ab"));
        assert_eq!(content_text(&Value::Null, "m", true).ok().as_deref(), Some(""));
        let param = |e: ApiError| e.body()["error"]["param"].as_str().map(str::to_string);
        let image = serde_json::json!([{"type": "image_url"}]);
        assert_eq!(
            content_text(&image, "messages[1].content", false).map_err(param),
            Err(Some("messages[1].content[0]".into()))
        );
        assert_eq!(
            content_text(&Value::Null, "messages[2].content", false).map_err(param),
            Err(Some("messages[2].content".into()))
        );
        assert_eq!(stops(Some(&serde_json::json!("x"))).ok(), Some(vec!["x".to_string()]));
        assert_eq!(stops(Some(&serde_json::json!([1]))).map_err(param), Err(Some("stop".into())));
    }

    #[test]
    fn a_bad_field_is_named_without_serde_internals() {
        let e = parse::<SamplingFields>(br#"{"model": "m", "messages": [], "temperature": "hot"}"#).expect_err("bad");
        assert_eq!(e.body()["error"]["param"], "temperature");
        assert!(!e.to_string().contains("untagged"), "{e}");
    }
}
