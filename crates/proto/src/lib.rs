//! InferScale's gRPC API (`proto/inferscale.proto`), generated with tonic;
//! the one conversion between the API's messages and the shared words of
//! `inferscale-types`; the error kinds a worker attaches to a status so that
//! callers act on a kind, never on its text; and how the API's connections
//! are secured ([`tls`]).

// Generated code is not ours to lint; the rest of the crate is.
#[allow(clippy::all)]
pub mod v1 {
    tonic::include_proto!("inferscale.v1");
}

pub use v1::*;

use inferscale_types as types;

pub mod tls;

/// The URI a gRPC client dials for `addr`: `host:port` as plain HTTP/2, or
/// a URI that already names its scheme, unchanged. Worker and etcd
/// addresses are given either way on command lines and in the cluster.
pub fn uri(addr: &str) -> String {
    if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") }
}

impl From<inferscale_types::MemoryUnit> for MemoryUnit {
    fn from(u: inferscale_types::MemoryUnit) -> Self {
        let metadata = match u.metadata.is_empty() {
            true => String::new(),
            false => serde_json::Value::Object(u.metadata).to_string(),
        };
        MemoryUnit {
            id: u.id,
            speaker: u.speaker,
            text: u.text,
            time: u.time,
            source_turn: u.source_turn,
            metadata,
            agent_id: u.agent_id,
            run_id: u.run_id,
            created_ms: 0,
            updated_ms: 0,
        }
    }
}

impl From<inferscale_types::StoredUnit> for MemoryUnit {
    fn from(s: inferscale_types::StoredUnit) -> Self {
        MemoryUnit { created_ms: s.created_ms, updated_ms: s.updated_ms, ..MemoryUnit::from(s.unit) }
    }
}

impl TryFrom<MemoryUnit> for inferscale_types::MemoryUnit {
    /// Why `metadata` is not a JSON object.
    type Error = String;

    fn try_from(u: MemoryUnit) -> Result<Self, String> {
        let metadata = match u.metadata.is_empty() {
            true => serde_json::Map::new(),
            false => serde_json::from_str(&u.metadata)
                .map_err(|e| format!("unit {:?}: metadata is not a JSON object: {e}", u.id))?,
        };
        Ok(inferscale_types::MemoryUnit {
            id: u.id,
            speaker: u.speaker,
            text: u.text,
            time: u.time,
            source_turn: u.source_turn,
            metadata,
            agent_id: u.agent_id,
            run_id: u.run_id,
        })
    }
}

impl From<inferscale_types::Mode> for MemoryMode {
    fn from(m: inferscale_types::Mode) -> Self {
        match m {
            inferscale_types::Mode::Kv => MemoryMode::Kv,
            inferscale_types::Mode::Blend => MemoryMode::Blend,
            inferscale_types::Mode::Prompt => MemoryMode::Prompt,
            inferscale_types::Mode::None => MemoryMode::None,
        }
    }
}

impl From<inferscale_types::BlendSelect> for BlendSelect {
    fn from(s: inferscale_types::BlendSelect) -> Self {
        match s {
            inferscale_types::BlendSelect::Deviation => BlendSelect::Deviation,
            inferscale_types::BlendSelect::Question => BlendSelect::Question,
            inferscale_types::BlendSelect::FactStarts => BlendSelect::FactStarts,
        }
    }
}

impl BlendSelect {
    /// The selection this names; unspecified is the default.
    pub fn to_select(self) -> inferscale_types::BlendSelect {
        match self {
            BlendSelect::Unspecified => inferscale_types::BlendSelect::default(),
            BlendSelect::Deviation => inferscale_types::BlendSelect::Deviation,
            BlendSelect::Question => inferscale_types::BlendSelect::Question,
            BlendSelect::FactStarts => inferscale_types::BlendSelect::FactStarts,
        }
    }
}

impl MemoryMode {
    /// The mode a request names; an unspecified mode is `kv`, the default.
    pub fn to_mode(self) -> inferscale_types::Mode {
        match self {
            MemoryMode::Kv | MemoryMode::Unspecified => inferscale_types::Mode::Kv,
            MemoryMode::Blend => inferscale_types::Mode::Blend,
            MemoryMode::Prompt => inferscale_types::Mode::Prompt,
            MemoryMode::None => inferscale_types::Mode::None,
        }
    }
}

impl GenerateRequest {
    /// The message a router sends for `g`; `deadline_ms` is how long it
    /// will wait in all.
    pub fn new(g: &types::Generation, deadline_ms: u32) -> GenerateRequest {
        let (messages, prompt) = match &g.input {
            types::Input::Chat(m) => (
                m.iter().map(|m| ChatMessage { role: m.role.as_str().into(), content: m.content.clone() }).collect(),
                None,
            ),
            types::Input::Prompt(p) => (Vec::new(), Some(p.clone())),
        };
        let m = &g.memory;
        let s = &g.sampling;
        GenerateRequest {
            request_id: String::new(),
            user: g.user.clone(),
            messages,
            mode: MemoryMode::from(m.mode) as i32,
            k: m.k,
            window: m.window,
            sampling: Some(Sampling {
                temperature: s.temperature,
                top_p: s.top_p,
                top_k: s.top_k,
                seed: s.seed,
                max_tokens: s.max_tokens,
                max_tokens_defaulted: s.max_tokens_defaulted,
                stop: s.stop.clone(),
                ignore_eos: s.ignore_eos,
                min_p: s.min_p,
                repetition_penalty: s.repetition_penalty,
                presence_penalty: s.presence_penalty,
                frequency_penalty: s.frequency_penalty,
                logprobs: s.logprobs,
            }),
            deadline_ms,
            blend_ratio: (m.mode == types::Mode::Blend).then_some(m.blend.ratio),
            blend_focus: (m.mode == types::Mode::Blend).then_some(m.blend.focus),
            blend_select: BlendSelect::from(m.blend.select).into(),
            prompt,
            agent_id: m.scope.agent_id.clone().unwrap_or_default(),
            run_id: m.scope.run_id.clone().unwrap_or_default(),
            instruction: m.instruction.clone(),
        }
    }

    /// The generation this message asks for (not yet admitted: see
    /// [`types::admit`]). Unset fields take their defaults.
    pub fn generation(self) -> Result<types::Generation, types::Refusal> {
        let input = match (self.prompt, self.messages.is_empty()) {
            (Some(p), true) => types::Input::Prompt(p),
            (Some(_), false) => {
                return Err(types::Refusal::new("prompt", "a request has either a prompt or messages, not both"));
            }
            (None, _) => types::Input::Chat(
                self.messages
                    .into_iter()
                    .enumerate()
                    .map(|(i, m)| Ok(types::Message { role: types::Role::parse(&m.role, i)?, content: m.content }))
                    .collect::<Result<_, types::Refusal>>()?,
            ),
        };
        let mode = MemoryMode::try_from(self.mode)
            .map_err(|_| types::Refusal::new("memory.mode", format!("{} is not a memory mode", self.mode)))?
            .to_mode();
        let s = self.sampling.unwrap_or_default();
        let unset_one = |v: f32| if v == 0.0 { 1.0 } else { v };
        Ok(types::Generation {
            user: self.user,
            input,
            memory: types::MemoryRequest {
                mode,
                k: self.k,
                window: self.window,
                blend: types::Blend {
                    ratio: self.blend_ratio.unwrap_or(types::DEFAULT_BLEND_RATIO),
                    focus: self.blend_focus.unwrap_or(types::DEFAULT_BLEND_FOCUS),
                    select: BlendSelect::try_from(self.blend_select)
                        .map_err(|_| {
                            types::Refusal::new(
                                "memory.blend_select",
                                format!("{} is not a blend selection", self.blend_select),
                            )
                        })?
                        .to_select(),
                },
                scope: scope(&self.agent_id, &self.run_id),
                instruction: self.instruction,
            },
            sampling: types::Sampling {
                temperature: s.temperature,
                top_p: unset_one(s.top_p),
                top_k: s.top_k,
                min_p: s.min_p,
                repetition_penalty: unset_one(s.repetition_penalty),
                presence_penalty: s.presence_penalty,
                frequency_penalty: s.frequency_penalty,
                seed: s.seed,
                max_tokens: if s.max_tokens == 0 { types::Sampling::default().max_tokens } else { s.max_tokens },
                max_tokens_defaulted: s.max_tokens_defaulted || s.max_tokens == 0,
                stop: s.stop,
                ignore_eos: s.ignore_eos,
                logprobs: s.logprobs,
            },
        })
    }
}

impl From<types::FactSources> for FactSources {
    fn from(s: types::FactSources) -> Self {
        FactSources { device: s.device, host: s.host, disk: s.disk, prefilled: s.prefilled }
    }
}

impl From<FactSources> for types::FactSources {
    fn from(s: FactSources) -> Self {
        types::FactSources { device: s.device, host: s.host, disk: s.disk, prefilled: s.prefilled }
    }
}

/// The status metadata key under which a refused request's parameter at
/// fault travels (OpenAI's `param`), beside its message.
pub const PARAM: &str = "inferscale-param";

/// An `INVALID_ARGUMENT` status for `r`, its parameter attached.
pub fn refused(r: &types::Refusal) -> tonic::Status {
    let mut status = tonic::Status::invalid_argument(r.to_string());
    if let Ok(v) = tonic::metadata::MetadataValue::try_from(r.param.as_str()) {
        status.metadata_mut().insert(PARAM, v);
    }
    status
}

/// The parameter a refusal status names, if it does.
pub fn refused_param(status: &tonic::Status) -> Option<String> {
    status.metadata().get(PARAM)?.to_str().ok().map(str::to_string)
}

/// The status metadata key under which a worker names the kind of an
/// error that its code alone does not tell apart.
pub const ERROR_KIND: &str = "inferscale-error-kind";

/// Kinds of [`ERROR_KIND`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// `UNAVAILABLE` because the user's memory is moving between workers:
    /// the worker itself is fine; retry (on the user's new home).
    Moving,
    /// `RESOURCE_EXHAUSTED` because the worker's disk is full: the request
    /// changed nothing (HTTP 507), not a busy queue (429).
    DiskFull,
    /// `UNAVAILABLE` because the user's memory is damaged on this worker:
    /// another replica may serve it.
    Damaged,
    /// `UNAVAILABLE` because an earlier ingest of the user is still being
    /// undone on this worker: retry shortly.
    Unsettled,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Moving => "moving",
            ErrorKind::DiskFull => "disk-full",
            ErrorKind::Damaged => "damaged",
            ErrorKind::Unsettled => "unsettled",
        }
    }

    /// `status` marked as of this kind.
    pub fn mark(self, mut status: tonic::Status) -> tonic::Status {
        status.metadata_mut().insert(ERROR_KIND, tonic::metadata::MetadataValue::from_static(self.as_str()));
        status
    }

    /// The kind `status` is marked with, if any.
    pub fn of(status: &tonic::Status) -> Option<ErrorKind> {
        match status.metadata().get(ERROR_KIND)?.to_str().ok()? {
            "moving" => Some(ErrorKind::Moving),
            "disk-full" => Some(ErrorKind::DiskFull),
            "damaged" => Some(ErrorKind::Damaged),
            "unsettled" => Some(ErrorKind::Unsettled),
            _ => None,
        }
    }
}

/// A request's scope from its proto fields (empty: not scoped).
pub fn scope(agent_id: &str, run_id: &str) -> inferscale_types::Scope {
    let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
    inferscale_types::Scope { agent_id: some(agent_id), run_id: some(run_id) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_survives_the_wire_and_a_refusal_keeps_its_param() {
        let g = types::Generation {
            user: "t/ana".into(),
            input: types::Input::Chat(vec![
                types::Message::new(types::Role::Developer, "Be brief."),
                types::Message::new(types::Role::User, "Where do I live?"),
            ]),
            memory: types::MemoryRequest {
                mode: types::Mode::Blend,
                k: 7,
                window: Some(20),
                blend: types::Blend { ratio: 0.3, focus: 0.5, select: types::BlendSelect::Question },
                scope: types::Scope { agent_id: Some("bot".into()), run_id: None },
                instruction: Some(String::new()),
            },
            sampling: types::Sampling {
                temperature: 0.7,
                top_k: 40,
                min_p: 0.05,
                repetition_penalty: 1.1,
                presence_penalty: -0.5,
                frequency_penalty: 0.25,
                seed: 9,
                max_tokens: 12,
                stop: vec!["\n".into()],
                logprobs: Some(3),
                ..types::Sampling::default()
            },
        };
        assert_eq!(GenerateRequest::new(&g, 1000).generation(), Ok(g.clone()));
        let completion = types::Generation { input: types::Input::Prompt("Once".into()), ..g };
        assert_eq!(GenerateRequest::new(&completion, 0).generation(), Ok(completion));
        let mut bad = GenerateRequest::new(&types::Generation { ..completion_with_chat() }, 0);
        bad.messages[0].role = "tool".into();
        let r = bad.generation().expect_err("tool is not a role");
        let status = refused(&r);
        assert_eq!(refused_param(&status).as_deref(), Some("messages[0].role"));
        assert_eq!(status.message(), r.to_string());
    }

    fn completion_with_chat() -> types::Generation {
        types::Generation {
            user: String::new(),
            input: types::Input::Chat(vec![types::Message::new(types::Role::User, "hi")]),
            memory: types::MemoryRequest::none(),
            sampling: types::Sampling::default(),
        }
    }
}
