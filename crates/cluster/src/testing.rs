//! A real etcd server for tests and local benchmarks: started from the
//! `etcd` binary (Debian's `etcd-server`; `INFERSCALE_ETCD` names another),
//! on free loopback ports, with its own data directory, killed on drop;
//! plaintext, or TLS with client certificates required. With the `testing`
//! feature, [`TestCa`] makes the certificates inside the test.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{ClusterError, Result};
use crate::etcd::{EtcdOptions, EtcdTlsFiles};
use crate::store::Placement;

/// TLS of a test etcd: its server certificate and key, and the CA that
/// clients' certificates must chain to (`--client-cert-auth`).
#[derive(Debug, Clone)]
pub struct EtcdServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    /// A client certificate and key from the same CA, for the readiness
    /// probe and [`EtcdProcess::options`].
    pub client: (PathBuf, PathBuf),
}

pub struct EtcdProcess {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    tls: Option<EtcdServerTls>,
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| ClusterError::Invalid(format!("no free port: {e}")))?;
    l.local_addr().map(|a| a.port()).map_err(|e| ClusterError::Invalid(format!("no free port: {e}")))
}

impl EtcdProcess {
    /// Starts a plaintext etcd and waits until it answers.
    pub async fn start() -> Result<EtcdProcess> {
        Self::start_with(None).await
    }

    /// Starts etcd serving clients over TLS only, with client certificates
    /// required, and waits until it answers.
    pub async fn start_tls(tls: EtcdServerTls) -> Result<EtcdProcess> {
        Self::start_with(Some(tls)).await
    }

    async fn start_with(tls: Option<EtcdServerTls>) -> Result<EtcdProcess> {
        let dir = std::env::temp_dir().join(format!("inferscale-etcd-{}-{}", std::process::id(), free_port()?));
        let mut etcd = EtcdProcess { child: None, dir, client_port: free_port()?, peer_port: free_port()?, tls };
        etcd.restart().await?;
        Ok(etcd)
    }

    /// `host:port` of the client API.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// How a client reaches this etcd (with the test client certificate
    /// when it runs TLS).
    pub fn options(&self) -> EtcdOptions {
        EtcdOptions {
            endpoints: vec![self.endpoint()],
            tls: self.tls.as_ref().map(|t| EtcdTlsFiles { ca: t.ca.clone(), identity: Some(t.client.clone()) }),
            user: None,
        }
    }

    /// Kills the server at once (SIGKILL), keeping its data.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same ports and data (killing it
    /// first if it runs) and waits until it answers.
    pub async fn restart(&mut self) -> Result<()> {
        self.kill();
        let bin = std::env::var("INFERSCALE_ETCD").unwrap_or_else(|_| "etcd".into());
        std::fs::create_dir_all(&self.dir).map_err(|source| ClusterError::Io { path: self.dir.clone(), source })?;
        let log_path = self.dir.join("etcd.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| ClusterError::Io { path: log_path.clone(), source })?;
        let log2 = log.try_clone().map_err(|source| ClusterError::Io { path: log_path.clone(), source })?;
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(&bin);
        if let Some(t) = &self.tls {
            cmd.arg("--cert-file").arg(&t.cert).arg("--key-file").arg(&t.key);
            cmd.arg("--trusted-ca-file").arg(&t.ca).arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", "test", "--data-dir"])
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| {
                ClusterError::Invalid(format!(
                    "cannot run {bin:?} ({e}); install etcd (Debian: apt-get install etcd-server) or set INFERSCALE_ETCD"
                ))
            })?;
        self.child = Some(child);
        let client = crate::etcd::Etcd::connect(&self.options()).await?;
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            match client.range("/").await {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > until => {
                    return Err(ClusterError::Unavailable(format!(
                        "etcd did not come up in 30 s ({e}); its log: {}",
                        log_path.display()
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A certificate authority made inside a test: its certificate and the
/// certificates it issues are PEM files in a directory of the test's.
#[cfg(feature = "testing")]
pub struct TestCa {
    dir: PathBuf,
    params: rcgen::CertificateParams,
    key: rcgen::KeyPair,
}

#[cfg(feature = "testing")]
impl TestCa {
    /// A new CA whose certificate is written to `dir/ca.pem`.
    pub fn new(dir: &std::path::Path) -> Result<TestCa> {
        let bad = |e: rcgen::Error| ClusterError::Invalid(format!("test CA: {e}"));
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(bad)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, "inferscale test CA");
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::DigitalSignature];
        let key = rcgen::KeyPair::generate().map_err(bad)?;
        let cert = params.self_signed(&key).map_err(bad)?;
        let ca = TestCa { dir: dir.to_path_buf(), params, key };
        ca.write("ca.pem", &cert.pem())?;
        Ok(ca)
    }

    /// The CA certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// Issues a certificate for `names` (DNS names or IP addresses), good
    /// for a server and a client alike; returns the certificate and key
    /// files (`<file>.pem`, `<file>-key.pem`).
    pub fn issue(&self, file: &str, names: &[&str]) -> Result<(PathBuf, PathBuf)> {
        let bad = |e: rcgen::Error| ClusterError::Invalid(format!("test certificate {file}: {e}"));
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names).map_err(bad)?;
        params.distinguished_name.push(rcgen::DnType::CommonName, file);
        params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let key = rcgen::KeyPair::generate().map_err(bad)?;
        let issuer = rcgen::Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).map_err(bad)?;
        Ok((
            self.write(&format!("{file}.pem"), &cert.pem())?,
            self.write(&format!("{file}-key.pem"), &key.serialize_pem())?,
        ))
    }

    /// A TLS etcd's files: a server certificate for 127.0.0.1 and a client one.
    pub fn etcd(&self) -> Result<EtcdServerTls> {
        let (cert, key) = self.issue("etcd", &["127.0.0.1", "localhost"])?;
        let client = self.issue("etcd-client", &["etcd-client"])?;
        Ok(EtcdServerTls { cert, key, ca: self.ca(), client })
    }

    fn write(&self, name: &str, text: &str) -> Result<PathBuf> {
        let path = self.dir.join(name);
        std::fs::write(&path, text).map_err(|source| ClusterError::Io { path: path.clone(), source })?;
        Ok(path)
    }
}
