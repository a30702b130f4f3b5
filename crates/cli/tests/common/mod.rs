//! Helpers shared by the process-level tests: child processes that print
//! their address, and a plain HTTP/1.1 client.

#![allow(dead_code)] // each test file uses its own subset

pub mod cluster;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use serde_json::Value;

/// This crate's directory in the checkout running the tests: the runner's
/// `CARGO_MANIFEST_DIR` first, since a test binary reused from a shared
/// target directory may have been compiled in another checkout, whose path
/// `env!` froze in.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// A child process killed on drop; `addr` is what it printed after `marker`.
pub struct Proc {
    pub child: Child,
    pub addr: String,
    /// The lines the child wrote to stderr so far (not its successful
    /// requests' log lines).
    pub stderr: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    /// The child's stderr lines so far that contain `needle`.
    pub fn stderr_lines(&self, needle: &str) -> Vec<String> {
        let lines = self.stderr.lock().unwrap_or_else(|e| e.into_inner());
        lines.iter().filter(|l| l.contains(needle)).cloned().collect()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `inferscale args…` and waits (up to 3 minutes) for the stderr line
/// containing `marker`, taking the address that follows it.
pub fn spawn(args: &[&str], marker: &str) -> Proc {
    spawn_env(args, marker, &[])
}

/// [`spawn`] with extra environment variables.
pub fn spawn_env(args: &[&str], marker: &str, env: &[(&str, &str)]) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_inferscale"))
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let marker = marker.to_string();
    let lines = Arc::new(Mutex::new(Vec::new()));
    let kept = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            // The request log of successful requests (hundreds of lines in a
            // load test) is neither repeated nor kept: in CI's log it buried
            // the line a failing test ends with. Failed requests and
            // everything else are.
            if !(line.contains(" inferscale::http ") && line.contains(" status=2")) {
                eprintln!("[child] {line}");
                kept.lock().unwrap_or_else(|e| e.into_inner()).push(line.clone());
            }
            if let Some(at) = line.find(&marker) {
                let rest = &line[at + marker.len()..];
                let addr = rest.trim_start_matches("http://").split(['/', ' ']).next().unwrap_or("").to_string();
                let _ = tx.send(addr);
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(180)).unwrap_or_else(|_| panic!("{args:?} did not start"));
    Proc { child, addr, stderr: lines }
}

/// One HTTP/1.1 exchange: (status, lower-cased headers, body).
pub fn http(addr: &str, method: &str, path: &str, body: &[u8]) -> (u16, Vec<(String, String)>, Vec<u8>) {
    http_as(None, addr, method, path, body)
}

/// [`http`] with a bearer key.
pub fn http_as(
    key: Option<&str>,
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.as_deref().map(|a| ("Authorization", a)).into_iter().collect();
    http_with(addr, method, path, &headers, body)
}

/// One HTTP/1.1 exchange with extra request headers.
pub fn http_with(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer (413) before reading a large body; ignore a reset.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_response(&raw)
}

pub fn parse_response(raw: &[u8]) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or_else(|| panic!("no response head: {raw:?}"));
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.lines();
    let status: u16 = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> =
        lines.filter_map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_lowercase(), v.trim().to_string()))).collect();
    let mut body = raw[end + 4..].to_vec();
    if headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked")) {
        body = dechunk(&body);
    }
    (status, headers, body)
}

pub fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..nl]).trim(), 16).unwrap_or(0);
        if n == 0 || b.len() < nl + 2 + n {
            break;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + n]);
        b = &b[nl + 4 + n..];
    }
    out
}

pub fn json_call(addr: &str, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, b) = http(addr, method, path, body.to_string().as_bytes());
    (status, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

/// Where the tests' Python packages are installed (`scripts/test.sh`
/// fills it: the OpenAI client, the OTLP collectors).
pub fn python_path() -> std::path::PathBuf {
    cache_home().join("python")
}

/// Where scripts/test.sh installs Mem0's Python client (`mem0ai`, pinned,
/// with what its import needs): apart from the openai client, whose
/// dependencies it pins differently.
#[allow(dead_code)] // not every test binary drives Mem0's client
pub fn mem0_path() -> std::path::PathBuf {
    cache_home().join("mem0")
}

fn cache_home() -> std::path::PathBuf {
    std::env::var_os("INFERSCALE_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/inferscale"))
}
