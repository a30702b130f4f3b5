//! Our kernels (`kernels/*.cu` at the repository root), compiled by NVRTC
//! when the backend starts, for the architecture of the device in hand: no
//! CUDA toolkit is needed to build InferScale, only the headers at run time.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, sys::CUfunction_attribute};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use crate::error::{CudaError, Result};

/// The sources, in compilation order (one translation unit).
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    ("elementwise.cu", include_str!("../../../kernels/elementwise.cu")),
    ("kv.cu", include_str!("../../../kernels/kv.cu")),
    ("kv_fp8.cu", include_str!("../../../kernels/kv_fp8.cu")),
    ("attention.cu", include_str!("../../../kernels/attention.cu")),
    ("gemv.cu", include_str!("../../../kernels/gemv.cu")),
    ("retrieval.cu", include_str!("../../../kernels/retrieval.cu")),
];

/// Query rows and keys per tile of `paged_attention` (`BR`, `BK` in attention.cu).
pub const ATTN_ROWS: usize = 64;
pub const ATTN_KEYS: usize = 64;
/// Threads of a `paged_attention` block (four warps of sixteen rows).
pub const ATTN_THREADS: u32 = 128;

/// Most rows `gemv_r*` (gemv.cu) takes, and its threads a block (a warp
/// per output column).
pub const GEMV_ROWS: usize = 8;
pub const GEMV_THREADS: u32 = 256;

/// Dynamic shared memory of `paged_attention_d{head_dim}`: two stages
/// (double buffering) of a K and a V tile, each `[keys, head_dim + 8]` bf16.
pub fn attention_smem_bytes(head_dim: usize) -> usize {
    2 * 2 * ATTN_KEYS * (head_dim + 8) * 2
}

/// Dynamic shared memory of `paged_attention_fp8_d{head_dim}`: one stage of
/// bf16 K and V tiles, two stages of codes (K and V, `[keys, head_dim]`
/// bytes each) with their scales and positions (4 bytes a key each), and
/// the head's key offsets with the other element of each one's rotated pair
/// (f32 each).
pub fn attention_fp8_smem_bytes(head_dim: usize) -> usize {
    2 * ATTN_KEYS * (head_dim + 8) * 2 + 2 * (2 * ATTN_KEYS * head_dim + 3 * ATTN_KEYS * 4) + 8 * head_dim
}

/// Most rows `top_k_sorted` sorts in shared memory (8 bytes a row); a
/// user with more facts has its scores ranked on the host.
pub const TOP_K_SORT_ROWS: usize = 8192;

/// The directory holding `cuda_bf16.h`: `$INFERSCALE_CUDA_INCLUDE`, then
/// `$CUDA_HOME`/`$CUDA_PATH`, then the usual install places.
pub fn find_include_dir() -> Result<PathBuf> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("INFERSCALE_CUDA_INCLUDE") {
        candidates.push(PathBuf::from(d));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = std::env::var_os(var) {
            let d = PathBuf::from(d);
            candidates.push(d.join("include"));
            candidates.push(d.join("targets/x86_64-linux/include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates.push(PathBuf::from("/usr/local/cuda/targets/x86_64-linux/include"));
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut versioned: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("cuda-")))
            .collect();
        versioned.sort();
        for d in versioned.into_iter().rev() {
            candidates.push(d.join("targets/x86_64-linux/include"));
            candidates.push(d.join("include"));
        }
    }
    for c in candidates {
        if c.join("cuda_bf16.h").is_file() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    Err(CudaError::Headers(format!(
        "no cuda_bf16.h in {}; set INFERSCALE_CUDA_INCLUDE to the CUDA include directory",
        tried.join(", ")
    )))
}

/// Compiles every kernel to PTX for `arch` (e.g. `sm_90`).
pub fn compile(arch: &str, include: &Path) -> Result<cudarc::nvrtc::Ptx> {
    let src: String = SOURCES.iter().map(|(name, text)| format!("// ---- {name}\n{text}\n")).collect();
    let opts = CompileOptions {
        include_paths: vec![include.display().to_string()],
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("inferscale_kernels.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            CudaError::Compile { reason: "compile error".into(), log: format!(":\n{}", log.to_string_lossy()) }
        }
        other => CudaError::Compile { reason: other.to_string(), log: String::new() },
    })
}

macro_rules! kernels {
    ($($name:ident),* $(,)?) => {
        /// Handles of every kernel in the module.
        pub struct Kernels {
            $(pub $name: CudaFunction,)*
        }

        impl Kernels {
            fn load_all(module: &Arc<cudarc::driver::CudaModule>) -> Result<Self> {
                Ok(Kernels { $($name: module.load_function(stringify!($name))?,)* })
            }
        }
    };
}

kernels!(
    embedding_gather,
    select_rows,
    argmax_parts,
    argmax_merge_parts,
    row_sq_distance,
    attention_mass,
    rms_norm,
    rms_norm_v8,
    add_rms_norm_v8,
    layer_norm,
    gelu,
    silu_mul,
    copy_cols,
    add_assign,
    add_bias,
    rope_apply,
    qkv_rope_write,
    write_kv,
    gather_kv,
    copy_blocks,
    inject_kv,
    inject_kv_strided,
    inject_kv_fp8,
    inject_kv_strided_fp8,
    qkv_rope_write_fp8,
    write_kv_fp8,
    gather_kv_fp8,
    copy_blocks_fp8,
    inject_kv_to_fp8,
    inject_kv_fp8_to_fp8,
    e4m3_encode_mismatches,
    fp8_divisor_mismatches,
    attention_bidirectional,
    paged_attention_d64,
    paged_attention_d128,
    paged_attention_fp8_d64,
    paged_attention_fp8_d128,
    attention_combine,
    gemv_r1,
    gemv_r2,
    gemv_r4,
    gemv_r8,
    gemv_silu_r1,
    gemv_silu_r2,
    gemv_silu_r4,
    gemv_silu_r8,
    inner_products,
    top_k_sorted,
);

impl Kernels {
    /// Compiles for `ctx`'s device and loads the module.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let (major, minor) = ctx.compute_capability()?;
        if major < 8 {
            return Err(CudaError::Unsupported(format!(
                "compute capability {major}.{minor}: bf16 tensor-core kernels need 8.0 or newer"
            )));
        }
        let include = find_include_dir()?;
        let ptx = compile(&format!("sm_{major}{minor}"), &include)?;
        let module = ctx.load_module(ptx)?;
        let k = Kernels::load_all(&module)?;
        for (f, bytes) in [
            (&k.paged_attention_d64, attention_smem_bytes(64)),
            (&k.paged_attention_d128, attention_smem_bytes(128)),
            (&k.paged_attention_fp8_d64, attention_fp8_smem_bytes(64)),
            (&k.paged_attention_fp8_d128, attention_fp8_smem_bytes(128)),
        ] {
            f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)?;
        }
        k.top_k_sorted.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            (8 * TOP_K_SORT_ROWS) as i32,
        )?;
        Ok(k)
    }
}

/// Whether a CUDA library (`"cuda"`, `"nvrtc"`, `"cublas"`, …) can be opened.
/// cudarc aborts the process with a panic when it cannot load one, so the
/// backend asks first and reports a plain error instead.
pub fn library_present(name: &str) -> bool {
    cudarc::get_lib_name_candidates(name).iter().any(|candidate| {
        // SAFETY: opening a CUDA library runs only its initialisers, as linking against it would.
        unsafe { libloading::Library::new(candidate) }.is_ok()
    })
}
