//! The load test's two charts: TTFT p50 against k (one line per mode and
//! user count) and requests/s against users (one line per mode and k).
//!
//! kv lines are blue and prompt lines red, darker for more users (or larger
//! k), so the mode comparison — the point of the project — reads at a glance.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::style::RGBColor;

use crate::error::Result;
use crate::report::{Point, Report};
use inferscale_eval::plot::{Layout, Panel, Series, line_charts_with};

/// Light to dark.
const BLUES: [RGBColor; 4] = [RGBColor(107, 174, 214), RGBColor(33, 113, 181), RGBColor(8, 48, 107), RGBColor(0, 0, 0)];
const REDS: [RGBColor; 4] =
    [RGBColor(252, 146, 114), RGBColor(222, 45, 38), RGBColor(103, 0, 13), RGBColor(60, 60, 60)];

/// Lines keyed by (mode rank, mode, parameter), so kv comes before prompt.
type Lines = BTreeMap<(u8, String, u64), Vec<(f64, f64)>>;

fn rank(mode: &str) -> u8 {
    match mode {
        "kv" => 0,
        "prompt" => 1,
        _ => 2,
    }
}

fn lines(points: &[Point], param: fn(&Point) -> u64, xy: fn(&Point) -> (f64, f64)) -> Lines {
    let mut out = Lines::new();
    for p in points {
        out.entry((rank(&p.mode), p.mode.clone(), param(p))).or_default().push(xy(p));
    }
    for pts in out.values_mut() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// Series and their colours: each mode's lines shaded light to dark.
fn series(lines: Lines, label: fn(&str, u64) -> String) -> (Vec<Series>, Vec<RGBColor>) {
    let mut shade: BTreeMap<u8, usize> = BTreeMap::new();
    let mut palette = Vec::new();
    let series = lines
        .into_iter()
        .map(|((r, mode, param), points)| {
            let i = shade.entry(r).or_insert(0);
            let ramp = if r == 0 { &BLUES } else { &REDS };
            palette.push(ramp[*i % ramp.len()]);
            *i += 1;
            Series { label: label(&mode, param), points }
        })
        .collect();
    (series, palette)
}

/// Writes `{stem}-ttft-vs-k.png` and `{stem}-throughput-vs-users.png` into
/// `dir` (900×500 each) and returns their paths.
pub fn write(report: &Report, dir: &Path, stem: &str) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|source| crate::Error::Io { path: dir.to_path_buf(), source })?;
    let subtitle = format!("{}, max_tokens {}", report.target.model, report.target.max_tokens);
    let mut written = Vec::new();

    let ttft = lines(&report.points, |p| p.users as u64, |p| (f64::from(p.k), p.ttft_ms.p50));
    let (s, palette) = series(ttft, |m, u| format!("{m}, {u} user{}", if u == 1 { "" } else { "s" }));
    let panel = Panel {
        title: format!("Time to first token, median ({subtitle})"),
        y_label: "milliseconds".into(),
        log_y: true,
        series: s,
    };
    let layout = Layout { x_label: "k (facts retrieved)".into(), width: 900, height: 500, palette, light_grid: false };
    let path = dir.join(format!("{stem}-ttft-vs-k.png"));
    line_charts_with(&path, &[panel], &layout)?;
    written.push(path);

    let thr = lines(&report.points, |p| u64::from(p.k), |p| (p.users as f64, p.requests_per_s));
    let (s, palette) = series(thr, |m, k| format!("{m}, k={k}"));
    let panel = Panel {
        title: format!("Throughput, closed loop ({subtitle})"),
        y_label: "requests/s".into(),
        log_y: false,
        series: s,
    };
    let layout = Layout { x_label: "concurrent users".into(), width: 900, height: 500, palette, light_grid: false };
    let path = dir.join(format!("{stem}-throughput-vs-users.png"));
    line_charts_with(&path, &[panel], &layout)?;
    written.push(path);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::client::{Outcome, Sample};
    use crate::report::{Ingest, Target};

    #[test]
    fn both_charts_are_small_pngs() {
        let ok = |ms: u64| {
            Outcome::Ok(Sample {
                ttft: Duration::from_millis(ms),
                e2e: Duration::from_millis(10 * ms),
                output_tokens: 8,
                sources: None,
                sent: Duration::ZERO,
            })
        };
        let mut points = Vec::new();
        for (mode, base) in [("kv", 30), ("prompt", 90)] {
            for users in [1, 5, 20] {
                for k in [5, 20, 50] {
                    let o = [ok(base + k * users as u64)];
                    points.push(Point::new(mode, k as u32, users, Duration::from_secs(users as u64), &o));
                }
            }
        }
        let target = Target {
            url: "http://127.0.0.1:8080".into(),
            model: "smollm2".into(),
            source: "synthetic:8 facts per user".into(),
            machine: None,
            requests_per_point: 10,
            duration_s_per_point: 10.0,
            max_tokens: 16,
            warmup_requests: 1,
            ignore_eos: false,
            population: None,
        };
        let report = Report { target, date: "2026-12-01".into(), ingest: Ingest::default(), points };
        let dir = std::env::temp_dir().join(format!("inferscale-loadtest-charts-{}", std::process::id()));
        let paths = write(&report, &dir, "t").expect("charts");
        assert_eq!(paths.len(), 2);
        for p in &paths {
            let bytes = std::fs::read(p).expect("png");
            assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{}", p.display());
            // IHDR: width and height, big-endian, at bytes 16..24.
            assert_eq!((&bytes[16..20], &bytes[20..24]), (&900u32.to_be_bytes()[..], &500u32.to_be_bytes()[..]));
            assert!(bytes.len() < 200_000, "{}: {} bytes", p.display(), bytes.len());
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
