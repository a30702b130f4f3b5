//! One metrics vocabulary for router and worker: after a request, both
//! `/metrics` endpoints follow Prometheus' naming conventions, name the
//! worker's load the same way with the same types, carry `build_info` and
//! the `process_*` metrics, and every query of the Grafana dashboard in
//! deploy/grafana names a metric one of them serves.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{http, json_call, spawn};
use serde_json::json;

/// Metric families of an exposition: name → type, checked as they are read.
fn families(text: &str, what: &str) -> BTreeMap<String, String> {
    let mut types = BTreeMap::new();
    let mut helped = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            assert!(helped.insert(name.to_string()), "{what}: {name} has two HELP lines");
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(types.insert(name.to_string(), kind.to_string()).is_none(), "{what}: {name} declared twice");
        } else if !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| types.get(*f).is_some_and(|k| k == "histogram")))
                .unwrap_or(name);
            assert!(types.contains_key(family), "{what}: sample {name} has no TYPE line before it");
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{what}: {line:?} has no numeric value");
        }
    }
    for (name, kind) in &types {
        assert!(helped.contains(name), "{what}: {name} has no HELP");
        assert!(
            name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "{what}: {name} is not snake_case"
        );
        assert!(name.starts_with("inferscale_") || name.starts_with("process_"), "{what}: {name} has no namespace");
        match kind.as_str() {
            "counter" => assert!(name.ends_with("_total"), "{what}: counter {name} must end in _total"),
            "gauge" | "histogram" => {
                assert!(!name.ends_with("_total"), "{what}: {kind} {name} must not end in _total (only counters)")
            }
            other => panic!("{what}: {name} has type {other}"),
        }
        if kind == "histogram" {
            let units = ["_seconds", "_rows", "_tokens", "_nats"];
            assert!(units.iter().any(|u| name.ends_with(u)), "{what}: histogram {name} does not name its unit");
        }
        // A quantity with a unit names it: bytes and seconds, never ms or kb.
        for bad in ["_ms", "_milliseconds", "_kb", "_mb", "_percent"] {
            assert!(!name.contains(bad), "{what}: {name}: use base units (seconds, bytes, ratio)");
        }
    }
    types
}

/// Metric names in a PromQL expression (identifiers that start with our
/// namespaces or `process_`).
fn names_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            cur.push(c);
        } else {
            if cur.starts_with("inferscale_") || cur.starts_with("process_") {
                out.push(std::mem::take(&mut cur));
            }
            cur.clear();
        }
    }
    out
}

#[test]
fn router_and_worker_metrics_share_one_vocabulary_and_the_dashboard_renders_against_them() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let worker_http = format!("127.0.0.1:{port}");
    let mem = dir.path().join("mem");
    let args =
        ["serve", "--listen", "127.0.0.1:0", "--worker-http-listen", &worker_http, "--memory", mem.to_str().unwrap()];
    let s = spawn(&args, "API on ");
    let turns = json!({"user": "u1", "turns": [
        {"id": "D1:1", "speaker": "Caroline", "text": "I adopted a grey cat named Miso.", "time": "8 May 2023"}]});
    assert_eq!(json_call(&s.addr, "POST", "/v1/memories", &turns).0, 200);
    let chat = json!({"model": "smollm2", "user": "u1", "max_tokens": 4, "temperature": 0,
                      "messages": [{"role": "user", "content": "What is the cat's name?"}]});
    assert_eq!(json_call(&s.addr, "POST", "/v1/chat/completions", &chat).0, 200);

    let text = |addr: &str| String::from_utf8(http(addr, "GET", "/metrics", b"").2).unwrap();
    // The router mirrors the worker's load from Stats calls made every
    // second: wait for one made after the request.
    let finished = "inferscale_worker_requests_total{worker=\"local\",status=\"finished\"} 1\n";
    let t0 = std::time::Instant::now();
    let mut router_text = text(&s.addr);
    while !router_text.contains(finished) {
        assert!(t0.elapsed() < std::time::Duration::from_secs(15), "no Stats after the request: {router_text}");
        std::thread::sleep(std::time::Duration::from_millis(200));
        router_text = text(&s.addr);
    }
    let worker_text = text(&worker_http);
    let router = families(&router_text, "router");
    let worker = families(&worker_text, "worker");

    // The same name means the same thing, and is typed the same, on both.
    for (name, kind) in &router {
        if let Some(w) = worker.get(name) {
            assert_eq!(w, kind, "{name} is a {kind} on the router and a {w} on the worker");
        }
    }
    for name in [
        "inferscale_worker_requests_waiting",
        "inferscale_worker_requests_running",
        "inferscale_worker_kv_blocks",
        "inferscale_worker_kv_blocks_free",
        "inferscale_worker_users",
        "inferscale_worker_memory_units",
        "inferscale_worker_requests_total",
    ] {
        assert!(router.contains_key(name) && worker.contains_key(name), "{name} on both");
    }
    for (what, t, prefix) in [("router", &router_text, "inferscale_"), ("worker", &worker_text, "inferscale_worker_")] {
        let value = |key: &str| {
            t.lines()
                .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(' ')))
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{what}: no {key}"))
        };
        assert_eq!(value(&format!("{prefix}e2e_request_latency_seconds_count{{mode=\"kv\"}}")), 1.0, "{what}");
        assert!(value(&format!("{prefix}prompt_tokens_total")) > 0.0, "{what}");
        assert!(value("process_resident_memory_bytes") > 0.0, "{what}");
        assert!(t.contains("inferscale_build_info{component="), "{what}");
    }
    assert!(router_text.contains("inferscale_worker_memory_units{worker=\"local\"} 1\n"), "{router_text}");
    assert!(worker_text.contains("inferscale_worker_memory_units 1\n"), "{worker_text}");

    // Every dashboard query names metrics that exist.
    let path = common::manifest_dir().join("../../deploy/grafana/inferscale.json");
    let dash: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let served: BTreeSet<&String> = router.keys().chain(worker.keys()).collect();
    let mut queries = 0;
    for panel in dash["panels"].as_array().unwrap() {
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {} has no query", panel["title"]);
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            let names = names_in(expr);
            assert!(!names.is_empty(), "{expr}: names no metric");
            for n in names {
                let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| n.strip_suffix(s)).unwrap_or(&n);
                let known = served.contains(&n) || served.contains(&family.to_string());
                assert!(known, "dashboard panel {}: {n} is served by neither router nor worker", panel["title"]);
                queries += 1;
            }
        }
    }
    assert!(queries >= 20, "{queries} metric references in the dashboard");
}

/// The answer-quality audit (`--audit-share 1`: every kv and blend request):
/// each request's first-token distribution against prompt mode's for the
/// same facts, computed after it. Blend at ratio 1 recomputes every
/// injected token with the question, which is prompt mode's prefill: its
/// audits find KL ≈ 0 and the same greedy token. kv mode's facts were
/// encoded apart: its audits find a larger KL. Plain chats (no memory)
/// are not audited.
#[test]
fn audits_compare_served_first_tokens_with_prompt_mode() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let worker_http = format!("127.0.0.1:{port}");
    let mem = dir.path().join("mem");
    let mem = mem.to_str().unwrap();
    let args = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker-http-listen",
        &worker_http,
        "--memory",
        mem,
        "--audit-share",
        "1",
    ];
    let s = spawn(&args, "API on ");
    let turns = json!({"user": "u1", "turns": [
        {"id": "D1:1", "speaker": "Caroline", "text": "I adopted a grey cat named Miso last week.", "time": "8 May 2023"},
        {"id": "D1:2", "speaker": "Melanie", "text": "I ran a charity race for mental health on Saturday.", "time": "8 May 2023"},
        {"id": "D1:3", "speaker": "Caroline", "text": "I am moving to Lisbon to study counselling.", "time": "9 May 2023"},
        {"id": "D1:4", "speaker": "Melanie", "text": "My kids and I went camping by the lake.", "time": "9 May 2023"}]});
    assert_eq!(json_call(&s.addr, "POST", "/v1/memories", &turns).0, 200);
    let ask = |question: &str, memory: serde_json::Value| {
        let chat = json!({"model": "smollm2", "user": "u1", "max_tokens": 2, "temperature": 0, "memory": memory,
                          "messages": [{"role": "user", "content": question}]});
        let (status, v) = json_call(&s.addr, "POST", "/v1/chat/completions", &chat);
        assert_eq!(status, 200, "{v}");
    };
    let questions = ["What is the cat's name?", "Where is Caroline moving?", "What did Melanie run?"];
    for q in questions {
        ask(q, json!({"mode": "kv", "k": 4}));
        ask(q, json!({"mode": "blend", "k": 4, "blend_ratio": 1.0}));
        ask(q, json!({"mode": "prompt", "k": 4}));
        ask(q, json!({"mode": "none"}));
    }
    let value = |t: &str, key: &str| {
        t.lines()
            .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(' ')))
            .and_then(|v| v.parse::<f64>().ok())
    };
    let count = |t: &str, mode: &str| value(t, &format!("inferscale_worker_audit_kl_nats_count{{mode=\"{mode}\"}}"));
    // Audits run when the engine is idle: wait for all six.
    let t0 = std::time::Instant::now();
    let text = loop {
        let t = String::from_utf8(http(&worker_http, "GET", "/metrics", b"").2).unwrap();
        if count(&t, "kv") == Some(3.0) && count(&t, "blend") == Some(3.0) {
            break t;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(60), "audits not done: {t}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let sum = |mode: &str| value(&text, &format!("inferscale_worker_audit_kl_nats_sum{{mode=\"{mode}\"}}")).unwrap();
    let agreed =
        |mode: &str| value(&text, &format!("inferscale_worker_audit_top1_agreed_total{{mode=\"{mode}\"}}")).unwrap();
    let (blend_kl, kv_kl) = (sum("blend") / 3.0, sum("kv") / 3.0);
    eprintln!("audits: kv mean KL {kv_kl:.4}, {} of 3 agreed; blend r=1 mean KL {blend_kl:.1e}", agreed("kv"));
    assert!(blend_kl < 1e-4, "blend at ratio 1 is prompt mode: mean KL {blend_kl}");
    assert_eq!(agreed("blend"), 3.0, "blend at ratio 1 is prompt mode: greedy tokens agree");
    assert!(
        kv_kl > 1e-3 && kv_kl > 100.0 * blend_kl,
        "kv mode's injected facts differ from prompt mode's: mean KL {kv_kl}"
    );
    assert_eq!(value(&text, "inferscale_worker_audits_skipped_total"), Some(0.0));
    // Prompt and none requests are not audited.
    for mode in ["prompt", "none"] {
        assert_eq!(count(&text, mode), None, "{mode} requests are not audited");
    }
    families(&text, "worker");
}
