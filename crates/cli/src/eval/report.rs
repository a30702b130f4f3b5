//! The evaluation's report: every answer, the summary rows per mode, window
//! and k, and their Markdown table and chart.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use inferscale_eval::plot;
use serde::{Deserialize, Serialize};

use crate::bench::median;

#[derive(Serialize, Deserialize, Clone)]
pub(super) struct Answer {
    pub(super) sample: String,
    pub(super) question: usize,
    pub(super) category: u8,
    pub(super) mode: String,
    /// Blend rows: the share of injected tokens recomputed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) blend_ratio: Option<f32>,
    /// Blend rows with a focus (`--blend-focus`): the share of the
    /// recomputed tokens that were the memory's last ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) blend_focus: Option<f32>,
    /// Blend rows ranked otherwise than by deviation (`--blend-select`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) blend_select: Option<String>,
    pub(super) window: Option<usize>,
    /// kv and blend rows when formats were chosen (`--kv-format`): the
    /// format the memory stored the KV in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) kv_format: Option<String>,
    pub(super) k: usize,
    pub(super) answer: String,
    pub(super) f1: f64,
    /// Set for the questions whose TTFT was measured (see `--ttft-questions`).
    pub(super) ttft_ms: Option<f64>,
    pub(super) recall: Option<f64>,
    /// kv and blend rows: KL(prompt ‖ this) of the first-token
    /// distributions, and whether the greedy answers are identical.
    pub(super) kl_vs_prompt: Option<f64>,
    pub(super) same_as_prompt: Option<bool>,
    /// kv and blend rows from a memory in another format than the first
    /// `--kv-format`: KL(first format ‖ this) of the first-token
    /// distributions, and whether the greedy answers are identical.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) kl_vs_reference: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) same_as_reference: Option<bool>,
    /// Whether the answer copies a fact's `Speaker (date):` label (absent
    /// in reports written before this was counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) copies_label: Option<bool>,
}

impl Answer {
    /// The blend variant as text (ratio, and focus and selection when
    /// set), to key by: f32 has no order to sort by.
    pub(super) fn blend_key(&self) -> Option<String> {
        self.blend_ratio.map(|r| {
            let mut key = r.to_string();
            if let Some(f) = self.blend_focus {
                key += &format!(" f={f}");
            }
            if let Some(s) = &self.blend_select {
                key += &format!(" {s}");
            }
            key
        })
    }
}

#[derive(Serialize, Deserialize)]
pub(super) struct Ingest {
    pub(super) window: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) kv_format: Option<String>,
    pub(super) turns: usize,
    pub(super) seconds: f64,
    pub(super) turns_per_s: f64,
    pub(super) encoded_tokens_per_s: f64,
}

#[derive(Serialize, Deserialize)]
pub(super) struct Row {
    pub(super) mode: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) blend_ratio: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) blend_focus: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) blend_select: Option<String>,
    pub(super) window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) kv_format: Option<String>,
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) f1: f64,
    pub(super) f1_by_category: BTreeMap<u8, f64>,
    /// Absent for `none` rows (nothing retrieved).
    pub(super) recall: Option<f64>,
    pub(super) ttft_ms_median: f64,
    pub(super) agreement: Option<f64>,
    pub(super) kl_mean: Option<f64>,
    /// Rows in another format than the first: agreement with and mean KL
    /// from the first format's answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) agreement_vs_reference: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) kl_vs_reference: Option<f64>,
    /// Share of answers that copy a fact's label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) labels: Option<f64>,
}

impl Row {
    /// The mode as tables and charts name it: `blend r=0.15` for blend,
    /// followed by the KV format when formats were chosen.
    fn mode_label(&self) -> String {
        let mut mode = match (self.blend_ratio, self.blend_focus) {
            (Some(r), Some(f)) => format!("{} r={r} f={f}", self.mode),
            (Some(r), None) => format!("{} r={r}", self.mode),
            _ => self.mode.clone(),
        };
        if let Some(s) = &self.blend_select {
            mode += &format!(" {s}");
        }
        match &self.kv_format {
            Some(f) => format!("{mode} {f}"),
            None => mode,
        }
    }
}

#[derive(Serialize, Deserialize)]
pub(super) struct Report {
    pub(super) data: String,
    pub(super) samples: Vec<String>,
    pub(super) model: String,
    /// How facts were ranked (absent in reports written before retrievers existed: dense).
    #[serde(default)]
    pub(super) retriever: Option<String>,
    /// The system prompt and instruction (absent in older reports: the defaults of then).
    #[serde(default)]
    pub(super) prompts: Option<inferscale_memory::Prompts>,
    pub(super) ingest: Vec<Ingest>,
    pub(super) summary: Vec<Row>,
    pub(super) answers: Vec<Answer>,
}

pub(super) fn write_outputs(out: &std::path::Path, report: &Report) -> Result<()> {
    let md = markdown(report);
    std::fs::write(out.join("locomo.md"), &md)?;
    println!("{md}");
    let png = out.join("locomo.png");
    match plot::line_charts(&png, &panels(&report.summary)) {
        Ok(()) => eprintln!("inferscale eval: wrote locomo.json, locomo.md and locomo.png in {}", out.display()),
        Err(e) => eprintln!("inferscale eval: wrote locomo.json and locomo.md in {}; no chart: {e:#}", out.display()),
    }
    Ok(())
}

/// F1 and TTFT against k, one line per mode (and window for kv).
fn panels(rows: &[Row]) -> Vec<plot::Panel> {
    let mut lines: BTreeMap<String, Vec<&Row>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.mode != "none") {
        let label = match r.window {
            Some(w) => format!("{} w={w}", r.mode_label()),
            None => r.mode_label(),
        };
        lines.entry(label).or_default().push(r);
    }
    let series = |f: fn(&Row) -> f64| {
        lines
            .iter()
            .map(|(label, rs)| plot::Series {
                label: label.clone(),
                points: rs.iter().map(|r| (r.k as f64, f(r))).collect(),
            })
            .collect()
    };
    vec![
        plot::Panel {
            title: "Token F1 (LoCoMo cat. 1-4)".into(),
            y_label: "F1".into(),
            log_y: false,
            series: series(|r| r.f1),
        },
        plot::Panel {
            title: "Time to first token".into(),
            y_label: "ms (median)".into(),
            log_y: true,
            series: series(|r| r.ttft_ms_median),
        },
    ]
}

pub(super) fn summarize(answers: &[Answer]) -> Vec<Row> {
    // (mode, blend variant, window, format, k).
    type Key = (String, Option<String>, Option<usize>, Option<String>, usize);
    let mut groups: BTreeMap<Key, Vec<&Answer>> = BTreeMap::new();
    for x in answers {
        let key = (x.mode.clone(), x.blend_key(), x.window, x.kv_format.clone(), x.k);
        groups.entry(key).or_default().push(x);
    }
    groups
        .into_iter()
        .map(|((mode, _, window, kv_format, k), xs)| {
            let mean = |v: Vec<f64>| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
            let mut by_cat: BTreeMap<u8, Vec<f64>> = BTreeMap::new();
            xs.iter().for_each(|x| by_cat.entry(x.category).or_default().push(x.f1));
            let kls: Vec<f64> = xs.iter().filter_map(|x| x.kl_vs_prompt).collect();
            let ref_kls: Vec<f64> = xs.iter().filter_map(|x| x.kl_vs_reference).collect();
            let share = |f: fn(&Answer) -> Option<bool>| {
                let v: Vec<f64> = xs.iter().filter_map(|x| f(x).map(|b| if b { 1.0 } else { 0.0 })).collect();
                (!v.is_empty()).then(|| mean(v))
            };
            Row {
                mode,
                blend_ratio: xs[0].blend_ratio,
                blend_focus: xs[0].blend_focus,
                blend_select: xs[0].blend_select.clone(),
                window,
                kv_format,
                k,
                n: xs.len(),
                f1: mean(xs.iter().map(|x| x.f1).collect()),
                f1_by_category: by_cat.into_iter().map(|(c, v)| (c, mean(v))).collect(),
                recall: {
                    let r: Vec<f64> = xs.iter().filter_map(|x| x.recall).collect();
                    (!r.is_empty()).then(|| mean(r))
                },
                ttft_ms_median: median(xs.iter().filter_map(|x| x.ttft_ms).collect()),
                agreement: share(|x| x.same_as_prompt),
                kl_mean: (!kls.is_empty()).then(|| mean(kls)),
                agreement_vs_reference: share(|x| x.same_as_reference),
                kl_vs_reference: (!ref_kls.is_empty()).then(|| mean(ref_kls)),
                labels: share(|x| x.copies_label),
            }
        })
        .collect()
}

fn markdown(r: &Report) -> String {
    let mut s = format!(
        "LoCoMo: {} ({}), model {}, retriever {}\n\n",
        r.data,
        r.samples.join(", "),
        r.model,
        r.retriever.as_deref().unwrap_or("dense")
    );
    if let Some(p) = &r.prompts {
        s += &format!("Memory turn: {}; answer instruction: {:?}\n\n", p.turn.as_str(), p.instruction);
    }
    // Columns comparing formats only when the run compared them.
    let vs_ref = r.summary.iter().any(|x| x.agreement_vs_reference.is_some());
    s += "| mode | window | k | n | F1 | F1 cat 1 | cat 2 | cat 3 | cat 4 | recall@k | TTFT ms (median) | agreement | KL | labels |";
    s += if vs_ref { " agreement vs ref | KL vs ref |\n" } else { "\n" };
    s += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";
    s += if vs_ref { "---:|---:|\n" } else { "\n" };
    for x in &r.summary {
        let cat = |c: u8| x.f1_by_category.get(&c).map_or("-".to_string(), |v| format!("{v:.3}"));
        let opt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
        s += &format!(
            "| {} | {} | {} | {} | {:.3} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} |",
            x.mode_label(),
            x.window.map_or("-".into(), |w| w.to_string()),
            x.k,
            x.n,
            x.f1,
            cat(1),
            cat(2),
            cat(3),
            cat(4),
            opt(x.recall, 3),
            x.ttft_ms_median,
            opt(x.agreement, 3),
            opt(x.kl_mean, 4),
            opt(x.labels, 3)
        );
        if vs_ref {
            s += &format!(" {} | {} |", opt(x.agreement_vs_reference, 3), opt(x.kl_vs_reference, 5));
        }
        s += "\n";
    }
    if !r.ingest.is_empty() {
        s += "\n| ingest window | turns | seconds | turns/s | encoded tokens/s |\n|---:|---:|---:|---:|---:|\n";
        for i in &r.ingest {
            let format = i.kv_format.as_ref().map_or(String::new(), |f| format!(" ({f})"));
            s += &format!(
                "| {}{format} | {} | {:.1} | {:.2} | {:.0} |\n",
                i.window, i.turns, i.seconds, i.turns_per_s, i.encoded_tokens_per_s
            );
        }
    }
    s
}

/// Redraws locomo.md and locomo.png from `out`/locomo.json.
pub(super) fn replot(out: &std::path::Path) -> Result<()> {
    let path = out.join("locomo.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let report: Report =
        serde_json::from_str(&text).with_context(|| format!("{}: not an eval report", path.display()))?;
    write_outputs(out, &report)
}
