//! `inferscale cluster status` and `inferscale cluster drain`: looking at
//! and operating a cluster through its placement store and workers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use inferscale_cluster::Placement;
use inferscale_cluster::store::Txn;
use inferscale_cluster::view::{ClusterView, MemberState, PlacementRecord};
use inferscale_proto as pb;
use inferscale_proto::tls::Security;
use serde_json::json;

use crate::serve::{ClusterArgs, TlsArgs, connect_etcd, runtime};

#[derive(Subcommand)]
pub enum Command {
    /// Print workers (state, load, users held), the leader and placement records.
    Status(StatusArgs),
    /// Move a worker's users away (with their KV) so it can be stopped.
    Drain(DrainArgs),
}

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    tls: TlsArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct DrainArgs {
    /// The worker's name (as `cluster status` lists it).
    worker: String,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    tls: TlsArgs,
    /// Give up waiting after this many seconds (the drain goes on).
    #[arg(long, default_value_t = 600)]
    wait_s: u64,
}

pub fn run(c: Command) -> Result<()> {
    runtime()?.block_on(async move {
        match c {
            Command::Status(a) => status(a).await,
            Command::Drain(a) => drain(a).await,
        }
    })
}

async fn view(c: &ClusterArgs) -> Result<(Arc<dyn Placement>, ClusterView)> {
    if c.etcd.is_empty() {
        bail!("give the cluster's etcd endpoints with --etcd HOST:PORT,… (or INFERSCALE_ETCD)");
    }
    let store = connect_etcd(&c.etcd_options()?).await?;
    let keys = c.keys();
    let snap = store.range(&keys.prefix()).await.with_context(|| format!("reading {}", store.describe()))?;
    let (view, errors) = ClusterView::from_snapshot(&keys, inferscale_cluster::DEFAULT_VNODES, &snap);
    for e in errors {
        eprintln!("warning: {e}");
    }
    Ok((store, view))
}

async fn client(addr: &str, security: &Security) -> Result<pb::worker_client::WorkerClient<tonic::transport::Channel>> {
    let channel = security
        .endpoint(addr)?
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .with_context(|| format!("connecting to worker {addr}"))?;
    Ok(pb::worker_client::WorkerClient::new(channel))
}

async fn users_of(addr: &str, security: &Security) -> Result<Vec<String>> {
    let mut c = client(addr, security).await?;
    Ok(c.list_users(pb::ListUsersRequest {}).await?.into_inner().users)
}

async fn status(a: StatusArgs) -> Result<()> {
    let security = a.tls.security()?;
    let (store, view) = view(&a.cluster).await?;
    let mut workers = Vec::new();
    for m in view.members.values() {
        let m = &m.value;
        let (users, stats) = match client(&m.addr, &security).await {
            Ok(mut c) => {
                let users = c.list_users(pb::ListUsersRequest {}).await.ok().map(|r| r.into_inner().users);
                let stats = c.stats(pb::StatsRequest {}).await.ok().map(|r| r.into_inner());
                (users, stats)
            }
            Err(_) => (None, None),
        };
        let homes = users.as_ref().map(|us| us.iter().filter(|u| view.home(u) == Some(m.name.as_str())).count());
        workers.push(json!({
            "name": m.name, "addr": m.addr, "state": m.state, "reachable": users.is_some(),
            "users_held": users.as_ref().map(Vec::len), "users_home": homes,
            "running": stats.map(|s| s.running), "waiting": stats.map(|s| s.waiting),
            "kv_blocks_free": stats.map(|s| s.kv_blocks_free), "kv_blocks_total": stats.map(|s| s.kv_blocks_total),
            "damaged_users": stats.map(|s| s.damaged_users), "unsettled_users": stats.map(|s| s.unsettled_users),
            "disk_full": stats.map(|s| s.disk_full),
        }));
    }
    let records: Vec<_> = view
        .records
        .iter()
        .map(|(u, r)| json!({"user": u, "home": r.value.home, "moving_to": r.value.moving_to}))
        .collect();
    let leader = view.leader.as_ref().map(|l| l.value.clone());
    if a.json {
        let out = json!({"store": store.describe(), "revision": view.revision, "leader": leader,
                         "workers": workers, "placement_records": records});
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("{} · revision {} · leader {}", store.describe(), view.revision, leader.as_deref().unwrap_or("(none)"));
    println!(
        "{:<24} {:<22} {:<9} {:>6} {:>6} {:>8} {:>8} {:>13} {:>8} {:>5}",
        "worker", "address", "state", "users", "homes", "running", "waiting", "kv free/total", "damaged", "disk"
    );
    let show = |v: &serde_json::Value| v.as_u64().map_or("-".to_string(), |n| n.to_string());
    for w in &workers {
        let disk = match w["disk_full"].as_bool() {
            Some(true) => "FULL",
            Some(false) => "ok",
            None => "-",
        };
        println!(
            "{:<24} {:<22} {:<9} {:>6} {:>6} {:>8} {:>8} {:>13} {:>8} {:>5}",
            w["name"].as_str().unwrap_or(""),
            w["addr"].as_str().unwrap_or(""),
            w["state"].as_str().unwrap_or(""),
            show(&w["users_held"]),
            show(&w["users_home"]),
            show(&w["running"]),
            show(&w["waiting"]),
            format!("{}/{}", show(&w["kv_blocks_free"]), show(&w["kv_blocks_total"])),
            show(&w["damaged_users"]),
            disk,
        );
    }
    if records.is_empty() {
        println!("placement: every user at its ring home");
    } else {
        println!("placement records ({}):", records.len());
        for r in &records {
            let moving = r["moving_to"].as_str().map_or(String::new(), |t| format!(" -> moving to {t}"));
            println!("  {} at {}{moving}", r["user"].as_str().unwrap_or(""), r["home"].as_str().unwrap_or(""));
        }
    }
    Ok(())
}

async fn drain(a: DrainArgs) -> Result<()> {
    let security = a.tls.security()?;
    let (store, view) = view(&a.cluster).await?;
    let keys = a.cluster.keys();
    let m = view.members.get(&a.worker).with_context(|| {
        let known: Vec<&str> = view.members.keys().map(String::as_str).collect();
        format!("no worker {:?} in the cluster; workers: {}", a.worker, known.join(", "))
    })?;
    let addr = m.value.addr.clone();
    // Pin the worker's users to it first, so that leaving the ring moves
    // them with their KV instead of handing them to their replicas.
    let mut pinned = 0;
    for user in users_of(&addr, &security).await? {
        if view.home(&user) == Some(a.worker.as_str()) && !view.records.contains_key(&user) {
            let key = keys.placement(&user);
            let record = PlacementRecord { home: a.worker.clone(), moving_to: None };
            let txn = Txn::default().when(&key, 0).put(&key, serde_json::to_vec(&record)?, 0);
            pinned += usize::from(store.txn(txn).await?.succeeded);
        }
    }
    if m.value.state != MemberState::Draining {
        let mut member = m.value.clone();
        member.state = MemberState::Draining;
        let key = keys.member(&a.worker);
        let txn = Txn::default().when(&key, m.mod_revision).put(&key, serde_json::to_vec(&member)?, m.lease);
        if !store.txn(txn).await?.succeeded {
            bail!("worker {} changed meanwhile (re-registered?); run drain again", a.worker);
        }
    }
    eprintln!("draining {} ({addr}): {pinned} users pinned for moving; waiting for the leader to move them", a.worker);
    let started = Instant::now();
    loop {
        let left = users_of(&addr, &security).await?.len();
        if left == 0 {
            println!("{} holds no users: safe to stop ({:.1} s)", a.worker, started.elapsed().as_secs_f64());
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(a.wait_s) {
            bail!("{} still holds {left} users after {} s; the drain goes on", a.worker, a.wait_s);
        }
        eprintln!("  {left} users left");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
