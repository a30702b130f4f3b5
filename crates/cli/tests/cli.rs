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
}
