//! [`Placement`] on etcd's v3 gRPC API (the subset in `proto/etcd.proto`).
//!
//! One lazily connected channel over every endpoint: a call fails fast with
//! [`ClusterError::Unavailable`] while etcd is down and reconnects on its
//! own when it is back, so callers only ever retry.

use std::time::Duration;

use inferscale_proto::etcd as pb;
use pb::kv_client::KvClient;
use pb::lease_client::LeaseClient;
use pb::watch_client::WatchClient;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

use crate::error::{ClusterError, Result};
use crate::store::{
    BoxFuture, Event, KeyValue, LeaseId, Op, Placement, Snapshot, Txn, TxnResult, WatchBatch, WatchStream, prefix_end,
};

/// How long one unary call may take before it counts as a failure.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Etcd {
    endpoints: Vec<String>,
    kv: KvClient<Channel>,
    lease: LeaseClient<Channel>,
    watch: WatchClient<Channel>,
}

impl Etcd {
    /// A client of the etcd cluster at `endpoints` (`host:port` or URLs).
    /// Nothing is dialled until the first call.
    pub fn connect(endpoints: &[String]) -> Result<Etcd> {
        if endpoints.is_empty() {
            return Err(ClusterError::Invalid("no etcd endpoint given".into()));
        }
        let mut list = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            let ep = Endpoint::from_shared(inferscale_proto::uri(e))
                .map_err(|err| ClusterError::Invalid(format!("etcd endpoint {e:?}: {err}")))?
                .connect_timeout(Duration::from_secs(2))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_timeout(Duration::from_secs(5));
            list.push(ep);
        }
        let channel = Channel::balance_list(list.into_iter());
        Ok(Etcd {
            endpoints: endpoints.to_vec(),
            kv: KvClient::new(channel.clone()),
            lease: LeaseClient::new(channel.clone()),
            watch: WatchClient::new(channel),
        })
    }
}

fn request<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(CALL_TIMEOUT);
    r
}

fn key_value(kv: pb::KeyValue) -> Result<KeyValue> {
    let key = String::from_utf8(kv.key).map_err(|e| ClusterError::Decode {
        key: String::from_utf8_lossy(e.as_bytes()).into_owned(),
        reason: "key is not UTF-8".into(),
    })?;
    Ok(KeyValue { key, value: kv.value, mod_revision: kv.mod_revision, lease: kv.lease })
}

fn revision(header: Option<pb::ResponseHeader>) -> i64 {
    header.map_or(0, |h| h.revision)
}

impl Placement for Etcd {
    fn range(&self, prefix: &str) -> BoxFuture<'_, Result<Snapshot>> {
        let req =
            pb::RangeRequest { key: prefix.as_bytes().to_vec(), range_end: prefix_end(prefix), ..Default::default() };
        Box::pin(async move {
            let resp = self.kv.clone().range(request(req)).await?.into_inner();
            let kvs = resp.kvs.into_iter().map(key_value).collect::<Result<_>>()?;
            Ok(Snapshot { revision: revision(resp.header), kvs })
        })
    }

    fn txn(&self, txn: Txn) -> BoxFuture<'_, Result<TxnResult>> {
        use pb::compare::{CompareResult, CompareTarget, TargetUnion};
        use pb::request_op::Request;
        let compare = txn
            .compare
            .into_iter()
            .map(|c| pb::Compare {
                result: CompareResult::Equal as i32,
                target: CompareTarget::Mod as i32,
                key: c.key.into_bytes(),
                target_union: Some(TargetUnion::ModRevision(c.mod_revision)),
            })
            .collect();
        let success = txn
            .ops
            .into_iter()
            .map(|op| pb::RequestOp {
                request: Some(match op {
                    Op::Put { key, value, lease } => {
                        Request::RequestPut(pb::PutRequest { key: key.into_bytes(), value, lease })
                    }
                    Op::Delete { key } => Request::RequestDeleteRange(pb::DeleteRangeRequest {
                        key: key.into_bytes(),
                        range_end: Vec::new(),
                    }),
                }),
            })
            .collect();
        let req = pb::TxnRequest { compare, success, failure: Vec::new() };
        Box::pin(async move {
            let resp = self.kv.clone().txn(request(req)).await?.into_inner();
            Ok(TxnResult { succeeded: resp.succeeded, revision: revision(resp.header) })
        })
    }

    fn grant(&self, ttl: Duration) -> BoxFuture<'_, Result<LeaseId>> {
        let secs = ttl.as_secs().max(1) as i64;
        Box::pin(async move {
            let resp =
                self.lease.clone().lease_grant(request(pb::LeaseGrantRequest { ttl: secs, id: 0 })).await?.into_inner();
            if !resp.error.is_empty() {
                return Err(ClusterError::Unavailable(format!("lease grant refused: {}", resp.error)));
            }
            Ok(resp.id)
        })
    }

    fn keep_alive(&self, lease: LeaseId) -> BoxFuture<'_, Result<bool>> {
        Box::pin(async move {
            // etcd only offers keep-alive as a stream; one request, one
            // answer, then the stream is dropped.
            let out = tokio_stream::once(pb::LeaseKeepAliveRequest { id: lease });
            let mut answers = self.lease.clone().lease_keep_alive(request(out)).await?.into_inner();
            let answer = tokio::time::timeout(CALL_TIMEOUT, answers.message())
                .await
                .map_err(|_| ClusterError::Unavailable("lease keep-alive timed out".into()))??;
            match answer {
                // A TTL of 0 is etcd's "no such lease".
                Some(a) => Ok(a.ttl > 0),
                None => Err(ClusterError::Unavailable("lease keep-alive stream closed".into())),
            }
        })
    }

    fn revoke(&self, lease: LeaseId) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            match self.lease.clone().lease_revoke(request(pb::LeaseRevokeRequest { id: lease })).await {
                Ok(_) => Ok(()),
                // Already gone is what revoking wanted.
                Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
                Err(s) => Err(s.into()),
            }
        })
    }

    fn watch(&self, prefix: &str, from_revision: i64) -> BoxFuture<'_, Result<WatchStream>> {
        let create = pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(pb::WatchCreateRequest {
                key: prefix.as_bytes().to_vec(),
                range_end: prefix_end(prefix),
                start_revision: from_revision,
                progress_notify: false,
            })),
        };
        Box::pin(async move {
            // The request side stays open for the watch's lifetime: etcd
            // ends a watch whose client stopped sending.
            let (req_tx, req_rx) = mpsc::channel(1);
            req_tx.send(create).await.map_err(|_| ClusterError::Unavailable("watch request channel closed".into()))?;
            let mut answers =
                self.watch.clone().watch(tokio_stream::wrappers::ReceiverStream::new(req_rx)).await?.into_inner();
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(async move {
                let _keep_open = req_tx;
                loop {
                    let batch = match answers.message().await {
                        Ok(Some(w)) if w.compact_revision > 0 => {
                            Err(ClusterError::Compacted { requested: from_revision, compacted: w.compact_revision })
                        }
                        Ok(Some(w)) if w.canceled => {
                            Err(ClusterError::Unavailable(format!("watch cancelled: {}", w.cancel_reason)))
                        }
                        Ok(Some(w)) if w.created && w.events.is_empty() => continue,
                        Ok(Some(w)) => events(w),
                        Ok(None) => Err(ClusterError::Unavailable("watch stream closed".into())),
                        Err(s) => Err(s.into()),
                    };
                    let end = batch.is_err();
                    if tx.send(batch).await.is_err() || end {
                        return;
                    }
                }
            });
            Ok(rx)
        })
    }

    fn describe(&self) -> String {
        format!("etcd at {}", self.endpoints.join(","))
    }
}

fn events(w: pb::WatchResponse) -> Result<WatchBatch> {
    let mut out = Vec::with_capacity(w.events.len());
    for e in w.events {
        let Some(kv) = e.kv else { continue };
        let kv = key_value(kv)?;
        out.push(if e.r#type == pb::event::EventType::Delete as i32 {
            Event::Delete { key: kv.key, mod_revision: kv.mod_revision }
        } else {
            Event::Put(kv)
        });
    }
    Ok(WatchBatch { revision: revision(w.header), events: out })
}
