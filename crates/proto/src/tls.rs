//! How workers' gRPC connections are secured: plaintext (loopback, or a
//! network the operator vouches for) or mutual TLS, where the worker
//! accepts only clients whose certificate chains to the cluster's CA and
//! every client (router, other workers, the CLI) checks the worker's
//! certificate against the same CA. One [`Security`] value is built per
//! process from three PEM files and used for every server and channel.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {path}: {reason}")]
    Pem { what: &'static str, path: PathBuf, reason: String },
    #[error("TLS settings: {0}")]
    Config(String),
    #[error("worker address {addr:?}: {reason}")]
    Address { addr: String, reason: String },
}

/// How long a client waits for a worker's TLS handshake: a few
/// milliseconds on a LAN; a second means the worker is not answering.
pub const CLIENT_HANDSHAKE: Duration = Duration::from_secs(1);

/// How long a worker waits for a client's handshake.
pub const SERVER_HANDSHAKE: Duration = Duration::from_secs(5);

/// The three files of a process's TLS identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This process's certificate chain (PEM), presented to peers.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA certificates (PEM) a peer's certificate must chain to.
    pub ca: PathBuf,
}

impl TlsFiles {
    /// The three files when all are given, `None` when none is; one or two
    /// of them is an error (`what` names the three as the caller's user
    /// knows them: flags, keyword arguments).
    pub fn from_parts(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
        what: &str,
    ) -> Result<Option<TlsFiles>, TlsError> {
        match (cert, key, ca) {
            (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsFiles { cert, key, ca })),
            (None, None, None) => Ok(None),
            _ => Err(TlsError::Config(format!("give all of {what}, or none"))),
        }
    }
}

/// Loaded TLS material: an identity and the CA that vouches for peers.
#[derive(Clone)]
pub struct Tls {
    identity: Identity,
    ca: Certificate,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls { .. }") // never the key
    }
}

/// How this process speaks gRPC to workers (and how a worker serves it).
#[derive(Debug, Clone, Default)]
pub enum Security {
    /// HTTP/2 in clear: for loopback, or a network the operator trusts.
    #[default]
    Plaintext,
    /// Mutual TLS with one CA.
    Tls(Arc<Tls>),
}

fn read_pem(what: &'static str, path: &Path, label: &str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read { what, path: path.into(), source })?;
    let text = String::from_utf8_lossy(&bytes);
    if !text.lines().any(|l| l.starts_with("-----BEGIN ") && l.contains(label)) {
        return Err(TlsError::Pem { what, path: path.into(), reason: format!("no PEM block with {label} in it") });
    }
    Ok(bytes)
}

impl Tls {
    /// Reads the three files and checks that they make a usable identity
    /// (a key that matches its certificate, a CA that parses), so that a
    /// bad file fails at start, naming itself, not at the first connection.
    pub fn load(files: &TlsFiles) -> Result<Tls, TlsError> {
        let cert = read_pem("--tls-cert", &files.cert, "CERTIFICATE")?;
        let key = read_pem("--tls-key", &files.key, "PRIVATE KEY")?;
        let ca = read_pem("--tls-ca", &files.ca, "CERTIFICATE")?;
        let tls = Tls { identity: Identity::from_pem(cert, key), ca: Certificate::from_pem(ca) };
        // Building both configs parses the PEMs and pairs key and certificate.
        Endpoint::from_static("https://localhost")
            .tls_config(tls.client())
            .map_err(|e| TlsError::Config(format!("{e}: {}", source_chain(&e))))?;
        tonic::transport::Server::builder()
            .tls_config(tls.server())
            .map_err(|e| TlsError::Config(format!("{e}: {}", source_chain(&e))))?;
        Ok(tls)
    }

    /// A worker's server side: its identity, and clients must present a
    /// certificate from the CA (no anonymous clients). A client that does
    /// not finish its handshake in [`SERVER_HANDSHAKE`] is dropped.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.identity.clone()).client_ca_root(self.ca.clone()).timeout(SERVER_HANDSHAKE)
    }

    /// A client's side: the server's certificate must chain to the CA and
    /// name the address dialled; ours is presented in turn. A handshake
    /// that does not finish in [`CLIENT_HANDSHAKE`] fails the connection,
    /// so that a call to a worker that is dying (its port still accepting,
    /// its process no longer answering) fails over instead of waiting.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(self.ca.clone()).identity(self.identity.clone()).timeout(CLIENT_HANDSHAKE)
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = Vec::new();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push(s.to_string());
        cur = s.source();
    }
    out.join(": ")
}

impl Security {
    /// TLS from `files` when given, else plaintext.
    pub fn from_files(files: Option<&TlsFiles>) -> Result<Security, TlsError> {
        Ok(match files {
            Some(f) => Security::Tls(Arc::new(Tls::load(f)?)),
            None => Security::Plaintext,
        })
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Security::Tls(_))
    }

    /// The endpoint for the worker at `addr` (`host:port`, or a URI whose
    /// scheme matches this security: `https://` with TLS, `http://`
    /// without). Not connected yet.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, TlsError> {
        let bad = |reason: String| TlsError::Address { addr: addr.to_string(), reason };
        let (scheme, rest) = match addr.split_once("://") {
            Some((s, rest)) => (Some(s), rest),
            None => (None, addr),
        };
        let want = match self {
            Security::Plaintext => "http",
            Security::Tls(_) => "https",
        };
        if let Some(s) = scheme
            && s != want
        {
            return Err(bad(format!("a {s}:// address where this process speaks {want} (TLS settings)")));
        }
        let ep = Endpoint::from_shared(format!("{want}://{rest}")).map_err(|e| bad(e.to_string()))?;
        match self {
            Security::Plaintext => Ok(ep),
            Security::Tls(t) => ep.tls_config(t.client()).map_err(|e| bad(e.to_string())),
        }
    }

    /// A channel to the worker at `addr`, connected on first use: a TCP
    /// address as [`Security::endpoint`] takes it, or `unix:/path` for a
    /// worker on a Unix socket (plaintext: the socket's file permissions
    /// are its access control). `configure` sets a TCP endpoint's options.
    pub fn channel_lazy(
        &self,
        addr: &str,
        configure: impl FnOnce(Endpoint) -> Endpoint,
    ) -> Result<tonic::transport::Channel, TlsError> {
        let Some(path) = addr.strip_prefix("unix:") else {
            return Ok(configure(self.endpoint(addr)?).connect_lazy());
        };
        if self.is_tls() {
            let reason = "a Unix socket is plaintext: its permissions guard it".to_string();
            return Err(TlsError::Address { addr: addr.to_string(), reason });
        }
        let path = std::path::PathBuf::from(path);
        // The URI is not dialled: the connector below is.
        let ep = Endpoint::from_static("http://localhost");
        Ok(ep.connect_with_connector_lazy(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(hyper_util::rt::TokioIo::new) }
        })))
    }

    /// The server builder for a worker: with TLS, clients must present a
    /// certificate from the CA.
    pub fn server(&self) -> Result<tonic::transport::Server, TlsError> {
        let builder = tonic::transport::Server::builder();
        match self {
            Security::Plaintext => Ok(builder),
            Security::Tls(t) => builder.tls_config(t.server()).map_err(|e| TlsError::Config(e.to_string())),
        }
    }
}
