//! The `inferscale` command as scripts use it: text on stdout only, clear
//! errors (naming the file, field or limit) with a non-zero exit.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

use std::process::{Command, Output};

fn inferscale(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_inferscale")).args(args).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn generate_prints_only_the_text() {
    let o = inferscale(&["generate", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "12"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    assert!(out.contains("Paris"), "{out:?}");
    assert!(!out.contains("inferscale:"), "logs leaked to stdout: {out:?}");
    assert!(stderr(&o).contains("TTFT"), "timings go to stderr");
}

/// README's first command answers from its facts in both modes: the cat
/// the stored fact names, with the same answer injected and pasted.
#[test]
fn the_demo_answers_from_the_stored_facts() {
    let o = inferscale(&["demo"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    let answer = |mode: &str| {
        let line = out.lines().find(|l| l.starts_with(&format!("[{mode:>6}]"))).unwrap_or_else(|| panic!("{out}"));
        line.split_once("answer: ").map(|(_, a)| a.to_string()).unwrap_or_default()
    };
    let (kv, prompt) = (answer("kv"), answer("prompt"));
    assert!(kv.contains("Miso"), "kv answered {kv:?}:\n{out}");
    assert_eq!(kv, prompt, "injected and pasted facts answer alike");
}

/// The same with the fp8 paged cache (`--kv-cache-dtype fp8`): calibrated
/// at load, said so in the load line, and the stored fact still answers.
#[test]
fn the_demo_answers_from_an_fp8_kv_cache() {
    let o = inferscale(&["demo", "--kv-cache-dtype", "fp8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("blocks (fp8)"), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    let kv = out.lines().find(|l| l.starts_with("[    kv]")).unwrap_or_else(|| panic!("{out}"));
    assert!(kv.contains("Miso"), "{out}");
}

#[test]
fn sampling_is_reproducible_with_a_seed() {
    let args = ["generate", "--prompt", "Once upon a time", "--max-tokens", "8", "--temperature", "0.9", "--seed", "7"];
    let (a, b) = (inferscale(&args), inferscale(&args));
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    let o = inferscale(&["generate", "--prompt", "hi", "--model", missing.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("nope.gguf"), "{}", stderr(&o));

    let corrupt = dir.path().join("corrupt.gguf");
    std::fs::write(&corrupt, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let o = inferscale(&["generate", "--prompt", "hi", "--model", corrupt.to_str().unwrap()]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("corrupt.gguf") && e.contains("truncated"), "{e}");

    let o = inferscale(&["generate", "--prompt", ""]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("empty"), "{}", stderr(&o));

    let long = "word ".repeat(9000);
    let o = inferscale(&["generate", "--prompt", &long, "--max-tokens", "1"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("context of 8192"), "{}", stderr(&o));

    let o = inferscale(&["generate", "--prompt", "hi", "--top-p", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("top_p"), "{}", stderr(&o));

    // Decode graphs are the CUDA backend's: asked for on the CPU, a clear
    // refusal (the default, `auto`, runs the CPU without them).
    let o = inferscale(&["generate", "--prompt", "hi", "--cuda-graphs", "on"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--cuda-graphs on: the cpu backend has no decode graphs"), "{}", stderr(&o));

    // Server settings out of range are refused at start, naming the flag,
    // not blamed on every client request later.
    for (flag, value) in
        [("--default-k", "0"), ("--default-k", "201"), ("--default-max-tokens", "0"), ("--default-blend-ratio", "1.5")]
    {
        let mem = dir.path().join("mem");
        let o = inferscale(&["serve", flag, value, "--listen", "127.0.0.1:0", "--memory", mem.to_str().unwrap()]);
        assert!(!o.status.success(), "{flag} {value} was accepted");
        assert!(stderr(&o).contains(flag), "{flag} {value}: {}", stderr(&o));
    }
}

#[test]
fn config_files_feed_the_serving_flags_and_bad_ones_name_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("router.env");
    // Without keys a router must stay on loopback: the refusal proves the
    // file's listen address (and its required worker list) were read.
    std::fs::write(&cfg, "# router\nINFERSCALE_WORKERS=127.0.0.1:1\nINFERSCALE_API_LISTEN=0.0.0.0:0\n").unwrap();
    let o = inferscale(&["router", "--config", cfg.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("loopback only"), "{}", stderr(&o));
    // A flag wins over the file.
    let o = Command::new(env!("CARGO_BIN_EXE_inferscale"))
        .args(["router", "--config", cfg.to_str().unwrap(), "--listen", "127.0.0.1:0", "--load-factor", "0.5"])
        .output()
        .unwrap();
    assert!(stderr(&o).contains("--load-factor"), "{}", stderr(&o));
    // The retired variable that set both the API's and a worker's address
    // is refused with its replacements named, not silently ignored.
    std::fs::write(&cfg, "INFERSCALE_WORKERS=127.0.0.1:1\nINFERSCALE_LISTEN=0.0.0.0:8080\n").unwrap();
    let o = inferscale(&["router", "--config", cfg.to_str().unwrap()]);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("INFERSCALE_API_LISTEN") && e.contains("INFERSCALE_GRPC_LISTEN"), "{e}");
    std::fs::write(&cfg, "INFERSCALE_WORKERS=127.0.0.1:1\nlisten 0.0.0.0\n").unwrap();
    let o = inferscale(&["router", "--config", cfg.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("router.env:2"), "{}", stderr(&o));
}

/// `bench ttft` end to end on the CPU: both modes at two k, the prompt
/// mode's prefill cut into several steps (`--max-batch-tokens`) before its
/// first token, and the JSON's token accounting: kv prefills only the
/// question, prompt the facts as well, both after the same cached header.
#[test]
fn bench_ttft_reports_both_modes_with_their_token_counts() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("ttft.json");
    let o = inferscale(&[
        "bench",
        "ttft",
        "--shape",
        "smollm2-135m",
        "--random-weights",
        "--k",
        "1,3",
        "--reps",
        "2",
        "--header-tokens",
        "12",
        "--fact-tokens",
        "9",
        "--question-tokens",
        "5",
        "--max-batch-tokens",
        "8",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = report["results"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{report}");
    for row in rows {
        let (k, mode) = (row["k"].as_u64().unwrap(), row["mode"].as_str().unwrap());
        assert_eq!(row["prompt_tokens"].as_u64(), Some(12 + 9 * k + 5), "{row}");
        let prefilled = if mode == "kv" { 5 } else { 9 * k + 5 };
        assert_eq!(row["prefilled_tokens"].as_u64(), Some(prefilled), "{row}");
        assert!(row["ttft_ms_median"].as_f64().unwrap() > 0.0, "{row}");
        assert_eq!(row["inject_ms_median"].is_f64(), mode == "kv", "{row}");
    }
}

/// `bench engine` on the CPU: prefill and decode rows as asked, each decode
/// row with every timed repetition's step time beside their median (an
/// untimed pass per batch size runs first, so no repetition carries a
/// batch size's one-time costs).
#[test]
fn bench_engine_reports_each_repetition_of_each_batch() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("engine.json");
    let flags = "bench engine --shape smollm2-135m --random-weights --prompt-tokens 8 --decode-batch 1,2 \
                 --decode-prompt-tokens 6 --decode-tokens 3 --reps 2 --gemm-n 64 --json";
    let mut args: Vec<&str> = flags.split_whitespace().collect();
    args.push(json.to_str().unwrap());
    let o = inferscale(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["prefill"]["tokens"].as_u64(), Some(8), "{report}");
    let rows = report["decode"].as_array().unwrap();
    let batches: Vec<u64> = rows.iter().map(|r| r["batch"].as_u64().unwrap()).collect();
    assert_eq!(batches, [1, 2], "{report}");
    for r in rows {
        assert_eq!((r["prompt_tokens"].as_u64(), r["new_tokens"].as_u64()), (Some(6), Some(3)), "{r}");
        let reps: Vec<f64> = r["ms_per_step_reps"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(reps.len(), 2, "{r}");
        let ms = r["ms_per_step"].as_f64().unwrap();
        let (lo, hi) = (reps.iter().copied().fold(f64::INFINITY, f64::min), reps.iter().copied().fold(0.0, f64::max));
        assert!(lo > 0.0 && lo <= ms * (1.0 + 1e-9) && ms <= hi * (1.0 + 1e-9), "median {ms} outside {reps:?}: {r}");
    }
}

/// `bench serve --audit-shares 0,1 --rounds 2` on the CPU: four points on
/// one worker, in order; a share-0 point audits nothing, a share-1 point
/// audits or skips every kv request it sent (each one is sampled) and
/// has run its audits before the next point starts.
#[test]
fn bench_serve_measures_each_audit_share_on_one_worker() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("serve.json");
    let o = inferscale(&[
        "bench",
        "serve",
        "--users",
        "2",
        "--modes",
        "kv",
        "--k",
        "2",
        "--memory-users",
        "1",
        "--facts-per-user",
        "2",
        "--max-tokens",
        "2",
        "--warmup-s",
        "0",
        "--duration-s",
        "2",
        "--audit-shares",
        "0,1",
        "--rounds",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let points = report["results"].as_array().unwrap();
    let order: Vec<(u64, f64)> =
        points.iter().map(|p| (p["round"].as_u64().unwrap(), p["audit_share"].as_f64().unwrap())).collect();
    assert_eq!(order, [(0, 0.0), (0, 1.0), (1, 0.0), (1, 1.0)], "{report}");
    for p in points {
        let (requests, audited, skipped) =
            (p["requests"].as_u64().unwrap(), p["audited"].as_u64().unwrap(), p["audits_skipped"].as_u64().unwrap());
        assert!(requests > 0, "{p}");
        if p["audit_share"].as_f64() == Some(0.0) {
            assert_eq!((audited, skipped), (0, 0), "share 0 audits nothing: {p}");
        } else {
            assert!(audited >= 1 && audited + skipped >= requests, "share 1 samples every kv request: {p}");
        }
    }
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("÷ first"), "the by-share summary is printed: {out}");
    // Shares outside 0..=1 are refused before the model loads.
    let o = inferscale(&["bench", "serve", "--audit-shares", "0,2"]);
    assert!(!o.status.success() && stderr(&o).contains("--audit-shares"), "{}", stderr(&o));
}

#[test]
fn worker_engine_vllm_configures_vllm_with_the_connector_and_refuses_what_it_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("memory");
    let home = dir.path().join("home");
    let run = |extra: &[&str]| {
        let mut args =
            vec!["worker", "--engine", "vllm", "--memory", mem.to_str().unwrap(), "--listen", "127.0.0.1:50071"];
        args.extend_from_slice(extra);
        Command::new(env!("CARGO_BIN_EXE_inferscale")).args(&args).env("INFERSCALE_HOME", &home).output().unwrap()
    };
    let o = run(&[
        "--shape",
        "llama3.1-8b",
        "--random-weights",
        "--backend",
        "cuda",
        "--window",
        "0",
        "--vllm-port",
        "8123",
        "--vllm-arg=--gpu-memory-utilization=0.8",
        "--retriever=dense",
        "--instruction=Briefly:",
        "--print-vllm-command",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let line = String::from_utf8(o.stdout).unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(&words[..4], ["python3", "-m", "vllm.entrypoints.cli.main", "serve"]);
    // The shape's config for vLLM's dummy weights, written under the home.
    let model = std::path::Path::new(words[4]);
    assert!(model.starts_with(&home), "{line}");
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(model.join("config.json")).unwrap()).unwrap();
    assert_eq!((config["num_hidden_layers"].as_u64(), config["num_key_value_heads"].as_u64()), (Some(32), Some(8)));
    assert!(words.contains(&"--load-format=dummy") && words.contains(&"--port=8123"), "{line}");
    assert!(words.last() == Some(&"--gpu-memory-utilization=0.8"), "extra vLLM arguments come last: {line}");
    let transfer = words.iter().find_map(|w| w.strip_prefix("'--kv-transfer-config=")).unwrap();
    let transfer: serde_json::Value = serde_json::from_str(transfer.trim_end_matches('\'')).unwrap();
    assert_eq!(transfer["kv_connector_module_path"], "inferscale_vllm.connector");
    assert_eq!(transfer["kv_load_failure_policy"], "recompute");
    let extra = &transfer["kv_connector_extra_config"];
    assert_eq!(extra["grpc_listen"], "127.0.0.1:50071");
    assert_eq!(extra["vllm_url"], "http://127.0.0.1:8123");
    assert_eq!((extra["random_shape"].as_str(), extra["window"].as_u64()), (Some("llama3.1-8b"), Some(0)));
    assert_eq!(extra["memory_dir"], mem.to_str().unwrap());
    // How facts are found and the words around them reach the connector; the
    // default system prompt is the connector's default too, so it stays out.
    assert_eq!((extra["retriever"].as_str(), extra["instruction"].as_str()), (Some("dense"), Some("Briefly:")));
    assert!(extra.get("system_prompt").is_none(), "{extra}");

    let o = run(&[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--vllm-model"), "{}", stderr(&o));
    let o = run(&["--vllm-model", "x", "--vllm-python", "/nonexistent/python3"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/nonexistent/python3: not found"), "{}", stderr(&o));
    let o = run(&["--vllm-model", "x", "--http-listen", "127.0.0.1:9100"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--http-listen"), "{}", stderr(&o));
    let o = run(&["--vllm-model", "x", "--audit-share", "0.01"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--audit-share is for native workers"), "{}", stderr(&o));
}
