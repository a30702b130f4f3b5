//! `inferscale ingest` / `ask` end to end on a small LoCoMo-format file,
//! and their errors on bad input (which must leave stored data untouched);
//! `inferscale eval locomo` / `eval retrieval` on another.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

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

    // The memory records its window and model; without --window the
    // recorded one is used (no mismatch), and a contradicting one is refused
    // before the model loads.
    let made: Value = serde_json::from_str(&std::fs::read_to_string(mem.join("memory.json")).unwrap()).unwrap();
    assert_eq!(made["window"], 1, "{made}");
    assert_eq!(made["model"], "smollm2", "{made}");
    let o = run(&["ask", "--memory", m, "--user", "u1", "--k", "2", "Where is Caroline moving?"]);
    assert!(o.status.success(), "without --window: {}", err(&o));
    let o = run(&["ask", "--memory", m, "--window", "3", "--user", "u1", "Where?"]);
    let e = err(&o);
    assert!(!o.status.success() && e.contains("made with window 1") && !e.contains("loaded"), "{e}");
    // A memory made before memory.json existed: its KV segments say the window.
    std::fs::remove_file(mem.join("memory.json")).unwrap();
    let o = run(&["ask", "--memory", m, "--window", "3", "--user", "u1", "Where?"]);
    let e = err(&o);
    assert!(!o.status.success() && e.contains("made with window 1") && !e.contains("loaded"), "{e}");
    let o = run(&["ask", "--memory", m, "--user", "u1", "--k", "2", "Where is Caroline moving?"]);
    assert!(o.status.success(), "window from the KV: {}", err(&o));
    assert!(mem.join("memory.json").exists(), "the record is written at the next open");

    // A memory held by another process (a server, an ingest) is refused at
    // once, before any model loads.
    let lock = std::fs::OpenOptions::new().write(true).open(mem.join("LOCK")).unwrap();
    lock.try_lock().unwrap();
    let o = run(&["ingest", "--memory", m, "--user", "u1", "--locomo", d]);
    let e = err(&o);
    assert!(!o.status.success() && e.contains("in use by another process") && !e.contains("loaded"), "{e}");
    drop(lock);
}

const EVAL_LOCOMO: &str = r#"[{"sample_id": "s1",
  "conversation": {"speaker_a": "Caroline", "speaker_b": "Melanie",
    "session_1_date_time": "1:56 pm on 8 May, 2023",
    "session_1": [
      {"speaker": "Caroline", "dia_id": "D1:1", "text": "I adopted a grey cat named Miso last spring."},
      {"speaker": "Melanie", "dia_id": "D1:2", "text": "I ran a charity race for mental health on Saturday."},
      {"speaker": "Caroline", "dia_id": "D1:3", "text": "I am moving to Lisbon in September to study counselling."},
      {"speaker": "Melanie", "dia_id": "D1:4", "text": "We took the kids camping at the beach last weekend."}]},
  "qa": [{"question": "Where is Caroline moving?", "answer": "Lisbon", "evidence": ["D1:3"], "category": 4},
         {"question": "What is the name of Caroline's cat?", "answer": "Miso", "evidence": ["D1:1"], "category": 4},
         {"question": "Where did Melanie go camping?", "answer": "the beach", "evidence": ["D1:4"], "category": 4},
         {"question": "Is this adversarial?", "evidence": [], "category": 5}]}]"#;

fn eval(data: &Path, out: &Path, batch: &str) -> Value {
    let (d, o) = (data.to_str().unwrap(), out.to_str().unwrap());
    let args = [
        "eval",
        "locomo",
        "--data",
        d,
        "--out",
        o,
        "--modes",
        "kv,prompt,none",
        "--k",
        "1,2",
        "--window",
        "0,1",
        "--batch",
        batch,
        "--ttft-questions",
        "1",
        "--max-tokens",
        "8",
    ];
    let r = run(&args);
    assert!(r.status.success(), "{}", err(&r));
    serde_json::from_str(&std::fs::read_to_string(out.join("locomo.json")).unwrap()).unwrap()
}

/// Every mode, k and window is answered and scored for every question;
/// answering in batches of one question or of two gives the same answers
/// (batching only changes which sequences share a forward pass); TTFT is
/// measured on the first questions only.
#[test]
fn eval_locomo_answers_every_variant_in_batches() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("conv.json");
    std::fs::write(&data, EVAL_LOCOMO).unwrap();
    let one = eval(&data, &dir.path().join("one"), "1");
    let two = eval(&data, &dir.path().join("two"), "2");

    let rows = one["summary"].as_array().unwrap();
    assert_eq!(rows.len(), 2 * 2 + 2 + 1, "kv × 2 windows × 2 k, prompt × 2 k, none: {rows:?}");
    assert!(rows.iter().all(|r| r["n"] == 3), "three scored questions (category 5 is not): {rows:?}");
    let row = |mode: &str, k: u64, window: Option<u64>| {
        rows.iter().find(|r| r["mode"] == mode && r["k"] == k && r["window"].as_u64() == window).unwrap()
    };
    assert_eq!(row("prompt", 1, None)["recall"], 1.0, "each question's evidence ranks first");
    assert!(row("none", 0, None)["recall"].is_null(), "nothing is retrieved without memory");
    assert!(row("kv", 2, Some(1))["agreement"].is_number() && row("kv", 2, Some(1))["kl_mean"].is_number());
    assert!(row("prompt", 2, None)["agreement"].is_null());

    let answers = |r: &Value| -> Vec<(String, u64, Option<u64>, u64, String)> {
        r["answers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                let s = |f: &str| a[f].as_str().unwrap().to_string();
                (
                    s("mode"),
                    a["k"].as_u64().unwrap(),
                    a["window"].as_u64(),
                    a["question"].as_u64().unwrap(),
                    s("answer"),
                )
            })
            .collect()
    };
    assert_eq!(answers(&one), answers(&two), "batch size changed an answer");
    assert_eq!(answers(&one).len(), 3 * 7);
    for a in one["answers"].as_array().unwrap() {
        let timed = a["ttft_ms"].as_f64().is_some();
        assert_eq!(timed, a["question"] == 0, "TTFT on the first question only: {a}");
    }
    for a in one["answers"].as_array().unwrap() {
        let (f1, answer) = (a["f1"].as_f64().unwrap(), a["answer"].as_str().unwrap());
        assert!((0.0..=1.0).contains(&f1), "{a}");
        assert!(!answer.contains('\n'), "answers are cut at the first newline: {a}");
    }
    assert_eq!(one["retriever"], "hybrid");
    assert_eq!(one["prompts"]["instruction"], inferscale_memory::ANSWER_INSTRUCTION);
    assert_eq!(one["prompts"]["turn"], "system");

    // The table and chart are redrawn from the JSON alone.
    std::fs::remove_file(dir.path().join("one/locomo.md")).unwrap();
    let r = run(&["eval", "locomo", "--replot", "--out", dir.path().join("one").to_str().unwrap()]);
    assert!(r.status.success(), "{}", err(&r));
    assert!(std::fs::read_to_string(dir.path().join("one/locomo.md")).unwrap().contains("| kv | 1 | 2 | 3 |"));
}

/// With several KV formats, each window gets a memory per format; answers
/// from the second format on are compared with the first's.
#[test]
fn eval_locomo_compares_kv_formats_with_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("conv.json");
    std::fs::write(&data, EVAL_LOCOMO).unwrap();
    let out = dir.path().join("formats");
    let (d, o) = (data.to_str().unwrap(), out.to_str().unwrap());
    let r = run(&[
        "eval",
        "locomo",
        "--data",
        d,
        "--out",
        o,
        "--modes",
        "kv",
        "--k",
        "2",
        "--window",
        "0",
        "--kv-format",
        "f32,bf16",
        "--ttft-questions",
        "0",
        "--max-tokens",
        "8",
    ]);
    assert!(r.status.success(), "{}", err(&r));
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("locomo.json")).unwrap()).unwrap();
    let rows = report["summary"].as_array().unwrap();
    let formats: Vec<&str> = rows.iter().map(|r| r["kv_format"].as_str().unwrap()).collect();
    assert_eq!(formats, ["bf16", "f32"], "a row per format: {rows:?}");
    let (bf16, f32) = (&rows[0], &rows[1]);
    assert!(f32.get("agreement_vs_reference").is_none(), "the reference is not compared with itself: {f32}");
    let agreement = bf16["agreement_vs_reference"].as_f64().unwrap();
    let kl = bf16["kl_vs_reference"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&agreement), "{bf16}");
    // bf16 rounds f32 KV by 2⁻⁸ at most: the first token barely moves.
    assert!((0.0..0.01).contains(&kl), "KL of bf16 against f32: {kl}");
    for f in ["memory-w0-f32", "memory-w0-bf16"] {
        assert!(out.join(f).join("users").is_dir(), "{f}");
    }
    let md = std::fs::read_to_string(out.join("locomo.md")).unwrap();
    assert!(md.contains("| kv bf16 | 0 | 2 | 3 |") && md.contains("agreement vs ref"), "{md}");
}

#[test]
fn eval_retrieval_reports_recall_per_retriever() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("conv.json");
    std::fs::write(&data, EVAL_LOCOMO).unwrap();
    let json = dir.path().join("recall.json");
    let r =
        run(&["eval", "retrieval", "--data", data.to_str().unwrap(), "--k", "1,4", "--json", json.to_str().unwrap()]);
    assert!(r.status.success(), "{}", err(&r));
    let table = String::from_utf8_lossy(&r.stdout);
    for retriever in ["dense", "lexical", "hybrid"] {
        assert!(table.contains(&format!("| {retriever} | 4 | 3 | 1.000 |")), "all evidence within k = 4: {table}");
    }
    let rows: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let hybrid_1 = rows.as_array().unwrap().iter().find(|r| r["retriever"] == "hybrid" && r["k"] == 1).unwrap();
    assert_eq!(hybrid_1["recall"], 1.0, "{rows}");

    let r = run(&["eval", "retrieval", "--data", data.to_str().unwrap(), "--retriever", "bm25"]);
    assert!(!r.status.success() && err(&r).contains("`bm25` is not one of dense, lexical, hybrid"), "{}", err(&r));
}
