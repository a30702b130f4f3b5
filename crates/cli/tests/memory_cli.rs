//! `inferscale ingest` / `ask` end to end on a small LoCoMo-format file,
//! and their errors on bad input (which must leave stored data untouched).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

use std::path::Path;
use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_inferscale")).args(args).output().unwrap()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const LOCOMO: &str = r#"[{"sample_id": "s1",
  "conversation": {"speaker_a": "Caroline", "speaker_b": "Melanie",
    "session_1_date_time": "1:56 pm on 8 May, 2023",
    "session_1": [
      {"speaker": "Caroline", "dia_id": "D1:1", "text": "I adopted a grey cat named Miso last spring."},
      {"speaker": "Melanie", "dia_id": "D1:2", "text": "I ran a charity race for mental health on Saturday."},
      {"speaker": "Caroline", "dia_id": "D1:3", "text": "I am moving to Lisbon in September to study counselling."}]},
  "qa": [{"question": "Where is Caroline moving?", "answer": "Lisbon", "evidence": ["D1:3"], "category": 4}]}]"#;

fn ask(mem: &Path, extra: &[&str]) -> Output {
    let m = mem.to_str().unwrap();
    let mut args = vec!["ask", "--memory", m, "--window", "1", "--user", "u1", "--k", "2"];
    args.extend_from_slice(extra);
    run(&args)
}

#[test]
fn ingest_ask_and_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("conv.json");
    std::fs::write(&data, LOCOMO).unwrap();
    let mem = dir.path().join("mem");
    let m = mem.to_str().unwrap();
    let d = data.to_str().unwrap();

    let o = run(&["ingest", "--memory", m, "--window", "1", "--user", "u1", "--locomo", d]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(err(&o).contains("3 turns"), "{}", err(&o));

    let o = ask(&mem, &["--mode", "kv", "Where is Caroline moving?"]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(!String::from_utf8_lossy(&o.stdout).trim().is_empty());
    let e = err(&o);
    assert!(e.contains("D1:3") && e.contains("TTFT"), "fact ids and TTFT on stderr: {e}");
    assert!(e.lines().any(|l| l.contains("facts (prompt order)") && l.trim_end().ends_with("D1:3")), "{e}");

    // Caller-supplied facts with their source turns join the same memory.
    let facts = dir.path().join("facts.jsonl");
    std::fs::write(
        &facts,
        "{\"id\": \"F1\", \"text\": \"Caroline will study counselling.\", \"source_turn\": \"D1:3\"}\n",
    )
    .unwrap();
    let f = facts.to_str().unwrap();
    let o = run(&["ingest", "--memory", m, "--window", "1", "--user", "u1", "--facts", f]);
    assert!(o.status.success() && err(&o).contains("1 new"), "{}", err(&o));
    let o = run(&["ingest", "--memory", m, "--window", "1", "--user", "u1", "--facts", f]);
    assert!(o.status.success() && err(&o).contains("1 already stored"), "{}", err(&o));
    std::fs::write(&facts, "{\"id\": \"F2\", \"text\": \"No source.\"}\n").unwrap();
    let o = run(&["ingest", "--memory", m, "--window", "1", "--user", "u1", "--facts", f]);
    assert!(!o.status.success() && err(&o).contains("facts.jsonl:1: missing field `source_turn`"), "{}", err(&o));
    let o = run(&["ingest", "--memory", m, "--window", "1", "--user", "u1", "--facts", f, "--locomo", d]);
    assert!(!o.status.success() && err(&o).contains("cannot be used with"), "{}", err(&o));

    // Bad input: each is a clear error.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"[{"sample_id": "x", "conversation": {"session_1": [{"speaker": "A"}]}}]"#).unwrap();
    let o = run(&["ingest", "--memory", m, "--window", "1", "--user", "u1", "--locomo", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(err(&o).contains("bad.json") && err(&o).contains("dia_id"), "{}", err(&o));

    let o = run(&["ingest", "--memory", m, "--window", "1", "--user", "u1", "--locomo", d, "--sample", "nope"]);
    assert!(!o.status.success() && err(&o).contains("nope"), "{}", err(&o));

    let o = run(&["ask", "--memory", m, "--window", "1", "--user", "ghost", "Where?"]);
    assert!(!o.status.success() && err(&o).contains("unknown user"), "{}", err(&o));

    for k in ["0", "5000"] {
        let o = run(&["ask", "--memory", m, "--window", "1", "--user", "u1", "--k", k, "Where?"]);
        assert!(!o.status.success() && err(&o).contains("--k"), "k={k}: {}", err(&o));
    }
    let o = run(&["ask", "--memory", m, "--window=-1", "--user", "u1", "Where?"]);
    assert!(!o.status.success() && err(&o).contains("--window"), "{}", err(&o));
    let o = ask(&mem, &["   "]);
    assert!(!o.status.success() && err(&o).contains("empty"), "{}", err(&o));

    // KV made with window 1 is refused for window 0, with a clear message.
    let o = run(&["ask", "--memory", m, "--window", "0", "--user", "u1", "Where?"]);
    assert!(!o.status.success() && err(&o).contains("window 1"), "{}", err(&o));

    // Stored data untouched: the same facts answer again.
    let o = ask(&mem, &["--mode", "prompt", "Where is Caroline moving?"]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(err(&o).contains("D1:3"), "{}", err(&o));
}
