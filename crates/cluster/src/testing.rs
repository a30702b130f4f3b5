//! A real etcd server for tests and local benchmarks: started from the
//! `etcd` binary (Debian's `etcd-server`; `INFERSCALE_ETCD` names another),
//! on free loopback ports, with its own data directory, killed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{ClusterError, Result};
use crate::store::Placement;

pub struct EtcdProcess {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| ClusterError::Invalid(format!("no free port: {e}")))?;
    l.local_addr().map(|a| a.port()).map_err(|e| ClusterError::Invalid(format!("no free port: {e}")))
}

impl EtcdProcess {
    /// Starts etcd and waits until it answers.
    pub async fn start() -> Result<EtcdProcess> {
        let dir = std::env::temp_dir().join(format!("inferscale-etcd-{}-{}", std::process::id(), free_port()?));
        let mut etcd = EtcdProcess { child: None, dir, client_port: free_port()?, peer_port: free_port()? };
        etcd.restart().await?;
        Ok(etcd)
    }

    /// `host:port` of the client API.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
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
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(&bin)
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
        let client = crate::etcd::Etcd::connect(&[self.endpoint()])?;
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
