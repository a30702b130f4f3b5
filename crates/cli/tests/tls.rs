//! Mutual TLS on the worker API: a worker started with a certificate
//! accepts only clients presenting one from its CA; without TLS it refuses
//! to listen beyond loopback, before loading anything.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use common::spawn;
use inferscale_cluster::testing::TestCa;
use inferscale_proto as pb;
use inferscale_proto::tls::{Security, TlsFiles};
use pb::worker_client::WorkerClient;

/// `ListUsers` through `security`: Ok, or why the call failed.
async fn list(addr: &str, security: &Security) -> Result<usize, String> {
    let channel = security.endpoint(addr).map_err(|e| e.to_string())?.connect().await.map_err(|e| format!("{e:?}"))?;
    let users = WorkerClient::new(channel).list_users(pb::ListUsersRequest {}).await.map_err(|e| format!("{e:?}"))?;
    Ok(users.into_inner().users.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_tls_serves_only_clients_with_a_certificate_from_its_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ours_dir = dir.path().join("ours");
    let theirs_dir = dir.path().join("theirs");
    std::fs::create_dir_all(&ours_dir).unwrap();
    std::fs::create_dir_all(&theirs_dir).unwrap();
    let ours = TestCa::new(&ours_dir).unwrap();
    let theirs = TestCa::new(&theirs_dir).unwrap();
    let (cert, key) = ours.issue("worker", &["127.0.0.1"]).unwrap();
    let (client_cert, client_key) = ours.issue("router", &["router"]).unwrap();
    let (rogue_cert, rogue_key) = theirs.issue("rogue", &["rogue"]).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let mem = dir.path().join("mem");
    let args = [
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--memory",
        &s(&mem),
        "--tls-cert",
        &s(&cert),
        "--tls-key",
        &s(&key),
        "--tls-ca",
        &s(&ours.ca()),
    ];
    let w = spawn(&args, "gRPC on ");

    let with = |cert: &std::path::Path, key: &std::path::Path, ca: &std::path::Path| {
        Security::from_files(Some(&TlsFiles { cert: cert.into(), key: key.into(), ca: ca.into() })).unwrap()
    };
    // A client of the same CA is served.
    assert_eq!(list(&w.addr, &with(&client_cert, &client_key, &ours.ca())).await, Ok(0));
    // Plaintext gets nowhere.
    assert!(list(&w.addr, &Security::Plaintext).await.is_err(), "a plaintext client was served");
    // A certificate from another CA is refused, even by a client that
    // trusts the worker's CA.
    let rogue = with(&rogue_cert, &rogue_key, &ours.ca());
    assert!(list(&w.addr, &rogue).await.is_err(), "a client with a foreign certificate was served");
    // A client that does not trust the worker's CA refuses the worker.
    let distrust = with(&client_cert, &client_key, &theirs.ca());
    assert!(list(&w.addr, &distrust).await.is_err(), "a client accepted a worker its CA did not sign");
}

#[test]
fn a_worker_without_tls_refuses_to_listen_beyond_loopback_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inferscale"))
        .args(["worker", "--listen", "0.0.0.0:0", "--memory", dir.path().join("m").to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it started: {err}");
    assert!(err.contains("needs mutual TLS") && err.contains("--insecure-plaintext"), "{err}");
    assert!(!err.contains("loaded"), "the refusal came after the model load: {err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "took {:?}", started.elapsed());
    // Half a set of TLS files is refused by name.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inferscale"))
        .args(["worker", "--tls-cert", "/nonexistent.pem"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--tls-key"), "{err}");
}
