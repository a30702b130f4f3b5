//! Prometheus metrics of the router, in the text exposition format.
//!
//! A handful of counters and histograms need no metrics framework: each is
//! a few atomics, rendered on scrape ([`inferscale_telemetry::prom`]).

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use inferscale_telemetry::prom::{self, Histogram};
use inferscale_types::Mode;

/// Memory modes, in the order of the per-mode histograms.
const MODES: [Mode; 4] = Mode::ALL;

#[derive(Default)]
pub struct Metrics {
    /// Per mode: time to first token, and time per output token after it.
    pub ttft: [Histogram; 4],
    pub tpot: [Histogram; 4],
    /// Per mode: request arrival to the last token.
    pub e2e: [Histogram; 4],
    /// Requests by (route, status code).
    requests: Mutex<std::collections::BTreeMap<(String, u16), u64>>,
    pub output_tokens: AtomicU64,
    /// Prompt tokens of finished chat requests, as their usage counts them.
    pub prompt_tokens: AtomicU64,
    pub ingested_units: AtomicU64,
}

pub fn mode_index(mode: Mode) -> usize {
    MODES.iter().position(|&m| m == mode).unwrap_or(0)
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
        prom::header(&mut out, "inferscale_requests_total", "counter", "HTTP requests by route and status.");
        if let Ok(m) = self.requests.lock() {
            for ((route, status), n) in m.iter() {
                let _ = writeln!(out, "inferscale_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
            }
        }
        for (name, help, h) in [
            ("inferscale_ttft_seconds", "Time to first token by memory mode.", &self.ttft),
            ("inferscale_tpot_seconds", "Time per output token after the first, by memory mode.", &self.tpot),
            ("inferscale_e2e_request_latency_seconds", "Request arrival to the last token, by memory mode.", &self.e2e),
        ] {
            prom::header(&mut out, name, "histogram", help);
            for (mode, h) in MODES.iter().zip(h.iter()) {
                h.render(&mut out, name, &format!("mode=\"{mode}\""));
            }
        }
        for (name, help, v) in [
            ("inferscale_output_tokens_total", "Tokens generated.", &self.output_tokens),
            (
                "inferscale_prompt_tokens_total",
                "Prompt tokens of finished requests (injected memory included).",
                &self.prompt_tokens,
            ),
            ("inferscale_ingested_units_total", "Memory units stored.", &self.ingested_units),
        ] {
            prom::single(&mut out, name, help, v.load(Ordering::Relaxed) as f64);
        }
        for (name, help, v) in gauges {
            prom::single(&mut out, name, help, *v);
        }
        out
    }
}
