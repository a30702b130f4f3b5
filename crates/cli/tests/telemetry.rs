//! Traces and metrics across real processes.
//!
//! A router and a worker run as separate processes and export their spans
//! to two real OTLP collectors: the router over OTLP/HTTP (protobuf) to
//! `oteltap`, which prints every span it receives as JSON; the worker over
//! OTLP/gRPC to `rotel`, which logs every span it receives. Both come from
//! PyPI (`scripts/test.sh` installs them). The test sends requests — one
//! of them carrying a client's `traceparent` — and checks that each
//! request is one trace whose spans link across the two processes, with
//! the phases a request goes through. It also scrapes and parses both
//! `/metrics` endpoints and checks that the histograms move.

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{http, http_with, json_call, python_path, spawn_env};
use serde_json::{Value, json};

/// A collector process whose output lines are kept; killed on drop.
struct Collector {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Collector {
    /// Starts `cmd` and waits for an output line containing `ready`.
    fn start(mut cmd: Command, ready: &str) -> Collector {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        for pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(strip_ansi(&line));
                }
            });
        }
        let c = Collector { child, lines };
        let until = Instant::now() + Duration::from_secs(30);
        while !c.lines().iter().any(|l| l.contains(ready)) {
            assert!(Instant::now() < until, "collector did not start:\n{}", c.lines().join("\n"));
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[derive(Debug, Clone)]
struct Span {
    trace: String,
    id: String,
    parent: String,
    name: String,
    attrs: HashMap<String, String>,
    /// `service.name` of the process that sent it, where the collector says.
    service: Option<String>,
}

/// oteltap prints one JSON span per line.
fn tap_spans(lines: &[String]) -> Vec<Span> {
    lines
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("spanId").is_some())
        .map(|v| {
            let attrs = v["attributes"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|kv| {
                            let val = kv["value"].as_object().and_then(|o| o.values().next()).cloned();
                            let val = match val {
                                Some(Value::String(s)) => s,
                                Some(other) => other.to_string(),
                                None => String::new(),
                            };
                            (kv["key"].as_str().unwrap_or("").to_string(), val)
                        })
                        .collect()
                })
                .unwrap_or_default();
            let s = |k: &str| v[k].as_str().unwrap_or("").to_string();
            Span {
                trace: s("traceId"),
                id: s("spanId"),
                parent: s("parentSpanId"),
                name: s("name"),
                attrs,
                service: None,
            }
        })
        .collect()
}

/// rotel's detailed debug log: resource attributes, then blocks of
/// `Trace ID : …`, `Parent ID : …`, `ID : …`, `Name : …` and
/// `-> key: Kind(value)` attribute lines.
fn rotel_spans(lines: &[String]) -> Vec<Span> {
    let mut spans = Vec::new();
    let mut service = None;
    let mut cur: Option<Span> = None;
    let field = |l: &str| l.split_once(':').map(|(_, v)| v.trim().to_string()).unwrap_or_default();
    for l in lines {
        let t = l.trim();
        if t.starts_with("ResourceSpans #") || t.starts_with("Span #") {
            spans.extend(cur.take());
        }
        if let Some(rest) = t.strip_prefix("-> ") {
            let Some((k, v)) = rest.split_once(": ") else { continue };
            let v = v.split_once('(').map_or(v, |(_, x)| x.strip_suffix(')').unwrap_or(x)).to_string();
            match cur.as_mut() {
                Some(span) => {
                    span.attrs.insert(k.to_string(), v);
                }
                None if k == "service.name" => service = Some(v),
                None => {}
            }
        } else if t.starts_with("Span #") {
            cur = Some(Span {
                trace: String::new(),
                id: String::new(),
                parent: String::new(),
                name: String::new(),
                attrs: HashMap::new(),
                service: service.clone(),
            });
        } else if let Some(span) = cur.as_mut() {
            if t.starts_with("Trace ID") {
                span.trace = field(t);
            } else if t.starts_with("Parent ID") {
                span.parent = field(t);
            } else if t.starts_with("ID ") || t.starts_with("ID:") {
                span.id = field(t);
            } else if t.starts_with("Name ") {
                span.name = field(t);
            }
        }
    }
    spans.extend(cur);
    spans
}

/// Prometheus text: `name{labels}` → value, checking the format as it goes
/// (every sample's family typed; histogram buckets cumulative, `+Inf`
/// equal to `_count`).
fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    let mut types: HashMap<String, String> = HashMap::new();
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            types.insert(name.to_string(), kind.to_string());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (key, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let name = key.split('{').next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| types.get(*f).is_some_and(|t| t == "histogram")))
            .unwrap_or(name);
        assert!(types.contains_key(family), "sample {key} has no # TYPE line");
        assert!(samples.insert(key.to_string(), value).is_none(), "sample {key} appears twice");
    }
    // Buckets: cumulative, and +Inf equals _count.
    let mut by_series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (k, v) in &samples {
        if let Some((head, rest)) = k.split_once("_bucket{") {
            let le = rest.split("le=\"").nth(1).unwrap().split('"').next().unwrap();
            let labels = rest.replace(&format!("le=\"{le}\""), "").replace(",}", "}").replace("{,", "{");
            let bound = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap() };
            by_series.entry(format!("{head}{{{labels}")).or_default().push((bound, *v));
        }
    }
    for (series, mut buckets) in by_series {
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{series}: buckets not cumulative");
        let (head, labels) = series.split_once('{').unwrap();
        let labels = labels.trim_end_matches('}');
        let count_key = if labels.is_empty() { format!("{head}_count") } else { format!("{head}_count{{{labels}}}") };
        assert_eq!(samples.get(&count_key), buckets.last().map(|b| &b.1), "{series}: +Inf bucket vs {count_key}");
    }
    samples
}

fn scrape(addr: &str) -> BTreeMap<String, f64> {
    let (status, headers, body) = http(addr, "GET", "/metrics", b"");
    assert_eq!(status, 200);
    assert!(headers.iter().any(|(k, v)| k == "content-type" && v.starts_with("text/plain")), "{headers:?}");
    parse_metrics(&String::from_utf8(body).unwrap())
}

fn metric(m: &BTreeMap<String, f64>, key: &str) -> f64 {
    *m.get(key).unwrap_or_else(|| panic!("no sample {key}"))
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

#[test]
fn one_trace_per_request_across_router_and_worker_and_metrics_move() {
    let py = python_path();
    let rotel_bin = py.join("rotel/rotel-agent");
    assert!(
        py.join("oteltap").is_dir() && rotel_bin.is_file(),
        "the OTLP collectors (PyPI oteltap, rotel) are not in {}: run scripts/test.sh, which installs them",
        py.display()
    );
    let dir = tempfile::tempdir().unwrap();

    let tap_port = free_port();
    let mut tap = Command::new("python3");
    tap.args(["-m", "oteltap", "--port", &tap_port.to_string()]).env("PYTHONPATH", &py);
    let tap = Collector::start(tap, "Listening");

    let (grpc_port, http_port) = (free_port(), free_port());
    let mut rotel = Command::new(&rotel_bin);
    rotel
        .arg("start")
        .args(["--otlp-grpc-endpoint", &format!("127.0.0.1:{grpc_port}")])
        .args(["--otlp-http-endpoint", &format!("127.0.0.1:{http_port}")])
        .args(["--exporter", "blackhole", "--debug-log", "traces", "--debug-log-verbosity", "detailed"])
        .args(["--traces-batch-timeout", "100ms"])
        .arg("--pid-file")
        .arg(dir.path().join("rotel.pid"))
        .arg("--log-file")
        .arg(dir.path().join("rotel.log"));
    let rotel = Collector::start(rotel, "Starting Rotel");

    let grpc_endpoint = format!("http://127.0.0.1:{grpc_port}");
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mem = dir.path().join("mem");
    let worker = spawn_env(
        &["worker", "--listen", "127.0.0.1:0", "--http-listen", &metrics_addr, "--window", "2"]
            .into_iter()
            .chain(["--memory", mem.to_str().unwrap()])
            .collect::<Vec<_>>(),
        "gRPC on ",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", grpc_endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    let tap_endpoint = format!("http://127.0.0.1:{tap_port}");
    let router = spawn_env(
        &["router", "--listen", "127.0.0.1:0", "--worker", &worker.addr],
        "API on ",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", tap_endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    let r = router.addr.as_str();
    let (status, _, _) = http(&metrics_addr, "GET", "/readyz", b"");
    assert_eq!(status, 200, "worker /readyz");
    let worker_before = scrape(&metrics_addr);
    let router_before = scrape(r);

    let turns = json!([
        {"id": "D1:1", "speaker": "Ann", "text": "I went camping at Lake Tahoe last summer.", "time": "8 May 2023"},
        {"id": "D1:2", "speaker": "Ann", "text": "My dog Rex came with me.", "time": "8 May 2023"},
        {"id": "D1:3", "speaker": "Ann", "text": "We hiked to Eagle Lake on the second day.", "time": "8 May 2023"},
    ]);
    let (s, v) = json_call(r, "POST", "/v1/memories", &json!({"user": "ann", "window": 2, "turns": turns}));
    assert_eq!(s, 200, "{v}");

    let ask = |mode: &str, stream: bool| {
        json!({"model": "smollm2", "user": "ann", "max_tokens": 4, "ignore_eos": true, "stream": stream,
               "memory": {"mode": mode, "k": 3},
               "messages": [{"role": "user", "content": "Where did Ann go camping?"}]})
    };
    // (a) kv, answered whole, continuing the client's trace.
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let (s, _, b) = http_with(
        r,
        "POST",
        "/v1/chat/completions",
        &[("traceparent", &traceparent)],
        ask("kv", false).to_string().as_bytes(),
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    // (b) prompt mode, streamed; (c) kv, streamed.
    for mode in ["prompt", "kv"] {
        let (s, _, b) = http(r, "POST", "/v1/chat/completions", ask(mode, true).to_string().as_bytes());
        assert_eq!(s, 200);
        assert!(String::from_utf8_lossy(&b).contains("[DONE]"));
    }

    // Wait for every request's trace to arrive whole: three chat traces,
    // each with its worker's decode span.
    let chat = "POST /v1/chat/completions";
    let until = Instant::now() + Duration::from_secs(30);
    let (router_spans, worker_spans) = loop {
        let (rs, ws) = (tap_spans(&tap.lines()), rotel_spans(&rotel.lines()));
        let chats: Vec<&Span> = rs.iter().filter(|s| s.name == chat).collect();
        let decoded = chats.iter().filter(|c| ws.iter().any(|w| w.trace == c.trace && w.name == "decode")).count();
        if (chats.len() == 3 && decoded == 3) || Instant::now() > until {
            break (rs, ws);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let dump = || format!("router spans: {router_spans:#?}\nworker spans: {worker_spans:#?}");

    // The worker's spans come from the worker process, under its own name.
    assert!(!worker_spans.is_empty(), "{}", dump());
    assert!(worker_spans.iter().all(|s| s.service.as_deref() == Some("inferscale-worker")), "{}", dump());

    // One trace per chat request.
    let chats: Vec<&Span> = router_spans.iter().filter(|s| s.name == chat).collect();
    assert_eq!(chats.len(), 3, "{}", dump());
    let mut traces: Vec<&str> = chats.iter().map(|s| s.trace.as_str()).collect();
    traces.sort();
    traces.dedup();
    assert_eq!(traces.len(), 3, "chat requests share traces:\n{}", dump());
    // (a) continues the client's trace under the client's span.
    let a = chats.iter().find(|s| s.trace == CLIENT_TRACE).unwrap_or_else(|| panic!("{}", dump()));
    assert_eq!(a.parent, CLIENT_SPAN);
    for c in &chats {
        assert_eq!(c.attrs.get("http.response.status_code").map(String::as_str), Some("200"), "{c:?}");
        assert_eq!(c.attrs.get("http.route").map(String::as_str), Some("/v1/chat/completions"));
        let one = |name: &str, parent: &str| -> Span {
            let found: Vec<&Span> = router_spans
                .iter()
                .chain(&worker_spans)
                .filter(|s| s.trace == c.trace && s.name == name && s.parent == parent)
                .collect();
            assert_eq!(found.len(), 1, "trace {}: {name} under {parent}:\n{}", c.trace, dump());
            found[0].clone()
        };
        let route = one("route", &c.id);
        // Across the process boundary: the worker's span is the route's child.
        let generate = one("generate", &route.id);
        assert!(worker_spans.iter().any(|w| w.id == generate.id), "generate must come from the worker");
        let mode = generate.attrs.get("mode").cloned().unwrap_or_default();
        let retrieve = one("retrieve", &generate.id);
        assert_eq!(retrieve.attrs.get("k").map(String::as_str), Some("3"), "{retrieve:?}");
        assert_eq!(retrieve.attrs.get("candidates").map(String::as_str), Some("3"), "{retrieve:?}");
        one("queue", &generate.id);
        let compose = one("compose", &generate.id);
        let prefill = one("prefill", &generate.id);
        assert!(prefill.attrs.get("tokens").is_some_and(|t| t.parse::<u64>().unwrap() > 0), "{prefill:?}");
        let decode = one("decode", &generate.id);
        assert_eq!(decode.attrs.get("tokens").map(String::as_str), Some("4"), "{decode:?}");
        let injects: Vec<&Span> = worker_spans.iter().filter(|s| s.trace == c.trace && s.name == "inject").collect();
        match mode.as_str() {
            "kv" => {
                let inject = one("inject", &compose.id);
                for k in ["facts", "tokens", "bytes"] {
                    assert!(inject.attrs.get(k).is_some_and(|v| v.parse::<u64>().unwrap() > 0), "{inject:?}");
                }
            }
            "prompt" => assert!(injects.is_empty(), "prompt mode injects nothing: {injects:?}"),
            other => panic!("mode {other:?}"),
        }
    }
    // The ingest, too, is one trace across both processes.
    let ingest = router_spans.iter().find(|s| s.name == "POST /v1/memories").unwrap_or_else(|| panic!("{}", dump()));
    assert!(
        worker_spans.iter().any(|w| w.name == "ingest" && w.trace == ingest.trace && w.parent == ingest.id),
        "{}",
        dump()
    );

    // Metrics: both endpoints parse, and the histograms moved.
    let w = scrape(&metrics_addr);
    let moved = |key: &str, by: f64| {
        assert_eq!(metric(&w, key) - worker_before.get(key).copied().unwrap_or(0.0), by, "worker {key}");
    };
    moved("inferscale_worker_ttft_seconds_count{mode=\"kv\"}", 2.0);
    moved("inferscale_worker_ttft_seconds_count{mode=\"prompt\"}", 1.0);
    moved("inferscale_worker_tpot_seconds_count{mode=\"kv\"}", 2.0);
    moved("inferscale_worker_queue_seconds_count", 3.0);
    moved("inferscale_worker_requests_total{status=\"finished\"}", 3.0);
    // The two kv requests found their 3 facts each cached (encoded by the
    // ingest; the CPU backend's device memory is labelled host) and
    // injected them all: nothing read from disk, nothing prefilled.
    moved("inferscale_worker_kv_cache_hits_total{tier=\"host\"}", 6.0);
    moved("inferscale_worker_kv_cache_misses_total", 0.0);
    moved("inferscale_worker_memory_tokens_total{path=\"prefilled\"}", 0.0);
    assert!(metric(&w, "inferscale_worker_memory_tokens_total{path=\"injected\"}") > 0.0);
    assert!(metric(&w, "inferscale_worker_ttft_seconds_sum{mode=\"kv\"}") > 0.0);
    assert!(metric(&w, "inferscale_worker_batch_rows_count") > 0.0);
    // One observation of each per step; a step computes at least a token a
    // row, and the prompt-mode request's prefill computed many more.
    let steps = metric(&w, "inferscale_worker_batch_rows_count");
    assert_eq!(metric(&w, "inferscale_worker_batch_tokens_count"), steps);
    let (rows, tokens) =
        (metric(&w, "inferscale_worker_batch_rows_sum"), metric(&w, "inferscale_worker_batch_tokens_sum"));
    assert!(tokens >= rows + 50.0, "{tokens} tokens computed in {rows} step rows");
    assert!(metric(&w, "inferscale_worker_step_seconds_count") > 0.0);
    assert_eq!(metric(&w, "inferscale_worker_requests_waiting"), 0.0);
    assert_eq!(metric(&w, "inferscale_worker_requests_running"), 0.0);
    assert_eq!(metric(&w, "inferscale_worker_memory_units"), 3.0);
    assert!(metric(&w, "inferscale_worker_kv_blocks") > 0.0);
    assert!(metric(&w, "inferscale_worker_memory_bytes{tier=\"host\"}") > 0.0);
    assert!(metric(&w, "inferscale_worker_memory_bytes{tier=\"disk\"}") > 0.0);
    metric(&w, "inferscale_worker_shards_sent_total");
    let rm = scrape(r);
    let router_moved = |key: &str| metric(&rm, key) - router_before.get(key).copied().unwrap_or(0.0);
    assert_eq!(router_moved("inferscale_ttft_seconds_count{mode=\"kv\"}"), 2.0);
    assert_eq!(router_moved("inferscale_ttft_seconds_count{mode=\"prompt\"}"), 1.0);
    assert_eq!(router_moved("inferscale_requests_total{route=\"/v1/chat/completions\",status=\"200\"}"), 3.0);
    assert!(router_moved("inferscale_tpot_seconds_count{mode=\"kv\"}") >= 1.0);
}

/// A shard move between two worker processes, asked for by a caller with a
/// trace of its own, is one trace: the source's `send_shard` continues the
/// caller's span, its `export_shard` is a child, and the destination's
/// `import_shard` (another process) is a child of the source's `send_shard`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_move_is_one_trace_across_both_workers() {
    use inferscale_proto as pb;
    let py = python_path();
    assert!(py.join("oteltap").is_dir(), "oteltap is not in {}: run scripts/test.sh", py.display());
    let dir = tempfile::tempdir().unwrap();
    let tap_port = free_port();
    let mut tap = Command::new("python3");
    tap.args(["-m", "oteltap", "--port", &tap_port.to_string()]).env("PYTHONPATH", &py);
    let tap = Collector::start(tap, "Listening");
    let endpoint = format!("http://127.0.0.1:{tap_port}");
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let start = |name: &str| {
        let mem = dir.path().join(name);
        spawn_env(
            &["worker", "--listen", "127.0.0.1:0", "--window", "0", "--memory", mem.to_str().unwrap()],
            "gRPC on ",
            &env,
        )
    };
    let (wa, wb) = (start("a"), start("b"));
    let max = inferscale_worker::transfer::MAX_MESSAGE_BYTES;
    let mut a = pb::worker_client::WorkerClient::connect(format!("http://{}", wa.addr))
        .await
        .unwrap()
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let unit = |id: &str, text: &str| pb::MemoryUnit {
        id: id.into(),
        speaker: "Ann".into(),
        text: text.into(),
        time: "8 May 2023".into(),
        ..Default::default()
    };
    let units = vec![unit("D1:1", "I went camping at Lake Tahoe."), unit("D1:2", "My dog Rex came too.")];
    a.ingest(pb::IngestRequest { user: "ann".into(), units, ..Default::default() }).await.unwrap();

    let mut req = tonic::Request::new(pb::SendShardRequest {
        user: "ann".into(),
        to: wb.addr.clone(),
        with_kv: true,
        freeze: true,
        ..Default::default()
    });
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    req.metadata_mut().insert("traceparent", traceparent.parse().unwrap());
    let sent = a.send_shard(req).await.unwrap().into_inner();
    let bytes = sent.imported.unwrap().bytes;
    assert!(bytes > 0);

    let until = Instant::now() + Duration::from_secs(30);
    let spans = loop {
        let spans = tap_spans(&tap.lines());
        let names = ["send_shard", "export_shard", "import_shard"];
        if names.iter().all(|n| spans.iter().any(|s| s.trace == CLIENT_TRACE && s.name == *n)) || Instant::now() > until
        {
            break spans;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let one = |name: &str, parent: &str| -> Span {
        let found: Vec<&Span> =
            spans.iter().filter(|s| s.trace == CLIENT_TRACE && s.name == name && s.parent == parent).collect();
        assert_eq!(found.len(), 1, "{name} under {parent}: {spans:#?}");
        found[0].clone()
    };
    let send = one("send_shard", CLIENT_SPAN);
    one("export_shard", &send.id);
    let import = one("import_shard", &send.id);
    assert_eq!(import.attrs.get("bytes").map(String::as_str), Some(bytes.to_string().as_str()), "{import:?}");
}
