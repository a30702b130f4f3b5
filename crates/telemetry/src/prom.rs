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

/// Writes `inferscale_build_info{component,version} 1`: which build a
/// process runs, for dashboards and alerts that join on it.
pub fn build_info(out: &mut String, component: &str, version: &str) {
    header(out, "inferscale_build_info", "gauge", "Always 1; the labels say which build runs.");
    let _ =
        writeln!(out, "inferscale_build_info{{component=\"{}\",version=\"{}\"}} 1", label(component), label(version));
}

/// Linux exports /proc times in USER_HZ ticks, 100 per second on every
/// architecture the kernel supports today.
const USER_HZ: f64 = 100.0;

/// Writes the standard `process_*` metrics (as every Prometheus client
/// library names them) from `/proc/self`; nothing where `/proc` is absent.
pub fn process(out: &mut String) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return };
    // Fields after the command name (which may hold spaces) in ")".
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    // `rest` starts at field 3 (state): utime is field 14, stime 15, starttime 22.
    if let (Some(utime), Some(stime)) = (field(11), field(12)) {
        single(
            out,
            "process_cpu_seconds_total",
            "User and system CPU time spent, in seconds.",
            (utime + stime) / USER_HZ,
        );
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |key: &str| {
        status.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
    };
    if let Some(rss) = kib("VmRSS:") {
        single(out, "process_resident_memory_bytes", "Resident memory size in bytes.", rss * 1024.0);
    }
    if let Some(vm) = kib("VmSize:") {
        single(out, "process_virtual_memory_bytes", "Virtual memory size in bytes.", vm * 1024.0);
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        single(out, "process_open_fds", "Open file descriptors.", fds.count() as f64);
    }
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    if let Some(max) = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
    {
        single(out, "process_max_fds", "Maximum open file descriptors.", max);
    }
    // The boot time does not change: /proc/stat (a line per CPU and more)
    // is read once, not at every scrape.
    static BOOT: std::sync::OnceLock<Option<f64>> = std::sync::OnceLock::new();
    let boot = *BOOT.get_or_init(|| {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        stat.lines().find_map(|l| l.strip_prefix("btime ")).and_then(|v| v.trim().parse::<f64>().ok())
    });
    if let (Some(boot), Some(start)) = (boot, field(19)) {
        single(
            out,
            "process_start_time_seconds",
            "Start time since the Unix epoch, in seconds.",
            boot + start / USER_HZ,
        );
    }
}

/// A worker's load and capacity, under the same names and types on the
/// worker's `/metrics` and, labelled `worker`, on the router's (from the
/// workers' Stats calls).
pub mod worker {
    /// Requests waiting for admission (gauge).
    pub const REQUESTS_WAITING: &str = "inferscale_worker_requests_waiting";
    /// Requests in the running batch (gauge).
    pub const REQUESTS_RUNNING: &str = "inferscale_worker_requests_running";
    /// KV cache blocks, a capacity (gauge).
    pub const KV_BLOCKS: &str = "inferscale_worker_kv_blocks";
    /// Free KV cache blocks (gauge).
    pub const KV_BLOCKS_FREE: &str = "inferscale_worker_kv_blocks_free";
    /// Users with memory on the worker (gauge).
    pub const USERS: &str = "inferscale_worker_users";
    /// Memory units stored on the worker (gauge).
    pub const MEMORY_UNITS: &str = "inferscale_worker_memory_units";
    /// Requests that left the worker, by `status` (counter).
    pub const REQUESTS_TOTAL: &str = "inferscale_worker_requests_total";
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
    fn process_metrics_read_this_process() {
        let mut out = String::new();
        process(&mut out);
        let value = |name: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{name} missing: {out}"))
        };
        assert!(value("process_resident_memory_bytes") > 1e6, "{out}");
        assert!(value("process_open_fds") >= 3.0, "{out}");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        let start = value("process_start_time_seconds");
        assert!(start <= now + 1.0 && start > now - 86_400.0, "start {start}, now {now}");
        assert!(out.contains("# TYPE process_cpu_seconds_total counter"), "{out}");
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
