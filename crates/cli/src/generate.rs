//! `inferscale generate`.

use anyhow::{Context, Result, bail};
use clap::Args as ClapArgs;
use inferscale_engine::{GenerateRequest, SamplingParams, generate};
use inferscale_model::Message;

use inferscale_engine::Backend;

use crate::runtime::{ModelArgs, load_on, on_backend};

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as the user message of the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Greedy decoding (the default when no temperature is given).
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k", "seed"])]
    greedy: bool,
    /// Sampling temperature; 0 is greedy.
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus sampling: keep the most likely tokens whose probabilities
    /// sum to this; 1 keeps all.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Random seed of the sampler (same seed, same output).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the output contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(a: Args) -> Result<()> {
    if a.prompt.is_empty() {
        bail!("--prompt is empty");
    }
    let m = a.model.clone();
    on_backend!(m, run_on(a))
}

fn run_on<B: Backend>(a: Args, backend: B) -> Result<()> {
    let mut m = load_on(&a.model, backend)?;
    let tok =
        m.files.tokenizer.as_ref().context("the model has no tokenizer (tokenizer.json or GGUF tokenizer metadata)")?;
    let ids = if a.chat {
        let tmpl = m.files.chat_template.as_ref().context("--chat: the model ships no chat template")?;
        let text = tmpl.render(&[Message::new("user", &a.prompt)], true)?;
        tok.encode(&text, false)?
    } else {
        tok.encode(&a.prompt, true)?
    };
    let params = SamplingParams {
        temperature: if a.greedy { 0.0 } else { a.temperature.unwrap_or(0.0) },
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        max_tokens: a.max_tokens,
        stop: a.stop,
        ..SamplingParams::default()
    };
    let eos = m.eos_ids();
    let n_prompt = ids.len();
    let out = generate(&mut m.engine, Some(tok), &eos, GenerateRequest { prompt: ids, params })?;
    println!("{}", out.text);
    let decode_rate =
        if out.tokens.len() > 1 { (out.tokens.len() - 1) as f64 / out.decode_time.as_secs_f64() } else { 0.0 };
    eprintln!(
        "inferscale: prompt {n_prompt} tokens, TTFT {:.1} ms, {} tokens generated ({:?}), decode {:.1} tokens/s",
        out.time_to_first_token.as_secs_f64() * 1e3,
        out.tokens.len(),
        out.finish,
        decode_rate
    );
    Ok(())
}
