//! An ingest on its way to the workers: units checked and converted, sent
//! to every writer of the user (all or nothing at each), answered when all
//! have stored them. Shared by the memory API (`memories.rs`), its jobs
//! (`jobs.rs`) and Mem0's add (`mem0/`).

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use inferscale_proto as pb;
use inferscale_types::{MemoryUnit, Role};
use serde_json::json;

use crate::auth::scoped;
use crate::dispatch::write_all;
use crate::error::Result;
use crate::openai;
use crate::state::AppState;
use crate::workers::request;

/// An ingest request, checked and ready to send.
pub(crate) struct Ingest {
    /// The user as the client named it, and as the workers know it.
    pub(crate) user: String,
    pub(crate) scoped_user: String,
    req: pb::IngestRequest,
    /// The ids given to units made from chat messages.
    message_ids: Vec<String>,
}

impl Ingest {
    /// An ingest of `units` (checked) for `tenant`'s `user`, encoded with
    /// `window` (the worker's when `None`); `message_ids` are the ids given
    /// to units made from chat messages, echoed in the answer.
    pub(crate) fn new(
        tenant: &str,
        user: String,
        window: Option<u32>,
        units: Vec<MemoryUnit>,
        message_ids: Vec<String>,
    ) -> Ingest {
        let units: Vec<pb::MemoryUnit> = units.into_iter().map(pb::MemoryUnit::from).collect();
        let scoped_user = scoped(tenant, &user);
        let req = pb::IngestRequest { user: scoped_user.clone(), window, units, defer_kv: false };
        Ingest { user, scoped_user, req, message_ids }
    }

    /// Every unit id of the request.
    pub(crate) fn ids(&self) -> Vec<String> {
        self.req.units.iter().map(|u| u.id.clone()).collect()
    }

    /// Sends it to every writer of the user, each call bounded by
    /// `deadline`; the answer's body.
    pub(crate) async fn run(
        &self,
        s: &AppState,
        tenant: &str,
        deadline: std::time::Duration,
    ) -> Result<serde_json::Value> {
        // Copies other than the home's store facts only; their KV is encoded
        // if they ever serve.
        let resp = write_all(
            s,
            &self.scoped_user,
            |_| false,
            |mut c, home| {
                let req = request(pb::IngestRequest { defer_kv: !home, ..self.req.clone() }, deadline);
                async move { c.ingest(req).await }
            },
        )
        .await
        .map_err(|e| e.unscope(tenant))?;
        s.metrics.ingested_units.fetch_add(u64::from(resp.added), Ordering::Relaxed);
        let mut out = json!({"user": self.user, "added": resp.added, "skipped": resp.skipped,
                             "encoded_tokens": resp.encoded_tokens});
        if !self.message_ids.is_empty() {
            out["ids"] = json!(self.message_ids);
        }
        Ok(out)
    }
}

/// Memory units from an OpenAI message list (Mem0's `add(messages)`): each
/// user or assistant message is a turn, its speaker the message's `name`
/// or its role; system and developer messages are instructions, not
/// memories, and are skipped. A message's id is derived from its role,
/// name, text and how many identical messages precede it in the list, so
/// re-sending a list stores nothing twice — unless `salt` is non-zero: then
/// it is mixed in, and each call's units are new ones (Mem0's `add`).
pub(crate) fn units_from_messages(messages: &[openai::Message], salt: u64) -> Result<Vec<MemoryUnit>> {
    let mut seen: HashMap<u64, u32> = HashMap::new();
    let mut units = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let speaker = match Role::parse(&m.role, i)? {
            Role::System | Role::Developer => continue,
            Role::User => "User",
            Role::Assistant => "Assistant",
        };
        let speaker = m.name.clone().unwrap_or_else(|| speaker.to_string());
        let text = crate::validate::content_text(&m.content, &format!("messages[{i}].content"), false)?;
        let key = [m.role.as_bytes(), b"\0", speaker.as_bytes(), b"\0", text.as_bytes()].concat();
        let base = inferscale_cluster::ring::hash64(&key);
        let n = seen.entry(base).or_default();
        let mut occurrence = [base.to_le_bytes(), u64::from(*n).to_le_bytes()].concat();
        if salt != 0 {
            occurrence.extend(salt.to_le_bytes());
        }
        let id = format!("msg-{:016x}", inferscale_cluster::ring::hash64(&occurrence));
        *n += 1;
        units.push(MemoryUnit { id, speaker, text, ..Default::default() });
    }
    Ok(units)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(v: serde_json::Value) -> Vec<openai::Message> {
        serde_json::from_value(v).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn messages_become_turns_with_stable_ids() {
        let list = messages(json!([
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "I love hiking."},
            {"role": "assistant", "name": "Coach", "content": "Great!"},
            {"role": "user", "content": "I love hiking."},
        ]));
        let units = units_from_messages(&list, 0).unwrap_or_else(|e| panic!("{e}"));
        let speakers: Vec<&str> = units.iter().map(|u| u.speaker.as_str()).collect();
        assert_eq!(speakers, ["User", "Coach", "User"]);
        assert_eq!(units[2].text, "I love hiking.");
        // Identical messages get distinct ids; the same list the same ids.
        assert_ne!(units[0].id, units[2].id);
        let again = units_from_messages(&list, 0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(units.iter().map(|u| &u.id).collect::<Vec<_>>(), again.iter().map(|u| &u.id).collect::<Vec<_>>());
        let tool = messages(json!([{"role": "tool", "content": "x"}]));
        assert!(units_from_messages(&tool, 0).is_err());
    }
}
