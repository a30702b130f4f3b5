//! The serving processes end to end over real loopback HTTP and gRPC:
//! `inferscale serve` (router + worker in one process) and `inferscale
//! router` in front of two `inferscale worker` processes, all on SmolLM2.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Proc, http, http_as, json_call, mem0_path, python_path, spawn};
use serde_json::{Value, json};

fn serve(mem: &Path, extra: &[&str]) -> Proc {
    let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--memory", mem.to_str().unwrap()];
    args.extend_from_slice(extra);
    spawn(&args, "API on ")
}

/// Asserts a 4xx answer with an OpenAI-style error whose message contains `needle`.
fn assert_error(what: &str, (status, body): (u16, Vec<u8>), want: u16, needle: &str) {
    let v: Value = serde_json::from_slice(&body).unwrap_or_else(|_| panic!("{what}: body is not JSON: {body:?}"));
    let msg = v["error"]["message"].as_str().unwrap_or_else(|| panic!("{what}: no error.message in {v}"));
    assert_eq!(status, want, "{what}: {msg}");
    assert!(msg.to_lowercase().contains(&needle.to_lowercase()), "{what}: message {msg:?} lacks {needle:?}");
}

fn post(addr: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let (s, _, b) = http(addr, "POST", path, body);
    (s, b)
}

fn chat(user: Option<&str>, question: &str, memory: Value) -> Value {
    let mut v = json!({"model": "smollm2", "messages": [{"role": "user", "content": question}],
                       "max_tokens": 8, "temperature": 0, "memory": memory});
    if let Some(u) = user {
        v["user"] = json!(u);
    }
    v
}

const TURNS: &str = r#"{"user": "u1", "turns": [
  {"id": "D1:1", "speaker": "Caroline", "text": "I adopted a grey cat named Miso last week.", "time": "1:56 pm on 8 May, 2023"},
  {"id": "D1:2", "speaker": "Melanie", "text": "I ran a charity race for mental health on Saturday.", "time": "1:56 pm on 8 May, 2023"}]}"#;

fn units(addr: &str, user: &str) -> Value {
    let (status, v) = json_call(addr, "GET", &format!("/v1/memories/{user}"), &Value::Null);
    assert_eq!(status, 200, "{v}");
    v["units"].clone()
}

#[test]
fn bad_http_input_gets_clear_errors_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let srv = serve(&dir.path().join("mem"), &["--window", "2"]);
    let a = srv.addr.as_str();
    let (status, v) = json_call(a, "POST", "/v1/memories", &serde_json::from_str(TURNS).unwrap());
    assert_eq!((status, v["added"].as_u64()), (200, Some(2)), "{v}");
    let before = units(a, "u1");
    assert_eq!(before.as_array().map(Vec::len), Some(2));

    let c = "/v1/chat/completions";
    assert_error("malformed JSON", post(a, c, b"{\"model\": "), 400, "invalid JSON");
    let mut wrong = chat(Some("u1"), "Hi?", json!({}));
    wrong["max_tokens"] = json!("ten");
    assert_error("wrong type", post(a, c, wrong.to_string().as_bytes()), 400, "max_tokens");
    let mut unknown = chat(Some("u1"), "Hi?", json!({}));
    unknown["model"] = json!("gpt-9");
    assert_error("unknown model", post(a, c, unknown.to_string().as_bytes()), 404, "gpt-9");
    let no_user = chat(None, "Hi?", json!({"mode": "kv"}));
    assert_error("missing user", post(a, c, no_user.to_string().as_bytes()), 400, "user");
    let huge_k = chat(Some("u1"), "Hi?", json!({"k": 1_000_000_000u64}));
    assert_error("k = 1e9", post(a, c, huge_k.to_string().as_bytes()), 400, "memory.k");
    let neg = chat(Some("u1"), "Hi?", json!({"window": -1}));
    assert_error("negative window", post(a, c, neg.to_string().as_bytes()), 400, "window");
    let other_window = chat(Some("u1"), "Hi?", json!({"window": 7}));
    assert_error("other window", post(a, c, other_window.to_string().as_bytes()), 400, "window");
    let bad_mode = chat(Some("u1"), "Hi?", json!({"mode": "magic"}));
    assert_error("bad mode", post(a, c, bad_mode.to_string().as_bytes()), 400, "memory.mode");
    let bad_ratio = chat(Some("u1"), "Hi?", json!({"mode": "blend", "blend_ratio": 1.5}));
    assert_error(
        "blend ratio 1.5",
        post(a, c, bad_ratio.to_string().as_bytes()),
        400,
        "`memory.blend_ratio`: 1.5 is outside 0..=1",
    );
    let stray_ratio = chat(Some("u1"), "Hi?", json!({"mode": "kv", "blend_ratio": 0.2}));
    assert_error(
        "blend ratio in kv mode",
        post(a, c, stray_ratio.to_string().as_bytes()),
        400,
        "applies to memory.mode \"blend\"",
    );
    let bad_select = chat(Some("u1"), "Hi?", json!({"mode": "blend", "blend_select": "magic"}));
    assert_error(
        "bad blend selection",
        post(a, c, bad_select.to_string().as_bytes()),
        400,
        "`memory.blend_select`: \"magic\" is not a blend selection (deviation, question or fact_starts)",
    );
    let stray_select = chat(Some("u1"), "Hi?", json!({"mode": "prompt", "blend_select": "question"}));
    assert_error(
        "blend selection in prompt mode",
        post(a, c, stray_select.to_string().as_bytes()),
        400,
        "blend_select",
    );
    let mut utf8 = chat(Some("u1"), "Hi?", json!({})).to_string().into_bytes();
    let at = utf8.windows(3).position(|w| w == b"Hi?").unwrap();
    utf8[at] = 0xff;
    assert_error("invalid UTF-8", post(a, c, &utf8), 400, "UTF-8");
    let big = format!("{{\"model\": \"smollm2\", \"pad\": \"{}\"}}", "x".repeat(10 << 20));
    assert_error("10 MB body", post(a, c, big.as_bytes()), 413, "limit");
    let assistant_last = json!({"model": "smollm2", "user": "u1", "messages": [{"role": "assistant", "content": "x"}]});
    assert_error("assistant last", post(a, c, assistant_last.to_string().as_bytes()), 400, "must be the user's");
    let mut tools = chat(Some("u1"), "Hi?", json!({}));
    tools["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
    let refused = post(a, c, tools.to_string().as_bytes());
    assert_eq!(serde_json::from_slice::<Value>(&refused.1).unwrap()["error"]["param"], "tools");
    assert_error("tools", refused, 400, "`tools` is not supported");
    let tool_role =
        json!({"model": "smollm2", "messages": [{"role": "tool", "content": "x"}, {"role": "user", "content": "Hi?"}]});
    assert_error("tool message", post(a, c, tool_role.to_string().as_bytes()), 400, "messages[0].role");
    let cmpl = "/v1/completions";
    let empty = json!({"model": "smollm2", "prompt": "  "});
    assert_error("empty prompt", post(a, cmpl, empty.to_string().as_bytes()), 400, "prompt");
    let ids = json!({"model": "smollm2", "prompt": [1, 2, 3]});
    assert_error("token-id prompt", post(a, cmpl, ids.to_string().as_bytes()), 400, "token ids");
    let two = json!({"model": "smollm2", "prompt": ["a", "b"]});
    assert_error("two prompts", post(a, cmpl, two.to_string().as_bytes()), 400, "one prompt");
    let emb = "/v1/embeddings";
    let none = json!({"model": "minilm", "input": []});
    assert_error("no input", post(a, emb, none.to_string().as_bytes()), 400, "empty");
    let blank = json!({"model": "minilm", "input": ["fine", ""]});
    assert_error("blank input", post(a, emb, blank.to_string().as_bytes()), 400, "input[1]");
    let dims = json!({"model": "minilm", "input": "x", "dimensions": 64});
    assert_error("dimensions", post(a, emb, dims.to_string().as_bytes()), 400, "384 dimensions");
    let format = json!({"model": "minilm", "input": "x", "encoding_format": "hex"});
    assert_error("encoding format", post(a, emb, format.to_string().as_bytes()), 400, "encoding_format");

    // Memory endpoints.
    let m = "/v1/memories";
    assert_error("ingest malformed", post(a, m, b"[1,2"), 400, "invalid JSON");
    let bad_unit = json!({"user": "u1", "turns": [{"id": "D9:1", "text": "fine"}, {"id": "D9:2", "text": "  "}]});
    assert_error("empty text", post(a, m, bad_unit.to_string().as_bytes()), 400, "empty");
    let dup = json!({"user": "u1", "turns": [{"id": "D9:1", "text": "a"}, {"id": "D9:1", "text": "b"}]});
    assert_error("duplicate ids", post(a, m, dup.to_string().as_bytes()), 400, "twice");
    let neg_window = json!({"user": "u1", "window": -3, "turns": [{"id": "D9:1", "text": "a"}]});
    assert_error("ingest negative window", post(a, m, neg_window.to_string().as_bytes()), 400, "window");
    let other = json!({"user": "u1", "window": 5, "turns": [{"id": "D9:1", "text": "a"}]});
    assert_error("ingest other window", post(a, m, other.to_string().as_bytes()), 400, "window");
    let no_source = json!({"user": "u1", "facts": [{"id": "F1", "text": "a fact"}]});
    assert_error("fact without source", post(a, m, no_source.to_string().as_bytes()), 400, "source_turn");
    // A unit too long to encode and store: refused whole, naming it (it
    // used to be stored and then break every kv chat of its user).
    let long = json!({"user": "u1", "turns": [{"id": "D9:1", "text": "fine"}, {"id": "D9:2", "text": "banana ".repeat(9000)}]});
    assert_error("oversized unit", post(a, m, long.to_string().as_bytes()), 400, "\"D9:2\" is");
    let nul = json!({"user": "u1", "turns": [{"id": "D9:\u{0}1", "text": "a"}]});
    assert_error("control character in an id", post(a, m, nul.to_string().as_bytes()), 400, "control characters");
    let many: Vec<_> = (0..2001).map(|i| json!({"id": format!("M{i}"), "text": "a"})).collect();
    let many = json!({"user": "u1", "turns": many});
    assert_error("2,001 units", post(a, m, many.to_string().as_bytes()), 400, "the limit is 2000");
    let (s, _, b) = http(a, "GET", "/v1/memories/nobody", b"");
    assert_error("list unknown user", (s, b), 404, "nobody");
    let (s, _, b) = http(a, "DELETE", "/v1/memories/nobody", b"");
    assert_error("forget unknown user", (s, b), 404, "nobody");
    let (s, _, b) = http(a, "DELETE", "/v1/memories/u1/D7:7", b"");
    assert_error("forget unknown unit", (s, b), 404, "D7:7");
    let (s, _, b) = http(a, "GET", "/v1/nothing-here", b"");
    assert_error("unknown endpoint", (s, b), 404, "endpoint");
    // Every error has the JSON shape, the router's own rejections too.
    let (s, _, b) = http(a, "PUT", "/v1/memories", b"");
    assert_error("wrong method", (s, b), 405, "does not take PUT");
    let (s, _, b) = http(a, "GET", "/v1/memories/%FF", b"");
    assert_error("invalid UTF-8 in the path", (s, b), 400, "invalid path");

    assert_eq!(units(a, "u1"), before, "bad input changed stored memory");

    // A request without a user or a memory mode is answered without memory.
    let (status, v) = json_call(a, "POST", c, &chat(None, "Hi?", Value::Null));
    assert_eq!((status, v["usage"]["memory"]["mode"].as_str()), (200, Some("none")), "{v}");
    // A user without memory is answered with none injected, and usage says so.
    let (status, v) = json_call(a, "POST", c, &chat(Some("newcomer"), "What is my cat's name?", json!({"mode": "kv"})));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["memory"]["facts"], json!(0), "{v}");
    assert_eq!(v["usage"]["memory"]["injected_tokens"], json!(0), "{v}");
    // And one with memory gets its facts, counted honestly.
    let (status, v) =
        json_call(a, "POST", c, &chat(Some("u1"), "What is the name of Caroline's cat?", json!({"k": 2})));
    assert_eq!(status, 200, "{v}");
    let u = &v["usage"];
    assert_eq!(u["memory"]["facts"], json!(2), "{v}");
    let injected = u["memory"]["injected_tokens"].as_u64().unwrap();
    assert!(injected > 20, "{v}");
    assert!(u["prompt_tokens"].as_u64().unwrap() > injected, "{v}");
    assert!(v["choices"][0]["message"]["content"].as_str().unwrap().contains("Miso"), "{v}");
    // Blend: the same facts injected, a share recomputed, and usage says
    // how many; all of them at ratio 1 (nothing is then taken from cache).
    let (status, v) = json_call(
        a,
        "POST",
        c,
        &chat(Some("u1"), "What is the name of Caroline's cat?", json!({"k": 2, "mode": "blend", "blend_ratio": 0.25})),
    );
    assert_eq!(status, 200, "{v}");
    let m = &v["usage"]["memory"];
    assert_eq!((m["mode"].as_str(), m["injected_tokens"].as_u64()), (Some("blend"), Some(injected)), "{v}");
    let recomputed = m["recomputed_tokens"].as_u64().unwrap();
    assert!(recomputed >= injected / 4 && recomputed < injected / 2, "{v}");
    // The same share chosen by the question's attention: as many tokens.
    let ask = json!({"k": 2, "mode": "blend", "blend_ratio": 0.25, "blend_select": "question"});
    let (status, v) = json_call(a, "POST", c, &chat(Some("u1"), "What is the name of Caroline's cat?", ask));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["memory"]["recomputed_tokens"].as_u64(), Some(recomputed), "{v}");
    let (status, v) = json_call(
        a,
        "POST",
        c,
        &chat(Some("u1"), "What is the name of Caroline's cat?", json!({"k": 2, "mode": "blend", "blend_ratio": 1.0})),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["memory"]["recomputed_tokens"].as_u64(), Some(injected), "{v}");
    let uncached = v["usage"]["prompt_tokens"].as_u64().unwrap()
        - v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(uncached > injected, "recomputed tokens are not cached: {v}");
    let metrics = String::from_utf8_lossy(&http(a, "GET", "/metrics", b"").2).to_string();
    assert!(metrics.contains("inferscale_ttft_seconds_count{mode=\"blend\"} 3"), "{metrics}");

    // Forgetting one unit, then the user, is visible at once.
    let (s, _, _) = http(a, "DELETE", "/v1/memories/u1/D1:2", b"");
    assert_eq!(s, 200);
    assert_eq!(units(a, "u1").as_array().map(Vec::len), Some(1));
    let (s, _, _) = http(a, "DELETE", "/v1/memories/u1", b"");
    assert_eq!(s, 200);
    let (s, _, _) = http(a, "GET", "/v1/memories/u1", b"");
    assert_eq!(s, 404);
}

#[test]
fn api_keys_authenticate_and_tenants_are_isolated() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# tenant:key\nacme:sk-acme-0001\nbeta:sk-beta-0002\n").unwrap();
    let srv = serve(&dir.path().join("mem"), &["--window", "2", "--api-keys", keys.to_str().unwrap()]);
    let a = srv.addr.as_str();
    let (s, _, b) = http_as(None, a, "POST", "/v1/memories", TURNS.as_bytes());
    assert_error("no key", (s, b), 401, "missing API key");
    let (s, _, b) = http_as(Some("sk-wrong-9999"), a, "GET", "/v1/models", b"");
    assert_error("wrong key", (s, b), 401, "invalid API key");
    let (s, _, b) = http_as(Some("sk-acme-0001"), a, "POST", "/v1/memories", TURNS.as_bytes());
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let (s, _, b) = http_as(Some("sk-acme-0001"), a, "GET", "/v1/memories/u1", b"");
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    // Another tenant's `u1` is another user: acme's memory is out of reach.
    let (s, _, b) = http_as(Some("sk-beta-0002"), a, "GET", "/v1/memories/u1", b"");
    assert_error("other tenant", (s, b), 404, "unknown user `u1`");
    let (s, _, b) = http_as(Some("sk-beta-0002"), a, "DELETE", "/v1/memories/u1", b"");
    assert_error("other tenant delete", (s, b), 404, "unknown user");
    let body = chat(Some("u1"), "What is the name of Caroline's cat?", json!({"k": 2})).to_string();
    let (s, _, b) = http_as(Some("sk-beta-0002"), a, "POST", "/v1/chat/completions", body.as_bytes());
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!((s, &v["usage"]["memory"]["facts"]), (200, &json!(0)), "{v}");
    let (s, _, b) = http_as(Some("sk-acme-0001"), a, "GET", "/v1/memories/u1", b"");
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!((s, v["count"].as_u64()), (200, Some(2)), "{v}");
}

#[test]
fn openai_python_client_works_unchanged() {
    let py = python_path();
    assert!(
        py.join("openai").is_dir(),
        "the `openai` package is not in {}: run scripts/test.sh, which installs it",
        py.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "py:py-secret-key\n").unwrap();
    let srv = serve(
        &dir.path().join("mem"),
        &["--window", "2", "--api-keys", keys.to_str().unwrap(), "--max-running", "1", "--max-queue", "1"],
    );
    let script = common::manifest_dir().join("tests/openai_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}/v1", srv.addr))
        .arg("py-secret-key")
        .env("PYTHONPATH", &py)
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "openai client script failed:\n{}", String::from_utf8_lossy(&out.stderr));
}

/// Mem0's own Python client (`mem0ai`'s `MemoryClient`), pointed at
/// `inferscale serve` by its `host`: add → list with filters and pages →
/// search with filters → get → update → history → delete → delete_all
/// (twice) → list, in Mem0's shapes (crates/cli/tests/mem0_client.py).
#[test]
fn mem0_python_client_works_by_changing_the_host() {
    let py = mem0_path();
    assert!(
        py.join("mem0").is_dir(),
        "the `mem0ai` package is not in {}: run scripts/test.sh, which installs it",
        py.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "acme:m0-secret-key\n").unwrap();
    let srv = serve(&dir.path().join("mem"), &["--api-keys", keys.to_str().unwrap()]);
    let script = common::manifest_dir().join("tests/mem0_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}", srv.addr))
        .arg("m0-secret-key")
        .env("PYTHONPATH", &py)
        .env("MEM0_TELEMETRY", "false")
        .env("MEM0_DIR", dir.path().join("mem0-home"))
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "Mem0 client script failed:\n{}", String::from_utf8_lossy(&out.stderr));
}

/// A worker opens its memory without reading any KV: after a restart, with
/// `--cold-kv prefill` the first kv request pastes the facts it retrieved
/// (their KV is on disk only) and is prefilled like prompt mode, while their
/// KV is read in the background; a later request injects them. Usage says
/// which path served each. With `--cold-kv read` the first request reads
/// them and injects; `wait` and `auto` (the default) below.
#[test]
fn cold_facts_are_prefilled_while_their_kv_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem");
    let c = "/v1/chat/completions";
    let question = chat(Some("u1"), "What is the name of Caroline's cat?", json!({"k": 2}));
    let injected = {
        let s = serve(&mem, &[]);
        let (status, v) = json_call(&s.addr, "POST", "/v1/memories", &serde_json::from_str(TURNS).unwrap());
        assert_eq!(status, 200, "{v}");
        let (status, v) = json_call(&s.addr, "POST", c, &question);
        assert_eq!(status, 200, "{v}");
        let sources = json!({"device": 2, "host": 0, "disk": 0, "prefilled": 0});
        assert_eq!(v["usage"]["memory"]["sources"], sources, "fresh KV is cached on the device: {v}");
        v["usage"]["memory"]["injected_tokens"].as_u64().unwrap()
    };
    assert!(injected > 20, "freshly encoded KV is cached and injected");

    let s = serve(&mem, &["--cold-kv", "prefill"]);
    let (status, v) = json_call(&s.addr, "POST", c, &question);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["memory"]["facts"], json!(2), "{v}");
    assert_eq!(v["usage"]["memory"]["injected_tokens"], json!(0), "cold facts are pasted: {v}");
    let sources = json!({"device": 0, "host": 0, "disk": 0, "prefilled": 2});
    assert_eq!(v["usage"]["memory"]["sources"], sources, "{v}");
    let prompt = v["usage"]["prompt_tokens"].clone();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, v) = json_call(&s.addr, "POST", c, &question);
        assert_eq!(status, 200, "{v}");
        if v["usage"]["memory"]["injected_tokens"].as_u64() == Some(injected) {
            assert_eq!(v["usage"]["prompt_tokens"], prompt, "the same prompt, its facts injected: {v}");
            // Read from disk into the cache (the CPU backend's tier is its device).
            assert_eq!(v["usage"]["memory"]["sources"]["device"], json!(2), "{v}");
            break;
        }
        assert!(Instant::now() < deadline, "the facts' KV was never cached: {v}");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(s);

    let s = serve(&mem, &["--cold-kv", "read"]);
    let (status, v) = json_call(&s.addr, "POST", c, &question);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["memory"]["injected_tokens"].as_u64(), Some(injected), "read at arrival: {v}");
    let sources = json!({"device": 0, "host": 0, "disk": 2, "prefilled": 0});
    assert_eq!(v["usage"]["memory"]["sources"], sources, "{v}");
    // Prompt mode says nothing of where KV came from: it injects none.
    let prompt_mode = chat(Some("u1"), "What is the name of Caroline's cat?", json!({"k": 2, "mode": "prompt"}));
    let (status, v) = json_call(&s.addr, "POST", c, &prompt_mode);
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["memory"].get("sources").is_none(), "{v}");
    drop(s);

    // `wait`: the reader threads (here one, --kv-readers) read the cold
    // facts while the request waits outside the engine; read in time, every
    // fact is injected.
    let s = serve(&mem, &["--cold-kv", "wait", "--cold-kv-wait-ms", "20000", "--kv-readers", "1"]);
    let (status, v) = json_call(&s.addr, "POST", c, &question);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["memory"]["injected_tokens"].as_u64(), Some(injected), "waited for the reads: {v}");
    assert_eq!(v["usage"]["prompt_tokens"], prompt, "{v}");
    let sources = json!({"device": 0, "host": 0, "disk": 2, "prefilled": 0});
    assert_eq!(v["usage"]["memory"]["sources"], sources, "{v}");
    drop(s);
    // With no time to wait, it is `prefill`: the cold facts are pasted.
    let s = serve(&mem, &["--cold-kv", "wait", "--cold-kv-wait-ms", "0"]);
    let (status, v) = json_call(&s.addr, "POST", c, &question);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["memory"]["injected_tokens"], json!(0), "{v}");
    assert_eq!(v["usage"]["memory"]["sources"]["prefilled"], json!(2), "{v}");
    drop(s);

    // `auto`: with nothing measured yet the first cold request waits for
    // its reads, as `wait` does (a cap long enough for a loaded disk); its
    // reads and the prefill of its question are then measured, and the
    // next cold request — another user's, so its facts are still on disk —
    // is planned from them (the rule's choices on fixed inputs are
    // `crates/worker/src/cold.rs`'s tests; here, the wiring: every fact
    // accounted for once, an injected fact injected whole). Which way it
    // goes depends on this machine's load at that moment: a read of a
    // SmolLM2 fact (~1 MB of f32 KV) takes milliseconds when idle and its
    // ~25 tokens' prefill tens of them, but reads slow down more than the
    // prefill when the tests beside this one load the disk.
    let s = serve(&mem, &["--cold-kv", "auto"]);
    let (status, v) =
        json_call(&s.addr, "POST", "/v1/memories", &serde_json::from_str(&TURNS.replace("\"u1\"", "\"u2\"")).unwrap());
    assert_eq!(status, 200, "{v}");
    drop(s);
    let s = serve(&mem, &["--cold-kv", "auto", "--cold-kv-wait-ms", "20000"]);
    let (status, v) = json_call(&s.addr, "POST", c, &question);
    assert_eq!(status, 200, "{v}");
    let sources = json!({"device": 0, "host": 0, "disk": 2, "prefilled": 0});
    assert_eq!(v["usage"]["memory"]["sources"], sources, "nothing measured yet: waited for the reads: {v}");
    assert_eq!(v["usage"]["memory"]["injected_tokens"].as_u64(), Some(injected), "{v}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while json_call(&s.addr, "POST", c, &question).1["usage"]["memory"]["sources"]["device"] != json!(2) {
        assert!(Instant::now() < deadline, "u1's facts were never read");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A prompt-mode request prefills its facts as text: a measured prefill
    // (a kv request's question alone may be too short to be sampled).
    let (status, v) = json_call(&s.addr, "POST", c, &prompt_mode);
    assert_eq!(status, 200, "{v}");
    let other = chat(Some("u2"), "What is the name of Caroline's cat?", json!({"k": 2}));
    let (status, v) = json_call(&s.addr, "POST", c, &other);
    assert_eq!(status, 200, "{v}");
    let m = &v["usage"]["memory"];
    let (disk, prefilled) = (m["sources"]["disk"].as_u64().unwrap(), m["sources"]["prefilled"].as_u64().unwrap());
    assert_eq!(
        (m["sources"]["device"].as_u64(), m["sources"]["host"].as_u64(), disk + prefilled),
        (Some(0), Some(0), 2)
    );
    let injected_now = m["injected_tokens"].as_u64().unwrap();
    match disk {
        2 => assert_eq!(injected_now, injected, "both read in time: both injected: {v}"),
        0 => assert_eq!(injected_now, 0, "none read in time: both pasted: {v}"),
        _ => assert!(injected_now > 0 && injected_now < injected, "one of each: {v}"),
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt, "the same prompt whichever way its facts came: {v}");
}

/// A restart reads back what the KV tiers held (`--kv-warm-restart true`):
/// SIGTERM saves the list of resident facts, the next start reads
/// them back on its reader threads and says so, and a request after that
/// finds its facts on the device — with `--cold-kv prefill`, which would
/// paste facts still on disk. Turned off (the default), a restart is cold
/// and nothing is saved.
#[test]
fn a_restart_reads_back_the_facts_its_tiers_held() {
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem");
    let c = "/v1/chat/completions";
    let question = chat(Some("u1"), "What is the name of Caroline's cat?", json!({"k": 2}));
    let stop = |mut s: Proc| {
        sigterm(&mut s);
        s.stderr_lines("saved the")
    };
    let warm = ["--kv-warm-restart", "true"];
    let s = serve(&mem, &warm);
    let (status, v) = json_call(&s.addr, "POST", "/v1/memories", &serde_json::from_str(TURNS).unwrap());
    assert_eq!(status, 200, "{v}");
    let (status, v) = json_call(&s.addr, "POST", c, &question);
    assert_eq!(status, 200, "{v}");
    let injected = v["usage"]["memory"]["injected_tokens"].as_u64().unwrap();
    let saved = stop(s);
    assert!(saved.iter().any(|l| l.contains("saved the 2 facts the KV tiers hold")), "{saved:?}");
    assert!(mem.join("resident").is_file());

    let s = serve(&mem, &["--cold-kv", "prefill", warm[0], warm[1]]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.stderr_lines("read back").is_empty() {
        assert!(Instant::now() < deadline, "no warm-up reported");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(s.stderr_lines("read back 2 facts the KV tiers held at the last stop").len() == 1);
    let (status, v) = json_call(&s.addr, "POST", c, &question);
    assert_eq!(status, 200, "{v}");
    let sources = json!({"device": 2, "host": 0, "disk": 0, "prefilled": 0});
    assert_eq!(v["usage"]["memory"]["sources"], sources, "read back before the request: {v}");
    assert_eq!(v["usage"]["memory"]["injected_tokens"].as_u64(), Some(injected), "{v}");
    stop(s);

    let s = serve(&mem, &["--cold-kv", "prefill"]);
    let (status, v) = json_call(&s.addr, "POST", c, &question);
    assert_eq!(status, 200, "{v}");
    let sources = json!({"device": 0, "host": 0, "disk": 0, "prefilled": 2});
    assert_eq!(v["usage"]["memory"]["sources"], sources, "turned off, a restart is cold: {v}");
    assert!(stop(s).is_empty(), "turned off, nothing is saved");
}

/// Prompt mode's automatic prefix caching: a user's second identical
/// request takes its prompt's computed blocks from the first and answers
/// the same; another user's does not (the default, `user`), unless the
/// worker shares the cache (`shared`).
#[test]
fn prompt_blocks_are_reused_within_a_user_or_when_shared() {
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem");
    let c = "/v1/chat/completions";
    let ask = |addr: &str, user: &str| {
        let body = chat(Some(user), "What is the name of Caroline's cat?", json!({"k": 2, "mode": "prompt"}));
        let (status, v) = json_call(addr, "POST", c, &body);
        assert_eq!(status, 200, "{v}");
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        (cached, prompt, v["choices"][0]["message"]["content"].clone())
    };
    let s = serve(&mem, &[]);
    for user in ["u1", "u2"] {
        let turns = TURNS.replace("\"user\": \"u1\"", &format!("\"user\": \"{user}\""));
        let (status, v) = json_call(&s.addr, "POST", "/v1/memories", &serde_json::from_str(&turns).unwrap());
        assert_eq!(status, 200, "{v}");
    }
    let (header, prompt, answer) = ask(&s.addr, "u1");
    assert!(prompt > header + 32, "a prompt of several blocks past its header: {prompt} tokens, {header} cached");
    let (cached, prompt2, answer2) = ask(&s.addr, "u1");
    assert_eq!((prompt2, &answer2), (prompt, &answer), "the same prompt, the same greedy answer");
    // All but the block holding the last token (computed for its logits).
    assert!(cached > header && cached + 16 >= prompt && cached < prompt, "{cached} of {prompt} cached");
    let (other, _, answer3) = ask(&s.addr, "u2");
    assert_eq!((other, &answer3), (header, &answer), "another user's prompt finds nothing of u1's");
    drop(s);

    let s = serve(&mem, &["--prefix-cache", "shared"]);
    assert_eq!(ask(&s.addr, "u1").0, header, "nothing cached after a restart");
    assert_eq!(ask(&s.addr, "u2").0, cached, "shared: u2's identical prompt takes u1's blocks");
    drop(s);
    let s = serve(&mem, &["--prefix-cache", "off"]);
    ask(&s.addr, "u1");
    assert_eq!(ask(&s.addr, "u1").0, header, "off: only the header is cached");
}

/// SIGKILL in the middle of a large ingest request: after a restart none
/// of its units are there (before ingests were committed per request, the
/// first batches stayed: 16 of 120 units in the issue's repro); the retried
/// request stores all of them, and a kill after its answer loses none.
#[test]
fn a_request_killed_mid_ingest_leaves_none_of_its_units() {
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem");
    let turns: Vec<Value> = (0..40)
        .map(|i| {
            let speaker = if i % 2 == 0 { "Caroline" } else { "Melanie" };
            let text = format!("Turn {i}: I visited place {} and met friend {} there.", i * 7 % 13, i * 5 % 11);
            json!({"id": format!("K{i}"), "speaker": speaker, "text": text, "time": "1:56 pm on 8 May, 2023"})
        })
        .collect();
    let body = json!({"user": "k1", "turns": turns});
    {
        let s = serve(&mem, &["--window", "2"]);
        let (addr, b) = (s.addr.clone(), body.clone());
        std::thread::spawn(move || {
            let _ = http(&addr, "POST", "/v1/memories", b.to_string().as_bytes());
        });
        // Units are listed as their batches are stored; kill between batches.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (status, v) = json_call(&s.addr, "GET", "/v1/memories/k1", &Value::Null);
            let total = v["total"].as_u64().unwrap_or(0);
            if status == 200 && total >= 8 {
                assert!(total < 40, "the whole request was stored before the kill: {v}");
                break;
            }
            assert!(Instant::now() < deadline, "the ingest never got going: {status} {v}");
            std::thread::sleep(Duration::from_millis(20));
        }
    } // SIGKILL
    let s = serve(&mem, &["--window", "2"]);
    let (status, v) = json_call(&s.addr, "GET", "/v1/memories/k1", &Value::Null);
    assert_eq!(status, 404, "none of the unanswered request's units, not even its user: {v}");
    let (status, v) = json_call(&s.addr, "POST", "/v1/memories", &body);
    assert_eq!((status, v["added"].as_u64()), (200, Some(40)), "the retry stores it all: {v}");
    drop(s); // SIGKILL after the answer
    let s = serve(&mem, &["--window", "2"]);
    assert_eq!(units(&s.addr, "k1").as_array().unwrap().len(), 40);
}

/// SIGTERM stops `serve` in order: the servers drain, then the process
/// waits for its engine thread to drop the engine (which frees a device's
/// memory and prints `INFERSCALE_CUDA_PROFILE`'s table) before it exits 0.
#[test]
fn sigterm_stops_serve_after_its_engine() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = serve(&dir.path().join("mem"), &[]);
    let v = chat(None, "Say hello.", Value::Null);
    let (status, body) = post(&s.addr, "/v1/chat/completions", v.to_string().as_bytes());
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    sigterm(&mut s);
    assert_eq!(s.stderr_lines("inferscale: the engine stopped").len(), 1, "the engine thread was not waited for");
    assert!(s.stderr_lines("did not stop").is_empty());
}

/// Stops `s` with SIGTERM: it must exit 0 within 30 s; its stderr lines
/// are then waited for (up to 5 s) until the engine thread's last one.
fn sigterm(s: &mut Proc) {
    let pid = i32::try_from(s.child.id()).unwrap();
    // SAFETY: kill(2) with a valid signal number touches no memory of ours.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "serve still running 30 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "serve exited with {status} after SIGTERM");
    // The reader thread may still hold the last lines for a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.stderr_lines("inferscale: the engine stopped").is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A large ingest does not starve chats on the same worker: while an
/// async ingest of 200 turns runs (stored a few at a time, its KV left for
/// idle time), a kv chat of another user takes about what it takes idle,
/// and the job's progress counts the units stored so far.
/// Before, every engine turn stored a whole batch (KV encoded, seconds on
/// a CPU) before one serving step: an 8-token chat took 36–60 s against
/// 0.5–0.9 s idle. The bound here (4× idle, plus 2 s for a busy CI
/// machine) is loose on purpose; `inferscale bench serve --ingest-turns`
/// measures it (docs/performance.md).
#[test]
fn chats_keep_their_pace_during_a_large_ingest() {
    let dir = tempfile::tempdir().unwrap();
    let s = serve(&dir.path().join("mem"), &["--window", "2"]);
    let a = s.addr.as_str();
    let turns = |prefix: &str, n: usize| -> Vec<Value> {
        (0..n)
            .map(|i| {
                let text = format!("Turn {i}: I visited place {} and met friend {} there.", i * 7 % 13, i * 5 % 11);
                json!({"id": format!("{prefix}{i}"), "speaker": "Caroline", "text": text, "time": "1:56 pm on 8 May, 2023"})
            })
            .collect()
    };
    let (status, v) = json_call(a, "POST", "/v1/memories", &json!({"user": "chatter", "turns": turns("C", 10)}));
    assert_eq!(status, 200, "{v}");
    let ask = || {
        let body = chat(Some("chatter"), "Where did I go?", json!({"mode": "kv", "k": 5})).to_string();
        let t0 = Instant::now();
        let (status, b) = post(a, "/v1/chat/completions", body.as_bytes());
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
        t0.elapsed()
    };
    ask(); // warm
    let mut idle: Vec<Duration> = (0..3).map(|_| ask()).collect();
    idle.sort();
    let body = json!({"user": "bulk", "turns": turns("B", 200), "async": true});
    let (status, started) = json_call(a, "POST", "/v1/memories", &body);
    assert_eq!(status, 202, "{started}");
    let job = format!("/v1/memories/jobs/{}", started["job"].as_str().unwrap());
    std::thread::sleep(Duration::from_millis(500));
    let during: Vec<Duration> = (0..3).map(|_| ask()).collect();
    let (_, v) = json_call(a, "GET", &job, &Value::Null);
    assert_eq!(v["status"], "running", "the ingest must still run for the chats to have met it: {v}");
    let stored = v["stored"].as_u64().unwrap_or(0);
    assert!(stored > 0 && stored < 200, "progress counts what is stored so far: {v}");
    let bound = idle[1] * 4 + Duration::from_secs(2);
    for d in &during {
        assert!(*d < bound, "a chat took {d:?} during the ingest against {:?} idle (bound {bound:?})", idle[1]);
    }
    // And the ingest finishes: every unit stored.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let (_, v) = json_call(a, "GET", &job, &Value::Null);
        if v["status"] == "done" {
            assert_eq!(v["result"]["added"], 200, "{v}");
            break;
        }
        assert_eq!(v["status"], "running", "{v}");
        assert!(Instant::now() < deadline, "the ingest did not finish: {v}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn locomo() -> Vec<Value> {
    let path = std::env::var_os("INFERSCALE_LOCOMO")
        .map(PathBuf::from)
        .unwrap_or_else(|| common::manifest_dir().join("../../../shared/data/locomo/locomo-dev.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (set INFERSCALE_LOCOMO to a LoCoMo file)", path.display()));
    serde_json::from_str::<Vec<Value>>(&text).unwrap()
}

/// The first `n` turns of a LoCoMo sample as ingest units, and a question.
fn conversation(sample: &Value, n: usize) -> (Vec<Value>, String) {
    let conv = &sample["conversation"];
    let time = conv["session_1_date_time"].as_str().unwrap_or("").to_string();
    let turns: Vec<Value> = conv["session_1"]
        .as_array()
        .unwrap()
        .iter()
        .take(n)
        .map(|t| json!({"id": t["dia_id"], "speaker": t["speaker"], "text": t["text"], "time": time}))
        .collect();
    let q = sample["qa"][0]["question"].as_str().unwrap().to_string();
    (turns, q)
}

fn metric(text: &str, name: &str, worker: &str) -> Option<f64> {
    let key = format!("{name}{{worker=\"{worker}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&key)).and_then(|v| v.trim().parse().ok())
}

/// The router's count of `worker`'s requests that ended as `status`.
fn requests(text: &str, worker: &str, status: &str) -> Option<f64> {
    let key = format!("inferscale_worker_requests_total{{worker=\"{worker}\",status=\"{status}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&key)).and_then(|v| v.trim().parse().ok())
}

#[test]
fn router_and_two_workers_serve_twenty_users() {
    let dir = tempfile::tempdir().unwrap();
    let workers: Vec<Proc> = (0..2)
        .map(|i| {
            let mem = dir.path().join(format!("mem{i}"));
            let args = ["worker", "--listen", "127.0.0.1:0", "--memory", mem.to_str().unwrap(), "--window", "3"];
            spawn(&args, "gRPC on ")
        })
        .collect();
    let list = workers.iter().map(|w| w.addr.clone()).collect::<Vec<_>>().join(",");
    // A shared CI machine may be slow: the deadline is generous, not a timing assertion.
    let router = spawn(&["router", "--listen", "127.0.0.1:0", "--worker", &list, "--deadline-s", "600"], "API on ");
    let a = router.addr.clone();
    let samples = locomo();

    // 20 users ingest (two per conversation), all at once.
    let users: Vec<(String, Vec<Value>, String)> = (0..20)
        .map(|i| {
            let (turns, q) = conversation(&samples[i % samples.len()], 6);
            (format!("user-{i}"), turns, q)
        })
        .collect();
    std::thread::scope(|s| {
        for (u, turns, _) in &users {
            let a = &a;
            s.spawn(move || {
                let (status, v) = json_call(a, "POST", "/v1/memories", &json!({"user": u, "turns": turns}));
                assert_eq!(status, 200, "{u}: {v}");
                assert_eq!(v["added"].as_u64(), Some(turns.len() as u64), "{u}: {v}");
            });
        }
    });

    // Each asks two questions concurrently (kv and prompt mode); all answer,
    // and every request of a user lands on one worker.
    let served: Vec<(String, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = users
            .iter()
            .flat_map(|(u, _, q)| ["kv", "prompt"].map(move |mode| (u, q, mode)))
            .map(|(u, q, mode)| {
                let a = &a;
                s.spawn(move || {
                    let body = chat(Some(u), q, json!({"mode": mode, "k": 4}));
                    let (status, headers, b) = http(a, "POST", "/v1/chat/completions", body.to_string().as_bytes());
                    let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
                    assert_eq!(status, 200, "{u} {mode}: {v}");
                    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{u}: {v}");
                    assert_eq!(v["usage"]["memory"]["facts"], json!(4), "{u}: {v}");
                    let w = headers.iter().find(|(k, _)| k == "x-inferscale-worker").map(|(_, v)| v.clone());
                    (u.clone(), w.unwrap_or_default())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut by_user = std::collections::BTreeMap::<String, std::collections::BTreeSet<String>>::new();
    for (u, w) in &served {
        by_user.entry(u.clone()).or_default().insert(w.clone());
    }
    assert!(by_user.values().all(|ws| ws.len() == 1), "a user's requests went to several workers: {by_user:?}");
    let used: std::collections::BTreeSet<_> = by_user.values().flatten().collect();
    assert_eq!(used.len(), 2, "all users landed on one worker: {by_user:?}");

    // A client that goes away mid-stream frees its request's blocks at once.
    let user = "user-0";
    let home = by_user[user].iter().next().unwrap().clone();
    let scrape = || String::from_utf8(http(&a, "GET", "/metrics", b"").2).unwrap();
    let wait_for = |what: &str, ok: &dyn Fn(&str) -> bool| {
        let t0 = Instant::now();
        loop {
            let m = scrape();
            if ok(&m) {
                return m;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "{what}; last metrics:\n{m}");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let idle = wait_for("the worker did not go idle", &|m| {
        metric(m, "inferscale_worker_requests_running", &home) == Some(0.0)
    });
    let free = metric(&idle, "inferscale_worker_kv_blocks_free", &home).unwrap();
    let cancelled = requests(&idle, &home, "cancelled").unwrap();
    let mut body = chat(Some(user), "Write a very long story about a cat, a dog and a lighthouse.", json!({"k": 4}));
    // Past end-of-sequence too, so it is surely still running when dropped.
    body["max_tokens"] = json!(2000);
    body["ignore_eos"] = json!(true);
    body["stream"] = json!(true);
    let body = body.to_string();
    let mut s = TcpStream::connect(&a).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("\"content\"") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended before the first token");
        got.extend_from_slice(&buf[..n]);
    }
    wait_for("the request is not running", &|m| metric(m, "inferscale_worker_requests_running", &home) == Some(1.0));
    drop(s);
    let after = wait_for("the cancelled request's blocks were not freed", &|m| {
        metric(m, "inferscale_worker_requests_running", &home) == Some(0.0)
            && metric(m, "inferscale_worker_kv_blocks_free", &home) == Some(free)
    });
    assert_eq!(requests(&after, &home, "cancelled"), Some(cancelled + 1.0));
}
