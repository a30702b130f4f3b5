//! [`Placement`] on etcd, through the `etcd-client` crate: TLS (with a
//! client certificate when etcd runs `--client-cert-auth`) and user/password
//! authentication (the token is renewed by the client when it expires).
//!
//! One balanced channel over every endpoint: a call fails fast with
//! [`ClusterError::Unavailable`] while etcd is down and the channel
//! reconnects on its own when it is back, so callers only ever retry.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity, PutOptions, TlsOptions,
    TxnOp, WatchOptions,
};
use tokio::sync::mpsc;

use crate::error::{ClusterError, Result};
use crate::store::{
    BoxFuture, Event, KeyValue, LeaseId, Op, Placement, Snapshot, Txn, TxnResult, WatchBatch, WatchStream,
};

/// How long one unary call may take before it counts as a failure.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long [`Etcd::connect`] keeps trying to authenticate while etcd is
/// unreachable (only a client with a user authenticates at connect).
const AUTH_WAIT: Duration = Duration::from_secs(30);

/// TLS to etcd: the CA that signs etcd's server certificate and, for an
/// etcd that requires client certificates, this process's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTlsFiles {
    pub ca: PathBuf,
    /// Certificate chain and private key (PEM), presented to etcd.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// Where etcd is and how to talk to it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdOptions {
    /// `host:port` (the scheme follows from `tls`) or `http(s)://host:port`.
    pub endpoints: Vec<String>,
    pub tls: Option<EtcdTlsFiles>,
    /// User name and password for etcd's authentication.
    pub user: Option<(String, String)>,
}

impl EtcdOptions {
    /// Plaintext, no authentication (a loopback etcd, tests).
    pub fn plain(endpoints: Vec<String>) -> EtcdOptions {
        EtcdOptions { endpoints, ..Default::default() }
    }

    /// Checks the settings and reads the TLS files, naming any that is
    /// missing or not PEM, without contacting etcd.
    pub fn load(&self) -> Result<ConnectOptions> {
        if self.endpoints.is_empty() {
            return Err(ClusterError::Invalid("no etcd endpoint given".into()));
        }
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if let Some(tls) = &self.tls {
            let mut t = TlsOptions::new().ca_certificate(Certificate::from_pem(pem(&tls.ca, "CERTIFICATE")?));
            if let Some((cert, key)) = &tls.identity {
                t = t.identity(Identity::from_pem(pem(cert, "CERTIFICATE")?, pem(key, "PRIVATE KEY")?));
            }
            opts = opts.with_tls(t);
        }
        if let Some((user, password)) = &self.user {
            if user.is_empty() {
                return Err(ClusterError::Invalid("etcd user name is empty".into()));
            }
            opts = opts.with_user(user.clone(), password.clone());
        }
        for e in &self.endpoints {
            let scheme = e.split_once("://").map(|(s, _)| s);
            match (scheme, self.tls.is_some()) {
                (Some("http"), true) => {
                    return Err(ClusterError::Invalid(format!(
                        "etcd endpoint {e:?}: http:// with etcd TLS settings; give host:port or https://"
                    )));
                }
                (Some("https"), false) => {
                    return Err(ClusterError::Invalid(format!(
                        "etcd endpoint {e:?}: https:// needs the etcd CA (--etcd-ca)"
                    )));
                }
                (Some(s), _) if s != "http" && s != "https" => {
                    return Err(ClusterError::Invalid(format!("etcd endpoint {e:?}: unknown scheme {s}")));
                }
                _ => {}
            }
        }
        Ok(opts)
    }
}

fn pem(path: &Path, label: &str) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|source| ClusterError::Io { path: path.to_path_buf(), source })?;
    let text = String::from_utf8_lossy(&bytes);
    if !text.lines().any(|l| l.starts_with("-----BEGIN ") && l.contains(label)) {
        return Err(ClusterError::Invalid(format!("{}: no PEM block with {label} in it", path.display())));
    }
    Ok(bytes)
}

pub struct Etcd {
    endpoints: Vec<String>,
    client: Client,
}

impl From<etcd_client::Error> for ClusterError {
    fn from(e: etcd_client::Error) -> Self {
        match e {
            etcd_client::Error::InvalidArgs(m) => ClusterError::Invalid(m),
            etcd_client::Error::InvalidUri(u) => ClusterError::Invalid(format!("etcd endpoint: {u}")),
            etcd_client::Error::GRpcStatus(s) => s.into(),
            other => ClusterError::Unavailable(other.to_string()),
        }
    }
}

impl Etcd {
    /// A client of the etcd cluster `options` name. Without a user nothing
    /// is dialled until the first call; with one, the client authenticates
    /// now, retrying for a while if etcd is not up yet.
    pub async fn connect(options: &EtcdOptions) -> Result<Etcd> {
        let opts = options.load()?;
        let until = Instant::now() + AUTH_WAIT;
        let client = loop {
            match Client::connect(&options.endpoints, Some(opts.clone())).await {
                Ok(c) => break c,
                Err(e) if unreachable(&e) && Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        Ok(Etcd { endpoints: options.endpoints.clone(), client })
    }

    /// The underlying client, for what the [`Placement`] trait does not
    /// cover (administration in tests: users, roles, enabling auth).
    pub fn client(&self) -> &Client {
        &self.client
    }
}

/// Whether `e` says etcd could not be reached (worth retrying), rather
/// than that it answered no (bad credentials, no permission).
fn unreachable(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(s) => matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded),
        _ => false,
    }
}

/// `call` within [`CALL_TIMEOUT`], its error as ours.
async fn with_timeout<T>(call: impl Future<Output = std::result::Result<T, etcd_client::Error>>) -> Result<T> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(ClusterError::Unavailable(format!("etcd call timed out after {CALL_TIMEOUT:?}"))),
    }
}

fn key_value(kv: &etcd_client::KeyValue) -> Result<KeyValue> {
    let key = std::str::from_utf8(kv.key()).map_err(|_| ClusterError::Decode {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        reason: "key is not UTF-8".into(),
    })?;
    Ok(KeyValue {
        key: key.to_string(),
        value: kv.value().to_vec(),
        mod_revision: kv.mod_revision(),
        lease: kv.lease(),
    })
}

fn revision(header: Option<&etcd_client::ResponseHeader>) -> i64 {
    header.map_or(0, |h| h.revision())
}

impl Placement for Etcd {
    fn range(&self, prefix: &str) -> BoxFuture<'_, Result<Snapshot>> {
        let prefix = prefix.to_string();
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let resp = with_timeout(kv.get(prefix, Some(GetOptions::new().with_prefix()))).await?;
            let kvs = resp.kvs().iter().map(key_value).collect::<Result<_>>()?;
            Ok(Snapshot { revision: revision(resp.header()), kvs })
        })
    }

    fn txn(&self, txn: Txn) -> BoxFuture<'_, Result<TxnResult>> {
        let compare: Vec<Compare> =
            txn.compare.into_iter().map(|c| Compare::mod_revision(c.key, CompareOp::Equal, c.mod_revision)).collect();
        let ops: Vec<TxnOp> = txn
            .ops
            .into_iter()
            .map(|op| match op {
                Op::Put { key, value, lease } => TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease))),
                Op::Delete { key } => TxnOp::delete(key, None),
            })
            .collect();
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let resp = with_timeout(kv.txn(etcd_client::Txn::new().when(compare).and_then(ops))).await?;
            Ok(TxnResult { succeeded: resp.succeeded(), revision: revision(resp.header()) })
        })
    }

    fn grant(&self, ttl: Duration) -> BoxFuture<'_, Result<LeaseId>> {
        let secs = ttl.as_secs().max(1) as i64;
        Box::pin(async move {
            let mut lease = self.client.lease_client();
            let resp = with_timeout(lease.grant(secs, None)).await?;
            if !resp.error().is_empty() {
                return Err(ClusterError::Unavailable(format!("lease grant refused: {}", resp.error())));
            }
            Ok(resp.id())
        })
    }

    fn keep_alive(&self, lease: LeaseId) -> BoxFuture<'_, Result<bool>> {
        Box::pin(async move {
            // etcd offers keep-alive as a stream only; the client sends one
            // request and reads its answer, and the stream is dropped.
            let mut client = self.client.lease_client();
            match tokio::time::timeout(CALL_TIMEOUT, client.keep_alive(lease)).await {
                Ok(Ok(_)) => Ok(true),
                // The client's error for a TTL of 0: etcd's "no such lease".
                Ok(Err(etcd_client::Error::LeaseKeepAliveError(m))) if m == "lease not found" => Ok(false),
                Ok(Err(e)) => Err(e.into()),
                Err(_) => Err(ClusterError::Unavailable("lease keep-alive timed out".into())),
            }
        })
    }

    fn revoke(&self, lease: LeaseId) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let mut client = self.client.lease_client();
            match tokio::time::timeout(CALL_TIMEOUT, client.revoke(lease)).await {
                Ok(Ok(_)) => Ok(()),
                // Already gone is what revoking wanted.
                Ok(Err(etcd_client::Error::GRpcStatus(s))) if s.code() == tonic::Code::NotFound => Ok(()),
                Ok(Err(e)) => Err(e.into()),
                Err(_) => Err(ClusterError::Unavailable("lease revoke timed out".into())),
            }
        })
    }

    fn watch(&self, prefix: &str, from_revision: i64) -> BoxFuture<'_, Result<WatchStream>> {
        let prefix = prefix.to_string();
        Box::pin(async move {
            let mut client = self.client.watch_client();
            let options = WatchOptions::new().with_prefix().with_start_revision(from_revision);
            // The stream keeps the request side open for the watch's
            // lifetime: etcd ends a watch whose client stopped sending.
            let mut answers = with_timeout(client.watch(prefix, Some(options))).await?;
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(async move {
                loop {
                    let batch = match answers.message().await {
                        Ok(Some(w)) if w.compact_revision() > 0 => {
                            Err(ClusterError::Compacted { requested: from_revision, compacted: w.compact_revision() })
                        }
                        Ok(Some(w)) if w.canceled() => {
                            Err(ClusterError::Unavailable(format!("watch cancelled: {}", w.cancel_reason())))
                        }
                        Ok(Some(w)) if w.created() && w.events().is_empty() => continue,
                        Ok(Some(w)) => events(&w),
                        Ok(None) => Err(ClusterError::Unavailable("watch stream closed".into())),
                        Err(e) => Err(e.into()),
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

fn events(w: &etcd_client::WatchResponse) -> Result<WatchBatch> {
    let mut out = Vec::with_capacity(w.events().len());
    for e in w.events() {
        let Some(kv) = e.kv() else { continue };
        let kv = key_value(kv)?;
        out.push(match e.event_type() {
            EventType::Delete => Event::Delete { key: kv.key, mod_revision: kv.mod_revision },
            EventType::Put => Event::Put(kv),
        });
    }
    Ok(WatchBatch { revision: revision(w.header()), events: out })
}
