//! Prometheus metrics of the router, in the text exposition format.
//!
//! A handful of counters and histograms need no metrics framework: each is
//! a few atomics, rendered on scrape.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds (seconds) of the latency buckets: 1 ms to 60 s.
const BUCKETS: [f64; 16] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0];

#[derive(Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    /// Sum in microseconds (atomics hold integers).
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            if seconds <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {}", c.load(Ordering::Relaxed));
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {n}");
        let braced = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braced} {}", self.sum_us.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{braced} {n}");
    }
}

/// Memory modes, in label order.
pub const MODES: [&str; 3] = ["kv", "prompt", "none"];

#[derive(Default)]
pub struct Metrics {
    /// Per mode: time to first token, and time per output token after it.
    pub ttft: [Histogram; 3],
    pub tpot: [Histogram; 3],
    /// Requests by (route, status code).
    requests: Mutex<std::collections::BTreeMap<(String, u16), u64>>,
    pub output_tokens: AtomicU64,
    pub ingested_units: AtomicU64,
}

pub fn mode_index(mode: &str) -> usize {
    MODES.iter().position(|m| *m == mode).unwrap_or(2)
}

impl Metrics {
    pub fn request(&self, route: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((route.to_string(), status)).or_default() += 1;
        }
    }

    /// The exposition text; `gauges` are (name, help, value) read at scrape
    /// (a name ending in `_total` is typed as a counter).
    pub fn render(&self, gauges: &[(&str, &str, f64)]) -> String {
        let mut out = String::new();
        out.push_str("# HELP inferscale_requests_total HTTP requests by route and status.\n");
        out.push_str("# TYPE inferscale_requests_total counter\n");
        if let Ok(m) = self.requests.lock() {
            for ((route, status), n) in m.iter() {
                let _ = writeln!(out, "inferscale_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
            }
        }
        for (name, help, h) in [
            ("inferscale_ttft_seconds", "Time to first token by memory mode.", &self.ttft),
            ("inferscale_tpot_seconds", "Time per output token after the first, by memory mode.", &self.tpot),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            for (mode, h) in MODES.iter().zip(h.iter()) {
                h.render(&mut out, name, &format!("mode=\"{mode}\""));
            }
        }
        for (name, help, v) in [
            ("inferscale_output_tokens_total", "Tokens generated.", &self.output_tokens),
            ("inferscale_ingested_units_total", "Memory units stored.", &self.ingested_units),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        }
        for (name, help, v) in gauges {
            // Totals read at scrape time are counters by name.
            let kind = if name.ends_with("_total") { "counter" } else { "gauge" };
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::default();
        h.observe(0.003);
        h.observe(0.2);
        let mut out = String::new();
        h.render(&mut out, "x", "");
        assert!(out.contains("x_bucket{le=\"0.0025\"} 0"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.005\"} 1"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.25\"} 2"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 2"), "{out}");
        assert!(out.contains("x_count 2"), "{out}");
    }
}
