//! `inferscale ingest` and `inferscale ask`: the memory shard from the
//! command line, stored under `--memory` (default `$INFERSCALE_HOME/memory`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use inferscale_engine::bert::Bert;
use inferscale_engine::sampling::SamplingParams;
use inferscale_engine::{Backend, generate_sequences};
use inferscale_eval::locomo;
use inferscale_memory::{
    ANSWER_INSTRUCTION, Budgets, Facts, KvFormat, Manifest, Memory, MemoryTurn, Mode, Prompts, Recall, Retriever,
    Session, ShardSpec, StoreOptions,
};
use inferscale_model::fetch;
use inferscale_model::progress::Progress;

use crate::runtime::{Loaded, ModelArgs, blend_ratio, load_on, on_backend};

#[derive(Args, Debug, Clone)]
pub struct MemoryArgs {
    /// Memory directory (default `$INFERSCALE_HOME/memory`).
    #[arg(long, env = "INFERSCALE_MEMORY")]
    pub(crate) memory: Option<PathBuf>,
    /// Context window: turns encoded before each fact (0 = isolated).
    /// Default: the window the memory directory was made with (its
    /// memory.json), else 20. A memory's KV is made for one window; another
    /// is refused.
    #[arg(long, env = "INFERSCALE_WINDOW")]
    pub(crate) window: Option<usize>,
    /// Sentence-embedding model (name or directory; `random` for speed work).
    #[arg(long, default_value = fetch::DEFAULT_EMBEDDER)]
    pub(crate) embedder: String,
    /// How facts are ranked for a question: dense (sentence embeddings),
    /// lexical (BM25) or hybrid (both, fused by reciprocal rank).
    #[arg(long, env = "INFERSCALE_RETRIEVER", default_value = "hybrid", value_parser = parse_retriever)]
    pub(crate) retriever: Retriever,
    #[command(flatten)]
    pub(crate) prompts: PromptArgs,
    /// MiB of device memory that may cache facts' KV (least recently used
    /// facts move to the host tier past it). On the CPU backend host memory
    /// is the device: this bounds it, by default to a quarter of the
    /// machine's memory. On CUDA the default is no limit (reads then go to
    /// the host tier; a budget sends them to the device while it has room).
    #[arg(long, env = "INFERSCALE_KV_DEVICE_MB")]
    pub(crate) kv_device_mb: Option<u64>,
    /// MiB of pinned host memory that may cache facts' KV (the host tier,
    /// read over the bus while the question is prefilled; least recently
    /// used facts are dropped past it — the disk has them). Default: a
    /// quarter of the machine's memory. Only the CUDA backend has a host
    /// tier.
    #[arg(long, env = "INFERSCALE_KV_HOST_MB")]
    pub(crate) kv_host_mb: Option<u64>,
    /// Promote a fact whose KV is in the host tier onto the device after
    /// this many hits there (read again from its segment by a reader
    /// thread; the device's least recently used facts are read again into
    /// the host tier), so that the device tier turns over to the facts
    /// asked for most (0: never, the default until measured; needs
    /// --kv-device-mb).
    #[arg(long, env = "INFERSCALE_KV_PROMOTE_AFTER", default_value_t = 0)]
    pub(crate) kv_promote_after: u32,
    /// How new KV segments store values: f32, bf16 or fp8 (e4m3 with a
    /// scale per fact, layer and KV head, keys relative to per-channel
    /// offsets; docs/design.md §2.1). Default: the backend's own
    /// (bf16 on CUDA, f32 on the CPU: lossless). Segments already written
    /// keep their format and are read as they are.
    #[arg(long, env = "INFERSCALE_KV_FORMAT")]
    pub(crate) kv_format: Option<KvFormat>,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["locomo", "facts"])))]
pub struct IngestArgs {
    /// The user whose memory receives the units (created if new).
    #[arg(long)]
    user: String,
    /// A LoCoMo-format JSON file: its turns become the memory units.
    #[arg(long)]
    locomo: Option<PathBuf>,
    /// Which sample of the LoCoMo file (default: the first).
    #[arg(long, requires = "locomo")]
    sample: Option<String>,
    /// Facts the caller extracted, one JSON object per line: `id`, `text`,
    /// `source_turn` (required), `speaker`, `time`. Each is encoded after the
    /// turns stored before its source turn.
    #[arg(long)]
    facts: Option<PathBuf>,
    /// Turns per durable batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[command(flatten)]
    mem: MemoryArgs,
}

#[derive(Args, Debug)]
pub struct AskArgs {
    /// The user whose memory answers.
    #[arg(long)]
    user: String,
    /// How the retrieved facts reach the model: injected as stored KV (kv),
    /// injected with a share recomputed (blend), pasted as text (prompt), or
    /// not at all (none).
    #[arg(long, value_enum, default_value_t = Mode::Kv)]
    mode: Mode,
    /// With --mode blend: the share of injected tokens recomputed (0..=1).
    #[arg(long, default_value_t = inferscale_types::DEFAULT_BLEND_RATIO, value_parser = blend_ratio)]
    blend_ratio: f32,
    /// Facts to retrieve.
    #[arg(long, default_value_t = 20)]
    k: usize,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// The question.
    question: String,
    #[command(flatten)]
    mem: MemoryArgs,
}

/// The words around the facts (see [`Prompts`]).
#[derive(Args, Debug, Clone)]
pub struct PromptArgs {
    /// Where the facts go: at the end of the system turn, or at the start
    /// of the first user turn (for chat templates without a system role,
    /// and memories made before this choice existed). Part of what a
    /// memory's KV is made with; another is refused (the facts stay).
    #[arg(long, env = "INFERSCALE_MEMORY_TURN", default_value = MemoryTurn::DEFAULT.as_str(), value_parser = parse_memory_turn)]
    pub(crate) memory_turn: MemoryTurn,
    /// The system prompt (default: the memory turn's own). Every fact is
    /// encoded after it, so a memory's KV is made for one system prompt;
    /// another is refused (the facts stay).
    #[arg(long, env = "INFERSCALE_SYSTEM_PROMPT")]
    pub(crate) system_prompt: Option<String>,
    /// The instruction before each question (free to change).
    #[arg(long, env = "INFERSCALE_INSTRUCTION", default_value = ANSWER_INSTRUCTION)]
    pub(crate) instruction: String,
}

impl PromptArgs {
    pub(crate) fn prompts(&self) -> Prompts {
        Prompts::new(self.memory_turn, self.system_prompt.clone(), Some(self.instruction.clone()))
    }
}

fn parse_memory_turn(s: &str) -> Result<MemoryTurn, String> {
    s.parse().map_err(|e: inferscale_memory::MemoryError| e.to_string())
}

pub(crate) fn parse_retriever(s: &str) -> Result<Retriever, String> {
    s.parse().map_err(|e: inferscale_memory::MemoryError| e.to_string())
}

impl MemoryArgs {
    pub(crate) fn prompts(&self) -> Prompts {
        self.prompts.prompts()
    }

    /// The memory directory: `--memory`, else `$INFERSCALE_HOME/memory`.
    pub(crate) fn dir(&self) -> PathBuf {
        self.memory.clone().unwrap_or_else(|| fetch::home_dir().join("memory"))
    }

    /// The context window: `--window`, else the memory's (see
    /// [`MemoryArgs::resolve`]), else [`DEFAULT_WINDOW`].
    pub(crate) fn window(&self) -> usize {
        self.window.unwrap_or(DEFAULT_WINDOW)
    }

    /// Checks what can be checked before a model loads, and fills in what
    /// the memory directory recorded at its creation (`memory.json`): the
    /// window and, unless `--model` or `--shape` is given, the model. A
    /// flag that contradicts the record, a memory held by another process
    /// (a running server, an ingest) or a damaged record fail here, at
    /// once, rather than after the model has loaded.
    pub(crate) fn resolve(&mut self) -> Result<()> {
        let dir = self.dir();
        inferscale_memory::check_unlocked(&dir).with_context(|| format!("opening memory {}", dir.display()))?;
        let made = Manifest::read(&dir)?;
        // A memory made before memory.json existed: its KV says its window.
        let window = match &made {
            Some(m) => Some(m.window),
            None => inferscale_memory::recorded_window(&dir)?,
        };
        match (self.window, window) {
            (None, Some(recorded)) => self.window = Some(recorded),
            (Some(w), Some(recorded)) if w != recorded => bail!(
                "--window {w}: memory {} was made with window {recorded} (its KV is encoded for that window); \
                 omit --window, or give another --memory directory for window {w}",
                dir.display()
            ),
            _ => {}
        }
        let Some(made) = made else { return Ok(()) };
        let named = self.model.model.is_some() || self.model.shape.is_some();
        if !named && !made.model.starts_with("shape:") {
            eprintln!("inferscale: model {} (memory {} was made with it)", made.model, dir.display());
            self.model.model = Some(made.model);
        }
        Ok(())
    }

    /// Records what this memory is made with, once it opened with it
    /// (a directory made before the record existed gets one now).
    fn record(&self, dir: &std::path::Path) -> Result<()> {
        let made = Manifest { window: self.window(), model: self.model.recorded() };
        if Manifest::read(dir)?.as_ref() != Some(&made) {
            made.write(dir)?;
        }
        Ok(())
    }
}

/// The context window of a memory made without `--window`.
pub(crate) const DEFAULT_WINDOW: usize = 20;

/// Everything a memory command needs, loaded once.
fn open<B: Backend>(a: &MemoryArgs, backend: B) -> Result<Session<B>> {
    let loaded = load_on(&a.model, backend)?;
    let (embedder, memory) = open_memory(a, &loaded, false)?;
    Ok(Session::new(Arc::new(loaded.files), loaded.engine, embedder, memory, &a.prompts())?)
}

/// The embedder (on the engine's backend) and the memory directory `a`
/// names, for a loaded model; warnings about dropped data go to stderr.
/// `lazy_users`: users are read when first used (a server; see
/// [`StoreOptions::lazy_users`]), not all before this returns.
pub(crate) fn open_memory<B: Backend>(
    a: &MemoryArgs,
    loaded: &Loaded<B>,
    lazy_users: bool,
) -> Result<(Bert<B>, Memory<B>)> {
    let files = inferscale_model::encoder::open(&a.embedder)
        .with_context(|| format!("loading the embedder {:?}", a.embedder))?;
    let embedder =
        Bert::load(loaded.engine.backend(), files).with_context(|| format!("loading the embedder {:?}", a.embedder))?;
    let dir = a.dir();
    let spec = ShardSpec::new(&loaded.files, a.window(), &a.prompts())?;
    let options = StoreOptions {
        format: a.kv_format,
        budgets: budgets(a, loaded.engine.backend().name()),
        promote_after: a.kv_promote_after,
        lazy_users,
        emulated_host_tier: false,
    };
    let t0 = std::time::Instant::now();
    let (mut memory, warnings) = Memory::open_with(&dir, spec, &loaded.engine, options)
        .with_context(|| format!("opening memory {}", dir.display()))?;
    memory.set_retriever(a.retriever);
    a.record(&dir)?;
    warnings.iter().for_each(|w| eprintln!("inferscale: warning: {w}"));
    // Opening reads facts and the KV records' index, never KV: its time
    // should not grow with the KV stored (docs/serving.md); read lazily, it
    // lists the users and reads one.
    let (users, unread) = (memory.users().count(), memory.unread_users());
    eprintln!(
        "inferscale: opened memory {} in {:.0} ms: {users} users ({} read, {:.1} GB on disk)",
        dir.display(),
        t0.elapsed().as_secs_f64() * 1e3,
        users - unread,
        memory.footprint().disk_bytes as f64 / 1e9
    );
    Ok((embedder, memory))
}

pub fn ingest(mut a: IngestArgs) -> Result<()> {
    if a.batch == 0 {
        bail!("--batch must be at least 1");
    }
    a.mem.resolve()?;
    on_backend!(a.mem.model, ingest_on(&a))
}

fn ingest_on<B: Backend>(a: &IngestArgs, backend: B) -> Result<()> {
    let (units, kind, source) = match (&a.locomo, &a.facts) {
        (Some(path), _) => {
            let samples = locomo::read(path)?;
            let sample = match &a.sample {
                Some(id) => samples
                    .iter()
                    .find(|s| &s.id == id)
                    .with_context(|| format!("{}: no sample {id:?}", path.display()))?,
                None => samples.first().with_context(|| format!("{}: no samples", path.display()))?,
            };
            (sample.turns.clone(), "turns", format!("of {}", sample.id))
        }
        (None, Some(path)) => (locomo::read_facts(path)?, "facts", format!("of {}", path.display())),
        (None, None) => bail!("give --locomo or --facts"),
    };
    let mut s = open(&a.mem, backend)?;
    let t0 = Instant::now();
    let (mut added, mut skipped, mut tokens) = (0, 0, 0);
    let total = units.len();
    let mut progress = Progress::new("inferscale ingest", total as u64, kind);
    for (i, batch) in units.chunks(a.batch).enumerate() {
        let r = s.ingest(&a.user, batch, false)?;
        (added, skipped, tokens) = (added + r.added, skipped + r.skipped, tokens + r.encoded_tokens);
        let done = (i * a.batch + batch.len()).min(total);
        progress.set(done as u64, &format!("{source}: {added} new, {skipped} already stored"));
    }
    progress.finish(&format!("{source}: {added} new, {skipped} already stored"));
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "inferscale ingest: user {:?}: {added} units in {secs:.1} s ({:.1} units/s, {:.0} encoded tokens/s, window {})",
        a.user,
        added as f64 / secs,
        tokens as f64 / secs,
        a.mem.window()
    );
    Ok(())
}

pub fn ask(mut a: AskArgs) -> Result<()> {
    if a.question.trim().is_empty() {
        bail!("the question is empty");
    }
    if a.k == 0 || a.k > 1000 {
        bail!("--k must be between 1 and 1000, got {}", a.k);
    }
    a.mem.resolve()?;
    on_backend!(a.mem.model, ask_on(&a))
}

fn ask_on<B: Backend>(a: &AskArgs, backend: B) -> Result<()> {
    let mut s = open(&a.mem, backend)?;
    s.ensure_kv(&a.user)?;
    let eos = s.files().eos_ids();
    let question = s.question(&a.question)?;

    let start = Instant::now();
    let top = s.retrieve(&a.user, &a.question, a.k)?;
    let recall = Recall { mode: a.mode, blend: inferscale_types::Blend { ratio: a.blend_ratio, ..Default::default() } };
    let p = s.prepare(Facts::new(&a.user, &top, recall), &question)?;
    let files = s.files().clone();
    let work = vec![(p.seq, SamplingParams::greedy(a.max_tokens))];
    let out = generate_sequences(s.engine_mut(), files.tokenizer.as_ref(), &eos, work, start)?.remove(0);
    println!("{}", out.text.trim());
    eprintln!("inferscale ask: facts (prompt order): {}", p.fact_ids.join(", "));
    eprintln!(
        "inferscale ask: mode {} · {} memory tokens · TTFT {:.1} ms (retrieval included)",
        a.mode,
        p.memory_tokens,
        out.time_to_first_token.as_secs_f64() * 1e3
    );
    Ok(())
}

/// The KV cache's budgets: the flags', else bounded by default — the KV a
/// memory reads and encodes would otherwise grow with every fact until the
/// machine runs out: a quarter of the machine's memory for the CPU's
/// resident KV and for CUDA's host tier (see the flags' help).
pub(crate) fn budgets(a: &MemoryArgs, backend: &str) -> Budgets {
    let quarter = machine_memory_bytes().map(|b| b / 4);
    let mb = |v: Option<u64>| v.map(|mb| mb << 20);
    Budgets {
        device: mb(a.kv_device_mb).or(if backend == "cpu" { quarter } else { None }),
        host: mb(a.kv_host_mb).or(quarter),
    }
}

/// The machine's memory (`MemTotal`), if this system says.
fn machine_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 =
        info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb << 10)
}

/// Operations on a memory directory that load no model.
#[derive(clap::Subcommand, Debug)]
pub enum MemoryCommand {
    /// Mend users whose stored files are damaged (a worker reports them
    /// and refuses them): keep every record that is intact or can be
    /// corrected, and name what could not be. The memory must not be in
    /// use (stop the server first).
    Repair(RepairArgs),
}

#[derive(Args, Debug)]
pub struct RepairArgs {
    /// Memory directory (default `$INFERSCALE_HOME/memory`).
    #[arg(long, env = "INFERSCALE_MEMORY")]
    memory: Option<PathBuf>,
    /// Only this user (default: every damaged user).
    #[arg(long)]
    user: Option<String>,
}

pub fn memory(c: MemoryCommand) -> Result<()> {
    match c {
        MemoryCommand::Repair(a) => repair(a),
    }
}

/// `inferscale memory repair`: prints what was mended and fails when any
/// record could not be recovered (its bytes and, for units, their ids are
/// named; the damaged fact log is kept beside the mended one).
fn repair(a: RepairArgs) -> Result<()> {
    let dir = a.memory.unwrap_or_else(|| fetch::home_dir().join("memory"));
    let repaired = inferscale_memory::repair::repair(&dir, a.user.as_deref())
        .with_context(|| format!("repairing {}", dir.display()))?;
    if repaired.is_empty() {
        println!("{}: nothing to repair", dir.display());
        return Ok(());
    }
    let mut lost = 0;
    for u in &repaired {
        println!("user {:?}:", u.user);
        for f in &u.files {
            let lost_bytes: u64 = f.lost.iter().map(|(a, b)| b - a).sum();
            println!(
                "  {}: {} records kept ({} corrected), {} lost ({lost_bytes} bytes){}{}",
                f.file.display(),
                f.kept,
                f.corrected.len(),
                f.lost.len(),
                if f.torn > 0 { format!(", a torn tail of {} bytes dropped", f.torn) } else { String::new() },
                f.backup.as_ref().map_or(String::new(), |b| format!("; the damaged file is kept as {}", b.display()))
            );
            for (from, to) in &f.lost {
                println!("    lost: bytes {from}..{to}");
            }
        }
        if !u.lost_units.is_empty() {
            println!(
                "  units lost with their records (re-ingest them, or copy the user from a replica): {:?}",
                u.lost_units
            );
        }
        lost += usize::from(u.lost_anything());
    }
    if lost > 0 {
        bail!("{lost} of {} users lost records that could not be recovered (listed above)", repaired.len());
    }
    println!("every damaged record was recovered");
    Ok(())
}
