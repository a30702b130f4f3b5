//! The memory API (docs/serving.md, "Memory API") over real loopback HTTP
//! against `inferscale serve` on SmolLM2 + MiniLM: chat messages stored as
//! turns, metadata stored, returned, filtered and kept across a restart,
//! one unit fetched, search with scores, thresholds and filters, and what
//! is refused rather than silently dropped.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::path::Path;

use common::{Proc, json_call, spawn};
use serde_json::{Value, json};

fn serve(mem: &Path) -> Proc {
    spawn(&["serve", "--listen", "127.0.0.1:0", "--memory", mem.to_str().unwrap(), "--window", "2"], "API on ")
}

fn call(a: &str, method: &str, path: &str, body: Value) -> Value {
    let (status, v) = json_call(a, method, path, &body);
    assert_eq!(status, 200, "{method} {path}: {v}");
    v
}

fn refused(a: &str, method: &str, path: &str, body: Value, want: u16, needle: &str) -> Value {
    let (status, v) = json_call(a, method, path, &body);
    let msg = v["error"]["message"].as_str().unwrap_or_default().to_string();
    assert_eq!(status, want, "{method} {path}: {v}");
    assert!(msg.contains(needle), "{method} {path}: {msg:?} lacks {needle:?}");
    v
}

fn search(a: &str, body: Value) -> Vec<Value> {
    call(a, "POST", "/v1/memories/search", body)["results"].as_array().cloned().unwrap()
}

fn ids(results: &[Value]) -> Vec<&str> {
    results.iter().map(|r| r["id"].as_str().unwrap()).collect()
}

#[test]
fn messages_metadata_get_and_search() {
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem");
    let srv = serve(&mem);
    let a = srv.addr.as_str();

    // A chat stored as turns; the system message is an instruction, not a memory.
    let chat = json!({"user": "m1", "metadata": {"topic": "pets"}, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "I adopted a grey cat named Miso last spring."},
        {"role": "assistant", "content": "Miso is a lovely name for a cat!"}]});
    let v = call(a, "POST", "/v1/memories", chat.clone());
    assert_eq!(v["added"], 2, "{v}");
    let msg_ids: Vec<String> = serde_json::from_value(v["ids"].clone()).unwrap();
    assert_eq!(msg_ids.len(), 2);
    // Re-sending the same chat stores nothing twice.
    let again = call(a, "POST", "/v1/memories", chat);
    assert_eq!(
        (again["added"].clone(), again["skipped"].clone(), again["ids"].clone()),
        (json!(0), json!(2), v["ids"].clone())
    );
    let turns = json!({"user": "m1", "turns": [
        {"id": "r1", "speaker": "Ana", "text": "I ran a half marathon in Lisbon in October.",
         "metadata": {"topic": "sport", "km": 21}},
        {"id": "r2", "speaker": "Ana", "text": "My sister Eva lives in Porto and teaches maths."}],
        "metadata": {"topic": "family"}});
    assert_eq!(call(a, "POST", "/v1/memories", turns)["added"], 2);
    // Mem0's names: `user_id` for `user`; `infer: true` (an LLM's extraction,
    // not done here) refused naming it, never ignored; `infer: false` stored.
    let mem0 = json!({"user_id": "m1", "infer": true, "messages": [{"role": "user", "content": "I like tea."}]});
    let v = refused(a, "POST", "/v1/memories", mem0.clone(), 400, "infer");
    assert_eq!(v["error"]["param"], "infer", "{v}");
    let mut plain = mem0;
    plain["infer"] = json!(false);
    assert_eq!(call(a, "POST", "/v1/memories", plain.clone())["added"], 1);
    call(
        a,
        "DELETE",
        &format!("/v1/memories/m1/{}", call(a, "POST", "/v1/memories", plain)["ids"][0].as_str().unwrap()),
        Value::Null,
    );

    // Listing and getting one return the metadata; the speaker of a message is its role.
    let listed = call(a, "GET", "/v1/memories/m1", Value::Null);
    assert_eq!(listed["count"], 4, "{listed}");
    let cat = call(a, "GET", &format!("/v1/memories/m1/{}", msg_ids[0]), Value::Null);
    assert_eq!((cat["speaker"].as_str(), cat["metadata"]["topic"].as_str()), (Some("User"), Some("pets")), "{cat}");
    assert_eq!(cat["memory"], "I adopted a grey cat named Miso last spring.");
    let r1 = call(a, "GET", "/v1/memories/m1/r1", Value::Null);
    assert_eq!(r1["metadata"], json!({"topic": "sport", "km": 21}), "a unit's own metadata wins: {r1}");
    refused(a, "GET", "/v1/memories/m1/nope", Value::Null, 404, "nope");
    refused(a, "GET", "/v1/memories/nobody/r1", Value::Null, 404, "nobody");

    // Search: the retriever's order, each result with its score.
    let hits = search(a, json!({"user": "m1", "query": "What is the name of my cat?", "top_k": 2}));
    assert_eq!(hits.len(), 2);
    assert_eq!(hits[0]["id"].as_str(), Some(msg_ids[0].as_str()), "{hits:?}");
    let score = hits[0]["score"].as_f64().unwrap();
    assert!(score > 0.3 && score <= 1.0 + 1e-6, "{hits:?}");
    assert_eq!(hits[0]["metadata"]["topic"], "pets");
    // Filters narrow by metadata: equality, operators, combinations.
    let sport = search(a, json!({"user": "m1", "query": "What is the name of my cat?", "filters": {"topic": "sport"}}));
    assert_eq!(ids(&sport), ["r1"]);
    let far = search(a, json!({"user_id": "m1", "query": "running", "filters": {"km": {"gte": 20}}}));
    assert_eq!(ids(&far), ["r1"]);
    let either = search(
        a,
        json!({"user": "m1", "query": "family", "filters": {"OR": [{"topic": "family"}, {"topic": "sport"}]}}),
    );
    let mut got = ids(&either);
    got.sort();
    assert_eq!(got, ["r1", "r2"]);
    // A threshold drops weak matches: nothing is that close to this query.
    let strict = search(a, json!({"user": "m1", "query": "quantum chromodynamics", "threshold": 0.9}));
    assert!(strict.is_empty(), "{strict:?}");
    let loose = search(a, json!({"user": "m1", "query": "quantum chromodynamics", "threshold": -1.0, "top_k": 10}));
    assert_eq!(loose.len(), 4);
    // A user without memory has no results (not an error).
    assert!(search(a, json!({"user": "nobody", "query": "cats"})).is_empty());

    // What is refused, not dropped.
    let p = "/v1/memories/search";
    refused(a, "POST", p, json!({"user": "m1", "query": "x", "filters": {"km": {"near": 1}}}), 400, "unknown operator");
    refused(a, "POST", p, json!({"user": "m1", "query": "x", "top_k": 0}), 400, "top_k");
    refused(a, "POST", p, json!({"user": "m1", "query": "  "}), 400, "query");
    refused(a, "POST", p, json!({"user": "m1", "query": "x", "threshold": 2.0}), 400, "threshold");
    let bad_agent = json!({"user": "m1", "agent_id": "a\u{0}b", "messages": [{"role": "user", "content": "x"}]});
    refused(a, "POST", "/v1/memories", bad_agent, 400, "agent_id");
    let tool = json!({"user": "m1", "messages": [{"role": "tool", "content": "x"}]});
    refused(a, "POST", "/v1/memories", tool, 400, "messages[0].role");
    let only_system = json!({"user": "m1", "messages": [{"role": "system", "content": "x"}]});
    refused(a, "POST", "/v1/memories", only_system, 400, "nothing to ingest");
    let big = json!({"user": "m1", "turns": [{"id": "b1", "text": "x", "metadata": {"pad": "y".repeat(20_000)}}]});
    refused(a, "POST", "/v1/memories", big, 400, "metadata");
    assert_eq!(call(a, "GET", "/v1/memories/m1", Value::Null)["count"], 4, "refusals stored nothing");

    // Chat retrieves the message turns like any other.
    let q = json!({"model": "smollm2", "user": "m1", "max_tokens": 8, "temperature": 0,
                   "messages": [{"role": "user", "content": "What is the name of my cat?"}], "memory": {"k": 1}});
    let v = call(a, "POST", "/v1/chat/completions", q);
    assert_eq!(v["usage"]["memory"]["fact_ids"], json!([msg_ids[0]]), "{v}");

    // Update: a new text is what retrieval and injection use from then on.
    let ask = |mode: &str| {
        let q = json!({"model": "smollm2", "user": "m1", "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": "Which city does my sister live in?"}],
                       "memory": {"k": 1, "mode": mode}});
        call(a, "POST", "/v1/chat/completions", q)
    };
    let before = ask("kv");
    assert_eq!(before["usage"]["memory"]["fact_ids"], json!(["r2"]), "{before}");
    let moved = json!({"text": "My sister Eva moved to Berlin last year and now teaches physics there."});
    let v = call(a, "PUT", "/v1/memories/m1/r2", moved.clone());
    assert_eq!(v["updated"], true, "{v}");
    assert!(v["encoded_tokens"].as_u64().unwrap() > 0, "a new text is re-encoded: {v}");
    let hits = search(a, json!({"user": "m1", "query": "Which city does my sister live in?", "top_k": 1}));
    assert_eq!((ids(&hits), hits[0]["memory"].as_str()), (vec!["r2"], moved["text"].as_str()), "{hits:?}");
    // kv and prompt mode hold the same tokens: the injected KV is the new text's.
    let (kv, prompt) = (ask("kv"), ask("prompt"));
    assert_eq!(kv["usage"]["prompt_tokens"], prompt["usage"]["prompt_tokens"], "{kv} {prompt}");
    assert_ne!(kv["usage"]["prompt_tokens"], before["usage"]["prompt_tokens"], "the old text's tokens are gone");
    // The same update again changes nothing; metadata alone re-encodes nothing.
    assert_eq!(call(a, "PUT", "/v1/memories/m1/r2", moved)["updated"], false);
    let v = call(a, "PUT", "/v1/memories/m1/r2", json!({"metadata": {"topic": "family", "city": "Berlin"}}));
    assert_eq!((v["updated"].clone(), v["encoded_tokens"].clone()), (json!(true), json!(0)), "{v}");
    let h = call(a, "GET", "/v1/memories/m1/r2/history", Value::Null)["history"].as_array().cloned().unwrap();
    let events: Vec<&str> = h.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["ADD", "UPDATE", "UPDATE"], "{h:?}");
    assert_eq!(h[1]["old_memory"], "My sister Eva lives in Porto and teaches maths.");
    assert_eq!(
        h[1]["new_memory"].as_str(),
        Some("My sister Eva moved to Berlin last year and now teaches physics there.")
    );
    assert_eq!(h[2]["new_metadata"], json!({"topic": "family", "city": "Berlin"}));
    assert!(h[0]["created_at"].as_str().unwrap().ends_with('Z'), "{h:?}");
    refused(a, "PUT", "/v1/memories/m1/nope", json!({"text": "x"}), 404, "nope");
    refused(a, "PUT", "/v1/memories/m1/r2", json!({}), 400, "nothing to update");
    refused(a, "PUT", "/v1/memories/m1/r2", json!({"text": "  "}), 400, "empty");
    refused(a, "PUT", "/v1/memories/m1/r2", json!({"txt": "typo"}), 400, "txt");
    refused(a, "GET", "/v1/memories/m1/nope/history", Value::Null, 404, "nope");

    // Pages of the list: `limit`, then `next_cursor` until the end.
    let mut seen = Vec::new();
    let mut url = "/v1/memories/m1?limit=3".to_string();
    loop {
        let page = call(a, "GET", &url, Value::Null);
        assert_eq!(page["total"], 4);
        seen.extend(page["units"].as_array().unwrap().iter().map(|u| u["id"].as_str().unwrap().to_string()));
        match page["next_cursor"].as_str() {
            Some(c) => url = format!("/v1/memories/m1?limit=3&cursor={c}"),
            None => break,
        }
    }
    assert_eq!(seen.len(), 4);
    assert_eq!(&seen[2..], ["r1", "r2"]);
    refused(a, "GET", "/v1/memories/m1?limit=0", Value::Null, 400, "limit");
    refused(a, "GET", "/v1/memories/m1?cursor=gone", Value::Null, 400, "cursor");

    // Metadata and updates are durable: there after a restart, history too.
    drop(srv);
    let srv = serve(&mem);
    let r1 = call(&srv.addr, "GET", "/v1/memories/m1/r1", Value::Null);
    assert_eq!(r1["metadata"], json!({"topic": "sport", "km": 21}), "{r1}");
    let r2 = call(&srv.addr, "GET", "/v1/memories/m1/r2", Value::Null);
    assert_eq!(r2["memory"].as_str(), Some("My sister Eva moved to Berlin last year and now teaches physics there."));
    let h = call(&srv.addr, "GET", "/v1/memories/m1/r2/history", Value::Null);
    assert_eq!(h["history"].as_array().map(Vec::len), Some(3), "{h}");
    // Forgetting a unit forgets its history with it.
    call(&srv.addr, "DELETE", "/v1/memories/m1/r2", Value::Null);
    refused(&srv.addr, "GET", "/v1/memories/m1/r2/history", Value::Null, 404, "r2");

    // Scoping: units of an agent (or run) are the user's, and a request
    // scoped to another agent never sees them.
    let a = srv.addr.as_str();
    let coach = json!({"user": "m1", "agent_id": "coach", "run_id": "s1",
                       "messages": [{"role": "user", "content": "My left knee hurts when I run downhill."}]});
    let coach_id = call(a, "POST", "/v1/memories", coach)["ids"][0].as_str().unwrap().to_string();
    let chef = json!({"user": "m1", "agent_id": "chef",
                      "messages": [{"role": "user", "content": "I am allergic to peanuts and cashews."}]});
    let chef_id = call(a, "POST", "/v1/memories", chef)["ids"][0].as_str().unwrap().to_string();
    let q = "What am I allergic to?";
    let everyone = search(a, json!({"user": "m1", "query": q, "top_k": 1}));
    assert_eq!(ids(&everyone), [chef_id.as_str()], "the user's own search sees every agent's units");
    assert_eq!(everyone[0]["agent_id"], "chef");
    let coached = search(a, json!({"user": "m1", "query": q, "agent_id": "coach", "top_k": 10}));
    assert_eq!(ids(&coached), [coach_id.as_str()], "{coached:?}");
    let run = search(a, json!({"user": "m1", "query": q, "run_id": "s1"}));
    assert_eq!(ids(&run), [coach_id.as_str()]);
    assert!(search(a, json!({"user": "m1", "query": q, "agent_id": "chef", "run_id": "s1"})).is_empty());
    let chat = |agent: &str| {
        let q = json!({"model": "smollm2", "user": "m1", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": q}], "memory": {"k": 20, "agent_id": agent}});
        call(a, "POST", "/v1/chat/completions", q)["usage"]["memory"]["fact_ids"].clone()
    };
    assert_eq!(chat("coach"), json!([coach_id]));
    assert_eq!(chat("chef"), json!([chef_id]));
    assert_eq!(chat("nobody"), json!([]));
    let listed = call(a, "GET", "/v1/memories/m1?agent_id=chef", Value::Null);
    assert_eq!((listed["total"].clone(), listed["units"][0]["id"].clone()), (json!(1), json!(chef_id)));
    assert_eq!(call(a, "GET", "/v1/memories/m1", Value::Null)["total"], 5);
}

fn turns(prefix: &str, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            let speaker = if i % 2 == 0 { "Caroline" } else { "Melanie" };
            let text = format!("Turn {i}: we talked about place {} and friend {}.", i * 7 % 13, i * 5 % 11);
            json!({"id": format!("{prefix}{i}"), "speaker": speaker, "text": text, "time": "8 May 2023"})
        })
        .collect()
}

/// Polls job `id` until it is no longer running; its last status.
fn wait_job(a: &str, id: &str) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    loop {
        let v = call(a, "GET", &format!("/v1/memories/jobs/{id}"), Value::Null);
        if v["status"] != "running" {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "job {id} never ended: {v}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// `"async": true` makes an ingest a job: 202 at once with its id and
/// `Location`, a status with progress while it runs and the ingest's
/// answer once done; a cancelled job leaves none of its units (the worker
/// removes what it stored). Unknown jobs and cancelling a finished job are
/// refused with the JSON error shape.
#[test]
fn ingest_jobs_run_report_and_cancel() {
    let dir = tempfile::tempdir().unwrap();
    let srv = serve(&dir.path().join("mem"));
    let a = srv.addr.as_str();
    let body = json!({"user": "jo", "turns": turns("J", 12), "async": true});
    let (status, started) = json_call(a, "POST", "/v1/memories", &body);
    assert_eq!(status, 202, "{started}");
    let id = started["job"].as_str().unwrap().to_string();
    assert_eq!((started["status"].as_str(), started["units"].as_u64()), (Some("running"), Some(12)), "{started}");
    assert_eq!(started["location"], json!(format!("/v1/memories/jobs/{id}")));
    let running = call(a, "GET", &format!("/v1/memories/jobs/{id}"), Value::Null);
    if running["status"] == "running" {
        let stored = running["stored"].as_u64().unwrap();
        assert!(stored <= 12, "{running}");
    }
    let done = wait_job(a, &id);
    assert_eq!(done["status"], "done", "{done}");
    assert_eq!(done["result"]["added"], 12, "{done}");
    assert_eq!(call(a, "GET", "/v1/memories/jo", Value::Null)["total"], 12);
    refused(a, "DELETE", &format!("/v1/memories/jobs/{id}"), Value::Null, 409, "already ended");

    // Cancelled while it runs: none of its units stay.
    let body = json!({"user": "jo", "turns": turns("C", 60), "async": true});
    let (status, started) = json_call(a, "POST", "/v1/memories", &body);
    assert_eq!(status, 202, "{started}");
    let id = started["job"].as_str().unwrap().to_string();
    let cancelled = call(a, "DELETE", &format!("/v1/memories/jobs/{id}"), Value::Null);
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    assert_eq!(call(a, "GET", &format!("/v1/memories/jobs/{id}"), Value::Null)["status"], "cancelled");
    // The worker notices at its next batch; then the user has its 12 units only.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let v = call(a, "GET", "/v1/memories/jo?limit=1000", Value::Null);
        let units = v["units"].as_array().unwrap();
        if v["total"] == 12 && units.iter().all(|u| u["id"].as_str().unwrap().starts_with('J')) {
            // And it stays so: the cancelled ingest does not go on.
            std::thread::sleep(std::time::Duration::from_secs(2));
            assert_eq!(call(a, "GET", "/v1/memories/jo", Value::Null)["total"], 12);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the cancelled job's units stayed: {v}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    refused(a, "GET", "/v1/memories/jobs/ij-nope", Value::Null, 404, "no ingest job");
}
