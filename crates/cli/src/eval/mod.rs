//! `inferscale eval locomo`: answer LoCoMo questions from memory in each
//! mode, window and k, and score them (see inferscale_memory::score).
//!
//! Retrieval and prompt mode do not depend on the encoding window (the same
//! facts, embeddings and text), so they run once per question and k; kv mode
//! runs once per window. Every answer's first-token distribution is kept to
//! compare kv with prompt mode (KL divergence) before it is dropped.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use inferscale_engine::bert::Bert;
use inferscale_engine::sampling::{SamplingParams, argmax};
use inferscale_engine::{CpuBackend, Engine, FinishReason, Sequence, generate_sequences};
use inferscale_loadtest::plot;
use inferscale_memory::score::{kl, locomo_f1, log_softmax, recall};
use inferscale_memory::{Composer, Encoders, Memory, Mode, SYSTEM_PROMPT, ShardSpec, fingerprint, locomo, prepare};
use serde::{Deserialize, Serialize};

use crate::bench::median;
use crate::runtime::{ModelArgs, load};

#[derive(Subcommand, Debug)]
pub enum Command {
    /// LoCoMo question answering from memory.
    Locomo(LocomoArgs),
}

#[derive(Args, Debug)]
pub struct LocomoArgs {
    /// A LoCoMo-format JSON file.
    #[arg(long, required_unless_present = "replot")]
    data: Option<PathBuf>,
    /// Only redraw locomo.md and locomo.png from `--out`/locomo.json.
    #[arg(long)]
    replot: bool,
    /// Sample ids to use (default: all).
    #[arg(long, value_delimiter = ',')]
    samples: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "kv,prompt", value_parser = ["kv", "prompt", "none"])]
    modes: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "5,20,50")]
    k: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "0,20")]
    window: Vec<usize>,
    /// Question categories to score (5, adversarial, is excluded by default).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    categories: Vec<u8>,
    /// Stop after this many questions per sample (0: all).
    #[arg(long, default_value_t = 0)]
    max_questions: usize,
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    #[arg(long, default_value = inferscale_model::fetch::DEFAULT_EMBEDDER)]
    embedder: String,
    /// Output directory (results, table, memory stores).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Serialize, Deserialize, Clone)]
struct Answer {
    sample: String,
    question: usize,
    category: u8,
    mode: String,
    window: Option<usize>,
    k: usize,
    answer: String,
    f1: f64,
    ttft_ms: f64,
    recall: Option<f64>,
    /// kv rows: KL(prompt ‖ kv) of the first-token distributions, and
    /// whether the greedy answers are identical.
    kl_vs_prompt: Option<f64>,
    same_as_prompt: Option<bool>,
}

#[derive(Serialize, Deserialize)]
struct Ingest {
    window: usize,
    turns: usize,
    seconds: f64,
    turns_per_s: f64,
    encoded_tokens_per_s: f64,
}

#[derive(Serialize, Deserialize)]
struct Row {
    mode: String,
    window: Option<usize>,
    k: usize,
    n: usize,
    f1: f64,
    f1_by_category: BTreeMap<u8, f64>,
    recall: f64,
    ttft_ms_median: f64,
    agreement: Option<f64>,
    kl_mean: Option<f64>,
}

#[derive(Serialize, Deserialize)]
struct Report {
    data: String,
    samples: Vec<String>,
    model: String,
    ingest: Vec<Ingest>,
    summary: Vec<Row>,
    answers: Vec<Answer>,
}

pub fn run(c: Command) -> Result<()> {
    match c {
        Command::Locomo(a) => locomo_eval(a),
    }
}

/// Prefills `seq` and decodes greedily; returns the first-token
/// log-probabilities, the answer (first line) and the time to first token.
fn answer(
    e: &mut Engine<CpuBackend>,
    mut seq: Sequence,
    start: Instant,
    tok: &inferscale_model::Tokenizer,
    eos: &[u32],
    max_tokens: usize,
) -> Result<(Vec<f64>, String, f64)> {
    let logits = e.prefill(&mut seq)?;
    let first = argmax(&logits);
    let ttft = start.elapsed().as_secs_f64() * 1e3;
    let mut text = String::new();
    if !eos.contains(&first) {
        seq.push(first);
        let params = SamplingParams { stop: vec!["\n".into()], ..SamplingParams::greedy(max_tokens.saturating_sub(1)) };
        let g = generate_sequences(e, Some(tok), eos, vec![(seq, params)], start)?.remove(0);
        let mut ids = vec![first];
        ids.extend(&g.tokens);
        text = tok.decode(&ids, true)?;
        if g.finish == FinishReason::Stop || text.contains('\n') {
            text = text.split('\n').next().unwrap_or("").to_string();
        }
    }
    Ok((log_softmax(&logits), text.trim().to_string(), ttft))
}

fn write_outputs(out: &std::path::Path, report: &Report) -> Result<()> {
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

fn locomo_eval(a: LocomoArgs) -> Result<()> {
    if a.replot {
        let path = a.out.join("locomo.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let report: Report =
            serde_json::from_str(&text).with_context(|| format!("{}: not an eval report", path.display()))?;
        return write_outputs(&a.out, &report);
    }
    let data = a.data.clone().context("--data is required")?;
    if a.k.contains(&0) || a.k.is_empty() {
        bail!("--k needs values of at least 1");
    }
    let samples: Vec<_> =
        locomo::read(&data)?.into_iter().filter(|s| a.samples.is_empty() || a.samples.contains(&s.id)).collect();
    if samples.is_empty() {
        bail!("{}: none of the samples {:?}", data.display(), a.samples);
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut m = load(&a.model)?;
    let eos = m.eos_ids();
    let embedder = Bert::load(&CpuBackend, inferscale_model::encoder::open(&a.embedder)?)?;
    let composer = Composer::new(&m.files, SYSTEM_PROMPT)?;
    let tok = m.files.tokenizer.as_ref().context("the model has no tokenizer")?;
    let fp = fingerprint(&m.files)?;
    let e = &mut m.engine;

    // One memory per window, every sample a user of it.
    let mut memories = Vec::new();
    let mut ingest = Vec::new();
    for &w in &a.window {
        let dir = a.out.join(format!("memory-w{w}"));
        let (mut mem, warnings) = Memory::open(&dir, ShardSpec { window: w, fingerprint: fp.clone() }, e)?;
        warnings.iter().for_each(|x| eprintln!("inferscale eval: warning: {x}"));
        let mut enc = Encoders { engine: e, embedder: &embedder, composer: &composer };
        let (t0, mut turns, mut tokens) = (Instant::now(), 0, 0);
        for s in &samples {
            for (i, batch) in s.turns.chunks(16).enumerate() {
                let r = mem.ingest(&s.id, batch, &mut enc)?;
                turns += r.added;
                tokens += r.encoded_tokens;
                eprint!(
                    "\rinferscale eval: window {w}: ingest {} {}/{}   ",
                    s.id,
                    (i * 16 + batch.len()).min(s.turns.len()),
                    s.turns.len()
                );
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        if turns > 0 {
            ingest.push(Ingest {
                window: w,
                turns,
                seconds: secs,
                turns_per_s: turns as f64 / secs,
                encoded_tokens_per_s: tokens as f64 / secs,
            });
        }
        eprintln!();
        memories.push((w, mem));
    }

    let mut header = e.new_sequence(composer.header().to_vec())?;
    e.prefill(&mut header)?;
    let k_max = *a.k.iter().max().context("--k")?;
    let want = |m: &str| a.modes.iter().any(|x| x == m);
    let mut answers = Vec::new();
    for s in &samples {
        let qas: Vec<(usize, &locomo::Qa)> =
            s.qa.iter()
                .enumerate()
                .filter(|(_, q)| a.categories.contains(&q.category) && q.answer.is_some())
                .take(if a.max_questions == 0 { usize::MAX } else { a.max_questions })
                .collect();
        for (n, (qi, qa)) in qas.iter().enumerate() {
            eprint!("\rinferscale eval: {} question {}/{}   ", s.id, n + 1, qas.len());
            let gold = qa.answer.as_deref().unwrap_or_default();
            let question = composer.question(&qa.question)?;
            let (_, mem0) = &memories[0];
            let t_retrieve = Instant::now();
            let q = embedder.embed(e.backend(), &[qa.question.as_str()])?.remove(0);
            let top = mem0.retrieve(e.backend(), &s.id, &q, k_max)?;
            let retrieve_ms = t_retrieve.elapsed().as_secs_f64() * 1e3;
            let facts = mem0.facts(&s.id)?;
            let row = |mode: &str, window, k, text: String, ttft: f64, rec| Answer {
                sample: s.id.clone(),
                question: *qi,
                category: qa.category,
                mode: mode.into(),
                window,
                k,
                f1: locomo_f1(&text, gold, qa.category),
                answer: text,
                ttft_ms: ttft + retrieve_ms,
                recall: rec,
                kl_vs_prompt: None,
                same_as_prompt: None,
            };
            if want("none") {
                let p = prepare(e, mem0, &s.id, &[], Mode::None, &header, &question)?;
                let (_, text, ttft) = answer(e, p.seq, Instant::now(), tok, &eos, a.max_tokens)?;
                answers.push(row("none", None, 0, text, ttft, None));
            }
            for &k in &a.k {
                let ids = &top[..k.min(top.len())];
                let names: Vec<&str> = ids.iter().map(|&i| facts[i].id.as_str()).collect();
                let rec = recall(&names, &qa.evidence);
                let mut prompt_ref = None;
                if want("prompt") {
                    let start = Instant::now();
                    let p = prepare(e, mem0, &s.id, ids, Mode::Prompt, &header, &question)?;
                    let (lp, text, ttft) = answer(e, p.seq, start, tok, &eos, a.max_tokens)?;
                    prompt_ref = Some((lp, text.clone()));
                    answers.push(row("prompt", None, k, text, ttft, rec));
                }
                if want("kv") {
                    for (w, mem) in &memories {
                        let start = Instant::now();
                        let p = prepare(e, mem, &s.id, ids, Mode::Kv, &header, &question)?;
                        let (lp, text, ttft) = answer(e, p.seq, start, tok, &eos, a.max_tokens)?;
                        let mut r = row("kv", Some(*w), k, text.clone(), ttft, rec);
                        if let Some((plp, ptext)) = &prompt_ref {
                            r.kl_vs_prompt = Some(kl(plp, &lp));
                            r.same_as_prompt = Some(&text == ptext);
                        }
                        answers.push(r);
                    }
                }
            }
        }
        eprintln!();
    }

    let summary = summarize(&answers);
    let report = Report {
        data: data.display().to_string(),
        samples: samples.iter().map(|s| s.id.clone()).collect(),
        model: m.files.path.display().to_string(),
        ingest,
        summary,
        answers,
    };
    let json = a.out.join("locomo.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json.display()))?;
    write_outputs(&a.out, &report)
}

/// F1 and TTFT against k, one line per mode (and window for kv).
fn panels(rows: &[Row]) -> Vec<plot::Panel> {
    let mut lines: BTreeMap<String, Vec<&Row>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.mode != "none") {
        let label = match r.window {
            Some(w) => format!("{} w={w}", r.mode),
            None => r.mode.clone(),
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

fn summarize(answers: &[Answer]) -> Vec<Row> {
    let mut groups: BTreeMap<(String, Option<usize>, usize), Vec<&Answer>> = BTreeMap::new();
    for x in answers {
        groups.entry((x.mode.clone(), x.window, x.k)).or_default().push(x);
    }
    groups
        .into_iter()
        .map(|((mode, window, k), xs)| {
            let mean = |v: Vec<f64>| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
            let mut by_cat: BTreeMap<u8, Vec<f64>> = BTreeMap::new();
            xs.iter().for_each(|x| by_cat.entry(x.category).or_default().push(x.f1));
            let kls: Vec<f64> = xs.iter().filter_map(|x| x.kl_vs_prompt).collect();
            let same: Vec<f64> =
                xs.iter().filter_map(|x| x.same_as_prompt.map(|b| if b { 1.0 } else { 0.0 })).collect();
            Row {
                mode,
                window,
                k,
                n: xs.len(),
                f1: mean(xs.iter().map(|x| x.f1).collect()),
                f1_by_category: by_cat.into_iter().map(|(c, v)| (c, mean(v))).collect(),
                recall: mean(xs.iter().filter_map(|x| x.recall).collect()),
                ttft_ms_median: median(xs.iter().map(|x| x.ttft_ms).collect()),
                agreement: (!same.is_empty()).then(|| mean(same)),
                kl_mean: (!kls.is_empty()).then(|| mean(kls)),
            }
        })
        .collect()
}

fn markdown(r: &Report) -> String {
    let mut s = format!("LoCoMo: {} ({}), model {}\n\n", r.data, r.samples.join(", "), r.model);
    s += "| mode | window | k | n | F1 | F1 cat 1 | cat 2 | cat 3 | cat 4 | recall@k | TTFT ms (median) | agreement | KL |\n";
    s += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for x in &r.summary {
        let cat = |c: u8| x.f1_by_category.get(&c).map_or("-".to_string(), |v| format!("{v:.3}"));
        let opt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
        s += &format!(
            "| {} | {} | {} | {} | {:.3} | {} | {} | {} | {} | {:.3} | {:.1} | {} | {} |\n",
            x.mode,
            x.window.map_or("-".into(), |w| w.to_string()),
            x.k,
            x.n,
            x.f1,
            cat(1),
            cat(2),
            cat(3),
            cat(4),
            x.recall,
            x.ttft_ms_median,
            opt(x.agreement, 3),
            opt(x.kl_mean, 4)
        );
    }
    if !r.ingest.is_empty() {
        s += "\n| ingest window | turns | seconds | turns/s | encoded tokens/s |\n|---:|---:|---:|---:|---:|\n";
        for i in &r.ingest {
            s += &format!(
                "| {} | {} | {:.1} | {:.2} | {:.0} |\n",
                i.window, i.turns, i.seconds, i.turns_per_s, i.encoded_tokens_per_s
            );
        }
    }
    s
}
