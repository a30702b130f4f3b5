//! Prometheus text exposition (format 0.0.4) from plain atomics.
//!
//! The router and the worker each expose a handful of counters, gauges
//! and histograms; each is a few atomics, rendered on scrape.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// The exposition's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// Upper bounds (seconds) of the latency buckets: 1 ms to 60 s.
pub const LATENCY_BUCKETS: [f64; 16] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0];

/// A cumulative histogram over fixed bucket bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    /// Sum in millionths of the unit (atomics hold integers).
    sum_micros: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::new(&LATENCY_BUCKETS)
    }
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, value: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if value <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add((value.max(0.0) * 1e6) as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Writes the `_bucket`, `_sum` and `_count` lines under `labels`
    /// (`key="value",…`, possibly empty).
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {}", c.load(Ordering::Relaxed));
        }
        let n = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {n}");
        let braced = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braced} {}", self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{braced} {n}");
    }
}

/// Writes a metric family's `# HELP` and `# TYPE` lines.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Writes one unlabelled sample with its header; a name ending in
/// `_total` is typed as a counter, anything else as a gauge.
pub fn single(out: &mut String, name: &str, help: &str, value: f64) {
    let kind = if name.ends_with("_total") { "counter" } else { "gauge" };
    header(out, name, kind, help);
    let _ = writeln!(out, "{name} {value}");
}

/// Escapes a label value (backslash, quote, newline).
pub fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
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
        assert!(out.contains("x_sum 0.203"), "{out}");
    }

    #[test]
    fn labelled_lines_and_escapes() {
        static B: [f64; 2] = [1.0, 8.0];
        let h = Histogram::new(&B);
        h.observe(4.0);
        let mut out = String::new();
        h.render(&mut out, "rows", "mode=\"kv\"");
        assert!(out.contains("rows_bucket{mode=\"kv\",le=\"1\"} 0"), "{out}");
        assert!(out.contains("rows_bucket{mode=\"kv\",le=\"8\"} 1"), "{out}");
        assert!(out.contains("rows_count{mode=\"kv\"} 1"), "{out}");
        assert_eq!(label("a\"b\\c"), "a\\\"b\\\\c");
    }
}
