//! The PyO3 module `inferscale_vllm._core`: what the Python shim
//! (`inferscale_vllm/connector.py`) calls. Plans cross as JSON strings,
//! caches as raw pointers with their shape and strides, checked here.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use inferscale_memory::MemoryUnit;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use inferscale_engine::CpuBackend;
use inferscale_memory::{Chat, MemoryError, MemoryTurn, Prompts, Scope};

use crate::error::ConnectorError;
use crate::inject::CacheMut;
use crate::layout::{CacheView, DType, Geometry};
use crate::memory_core::{AnyCore, Core, CoreConfig};
use crate::plan::{self, ModelShape, Plan};

fn py_err(e: ConnectorError) -> PyErr {
    match e {
        ConnectorError::Layout(_)
        | ConnectorError::Plan(_)
        | ConnectorError::Unsupported(_)
        | ConnectorError::Invalid { .. } => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

fn parse_plan(params_json: &str) -> PyResult<Plan> {
    let v: serde_json::Value = serde_json::from_str(params_json)
        .map_err(|e| PyValueError::new_err(format!("kv_transfer_params is not JSON: {e}")))?;
    Plan::from_params(&v).map_err(py_err)?.ok_or_else(|| PyValueError::new_err("kv_transfer_params has no memory plan"))
}

/// A cache tensor as the shim passes it: `(data_ptr, shape, strides,
/// storage_elements, dtype)`.
type TensorArgs = (usize, Vec<usize>, Vec<usize>, usize, String);

/// One registered layer: where its storage starts and how it is addressed.
struct Layer {
    ptr: usize,
    view: CacheView,
}

/// The connector's core (see the Rust crate's `core` module).
#[pyclass(frozen, name = "Core")]
struct PyCore {
    /// Shared with the gRPC front's threads, once serving.
    core: Arc<Mutex<AnyCore>>,
    layers: Mutex<Vec<Layer>>,
    front: Mutex<Option<crate::front::Front>>,
    /// Names `/v1/embeddings` may call the core's encoder by.
    embedder: Vec<String>,
}

impl PyCore {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, AnyCore>> {
        self.core.lock().map_err(|_| PyRuntimeError::new_err("core poisoned by an earlier panic"))
    }
}

#[pymethods]
impl PyCore {
    #[new]
    #[pyo3(signature = (model, memory_dir, embedder = "minilm", window = 20, kv_cache_mb = 256, max_batch_tokens = 512,
                        backend = "cpu", device = 0, random_shape = None, retriever = "hybrid",
                        system_prompt = None, instruction = None, memory_turn = None))]
    #[allow(clippy::too_many_arguments)] // keyword arguments from the connector's config
    fn new(
        model: &str,
        memory_dir: &str,
        embedder: &str,
        window: usize,
        kv_cache_mb: usize,
        max_batch_tokens: usize,
        backend: &str,
        device: usize,
        random_shape: Option<String>,
        retriever: &str,
        system_prompt: Option<String>,
        instruction: Option<String>,
        memory_turn: Option<String>,
    ) -> PyResult<Self> {
        let turn = match memory_turn {
            Some(t) => t.parse().map_err(|e: MemoryError| PyValueError::new_err(e.to_string()))?,
            None => MemoryTurn::DEFAULT,
        };
        let cfg = CoreConfig {
            model: model.into(),
            random_shape,
            embedder: embedder.into(),
            memory_dir: PathBuf::from(memory_dir),
            window,
            kv_cache_mb,
            max_batch_tokens,
            retriever: retriever.parse().map_err(|e: MemoryError| PyValueError::new_err(e.to_string()))?,
            prompts: Prompts::new(turn, system_prompt, instruction),
        };
        let inner = match backend {
            "cpu" => AnyCore::Cpu(Box::new(Core::open(&cfg, CpuBackend).map_err(py_err)?)),
            #[cfg(feature = "cuda")]
            "cuda" => {
                let be = inferscale_cuda::CudaBackend::new(device)
                    .map_err(|e| PyRuntimeError::new_err(format!("opening GPU {device}: {e}")))?;
                AnyCore::Cuda(Box::new(Core::open(&cfg, be).map_err(py_err)?))
            }
            other => {
                let _ = device;
                return Err(PyValueError::new_err(format!(
                    "backend {other:?}: this build has {}",
                    if cfg!(feature = "cuda") { "cpu and cuda" } else { "cpu only (build with the cuda feature)" }
                )));
            }
        };
        Ok(PyCore {
            core: Arc::new(Mutex::new(inner)),
            layers: Mutex::new(Vec::new()),
            front: Mutex::new(None),
            embedder: inferscale_model::fetch::served_names(embedder),
        })
    }

    /// The model shape's fingerprint (what a plan's `fingerprint` names).
    fn fingerprint(&self) -> PyResult<String> {
        Ok(each!(&*self.lock()?, c => c.fingerprint().to_string()))
    }

    /// The model's HF `config.json` fields vLLM needs to build the same shape.
    fn hf_config(&self) -> PyResult<String> {
        let inner = self.lock()?;
        Ok(inferscale_model::export::hf_config(&each!(&*inner, core => core.files().config.clone())).to_string())
    }

    /// Stores turns (dicts with `id`, `text` and optionally `speaker`,
    /// `time`, `source_turn`) for `user`; returns how many were new.
    fn ingest(&self, py: Python<'_>, user: &str, turns: Vec<HashMap<String, String>>) -> PyResult<usize> {
        let turns = turns
            .into_iter()
            .enumerate()
            .map(|(i, mut t)| {
                let mut take = |k: &str| t.remove(k).unwrap_or_default();
                let turn = MemoryUnit {
                    id: take("id"),
                    text: take("text"),
                    speaker: take("speaker"),
                    time: take("time"),
                    source_turn: take("source_turn"),
                    ..Default::default()
                };
                if turn.id.is_empty() || turn.text.is_empty() {
                    return Err(PyValueError::new_err(format!("turn {i}: `id` and `text` are required")));
                }
                Ok(turn)
            })
            .collect::<PyResult<Vec<MemoryUnit>>>()?;
        py.detach(|| Ok(each!(&mut *self.lock()?, c => c.ingest(user, &turns)).map_err(py_err)?.added))
    }

    #[pyo3(signature = (user, fact = None))]
    fn forget(&self, user: &str, fact: Option<&str>) -> PyResult<()> {
        each!(&mut *self.lock()?, c => c.forget(user, fact)).map_err(py_err)
    }

    fn facts(&self, user: &str) -> PyResult<usize> {
        Ok(each!(&*self.lock()?, c => c.facts(user)))
    }

    /// `(prompt token ids, kv_transfer_params as JSON, cache_salt, fact ids)`
    /// of a kv-mode request; the prompt-mode baseline submits the same ids
    /// with neither params nor salt.
    fn compose(
        &self,
        py: Python<'_>,
        user: &str,
        question: &str,
        k: usize,
    ) -> PyResult<(Vec<u32>, String, String, Vec<String>)> {
        let c = py.detach(|| {
            each!(&mut *self.lock()?, c => c.compose(user, &Chat::question(question), &Scope::default(), k))
                .map_err(py_err)
        })?;
        Ok((c.prompt, c.plan.to_params().to_string(), c.plan.salt.clone(), c.fact_ids))
    }

    /// Registers vLLM's cache tensors, in layer order: each
    /// `(data_ptr, shape, strides, storage_elements, dtype)`. Returns the
    /// detected layout's name. An error leaves nothing registered.
    fn register_caches(&self, layers: Vec<TensorArgs>, block_size: usize, on_device: bool) -> PyResult<String> {
        let (shape, device_core) = {
            let inner = self.lock()?;
            (each!(&*inner, c => c.shape().clone()), !matches!(*inner, AnyCore::Cpu(_)))
        };
        if on_device != device_core {
            return Err(PyValueError::new_err(format!(
                "{} caches for a core on the {}",
                if on_device { "device" } else { "host" },
                if device_core { "GPU" } else { "CPU" }
            )));
        }
        if layers.len() != shape.num_layers {
            return Err(PyValueError::new_err(format!(
                "{} cache layers, the model has {}",
                layers.len(),
                shape.num_layers
            )));
        }
        let g = Geometry { block_size, kv_heads: shape.num_kv_heads, head_dim: shape.head_dim };
        let mut out = Vec::with_capacity(layers.len());
        for (i, (ptr, dims, strides, elems, dtype)) in layers.into_iter().enumerate() {
            let dtype = DType::parse(&dtype).map_err(py_err)?;
            let view = CacheView::new(&dims, &strides, elems, dtype, &g)
                .map_err(|e| PyValueError::new_err(format!("layer {i}: {e}")))?;
            if ptr == 0 || ptr % dtype.size() != 0 {
                return Err(PyValueError::new_err(format!("layer {i}: bad data pointer {ptr:#x}")));
            }
            if out.first().is_some_and(|l: &Layer| l.view != view) {
                return Err(PyValueError::new_err(format!("layer {i}: shape or strides differ from layer 0's")));
            }
            out.push(Layer { ptr, view });
        }
        let name = out.first().map_or("none", |l| l.view.layout.as_str()).to_string();
        *self.layers.lock().map_err(|_| PyRuntimeError::new_err("layers poisoned"))? = out;
        Ok(name)
    }

    /// Loads the plan in `params_json` into the registered caches at the
    /// slots of `block_ids`, positions `from_position..end`; device caches
    /// on CUDA stream `stream` (torch's current stream, as an integer).
    /// Returns the plan's id (for [`PyCore::finish`] when the request ends).
    #[pyo3(signature = (params_json, block_ids, from_position, stream = 0))]
    fn load(
        &self,
        py: Python<'_>,
        params_json: &str,
        block_ids: Vec<u32>,
        from_position: usize,
        stream: u64,
    ) -> PyResult<String> {
        // Without the GIL: the gRPC front may hold the core for an ingest batch.
        py.detach(|| self.load_plan(params_json, &block_ids, from_position, stream))
    }

    /// Serves the worker gRPC API on `listen` (`host:port`) from background
    /// threads, its Generate relayed to the vLLM server at `vllm_url`
    /// serving `served_model`. Returns the bound address. Once per core.
    /// With `tls_cert`, `tls_key` and `tls_ca` (PEM files) the API is
    /// served with mutual TLS, as a native worker's.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (listen, vllm_url, served_model, max_k = 200, max_in_flight = 256, max_ingest_units = 2000,
                        tls_cert = None, tls_key = None, tls_ca = None))]
    fn serve(
        &self,
        listen: &str,
        vllm_url: &str,
        served_model: &str,
        max_k: usize,
        max_in_flight: usize,
        max_ingest_units: usize,
        tls_cert: Option<std::path::PathBuf>,
        tls_key: Option<std::path::PathBuf>,
        tls_ca: Option<std::path::PathBuf>,
    ) -> PyResult<String> {
        let mut front = self.front.lock().map_err(|_| PyRuntimeError::new_err("front poisoned"))?;
        if let Some(f) = front.as_ref() {
            return Err(PyRuntimeError::new_err(format!("this core already serves on {}", f.addr())));
        }
        let addr: std::net::SocketAddr =
            listen.parse().map_err(|e| PyValueError::new_err(format!("grpc_listen {listen:?}: {e}")))?;
        if max_k == 0 || max_in_flight == 0 || max_ingest_units == 0 {
            return Err(PyValueError::new_err("max_k, max_in_flight and max_ingest_units must be at least 1"));
        }
        let mut cfg = crate::front::FrontConfig::new(addr, vllm_url, served_model);
        cfg.max_k = max_k;
        cfg.max_in_flight = max_in_flight;
        cfg.max_ingest_units = max_ingest_units;
        cfg.embedder = self.embedder.clone();
        cfg.tls = inferscale_worker::TlsFiles::from_parts(tls_cert, tls_key, tls_ca, "tls_cert, tls_key and tls_ca")
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let f = crate::front::serve(self.core.clone(), cfg).map_err(py_err)?;
        let bound = f.addr().to_string();
        *front = Some(f);
        Ok(bound)
    }

    /// Forgets an issued plan once its request is done.
    fn finish(&self, py: Python<'_>, plan_id: &str) -> PyResult<()> {
        py.detach(|| {
            each!(&mut *self.lock()?, c => c.finish(plan_id));
            Ok(())
        })
    }

    /// Per layer `(K, V)`, each `[tokens · kv_dim]` floats, K rotated: the
    /// cache contents a prompt prefill of `tokens` alone at `start..` leaves.
    fn reference_kv(&self, tokens: Vec<u32>, start: u32) -> PyResult<Vec<(Vec<f32>, Vec<f32>)>> {
        each!(&mut *self.lock()?, c => c.reference_kv(&tokens, start)).map_err(py_err)
    }
}

impl PyCore {
    /// [`PyCore::load`]'s body, run without the GIL.
    fn load_plan(&self, params_json: &str, block_ids: &[u32], from_position: usize, stream: u64) -> PyResult<String> {
        let plan = parse_plan(params_json)?;
        let mut inner = self.lock()?;
        let layers = self.layers.lock().map_err(|_| PyRuntimeError::new_err("layers poisoned"))?;
        if layers.is_empty() {
            return Err(PyValueError::new_err("no kv caches registered"));
        }
        // Without the cuda feature the match has one arm.
        #[allow(clippy::infallible_destructuring_match)]
        let core = match &mut *inner {
            AnyCore::Cpu(core) => core,
            #[cfg(feature = "cuda")]
            AnyCore::Cuda(core) => {
                let bases: Vec<u64> = layers.iter().map(|l| l.ptr as u64).collect();
                // SAFETY: registration checked each pointer's storage against
                // the view (device memory vLLM keeps for the engine's life);
                // `stream` is torch's current stream of this device, on which
                // vLLM runs the forward that reads these blocks.
                unsafe { core.load_device(&plan, &bases, &layers[0].view, block_ids, from_position, stream) }
                    .map_err(py_err)?;
                return Ok(plan.id);
            }
        };
        let _ = stream;
        // SAFETY: each pointer was checked at registration to address a
        // storage of at least `view.extent` elements of `view.dtype`;
        // vLLM keeps registered caches alive for the engine's lifetime, and
        // the slices live only for this call, while vLLM's forward waits
        // on it (no other writer of these blocks runs meanwhile).
        let mut caches: Vec<(CacheMut<'_>, CacheView)> = layers
            .iter()
            .map(|l| {
                let cache = unsafe {
                    match l.view.dtype {
                        DType::F32 => CacheMut::F32(std::slice::from_raw_parts_mut(l.ptr as *mut f32, l.view.extent)),
                        DType::F16 => {
                            CacheMut::F16(std::slice::from_raw_parts_mut(l.ptr as *mut half::f16, l.view.extent))
                        }
                        DType::BF16 => {
                            CacheMut::BF16(std::slice::from_raw_parts_mut(l.ptr as *mut half::bf16, l.view.extent))
                        }
                    }
                };
                (cache, l.view)
            })
            .collect();
        core.load(&plan, &mut caches, block_ids, from_position).map_err(py_err)?;
        Ok(plan.id)
    }
}

/// `config.json` for vLLM of a named random-weight shape (as `random_shape`).
#[pyfunction]
fn shape_hf_config(name: &str) -> PyResult<String> {
    let c = inferscale_model::shapes::preset(name)
        .ok_or_else(|| PyValueError::new_err(format!("`{name}` is not a known shape")))?;
    Ok(inferscale_model::export::hf_config(&c).to_string())
}

/// Scheduler side: `(tokens to load, None)` or `(0, why not)`.
#[pyfunction]
#[pyo3(signature = (params_json, prompt, cache_salt, num_computed, engine_fingerprint))]
fn external_tokens(
    params_json: &str,
    prompt: Vec<u32>,
    cache_salt: Option<&str>,
    num_computed: usize,
    engine_fingerprint: &str,
) -> PyResult<(usize, Option<String>)> {
    let plan = parse_plan(params_json)?;
    Ok(match plan::external_tokens(&plan, &prompt, cache_salt, num_computed, engine_fingerprint) {
        Ok(n) => (n, None),
        Err(why) => (0, Some(why.to_string())),
    })
}

/// One past the last memory position of the plan in `params_json`.
#[pyfunction]
fn plan_end(params_json: &str) -> PyResult<usize> {
    Ok(parse_plan(params_json)?.end())
}

/// The fingerprint of a model shape as vLLM's config describes it.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // one argument per config field, named at the call
#[pyo3(signature = (architecture, num_layers, num_kv_heads, head_dim, hidden_size, vocab_size, rope_type, rope_theta, rotary_dim))]
fn shape_fingerprint(
    architecture: String,
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
    hidden_size: usize,
    vocab_size: usize,
    rope_type: String,
    rope_theta: f32,
    rotary_dim: usize,
) -> String {
    plan::shape_fingerprint(&ModelShape {
        architecture,
        num_layers,
        num_kv_heads,
        head_dim,
        hidden_size,
        vocab_size,
        rope_theta,
        rotary_dim,
        rope_type,
    })
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCore>()?;
    m.add_function(wrap_pyfunction!(external_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(plan_end, m)?)?;
    m.add_function(wrap_pyfunction!(shape_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(shape_hf_config, m)?)?;
    m.add("PARAMS_KEY", plan::PARAMS_KEY)?;
    Ok(())
}
