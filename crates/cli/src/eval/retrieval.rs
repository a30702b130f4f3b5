//! `inferscale eval retrieval`: how often each retriever finds LoCoMo's
//! evidence turns among the k facts it returns — the ceiling on what any
//! answering mode can use. Facts are stored without KV, so no answering
//! model runs beyond tokenizing the fact lines.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use inferscale_engine::Backend;
use inferscale_engine::bert::Bert;
use inferscale_eval::locomo;
use inferscale_eval::score::recall;
use inferscale_memory::{Memory, Prompts, Query, Retriever, Session, ShardSpec};
use inferscale_model::progress::Progress;
use serde::Serialize;

use crate::memory_cmd::parse_retriever;
use crate::runtime::{ModelArgs, load_on, on_backend};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A LoCoMo-format JSON file.
    #[arg(long)]
    data: PathBuf,
    /// Sample ids to use (default: all).
    #[arg(long, value_delimiter = ',')]
    samples: Vec<String>,
    /// Retrievers to score, one row each (dense, lexical, hybrid).
    #[arg(long, value_delimiter = ',', default_value = "dense,lexical,hybrid", value_parser = parse_retriever)]
    retriever: Vec<Retriever>,
    /// Facts retrieved: recall is reported at each k.
    #[arg(long, value_delimiter = ',', default_value = "5,20,50")]
    k: Vec<usize>,
    /// Question categories to score (5, adversarial, is excluded by default).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    categories: Vec<u8>,
    /// Sentence-embedding model for dense retrieval (name or directory).
    #[arg(long, default_value = inferscale_model::fetch::DEFAULT_EMBEDDER)]
    embedder: String,
    /// Also write the table as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// The model whose tokenizer makes the fact lines' tokens (stored with
    /// each fact; retrieval does not use them).
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Serialize)]
struct Row {
    retriever: String,
    k: usize,
    n: usize,
    recall: f64,
    recall_by_category: BTreeMap<u8, f64>,
}

pub fn run(a: Args) -> Result<()> {
    on_backend!(a.model, run_on(&a))
}

fn run_on<B: Backend>(a: &Args, backend: B) -> Result<()> {
    if a.k.contains(&0) || a.k.is_empty() || a.retriever.is_empty() {
        bail!("--k needs values of at least 1, --retriever at least one retriever");
    }
    let samples: Vec<_> =
        locomo::read(&a.data)?.into_iter().filter(|s| a.samples.is_empty() || a.samples.contains(&s.id)).collect();
    if samples.is_empty() {
        bail!("{}: none of the samples {:?}", a.data.display(), a.samples);
    }
    let m = load_on(&a.model, backend)?;
    let embedder = Bert::load(m.engine.backend(), inferscale_model::encoder::open(&a.embedder)?)?;
    let dir = tempfile::tempdir().context("a temporary memory directory")?;
    let spec = ShardSpec::new(&m.files, 0, &Prompts::default())?;
    let (mem, _) = Memory::open(dir.path(), spec, &m.engine)?;
    let mut session = Session::new(Arc::new(m.files), m.engine, embedder, mem, &Prompts::default())?;
    let k_max = *a.k.iter().max().context("--k")?;
    // (retriever, k) → category → recalls
    let mut got: BTreeMap<(usize, usize), BTreeMap<u8, Vec<f64>>> = BTreeMap::new();
    let mut progress = Progress::new("inferscale eval retrieval", samples.len() as u64, "samples");
    for (n, s) in samples.iter().enumerate() {
        progress.set(n as u64, &format!("{} ({} turns)", s.id, s.turns.len()));
        session.ingest(&s.id, &s.turns, true)?;
        let qas: Vec<&locomo::Qa> =
            s.qa.iter().filter(|q| a.categories.contains(&q.category) && !q.evidence.is_empty()).collect();
        let texts: Vec<&str> = qas.iter().map(|q| q.question.as_str()).collect();
        let ids: Vec<String> = session.memory().facts(&s.id)?.iter().map(|f| f.unit.id.clone()).collect();
        // The questions are embedded once; each retriever ranks with them.
        let backend = session.engine().backend();
        let embeddings = if texts.is_empty() { Vec::new() } else { session.embedder().embed(backend, &texts)? };
        for (ri, &r) in a.retriever.iter().enumerate() {
            session.memory_mut().set_retriever(r);
            for (qa, embedding) in qas.iter().zip(&embeddings) {
                let query = Query { text: &qa.question, embedding };
                let top = session.memory().retrieve(session.engine().backend(), &s.id, query, k_max)?;
                for &k in &a.k {
                    let names: Vec<&str> = top[..k.min(top.len())].iter().map(|&i| ids[i].as_str()).collect();
                    if let Some(x) = recall(&names, &qa.evidence) {
                        got.entry((ri, k)).or_default().entry(qa.category).or_default().push(x);
                    }
                }
            }
        }
    }
    progress.set(samples.len() as u64, "");
    progress.finish("");
    let mean = |v: &[f64]| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
    let rows: Vec<Row> = got
        .into_iter()
        .map(|((ri, k), by_cat)| {
            let all: Vec<f64> = by_cat.values().flatten().copied().collect();
            Row {
                retriever: a.retriever[ri].to_string(),
                k,
                n: all.len(),
                recall: mean(&all),
                recall_by_category: by_cat.iter().map(|(c, v)| (*c, mean(v))).collect(),
            }
        })
        .collect();
    println!(
        "LoCoMo evidence recall: {} ({})\n",
        a.data.display(),
        samples.iter().map(|s| s.id.as_str()).collect::<Vec<_>>().join(", ")
    );
    println!(
        "| retriever | k | n | recall@k | cat 1 | cat 2 | cat 3 | cat 4 |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in &rows {
        let cat = |c: u8| r.recall_by_category.get(&c).map_or("-".to_string(), |v| format!("{v:.3}"));
        println!(
            "| {} | {} | {} | {:.3} | {} | {} | {} | {} |",
            r.retriever,
            r.k,
            r.n,
            r.recall,
            cat(1),
            cat(2),
            cat(3),
            cat(4)
        );
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
