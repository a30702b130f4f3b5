//! The closed loop: ingest every user's memory once, then for each
//! (users, mode, k) point let N user tasks ask, each sending its next
//! request as soon as the previous one ended.
//!
//! A closed loop measures what N users who wait for answers get; its
//! offered load adapts to the server, so overload shows up as latency, not
//! as an ever-growing queue. Each point starts with every user's warm-up
//! requests (unmeasured: they open the user's connection and retrieve from
//! its memory, so first-touch costs stay out of the numbers). Warm-ups are
//! kv mode with one output token whatever the point's mode: they touch the
//! same retrieval path, and a prompt-mode warm-up at k = 50 would cost as
//! much as a measured round. Then a barrier, so all users start together.
//! A point ends at `requests` requests in all or `duration` after its
//! start, whichever comes first; requests already sent then still finish
//! and count, and the point's wall time runs until the last one ends.
//!
//! With a [`Population`], the closed-loop clients are not users: every
//! request of every client picks its user from the whole population, by a
//! Zipf law over the users' ranks (user 0 the most popular), as many users
//! with few active at once reach a server. Each client draws from its own
//! seeded stream, so every point (kv or prompt) sends the same users in
//! the same order.
//!
//! Questions do not repeat across the points of a mode ([`Questions`]):
//! each user asks its questions in turn over the whole run, per mode, so
//! a point never resends the prompts an earlier point of its mode sent —
//! with prefix caching a repeated prompt costs almost nothing, and would
//! flatter prompt mode.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use hyper::Method;
use serde_json::{Value, json};
use tokio::sync::Barrier;

use crate::client::{Client, Outcome, Sample};
use crate::error::{Error, Result};
use crate::report::{Ingest, Point};
use crate::users::User;

/// How memory reaches the model (`kv` or `prompt` for a load test): the
/// worker's own type, so the names cannot drift.
pub use inferscale_types::Mode;

/// What to measure. Points run users-major (all modes and k at 1 user, then
/// at 5, …) so a run cut short still has complete low-concurrency curves.
#[derive(Debug, Clone)]
pub struct Plan {
    pub users: Vec<usize>,
    pub modes: Vec<Mode>,
    pub ks: Vec<u32>,
    /// Requests per point, over all its users.
    pub requests: usize,
    /// Time per point.
    pub duration: Duration,
    pub max_tokens: u32,
    /// Unmeasured requests per user before each point (kv mode, one token).
    pub warmup: usize,
    /// Ask for exactly `max_tokens` (vLLM's `ignore_eos`), so every request
    /// does the same decode work whatever the answer.
    pub ignore_eos: bool,
    /// Sent with every ingest when set; the server refuses another than its own.
    pub window: Option<u32>,
    /// Many users, few asking at once (see the module's doc); `None`: each
    /// client is one user.
    pub population: Option<Population>,
}

/// Distinct users stored, and how requests pick among them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Population {
    pub users: usize,
    /// Zipf exponent s: the user of rank r is asked with weight
    /// 1/(r+1)^s (0: uniform).
    pub zipf: f64,
}

/// One client's stream of users: ranks drawn from the population's Zipf
/// law by inverse transform over its cumulative weights.
struct Picker {
    cumulative: Arc<Vec<f64>>,
    state: u64,
}

impl Picker {
    fn cumulative(p: &Population) -> Vec<f64> {
        let mut acc = 0.0;
        let mut c: Vec<f64> = (0..p.users)
            .map(|r| {
                acc += 1.0 / ((r + 1) as f64).powf(p.zipf);
                acc
            })
            .collect();
        c.iter_mut().for_each(|x| *x /= acc);
        c
    }

    fn next(&mut self) -> usize {
        // splitmix64: a fixed, seedable stream is all a load test needs.
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let u = ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64;
        self.cumulative.partition_point(|&c| c <= u).min(self.cumulative.len() - 1)
    }
}

impl Plan {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Config(m.to_string()));
        if self.users.is_empty() || self.users.contains(&0) {
            return bad("--users needs counts of at least 1");
        }
        if self.modes.is_empty() {
            return bad("--modes needs kv, prompt or both");
        }
        if self.ks.is_empty() || self.ks.contains(&0) {
            return bad("--k needs values of at least 1");
        }
        if self.requests == 0 || self.duration.is_zero() {
            return bad("--requests and --duration-s must be positive");
        }
        if self.max_tokens == 0 {
            return bad("--max-tokens must be at least 1");
        }
        if let Some(p) = &self.population {
            if p.users == 0 {
                return bad("--population needs at least 1 user");
            }
            if !p.zipf.is_finite() || p.zipf < 0.0 {
                return bad("--zipf must be a finite number ≥ 0");
            }
        }
        Ok(())
    }

    /// How many users the run stores: the population, else the largest
    /// client count.
    pub fn max_users(&self) -> usize {
        match &self.population {
            Some(p) => p.users,
            None => self.users.iter().copied().max().unwrap_or(0),
        }
    }
}

/// Turns per ingest request: small enough that a batch is encoded well
/// inside the router's deadline even on a slow CPU with a context window.
const INGEST_BATCH: usize = 16;
/// Ingest requests in flight at once. The worker encodes one unit after
/// another anyway; more in flight would only make each wait longer (and
/// risk the deadline) without storing memory any sooner.
const INGEST_CONCURRENCY: usize = 2;
/// Attempts per batch: a 429/503/504 is retried (re-sending stored ids is
/// a no-op, so a batch the worker finished after the deadline is skipped).
const INGEST_ATTEMPTS: usize = 4;

/// Sends every user's turns, in batches, users side by side. A failed
/// ingest stops the run: without memory the points would measure something
/// else.
pub async fn ingest(client: &Client, users: &[User], window: Option<u32>) -> Result<Ingest> {
    let start = Instant::now();
    let slots = Arc::new(tokio::sync::Semaphore::new(INGEST_CONCURRENCY));
    let mut tasks = tokio::task::JoinSet::new();
    for u in users {
        let (client, u, slots) = (client.clone(), u.clone(), slots.clone());
        tasks.spawn(async move {
            let (mut added, mut skipped) = (0, 0);
            for batch in u.turns.chunks(INGEST_BATCH) {
                let mut body = json!({"user": u.id, "turns": batch});
                if let Some(w) = window {
                    body["window"] = json!(w);
                }
                let _slot = slots.acquire().await.map_err(|e| Error::Config(format!("ingest: {e}")))?;
                let mut attempt = 1;
                let v = loop {
                    match client.json(Method::POST, "/v1/memories", Some(&body)).await {
                        Err(Error::Status { status: 429 | 503 | 504, .. }) if attempt < INGEST_ATTEMPTS => {
                            tokio::time::sleep(Duration::from_secs(2 * attempt as u64)).await;
                            attempt += 1;
                        }
                        r => break r?,
                    }
                };
                added += v["added"].as_u64().unwrap_or(0);
                skipped += v["skipped"].as_u64().unwrap_or(0);
            }
            Ok::<_, Error>((added, skipped))
        });
    }
    let mut out = Ingest { users: users.len(), ..Ingest::default() };
    while let Some(r) = tasks.join_next().await {
        let (a, s) = r.map_err(|e| Error::Config(format!("ingest task: {e}")))??;
        out.added += a;
        out.skipped += s;
    }
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}

/// The question each user asks next, per memory mode, over a whole run.
/// A user starts at its own index, so that users sharing a memory do not
/// ask in lockstep, and asks every question before any again.
#[derive(Debug, Clone, Default)]
pub struct Questions(Arc<Mutex<HashMap<(Mode, usize), usize>>>);

impl Questions {
    /// The index (to be taken modulo the user's questions) of the next
    /// question `user` asks in `mode`.
    fn next(&self, mode: Mode, user: usize) -> usize {
        let mut next = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let q = next.entry((mode, user)).or_insert(user);
        *q += 1;
        *q - 1
    }
}

/// The chat body of one request.
fn chat_body(model: &str, user: &User, question: &str, mode: Mode, k: u32, plan: &Plan) -> Value {
    let mut b = json!({
        "model": model,
        "user": user.id,
        "messages": [{"role": "user", "content": question}],
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": plan.max_tokens,
        "temperature": 0,
        "memory": {"mode": mode.as_str(), "k": k},
    });
    if plan.ignore_eos {
        b["ignore_eos"] = json!(true);
    }
    b
}

/// Measures one point with `n` clients (the first `n` of `users`, or
/// clients drawing from the plan's population), each user asking the next
/// of its `questions` in `mode`.
pub async fn point(
    client: &Client,
    model: &str,
    users: &[User],
    (n, mode, k): (usize, Mode, u32),
    plan: &Plan,
    questions: &Questions,
) -> Point {
    let barrier = Arc::new(Barrier::new(n));
    let start: Arc<OnceLock<Instant>> = Arc::new(OnceLock::new());
    let tickets = Arc::new(AtomicUsize::new(0));
    let cumulative = Arc::new(plan.population.as_ref().map(Picker::cumulative).unwrap_or_default());
    let all: Arc<Vec<User>> = Arc::new(users.to_vec());
    let mut tasks = tokio::task::JoinSet::new();
    // Without a population, client i is user i (`users` holds the largest
    // client count); with one, each client draws its users.
    for i in 0..n {
        let (client, all, plan, model) = (client.clone(), all.clone(), plan.clone(), model.to_string());
        let (barrier, start, tickets, questions) = (barrier.clone(), start.clone(), tickets.clone(), questions.clone());
        let mut picker = Picker { cumulative: cumulative.clone(), state: i as u64 };
        tasks.spawn(async move {
            let mut next = || {
                let user = if plan.population.is_some() { picker.next() } else { i };
                let u = &all[user];
                let q = questions.next(mode, user);
                chat_body(&model, u, &u.questions[q % u.questions.len()], mode, k, &plan)
            };
            for _ in 0..plan.warmup {
                let mut body = next();
                body["memory"]["mode"] = json!(Mode::Kv.as_str());
                body["max_tokens"] = json!(1);
                client.chat_stream(&body).await;
            }
            barrier.wait().await;
            let t0 = *start.get_or_init(Instant::now);
            let deadline = t0 + plan.duration;
            let mut outcomes = Vec::new();
            let mut last = t0;
            while Instant::now() < deadline && tickets.fetch_add(1, Ordering::Relaxed) < plan.requests {
                let sent = t0.elapsed();
                let outcome = match client.chat_stream(&next()).await {
                    Outcome::Ok(s) => Outcome::Ok(Sample { sent, ..s }),
                    failed => failed,
                };
                outcomes.push(outcome);
                last = Instant::now();
            }
            (outcomes, last)
        });
    }
    let mut outcomes: Vec<Outcome> = Vec::new();
    let mut end = None;
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok((o, last)) => {
                outcomes.extend(o);
                end = end.max(Some(last));
            }
            // A user task only ends this way if it panicked: count it, go on.
            Err(e) => outcomes
                .push(Outcome::Failed(crate::client::Failure { status: "panic".into(), message: e.to_string() })),
        }
    }
    let wall = match (start.get(), end) {
        (Some(s), Some(e)) => e.saturating_duration_since(*s),
        _ => Duration::ZERO,
    };
    Point::new(mode.as_str(), k, n, wall, &outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(users: usize, zipf: f64, seed: u64, draws: usize) -> Vec<usize> {
        let p = Population { users, zipf };
        let mut picker = Picker { cumulative: Arc::new(Picker::cumulative(&p)), state: seed };
        let mut n = vec![0; users];
        (0..draws).for_each(|_| n[picker.next()] += 1);
        n
    }

    #[test]
    fn users_are_drawn_by_their_zipf_weight_from_a_fixed_stream() {
        let draws = 200_000;
        // s = 1 over 4 users: weights 1, 1/2, 1/3, 1/4 of 25/12.
        let n = counts(4, 1.0, 7, draws);
        for (r, &got) in n.iter().enumerate() {
            let want = (1.0 / (r + 1) as f64) / (25.0 / 12.0);
            let share = got as f64 / draws as f64;
            assert!((share - want).abs() < 0.01, "rank {r}: {share} vs {want}");
        }
        // s = 0 is uniform.
        for got in counts(5, 0.0, 3, draws) {
            assert!((got as f64 / draws as f64 - 0.2).abs() < 0.01, "{got}");
        }
        // The same seed gives the same users in the same order (kv and
        // prompt points see one request stream); another seed another.
        assert_eq!(counts(50, 1.2, 11, 1000), counts(50, 1.2, 11, 1000));
        assert_ne!(counts(50, 1.2, 11, 1000), counts(50, 1.2, 12, 1000));
    }

    #[test]
    fn a_user_asks_every_question_before_any_again_per_mode() {
        let q = Questions::default();
        let asked: Vec<usize> = (0..4).map(|_| q.next(Mode::Prompt, 2)).collect();
        // User 2 starts at its own index; the caller wraps it over its questions.
        assert_eq!(asked, [2, 3, 4, 5]);
        // Another mode, another user: their own sequences.
        assert_eq!((q.next(Mode::Kv, 2), q.next(Mode::Prompt, 0)), (2, 0));
        // A clone is the same run's record (every point of a run shares it).
        assert_eq!(q.clone().next(Mode::Prompt, 2), 6);
    }

    #[test]
    fn a_population_is_validated_and_sizes_the_store() {
        let plan = |population| Plan {
            users: vec![2, 8],
            modes: vec![Mode::Kv],
            ks: vec![5],
            requests: 10,
            duration: Duration::from_secs(1),
            max_tokens: 4,
            warmup: 0,
            ignore_eos: false,
            window: None,
            population,
        };
        assert_eq!(plan(None).max_users(), 8);
        assert_eq!(plan(Some(Population { users: 400, zipf: 1.0 })).max_users(), 400);
        assert!(plan(Some(Population { users: 0, zipf: 1.0 })).validate().is_err());
        assert!(plan(Some(Population { users: 4, zipf: -1.0 })).validate().is_err());
        assert!(plan(Some(Population { users: 4, zipf: f64::NAN })).validate().is_err());
    }
}
