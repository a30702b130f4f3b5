//! Weight sources: one interface over GGUF files and HF safetensors
//! directories, always speaking HF tensor names and row-major f32.
//!
//! GGUF files produced by llama.cpp's converter for the `llama` architecture
//! store the rows of `q_proj` and `k_proj` permuted so that RoPE can rotate
//! adjacent pairs (interleaved). The engine rotates halves, as HF does, so
//! the permutation is undone here at load; the reference check against HF
//! transformers (tests/golden) proves the two agree.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// A dense host tensor in row-major order.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Where weights come from. Names are HF's (`model.layers.0.self_attn.q_proj.weight`).
pub enum WeightSource {
    /// A GGUF file; `qk_heads` = (query heads, KV heads) when the file stores
    /// Q/K rows permuted (llama.cpp's `llama` architecture).
    Gguf {
        file: GgufFile,
        qk_heads: Option<(usize, usize)>,
    },
    Safetensors(SafetensorsDir),
    /// Deterministic random values of whatever shape is asked for (speed
    /// work on shapes without a checkpoint; see `shapes.rs`). `tied`: no
    /// `lm_head.weight`, as with tied embeddings.
    Random {
        seed: u64,
        tied: bool,
    },
}

impl WeightSource {
    pub fn path(&self) -> &Path {
        match self {
            WeightSource::Gguf { file, .. } => file.path(),
            WeightSource::Safetensors(s) => &s.dir,
            WeightSource::Random { .. } => Path::new("random"),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        match self {
            WeightSource::Gguf { file, .. } => gguf_name(name).is_some_and(|n| file.tensors.contains_key(&n)),
            WeightSource::Safetensors(s) => s.index.contains_key(name),
            WeightSource::Random { tied, .. } => !(*tied && name == "lm_head.weight"),
        }
    }

    /// Loads tensor `name` as f32 and checks it has `shape`.
    pub fn load(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let (actual, mut data) = match self {
            WeightSource::Gguf { file, .. } => {
                let gname = gguf_name(name).ok_or_else(|| ModelError::MissingTensor {
                    path: file.path().to_path_buf(),
                    tensor: name.to_string(),
                })?;
                file.tensor_f32(&gname)?
            }
            WeightSource::Safetensors(s) => s.load(name)?,
            WeightSource::Random { seed, .. } => {
                let data = crate::shapes::random_values(*seed, name, shape.iter().product());
                return Ok(HostTensor { shape: shape.to_vec(), data });
            }
        };
        if actual != shape {
            return Err(ModelError::ShapeMismatch {
                path: self.path().to_path_buf(),
                tensor: name.to_string(),
                expected: shape.to_vec(),
                actual,
            });
        }
        if let WeightSource::Gguf { qk_heads: Some((q_heads, kv_heads)), .. } = self {
            let cols = shape.get(1).copied().unwrap_or(1);
            if name.ends_with("q_proj.weight") || name.ends_with("q_proj.bias") {
                data = unpermute_rows(&data, *q_heads, cols);
            } else if name.ends_with("k_proj.weight") || name.ends_with("k_proj.bias") {
                data = unpermute_rows(&data, *kv_heads, cols);
            }
        }
        Ok(HostTensor { shape: shape.to_vec(), data })
    }
}

/// Inverse of llama.cpp's `permute`: within each head, the converter moved
/// row `j*2 + p` (pair index j, member p) from HF row `p*half + j`. Rows have
/// `cols` elements.
fn unpermute_rows(data: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = data.len() / cols;
    let head_rows = rows / heads;
    let half = head_rows / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..heads {
        for j in 0..half {
            for p in 0..2 {
                let src = h * head_rows + j * 2 + p;
                let dst = h * head_rows + p * half + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Maps an HF tensor name to its llama.cpp GGUF name.
fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let g = match module {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{kind}"))
}

/// Memory-mapped `*.safetensors` files of one HF model directory.
pub struct SafetensorsDir {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    /// tensor name → index into `files`
    index: HashMap<String, usize>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<Self> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ModelError::Io { path, source }
        };
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(ModelError::Safetensors {
                path: dir.to_path_buf(),
                reason: "no *.safetensors files in the directory".into(),
            });
        }
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for (i, p) in paths.into_iter().enumerate() {
            let f = std::fs::File::open(&p).map_err(io(&p))?;
            // SAFETY: read-only map of a file we do not modify.
            let mmap = unsafe { Mmap::map(&f) }.map_err(io(&p))?;
            let names = SafeTensors::read_metadata(&mmap)
                .map_err(|e| ModelError::Safetensors { path: p.clone(), reason: e.to_string() })?
                .1
                .tensors()
                .into_keys()
                .collect::<Vec<_>>();
            for n in names {
                index.insert(n, i);
            }
            files.push((p, mmap));
        }
        Ok(SafetensorsDir { dir: dir.to_path_buf(), files, index })
    }

    fn load(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor { path: self.dir.clone(), tensor: name.to_string() })?;
        let (path, mmap) = &self.files[i];
        let st_err = |reason: String| ModelError::Safetensors { path: path.clone(), reason };
        let st = SafeTensors::deserialize(mmap).map_err(|e| st_err(e.to_string()))?;
        let view = st.tensor(name).map_err(|e| st_err(format!("`{name}`: {e}")))?;
        let bytes = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => {
                return Err(ModelError::UnsupportedType {
                    path: path.clone(),
                    tensor: name.to_string(),
                    ty: format!("{other:?}"),
                });
            }
        };
        Ok((view.shape().to_vec(), data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's permute, as its converter applies it.
    fn permute_rows(data: &[f32], heads: usize, cols: usize) -> Vec<f32> {
        let rows = data.len() / cols;
        let head_rows = rows / heads;
        let half = head_rows / 2;
        let mut out = vec![0f32; data.len()];
        for h in 0..heads {
            for p in 0..2 {
                for j in 0..half {
                    let src = h * head_rows + p * half + j;
                    let dst = h * head_rows + j * 2 + p;
                    out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_permute() {
        let data: Vec<f32> = (0..3 * 8 * 5).map(|x| x as f32).collect();
        assert_eq!(unpermute_rows(&permute_rows(&data, 3, 5), 3, 5), data);
        assert_ne!(permute_rows(&data, 3, 5), data);
    }

    #[test]
    fn gguf_names() {
        assert_eq!(gguf_name("model.layers.12.self_attn.k_proj.bias").as_deref(), Some("blk.12.attn_k.bias"));
        assert_eq!(gguf_name("model.layers.0.mlp.down_proj.weight").as_deref(), Some("blk.0.ffn_down.weight"));
        assert_eq!(gguf_name("lm_head.weight").as_deref(), Some("output.weight"));
        assert_eq!(gguf_name("model.layers.0.bogus.weight"), None);
    }
}
