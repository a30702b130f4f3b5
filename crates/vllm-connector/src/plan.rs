//! A request's memory plan: which stored KV fills which prompt positions,
//! carried through vLLM in the request's `kv_transfer_params`, and the
//! scheduler-side decisions made from it.
//!
//! The core composes a prompt (docs/design.md §3: header, facts, question) and
//! issues a plan naming it; vLLM hands the params to the scheduler-side
//! connector (possibly another process), which decides how many tokens are
//! "externally computed", and the worker-side connector, which looks the
//! plan up by id in the core that issued it. The params are claims: the
//! worker side loads only a plan it issued itself, with the same claims,
//! so a client that forges params gets its tokens recomputed, never another
//! user's KV.

use serde::{Deserialize, Serialize};

use crate::error::{ConnectorError, Result};

/// The key under `kv_transfer_params`.
pub const PARAMS_KEY: &str = "inferscale";
/// Version of the params' schema.
pub const PLAN_VERSION: u32 = 1;

/// One run of stored KV: `len` tokens placed at `start`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// The fact's id, or `None` for the prompt header.
    pub fact: Option<String>,
    pub start: usize,
    pub len: usize,
}

/// What the params carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub v: u32,
    /// Issued by the core, random: how the worker side finds its copy.
    pub id: String,
    pub user: String,
    /// The model shape the KV was made with ([`shape_fingerprint`]).
    pub fingerprint: String,
    /// The prefix-cache salt the request must carry ([`salt`]).
    pub salt: String,
    /// Digest of the prompt's first `end` token ids ([`token_digest`]).
    pub digest: String,
    /// Chunks tiling `[0, end)` in order: the header, then the facts.
    pub chunks: Vec<Chunk>,
}

impl Plan {
    /// One past the last memory position: the question starts here.
    pub fn end(&self) -> usize {
        self.chunks.last().map_or(0, |c| c.start + c.len)
    }

    /// Checks the chunks tile `[0, end)` with no gap or overlap.
    pub fn validate(&self) -> Result<()> {
        if self.v != PLAN_VERSION {
            return Err(ConnectorError::Plan(format!("plan version {} (this connector reads {PLAN_VERSION})", self.v)));
        }
        let mut at = 0;
        for c in &self.chunks {
            if c.start != at || c.len == 0 {
                return Err(ConnectorError::Plan(format!(
                    "chunk {:?} at {} of {} tokens: chunks must tile the prompt from 0",
                    c.fact, c.start, c.len
                )));
            }
            at += c.len;
        }
        Ok(())
    }

    /// The params' JSON value, `{"inferscale": {...}}`.
    pub fn to_params(&self) -> serde_json::Value {
        serde_json::json!({ PARAMS_KEY: self })
    }

    /// The plan in `params` (a request's `kv_transfer_params` as JSON), if it has one.
    pub fn from_params(params: &serde_json::Value) -> Result<Option<Plan>> {
        let Some(v) = params.get(PARAMS_KEY) else { return Ok(None) };
        let plan: Plan =
            serde_json::from_value(v.clone()).map_err(|e| ConnectorError::Plan(format!("kv_transfer_params: {e}")))?;
        plan.validate()?;
        Ok(Some(plan))
    }
}

/// Why a plan loads nothing. Each means vLLM computes the tokens itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    Fingerprint {
        plan: String,
        engine: String,
    },
    Salt,
    Tokens,
    /// The memory would cover the whole prompt: vLLM must compute at least
    /// the last token to sample from it.
    NoQuestion,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Fingerprint { plan, engine } => {
                write!(f, "plan made for model {plan}, this engine runs {engine}")
            }
            Refusal::Salt => write!(f, "request's cache_salt is not the plan's (its blocks would be shared)"),
            Refusal::Tokens => write!(f, "prompt tokens differ from the plan's"),
            Refusal::NoQuestion => write!(f, "memory covers the whole prompt"),
        }
    }
}

/// Scheduler side: how many tokens after `num_computed` (vLLM's own prefix
/// cache hits, whole blocks) the connector supplies for a request with
/// `prompt` token ids and `cache_salt`. The memory region is a prefix of
/// the prompt, so this is `end − num_computed` or nothing: the tokens vLLM
/// already has are not loaded again, and the question is always computed
/// by vLLM. `end` need not be block-aligned: the question's first tokens
/// share the memory's last block and vLLM writes their slots itself.
pub fn external_tokens(
    plan: &Plan,
    prompt: &[u32],
    cache_salt: Option<&str>,
    num_computed: usize,
    engine_fingerprint: &str,
) -> std::result::Result<usize, Refusal> {
    if plan.fingerprint != engine_fingerprint {
        return Err(Refusal::Fingerprint { plan: plan.fingerprint.clone(), engine: engine_fingerprint.into() });
    }
    if cache_salt != Some(plan.salt.as_str()) {
        return Err(Refusal::Salt);
    }
    let end = plan.end();
    if end >= prompt.len() {
        return Err(Refusal::NoQuestion);
    }
    if token_digest(&prompt[..end]) != plan.digest {
        return Err(Refusal::Tokens);
    }
    Ok(end.saturating_sub(num_computed))
}

/// The model facts the KV depends on, as both sides can compute them: the
/// core from its model files, the scheduler side from vLLM's HF config.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShape {
    pub architecture: String,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    /// Rotated dimensions per head.
    pub rotary_dim: usize,
    /// HF's name of the frequency scaling (`default`, `linear`, `llama3`).
    pub rope_type: String,
}

/// A short string naming a model shape; two engines with equal strings
/// lay out and rotate KV the same way. Weights are not in it: the core and
/// vLLM are pointed at the same model files by configuration.
pub fn shape_fingerprint(m: &ModelShape) -> String {
    format!(
        "{}:L{}:kv{}x{}:h{}:v{}:rope-{}-{}/{}",
        m.architecture,
        m.num_layers,
        m.num_kv_heads,
        m.head_dim,
        m.hidden_size,
        m.vocab_size,
        m.rope_type,
        m.rope_theta,
        m.rotary_dim
    )
}

/// The prefix-cache salt of a plan: vLLM folds a request's salt into the
/// hash of its first block, so blocks holding injected KV are reused only
/// by requests of the same user, memory generation and chunk layout — the
/// only requests whose KV at those positions is the same. Another user, a
/// prompt-mode request with the same text, or this user after an ingest
/// or forget never hits them.
pub fn salt(user: &str, generation: u64, fingerprint: &str, chunks: &[Chunk]) -> String {
    let mut h = Fnv::new();
    h.bytes(user.as_bytes());
    h.bytes(&generation.to_le_bytes());
    h.bytes(fingerprint.as_bytes());
    for c in chunks {
        h.bytes(c.fact.as_deref().unwrap_or("").as_bytes());
        h.bytes(&(c.start as u64).to_le_bytes());
        h.bytes(&(c.len as u64).to_le_bytes());
    }
    format!("inferscale-{:016x}", h.finish())
}

/// The prefix-cache salt of a prompt-mode request (the same token ids as a
/// kv-mode one, every token prefilled by vLLM): its own namespace per user
/// and memory generation, apart from every plan's, so that it never reuses
/// blocks holding injected KV — the baseline stays a prefill — nor another
/// user's blocks.
pub fn prompt_salt(user: &str, generation: u64, fingerprint: &str) -> String {
    let mut h = Fnv::new();
    h.bytes(b"prompt");
    h.bytes(user.as_bytes());
    h.bytes(&generation.to_le_bytes());
    h.bytes(fingerprint.as_bytes());
    format!("inferscale-prompt-{:016x}", h.finish())
}

/// Digest of token ids (FNV-1a, 64 bits): catches a plan paired with
/// another prompt by mistake. Not a security boundary: the worker side
/// trusts only plans it issued.
pub fn token_digest(tokens: &[u32]) -> String {
    let mut h = Fnv::new();
    for t in tokens {
        h.bytes(&t.to_le_bytes());
    }
    format!("{:016x}", h.finish())
}

struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    /// Length-prefixed, so `("ab", "c")` and `("a", "bc")` differ.
    fn bytes(&mut self, b: &[u8]) {
        for &x in (b.len() as u64).to_le_bytes().iter().chain(b) {
            self.0 ^= u64::from(x);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(prompt: &[u32]) -> Plan {
        let chunks = vec![
            Chunk { fact: None, start: 0, len: 5 },
            Chunk { fact: Some("D1:1".into()), start: 5, len: 20 },
            Chunk { fact: Some("D1:2".into()), start: 25, len: 12 },
        ];
        Plan {
            v: PLAN_VERSION,
            id: "p".into(),
            user: "u".into(),
            fingerprint: "m".into(),
            salt: salt("u", 0, "m", &chunks),
            digest: token_digest(&prompt[..37]),
            chunks,
        }
    }

    #[test]
    fn supplies_what_the_prefix_cache_lacks() {
        let prompt: Vec<u32> = (0..50).collect();
        let p = plan(&prompt);
        p.validate().unwrap();
        let s = Some(p.salt.as_str());
        assert_eq!(external_tokens(&p, &prompt, s, 0, "m"), Ok(37));
        assert_eq!(external_tokens(&p, &prompt, s, 32, "m"), Ok(5));
        assert_eq!(external_tokens(&p, &prompt, s, 48, "m"), Ok(0));
    }

    #[test]
    fn refuses_on_any_mismatch() {
        let prompt: Vec<u32> = (0..50).collect();
        let p = plan(&prompt);
        let s = Some(p.salt.as_str());
        assert!(matches!(external_tokens(&p, &prompt, s, 0, "other"), Err(Refusal::Fingerprint { .. })));
        assert_eq!(external_tokens(&p, &prompt, None, 0, "m"), Err(Refusal::Salt));
        assert_eq!(external_tokens(&p, &prompt, Some("x"), 0, "m"), Err(Refusal::Salt));
        let mut other = prompt.clone();
        other[3] = 999;
        assert_eq!(external_tokens(&p, &other, s, 0, "m"), Err(Refusal::Tokens));
        assert_eq!(external_tokens(&p, &prompt[..37], s, 0, "m"), Err(Refusal::NoQuestion));
    }

    #[test]
    fn params_round_trip_and_bad_tilings_are_errors() {
        let prompt: Vec<u32> = (0..50).collect();
        let p = plan(&prompt);
        let back = Plan::from_params(&p.to_params()).unwrap().unwrap();
        assert_eq!(back, p);
        assert_eq!(Plan::from_params(&serde_json::json!({"other": 1})).unwrap(), None);
        let mut gap = p.clone();
        gap.chunks[2].start = 26;
        assert!(Plan::from_params(&gap.to_params()).is_err());
        let mut future = p;
        future.v = 2;
        assert!(Plan::from_params(&future.to_params()).is_err());
    }

    #[test]
    fn salt_separates_users_generations_and_layouts() {
        let c = vec![Chunk { fact: None, start: 0, len: 5 }];
        let c2 = vec![Chunk { fact: None, start: 0, len: 6 }];
        let base = salt("u", 1, "m", &c);
        assert_ne!(base, salt("v", 1, "m", &c));
        assert_ne!(base, salt("u", 2, "m", &c));
        assert_ne!(base, salt("u", 1, "m", &c2));
        assert_ne!(base, salt("u", 1, "n", &c));
        assert_eq!(base, salt("u", 1, "m", &c));
        // Prompt mode: its own namespace, per user and generation.
        let p = prompt_salt("u", 1, "m");
        assert!(p != base && p != salt("u", 1, "m", &[]), "never a plan's salt");
        assert_ne!(p, prompt_salt("v", 1, "m"));
        assert_ne!(p, prompt_salt("u", 2, "m"));
        assert_eq!(p, prompt_salt("u", 1, "m"));
    }
}
