//! What the memory tests share: the real SmolLM2 model with the MiniLM
//! encoder, an engine over it on the CPU, and the encoders a memory writes
//! with.

use inferscale_engine::bert::Bert;
use inferscale_engine::{CpuBackend, Engine, EngineConfig};
use inferscale_memory::{Composer, Encoders, Prompts};

pub struct Models {
    pub files: inferscale_model::ModelFiles,
    pub embedder: Bert<CpuBackend>,
    pub composer: Composer,
    /// KV blocks (and tokens per step) of each engine made from these.
    blocks: usize,
}

/// SmolLM2 and MiniLM (fetched by `scripts/test.sh`), the default prompts,
/// engines of `blocks` KV blocks.
pub fn models(blocks: usize) -> Models {
    let files = inferscale_model::open("smollm2").unwrap();
    let embedder = Bert::load(&CpuBackend, inferscale_model::encoder::open("minilm").unwrap()).unwrap();
    let composer = Composer::new(&files, &Prompts::default()).unwrap();
    Models { files, embedder, composer, blocks }
}

impl Models {
    pub fn engine(&self) -> Engine<CpuBackend> {
        let cfg = EngineConfig { kv_blocks: self.blocks, max_batch_tokens: self.blocks };
        Engine::new(CpuBackend, &self.files, cfg).unwrap()
    }

    pub fn encoders<'a>(&'a self, engine: &'a mut Engine<CpuBackend>) -> Encoders<'a, CpuBackend> {
        Encoders { engine, embedder: &self.embedder, composer: &self.composer }
    }
}

/// Where `user`'s files are in the memory directory `dir`.
#[allow(dead_code)] // not every test file looks at a user's files
pub fn user_dir(dir: &std::path::Path, user: &str) -> std::path::PathBuf {
    dir.join("users").join(inferscale_memory::user_dir_name(user))
}
