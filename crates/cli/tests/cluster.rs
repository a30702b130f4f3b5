//! The cluster end to end on loopback, with real processes: shard moves
//! between `inferscale worker` processes over gRPC (SmolLM2, CPU).

#![allow(clippy::unwrap_used)] // tests fail loudly on unexpected errors

mod common;

use common::{Proc, spawn};
use inferscale_proto as pb;
use pb::worker_client::WorkerClient;
use tonic::transport::Channel;

fn worker(mem: &std::path::Path) -> Proc {
    let args = ["worker", "--listen", "127.0.0.1:0", "--memory", mem.to_str().unwrap(), "--window", "2"];
    spawn(&args, "gRPC on ")
}

async fn client(addr: &str) -> WorkerClient<Channel> {
    let max = inferscale_worker::transfer::MAX_MESSAGE_BYTES;
    WorkerClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(max)
        .max_encoding_message_size(max)
}

fn unit(id: &str, speaker: &str, text: &str) -> pb::MemoryUnit {
    pb::MemoryUnit {
        id: id.into(),
        speaker: speaker.into(),
        text: text.into(),
        time: "8 May 2023".into(),
        ..Default::default()
    }
}

fn units() -> Vec<pb::MemoryUnit> {
    vec![
        unit("D1:1", "Caroline", "I adopted a grey cat named Miso last spring."),
        unit("D1:2", "Melanie", "I ran a charity race for mental health on Saturday."),
        unit("D1:3", "Caroline", "I'm moving to Lisbon in September to study counselling."),
        unit("D1:4", "Melanie", "I painted a lake at sunrise and hung it in my kitchen."),
        unit("D1:5", "Caroline", "My favourite food is spicy ramen from the corner shop."),
    ]
}

/// A greedy answer: (text, retrieved fact ids), or the status it failed with.
async fn ask(
    c: &mut WorkerClient<Channel>,
    user: &str,
    question: &str,
) -> Result<(String, Vec<String>), tonic::Status> {
    let req = pb::GenerateRequest {
        user: user.into(),
        messages: vec![pb::ChatMessage { role: "user".into(), content: question.into() }],
        mode: pb::MemoryMode::Kv as i32,
        k: 3,
        sampling: Some(pb::Sampling { max_tokens: 16, ..Default::default() }),
        ..Default::default()
    };
    let mut stream = c.generate(req).await?.into_inner();
    let mut text = String::new();
    while let Some(ev) = stream.message().await? {
        match ev.event {
            Some(pb::generate_event::Event::Token(t)) => text.push_str(&t.text),
            Some(pb::generate_event::Event::Finished(f)) => return Ok((text, f.fact_ids)),
            None => {}
        }
    }
    panic!("the stream ended without a Finished event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_moves_between_workers_and_answers_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let (wa, wb) = (worker(&dir.path().join("a")), worker(&dir.path().join("b")));
    let (mut a, mut b) = (client(&wa.addr).await, client(&wb.addr).await);
    let user = "tenant/caroline";
    a.ingest(pb::IngestRequest { user: user.into(), units: units(), ..Default::default() }).await.unwrap();
    let question = "What is the name of Caroline's cat?";
    let before = ask(&mut a, user, question).await.unwrap();

    // A damaged record is refused whole and stores nothing.
    {
        let mut s = a
            .export_shard(pb::ExportShardRequest { user: user.into(), with_kv: true, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        let mut first = s.message().await.unwrap().unwrap();
        assert!(!first.kv_header.is_empty());
        first.records[0].crc32 ^= 1;
        let bad = tokio_stream::iter(vec![first]);
        let err = b.import_shard(bad).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::DataLoss, "{err}");
        assert!(b.list_users(pb::ListUsersRequest {}).await.unwrap().into_inner().users.is_empty());
    }

    // The move: snapshot, freeze, catch-up, commit on b.
    let sent = a
        .send_shard(pb::SendShardRequest {
            user: user.into(),
            to: wb.addr.clone(),
            with_kv: true,
            freeze: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let imported = sent.imported.unwrap();
    assert_eq!((imported.facts, imported.with_kv, imported.kept), (5, 5, 0));
    eprintln!(
        "moved {} facts, {:.1} MB in {:.3} s ({:.0} MB/s)",
        imported.facts,
        imported.bytes as f64 / 1e6,
        sent.seconds,
        imported.bytes as f64 / 1e6 / sent.seconds
    );
    // Frozen on the source: writes wait (retryably), reads go on.
    let err = a
        .ingest(pb::IngestRequest {
            user: user.into(),
            units: vec![unit("D2:1", "Caroline", "Hi.")],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(err.message().contains("moving"), "{err}");
    assert_eq!(ask(&mut a, user, question).await.unwrap(), before);

    // Released with drop: the source refuses the user as moved instead of
    // answering without its memory; the destination answers exactly as the
    // source did, from the same facts and their moved KV.
    a.release_shard(pb::ReleaseShardRequest { user: user.into(), drop: true }).await.unwrap();
    let err = ask(&mut a, user, question).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(a.list_users(pb::ListUsersRequest {}).await.unwrap().into_inner().users.is_empty());
    assert_eq!(b.list_users(pb::ListUsersRequest {}).await.unwrap().into_inner().users, vec![user.to_string()]);
    let after = ask(&mut b, user, question).await.unwrap();
    assert_eq!(after, before, "greedy answer and retrieved facts after the move");
    let listed = b.list_memories(pb::ListMemoriesRequest { user: user.into() }).await.unwrap().into_inner();
    let ids: Vec<String> = listed.units.iter().map(|u| u.id.clone()).collect();
    assert_eq!(ids, units().iter().map(|u| u.id.clone()).collect::<Vec<_>>());
    // The destination takes the user's writes.
    b.ingest(pb::IngestRequest {
        user: user.into(),
        units: vec![unit("D2:1", "Caroline", "Hi.")],
        ..Default::default()
    })
    .await
    .unwrap();
}
