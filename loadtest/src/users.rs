//! Who the load test's users are: what each ingests and what it asks.
//!
//! A user is a memory (turns sent once to `POST /v1/memories`) plus the
//! questions it asks about it. Two sources:
//!
//! - **LoCoMo**: each speaker of each sample is a user whose own turns are
//!   ingested and who asks the sample's QA questions. Real conversations make
//!   retrieval and prompt lengths realistic. The file has fewer speakers than
//!   a large run has users, so users past the last speaker start over with
//!   the first one under a new id (`…-r2`): the same memory stored again,
//!   as a second real user with the same history would be.
//! - **Synthetic**: user `u` ingests `F` generated facts (numbers `u·F` to
//!   `u·F+F-1` of [`crate::synthetic`]) and asks about them. With `M`
//!   memories, user `u` is memory `u mod M`'s user instead (stored once):
//!   many closed-loop users over a bounded store, for models whose KV per
//!   fact is large (an 8B model's pre-RoPE KV is ~0.26 MB per token).

use std::path::Path;

use inferscale_types::MemoryUnit;

use crate::error::{Error, Result};
use crate::synthetic::synthetic_fact;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub id: String,
    pub turns: Vec<MemoryUnit>,
    /// Asked round robin; never empty.
    pub questions: Vec<String>,
}

/// Where users come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// Speakers of a LoCoMo file; `max_turns` keeps only each speaker's
    /// first turns, to bound the time spent ingesting.
    Locomo { path: std::path::PathBuf, max_turns: Option<usize> },
    /// `facts` generated facts per user; with `memories`, users share that
    /// many memories round robin.
    Synthetic { facts: usize, memories: Option<usize> },
}

impl Source {
    /// How the report names the source.
    pub fn describe(&self) -> String {
        match self {
            Source::Locomo { path, max_turns: None } => format!("locomo:{}", path.display()),
            Source::Locomo { path, max_turns: Some(m) } => {
                format!("locomo:{} (first {m} turns per speaker)", path.display())
            }
            Source::Synthetic { facts, memories: None } => format!("synthetic:{facts} facts per user"),
            Source::Synthetic { facts, memories: Some(m) } => {
                format!("synthetic:{facts} facts per memory, users share {m} memories")
            }
        }
    }
}

/// `n` users from `source`, their ids starting with `prefix`.
pub fn users(source: &Source, n: usize, prefix: &str) -> Result<Vec<User>> {
    match source {
        Source::Locomo { path, max_turns } => locomo_users(path, *max_turns, n, prefix),
        Source::Synthetic { facts, memories } => synthetic_users(*facts, *memories, n, prefix),
    }
}

fn synthetic_users(facts: usize, memories: Option<usize>, n: usize, prefix: &str) -> Result<Vec<User>> {
    if facts == 0 {
        return Err(Error::Config("synthetic users need at least one fact each".into()));
    }
    if memories == Some(0) {
        return Err(Error::Config("--memories needs at least 1".into()));
    }
    Ok((0..n)
        .map(|u| {
            let m = memories.map_or(u, |count| u % count);
            let facts: Vec<_> = (m * facts..(m + 1) * facts).map(synthetic_fact).collect();
            User {
                id: format!("{prefix}-synthetic-{m}"),
                questions: facts.iter().map(|f| f.question.clone()).collect(),
                // A shared memory is ingested by its first user only.
                turns: facts
                    .into_iter()
                    .filter(|_| m == u)
                    .enumerate()
                    .map(|(j, f)| MemoryUnit {
                        id: format!("S{j}"),
                        speaker: f.speaker,
                        text: f.text,
                        time: "8 May 2023".into(),
                        source_turn: String::new(),
                        ..Default::default()
                    })
                    .collect(),
            }
        })
        .collect())
}

fn locomo_users(path: &Path, max_turns: Option<usize>, n: usize, prefix: &str) -> Result<Vec<User>> {
    let samples = inferscale_eval::locomo::read(path)?;
    let mut base = Vec::new();
    for s in &samples {
        let questions: Vec<String> = s.qa.iter().map(|q| q.question.clone()).collect();
        if questions.is_empty() {
            continue;
        }
        // Speakers in order of first appearance.
        let mut speakers: Vec<&str> = Vec::new();
        for t in &s.turns {
            if !speakers.contains(&t.speaker.as_str()) {
                speakers.push(&t.speaker);
            }
        }
        for speaker in speakers {
            let turns: Vec<MemoryUnit> = s
                .turns
                .iter()
                .filter(|t| t.speaker == speaker && !t.text.trim().is_empty())
                .take(max_turns.unwrap_or(usize::MAX))
                .cloned()
                .collect();
            if !turns.is_empty() {
                let id = format!("{prefix}-{}-{}", slug(&s.id), slug(speaker));
                base.push(User { id, turns, questions: questions.clone() });
            }
        }
    }
    if base.is_empty() {
        return Err(Error::Config(format!("{}: no sample has both turns and QA questions", path.display())));
    }
    Ok((0..n)
        .map(|i| {
            let mut u = base[i % base.len()].clone();
            let round = i / base.len();
            if round > 0 {
                u.id = format!("{}-r{}", u.id, round + 1);
            }
            u
        })
        .collect())
}

/// Lower-case letters, digits and dashes: safe in a URL path segment.
fn slug(s: &str) -> String {
    let out: String = s.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    out.trim_matches('-').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_users_have_their_own_facts() {
        let us = users(&Source::Synthetic { facts: 3, memories: None }, 2, "lt").expect("users");
        assert_eq!(us.len(), 2);
        assert_eq!(us[0].id, "lt-synthetic-0");
        assert_eq!(us[0].turns.len(), 3);
        assert_eq!(us[0].questions.len(), 3);
        assert_ne!(us[0].turns[0].text, us[1].turns[0].text);
        assert!(users(&Source::Synthetic { facts: 0, memories: None }, 2, "lt").is_err());
        assert!(users(&Source::Synthetic { facts: 3, memories: Some(0) }, 2, "lt").is_err());
    }

    #[test]
    fn shared_memories_are_stored_once_and_asked_by_all() {
        let us = users(&Source::Synthetic { facts: 2, memories: Some(2) }, 5, "lt").expect("users");
        let ids: Vec<&str> = us.iter().map(|u| u.id.as_str()).collect();
        assert_eq!(ids, ["lt-synthetic-0", "lt-synthetic-1", "lt-synthetic-0", "lt-synthetic-1", "lt-synthetic-0"]);
        let stored: Vec<usize> = us.iter().map(|u| u.turns.len()).collect();
        assert_eq!(stored, [2, 2, 0, 0, 0]);
        assert_eq!(us[4].questions, us[0].questions);
    }

    #[test]
    fn locomo_speakers_become_users_and_repeat_past_the_end() {
        let dir = std::env::temp_dir().join(format!("inferscale-loadtest-users-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("mini.json");
        let sample = serde_json::json!([{
            "sample_id": "conv-1",
            "conversation": {
                "speaker_a": "Ann", "speaker_b": "Bob",
                "session_1_date_time": "1 May 2023",
                "session_1": [
                    {"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a cat."},
                    {"speaker": "Bob", "dia_id": "D1:2", "text": "Nice! I run."},
                    {"speaker": "Ann", "dia_id": "D1:3", "text": "Her name is Miso."}
                ]
            },
            "qa": [{"question": "What is the cat called?", "answer": "Miso", "evidence": ["D1:3"], "category": 1}]
        }]);
        std::fs::write(&path, sample.to_string()).expect("write");
        let src = Source::Locomo { path: path.clone(), max_turns: None };
        let us = users(&src, 3, "lt").expect("users");
        let ids: Vec<&str> = us.iter().map(|u| u.id.as_str()).collect();
        assert_eq!(ids, ["lt-conv-1-ann", "lt-conv-1-bob", "lt-conv-1-ann-r2"]);
        assert_eq!(us[0].turns.len(), 2);
        assert_eq!(us[0].turns[1].time, "1 May 2023");
        assert_eq!(us[1].questions, ["What is the cat called?"]);
        let capped = users(&Source::Locomo { path, max_turns: Some(1) }, 1, "lt").expect("users");
        assert_eq!(capped[0].turns.len(), 1);
        std::fs::remove_dir_all(&dir).ok();
    }
}
