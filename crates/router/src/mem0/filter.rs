//! Mem0's `filters` (its platform API's grammar, v2 and later), parsed once
//! into a [`Filter`] and evaluated on each memory — pure logic, no I/O.
//!
//! - Logic: `{"AND": [f, …]}`, `{"OR": [f, …]}`, `{"NOT": f}` (or a list,
//!   negating their conjunction); several keys in one object are ANDed.
//! - Entities `user_id`, `agent_id`, `run_id`, `app_id`: a bare value
//!   (equality), `"*"` (any non-empty value), or `{eq|ne|in|contains|icontains}`.
//! - Times `created_at`, `updated_at`: RFC 3339 or `YYYY-MM-DD` (UTC) or
//!   Unix seconds, bare (equality) or `{gt|gte|lt|lte|ne|in}`.
//! - `metadata`: `{key: value}` (equality) or `{key: {op: arg}}` with
//!   `eq ne in gt gte lt lte contains icontains`, `"*"` for any value.
//! - The text: `keywords` or `text`, `{contains|icontains: s}` (a bare
//!   string: `contains`); `memory_ids`: a list of ids.
//!
//! `categories` (Mem0's automatic classification) is refused: nothing here
//! assigns categories, and a filter that can never match would hide that.

use serde_json::{Map, Value};

/// A memory as filters see it.
#[derive(Debug, Clone, Copy)]
pub struct Record<'a> {
    pub id: &'a str,
    pub user_id: &'a str,
    pub agent_id: &'a str,
    pub run_id: &'a str,
    pub memory: &'a str,
    pub metadata: &'a Map<String, Value>,
    pub created_ms: u64,
    pub updated_ms: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Filter {
    And(Vec<Filter>),
    Or(Vec<Filter>),
    Not(Box<Filter>),
    Entity(Entity, Cond),
    Time(Time, Cond),
    Metadata(String, Cond),
    Text(Cond),
    Ids(Vec<String>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entity {
    User,
    Agent,
    Run,
    App,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Time {
    Created,
    Updated,
}

/// One test on a value. Times are held as milliseconds in `Eq`/`In`/the
/// orderings.
#[derive(Debug, Clone, PartialEq)]
pub enum Cond {
    Eq(Value),
    Ne(Value),
    In(Vec<Value>),
    Any,
    Gt(f64),
    Gte(f64),
    Lt(f64),
    Lte(f64),
    Contains(String),
    IContains(String),
}

/// Why a filter is not one, in words for the client.
pub type Invalid = String;

impl Filter {
    /// Parses a `filters` object.
    pub fn parse(v: &Value) -> Result<Filter, Invalid> {
        let obj = v.as_object().ok_or_else(|| format!("expected a filter object, got {v}"))?;
        let mut all = Vec::with_capacity(obj.len());
        for (key, arg) in obj {
            all.push(Filter::key(key, arg)?);
        }
        Ok(match all.len() {
            1 => all.remove(0),
            _ => Filter::And(all),
        })
    }

    fn key(key: &str, arg: &Value) -> Result<Filter, Invalid> {
        let list = |arg: &Value| -> Result<Vec<Filter>, Invalid> {
            match arg {
                Value::Array(fs) => fs.iter().map(Filter::parse).collect(),
                other => Err(format!("`{key}` takes a list of filter objects, got {other}")),
            }
        };
        Ok(match key {
            "AND" => Filter::And(list(arg)?),
            "OR" => Filter::Or(list(arg)?),
            "NOT" => Filter::Not(Box::new(match arg {
                Value::Array(_) => Filter::And(list(arg)?),
                _ => Filter::parse(arg)?,
            })),
            "user_id" => Filter::Entity(Entity::User, entity(key, arg)?),
            "agent_id" => Filter::Entity(Entity::Agent, entity(key, arg)?),
            "run_id" => Filter::Entity(Entity::Run, entity(key, arg)?),
            "app_id" => Filter::Entity(Entity::App, entity(key, arg)?),
            "created_at" => Filter::Time(Time::Created, time(key, arg)?),
            "updated_at" => Filter::Time(Time::Updated, time(key, arg)?),
            "metadata" => {
                let fields = arg.as_object().ok_or_else(|| format!("`metadata` takes an object, got {arg}"))?;
                let mut all = Vec::with_capacity(fields.len());
                for (k, v) in fields {
                    all.push(Filter::Metadata(k.clone(), metadata(k, v)?));
                }
                match all.len() {
                    1 => all.remove(0),
                    _ => Filter::And(all),
                }
            }
            "keywords" | "text" => Filter::Text(match arg {
                Value::String(s) => Cond::Contains(s.clone()),
                _ => match op(key, arg)? {
                    (o @ ("contains" | "icontains" | "eq"), Value::String(s)) => text_cond(o, s),
                    (o, v) => return Err(format!("`{key}` takes {{contains|icontains: text}}, got `{o}`: {v}")),
                },
            }),
            "memory_ids" => Filter::Ids(
                arg.as_array()
                    .and_then(|ids| ids.iter().map(|i| i.as_str().map(str::to_string)).collect())
                    .ok_or_else(|| format!("`memory_ids` takes a list of ids, got {arg}"))?,
            ),
            "categories" => return Err("`categories` is not supported: this server assigns no categories".into()),
            other => {
                return Err(format!(
                    "unknown filter field `{other}` (AND, OR, NOT, user_id, agent_id, run_id, app_id, created_at, \
                     updated_at, metadata, keywords, text, memory_ids)"
                ));
            }
        })
    }

    /// Whether `r` passes.
    pub fn matches(&self, r: &Record) -> bool {
        match self {
            Filter::And(fs) => fs.iter().all(|f| f.matches(r)),
            Filter::Or(fs) => fs.iter().any(|f| f.matches(r)),
            Filter::Not(f) => !f.matches(r),
            Filter::Entity(e, c) => {
                let have = match e {
                    Entity::User => r.user_id,
                    Entity::Agent => r.agent_id,
                    Entity::Run => r.run_id,
                    Entity::App => "",
                };
                c.test((!have.is_empty()).then(|| Value::String(have.to_string())).as_ref())
            }
            Filter::Time(t, c) => {
                let ms = match t {
                    Time::Created => r.created_ms,
                    Time::Updated => r.updated_ms,
                };
                c.test((ms != 0).then(|| Value::from(ms)).as_ref())
            }
            Filter::Metadata(k, c) => c.test(r.metadata.get(k).filter(|v| !v.is_null())),
            Filter::Text(c) => c.test(Some(&Value::String(r.memory.to_string()))),
            Filter::Ids(ids) => ids.iter().any(|i| i == r.id),
        }
    }

    /// The users a filter confines memories to, when it does: memories are
    /// placed per user, so a read must know whose memory to ask for. A
    /// conjunction confines to what any of its parts does; a disjunction to
    /// the union, when every branch confines; `"*"` and negations do not.
    pub fn users(&self) -> Option<Vec<String>> {
        match self {
            Filter::Entity(Entity::User, Cond::Eq(Value::String(u))) => Some(vec![u.clone()]),
            Filter::Entity(Entity::User, Cond::In(list)) => {
                list.iter().map(|v| v.as_str().map(str::to_string)).collect()
            }
            Filter::And(fs) => fs.iter().find_map(Filter::users),
            Filter::Or(fs) if !fs.is_empty() => {
                let mut all: Vec<String> = Vec::new();
                for f in fs {
                    for u in f.users()? {
                        if !all.contains(&u) {
                            all.push(u);
                        }
                    }
                }
                Some(all)
            }
            _ => None,
        }
    }
}

impl Cond {
    fn test(&self, have: Option<&Value>) -> bool {
        let num = |v: &Value| v.as_f64();
        let text = |v: &Value| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        match self {
            Cond::Any => have.is_some(),
            Cond::Eq(want) => have.is_some_and(|h| loose_eq(h, want)),
            Cond::Ne(want) => !have.is_some_and(|h| loose_eq(h, want)),
            Cond::In(list) => have.is_some_and(|h| list.iter().any(|w| loose_eq(h, w))),
            Cond::Gt(b) => have.and_then(num).is_some_and(|h| h > *b),
            Cond::Gte(b) => have.and_then(num).is_some_and(|h| h >= *b),
            Cond::Lt(b) => have.and_then(num).is_some_and(|h| h < *b),
            Cond::Lte(b) => have.and_then(num).is_some_and(|h| h <= *b),
            Cond::Contains(s) => have.is_some_and(|h| match h {
                Value::Array(items) => items.iter().any(|i| i.as_str() == Some(s)),
                other => text(other).contains(s.as_str()),
            }),
            Cond::IContains(s) => have.is_some_and(|h| text(h).to_lowercase().contains(&s.to_lowercase())),
        }
    }
}

/// Equality where a number and the same number written differently (`1`,
/// `1.0`) are equal.
fn loose_eq(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// An operator object's one `(op, argument)`.
fn op<'a>(key: &str, arg: &'a Value) -> Result<(&'a str, &'a Value), Invalid> {
    match arg.as_object() {
        Some(o) if o.len() == 1 => o.iter().next().map(|(k, v)| (k.as_str(), v)).ok_or_else(String::new),
        _ => Err(format!("`{key}` takes a value or one {{operator: argument}} object, got {arg}")),
    }
}

fn text_cond(op: &str, s: &str) -> Cond {
    match op {
        "icontains" => Cond::IContains(s.to_string()),
        "eq" => Cond::Eq(Value::String(s.to_string())),
        _ => Cond::Contains(s.to_string()),
    }
}

fn entity(key: &str, arg: &Value) -> Result<Cond, Invalid> {
    match arg {
        Value::String(s) if s == "*" => Ok(Cond::Any),
        Value::String(_) => Ok(Cond::Eq(arg.clone())),
        Value::Object(_) => match op(key, arg)? {
            ("eq", v @ Value::String(_)) => Ok(Cond::Eq(v.clone())),
            ("ne", v @ Value::String(_)) => Ok(Cond::Ne(v.clone())),
            ("in", Value::Array(list)) if list.iter().all(Value::is_string) => Ok(Cond::In(list.clone())),
            (o @ ("contains" | "icontains"), Value::String(s)) => Ok(text_cond(o, s)),
            (o, v) => Err(format!("`{key}`: `{o}` with {v} is not a test of an id (eq, ne, in, contains, icontains)")),
        },
        other => Err(format!("`{key}` takes an id, \"*\" or an operator object, got {other}")),
    }
}

fn time(key: &str, arg: &Value) -> Result<Cond, Invalid> {
    let at = |v: &Value| -> Result<f64, Invalid> {
        let ms = match v {
            Value::Number(n) => n.as_f64().map(|secs| secs * 1000.0),
            Value::String(s) => inferscale_types::time::parse(s).map(|ms| ms as f64),
            _ => None,
        };
        ms.ok_or_else(|| format!("`{key}`: {v} is not a time (RFC 3339, YYYY-MM-DD, or Unix seconds)"))
    };
    if !arg.is_object() {
        return Ok(Cond::Eq(Value::from(at(arg)?)));
    }
    Ok(match op(key, arg)? {
        ("gt", v) => Cond::Gt(at(v)?),
        ("gte", v) => Cond::Gte(at(v)?),
        ("lt", v) => Cond::Lt(at(v)?),
        ("lte", v) => Cond::Lte(at(v)?),
        ("eq", v) => Cond::Eq(Value::from(at(v)?)),
        ("ne", v) => Cond::Ne(Value::from(at(v)?)),
        ("in", Value::Array(list)) => Cond::In(list.iter().map(|v| at(v).map(Value::from)).collect::<Result<_, _>>()?),
        (o, _) => return Err(format!("`{key}`: unknown operator `{o}` (gt, gte, lt, lte, eq, ne, in)")),
    })
}

fn metadata(key: &str, arg: &Value) -> Result<Cond, Invalid> {
    let name = format!("metadata.{key}");
    if let Value::String(s) = arg
        && s == "*"
    {
        return Ok(Cond::Any);
    }
    if !arg.is_object() {
        return Ok(Cond::Eq(arg.clone()));
    }
    let number = |v: &Value| v.as_f64().ok_or_else(|| format!("`{name}`: {v} is not a number"));
    Ok(match op(&name, arg)? {
        ("eq", v) => Cond::Eq(v.clone()),
        ("ne", v) => Cond::Ne(v.clone()),
        ("in", Value::Array(list)) => Cond::In(list.clone()),
        ("gt", v) => Cond::Gt(number(v)?),
        ("gte", v) => Cond::Gte(number(v)?),
        ("lt", v) => Cond::Lt(number(v)?),
        ("lte", v) => Cond::Lte(number(v)?),
        (o @ ("contains" | "icontains"), Value::String(s)) => text_cond(o, s),
        (o, v) => {
            return Err(format!(
                "`{name}`: `{o}` with {v} is not a test (eq, ne, in, gt, gte, lt, lte, contains, icontains)"
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record<'a>(memory: &'a str, agent: &'a str, metadata: &'a Map<String, Value>) -> Record<'a> {
        Record {
            id: "m1",
            user_id: "alex",
            agent_id: agent,
            run_id: "",
            memory,
            metadata,
            created_ms: 1_700_000_000_000,
            updated_ms: 1_700_000_100_000,
        }
    }

    fn parse(v: Value) -> Filter {
        Filter::parse(&v).unwrap_or_else(|e| panic!("{v}: {e}"))
    }

    #[test]
    fn the_grammar_decides_as_mem0_documents() {
        let pets = json!({"topic": "pets", "n": 3, "tags": ["a", "b"]}).as_object().cloned().unwrap_or_default();
        let none = Map::new();
        let cat = record("I adopted a grey cat named Miso.", "petbot", &pets);
        let work = record("I work as a nurse in Lisbon.", "", &none);
        let cases = [
            (json!({"user_id": "alex"}), true, true),
            (json!({"user_id": "sam"}), false, false),
            (json!({"AND": [{"user_id": "alex"}, {"agent_id": "*"}]}), true, false),
            (json!({"AND": [{"user_id": "alex"}, {"metadata": {"topic": "pets"}}]}), true, false),
            (json!({"AND": [{"user_id": "alex"}, {"NOT": {"metadata": {"topic": "pets"}}}]}), false, true),
            (json!({"NOT": [{"agent_id": "petbot"}]}), false, true),
            (json!({"OR": [{"metadata": {"n": {"gte": 3}}}, {"keywords": {"icontains": "LISBON"}}]}), true, true),
            (json!({"keywords": {"contains": "Lisbon"}}), false, true),
            (json!({"keywords": {"contains": "lisbon"}}), false, false),
            (json!({"metadata": {"n": {"in": [1, 3.0]}}}), true, false),
            (json!({"metadata": {"tags": {"contains": "b"}}}), true, false),
            (json!({"metadata": {"topic": {"ne": "pets"}}}), false, true),
            (json!({"metadata": {"topic": "*"}}), true, false),
            (json!({"agent_id": {"in": ["petbot", "x"]}}), true, false),
            (json!({"agent_id": {"ne": "petbot"}}), false, true),
            (json!({"created_at": {"gte": "2023-11-14"}, "updated_at": {"lt": "2023-11-14T22:15:01Z"}}), true, true),
            (json!({"created_at": {"gt": "2023-11-14T22:13:21+00:00"}}), false, false),
            (json!({"created_at": {"lt": 1_700_000_001}}), true, true),
            (json!({"memory_ids": ["m1"]}), true, true),
            (json!({"app_id": "*"}), false, false),
        ];
        for (f, want_cat, want_work) in cases {
            let parsed = parse(f.clone());
            assert_eq!((parsed.matches(&cat), parsed.matches(&work)), (want_cat, want_work), "{f}");
        }
    }

    #[test]
    fn bad_filters_are_refused_with_what_is_wrong() {
        for (f, says) in [
            (json!({"colour": "red"}), "unknown filter field `colour`"),
            (json!({"categories": {"in": ["x"]}}), "`categories` is not supported"),
            (json!({"AND": {"user_id": "a"}}), "`AND` takes a list"),
            (json!({"user_id": 7}), "`user_id` takes an id"),
            (json!({"user_id": {"gt": "a"}}), "not a test of an id"),
            (json!({"created_at": {"gte": "yesterday"}}), "is not a time"),
            (json!({"metadata": {"n": {"gt": "x"}}}), "is not a number"),
            (json!({"metadata": {"n": {"eq": 1, "ne": 2}}}), "one {operator: argument}"),
            (json!([1]), "expected a filter object"),
        ] {
            let e = Filter::parse(&f).err().unwrap_or_default();
            assert!(e.contains(says), "{f}: {e}");
        }
    }

    #[test]
    fn reads_know_whose_memory_to_ask_for() {
        assert_eq!(parse(json!({"user_id": "a"})).users(), Some(vec!["a".into()]));
        assert_eq!(parse(json!({"AND": [{"agent_id": "x"}, {"user_id": "a"}]})).users(), Some(vec!["a".into()]));
        assert_eq!(parse(json!({"user_id": {"in": ["a", "b"]}})).users(), Some(vec!["a".into(), "b".into()]));
        assert_eq!(
            parse(json!({"OR": [{"user_id": "a"}, {"user_id": "b"}]})).users(),
            Some(vec!["a".into(), "b".into()])
        );
        for open in [
            json!({"user_id": "*"}),
            json!({"agent_id": "x"}),
            json!({"NOT": {"user_id": "a"}}),
            json!({"OR": [{"user_id": "a"}, {"agent_id": "b"}]}),
        ] {
            assert_eq!(parse(open.clone()).users(), None, "{open}");
        }
    }
}
