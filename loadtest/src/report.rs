//! The numbers of a run: one [`Point`] per (mode, k, users), the JSON
//! [`Report`] around them, and the table printed for people.
//!
//! Percentiles are nearest-rank over the successful requests of a point
//! (the smallest value with at least q·n values at or below it), so every
//! reported latency is one that a request really had. Rates divide by the
//! point's wall time, from the moment all its users start asking until the
//! last request ends.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::client::{FactSources, Outcome, Sample};

/// Quantile `q` (0–1) of ascending `sorted` values, nearest rank; 0 when empty.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// p50, p90, p99 and mean of a latency, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Percentiles {
    pub fn of_ms(durations: impl IntoIterator<Item = Duration>) -> Percentiles {
        let mut v: Vec<f64> = durations.into_iter().map(|d| d.as_secs_f64() * 1e3).collect();
        v.sort_by(f64::total_cmp);
        let mean = if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
        Percentiles { p50: quantile(&v, 0.5), p90: quantile(&v, 0.9), p99: quantile(&v, 0.99), mean }
    }
}

/// One measured configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// `kv` (facts' KV injected) or `prompt` (facts pasted into the prompt).
    pub mode: String,
    /// Facts retrieved per request.
    pub k: u32,
    /// Concurrent closed-loop users.
    pub users: usize,
    /// Requests that ended with `[DONE]`.
    pub requests: usize,
    /// Requests that failed, whatever the reason.
    pub errors: usize,
    /// Failures by HTTP status, SSE error code, `io`, `timeout` or `incomplete`.
    pub errors_by_status: BTreeMap<String, usize>,
    /// The first failure's message, to tell why without rerunning.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub first_error: Option<String>,
    /// Wall time measured, seconds.
    pub duration_s: f64,
    /// Successful requests per second.
    pub requests_per_s: f64,
    pub output_tokens: u64,
    pub output_tokens_per_s: f64,
    /// Time to first token, ms, as the client saw it (request sent → first token chunk).
    pub ttft_ms: Percentiles,
    /// End-to-end latency, ms (request sent → `[DONE]`).
    pub e2e_ms: Percentiles,
    /// Where the facts' KV came from, when the server said (kv and blend
    /// on the native engine).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tiers: Option<Tiers>,
    /// The point second by second, by when requests were sent.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub timeline: Vec<Second>,
}

/// One second of a point: the successful requests sent in it, their TTFT,
/// and where their facts came from. A point's percentiles cannot tell a
/// steady tail from a burst (the cold requests right after a restart, a
/// queue that builds and drains); this can.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Second {
    /// Seconds since the point started (requests sent in [second, second + 1)).
    pub second: u32,
    pub requests: usize,
    pub ttft_ms: Percentiles,
    /// Summed over the second's requests, when the server said.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub facts: Option<FactSources>,
}

impl Second {
    /// Seconds in order, empty ones left out.
    fn timeline(ok: &[&Sample]) -> Vec<Second> {
        let mut by: BTreeMap<u32, Vec<&Sample>> = BTreeMap::new();
        for s in ok {
            by.entry(s.sent.as_secs().min(u64::from(u32::MAX)) as u32).or_default().push(s);
        }
        by.into_iter()
            .map(|(second, xs)| {
                let mut facts: Option<FactSources> = None;
                for src in xs.iter().filter_map(|s| s.sources.as_ref()) {
                    facts.get_or_insert_with(FactSources::default).add(src);
                }
                Second { second, requests: xs.len(), ttft_ms: Percentiles::of_ms(xs.iter().map(|s| s.ttft)), facts }
            })
            .collect()
    }
}

/// A point's requests by where their facts' KV came from: the facts per
/// tier summed, and latency per class of request — a request counts under
/// the slowest place any of its facts came from (`device` < `host` <
/// `disk` < `prefilled`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tiers {
    pub facts: FactSources,
    /// Share of facts found in a cache tier (device or host).
    pub hit_rate: f64,
    pub classes: Vec<ClassLatency>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassLatency {
    pub class: String,
    pub requests: usize,
    pub ttft_ms: Percentiles,
    pub e2e_ms: Percentiles,
}

impl Tiers {
    /// `None` when no sample carried sources.
    fn of(ok: &[&Sample]) -> Option<Tiers> {
        let mut facts = FactSources::default();
        let mut by: BTreeMap<&'static str, Vec<&Sample>> = BTreeMap::new();
        for s in ok {
            let Some(src) = &s.sources else { continue };
            facts.add(src);
            by.entry(src.class()).or_default().push(s);
        }
        if by.is_empty() {
            return None;
        }
        let order = ["device", "host", "disk", "prefilled", "none"];
        let mut classes: Vec<ClassLatency> = by
            .into_iter()
            .map(|(class, xs)| ClassLatency {
                class: class.to_string(),
                requests: xs.len(),
                ttft_ms: Percentiles::of_ms(xs.iter().map(|s| s.ttft)),
                e2e_ms: Percentiles::of_ms(xs.iter().map(|s| s.e2e)),
            })
            .collect();
        classes.sort_by_key(|c| order.iter().position(|o| *o == c.class));
        let total = facts.total();
        let hit_rate =
            if total == 0 { 0.0 } else { (u64::from(facts.device) + u64::from(facts.host)) as f64 / total as f64 };
        Some(Tiers { facts, hit_rate, classes })
    }
}

impl Point {
    /// Summarizes a point's outcomes over `wall` of measuring.
    pub fn new(mode: &str, k: u32, users: usize, wall: Duration, outcomes: &[Outcome]) -> Point {
        let ok: Vec<&Sample> = outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Ok(s) => Some(s),
                Outcome::Failed(_) => None,
            })
            .collect();
        let mut errors_by_status = BTreeMap::new();
        let mut first_error = None;
        for o in outcomes {
            if let Outcome::Failed(f) = o {
                *errors_by_status.entry(f.status.clone()).or_insert(0) += 1;
                first_error.get_or_insert_with(|| format!("{}: {}", f.status, f.message));
            }
        }
        let secs = wall.as_secs_f64();
        let rate = |n: f64| if secs > 0.0 { n / secs } else { 0.0 };
        let output_tokens: u64 = ok.iter().map(|s| s.output_tokens).sum();
        Point {
            mode: mode.to_string(),
            k,
            users,
            requests: ok.len(),
            errors: outcomes.len() - ok.len(),
            errors_by_status,
            first_error,
            duration_s: secs,
            requests_per_s: rate(ok.len() as f64),
            output_tokens,
            output_tokens_per_s: rate(output_tokens as f64),
            ttft_ms: Percentiles::of_ms(ok.iter().map(|s| s.ttft)),
            e2e_ms: Percentiles::of_ms(ok.iter().map(|s| s.e2e)),
            tiers: Tiers::of(&ok),
            timeline: Second::timeline(&ok),
        }
    }
}

/// What was tested, and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Target {
    /// The router's base URL.
    pub url: String,
    /// The served model (from `GET /v1/models`).
    pub model: String,
    /// Where users came from (`locomo:FILE` or `synthetic:F facts per user`).
    pub source: String,
    /// Free text about the machine, when given.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub machine: Option<String>,
    /// Request bound per point (whichever of this and `duration_s` comes first).
    pub requests_per_point: usize,
    /// Time bound per point, seconds.
    pub duration_s_per_point: f64,
    pub max_tokens: u32,
    /// Unmeasured requests each user sends before each point (kv mode, one
    /// output token: they warm the connection and the retrieval path).
    pub warmup_requests: usize,
    pub ignore_eos: bool,
    /// Distinct users and their popularity, when clients were not users.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub population: Option<crate::runner::Population>,
}

/// Ingest before the points: every user's memory sent once.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Ingest {
    pub users: usize,
    /// Units the server stored now; `skipped` ones it already had.
    pub added: u64,
    pub skipped: u64,
    pub seconds: f64,
}

/// The JSON file: `{"target", "date", "ingest", "points"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub target: Target,
    /// UTC day of the run, `YYYY-MM-DD`.
    pub date: String,
    pub ingest: Ingest,
    pub points: Vec<Point>,
}

impl Report {
    /// A Markdown table, one row per point.
    pub fn table(&self) -> String {
        let mut s = String::from(
            "| mode | k | users | requests | errors | req/s | out tok/s | TTFT p50 | TTFT p90 | TTFT p99 | e2e p50 | e2e p90 | e2e p99 |\n\
             |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n",
        );
        for p in &self.points {
            let errors = if p.errors == 0 {
                "0".to_string()
            } else {
                let by: Vec<String> = p.errors_by_status.iter().map(|(k, n)| format!("{n}×{k}")).collect();
                by.join(" ")
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {:.2} | {:.1} | {} | {} | {} | {} | {} | {} |\n",
                p.mode,
                p.k,
                p.users,
                p.requests,
                errors,
                p.requests_per_s,
                p.output_tokens_per_s,
                ms(p.ttft_ms.p50),
                ms(p.ttft_ms.p90),
                ms(p.ttft_ms.p99),
                ms(p.e2e_ms.p50),
                ms(p.e2e_ms.p90),
                ms(p.e2e_ms.p99),
            ));
        }
        if self.points.iter().any(|p| p.tiers.is_some()) {
            s.push_str(
                "\nBy where the facts' KV came from (a request counts under its slowest fact):\n\n\
                 | mode | k | users | facts device/host/disk/prefilled | hit rate | class | requests | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 |\n\
                 |---|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|\n",
            );
            for p in &self.points {
                let Some(t) = &p.tiers else { continue };
                let f = &t.facts;
                for c in &t.classes {
                    s.push_str(&format!(
                        "| {} | {} | {} | {}/{}/{}/{} | {:.3} | {} | {} | {} | {} | {} | {} |\n",
                        p.mode,
                        p.k,
                        p.users,
                        f.device,
                        f.host,
                        f.disk,
                        f.prefilled,
                        t.hit_rate,
                        c.class,
                        c.requests,
                        ms(c.ttft_ms.p50),
                        ms(c.ttft_ms.p99),
                        ms(c.e2e_ms.p50),
                        ms(c.e2e_ms.p99),
                    ));
                }
            }
        }
        s
    }
}

/// Milliseconds to three significant-ish digits, with the unit.
fn ms(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.1} s", v / 1e3)
    } else if v >= 100.0 {
        format!("{v:.0} ms")
    } else {
        format!("{v:.1} ms")
    }
}

/// Today's UTC date, `YYYY-MM-DD`, from the system clock.
pub fn today_utc() -> String {
    let now = inferscale_types::time::rfc3339(inferscale_types::time::now_ms());
    now[..10].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Failure;

    #[test]
    fn nearest_rank_quantiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!((quantile(&v, 0.5), quantile(&v, 0.9), quantile(&v, 0.99)), (50.0, 90.0, 99.0));
        assert_eq!((quantile(&v, 0.0), quantile(&v, 1.0)), (1.0, 100.0));
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
        // Four values: p50 is the 2nd, p90 and p99 the 4th.
        let four = [10.0, 20.0, 30.0, 40.0];
        assert_eq!((quantile(&four, 0.5), quantile(&four, 0.9), quantile(&four, 0.99)), (20.0, 40.0, 40.0));
    }

    #[test]
    fn percentiles_sort_their_input() {
        let p = Percentiles::of_ms([30, 10, 20].map(Duration::from_millis));
        assert_eq!((p.p50, p.p90, p.p99), (20.0, 30.0, 30.0));
        assert!((p.mean - 20.0).abs() < 1e-9);
        assert_eq!(Percentiles::of_ms([]), Percentiles::default());
    }

    fn ok(ttft_ms: u64, e2e_ms: u64, tokens: u64) -> Outcome {
        Outcome::Ok(Sample {
            ttft: Duration::from_millis(ttft_ms),
            e2e: Duration::from_millis(e2e_ms),
            output_tokens: tokens,
            sources: None,
            sent: Duration::ZERO,
        })
    }

    fn from(ttft_ms: u64, device: u32, host: u32, disk: u32, prefilled: u32) -> Outcome {
        let sources = Some(FactSources { device, host, disk, prefilled });
        match ok(ttft_ms, 2 * ttft_ms, 4) {
            Outcome::Ok(s) => Outcome::Ok(Sample { sources, ..s }),
            f => f,
        }
    }

    #[test]
    fn requests_are_classed_by_their_slowest_fact() {
        let outcomes = [from(10, 5, 0, 0, 0), from(12, 4, 1, 0, 0), from(30, 3, 0, 0, 2), from(11, 5, 0, 0, 0)];
        let p = Point::new("kv", 5, 2, Duration::from_secs(1), &outcomes);
        let t = p.tiers.as_ref().expect("sources were reported");
        assert_eq!(t.facts, FactSources { device: 17, host: 1, disk: 0, prefilled: 2 });
        assert!((t.hit_rate - 0.9).abs() < 1e-9);
        let classes: Vec<(&str, usize, f64)> =
            t.classes.iter().map(|c| (c.class.as_str(), c.requests, c.ttft_ms.p99)).collect();
        assert_eq!(classes, [("device", 2, 11.0), ("host", 1, 12.0), ("prefilled", 1, 30.0)]);
        let r = Report {
            target: target(),
            date: "2026-12-03".into(),
            ingest: Ingest::default(),
            points: vec![p, Point::new("prompt", 5, 2, Duration::from_secs(1), &[ok(50, 90, 4)])],
        };
        let table = r.table();
        assert!(table.contains("| kv | 5 | 2 | 17/1/0/2 | 0.900 | prefilled | 1 | 30.0 ms |"), "{table}");
        // A point whose server said nothing of sources has no tiers.
        assert!(r.points[1].tiers.is_none());
    }

    #[test]
    fn the_timeline_buckets_requests_by_when_they_were_sent() {
        let at = |sent_ms: u64, o: Outcome| match o {
            Outcome::Ok(s) => Outcome::Ok(Sample { sent: Duration::from_millis(sent_ms), ..s }),
            f => f,
        };
        let outcomes = [
            at(100, from(900, 0, 0, 0, 8)),
            at(950, from(700, 0, 0, 4, 4)),
            at(2_500, from(20, 8, 0, 0, 0)),
            at(2_999, from(30, 6, 2, 0, 0)),
            failed("429"),
        ];
        let p = Point::new("kv", 8, 2, Duration::from_secs(3), &outcomes);
        let seconds: Vec<(u32, usize, f64, f64)> =
            p.timeline.iter().map(|s| (s.second, s.requests, s.ttft_ms.p50, s.ttft_ms.p99)).collect();
        // Second 1 had no request: it is left out, not reported as zeros.
        assert_eq!(seconds, [(0, 2, 700.0, 900.0), (2, 2, 20.0, 30.0)]);
        assert_eq!(p.timeline[0].facts, Some(FactSources { device: 0, host: 0, disk: 4, prefilled: 12 }));
        assert_eq!(p.timeline[1].facts, Some(FactSources { device: 14, host: 2, disk: 0, prefilled: 0 }));
        let json = serde_json::to_string(&p).expect("json");
        assert_eq!(serde_json::from_str::<Point>(&json).expect("parse"), p);
        // Without sources a second carries none.
        let plain = Point::new("prompt", 8, 1, Duration::from_secs(1), &[ok(50, 90, 4)]);
        assert_eq!(plain.timeline.len(), 1);
        assert!(plain.timeline[0].facts.is_none());
    }

    fn failed(status: &str) -> Outcome {
        Outcome::Failed(Failure { status: status.into(), message: "busy".into() })
    }

    #[test]
    fn a_point_counts_rates_and_errors() {
        let outcomes = [ok(40, 400, 10), ok(60, 500, 20), failed("429"), ok(50, 600, 30), failed("429"), failed("io")];
        let p = Point::new("kv", 20, 3, Duration::from_secs(2), &outcomes);
        assert_eq!((p.requests, p.errors, p.output_tokens), (3, 3, 60));
        assert_eq!(p.errors_by_status, BTreeMap::from([("429".into(), 2), ("io".into(), 1)]));
        assert_eq!(p.first_error.as_deref(), Some("429: busy"));
        assert!((p.requests_per_s - 1.5).abs() < 1e-9);
        assert!((p.output_tokens_per_s - 30.0).abs() < 1e-9);
        assert_eq!((p.ttft_ms.p50, p.ttft_ms.p99), (50.0, 60.0));
        assert_eq!((p.e2e_ms.p50, p.e2e_ms.p90), (500.0, 600.0));
        // Failed requests carry no latency: they do not drag the percentiles.
        let none = Point::new("prompt", 5, 1, Duration::ZERO, &[failed("503")]);
        assert_eq!((none.requests, none.errors, none.requests_per_s, none.ttft_ms.p50), (0, 1, 0.0, 0.0));
    }

    #[test]
    fn report_round_trips_and_tabulates() {
        let target = target();
        let points = vec![Point::new("kv", 5, 2, Duration::from_secs(1), &[ok(40, 400, 10), failed("429")])];
        let r = Report { target, date: "2026-12-01".into(), ingest: Ingest::default(), points };
        let json = serde_json::to_string(&r).expect("json");
        assert_eq!(serde_json::from_str::<Report>(&json).expect("parse"), r);
        let t = r.table();
        assert_eq!(t.lines().count(), 3);
        assert!(t.contains("| kv | 5 | 2 | 1 | 1×429 | 1.00 | 10.0 | 40.0 ms |"), "{t}");
    }

    fn target() -> Target {
        Target {
            url: "http://127.0.0.1:8080".into(),
            model: "smollm2".into(),
            source: "synthetic:10 facts per user".into(),
            machine: None,
            requests_per_point: 10,
            duration_s_per_point: 30.0,
            max_tokens: 16,
            warmup_requests: 1,
            ignore_eos: false,
            population: None,
        }
    }
}
