//! Memory search (`/v1/memories/search`, Mem0's `search`): a user's facts
//! ranked for a query by the shard's retriever, narrowed by metadata
//! filters, each with a score a caller can threshold.
//!
//! The score is the cosine similarity of the query's and the fact's
//! MiniLM embeddings (both unit length, so a dot product): it means the same
//! for every retriever, where the hybrid ranking's fused reciprocal ranks
//! do not. The order is the retriever's, the one chat requests use, so a
//! search shows what a chat would retrieve.

use serde_json::{Map, Value};

use crate::error::{MemoryError, Result};

/// Whether `metadata` satisfies `filter`: every key of `filter` must hold.
/// A key maps to a value the metadata's must equal, or to an operator
/// object — `{"in": [v, …]}`, `{"ne": v}`, `{"gte"|"gt"|"lte"|"lt": n}`.
/// `"AND": [f, …]` and `"OR": [f, …]` combine filters; `"NOT": f` negates
/// one. A key the metadata lacks fails every test but `ne`. Every part of
/// the filter is evaluated, so a malformed one is an error whatever the
/// metadata (checking against an empty map validates a filter).
pub fn matches(metadata: &Map<String, Value>, filter: &Map<String, Value>) -> Result<bool> {
    let mut all = true;
    for (key, want) in filter {
        let all_of =
            |fs: Vec<&Map<String, Value>>| fs.iter().map(|f| matches(metadata, f)).collect::<Result<Vec<bool>>>();
        all &= match key.as_str() {
            "AND" => all_of(each(want, key)?)?.iter().all(|&b| b),
            "OR" => all_of(each(want, key)?)?.iter().any(|&b| b),
            "NOT" => !matches(metadata, object(want, key)?)?,
            _ => test(metadata.get(key), want, key)?,
        };
    }
    Ok(all)
}

fn invalid(reason: String) -> MemoryError {
    MemoryError::Invalid { what: "filters", reason }
}

fn object<'a>(v: &'a Value, key: &str) -> Result<&'a Map<String, Value>> {
    v.as_object().ok_or_else(|| invalid(format!("`{key}` takes a filter object")))
}

fn each<'a>(v: &'a Value, key: &str) -> Result<Vec<&'a Map<String, Value>>> {
    let list = v.as_array().ok_or_else(|| invalid(format!("`{key}` takes a list of filter objects")))?;
    list.iter().map(|f| object(f, key)).collect()
}

/// One key's test: equality, or the operators of an operator object.
fn test(have: Option<&Value>, want: &Value, key: &str) -> Result<bool> {
    let Some(ops) = want.as_object() else { return Ok(have == Some(want)) };
    let mut all = true;
    for (op, arg) in ops {
        let number = |v: &Value| v.as_f64();
        let ordered = |cmp: fn(f64, f64) -> bool| -> Result<bool> {
            let bound = number(arg).ok_or_else(|| invalid(format!("`{key}.{op}` takes a number")))?;
            Ok(have.and_then(number).is_some_and(|h| cmp(h, bound)))
        };
        let ok = match op.as_str() {
            "eq" => have == Some(arg),
            "ne" => have != Some(arg),
            "in" => {
                let list = arg.as_array().ok_or_else(|| invalid(format!("`{key}.in` takes a list")))?;
                have.is_some_and(|h| list.contains(h))
            }
            "gt" => ordered(|h, b| h > b)?,
            "gte" => ordered(|h, b| h >= b)?,
            "lt" => ordered(|h, b| h < b)?,
            "lte" => ordered(|h, b| h <= b)?,
            other => {
                return Err(invalid(format!("`{key}`: unknown operator {other:?} (eq, ne, in, gt, gte, lt, lte)")));
            }
        };
        all &= ok;
    }
    Ok(all)
}

/// Cosine similarity of two unit-length embeddings.
pub(crate) fn score(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn m(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn filters_match_values_operators_and_combinations() {
        let meta = m(json!({"topic": "health", "n": 3, "tags": "a"}));
        let yes = |f: Value| matches(&meta, &m(f)).unwrap_or_else(|e| panic!("{e}"));
        assert!(yes(json!({})));
        assert!(yes(json!({"topic": "health"})));
        assert!(!yes(json!({"topic": "work"})));
        assert!(!yes(json!({"missing": "x"})));
        assert!(yes(json!({"topic": "health", "n": 3})));
        assert!(!yes(json!({"topic": "health", "n": 4})));
        assert!(yes(json!({"topic": {"in": ["work", "health"]}})));
        assert!(yes(json!({"missing": {"ne": "x"}})));
        assert!(yes(json!({"n": {"gte": 3, "lt": 4}})));
        assert!(!yes(json!({"n": {"gt": 3}})));
        assert!(!yes(json!({"topic": {"gt": 3}})), "a string is not above a number");
        assert!(yes(json!({"OR": [{"topic": "work"}, {"n": 3}]})));
        assert!(!yes(json!({"AND": [{"topic": "health"}, {"n": 4}]})));
        assert!(yes(json!({"NOT": {"topic": "work"}})));
        for bad in [json!({"n": {"near": 3}}), json!({"OR": {"n": 3}}), json!({"n": {"gt": "x"}})] {
            assert!(matches(&meta, &m(bad.clone())).is_err(), "{bad}");
        }
        // A malformed part is found even behind one that already fails.
        assert!(matches(&Map::new(), &m(json!({"topic": "x", "n": {"near": 1}}))).is_err());
    }
}
