//! The vLLM-mode worker's gRPC API, driven over loopback by the worker
//! API's own client as a router drives it: memory calls on the core's
//! shard, shard moves between two such workers, and Generate relayed to
//! an HTTP server in vLLM's place.
//!
//! vLLM's server cannot run here (its PyPI wheel serves only on GPUs), so
//! Generate's far end is a stand-in that checks what a completions
//! request must carry (the prompt ids, the plan, the salt, token ids
//! asked for) and answers as vLLM 0.26's completions stream does; the
//! real server is driven in the H200 run (docs/vllm.md).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::response::IntoResponse;
use inferscale_proto as pb;
use inferscale_vllm::front::{Front, FrontConfig, serve};
use inferscale_vllm::memory_core::{AnyCore, Core, CoreConfig};
use pb::worker_client::WorkerClient;
use serde_json::{Value, json};
use tonic::Code;
use tonic::transport::Channel;

fn core(dir: &std::path::Path) -> Arc<Mutex<AnyCore>> {
    let cfg = CoreConfig {
        model: String::new(),
        random_shape: Some("smollm2-135m".into()),
        embedder: "random".into(),
        memory_dir: dir.to_path_buf(),
        window: 0,
        kv_cache_mb: 64,
        max_batch_tokens: 256,
        retriever: Default::default(),
        prompts: Default::default(),
    };
    let core = Core::open(&cfg, inferscale_engine::CpuBackend).expect("core opens");
    Arc::new(Mutex::new(AnyCore::Cpu(Box::new(core))))
}

fn front(core: Arc<Mutex<AnyCore>>, vllm: &str) -> Front {
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("address");
    serve(core, FrontConfig::new(addr, vllm, "served-model")).expect("front serves")
}

async fn client(f: &Front) -> WorkerClient<Channel> {
    WorkerClient::connect(format!("http://{}", f.addr())).await.expect("connects")
}

fn unit(id: &str, text: &str) -> pb::MemoryUnit {
    pb::MemoryUnit { id: id.into(), speaker: "Ana".into(), text: text.into(), ..Default::default() }
}

fn ingest(user: &str, units: Vec<pb::MemoryUnit>) -> pb::IngestRequest {
    pb::IngestRequest { user: user.into(), units, ..Default::default() }
}

async fn units(c: &mut WorkerClient<Channel>, user: &str) -> Vec<String> {
    let r = c.list_memories(pb::ListMemoriesRequest { user: user.into(), ids: Vec::new() }).await.expect("lists");
    r.into_inner().units.into_iter().map(|u| u.id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_calls_and_shard_moves_behave_as_a_native_workers() {
    let (dir_a, dir_b) = (tempfile::tempdir().expect("tmp"), tempfile::tempdir().expect("tmp"));
    let a = front(core(dir_a.path()), "http://127.0.0.1:9");
    let b = front(core(dir_b.path()), "http://127.0.0.1:9");
    let (mut ca, mut cb) = (client(&a).await, client(&b).await);

    let h = ca.health(pb::HealthRequest {}).await.expect("health").into_inner();
    assert!(h.ready);
    assert_eq!((h.model.as_str(), h.backend.as_str()), ("served-model", "vllm+cpu"));

    let facts = vec![
        unit("u1", "I adopted a cat named Miso."),
        unit("u2", "My sister lives in Porto."),
        unit("u3", "I run every Sunday morning."),
        unit("u4", "I am allergic to peanuts."),
        unit("u5", "My favourite film is Paprika."),
    ];
    let r = ca.ingest(ingest("ana", facts.clone())).await.expect("ingests").into_inner();
    assert_eq!((r.added, r.skipped), (5, 0));
    assert!(r.encoded_tokens > 0, "the facts' KV is encoded at ingest");
    let r = ca.ingest(ingest("ana", facts[..2].to_vec())).await.expect("re-ingests").into_inner();
    assert_eq!((r.added, r.skipped, r.encoded_tokens), (0, 2, 0));

    // Bad input is refused with a reason and stores nothing.
    let bad = ca.ingest(ingest("ana", vec![unit("u9", "fine"), unit("", "no id")])).await.expect_err("no id");
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    let mut wrong = ingest("ana", vec![unit("u9", "fine")]);
    wrong.window = Some(7);
    let bad = ca.ingest(wrong).await.expect_err("window");
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("context window of 0"), "{}", bad.message());
    assert_eq!(units(&mut ca, "ana").await, ["u1", "u2", "u3", "u4", "u5"]);

    ca.forget(pb::ForgetRequest { user: "ana".into(), unit_id: "u2".into() }).await.expect("forgets");
    let gone = ca.forget(pb::ForgetRequest { user: "ana".into(), unit_id: "u2".into() }).await.expect_err("twice");
    assert_eq!(gone.code(), Code::NotFound, "{gone:?}");
    let unknown =
        ca.list_memories(pb::ListMemoriesRequest { user: "bob".into(), ids: Vec::new() }).await.expect_err("no bob");
    assert_eq!(unknown.code(), Code::NotFound);

    let s = ca.stats(pb::StatsRequest {}).await.expect("stats").into_inner();
    assert_eq!((s.users, s.facts, s.window, s.running), (1, 4, 0, 0));
    let users = ca.list_users(pb::ListUsersRequest {}).await.expect("users").into_inner().users;
    assert_eq!(users, ["ana"]);

    // B holds a unit A lacks from before the move (a stale copy): the
    // shard replaces B's copy and the unit goes. (A unit that reaches B
    // during the copy is kept: crates/memory/tests/shard.rs.)
    cb.ingest(ingest("ana", vec![unit("b1", "I moved to Lisbon in May.")])).await.expect("ingests on b");
    let sent = ca
        .send_shard(pb::SendShardRequest {
            user: "ana".into(),
            to: b.addr().to_string(),
            with_kv: true,
            freeze: true,
            ..Default::default()
        })
        .await
        .expect("sends")
        .into_inner();
    let imported = sent.imported.expect("import report");
    assert_eq!((imported.facts, imported.with_kv, imported.kept, imported.dropped), (4, 4, 0, 1), "{imported:?}");
    assert_eq!(units(&mut cb, "ana").await, ["u1", "u3", "u4", "u5"]);

    // Frozen: A refuses the user's writes until released.
    let frozen = ca.ingest(ingest("ana", vec![unit("u6", "late")])).await.expect_err("frozen");
    assert_eq!(frozen.code(), Code::Unavailable, "{frozen:?}");
    // Marked as a move, not as a worker that is down, for the router.
    assert_eq!(pb::ErrorKind::of(&frozen), Some(pb::ErrorKind::Moving), "{frozen:?}");
    ca.release_shard(pb::ReleaseShardRequest { user: "ana".into(), drop: true }).await.expect("releases");
    let users = ca.list_users(pb::ListUsersRequest {}).await.expect("users").into_inner().users;
    assert!(users.is_empty(), "dropped at the source: {users:?}");
    // Moved: the source refuses the user's chats rather than answer without memory.
    let moved = ca.generate(chat("ana", "Where does my sister live?", pb::MemoryMode::Kv)).await;
    let moved = match moved {
        Err(e) => e,
        Ok(s) => s.into_inner().message().await.expect_err("refused"),
    };
    assert_eq!(moved.code(), Code::Unavailable, "{moved:?}");
    // A streamed error keeps its kind too (it travels in the trailers).
    assert_eq!(pb::ErrorKind::of(&moved), Some(pb::ErrorKind::Moving), "{moved:?}");
}

fn chat(user: &str, question: &str, mode: pb::MemoryMode) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: String::new(),
        user: user.into(),
        messages: vec![pb::ChatMessage { role: "user".into(), content: question.into() }],
        mode: mode as i32,
        k: 2,
        window: None,
        sampling: Some(pb::Sampling { max_tokens: 8, ..Default::default() }),
        deadline_ms: 30_000,
        ..Default::default()
    }
}

/// What the stand-in saw, and what it streams back.
#[derive(Clone, Default)]
struct StandIn {
    seen: Arc<Mutex<Vec<Value>>>,
    /// Token ids streamed, two per chunk, then `finish`.
    tokens: Vec<u32>,
    finish: &'static str,
}

async fn completions(
    axum::extract::State(s): axum::extract::State<StandIn>,
    Json(body): Json<Value>,
) -> axum::response::Response {
    s.seen.lock().expect("lock").push(body.clone());
    if body["max_tokens"] == json!(5) {
        // Slower than the caller's deadline.
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    }
    if body["max_tokens"] == json!(3) {
        let e = json!({"error": {"message": "This model's maximum context length is 8 tokens", "code": 400}});
        return (axum::http::StatusCode::BAD_REQUEST, Json(e)).into_response();
    }
    let mut out = String::new();
    let prompt = body["prompt"].as_array().map_or(0, Vec::len);
    for (i, pair) in s.tokens.chunks(2).enumerate() {
        let last = (i + 1) * 2 >= s.tokens.len();
        let chunk = json!({
            "id": "cmpl-1", "object": "text_completion", "model": "served-model",
            "choices": [{"index": 0, "text": "", "token_ids": pair,
                         "finish_reason": if last { json!(s.finish) } else { Value::Null }}],
        });
        out.push_str(&format!("data: {chunk}\n\n"));
    }
    let usage = json!({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": prompt,
        "completion_tokens": s.tokens.len(), "prompt_tokens_details": {"cached_tokens": 16}}});
    out.push_str(&format!("data: {usage}\n\ndata: [DONE]\n\n"));
    ([(axum::http::header::CONTENT_TYPE, "text/event-stream")], out).into_response()
}

async fn stand_in(s: StandIn) -> String {
    let app = axum::Router::new().route("/v1/completions", axum::routing::post(completions)).with_state(s);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// Runs one Generate: the tokens' texts, and the finish (or the error).
async fn generate(
    c: &mut WorkerClient<Channel>,
    req: pb::GenerateRequest,
) -> Result<(String, pb::Finished), tonic::Status> {
    let mut s = c.generate(req).await?.into_inner();
    let mut text = String::new();
    while let Some(e) = s.message().await? {
        match e.event {
            Some(pb::generate_event::Event::Token(t)) => text.push_str(&t.text),
            Some(pb::generate_event::Event::Finished(f)) => return Ok((text, f)),
            None => {}
        }
    }
    panic!("the stream ended without a finish")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_submits_the_composed_prompt_with_its_plan_and_relays_the_answer() {
    let dir = tempfile::tempdir().expect("tmp");
    let shared = core(dir.path());
    // Byte-level tokenizer: a token id is its byte.
    let answer: Vec<u32> = "In Porto END!".bytes().map(u32::from).collect();
    let s = StandIn { tokens: answer.clone(), finish: "length", ..Default::default() };
    let url = stand_in(s.clone()).await;
    let f = front(shared.clone(), &url);
    let mut c = client(&f).await;
    let facts =
        vec![unit("u1", "I adopted a cat named Miso."), unit("u2", "My sister lives in Porto."), unit("u3", "I run.")];
    c.ingest(ingest("ana", facts.clone())).await.expect("ingests");

    let (text, fin) =
        generate(&mut c, chat("ana", "Where does my sister live?", pb::MemoryMode::Kv)).await.expect("kv");
    assert_eq!(text, "In Porto END!");
    assert_eq!(fin.reason, "length");
    let usage = fin.usage.expect("usage");
    assert_eq!((usage.facts, usage.completion_tokens), (2, answer.len() as u32));
    assert_eq!(fin.fact_ids.len(), 2);
    let body = s.seen.lock().expect("lock").last().cloned().expect("a request reached vLLM");
    let prompt: Vec<u32> = serde_json::from_value(body["prompt"].clone()).expect("ids");
    assert_eq!(usage.prompt_tokens as usize, prompt.len());
    // Nothing was loaded (no vLLM worker here): no tokens claimed injected,
    // and vLLM's cached count is reported as its prefix cache's.
    assert_eq!((usage.injected_tokens, usage.cached_tokens), (0, 16));
    assert_eq!(body["model"], "served-model");
    assert_eq!((body["stream"].clone(), body["return_token_ids"].clone()), (json!(true), json!(true)));
    assert_eq!(body["max_tokens"], 8);
    let plan = &body["kv_transfer_params"]["inferscale"];
    assert!(plan.is_object(), "kv mode carries the plan: {body}");
    assert_eq!(body["cache_salt"], plan["salt"]);
    let chunks = plan["chunks"].as_array().expect("chunks");
    assert_eq!(chunks.len(), 3, "the header and two facts: {plan}");
    let end = chunks.last().map(|c| c["start"].as_u64().unwrap_or(0) + c["len"].as_u64().unwrap_or(0)).unwrap_or(0);
    let question: Vec<u32> = "Where does my sister live?".bytes().map(u32::from).collect();
    assert!(prompt.len() > end as usize, "the question follows the memory");
    let tail = &prompt[end as usize..];
    assert!(tail.windows(question.len()).any(|w| w == question), "the question's tokens follow the memory");
    let eos: Vec<u32> = serde_json::from_value(body["stop_token_ids"].clone()).expect("eos ids");
    assert!(!eos.is_empty(), "end of sequence is vLLM's to stop at");
    // The retrieved facts are in the prompt as text tokens, so vLLM's positions are right.
    for id in &fin.fact_ids {
        let fact = facts.iter().find(|f| &f.id == id).expect("a retrieved id is a stored unit");
        let text: Vec<u32> = fact.text.bytes().map(u32::from).collect();
        assert!(prompt[..end as usize].windows(text.len()).any(|w| w == text), "fact {id} in the prompt");
    }

    // Prompt mode: the same ids, no plan, and a salt of its own: a prefill
    // must never reuse the blocks kv mode injected for the same ids.
    let kv_salt = plan["salt"].clone();
    let (_, fin) =
        generate(&mut c, chat("ana", "Where does my sister live?", pb::MemoryMode::Prompt)).await.expect("p");
    let body = s.seen.lock().expect("lock").last().cloned().expect("request");
    assert!(body.get("kv_transfer_params").is_none(), "{body}");
    let prompt_salt = body["cache_salt"].as_str().expect("prompt mode is salted per user");
    assert!(prompt_salt.starts_with("inferscale-prompt-") && json!(prompt_salt) != kv_salt, "{prompt_salt}");
    let again: Vec<u32> = serde_json::from_value(body["prompt"].clone()).expect("ids");
    assert_eq!(again, prompt);
    assert_eq!(fin.usage.expect("usage").injected_tokens, 0);

    // A stop string cuts the text before it and ends the request as `stop`.
    let mut req = chat("ana", "Where does my sister live?", pb::MemoryMode::Kv);
    req.sampling.as_mut().expect("sampling").stop = vec!["END".into()];
    let (text, fin) = generate(&mut c, req).await.expect("stops");
    assert_eq!((text.as_str(), fin.reason.as_str()), ("In Porto ", "stop"));

    // vLLM's refusal reaches the caller as a bad request, with vLLM's reason.
    let mut req = chat("ana", "Where does my sister live?", pb::MemoryMode::Kv);
    req.sampling.as_mut().expect("sampling").max_tokens = 3;
    let e = generate(&mut c, req).await.expect_err("refused");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("maximum context length"), "{}", e.message());

    // Past the caller's deadline the worker stops waiting (and drops vLLM's stream).
    let mut req = chat("ana", "Where does my sister live?", pb::MemoryMode::Kv);
    req.sampling.as_mut().expect("sampling").max_tokens = 5;
    req.deadline_ms = 500;
    let e = generate(&mut c, req).await.expect_err("deadline");
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert!(e.message().contains("500 ms"), "{}", e.message());

    // Our own checks run before vLLM sees anything.
    let mut req = chat("ana", "Where does my sister live?", pb::MemoryMode::Kv);
    req.k = 1000;
    let before = s.seen.lock().expect("lock").len();
    let e = generate(&mut c, req).await.expect_err("k too large");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(s.seen.lock().expect("lock").len(), before);
    // Blend recomputes inside the engine's own forward pass: vLLM's is out of reach.
    let e =
        generate(&mut c, chat("ana", "Where does my sister live?", pb::MemoryMode::Blend)).await.expect_err("blend");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("needs the native engine"), "{}", e.message());
    // So does a completion with memory: its raw prompt has no configured
    // header to lead the prompt vLLM loads a prefix of.
    let mut req = chat("ana", "", pb::MemoryMode::Kv);
    (req.messages, req.prompt) = (Vec::new(), Some("My sister lives in".into()));
    let e = generate(&mut c, req).await.expect_err("completion");
    assert!(e.code() == Code::InvalidArgument && e.message().contains("a completion"), "{e:?}");
    assert_eq!(s.seen.lock().expect("lock").len(), before);

    // History goes after the memory, before the question.
    let mut req = chat("ana", "Where does my sister live?", pb::MemoryMode::Kv);
    let earlier = [("user", "I am planning a trip."), ("assistant", "Where to?")];
    for (i, (role, content)) in earlier.iter().enumerate() {
        req.messages.insert(i, pb::ChatMessage { role: role.to_string(), content: content.to_string() });
    }
    generate(&mut c, req).await.expect("with history");
    let body = s.seen.lock().expect("lock").last().cloned().expect("request");
    let with_history: Vec<u32> = serde_json::from_value(body["prompt"].clone()).expect("ids");
    let chunks = body["kv_transfer_params"]["inferscale"]["chunks"].as_array().cloned().expect("chunks");
    let end = chunks.last().map(|c| c["start"].as_u64().unwrap_or(0) + c["len"].as_u64().unwrap_or(0)).unwrap_or(0);
    let tail = &with_history[end as usize..];
    let at = |text: &str| {
        let ids: Vec<u32> = text.bytes().map(u32::from).collect();
        tail.windows(ids.len()).position(|w| w == ids).unwrap_or_else(|| panic!("{text:?} is not after the memory"))
    };
    assert!(at("I am planning a trip.") < at("Where to?") && at("Where to?") < at("Where does my sister live?"));

    // A request's own system prompt follows the memory block: the header the
    // memory's KV was made after stays the configured one, so it is served.
    let mut req = chat("ana", "Where does my sister live?", pb::MemoryMode::Kv);
    req.messages.insert(0, pb::ChatMessage { role: "system".into(), content: "Be terse.".into() });
    generate(&mut c, req).await.expect("with a system prompt of its own");
    let body = s.seen.lock().expect("lock").last().cloned().expect("request");
    let prompt: Vec<u32> = serde_json::from_value(body["prompt"].clone()).expect("ids");
    let chunks = body["kv_transfer_params"]["inferscale"]["chunks"].as_array().cloned().expect("chunks");
    let end = chunks.last().map(|c| c["start"].as_u64().unwrap_or(0) + c["len"].as_u64().unwrap_or(0)).unwrap_or(0);
    let after_memory = &prompt[end as usize..];
    let find = |text: &str| {
        let ids: Vec<u32> = text.bytes().map(u32::from).collect();
        after_memory.windows(ids.len()).position(|w| w == ids)
    };
    assert!(find("Be terse.").is_some_and(|i| Some(i) < find("Where does my sister live?")), "{after_memory:?}");

    // Embeddings come from the core's retrieval encoder.
    let e = c.embed(pb::EmbedRequest { model: "minilm".into(), input: vec!["a".into(), "b c".into()] }).await;
    let e = e.expect("embeds").into_inner();
    assert_eq!(e.data.len(), 2);
    assert!(!e.data[0].values.is_empty() && e.data[0].values.len() == e.data[1].values.len());

    let st = c.stats(pb::StatsRequest {}).await.expect("stats").into_inner();
    assert_eq!((st.requests_finished, st.requests_failed, st.running), (5, 5, 0), "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_without_a_vllm_server_is_unavailable() {
    let dir = tempfile::tempdir().expect("tmp");
    // A port nothing listens on.
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("binds").local_addr().expect("addr");
    let f = front(core(dir.path()), &format!("http://{free}"));
    let mut c = client(&f).await;
    let e = generate(&mut c, chat("ana", "Hello?", pb::MemoryMode::None)).await.expect_err("no vLLM");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("did not answer"), "{}", e.message());
}
