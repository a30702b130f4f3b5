//! `inferscale loadtest` as a process against a real `inferscale serve`
//! (SmolLM2 on CPU, a temporary memory directory) on loopback: two
//! synthetic users, k = 5, both modes, a handful of requests; the JSON
//! report must hold sane numbers and the charts must be PNGs.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::process::Command;

use common::spawn;
use serde_json::Value;

#[test]
fn loadtest_against_a_real_server_writes_json_and_charts() {
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem");
    let srv = spawn(&["serve", "--listen", "127.0.0.1:0", "--memory", mem.to_str().unwrap()], "API on ");
    let json = dir.path().join("lt.json");
    let plots = dir.path().join("plots");
    let url = format!("http://{}", srv.addr);
    let out = Command::new(env!("CARGO_BIN_EXE_inferscale"))
        .args(["loadtest", "--url", &url, "--users", "2", "--k", "5", "--modes", "kv,prompt"])
        .args(["--requests", "4", "--duration-s", "60", "--max-tokens", "4", "--synthetic-facts", "8"])
        .args(["--json", json.to_str().unwrap(), "--plots", plots.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "loadtest failed: {stderr}");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("| mode | k | users |"), "no table on stdout: {table}");

    let report: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["target"]["url"], url.as_str());
    assert_eq!(report["ingest"]["users"], 2, "{report}");
    assert_eq!(report["ingest"]["added"], 16, "{report}");
    let points = report["points"].as_array().unwrap();
    let modes: Vec<&str> = points.iter().map(|p| p["mode"].as_str().unwrap()).collect();
    assert_eq!(modes, ["kv", "prompt"], "{report}");
    for p in points {
        assert_eq!((p["k"].as_u64(), p["users"].as_u64()), (Some(5), Some(2)), "{p}");
        assert!(p["requests"].as_u64().unwrap() > 0, "{p}");
        assert_eq!(p["errors"], 0, "{p}");
        let ttft = p["ttft_ms"]["p50"].as_f64().unwrap();
        let e2e = p["e2e_ms"]["p50"].as_f64().unwrap();
        assert!(ttft > 0.0 && ttft <= e2e, "TTFT p50 {ttft} vs e2e p50 {e2e}: {p}");
        assert!(p["requests_per_s"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["output_tokens"].as_u64().unwrap() > 0, "{p}");
    }
    // kv requests say where their facts' KV came from (the CPU backend
    // caches it on the device tier); prompt requests have nothing to say.
    let tiers = &points[0]["tiers"];
    let kv_facts = tiers["facts"]["device"].as_u64().unwrap();
    assert_eq!(kv_facts, 5 * points[0]["requests"].as_u64().unwrap(), "{tiers}");
    assert_eq!(tiers["hit_rate"].as_f64(), Some(1.0), "{tiers}");
    assert_eq!(tiers["classes"][0]["class"], "device", "{tiers}");
    assert!(points[1].get("tiers").is_none(), "{report}");
    for name in ["lt-ttft-vs-k.png", "lt-throughput-vs-users.png"] {
        let bytes = std::fs::read(plots.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{name} is not a PNG");
    }
}

/// Many users, few clients: three stored users, two clients each picking
/// the user of every request by popularity.
#[test]
fn loadtest_with_a_population_stores_every_user_and_asks_as_any() {
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem");
    let srv = spawn(&["serve", "--listen", "127.0.0.1:0", "--memory", mem.to_str().unwrap()], "API on ");
    let json = dir.path().join("pop.json");
    let url = format!("http://{}", srv.addr);
    let out = Command::new(env!("CARGO_BIN_EXE_inferscale"))
        .args(["loadtest", "--url", &url, "--users", "2", "--population", "3", "--zipf", "1.2", "--k", "3"])
        .args(["--modes", "kv", "--requests", "6", "--duration-s", "60", "--max-tokens", "2"])
        .args(["--synthetic-facts", "4", "--warmup", "0", "--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "loadtest failed: {stderr}");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("By where the facts' KV came from"), "{table}");

    let report: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["ingest"]["users"], 3, "{report}");
    assert_eq!(report["ingest"]["added"], 12, "{report}");
    assert_eq!(report["target"]["population"]["users"], 3, "{report}");
    let p = &report["points"][0];
    assert_eq!((p["users"].as_u64(), p["requests"].as_u64(), p["errors"].as_u64()), (Some(2), Some(6), Some(0)), "{p}");
    assert_eq!(p["tiers"]["facts"]["device"], 18, "six requests of three facts: {p}");
}
