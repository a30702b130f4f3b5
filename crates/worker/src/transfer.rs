//! The gRPC side of shard moves: the export stream (batches of records
//! fetched from the engine thread, paced), the import (checked and staged
//! on disk off the engine thread, committed on it), and send (this worker's
//! export streamed into another worker's import).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inferscale_memory::{KvHeader, MemoryError, ShardRecord, Staging};
use inferscale_proto as pb;
use inferscale_telemetry::propagate;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tracing::Instrument;

use crate::core::{Command, ShardCommand};
use crate::error::WorkerError;
use crate::service::WorkerService;

/// Bytes of records per chunk: large enough to amortise a round trip to
/// the engine thread, small enough that fetching them (the KV read back
/// from the device) is a short pause between serving steps.
const CHUNK_BYTES: usize = 8 << 20;

/// Largest gRPC message a shard chunk may be (one fact's KV can exceed
/// `CHUNK_BYTES` on large models).
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// Fact ids handed to the engine thread per export call; a chunk of
/// `CHUNK_BYTES` uses a prefix of them (a SmolLM2 fact is about 1 MB).
const EXPORT_IDS: usize = 1024;

pub type ChunkStream = ReceiverStream<Result<pb::ShardChunk, Status>>;

fn shard_records(records: Vec<ShardRecord>) -> Vec<pb::ShardRecord> {
    records.into_iter().map(|r| pb::ShardRecord { crc32: r.checksum(), fact: r.fact, kv: r.kv }).collect()
}

/// Streams `req.user`'s shard (see `ExportShard` in the proto), traced
/// under `span`.
pub fn export(svc: WorkerService, req: pb::ExportShardRequest, span: tracing::Span) -> ChunkStream {
    let (tx, rx) = mpsc::channel(2);
    tokio::spawn(
        async move {
            if let Err(e) = export_into(&svc, req, &tx).await {
                let _ = tx.send(Err(e)).await;
            }
        }
        .instrument(span),
    );
    ReceiverStream::new(rx)
}

async fn export_into(
    svc: &WorkerService,
    req: pb::ExportShardRequest,
    tx: &mpsc::Sender<Result<pb::ShardChunk, Status>>,
) -> Result<(), Status> {
    let user = req.user;
    let (header, ids) =
        svc.call(|reply| Command::Shard(ShardCommand::ExportBegin { user: user.clone(), reply })).await??;
    let mut header = Some(header.encode());
    let started = Instant::now();
    let (mut sent_bytes, mut total) = (0u64, 0u32);
    let mut sent: HashSet<String> = HashSet::new();
    let mut pending = ids;
    let mut frozen = false;
    loop {
        let mut at = 0;
        while at < pending.len() {
            // A window of the ids still to send: a chunk takes a prefix of it.
            let ids = pending[at..(at + EXPORT_IDS).min(pending.len())].to_vec();
            let (records, used) = svc
                .call(|reply| {
                    Command::Shard(ShardCommand::Export {
                        user: user.clone(),
                        ids,
                        with_kv: req.with_kv,
                        max_bytes: CHUNK_BYTES,
                        reply,
                    })
                })
                .await??;
            sent.extend(pending[at..at + used].iter().cloned());
            at += used;
            total += records.len() as u32;
            sent_bytes += records.iter().map(|r| r.len() as u64).sum::<u64>();
            let chunk = pb::ShardChunk {
                user: user.clone(),
                kv_header: header.take().unwrap_or_default(),
                records: shard_records(records),
                last: false,
                total: 0,
            };
            if tx.send(Ok(chunk)).await.is_err() {
                return Ok(()); // the receiver went away
            }
            if req.max_bytes_per_sec > 0 {
                let due = Duration::from_secs_f64(sent_bytes as f64 / req.max_bytes_per_sec as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
            }
        }
        if !req.freeze || frozen {
            break;
        }
        // Writes stop here; what arrived during the copy follows it.
        let now = svc.call(|reply| Command::Shard(ShardCommand::Freeze { user: user.clone(), reply })).await?;
        pending = now.into_iter().filter(|id| !sent.contains(id)).collect();
        frozen = true;
    }
    let last =
        pb::ShardChunk { user, kv_header: header.take().unwrap_or_default(), records: Vec::new(), last: true, total };
    let _ = tx.send(Ok(last)).await;
    Ok(())
}

fn staging_error(e: MemoryError) -> Status {
    match e {
        MemoryError::KvMismatch { .. } => Status::failed_precondition(e.to_string()),
        MemoryError::Invalid { .. } | MemoryError::Corrupt { .. } => Status::data_loss(e.to_string()),
        e => Status::internal(e.to_string()),
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, MemoryError> + Send + 'static) -> Result<T, Status> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Status::internal(e.to_string()))?.map_err(staging_error)
}

/// Receives a shard (see `ImportShard` in the proto).
pub async fn import(
    svc: &WorkerService,
    mut stream: impl tokio_stream::Stream<Item = Result<pb::ShardChunk, Status>> + Unpin,
) -> Result<pb::ImportShardResponse, Status> {
    let first = stream.next().await.ok_or_else(|| Status::invalid_argument("the shard stream is empty"))??;
    let user = first.user.clone();
    if user.is_empty() {
        return Err(Status::invalid_argument("the shard names no user"));
    }
    let theirs: KvHeader = serde_json::from_slice(&first.kv_header)
        .map_err(|e| Status::invalid_argument(format!("the shard's first chunk has no valid KV header: {e}")))?;
    let (dir, ours) = svc.call(|reply| Command::Shard(ShardCommand::ImportTarget { reply })).await?;
    let u = user.clone();
    let mut staging = blocking(move || Staging::create(&dir, &u, &ours, &theirs)).await?;
    let mut next = Some(first);
    let mut count = 0usize;
    loop {
        let chunk = match next.take() {
            Some(c) => c,
            None => stream.next().await.ok_or_else(|| {
                Status::aborted("the shard stream ended before its last chunk; nothing was imported")
            })??,
        };
        if chunk.user != user {
            return Err(Status::invalid_argument(format!("a chunk for user {:?} in {user:?}'s shard", chunk.user)));
        }
        let mut records = Vec::with_capacity(chunk.records.len());
        for r in chunk.records {
            let rec = ShardRecord { fact: r.fact, kv: r.kv };
            if rec.checksum() != r.crc32 {
                return Err(Status::data_loss(format!(
                    "record {} of {user:?}'s shard fails its checksum; nothing was imported",
                    count + records.len()
                )));
            }
            records.push(rec);
        }
        count += records.len();
        staging = blocking(move || staging.append(&records).map(|()| staging)).await?;
        if chunk.last {
            if chunk.total as usize != count {
                return Err(Status::data_loss(format!(
                    "{user:?}'s shard announced {} records, {count} arrived; nothing was imported",
                    chunk.total
                )));
            }
            break;
        }
    }
    let staged = blocking(move || staging.finish()).await?;
    let report = svc
        .call(|reply| Command::Shard(ShardCommand::CommitImport { user: user.clone(), staged, reply }))
        .await?
        .map_err(|e| match e {
            WorkerError::Memory(m) => staging_error(m),
            e => Status::from(e),
        })?;
    let m = svc.metrics();
    m.shards_received.fetch_add(1, Ordering::Relaxed);
    m.shard_bytes_received.fetch_add(report.bytes, Ordering::Relaxed);
    Ok(pb::ImportShardResponse {
        facts: report.facts as u32,
        with_kv: report.with_kv as u32,
        kept: report.kept as u32,
        bytes: report.bytes,
    })
}

/// Sends a shard to another worker (see `SendShard` in the proto).
pub async fn send(svc: &WorkerService, req: pb::SendShardRequest) -> Result<pb::SendShardResponse, Status> {
    let started = Instant::now();
    if req.to.is_empty() {
        return Err(Status::invalid_argument("SendShard needs the receiving worker's address in `to`"));
    }
    let channel = tonic::transport::Endpoint::from_shared(pb::uri(&req.to))
        .map_err(|e| Status::invalid_argument(format!("worker address {:?}: {e}", req.to)))?
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("cannot reach worker {}: {e}", req.to)))?;
    let mut client = pb::worker_client::WorkerClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let chunks = export(
        svc.clone(),
        pb::ExportShardRequest {
            user: req.user.clone(),
            with_kv: req.with_kv,
            freeze: req.freeze,
            max_bytes_per_sec: req.max_bytes_per_sec,
        },
        tracing::info_span!("export_shard", user = %req.user),
    );
    // An export error ends the outgoing stream early (the receiver then
    // imports nothing) and is what this call reports.
    let failed: Arc<Mutex<Option<Status>>> = Arc::default();
    let slot = failed.clone();
    let outgoing = chunks.map_while(move |c| match c {
        Ok(c) => Some(c),
        Err(e) => {
            if let Ok(mut s) = slot.lock() {
                *s = Some(e);
            }
            None
        }
    });
    let mut outgoing = tonic::Request::new(outgoing);
    propagate::inject_current(&mut outgoing);
    let answer = client.import_shard(outgoing).await;
    if let Some(e) = failed.lock().ok().and_then(|mut s| s.take()) {
        return Err(e);
    }
    let imported = answer
        .map_err(|s| {
            Status::new(s.code(), format!("worker {} refused {:?}'s shard: {}", req.to, req.user, s.message()))
        })?
        .into_inner();
    let m = svc.metrics();
    m.shards_sent.fetch_add(1, Ordering::Relaxed);
    m.shard_bytes_sent.fetch_add(imported.bytes, Ordering::Relaxed);
    Ok(pb::SendShardResponse { imported: Some(imported), seconds: started.elapsed().as_secs_f64() })
}
