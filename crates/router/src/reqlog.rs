//! The request log: one line per HTTP request on stderr — method, route,
//! status, tenant, a hash of the user (ids are the client's, and may be
//! personal), the memory mode and k, prompt and completion tokens, time to
//! first token, duration, and an error's reason — written when the
//! response body ends, so that a streamed answer is logged once, complete.
//!
//! Configured from the environment, as the Rust ecosystem does:
//! `INFERSCALE_LOG` (or `RUST_LOG` when that is unset) takes a level
//! (`off`, `error`, `warn`, `info`, `debug`, `trace`) and/or
//! `target=level` directives, comma-separated; the most specific target
//! wins. Request lines have the target `inferscale::http` at `info`
//! (`warn` for 5xx answers). `INFERSCALE_LOG_FORMAT=json` writes one JSON
//! object a line, for log shippers; the default is `key=value` text.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use inferscale_types::Mode;
use serde_json::{Value, json};

/// The target request lines are logged under.
pub const TARGET: &str = "inferscale::http";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off,
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl Level {
    fn parse(s: &str) -> Option<Level> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "off" => Level::Off,
            "error" => Level::Error,
            "warn" => Level::Warn,
            "info" => Level::Info,
            "debug" => Level::Debug,
            "trace" => Level::Trace,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Level::Off => "off",
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
            Level::Trace => "trace",
        }
    }
}

/// A parsed filter: the default level and per-target levels.
#[derive(Debug, Clone, PartialEq)]
pub struct Filter {
    default: Level,
    targets: Vec<(String, Level)>,
}

impl Default for Filter {
    fn default() -> Self {
        Filter { default: Level::Info, targets: Vec::new() }
    }
}

impl Filter {
    /// Parses `RUST_LOG`-style directives (`info`, `warn,inferscale::http=info`).
    pub fn parse(spec: &str) -> Result<Filter, String> {
        let mut f = Filter::default();
        for d in spec.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            let bad = || {
                format!("log directive {d:?}: expected a level (off, error, warn, info, debug, trace) or target=level")
            };
            match d.split_once('=') {
                None => f.default = Level::parse(d).ok_or_else(bad)?,
                Some((target, _)) if target.trim().is_empty() => return Err(bad()),
                Some((target, level)) => {
                    f.targets.push((target.trim().to_string(), Level::parse(level).ok_or_else(bad)?))
                }
            }
        }
        Ok(f)
    }

    /// Whether a line of `target` at `level` is written.
    pub fn enabled(&self, target: &str, level: Level) -> bool {
        let max = self
            .targets
            .iter()
            .filter(|(t, _)| target == t || target.starts_with(&format!("{t}::")))
            .max_by_key(|(t, _)| t.len())
            .map_or(self.default, |(_, l)| *l);
        level != Level::Off && level <= max
    }
}

struct Config {
    filter: Filter,
    json: bool,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// Reads the environment (once); a bad setting is an error naming it.
pub fn configure_from_env() -> Result<(), String> {
    let spec = std::env::var("INFERSCALE_LOG").or_else(|_| std::env::var("RUST_LOG")).unwrap_or_default();
    let filter = Filter::parse(&spec)?;
    let json = match std::env::var("INFERSCALE_LOG_FORMAT").unwrap_or_default().trim() {
        "" | "text" => false,
        "json" => true,
        other => return Err(format!("INFERSCALE_LOG_FORMAT={other:?}: expected `text` or `json`")),
    };
    let _ = CONFIG.set(Config { filter, json });
    Ok(())
}

fn config() -> &'static Config {
    CONFIG.get_or_init(|| Config { filter: Filter::default(), json: false })
}

/// What the handler learned about a request, filled in as it runs.
#[derive(Debug, Default, Clone)]
pub struct Facts {
    pub tenant: Option<String>,
    /// A hash of the user id (16 hex digits), not the id.
    pub user: Option<String>,
    pub mode: Option<Mode>,
    pub k: Option<u32>,
    pub worker: Option<String>,
    pub prompt_tokens: Option<u32>,
    pub completion_tokens: Option<u64>,
    pub ttft_ms: Option<f64>,
    pub error: Option<String>,
}

/// A request's facts, shared by its handler (a request extension) and the
/// middleware that logs it.
#[derive(Debug, Default, Clone)]
pub struct Handle(Arc<Mutex<Facts>>);

impl Handle {
    pub fn update(&self, f: impl FnOnce(&mut Facts)) {
        if let Ok(mut facts) = self.0.lock() {
            f(&mut facts);
        }
    }

    fn take(&self) -> Facts {
        self.0.lock().map(|f| f.clone()).unwrap_or_default()
    }
}

/// The hash a user id is logged as.
pub fn user_hash(scoped_user: &str) -> String {
    format!("{:016x}", inferscale_cluster::ring::hash64(scoped_user.as_bytes()))
}

/// The error reason of a response, put there by `ApiError`.
#[derive(Debug, Clone)]
pub struct ErrorReason(pub String);

/// One request, logged when dropped (when its response body has ended or
/// the client has gone).
pub struct Line {
    pub method: String,
    pub route: String,
    pub status: u16,
    pub start: Instant,
    pub facts: Handle,
}

impl Line {
    fn level(&self) -> Level {
        if self.status >= 500 { Level::Warn } else { Level::Info }
    }

    fn fields(&self, f: &Facts) -> Vec<(&'static str, Value)> {
        let mut out = vec![
            ("method", json!(self.method)),
            ("route", json!(self.route)),
            ("status", json!(self.status)),
            ("duration_ms", json!((self.start.elapsed().as_secs_f64() * 1e4).round() / 10.0)),
        ];
        let opt = [
            ("tenant", f.tenant.as_ref().map(|t| json!(t))),
            ("user", f.user.as_ref().map(|u| json!(u))),
            ("mode", f.mode.map(|m| json!(m.as_str()))),
            ("k", f.k.map(|k| json!(k))),
            ("worker", f.worker.as_ref().map(|w| json!(w))),
            ("prompt_tokens", f.prompt_tokens.map(|t| json!(t))),
            ("completion_tokens", f.completion_tokens.map(|t| json!(t))),
            ("ttft_ms", f.ttft_ms.map(|t| json!((t * 10.0).round() / 10.0))),
            ("error", f.error.as_ref().map(|e| json!(e))),
        ];
        out.extend(opt.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))));
        out
    }

    /// The line as written, in `json` or text form.
    pub fn render(&self, json: bool) -> String {
        let facts = self.facts.take();
        let ts = inferscale_types::time::rfc3339(inferscale_types::time::now_ms());
        let level = self.level().name();
        let fields = self.fields(&facts);
        if json {
            let mut obj = serde_json::Map::new();
            obj.insert("ts".into(), json!(ts));
            obj.insert("level".into(), json!(level));
            obj.insert("target".into(), json!(TARGET));
            obj.extend(fields.into_iter().map(|(k, v)| (k.to_string(), v)));
            return Value::Object(obj).to_string();
        }
        let mut line = format!("{ts} {} {TARGET}", level.to_ascii_uppercase());
        for (k, v) in fields {
            match v {
                // Quoted (JSON string escapes) when it has spaces, quotes or `=`.
                Value::String(s) if s.is_empty() || s.contains([' ', '"', '=', '\n']) => {
                    line.push_str(&format!(" {k}={}", Value::String(s)))
                }
                Value::String(s) => line.push_str(&format!(" {k}={s}")),
                other => line.push_str(&format!(" {k}={other}")),
            }
        }
        line
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        let c = config();
        if c.filter.enabled(TARGET, self.level()) {
            eprintln!("{}", self.render(c.json));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_read_as_rust_log_does() {
        let f = Filter::parse("warn,inferscale::http=info").unwrap_or_default();
        assert!(f.enabled(TARGET, Level::Info) && !f.enabled(TARGET, Level::Debug));
        assert!(!f.enabled("inferscale::worker", Level::Info) && f.enabled("inferscale::worker", Level::Warn));
        let f = Filter::parse("inferscale=off").unwrap_or_default();
        assert!(!f.enabled(TARGET, Level::Warn) && f.enabled("other", Level::Info));
        assert!(!Filter::parse("off").unwrap_or_default().enabled(TARGET, Level::Error));
        assert_eq!(Filter::parse(""), Ok(Filter::default()));
        for bad in ["loud", "inferscale::http=lots", "=info"] {
            assert!(Filter::parse(bad).is_err_and(|e| e.contains("expected a level")), "{bad}");
        }
    }

    #[test]
    fn a_line_carries_what_the_handler_learned() {
        let facts = Handle::default();
        facts.update(|f| {
            f.tenant = Some("acme".into());
            f.user = Some(user_hash("acme/alex"));
            f.mode = Some(Mode::Kv);
            f.k = Some(8);
            f.prompt_tokens = Some(120);
            f.completion_tokens = Some(16);
            f.ttft_ms = Some(85.24);
            f.error = Some("a \"quoted\" reason".into());
        });
        let line = Line {
            method: "POST".into(),
            route: "/v1/chat/completions".into(),
            status: 200,
            start: Instant::now(),
            facts,
        };
        let text = line.render(false);
        for part in [
            " INFO inferscale::http",
            " method=POST",
            " route=/v1/chat/completions",
            " status=200",
            " tenant=acme",
            " mode=kv",
            " k=8",
            " prompt_tokens=120",
            " completion_tokens=16",
            " ttft_ms=85.2",
            r#" error="a \"quoted\" reason""#,
        ] {
            assert!(text.contains(part), "{part} not in {text}");
        }
        assert!(!text.contains("alex"), "{text}");
        let v: Value = serde_json::from_str(&line.render(true)).unwrap_or_default();
        assert_eq!(
            (v["level"].as_str(), v["status"].as_u64(), v["k"].as_u64()),
            (Some("info"), Some(200), Some(8)),
            "{v}"
        );
        assert_eq!(v["user"].as_str().map(str::len), Some(16), "{v}");
        std::mem::forget(line);
    }
}
