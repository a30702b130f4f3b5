//! Progress of a long command — a model fetch, an ingest, an evaluation, a
//! benchmark — on stderr: an `indicatif` bar with its rate and time left on a
//! terminal; plain lines otherwise (a log file, CI), one every
//! [`LINE_EVERY`] and one at the end, so that a log holds a readable line per
//! step instead of one long line of carriage returns.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a plain line is written when stderr is not a terminal.
pub const LINE_EVERY: Duration = Duration::from_secs(10);

pub struct Progress {
    /// `inferscale ingest`, … : what each plain line starts with.
    what: String,
    /// What is counted (`turns`, `questions`, `MB`).
    unit: String,
    total: u64,
    done: u64,
    start: Instant,
    /// Some on a terminal.
    bar: Option<ProgressBar>,
    last_line: Instant,
    every: Duration,
}

impl Progress {
    /// Progress over `total` `unit`s, drawn as a bar on a terminal.
    pub fn new(what: &str, total: u64, unit: &str) -> Progress {
        Self::with(what, total, unit, std::io::stderr().is_terminal(), LINE_EVERY)
    }

    /// As [`Progress::new`], choosing bar (`tty`) or lines, and the lines' pace.
    pub fn with(what: &str, total: u64, unit: &str, tty: bool, every: Duration) -> Progress {
        let bar = tty.then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            let template = format!(
                "{what}: [{{bar:30}}] {{pos}}/{{len}} {unit} ({{per_sec}}, {{eta}} left) {{msg}}",
                what = what.replace('{', "{{").replace('}', "}}"),
                unit = unit.replace('{', "{{").replace('}', "}}"),
            );
            if let Ok(style) = ProgressStyle::with_template(&template) {
                bar.set_style(style.progress_chars("#>-"));
            }
            bar
        });
        let start = Instant::now();
        Progress { what: what.into(), unit: unit.into(), total, done: 0, start, bar, last_line: start, every }
    }

    /// `done` of the total reached; `note` says where (shown beside the bar,
    /// or in the next plain line).
    pub fn set(&mut self, done: u64, note: &str) {
        self.done = done.min(self.total);
        if let Some(bar) = &self.bar {
            bar.set_position(self.done);
            bar.set_message(note.to_string());
        } else if self.last_line.elapsed() >= self.every {
            self.last_line = Instant::now();
            eprintln!("{}", self.line(note));
        }
    }

    /// One more done.
    pub fn inc(&mut self, note: &str) {
        self.set(self.done + 1, note);
    }

    /// The plain line for the current state: count, share, rate and time left.
    pub fn line(&self, note: &str) -> String {
        let secs = self.start.elapsed().as_secs_f64();
        let rate = if secs > 0.0 { self.done as f64 / secs } else { 0.0 };
        let left = match (rate > 0.0, self.total > self.done) {
            (true, true) => format!(", {} left", human((self.total - self.done) as f64 / rate)),
            (_, false) => String::new(),
            (false, true) => ", time left unknown".into(),
        };
        let share = 100.0 * self.done as f64 / self.total.max(1) as f64;
        let note = if note.is_empty() { String::new() } else { format!(" {note}") };
        format!(
            "{}: {}/{} {} ({share:.0}%, {rate:.1} {}/s{left}){note}",
            self.what, self.done, self.total, self.unit, self.unit
        )
    }

    /// Ends the bar (or writes the last plain line) with `summary`.
    pub fn finish(self, summary: &str) {
        match &self.bar {
            Some(bar) => bar.finish_with_message(summary.to_string()),
            None => eprintln!("{}", self.line(summary)),
        }
    }
}

/// Seconds as `1 h 02 min`, `3 min 05 s` or `12 s`.
fn human(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {:02} s", s / 60, s % 60),
        _ => format!("{} h {:02} min", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_say_count_share_rate_and_time_left() {
        let mut p = Progress::with("inferscale ingest", 200, "turns", false, Duration::from_secs(3600));
        p.set(50, "D1:50");
        let line = p.line("D1:50");
        assert!(line.starts_with("inferscale ingest: 50/200 turns (25%, "), "{line}");
        assert!(line.contains("turns/s") && line.contains(" left)") && line.ends_with(" D1:50"), "{line}");
        p.set(500, "");
        assert!(p.line("").starts_with("inferscale ingest: 200/200 turns (100%"), "{}", p.line(""));
        assert!(!p.line("").contains("left"), "nothing left at the end: {}", p.line(""));
        assert_eq!(human(12.4), "12 s");
        assert_eq!(human(185.0), "3 min 05 s");
        assert_eq!(human(3720.0), "1 h 02 min");
    }
}
