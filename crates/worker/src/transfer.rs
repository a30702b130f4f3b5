//! The gRPC side of shard moves: the export stream (batches of records
//! fetched from the engine thread, paced), the import (checked and staged
//! on disk off the engine thread, committed on it), and send (this worker's
//! export streamed into another worker's import).
//!
//! A send may put the KV — the bulk of a shard — on a device [`link`]
//! (NCCL between two GPUs of one host) instead: the gRPC stream then
//! carries each chunk's records with their KV lengths and checksums (the
//! `frames` manifest), and the chunk's KV follows over the link in frames.
//! Both ends check every record's checksum either way.
//!
//! [`link`]: crate::link

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

use crate::error::WorkerError;
use crate::frames::{self, FrameError, Manifest, ManifestEntry, Reassembler};
use crate::handle::Handle;
use crate::link::{FrameLink, Links};
use crate::protocol::{Command, ShardCommand};

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

/// Frame size on a device link: a chunk's KV (`CHUNK_BYTES`, or one large
/// fact's) in one or a few frames; the buffer both ends hold on the device.
const LINK_FRAME_BYTES: usize = 16 << 20;

/// Why a worker without links refuses a move over one, on either end.
const NO_LINK: &str = "this worker has no device link (NCCL needs a CUDA worker and libnccl); send over gRPC";

pub type ChunkStream = ReceiverStream<Result<pb::ShardChunk, Status>>;

fn shard_records(records: Vec<ShardRecord>) -> Vec<pb::ShardRecord> {
    records.into_iter().map(|r| pb::ShardRecord { crc32: r.checksum(), fact: r.fact, kv: r.kv, kv_len: 0 }).collect()
}

/// Streams `req.user`'s shard (see `ExportShard` in the proto), traced
/// under `span`.
pub(crate) fn export(svc: Handle, req: pb::ExportShardRequest, span: tracing::Span) -> ChunkStream {
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
    svc: &Handle,
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
    // Whether the units that arrived during the copy have been sent.
    let mut caught_up = false;
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
                ..Default::default()
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
        if caught_up {
            break;
        }
        // What arrived during the copy follows it. With freeze, writes stop
        // here; without (a copy to a replica, which takes the user's writes
        // itself), the units that came meanwhile follow once, so that the
        // receiver, which drops what it held from before its import began,
        // is not left without a write that reached it just before.
        let now = match req.freeze {
            true => svc.call(|reply| Command::Shard(ShardCommand::Freeze { user: user.clone(), reply })).await?,
            false => {
                svc.call(|reply| Command::Shard(ShardCommand::ExportBegin { user: user.clone(), reply })).await??.1
            }
        };
        pending = now.into_iter().filter(|id| !sent.contains(id)).collect();
        caught_up = true;
    }
    let last =
        pb::ShardChunk { user, kv_header: header.take().unwrap_or_default(), last: true, total, ..Default::default() };
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
    off_thread(move || f().map_err(staging_error)).await
}

fn frame_error(e: FrameError) -> Status {
    match e {
        FrameError::ZeroFrame => Status::invalid_argument(e.to_string()),
        e => Status::data_loss(format!("{e}; nothing was imported")),
    }
}

fn link_error(e: WorkerError) -> Status {
    Status::unavailable(format!("{e}; nothing was imported"))
}

async fn off_thread<T: Send + 'static>(f: impl FnOnce() -> Result<T, Status> + Send + 'static) -> Result<T, Status> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Status::internal(e.to_string()))?
}

/// The receiving end of a shard whose KV comes over a device link.
struct Incoming {
    link: Box<dyn FrameLink>,
    frame_bytes: usize,
}

impl Incoming {
    /// Joins the link the shard's first chunk names, if it names one.
    async fn join(svc: &Handle, first: &pb::ShardChunk) -> Result<Option<Incoming>, Status> {
        if first.link_id.is_empty() {
            return Ok(None);
        }
        let links: Arc<dyn Links> = svc.links.as_ref().cloned().ok_or_else(|| Status::failed_precondition(NO_LINK))?;
        let frame_bytes =
            usize::try_from(first.frame_bytes).ok().filter(|&f| f > 0 && f <= MAX_MESSAGE_BYTES).ok_or_else(|| {
                Status::invalid_argument(format!("link frame size {} is out of range", first.frame_bytes))
            })?;
        let id = first.link_id.clone();
        let link = off_thread(move || links.connect(&id, false, frame_bytes).map_err(link_error)).await?;
        Ok(Some(Incoming { link, frame_bytes }))
    }

    /// Receives `records`' KV (the chunk's manifest) over the link; returns
    /// the whole records, checksums verified.
    async fn fill(mut self, records: Vec<pb::ShardRecord>) -> Result<(Incoming, Vec<ShardRecord>), Status> {
        let mut entries = Vec::with_capacity(records.len());
        for r in records {
            if !r.kv.is_empty() || r.kv_len > MAX_MESSAGE_BYTES as u64 {
                return Err(Status::invalid_argument(format!(
                    "a record of a shard sent over a link carries {} bytes of KV inline and announces {}",
                    r.kv.len(),
                    r.kv_len
                )));
            }
            entries.push(ManifestEntry { fact: r.fact, kv_len: r.kv_len, crc32: r.crc32 });
        }
        let manifest = Manifest { entries, frame_bytes: self.frame_bytes };
        off_thread(move || {
            let mut r = Reassembler::new(manifest).map_err(frame_error)?;
            let mut out = Vec::new();
            while let Some(len) = r.next_frame() {
                let frame = self.link.recv(len).map_err(link_error)?;
                out.extend(r.push(&frame).map_err(frame_error)?);
            }
            out.extend(r.finish().map_err(frame_error)?);
            Ok((self, out))
        })
        .await
    }
}

/// Receives a shard (see `ImportShard` in the proto).
pub(crate) async fn import(
    svc: &Handle,
    mut stream: impl tokio_stream::Stream<Item = Result<pb::ShardChunk, Status>> + Unpin,
) -> Result<pb::ImportShardResponse, Status> {
    // Units this worker stores from here on arrived during the copy and
    // survive it; older ones the shard lacks are stale and go.
    let since = inferscale_memory::write_seq();
    let first = stream.next().await.ok_or_else(|| Status::invalid_argument("the shard stream is empty"))??;
    let user = first.user.clone();
    if user.is_empty() {
        return Err(Status::invalid_argument("the shard names no user"));
    }
    let theirs: KvHeader = serde_json::from_slice(&first.kv_header)
        .map_err(|e| Status::invalid_argument(format!("the shard's first chunk has no valid KV header: {e}")))?;
    let (dir, ours) = svc.call(|reply| Command::Shard(ShardCommand::ImportTarget { reply })).await?;
    let u = user.clone();
    let mut staging = blocking(move || Staging::create(&dir, &u, &ours, &theirs, since)).await?;
    // Joined only once the shard is known to fit here (same model and KV).
    let mut incoming = Incoming::join(svc, &first).await?;
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
        let records = match incoming.take() {
            Some(link) => {
                let (link, records) = link.fill(chunk.records).await?;
                incoming = Some(link);
                records
            }
            None => {
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
                records
            }
        };
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
    if report.dropped > 0 {
        tracing::info!(user, dropped = report.dropped, "an import replaced a stale copy: units it lacked are gone");
    }
    let m = &svc.metrics;
    m.shards_received.fetch_add(1, Ordering::Relaxed);
    m.shard_bytes_received.fetch_add(report.bytes, Ordering::Relaxed);
    Ok(pb::ImportShardResponse {
        facts: report.facts as u32,
        with_kv: report.with_kv as u32,
        kept: report.kept as u32,
        bytes: report.bytes,
        dropped: report.dropped as u32,
    })
}

/// The sending end of a link: a thread that joins it and sends each
/// chunk's frames as the chunk's manifest goes out on the gRPC stream.
struct Outgoing {
    frames: mpsc::Sender<Vec<Vec<u8>>>,
    sender: tokio::task::JoinHandle<Result<u64, WorkerError>>,
    frame_bytes: usize,
}

impl Outgoing {
    fn start(links: Arc<dyn Links>, id: Vec<u8>, frame_bytes: usize) -> Outgoing {
        let (frames, mut queued) = mpsc::channel::<Vec<Vec<u8>>>(1);
        let sender = tokio::task::spawn_blocking(move || {
            let mut link = links.connect(&id, true, frame_bytes)?;
            let mut bytes = 0u64;
            while let Some(frames) = queued.blocking_recv() {
                for f in &frames {
                    link.send(f)?;
                    bytes += f.len() as u64;
                }
            }
            Ok(bytes)
        });
        Outgoing { frames, sender, frame_bytes }
    }

    /// `chunks` as the gRPC stream carries them: the first names the link,
    /// every record's KV is replaced by its length and queued for the link.
    fn route(&self, mut chunks: ChunkStream, id: Vec<u8>) -> ChunkStream {
        let (tx, rx) = mpsc::channel(2);
        let frames = self.frames.clone();
        let frame_bytes = self.frame_bytes;
        tokio::spawn(async move {
            let mut id = Some(id);
            while let Some(chunk) = chunks.next().await {
                let mut chunk = match chunk {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                if let Some(id) = id.take() {
                    chunk.link_id = id;
                    chunk.frame_bytes = frame_bytes as u64;
                }
                let packed = frames::pack(chunk.records.iter().map(|r| r.kv.as_slice()), frame_bytes);
                let packed = match packed {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = tx.send(Err(Status::internal(e.to_string()))).await;
                        return;
                    }
                };
                for r in &mut chunk.records {
                    r.kv_len = r.kv.len() as u64;
                    r.kv = Vec::new();
                }
                if tx.send(Ok(chunk)).await.is_err() {
                    return;
                }
                // A closed queue means the link failed: the stream ends
                // short and the receiver imports nothing.
                if !packed.is_empty() && frames.send(packed).await.is_err() {
                    return;
                }
            }
        });
        ReceiverStream::new(rx)
    }
}

/// Sends a shard to another worker (see `SendShard` in the proto).
pub(crate) async fn send(svc: &Handle, req: pb::SendShardRequest) -> Result<pb::SendShardResponse, Status> {
    let started = Instant::now();
    if req.to.is_empty() {
        return Err(Status::invalid_argument("SendShard needs the receiving worker's address in `to`"));
    }
    // The link's id is made before anything is exported, so a failure here
    // leaves the user untouched.
    let links = match (req.nccl, svc.links.as_ref()) {
        (false, _) => None,
        (true, Some(l)) => Some((l.clone(), l.new_id().map_err(|e| Status::unavailable(e.to_string()))?)),
        (true, None) => {
            return Err(Status::failed_precondition(NO_LINK));
        }
    };
    let channel = svc
        .security
        .endpoint(&req.to)
        .map_err(|e| Status::invalid_argument(e.to_string()))?
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("cannot reach worker {}: {e}", req.to)))?;
    let mut client = pb::worker_client::WorkerClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let mut chunks = export(
        svc.clone(),
        pb::ExportShardRequest {
            user: req.user.clone(),
            with_kv: req.with_kv,
            freeze: req.freeze,
            max_bytes_per_sec: req.max_bytes_per_sec,
        },
        tracing::info_span!("export_shard", user = %req.user),
    );
    let mut link = None;
    if let Some((links, id)) = links {
        let out = Outgoing::start(links, id.clone(), LINK_FRAME_BYTES);
        chunks = out.route(chunks, id);
        link = Some(out);
    }
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
    // The link's own failure explains a refused import best; a link still
    // waiting for a receiver that gave up times out on its own thread.
    if answer.is_err()
        && let Some(out) = link
        && out.sender.is_finished()
        && let Ok(Err(e)) = out.sender.await
    {
        return Err(Status::unavailable(format!("sending {:?}'s shard to worker {}: {e}", req.user, req.to)));
    }
    let imported = answer
        .map_err(|s| {
            Status::new(s.code(), format!("worker {} refused {:?}'s shard: {}", req.to, req.user, s.message()))
        })?
        .into_inner();
    let m = &svc.metrics;
    m.shards_sent.fetch_add(1, Ordering::Relaxed);
    m.shard_bytes_sent.fetch_add(imported.bytes, Ordering::Relaxed);
    Ok(pb::SendShardResponse { imported: Some(imported), seconds: started.elapsed().as_secs_f64() })
}

#[cfg(test)]
mod tests {
    //! The link path of a move without a device: an in-process link pair
    //! stands in for NCCL (which needs two GPUs) between the sending side's
    //! routing and the receiving side's reassembly.

    use std::sync::mpsc as std_mpsc;

    use super::*;

    /// Both ends of one in-process link; `connect` hands out the sender's
    /// end or the receiver's.
    struct Pair {
        ends: Mutex<(Option<End>, Option<End>)>,
    }

    struct End {
        tx: std_mpsc::Sender<Vec<u8>>,
        rx: std_mpsc::Receiver<Vec<u8>>,
        /// Corrupts the byte at this offset of every frame sent.
        flip: Option<usize>,
    }

    impl Pair {
        /// `flip`: the sender's end damages its frames.
        fn new(flip: Option<usize>) -> Arc<Pair> {
            let (a_tx, b_rx) = std_mpsc::channel();
            let (b_tx, a_rx) = std_mpsc::channel();
            let a = End { tx: a_tx, rx: a_rx, flip };
            let b = End { tx: b_tx, rx: b_rx, flip: None };
            Arc::new(Pair { ends: Mutex::new((Some(a), Some(b))) })
        }
    }

    impl Links for Pair {
        fn new_id(&self) -> crate::Result<Vec<u8>> {
            Ok(vec![7; 128])
        }
        fn connect(&self, id: &[u8], sender: bool, _frame_bytes: usize) -> crate::Result<Box<dyn FrameLink>> {
            assert_eq!(id, [7; 128], "the receiver joins the link the sender made");
            let mut ends = self.ends.lock().unwrap();
            let end = if sender { ends.0.take() } else { ends.1.take() };
            Ok(Box::new(end.expect("each end joins once")))
        }
    }

    impl FrameLink for End {
        fn send(&mut self, frame: &[u8]) -> crate::Result<()> {
            let mut f = frame.to_vec();
            if let Some(at) = self.flip.filter(|&at| at < f.len()) {
                f[at] ^= 0x10;
            }
            self.tx.send(f).map_err(|_| WorkerError::Link("the peer left".into()))
        }
        fn recv(&mut self, len: usize) -> crate::Result<Vec<u8>> {
            let f = self.rx.recv().map_err(|_| WorkerError::Link("the peer left".into()))?;
            assert_eq!(f.len(), len, "frames arrive in the sizes the manifest gives");
            Ok(f)
        }
    }

    fn record(i: usize, kv_len: usize) -> ShardRecord {
        ShardRecord { fact: format!("fact {i}").into_bytes(), kv: (0..kv_len).map(|j| (i * 13 + j) as u8).collect() }
    }

    /// Three chunks as `export` makes them: KV inline, checksums set.
    fn chunks() -> Vec<Vec<ShardRecord>> {
        vec![vec![record(0, 40), record(1, 0), record(2, 9)], vec![record(3, 0)], vec![record(4, 33), record(5, 1)]]
    }

    async fn through(pair: Arc<Pair>, frame_bytes: usize) -> Result<Vec<ShardRecord>, Status> {
        let (tx, rx) = mpsc::channel(8);
        for (i, c) in chunks().into_iter().enumerate() {
            let chunk =
                pb::ShardChunk { user: "u".into(), records: shard_records(c), last: i == 2, ..Default::default() };
            tx.send(Ok(chunk)).await.unwrap();
        }
        drop(tx);
        let links: Arc<dyn Links> = pair.clone();
        let out = Outgoing::start(links.clone(), links.new_id().unwrap(), frame_bytes);
        let mut routed = out.route(ReceiverStream::new(rx), links.new_id().unwrap());
        let mut incoming: Option<Incoming> = None;
        let mut got = Vec::new();
        while let Some(chunk) = routed.next().await {
            let chunk = chunk?;
            assert!(chunk.records.iter().all(|r| r.kv.is_empty()), "no KV inline");
            if incoming.is_none() {
                assert_eq!(chunk.frame_bytes, frame_bytes as u64);
                let link = links.connect(&chunk.link_id, false, frame_bytes).unwrap();
                incoming = Some(Incoming { link, frame_bytes });
            } else {
                assert!(chunk.link_id.is_empty(), "only the first chunk names the link");
            }
            let (link, records) = incoming.take().unwrap().fill(chunk.records).await?;
            incoming = Some(link);
            got.extend(records);
        }
        drop(out.frames);
        let sent = out.sender.await.unwrap().unwrap();
        assert_eq!(sent, got.iter().map(|r| r.kv.len() as u64).sum::<u64>());
        Ok(got)
    }

    #[tokio::test]
    async fn kv_over_a_link_arrives_whole_and_checked() {
        let all: Vec<ShardRecord> = chunks().into_iter().flatten().collect();
        for frame_bytes in [1, 8, 40, 1 << 20] {
            assert_eq!(through(Pair::new(None), frame_bytes).await.unwrap(), all, "frames of {frame_bytes}");
        }
        let err = through(Pair::new(Some(3)), 8).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::DataLoss, "{err}");
        assert!(err.message().contains("checksum"), "{err}");
    }
}
