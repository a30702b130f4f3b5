//! `inferscale worker --engine vllm`: a worker whose generation is vLLM's.
//!
//! This process supervises `vllm serve` with our KV connector configured
//! (docs/vllm.md): the connector's core, inside vLLM's worker process,
//! owns the memory shard and serves the worker gRPC API on `--listen`;
//! its Generate goes to that vLLM server's completions API on loopback.
//! Here we wait until both answer, register the worker in the cluster like
//! a native one, and on shutdown stop vLLM and leave the cluster. vLLM is
//! killed if this process dies (parent-death signal), so no orphan keeps
//! the GPU.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use inferscale_cluster::etcd::EtcdOptions;
use inferscale_router::Security;
use serde_json::{Value, json};

use crate::serve::{WorkerCmd, connect_etcd, register, runtime, shutdown_signal};

#[derive(Args, Debug, Clone)]
pub struct VllmArgs {
    /// The model directory (or HF name) vLLM loads: the same weights as
    /// --model, in a format vLLM reads. Default with --shape: a directory
    /// holding the shape's config.json, loaded with dummy weights.
    #[arg(long)]
    vllm_model: Option<String>,
    /// Loopback port of vLLM's OpenAI-compatible server (the worker API
    /// sends it the composed prompts).
    #[arg(long, default_value_t = 8000)]
    vllm_port: u16,
    /// The Python that has vLLM 0.26 and the `inferscale_vllm` package.
    #[arg(long, env = "INFERSCALE_VLLM_PYTHON", default_value = "python3")]
    vllm_python: String,
    /// An argument passed on to `vllm serve` (repeat), e.g.
    /// `--vllm-arg=--gpu-memory-utilization=0.8`.
    #[arg(long = "vllm-arg", allow_hyphen_values = true)]
    vllm_args: Vec<String>,
    /// Seconds to wait for vLLM to load and serve.
    #[arg(long, default_value_t = 900)]
    vllm_start_timeout_s: u64,
    /// Print the `vllm serve` command line and exit (to run vLLM yourself).
    #[arg(long)]
    print_vllm_command: bool,
}

/// The connector's `kv_connector_extra_config` for this worker.
fn extra_config(a: &WorkerCmd) -> Result<Value> {
    let w = &a.worker;
    let m = &w.mem.model;
    let mut extra = json!({
        "model": m.model(),
        "memory_dir": w.mem.dir().to_string_lossy(),
        "embedder": w.mem.embedder,
        "window": w.mem.window(),
        "kv_cache_mb": m.kv_cache_mb,
        "max_batch_tokens": m.max_batch_tokens,
        "backend": m.backend,
        "grpc_listen": a.listen.to_string(),
        "vllm_url": format!("http://127.0.0.1:{}", a.vllm.vllm_port),
        "max_k": w.max_k,
        "max_in_flight": w.max_queue,
        "max_ingest_units": w.max_ingest_units,
        "retriever": w.mem.retriever.as_str(),
    });
    if let Some(tls) = a.tls.files()? {
        extra["tls_cert"] = json!(tls.cert.to_string_lossy());
        extra["tls_key"] = json!(tls.key.to_string_lossy());
        extra["tls_ca"] = json!(tls.ca.to_string_lossy());
    }
    // The connector's defaults are the native worker's: only a change travels.
    let (prompts, defaults) = (w.mem.prompts(), inferscale_memory::Prompts::default());
    if prompts.turn != defaults.turn {
        extra["memory_turn"] = json!(prompts.turn.as_str());
    }
    if prompts.system != prompts.turn.default_system_prompt() {
        extra["system_prompt"] = json!(prompts.system);
    }
    if prompts.instruction != defaults.instruction {
        extra["instruction"] = json!(prompts.instruction);
    }
    if let Some(shape) = &m.shape {
        extra["random_shape"] = json!(shape);
    }
    Ok(extra)
}

/// The model vLLM loads, and the arguments that come with it.
fn vllm_model(a: &WorkerCmd) -> Result<(String, Vec<String>)> {
    if let Some(m) = &a.vllm.vllm_model {
        return Ok((m.clone(), Vec::new()));
    }
    let Some(shape) = &a.worker.mem.model.shape else {
        bail!(
            "--engine vllm needs --vllm-model DIR: the weights of --model ({}) in a format vLLM loads \
             (or --shape NAME --random-weights for dummy weights of a shape)",
            a.worker.mem.model.model()
        );
    };
    let config = inferscale_model::shapes::preset(shape).with_context(|| format!("--shape {shape}: unknown shape"))?;
    let dir = inferscale_model::fetch::home_dir().join("vllm-models").join(shape);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("config.json");
    std::fs::write(&path, inferscale_model::export::hf_config(&config).to_string())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok((dir.to_string_lossy().into_owned(), vec!["--load-format=dummy".into()]))
}

/// `vllm serve`'s arguments (after the Python executable).
fn vllm_command(a: &WorkerCmd) -> Result<Vec<String>> {
    let (model, implied) = vllm_model(a)?;
    let transfer = json!({
        "kv_connector": "InferScaleConnector",
        "kv_connector_module_path": "inferscale_vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra_config(a)?,
    });
    let mut args: Vec<String> =
        ["-m", "vllm.entrypoints.cli.main", "serve", &model].into_iter().map(String::from).collect();
    // Clients name the model as for a native worker: the shape or the
    // packaged model's name, not vLLM's path.
    let served =
        a.worker.mem.model.shape.clone().unwrap_or_else(|| crate::serve::model_name(a.worker.mem.model.model()));
    args.extend([
        format!("--served-model-name={served}"),
        "--host=127.0.0.1".to_string(),
        format!("--port={}", a.vllm.vllm_port),
        format!("--kv-transfer-config={transfer}"),
        // The worker API renders prompts and answers with our tokenizer.
        "--skip-tokenizer-init".into(),
        "--enable-prefix-caching".into(),
        // Reports vLLM's cached prompt tokens, for the requests' usage.
        "--enable-prompt-tokens-details".into(),
    ]);
    args.extend(implied);
    args.extend(a.vllm.vllm_args.iter().cloned());
    Ok(args)
}

/// Waits until the worker API answers Health as ready and vLLM's server
/// lists its model, while `child` runs.
async fn wait_ready(a: &WorkerCmd, security: &Security, child: &mut tokio::process::Child) -> Result<()> {
    let started = Instant::now();
    let limit = Duration::from_secs(a.vllm.vllm_start_timeout_s);
    let vllm = inferscale_loadtest::client::Client::new(
        &format!("http://127.0.0.1:{}", a.vllm.vllm_port),
        None,
        Duration::from_secs(5),
    )?;
    // With TLS the probe dials the advertised address: the certificate names it.
    let target = match (&a.advertise, security.is_tls()) {
        (Some(advertised), true) => advertised.clone(),
        _ => a.listen.to_string(),
    };
    let grpc = security.endpoint(&target)?;
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("vLLM exited while starting ({status}); its log is above");
        }
        let api_ready = match grpc.connect().await {
            Ok(channel) => inferscale_proto::worker_client::WorkerClient::new(channel)
                .health(inferscale_proto::HealthRequest {})
                .await
                .is_ok_and(|h| h.into_inner().ready),
            Err(_) => false,
        };
        // vLLM's server listens once its engine has loaded.
        if api_ready && vllm.model().await.is_ok() {
            return Ok(());
        }
        if started.elapsed() > limit {
            bail!("vLLM did not serve within {} s (--vllm-start-timeout-s)", limit.as_secs());
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Sends SIGTERM to `child` and waits up to 30 s, then kills it.
async fn stop(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        // SAFETY: signalling a child we spawned and have not yet reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    }
    if tokio::time::timeout(Duration::from_secs(30), child.wait()).await.is_err() {
        let _ = child.kill().await;
    }
}

fn python_exists(python: &str) -> bool {
    let p = Path::new(python);
    if p.components().count() > 1 {
        return p.is_file();
    }
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(python).is_file()))
}

/// Runs the worker with vLLM; `security` and `etcd` are the settings
/// `serve::worker` read and checked from `a`.
pub fn worker(a: WorkerCmd, security: Security, etcd: EtcdOptions) -> Result<()> {
    if a.listen.port() == 0 {
        bail!("--engine vllm: give --listen a port (vLLM's process binds it; 0 cannot be advertised)");
    }
    if a.http_listen.is_some() {
        bail!("--engine vllm: --http-listen is for native workers (vLLM serves its own /metrics on --vllm-port)");
    }
    if a.worker.audit_share > 0.0 {
        bail!(
            "--engine vllm: --audit-share is for native workers (the audit reruns requests in prompt mode on our engine)"
        );
    }
    if a.worker.mem.model.backend == "cpu" {
        eprintln!(
            "inferscale worker: warning: --backend cpu puts the connector's core on the CPU, which loads only into \
             a CPU vLLM's caches; for vLLM on a GPU give --backend cuda (else every memory is recomputed)"
        );
    }
    let args = vllm_command(&a)?;
    if a.vllm.print_vllm_command {
        let quoted: Vec<String> = args.iter().map(|s| shell_quote(s)).collect();
        println!("{} {}", a.vllm.vllm_python, quoted.join(" "));
        return Ok(());
    }
    if !python_exists(&a.vllm.vllm_python) {
        bail!("--vllm-python {}: not found (the Python with vLLM 0.26 and inferscale_vllm)", a.vllm.vllm_python);
    }
    runtime()?.block_on(async move {
        let tracing = inferscale_telemetry::init("inferscale-worker")?;
        let mut cmd = tokio::process::Command::new(&a.vllm.vllm_python);
        cmd.args(&args).stdin(Stdio::null()).kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe; it runs in the forked child
        // before exec and touches no memory of ours.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().with_context(|| format!("starting {} -m vllm", a.vllm.vllm_python))?;
        eprintln!("inferscale worker: started vLLM (pid {}), waiting for it to serve", child.id().unwrap_or(0));
        let ready = tokio::select! {
            r = wait_ready(&a, &security, &mut child) => r,
            _ = shutdown_signal() => Err(anyhow::anyhow!("shut down while vLLM was starting")),
        };
        if let Err(e) = ready {
            stop(&mut child).await;
            return Err(e);
        }
        eprintln!("inferscale worker: gRPC on {} (engine vllm, vLLM on 127.0.0.1:{})", a.listen, a.vllm.vllm_port);
        let reg = match a.cluster.etcd.is_empty() {
            true => None,
            false => {
                let addr = a.advertise.clone().unwrap_or_else(|| a.listen.to_string());
                let name = a.cluster.name.clone().unwrap_or_else(|| addr.clone());
                Some(register(connect_etcd(&etcd).await?, &a.cluster, name, addr, None).await?)
            }
        };
        let r = tokio::select! {
            status = child.wait() => match status {
                Ok(s) => Err(anyhow::anyhow!("vLLM exited ({s})")),
                Err(e) => Err(anyhow::anyhow!("waiting for vLLM: {e}")),
            },
            _ = shutdown_signal() => {
                stop(&mut child).await;
                Ok(())
            }
        };
        if let Some(reg) = reg {
            reg.leave().await;
        }
        tracing.shutdown().await;
        r
    })
}

/// `s` quoted for a POSIX shell when it needs to be.
fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_=./:,@".contains(&b));
    if plain { s.to_string() } else { format!("'{}'", s.replace('\'', r"'\''")) }
}
