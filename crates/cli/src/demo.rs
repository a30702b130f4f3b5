//! `inferscale demo`: the README's first command. Fetches the default model
//! on first use and answers a chat question with it, with timings.

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use inferscale_engine::{GenerateRequest, SamplingParams, generate};
use inferscale_model::Message;

use crate::runtime::{ModelArgs, load};

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The question to ask.
    #[arg(long, default_value = "What is the capital of France? Answer in one sentence.")]
    question: String,
    #[arg(long, default_value_t = 48)]
    max_tokens: usize,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(a: Args) -> Result<()> {
    let mut m = load(&a.model)?;
    let tok = m.files.tokenizer.as_ref().context("the model has no tokenizer")?;
    let tmpl = m.files.chat_template.as_ref().context("the model ships no chat template")?;
    let ids = tok.encode(&tmpl.render(&[Message::new("user", &a.question)], true)?, false)?;
    let eos = m.eos_ids();
    let n = ids.len();
    let out = generate(
        &mut m.engine,
        Some(tok),
        &eos,
        GenerateRequest { prompt: ids, params: SamplingParams::greedy(a.max_tokens) },
    )?;
    println!("question: {}", a.question);
    println!("answer:   {}", out.text.trim());
    println!(
        "          ({n} prompt tokens, time to first token {:.1} ms, {} tokens in {:.2} s)",
        out.time_to_first_token.as_secs_f64() * 1e3,
        out.tokens.len(),
        (out.time_to_first_token + out.decode_time).as_secs_f64()
    );
    Ok(())
}
