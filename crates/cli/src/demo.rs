//! `inferscale demo`: the README's main job. Fetches the default model on
//! first use, stores a handful of facts (each encoded once, after the header
//! and the facts before it; pre-RoPE KV kept in memory), then asks a
//! question about them in both modes — the facts injected as KV, and the
//! same facts pasted into the prompt — and prints both answers and both
//! times to first token. Injected in the order they were stored, the facts'
//! KV is exactly what prompt mode computes (E2), so the answers agree.
//!
//! The facts end the system turn (the serving layout, docs/design.md §3)
//! and the question is asked plainly: the serving default's answer
//! instruction was chosen for LoCoMo transcripts on Qwen2.5 (docs/locomo.md)
//! and turns SmolLM2-135M's answer here from the fact's cat to an invented
//! one ("Luna"); `--instruction` puts one back.

use std::time::Instant;

use anyhow::Result;
use clap::Args as ClapArgs;
use inferscale_engine::{Generation, KvChunk, SamplingParams, generate_sequences};

use crate::runtime::{ModelArgs, load};
use inferscale_memory::{Composer, MemoryTurn, Prompts};

const FACTS: &[&str] = &[
    "Melanie ran a charity race for mental health on 20 May 2023.",
    "Caroline adopted a grey cat named Miso in April 2023.",
    "John's favourite food is spicy ramen from the corner shop.",
    "Caroline is moving to Lisbon in September to study counselling.",
    "Melanie painted a lake at sunrise and hung it in her kitchen.",
];

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The question to ask about the stored facts.
    #[arg(long, default_value = "What is the name of Caroline's cat?")]
    question: String,
    /// A fact to store (repeatable); replaces the built-in facts.
    #[arg(long = "fact")]
    facts: Vec<String>,
    /// Most tokens to generate per answer.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Words before the question (none by default; see the module docs).
    #[arg(long, default_value = "")]
    instruction: String,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(a: Args) -> Result<()> {
    let mut m = load(&a.model)?;
    let eos = m.eos_ids();
    let files = &m.files;
    let e = &mut m.engine;
    let composer = Composer::new(files, &Prompts::new(MemoryTurn::DEFAULT, None, Some(a.instruction.clone())))?;
    let texts: Vec<String> =
        if a.facts.is_empty() { FACTS.iter().map(|s| s.to_string()).collect() } else { a.facts.clone() };
    let facts: Vec<Vec<u32>> = texts.iter().map(|f| composer.fact(f)).collect::<Result<_, _>>()?;
    let question = composer.question(&a.question)?;
    let header_tokens = composer.header().to_vec();

    // Memory: each fact encoded once, after the same header serving uses.
    let t = Instant::now();
    // Each fact sees the header and the facts stored before it (the context
    // window of docs/design.md §2, here the whole short history).
    let mut context = header_tokens.clone();
    let mut chunks: Vec<KvChunk<_>> = Vec::with_capacity(facts.len());
    for f in &facts {
        chunks.push(e.encode(&context, f, context.len() as u32)?);
        context.extend(f);
    }
    let encode_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut header = e.new_sequence(header_tokens)?;
    e.prefill(&mut header)?;

    let params = SamplingParams::greedy(a.max_tokens);
    let tok = files.tokenizer.as_ref();

    let start = Instant::now();
    let mut seq = e.fork(&header)?;
    e.inject(&mut seq, &chunks.iter().collect::<Vec<_>>())?;
    seq.extend(&question);
    let kv = generate_sequences(e, tok, &eos, vec![(seq, params.clone())], start)?.remove(0);

    let start = Instant::now();
    let mut seq = e.fork(&header)?;
    facts.iter().for_each(|f| seq.extend(f));
    seq.extend(&question);
    let prompt = generate_sequences(e, tok, &eos, vec![(seq, params)], start)?.remove(0);

    println!("memory ({} facts, encoded once in {encode_ms:.0} ms):", texts.len());
    texts.iter().for_each(|f| println!("  - {f}"));
    println!("question: {}", a.question);
    let fact_tokens: usize = facts.iter().map(Vec::len).sum();
    show("kv", &kv, question.len());
    show("prompt", &prompt, question.len() + fact_tokens);
    Ok(())
}

fn show(mode: &str, g: &Generation, prefilled: usize) {
    println!(
        "[{mode:>6}] TTFT {:>7.1} ms ({prefilled} tokens prefilled)  answer: {}",
        g.time_to_first_token.as_secs_f64() * 1e3,
        g.text.trim()
    );
}
