//! Reading LoCoMo-format conversations (the `locomo10.json` layout).

use std::path::Path;

use serde_json::Value;

use inferscale_types::MemoryUnit;

use crate::error::{EvalError, Result, io};

/// One LoCoMo sample: its turns in session order and its questions.
#[derive(Debug, Clone)]
pub struct Sample {
    pub id: String,
    pub turns: Vec<MemoryUnit>,
    pub qa: Vec<Qa>,
}

#[derive(Debug, Clone)]
pub struct Qa {
    pub question: String,
    /// Absent for most category-5 (adversarial) items.
    pub answer: Option<String>,
    pub evidence: Vec<String>,
    pub category: u8,
}

/// Reads every sample of a LoCoMo file; errors name the file and the field.
pub fn read(path: &Path) -> Result<Vec<Sample>> {
    let bad = |reason: String| EvalError::Locomo { path: path.to_path_buf(), reason };
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let samples = v.as_array().ok_or_else(|| bad("top level is not a list of samples".into()))?;
    samples.iter().enumerate().map(|(i, s)| sample(s).map_err(|r| bad(format!("sample {i}: {r}")))).collect()
}

fn sample(s: &Value) -> std::result::Result<Sample, String> {
    let id = s.get("sample_id").and_then(Value::as_str).ok_or("missing `sample_id`")?.to_string();
    let conv = s.get("conversation").and_then(Value::as_object).ok_or(format!("{id}: missing `conversation`"))?;
    let mut sessions: Vec<(u32, &Vec<Value>)> = conv
        .iter()
        .filter_map(|(k, v)| {
            let n = k.strip_prefix("session_")?.parse::<u32>().ok()?;
            Some((n, v.as_array()?))
        })
        .collect();
    sessions.sort_by_key(|(n, _)| *n);
    let mut turns = Vec::new();
    for (n, items) in sessions {
        let time = conv.get(&format!("session_{n}_date_time")).and_then(Value::as_str).unwrap_or("").to_string();
        for (j, t) in items.iter().enumerate() {
            let field = |f: &str| {
                t.get(f)
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or(format!("{id}: session_{n}[{j}]: missing `{f}`"))
            };
            turns.push(MemoryUnit {
                id: field("dia_id")?,
                speaker: field("speaker")?,
                text: field("text")?,
                time: time.clone(),
                source_turn: String::new(),
                ..Default::default()
            });
        }
    }
    let qa = s
        .get("qa")
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .enumerate()
                .map(|(j, q)| {
                    let question = q
                        .get("question")
                        .and_then(Value::as_str)
                        .ok_or(format!("{id}: qa[{j}]: missing `question`"))?;
                    let answer = q.get("answer").map(|a| match a {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    });
                    let evidence = q
                        .get("evidence")
                        .and_then(Value::as_array)
                        .map(|e| {
                            e.iter()
                                .filter_map(Value::as_str)
                                .flat_map(|x| x.split(';'))
                                .map(|x| x.trim().to_string())
                                .collect()
                        })
                        .unwrap_or_default();
                    let category =
                        q.get("category").and_then(Value::as_u64).ok_or(format!("{id}: qa[{j}]: missing `category`"))?
                            as u8;
                    Ok(Qa { question: question.to_string(), answer, evidence, category })
                })
                .collect::<std::result::Result<Vec<_>, String>>()
        })
        .transpose()?
        .unwrap_or_default();
    Ok(Sample { id, turns, qa })
}

/// Reads caller-supplied facts, one JSON object per line: `id`, `text` and
/// `source_turn` (the turn the fact was extracted from) are required,
/// `speaker` and `time` optional. Blank lines are skipped; errors name the
/// file, the line and the field.
pub fn read_facts(path: &Path) -> Result<Vec<MemoryUnit>> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let bad = |line: usize, reason: String| EvalError::Facts { path: path.to_path_buf(), line, reason };
    let mut facts = Vec::new();
    for (n, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())) {
        if line.is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| bad(n, format!("invalid JSON: {e}")))?;
        let field = |name: &str, required: bool| -> Result<String> {
            match v.get(name) {
                Some(Value::String(s)) if !(required && s.trim().is_empty()) => Ok(s.clone()),
                None if !required => Ok(String::new()),
                Some(Value::String(_)) => Err(bad(n, format!("field `{name}` is empty"))),
                Some(_) => Err(bad(n, format!("field `{name}` is not a string"))),
                None => Err(bad(n, format!("missing field `{name}`"))),
            }
        };
        facts.push(MemoryUnit {
            id: field("id", true)?,
            text: field("text", true)?,
            source_turn: field("source_turn", true)?,
            speaker: field("speaker", false)?,
            time: field("time", false)?,
            ..Default::default()
        });
    }
    if facts.is_empty() {
        return Err(bad(0, "no facts".into()));
    }
    Ok(facts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_files_are_read_with_errors_naming_line_and_field() {
        let dir = tempfile::tempdir().expect("ok");
        let path = dir.path().join("facts.jsonl");
        let read = |text: &str| {
            std::fs::write(&path, text).expect("ok");
            read_facts(&path)
        };
        let good = read(
            "{\"id\": \"F1\", \"text\": \"Likes ramen.\", \"source_turn\": \"D1:3\", \"speaker\": \"Caroline\"}\n\n\
             {\"id\": \"F2\", \"text\": \"Lives in Lisbon.\", \"source_turn\": \"D2:1\"}\n",
        )
        .expect("ok");
        assert_eq!(good.len(), 2);
        assert_eq!(
            (good[0].speaker.as_str(), good[1].source_turn.as_str(), good[1].time.as_str()),
            ("Caroline", "D2:1", "")
        );
        for (text, needle) in [
            (
                "{\"id\": \"F1\", \"text\": \"x\", \"source_turn\": \"D1\"}\n{\"id\": \"F2\"",
                "facts.jsonl:2: invalid JSON",
            ),
            ("{\"id\": \"F1\", \"text\": \"x\"}", "facts.jsonl:1: missing field `source_turn`"),
            ("{\"id\": \"F1\", \"text\": \" \", \"source_turn\": \"D1\"}", "facts.jsonl:1: field `text` is empty"),
            ("{\"id\": 7, \"text\": \"x\", \"source_turn\": \"D1\"}", "facts.jsonl:1: field `id` is not a string"),
            ("\n\n", "no facts"),
        ] {
            let err = read(text).expect_err("refused").to_string();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
    }
}
