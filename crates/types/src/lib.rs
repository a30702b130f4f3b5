//! The words every crate shares, defined once: the memory unit a caller
//! stores ([`MemoryUnit`]), how a request uses memory ([`Mode`]), what a
//! generation asks for and the rules it is admitted by ([`request`]), and
//! how our HTTP clients read an OpenAI-compatible stream ([`sse`]).
//!
//! A leaf crate (serde only) so that the router, the load generator and
//! the evaluation can speak them without the engine stack; the gRPC
//! messages convert to and from them in `inferscale-proto`.

use serde::{Deserialize, Serialize};

pub mod request;
pub mod sse;
pub mod time;

pub use request::{
    Blend, BlendSelect, DEFAULT_BLEND_FOCUS, DEFAULT_BLEND_RATIO, FactSources, Generation, Input, Limits,
    MemoryRequest, Message, Recall, Refusal, Role, Sampling, admit, check_blend_ratio, check_user,
};

/// A memory unit to remember: a conversation turn, or a fact the caller
/// extracted from one (then `source_turn` names that turn). The JSON shape
/// is the HTTP API's (`/v1/memories`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemoryUnit {
    /// Unique within a user: a turn id such as LoCoMo's `D1:3`, or a fact id.
    pub id: String,
    #[serde(default)]
    pub speaker: String,
    pub text: String,
    /// Session date/time as given (e.g. `1:56 pm on 8 May, 2023`).
    #[serde(default)]
    pub time: String,
    /// For a caller-supplied fact: the id of the turn it came from. Its
    /// context window is then the units stored before that turn (when the
    /// turn is stored) instead of the units stored before the fact. Empty
    /// for a conversation turn.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source_turn: String,
    /// The caller's own fields (Mem0's `metadata`): stored with the unit,
    /// returned with it, and matched by search filters; never part of what
    /// the model reads.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// The agent this unit belongs to (Mem0's `agent_id`), empty for none:
    /// a request scoped to an agent retrieves only that agent's units.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub agent_id: String,
    /// The run (session) this unit belongs to (Mem0's `run_id`), likewise.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run_id: String,
}

/// Which of a user's units a request may use: all of them, or those of one
/// agent and/or one run (Mem0's scoping). Units of a user are one memory
/// placed together; a scope narrows what is retrieved, searched and listed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    pub agent_id: Option<String>,
    pub run_id: Option<String>,
}

impl Scope {
    pub fn is_all(&self) -> bool {
        self.agent_id.is_none() && self.run_id.is_none()
    }

    /// Whether `u` is in this scope.
    pub fn contains(&self, u: &MemoryUnit) -> bool {
        self.agent_id.as_ref().is_none_or(|a| *a == u.agent_id) && self.run_id.as_ref().is_none_or(|r| *r == u.run_id)
    }
}

/// A unit as reads return it: with when it was first stored and last
/// changed, in milliseconds since the Unix epoch by the storing worker's
/// clock (0 for units stored before the store kept their history). The
/// times come from the store, never from the caller.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoredUnit {
    pub unit: MemoryUnit,
    pub created_ms: u64,
    pub updated_ms: u64,
}

/// Largest `metadata` of one unit, as JSON text.
pub const MAX_METADATA_BYTES: usize = 16 << 10;

/// Longest unit id (and source turn), in bytes: ids travel in URL paths,
/// where a longer one would be refused (414) after it was stored.
pub const MAX_ID_BYTES: usize = 256;

/// How a request uses the user's memory: its facts injected as stored KV
/// (`kv`); injected, then a share of their tokens recomputed in the
/// question's prefill so that they attend to each other (`blend`, kv+blend:
/// docs/serving.md, "Memory modes"); pasted into the prompt as text and
/// prefilled (`prompt`); or not at all (`none`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Kv,
    Blend,
    Prompt,
    None,
}

impl Mode {
    pub const ALL: [Mode; 4] = [Mode::Kv, Mode::Blend, Mode::Prompt, Mode::None];

    /// The name requests use (`kv`, `blend`, `prompt`, `none`).
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Kv => "kv",
            Mode::Blend => "blend",
            Mode::Prompt => "prompt",
            Mode::None => "none",
        }
    }

    /// Whether the facts' stored KV is injected (`kv`, `blend`).
    pub fn injects(self) -> bool {
        matches!(self, Mode::Kv | Mode::Blend)
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A memory mode name that is not one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownMode(pub String);

impl std::fmt::Display for UnknownMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "memory mode {:?}: expected kv, blend, prompt or none", self.0)
    }
}

impl std::error::Error for UnknownMode {}

impl std::str::FromStr for Mode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Mode, UnknownMode> {
        Mode::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| UnknownMode(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_names_round_trip_in_text_and_json() {
        for m in Mode::ALL {
            assert_eq!(m.as_str().parse::<Mode>(), Ok(m));
            assert_eq!(serde_json::to_string(&m).ok(), Some(format!("\"{m}\"")));
        }
        assert_eq!("KV".parse::<Mode>(), Err(UnknownMode("KV".into())));
        assert!(serde_json::from_str::<Mode>("\"both\"").is_err());
    }

    #[test]
    fn a_unit_needs_only_id_and_text_and_omits_an_empty_source_turn() {
        let u: MemoryUnit = serde_json::from_str(r#"{"id":"D1:3","text":"I moved to Porto."}"#).expect("parses");
        assert_eq!(u, MemoryUnit { id: "D1:3".into(), text: "I moved to Porto.".into(), ..Default::default() });
        let back = serde_json::to_value(&u).expect("serializes");
        assert!(back.get("source_turn").is_none(), "{back}");
        assert!(serde_json::from_str::<MemoryUnit>(r#"{"id":"x"}"#).is_err(), "text is required");
    }
}
