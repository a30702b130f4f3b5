//! `inferscale eval locomo`: answer LoCoMo questions from memory in each
//! mode, window and k, and score them (see inferscale_eval::score);
//! `inferscale eval retrieval`: recall of the evidence turns per retriever.
//!
//! Retrieval and prompt mode do not depend on the encoding window (the same
//! facts, embeddings and text), so they run once per question and k; kv mode
//! runs once per window, blend once per window and ratio. Answers are generated in batches — every mode, k
//! and window of several questions prefilled and decoded together, as a
//! serving engine would — so that a GPU is kept busy; time to first token is
//! measured apart, one request at a time as a user sees it, on the first
//! `--ttft-questions` questions of each sample. Every answer's first-token
//! distribution is kept to compare kv and blend with prompt mode (KL
//! divergence) before it is dropped. With several `--kv-format`s each
//! window has a memory per format, and the answers from a lossy format are
//! compared with the first format's (fidelity of the stored KV).

mod kv_error;
mod report;
mod retrieval;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use inferscale_engine::bert::Bert;
use inferscale_engine::kv_cache::BLOCK_SIZE;
use inferscale_engine::sampling::{SamplingParams, argmax};
use inferscale_engine::{Backend, Engine, FinishReason, Sequence, generate_sequences};
use inferscale_eval::locomo;
use inferscale_eval::score::{copies_label, kl, locomo_f1, log_softmax, recall};
use inferscale_memory::{Facts, KvFormat, Memory, Mode, Recall, Retriever, Session, ShardSpec, StoreOptions};
use inferscale_model::progress::Progress;

use crate::memory_cmd::{PromptArgs, parse_retriever};
use crate::runtime::{ModelArgs, blend_ratio, load_on, on_backend};
use report::{Answer, Ingest, Report};

// Parsed once per process: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// LoCoMo question answering from memory.
    Locomo(LocomoArgs),
    /// Recall of LoCoMo's evidence turns among the k facts each retriever
    /// finds (no answering model runs).
    Retrieval(retrieval::Args),
    /// Per layer, how far each stored KV format rounds a memory's f32 KV,
    /// and which channels carry the error.
    KvError(kv_error::Args),
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
    /// Memory modes to answer in (kv, blend, prompt, none).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "kv,prompt")]
    modes: Vec<Mode>,
    /// Blend ratios to answer with when the modes include blend (each one
    /// a variant, like a window).
    #[arg(long, value_delimiter = ',', default_values_t = [inferscale_types::DEFAULT_BLEND_RATIO], value_parser = blend_ratio)]
    blend_ratio: Vec<f32>,
    /// Blend: shares of the recomputed tokens spent on the memory's last
    /// (best-ranked) tokens whatever their deviation, the rest chosen by
    /// deviation; each one a variant with each ratio.
    #[arg(long, value_delimiter = ',', default_values_t = [inferscale_types::DEFAULT_BLEND_FOCUS], value_parser = blend_ratio)]
    blend_focus: Vec<f32>,
    /// Blend: how the recomputed tokens are chosen (`deviation`,
    /// `question`, `fact_starts`); each one a variant with each ratio and focus.
    #[arg(long, value_delimiter = ',', default_values_t = [inferscale_types::BlendSelect::default()])]
    blend_select: Vec<inferscale_types::BlendSelect>,
    /// Facts retrieved per question; each k is a variant.
    #[arg(long, value_delimiter = ',', default_value = "5,20,50")]
    k: Vec<usize>,
    /// Context windows (turns before each fact in its encoding); a memory
    /// is built per window, and kv and blend answer from each.
    #[arg(long, value_delimiter = ',', default_value = "0,20")]
    window: Vec<usize>,
    /// Formats the memories store KV in (f32, bf16, fp8); each is a memory
    /// per window, and kv and blend answer from each. Answers from the
    /// second format on are compared with the first's (agreement and KL
    /// `vs ref`). Default: one memory per window in the backend's own format.
    #[arg(long, value_delimiter = ',')]
    kv_format: Vec<KvFormat>,
    /// Question categories to score (5, adversarial, is excluded by default).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    categories: Vec<u8>,
    /// Stop after this many questions per sample (0: all).
    #[arg(long, default_value_t = 0)]
    max_questions: usize,
    /// Most tokens generated per answer.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Questions answered together (all their modes, k and windows in one
    /// batch of sequences); fewer when the KV cache cannot hold them.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Questions per sample whose time to first token is measured, one
    /// request at a time, in every mode, k and window (0: none).
    #[arg(long, default_value_t = 10)]
    ttft_questions: usize,
    /// Sentence-embedding model for dense retrieval (name or directory).
    #[arg(long, default_value = inferscale_model::fetch::DEFAULT_EMBEDDER)]
    embedder: String,
    /// How facts are ranked: dense, lexical or hybrid.
    #[arg(long, default_value = "hybrid", value_parser = parse_retriever)]
    retriever: Retriever,
    #[command(flatten)]
    prompts: PromptArgs,
    /// Output directory (results, table, memory stores).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(c: Command) -> Result<()> {
    match c {
        Command::Locomo(a) if a.replot => report::replot(&a.out),
        Command::Locomo(a) => on_backend!(a.model, locomo_eval(&a)),
        Command::Retrieval(a) => retrieval::run(a),
        Command::KvError(a) => kv_error::run(a),
    }
}

/// One answer to produce: which question, and how its prompt is made.
#[derive(Clone, Copy)]
struct Variant {
    mode: Mode,
    k: usize,
    /// Index into the memories (one per window and format) for kv and
    /// blend mode.
    memory: usize,
    /// Blend's parameters (ratio 0 in other modes).
    blend: inferscale_types::Blend,
}

impl Variant {
    fn recall(&self) -> Recall {
        Recall { mode: self.mode, blend: self.blend }
    }
}

/// A question with its retrieval done.
struct Asked<'s> {
    sample: &'s str,
    index: usize,
    qa: &'s locomo::Qa,
    tokens: Vec<u32>,
    /// The k_max best facts, best first.
    top: Vec<usize>,
}

fn locomo_eval<B: Backend>(a: &LocomoArgs, backend: B) -> Result<()> {
    let data = a.data.clone().context("--data is required")?;
    if a.k.contains(&0) || a.k.is_empty() {
        bail!("--k needs values of at least 1");
    }
    if a.window.is_empty() {
        bail!("--window needs at least one window");
    }
    if a.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let samples: Vec<_> =
        locomo::read(&data)?.into_iter().filter(|s| a.samples.is_empty() || a.samples.contains(&s.id)).collect();
    if samples.is_empty() {
        bail!("{}: none of the samples {:?}", data.display(), a.samples);
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let m = load_on(&a.model, backend)?;
    let eos = m.eos_ids();
    let embedder = Bert::load(m.engine.backend(), inferscale_model::encoder::open(&a.embedder)?)?;
    let prompts = a.prompts.prompts();
    let model = m.files.path.display().to_string();

    // One memory per window and format, every sample a user of it: the
    // session answers from the first; the others take its place in turn
    // (`on_memory`).
    let formats: Vec<Option<KvFormat>> =
        if a.kv_format.is_empty() { vec![None] } else { a.kv_format.iter().copied().map(Some).collect() };
    let mut memories = Vec::new();
    let mut stores = Vec::new();
    for &w in &a.window {
        for &format in &formats {
            let dir = a.out.join(match format {
                None => format!("memory-w{w}"),
                Some(f) => format!("memory-w{w}-{f}"),
            });
            let options = StoreOptions { format, ..StoreOptions::default() };
            let (mut mem, warnings) =
                Memory::open_with(&dir, ShardSpec::new(&m.files, w, &prompts)?, &m.engine, options)?;
            warnings.iter().for_each(|x| eprintln!("inferscale eval: warning: {x}"));
            mem.set_retriever(a.retriever);
            memories.push(mem);
            stores.push(Store { window: w, format });
        }
    }
    let first = memories.remove(0);
    let mut session = Session::new(Arc::new(m.files), m.engine, embedder, first, &prompts)?;
    let mut ingest = Vec::new();
    for (i, &Store { window: w, format }) in stores.iter().enumerate() {
        let (t0, mut turns, mut tokens) = (Instant::now(), 0, 0);
        let all: usize = samples.iter().map(|x| x.turns.len()).sum();
        let what = format!("inferscale eval: ingest, window {w}{}", format.map_or(String::new(), |f| format!(" {f}")));
        let mut progress = Progress::new(&what, all as u64, "turns");
        let mut seen = 0;
        on_memory(&mut session, &mut memories, i, |s| -> Result<()> {
            for sample in &samples {
                for batch in sample.turns.chunks(16) {
                    let r = s.ingest(&sample.id, batch, false)?;
                    turns += r.added;
                    tokens += r.encoded_tokens;
                    seen += batch.len();
                    progress.set(seen as u64, &sample.id);
                }
            }
            Ok(())
        })?;
        progress.finish(&format!("{turns} new"));
        let secs = t0.elapsed().as_secs_f64();
        if turns > 0 {
            ingest.push(Ingest {
                window: w,
                kv_format: format.map(|f| f.to_string()),
                turns,
                seconds: secs,
                turns_per_s: turns as f64 / secs,
                encoded_tokens_per_s: tokens as f64 / secs,
            });
        }
        eprintln!();
    }

    let k_max = *a.k.iter().max().context("--k")?;
    let want = |m: Mode| a.modes.contains(&m);
    let mut variants = Vec::new();
    let no_blend = inferscale_types::Blend { ratio: 0.0, focus: 0.0, select: Default::default() };
    let plain = |mode, k, memory| Variant { mode, k, memory, blend: no_blend };
    if want(Mode::None) {
        variants.push(plain(Mode::None, 0, 0));
    }
    for &k in &a.k {
        // Prompt mode first: kv and blend answers of the same question and k compare with it.
        if want(Mode::Prompt) {
            variants.push(plain(Mode::Prompt, k, 0));
        }
        for memory in 0..stores.len() {
            if want(Mode::Kv) {
                variants.push(plain(Mode::Kv, k, memory));
            }
            if want(Mode::Blend) {
                for &select in &a.blend_select {
                    for &focus in &a.blend_focus {
                        variants.extend(a.blend_ratio.iter().map(|&ratio| Variant {
                            mode: Mode::Blend,
                            k,
                            memory,
                            blend: inferscale_types::Blend { ratio, focus, select },
                        }));
                    }
                }
            }
        }
    }

    // Retrieval for every question (the same in every mode and window).
    let mut asked = Vec::new();
    for s in &samples {
        let qas: Vec<(usize, &locomo::Qa)> =
            s.qa.iter()
                .enumerate()
                .filter(|(_, q)| a.categories.contains(&q.category) && q.answer.is_some())
                .take(if a.max_questions == 0 { usize::MAX } else { a.max_questions })
                .collect();
        let texts: Vec<&str> = qas.iter().map(|(_, q)| q.question.as_str()).collect();
        let tops = session.retrieve_many(&s.id, &texts, k_max)?;
        for ((index, qa), top) in qas.into_iter().zip(tops) {
            asked.push(Asked { sample: &s.id, index, qa, tokens: session.question(&qa.question)?, top });
        }
    }

    let plan = AnswerPlan { stores: &stores, variants: &variants, eos: &eos, max_tokens: a.max_tokens };
    let mut answers = Vec::new();
    let header_len = session.header().len();
    let mut batch: Vec<&Asked<'_>> = Vec::new();
    let mut batch_blocks = 0;
    let total_blocks = session.engine().pool().free_blocks();
    let mut progress = Progress::new("inferscale eval: answer", asked.len() as u64, "questions");
    let mut answered = 0;
    for q in &asked {
        let facts = session.memory().facts(q.sample)?;
        let blocks: usize = variants
            .iter()
            .map(|v| {
                let memory: usize = q.top[..v.k.min(q.top.len())].iter().map(|&i| facts[i].tokens.len()).sum();
                (header_len + memory + q.tokens.len() + a.max_tokens).div_ceil(BLOCK_SIZE) + 1
            })
            .sum();
        if blocks > total_blocks {
            bail!(
                "the KV cache ({total_blocks} blocks of {BLOCK_SIZE} tokens) cannot hold one question's {} answers \
                 ({blocks} blocks): raise --kv-cache-mb",
                variants.len()
            );
        }
        if !batch.is_empty() && (batch.len() == a.batch || batch_blocks + blocks > total_blocks) {
            answers.extend(plan.answer(&mut session, &mut memories, &batch)?);
            answered += batch.len();
            progress.set(answered as u64, q.sample);
            (batch, batch_blocks) = (Vec::new(), 0);
        }
        batch.push(q);
        batch_blocks += blocks;
    }
    if !batch.is_empty() {
        answers.extend(plan.answer(&mut session, &mut memories, &batch)?);
        answered += batch.len();
        progress.set(answered as u64, "");
    }
    progress.finish(&format!("{} answers", answers.len()));

    // Time to first token, one request at a time, retrieval included.
    let mut ttft: HashMap<(&str, usize, usize), f64> = HashMap::new();
    for s in &samples {
        for q in asked.iter().filter(|q| q.sample == s.id).take(a.ttft_questions) {
            for (vi, v) in variants.iter().enumerate() {
                let ms = on_memory(&mut session, &mut memories, v.memory, |s| -> Result<f64> {
                    let start = Instant::now();
                    let top = match v.mode {
                        Mode::None => Vec::new(),
                        _ => s.retrieve(q.sample, &q.qa.question, v.k)?,
                    };
                    let mut p = s.prepare(Facts::new(q.sample, &top, v.recall()), &q.tokens)?;
                    let _first = argmax(&s.engine_mut().prefill(&mut p.seq)?);
                    Ok(start.elapsed().as_secs_f64() * 1e3)
                })?;
                ttft.insert((q.sample, q.index, vi), ms);
            }
        }
    }
    let answers: Vec<Answer> = answers
        .into_iter()
        .map(|(vi, mut x)| {
            x.ttft_ms = ttft.get(&(x.sample.as_str(), x.question, vi)).copied();
            x
        })
        .collect();

    let summary = report::summarize(&answers);
    let report = Report {
        data: data.display().to_string(),
        samples: samples.iter().map(|s| s.id.clone()).collect(),
        model,
        retriever: Some(a.retriever.to_string()),
        prompts: Some(prompts),
        ingest,
        summary,
        answers,
    };
    let json = a.out.join("locomo.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json.display()))?;
    report::write_outputs(&a.out, &report)
}

/// What a memory of the evaluation holds: facts encoded with `window`
/// turns of context, KV stored in `format` (`None`: the backend's own).
struct Store {
    window: usize,
    format: Option<KvFormat>,
}

/// How every question is answered: in each variant, greedily, up to
/// `max_tokens` or a newline.
struct AnswerPlan<'a> {
    /// Each memory's window and format (index 0: the session's own).
    stores: &'a [Store],
    variants: &'a [Variant],
    eos: &'a [u32],
    max_tokens: usize,
}

impl AnswerPlan<'_> {
    /// Answers every variant of `batch`'s questions in one batch of sequences
    /// and scores them; kv answers are compared with the prompt answer of the
    /// same question and k, and those from a memory in another format than
    /// the first with the first format's answer of the same variant.
    /// Returns each answer with its variant's index.
    fn answer<B: Backend>(
        &self,
        session: &mut Session<B>,
        memories: &mut [Memory<B>],
        batch: &[&Asked<'_>],
    ) -> Result<Vec<(usize, Answer)>> {
        let AnswerPlan { stores, variants, eos, max_tokens } = *self;
        let mut seqs = Vec::with_capacity(batch.len() * variants.len());
        let mut rows = Vec::with_capacity(seqs.capacity());
        for q in batch {
            let fact_ids: Vec<String> = session.memory().facts(q.sample)?.iter().map(|f| f.unit.id.clone()).collect();
            for (vi, v) in variants.iter().enumerate() {
                let Store { window, format } = stores[v.memory];
                let ids = &q.top[..v.k.min(q.top.len())];
                let names: Vec<&str> = ids.iter().map(|&i| fact_ids[i].as_str()).collect();
                let p = on_memory(session, memories, v.memory, |s| {
                    s.prepare(Facts::new(q.sample, ids, v.recall()), &q.tokens)
                })?;
                seqs.push(p.seq);
                rows.push((
                    vi,
                    Answer {
                        sample: q.sample.to_string(),
                        question: q.index,
                        category: q.qa.category,
                        mode: v.mode.as_str().into(),
                        blend_ratio: (v.mode == Mode::Blend).then_some(v.blend.ratio),
                        blend_focus: (v.mode == Mode::Blend && v.blend.focus > 0.0).then_some(v.blend.focus),
                        blend_select: (v.mode == Mode::Blend
                            && v.blend.select != inferscale_types::BlendSelect::Deviation)
                            .then(|| v.blend.select.to_string()),
                        window: v.mode.injects().then_some(window),
                        kv_format: format.filter(|_| v.mode.injects()).map(|f| f.to_string()),
                        k: v.k,
                        answer: String::new(),
                        f1: 0.0,
                        ttft_ms: None,
                        recall: if v.mode == Mode::None { None } else { recall(&names, &q.qa.evidence) },
                        kl_vs_prompt: None,
                        same_as_prompt: None,
                        kl_vs_reference: None,
                        same_as_reference: None,
                        copies_label: None,
                    },
                ));
            }
        }
        let files = session.files().clone();
        let tok = files.tokenizer.as_ref().context("the model has no tokenizer")?;
        let outs = answer_batch(session.engine_mut(), seqs, tok, eos, max_tokens)?;
        let mut prompt_ref: HashMap<(String, usize, usize), (Vec<f64>, String)> = HashMap::new();
        // The first format's answers, by question and variant but format.
        type FormatKey = (String, usize, usize, &'static str, Option<String>, Option<usize>);
        let mut format_ref: HashMap<FormatKey, (Vec<f64>, String)> = HashMap::new();
        let first_format = stores.first().and_then(|s| s.format);
        let golds =
            batch.iter().flat_map(|q| std::iter::repeat_n(q.qa.answer.as_deref().unwrap_or_default(), variants.len()));
        for (((vi, r), (lp, text)), gold) in rows.iter_mut().zip(outs).zip(golds) {
            r.f1 = locomo_f1(&text, gold, r.category);
            r.copies_label = Some(copies_label(&text));
            let key = (r.sample.clone(), r.question, r.k);
            match variants[*vi].mode {
                Mode::Prompt => {
                    prompt_ref.insert(key, (lp, text.clone()));
                }
                Mode::Kv | Mode::Blend => {
                    if let Some((plp, ptext)) = prompt_ref.get(&key) {
                        r.kl_vs_prompt = Some(kl(plp, &lp));
                        r.same_as_prompt = Some(&text == ptext);
                    }
                    let mode = variants[*vi].mode.as_str();
                    let fkey = (key.0, key.1, key.2, mode, r.blend_key(), r.window);
                    if stores[variants[*vi].memory].format == first_format {
                        format_ref.insert(fkey, (lp, text.clone()));
                    } else if let Some((flp, ftext)) = format_ref.get(&fkey) {
                        r.kl_vs_reference = Some(kl(flp, &lp));
                        r.same_as_reference = Some(&text == ftext);
                    }
                }
                Mode::None => {}
            }
            r.answer = text;
        }
        Ok(rows)
    }
}

/// Runs `f` on the session with memory `i` in place: the session's own
/// for the first, `rest[i - 1]` for the others.
fn on_memory<B: Backend, R>(
    session: &mut Session<B>,
    rest: &mut [Memory<B>],
    i: usize,
    f: impl FnOnce(&mut Session<B>) -> R,
) -> R {
    match i.checked_sub(1).and_then(|j| rest.get_mut(j)) {
        Some(other) => session.with_memory(other, f),
        None => f(session),
    }
}

/// Prefills every sequence (together, in forward passes of the engine's
/// token budget), then decodes them together greedily, each up to its first
/// newline. Returns per sequence the first-token log-probabilities and the
/// answer.
fn answer_batch<B: Backend>(
    e: &mut Engine<B>,
    mut seqs: Vec<Sequence>,
    tok: &inferscale_model::Tokenizer,
    eos: &[u32],
    max_tokens: usize,
) -> Result<Vec<(Vec<f64>, String)>> {
    let mut first: Vec<Option<Vec<f32>>> = vec![None; seqs.len()];
    loop {
        let (idx, mut refs): (Vec<usize>, Vec<&mut Sequence>) =
            seqs.iter_mut().enumerate().filter(|(i, _)| first[*i].is_none()).unzip();
        if refs.is_empty() {
            break;
        }
        for (i, logits) in idx.into_iter().zip(e.step(&mut refs)?) {
            if logits.is_some() {
                first[i] = logits;
            }
        }
    }
    let params = SamplingParams { stop: vec!["\n".into()], ..SamplingParams::greedy(max_tokens.saturating_sub(1)) };
    let mut out = Vec::with_capacity(seqs.len());
    let mut decode = Vec::new();
    for (i, (mut seq, logits)) in seqs.into_iter().zip(first).enumerate() {
        let logits = logits.context("a prefill produced no logits")?;
        let token = argmax(&logits);
        out.push((log_softmax(&logits), token, String::new()));
        if !eos.contains(&token) {
            seq.push(token);
            decode.push((i, seq));
        }
    }
    let (idx, work): (Vec<usize>, Vec<_>) = decode.into_iter().map(|(i, s)| (i, (s, params.clone()))).unzip();
    let generated = generate_sequences(e, Some(tok), eos, work, Instant::now())?;
    for (i, g) in idx.into_iter().zip(generated) {
        let mut ids = vec![out[i].1];
        ids.extend(&g.tokens);
        let mut text = tok.decode(&ids, true)?;
        if g.finish == FinishReason::Stop || text.contains('\n') {
            text = text.split('\n').next().unwrap_or("").to_string();
        }
        out[i].2 = text;
    }
    Ok(out.into_iter().map(|(lp, _, text)| (lp, text.trim().to_string())).collect())
}
