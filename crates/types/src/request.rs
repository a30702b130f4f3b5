//! One request vocabulary: what a generation asks for — the conversation,
//! how it uses the user's memory, how tokens are sampled — and the rules
//! it is admitted by.
//!
//! The router and the worker both call [`admit`]: the router to answer a
//! bad request before it travels, the worker because it cannot trust its
//! caller. One function means one text per rule, so the two answers are
//! the same words and a rule fixed once is fixed everywhere. What only a
//! worker knows (its window, whether its engine blends, the model's context
//! length) it checks itself.

use serde::{Deserialize, Serialize};

use crate::{Mode, Scope};

/// Who said a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    /// OpenAI's newer name for a system message; rendered as one.
    Developer,
    User,
    Assistant,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::System, Role::Developer, Role::User, Role::Assistant];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    /// Whether the message instructs the model rather than converses.
    pub fn instructs(self) -> bool {
        matches!(self, Role::System | Role::Developer)
    }

    /// The role a message at `messages[index]` names, or the refusal.
    pub fn parse(name: &str, index: usize) -> Result<Role, Refusal> {
        Role::ALL.into_iter().find(|r| r.as_str() == name).ok_or_else(|| {
            Refusal::new(
                format!("messages[{index}].role"),
                format!("{name:?} is not a supported role (system, developer, user or assistant)"),
            )
        })
    }
}

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Message {
        Message { role, content: content.into() }
    }
}

/// What a generation continues: a chat (rendered with the model's chat
/// template) or a raw completion prompt (no template).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Chat(Vec<Message>),
    Prompt(String),
}

impl Input {
    /// The text memory is retrieved for: the last message, or the prompt.
    pub fn question(&self) -> &str {
        match self {
            Input::Chat(m) => m.last().map_or("", |m| m.content.as_str()),
            Input::Prompt(p) => p,
        }
    }
}

/// kv+blend's parameters (docs/serving.md, "Memory modes"): the share of
/// injected tokens recomputed with the question, how they are chosen, and
/// the share of them spent on the memory's last tokens — the best-ranked
/// facts, nearest the question — whatever the selection says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Blend {
    pub ratio: f32,
    pub focus: f32,
    pub select: BlendSelect,
}

/// How kv+blend picks the injected tokens it recomputes (docs/design.md
/// §1.2, docs/locomo.md "Which tokens to recompute").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlendSelect {
    /// The tokens whose layer-1 values move most when recomputed with the
    /// memory before them (CacheBlend's signal: the facts alone).
    #[default]
    Deviation,
    /// The tokens the question attends to most at layer 1, where its
    /// queries are already exact (layer 0 of an injected token is).
    Question,
    /// The first tokens of every fact, equally (EPIC's signal: where a
    /// fact encoded alone differs most from one encoded in context).
    FactStarts,
}

impl BlendSelect {
    pub const ALL: [BlendSelect; 3] = [BlendSelect::Deviation, BlendSelect::Question, BlendSelect::FactStarts];

    pub fn as_str(self) -> &'static str {
        match self {
            BlendSelect::Deviation => "deviation",
            BlendSelect::Question => "question",
            BlendSelect::FactStarts => "fact_starts",
        }
    }

    /// The selection `name` names, or the refusal (for the request field `param`).
    pub fn parse(name: &str, param: &str) -> Result<BlendSelect, Refusal> {
        BlendSelect::ALL.into_iter().find(|s| s.as_str() == name).ok_or_else(|| {
            Refusal::new(param, format!("{name:?} is not a blend selection (deviation, question or fact_starts)"))
        })
    }
}

impl std::fmt::Display for BlendSelect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BlendSelect {
    type Err = Refusal;
    fn from_str(s: &str) -> Result<Self, Refusal> {
        BlendSelect::parse(s, "blend selection")
    }
}

/// The share of injected tokens `blend` recomputes when a request does not
/// say: chosen on the LoCoMo dev split with Qwen2.5-Coder-1.5B
/// (docs/locomo.md, "kv+blend").
pub const DEFAULT_BLEND_RATIO: f32 = 0.15;

/// The blend focus when a request does not say: selection by deviation
/// alone (docs/locomo.md, "kv+blend": focus raised agreement with prompt
/// mode but lowered F1).
pub const DEFAULT_BLEND_FOCUS: f32 = 0.0;

impl Default for Blend {
    fn default() -> Self {
        Blend { ratio: DEFAULT_BLEND_RATIO, focus: DEFAULT_BLEND_FOCUS, select: BlendSelect::Deviation }
    }
}

/// How a request's retrieved facts enter its prompt: the mode, with
/// blend's parameters (what the layout needs of a [`MemoryRequest`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recall {
    pub mode: Mode,
    /// Used in [`Mode::Blend`] only.
    pub blend: Blend,
}

impl Recall {
    /// `mode` with the default blend parameters.
    pub fn of(mode: Mode) -> Recall {
        Recall { mode, blend: Blend::default() }
    }
}

/// How a request uses the user's memory.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryRequest {
    pub mode: Mode,
    /// Facts retrieved (unused in [`Mode::None`]).
    pub k: u32,
    /// The context window the caller expects the memory encoded with.
    pub window: Option<u32>,
    /// [`Mode::Blend`]'s parameters (ignored in other modes).
    pub blend: Blend,
    /// Which of the user's units may be retrieved.
    pub scope: Scope,
    /// The words before the question in a memory mode: `None` for the
    /// server's configured instruction, `Some("")` for none.
    pub instruction: Option<String>,
}

impl MemoryRequest {
    pub fn recall(&self) -> Recall {
        Recall { mode: self.mode, blend: self.blend }
    }

    /// No memory at all.
    pub fn none() -> MemoryRequest {
        MemoryRequest {
            mode: Mode::None,
            k: 0,
            window: None,
            blend: Blend::default(),
            scope: Scope::default(),
            instruction: None,
        }
    }
}

/// How tokens are chosen and when generation stops, as requested. The
/// neutral value of every optional adjustment leaves the model's
/// distribution as it is (`top_k` 0, `min_p` 0, penalties 0 or 1).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0 is greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    pub top_k: u32,
    /// Drop tokens less likely than `min_p` times the most likely one.
    pub min_p: f32,
    /// Divides the positive logits (multiplies the negative ones) of every
    /// token already in the prompt or the output (HF's and vLLM's rule); 1
    /// is none.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    pub seed: u64,
    pub max_tokens: u32,
    /// `max_tokens` is the server's default, not the client's: a worker
    /// lowers it to what the model's context leaves rather than refusing
    /// the request (a client's own `max_tokens` that does not fit is refused).
    pub max_tokens_defaulted: bool,
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Return each chosen token's log-probability and this many of the
    /// most likely alternatives (`None`: no log-probabilities).
    pub logprobs: Option<u32>,
}

impl Default for Sampling {
    /// OpenAI's defaults: temperature 1, nothing cut, 256 tokens.
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            max_tokens: 256,
            max_tokens_defaulted: true,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

/// A generation as the router sends it and the worker runs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The user whose memory is used; empty for none.
    pub user: String,
    pub input: Input,
    pub memory: MemoryRequest,
    pub sampling: Sampling,
}

/// A request refused: the parameter at fault (OpenAI's `param`, a path
/// such as `memory.k` or `messages[2].role`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub param: String,
    pub message: String,
}

impl Refusal {
    pub fn new(param: impl Into<String>, message: impl Into<String>) -> Refusal {
        Refusal { param: param.into(), message: message.into() }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}`: {}", self.param, self.message)
    }
}

impl std::error::Error for Refusal {}

/// A server's limits that [`admit`] checks against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest `memory.k`.
    pub max_k: u32,
}

/// Longest user id, in bytes.
pub const MAX_USER_BYTES: usize = 256;

/// Most stop strings, and the longest: a stop is matched against the
/// generated text at every token, so a long one costs every step and can
/// never match.
pub const MAX_STOPS: usize = 4;
pub const MAX_STOP_BYTES: usize = 1024;

/// Most alternatives `top_logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Longest `memory.instruction`, in bytes.
pub const MAX_INSTRUCTION_BYTES: usize = 4096;

/// A client's user id is 1–256 bytes of printable text (every endpoint
/// that takes one checks it so).
pub fn check_user(user: &str) -> Result<(), Refusal> {
    let bad = |m: String| Err(Refusal::new("user", m));
    if user.is_empty() {
        return bad("is empty".into());
    }
    if user.len() > MAX_USER_BYTES {
        return bad(format!("is longer than {MAX_USER_BYTES} bytes"));
    }
    if user.chars().any(char::is_control) {
        return bad("contains control characters".into());
    }
    Ok(())
}

/// Checks a blend ratio: a number in `0..=1`.
pub fn check_blend_ratio(ratio: f32) -> Result<f32, Refusal> {
    match (0.0..=1.0).contains(&ratio) {
        true => Ok(ratio),
        false => Err(Refusal::new(
            "memory.blend_ratio",
            format!("{ratio} is outside 0..=1 (the share of injected tokens recomputed)"),
        )),
    }
}

/// The rules every generation is admitted by, in the router and again in
/// the worker (see the module docs).
pub fn admit(g: &Generation, limits: &Limits) -> Result<(), Refusal> {
    check_input(&g.input)?;
    check_memory(&g.memory, &g.user, limits)?;
    check_sampling(&g.sampling)
}

/// A chat ends with the user's question; a prompt is not empty.
fn check_input(input: &Input) -> Result<(), Refusal> {
    match input {
        Input::Prompt(p) if p.trim().is_empty() => Err(Refusal::new("prompt", "is empty (or only whitespace)")),
        Input::Prompt(_) => Ok(()),
        Input::Chat(messages) => match messages.last() {
            None => Err(Refusal::new("messages", "is empty")),
            Some(m) if m.role != Role::User => Err(Refusal::new(
                format!("messages[{}].role", messages.len() - 1),
                format!("the last message must be the user's (the question), not {:?}", m.role.as_str()),
            )),
            Some(m) if m.content.trim().is_empty() => Err(Refusal::new(
                format!("messages[{}].content", messages.len() - 1),
                "the question (the last user message) is empty",
            )),
            Some(_) => Ok(()),
        },
    }
}

/// `user` is the id as the worker knows it (a router scopes a client's id
/// by its tenant after [`check_user`]), so only its presence is a rule here.
fn check_memory(m: &MemoryRequest, user: &str, limits: &Limits) -> Result<(), Refusal> {
    if let Some(i) = &m.instruction
        && i.len() > MAX_INSTRUCTION_BYTES
    {
        return Err(Refusal::new("memory.instruction", format!("is longer than {MAX_INSTRUCTION_BYTES} bytes")));
    }
    if m.mode == Mode::None {
        return Ok(());
    }
    if user.is_empty() {
        return Err(Refusal::new(
            "user",
            format!(
                "is required when memory is used (memory.mode = {}); leave memory.mode out or send \"none\" to \
                 chat without memory",
                m.mode
            ),
        ));
    }
    if m.k == 0 || m.k > limits.max_k {
        return Err(Refusal::new("memory.k", format!("{} is outside 1..={}", m.k, limits.max_k)));
    }
    if m.mode == Mode::Blend {
        check_blend_ratio(m.blend.ratio)?;
        if !(0.0..=1.0).contains(&m.blend.focus) {
            return Err(Refusal::new(
                "memory.blend_focus",
                format!("{} is outside 0..=1 (the share of recomputed tokens spent on the best facts)", m.blend.focus),
            ));
        }
    }
    Ok(())
}

fn check_sampling(s: &Sampling) -> Result<(), Refusal> {
    let range = |param: &str, v: f32, lo: f32, hi: f32, open_lo: bool| {
        let ok = v.is_finite() && v <= hi && if open_lo { v > lo } else { v >= lo };
        match ok {
            true => Ok(()),
            false => {
                let (l, r) = if open_lo { ("(", "]") } else { ("[", "]") };
                Err(Refusal::new(param, format!("{v} is outside {l}{lo}, {hi}{r}")))
            }
        }
    };
    range("temperature", s.temperature, 0.0, 2.0, false)?;
    range("top_p", s.top_p, 0.0, 1.0, true)?;
    range("min_p", s.min_p, 0.0, 1.0, false)?;
    range("repetition_penalty", s.repetition_penalty, 0.0, 2.0, true)?;
    range("presence_penalty", s.presence_penalty, -2.0, 2.0, false)?;
    range("frequency_penalty", s.frequency_penalty, -2.0, 2.0, false)?;
    if s.max_tokens == 0 {
        return Err(Refusal::new("max_tokens", "must be at least 1"));
    }
    if s.stop.len() > MAX_STOPS || s.stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(Refusal::new(
            "stop",
            format!("takes up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_BYTES} bytes"),
        ));
    }
    if s.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return Err(Refusal::new("top_logprobs", format!("must be between 0 and {MAX_TOP_LOGPROBS}")));
    }
    Ok(())
}

/// Where the KV of a request's facts came from, in facts: cached on the
/// GPU (`device`) or in pinned host memory (`host`), read from disk while
/// the request waited (`disk`), or on disk only and so prefilled as text
/// with the question (`prefilled`).
/// Summed over many requests (the load test's report) it counts their
/// facts the same way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FactSources {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
    pub prefilled: u32,
}

impl FactSources {
    /// The request's class: the slowest place any of its facts came from
    /// (`none` when it had no facts).
    pub fn class(&self) -> &'static str {
        if self.prefilled > 0 {
            "prefilled"
        } else if self.disk > 0 {
            "disk"
        } else if self.host > 0 {
            "host"
        } else if self.device > 0 {
            "device"
        } else {
            "none"
        }
    }

    pub fn total(&self) -> u64 {
        [self.device, self.host, self.disk, self.prefilled].iter().map(|&n| u64::from(n)).sum()
    }

    /// Adds `o`'s counts (saturating: a sum over a long run stays a bound).
    pub fn add(&mut self, o: &FactSources) {
        self.device = self.device.saturating_add(o.device);
        self.host = self.host.saturating_add(o.host);
        self.disk = self.disk.saturating_add(o.disk);
        self.prefilled = self.prefilled.saturating_add(o.prefilled);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(question: &str) -> Generation {
        Generation {
            user: "ana".into(),
            input: Input::Chat(vec![Message::new(Role::System, "Be brief."), Message::new(Role::User, question)]),
            memory: MemoryRequest { mode: Mode::Kv, k: 5, ..MemoryRequest::none() },
            sampling: Sampling::default(),
        }
    }

    const LIMITS: Limits = Limits { max_k: 200 };

    fn param(g: &Generation) -> Option<String> {
        admit(g, &LIMITS).err().map(|r| r.param)
    }

    #[test]
    fn each_rule_names_the_parameter_at_fault() {
        assert_eq!(param(&chat("Where do I live?")), None);
        assert_eq!(param(&chat("  ")).as_deref(), Some("messages[1].content"));
        let mut g = chat("q");
        g.input = Input::Chat(vec![Message::new(Role::User, "q"), Message::new(Role::Assistant, "a")]);
        assert_eq!(param(&g).as_deref(), Some("messages[1].role"));
        g.input = Input::Chat(Vec::new());
        assert_eq!(param(&g).as_deref(), Some("messages"));
        g.input = Input::Prompt(String::new());
        assert_eq!(param(&g).as_deref(), Some("prompt"));
        type Change = fn(&mut Generation);
        let cases: [(&str, Change); 13] = [
            ("user", |g| g.user.clear()),
            ("memory.k", |g| g.memory.k = 0),
            ("memory.k", |g| g.memory.k = 201),
            ("memory.blend_ratio", |g| (g.memory.mode, g.memory.blend.ratio) = (Mode::Blend, 1.5)),
            ("memory.blend_focus", |g| (g.memory.mode, g.memory.blend.focus) = (Mode::Blend, -0.1)),
            ("temperature", |g| g.sampling.temperature = 2.5),
            ("top_p", |g| g.sampling.top_p = 0.0),
            ("min_p", |g| g.sampling.min_p = f32::NAN),
            ("repetition_penalty", |g| g.sampling.repetition_penalty = 0.0),
            ("frequency_penalty", |g| g.sampling.frequency_penalty = 2.5),
            ("max_tokens", |g| g.sampling.max_tokens = 0),
            ("stop", |g| g.sampling.stop = vec![String::new()]),
            ("top_logprobs", |g| g.sampling.logprobs = Some(21)),
        ];
        for (want, change) in cases {
            let mut g = chat("q");
            change(&mut g);
            let r = admit(&g, &LIMITS).expect_err(want);
            assert_eq!(r.param, want, "{r}");
            assert!(r.to_string().starts_with(&format!("`{want}`: ")), "{r}");
        }
    }

    #[test]
    fn without_memory_no_user_or_k_is_needed_and_blend_settings_apply_only_to_blend() {
        let mut g = chat("q");
        g.user.clear();
        g.memory = MemoryRequest::none();
        assert_eq!(param(&g), None);
        let mut g = chat("q");
        g.memory.blend.ratio = 7.0; // not blend: not looked at
        assert_eq!(param(&g), None);
    }

    #[test]
    fn user_ids_are_printable_and_bounded() {
        assert_eq!(check_user("ana"), Ok(()));
        for bad in ["", "a\nb", &"x".repeat(MAX_USER_BYTES + 1)] {
            assert_eq!(check_user(bad).map_err(|r| r.param), Err("user".to_string()), "{bad:?}");
        }
    }

    #[test]
    fn roles_parse_by_name_and_a_bad_one_names_its_index() {
        for r in Role::ALL {
            assert_eq!(Role::parse(r.as_str(), 0), Ok(r));
        }
        assert_eq!(Role::parse("tool", 3).map_err(|r| r.param), Err("messages[3].role".to_string()));
        assert!(Role::Developer.instructs() && !Role::Assistant.instructs());
    }
}
