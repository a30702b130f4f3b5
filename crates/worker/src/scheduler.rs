//! Continuous batching: which requests run in the next engine step, and how
//! many of their tokens.
//!
//! Like vLLM's v1 scheduler there are no prefill and decode phases: every
//! running request has tokens still to compute (its prompt, then one token
//! per generated token), and each step takes up to `max_batch_tokens` of
//! them — decodes first, one token each, then prompt chunks in admission
//! order — so long prompts are prefilled in chunks between the decode steps
//! of everyone else.
//!
//! Admission reserves a request's whole KV footprint (prompt, injected
//! memory, and `max_new_tokens`) in blocks, so a running request never
//! runs out and nothing is ever preempted; when the blocks are taken, new
//! requests wait (back-pressure), and when the queue is full they are
//! refused ([`AdmitError::QueueFull`], `RESOURCE_EXHAUSTED` upstream).
//! Waiting requests are admitted round-robin across users, so one user's
//! burst cannot starve the others. Cancelling — the client went away —
//! returns a request's blocks at once.

use std::collections::{BTreeMap, VecDeque};

/// Sizing of a scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens computed per engine step, all requests together.
    pub max_batch_tokens: usize,
    /// Requests running at once.
    pub max_running: usize,
    /// Waiting requests beyond which new ones are refused.
    pub max_queue: usize,
    /// KV blocks in the pool and tokens per block.
    pub total_blocks: usize,
    pub block_size: usize,
}

pub type RequestId = u64;

/// What the scheduler needs to know of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSpec {
    pub id: RequestId,
    pub user: String,
    /// Tokens to prefill (header, question, …; not the injected memory).
    pub prompt_tokens: usize,
    /// Tokens whose KV is injected rather than computed: they take blocks, not compute.
    pub injected_tokens: usize,
    /// Of the injected tokens, those recomputed before the prompt (kv+blend):
    /// compute like prompt tokens, but no blocks of their own.
    pub recompute_tokens: usize,
    pub max_new_tokens: usize,
}

impl RequestSpec {
    /// Rows the request's prefill computes: recomputed injected tokens,
    /// then the prompt.
    fn prefill(&self) -> usize {
        self.recompute_tokens + self.prompt_tokens
    }

    fn blocks(&self, block_size: usize) -> usize {
        (self.prompt_tokens + self.injected_tokens + self.max_new_tokens).div_ceil(block_size.max(1))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error("the queue is full ({0} requests waiting)")]
    QueueFull(usize),
    #[error("request needs {needed} KV blocks, the pool has {total}")]
    TooLarge { needed: usize, total: usize },
    #[error("request {0} is already known")]
    Duplicate(RequestId),
    #[error("request {0} has nothing to compute (no prompt tokens)")]
    Empty(RequestId),
}

/// One request's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepItem {
    pub id: RequestId,
    /// Tokens to compute now: a prompt chunk, or 1 for a decode.
    pub tokens: usize,
    /// Whether this step finishes the prompt (the step yields logits to sample from).
    pub samples: bool,
}

/// The work of one engine step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    pub items: Vec<StepItem>,
}

impl Step {
    pub fn tokens(&self) -> usize {
        self.items.iter().map(|i| i.tokens).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

#[derive(Debug)]
struct Running {
    spec: RequestSpec,
    blocks: usize,
    prefilled: usize,
    generated: usize,
}

/// The scheduler's state.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    /// Waiting requests per user, users in round-robin order.
    waiting: BTreeMap<String, VecDeque<RequestSpec>>,
    /// The user admitted from last; the next admission starts after it.
    last_user: Option<String>,
    queued: usize,
    /// Running requests in admission order.
    running: Vec<Running>,
    free_blocks: usize,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Scheduler {
        Scheduler {
            cfg,
            waiting: BTreeMap::new(),
            last_user: None,
            queued: 0,
            running: Vec::new(),
            free_blocks: cfg.total_blocks,
        }
    }

    pub fn free_blocks(&self) -> usize {
        self.free_blocks
    }

    pub fn waiting(&self) -> usize {
        self.queued
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    fn known(&self, id: RequestId) -> bool {
        self.running.iter().any(|r| r.spec.id == id) || self.waiting.values().flatten().any(|r| r.id == id)
    }

    /// Queues a request. Refused when it could never fit the pool, when the
    /// queue is full, or when its id is already in use.
    pub fn submit(&mut self, spec: RequestSpec) -> Result<(), AdmitError> {
        let needed = spec.blocks(self.cfg.block_size);
        if needed > self.cfg.total_blocks {
            return Err(AdmitError::TooLarge { needed, total: self.cfg.total_blocks });
        }
        if spec.prompt_tokens == 0 {
            return Err(AdmitError::Empty(spec.id));
        }
        if self.queued >= self.cfg.max_queue {
            return Err(AdmitError::QueueFull(self.queued));
        }
        if self.known(spec.id) {
            return Err(AdmitError::Duplicate(spec.id));
        }
        self.waiting.entry(spec.user.clone()).or_default().push_back(spec);
        self.queued += 1;
        Ok(())
    }

    /// Drops a request, waiting or running; its blocks are free at once.
    /// Returns whether it was known.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.running.iter().position(|r| r.spec.id == id) {
            let r = self.running.remove(i);
            self.free_blocks += r.blocks;
            return true;
        }
        for q in self.waiting.values_mut() {
            if let Some(i) = q.iter().position(|r| r.id == id) {
                q.remove(i);
                self.queued -= 1;
                self.waiting.retain(|_, q| !q.is_empty());
                return true;
            }
        }
        false
    }

    /// The next waiting user after `last_user` in round-robin order.
    fn next_user(&self) -> Option<String> {
        let after = self.last_user.as_ref().and_then(|u| {
            self.waiting.range::<String, _>((std::ops::Bound::Excluded(u), std::ops::Bound::Unbounded)).next()
        });
        after.or_else(|| self.waiting.iter().next()).map(|(u, _)| u.clone())
    }

    /// Admits waiting requests while slots and blocks allow, round-robin
    /// over users, and returns their ids in admission order. A user whose
    /// next request does not fit yet keeps its place; no later request
    /// overtakes it for its blocks, so large requests are not starved by
    /// small ones.
    pub fn admit(&mut self) -> Vec<RequestId> {
        let mut admitted = Vec::new();
        while self.running.len() < self.cfg.max_running {
            let Some(user) = self.next_user() else { break };
            let Some(q) = self.waiting.get_mut(&user) else { break };
            let Some(front) = q.front() else { break };
            let blocks = front.blocks(self.cfg.block_size);
            if blocks > self.free_blocks {
                break;
            }
            let Some(spec) = q.pop_front() else { break };
            if q.is_empty() {
                self.waiting.remove(&user);
            }
            self.queued -= 1;
            self.free_blocks -= blocks;
            self.last_user = Some(user);
            admitted.push(spec.id);
            self.running.push(Running { spec, blocks, prefilled: 0, generated: 0 });
        }
        admitted
    }

    /// An admitted request found its first `tokens` prompt tokens' KV in
    /// the prefix cache: they are not computed (it keeps its blocks, as a
    /// bound). At least one prompt token is always left to compute; nothing
    /// changes once a step has computed some of its prompt.
    pub fn cached(&mut self, id: RequestId, tokens: usize) {
        if let Some(r) = self.running.iter_mut().find(|r| r.spec.id == id && r.prefilled == 0) {
            r.prefilled = tokens.min(r.spec.prefill().saturating_sub(1));
        }
    }

    /// Decides the next step: admits what fits, then [`Scheduler::plan`]s.
    pub fn schedule(&mut self) -> Step {
        self.admit();
        self.plan()
    }

    /// The next step of the running requests: decodes every request past
    /// its prompt and fills the rest of the token budget with prompt
    /// chunks in admission order.
    pub fn plan(&self) -> Step {
        let mut budget = self.cfg.max_batch_tokens;
        let mut items = Vec::new();
        for r in &self.running {
            if budget == 0 {
                break;
            }
            if r.prefilled == r.spec.prefill() {
                items.push(StepItem { id: r.spec.id, tokens: 1, samples: true });
                budget -= 1;
            }
        }
        for r in &self.running {
            if budget == 0 {
                break;
            }
            let left = r.spec.prefill() - r.prefilled;
            if left > 0 {
                let n = left.min(budget);
                items.push(StepItem { id: r.spec.id, tokens: n, samples: n == left });
                budget -= n;
            }
        }
        Step { items }
    }

    /// Records a finished step: prompt chunks advance, decodes add a token;
    /// requests in `finished` (end of sequence, stop string) and those that
    /// reached `max_new_tokens` leave and free their blocks. Returns the
    /// ids that left.
    pub fn complete(&mut self, step: &Step, finished: &[RequestId]) -> Vec<RequestId> {
        for item in &step.items {
            let Some(r) = self.running.iter_mut().find(|r| r.spec.id == item.id) else { continue };
            if r.prefilled < r.spec.prefill() {
                r.prefilled += item.tokens.min(r.spec.prefill() - r.prefilled);
                if item.samples {
                    r.generated += 1; // the first token comes from the prompt's last logits
                }
            } else {
                r.generated += 1;
            }
        }
        let mut done = Vec::new();
        let mut freed = 0;
        self.running.retain(|r| {
            let leave = finished.contains(&r.spec.id) || r.generated >= r.spec.max_new_tokens;
            if leave {
                done.push(r.spec.id);
                freed += r.blocks;
            }
            !leave
        });
        self.free_blocks += freed;
        done
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn cfg() -> SchedulerConfig {
        SchedulerConfig { max_batch_tokens: 64, max_running: 8, max_queue: 32, total_blocks: 40, block_size: 16 }
    }

    fn req(id: RequestId, user: &str, prompt: usize, new: usize) -> RequestSpec {
        RequestSpec {
            id,
            user: user.into(),
            prompt_tokens: prompt,
            injected_tokens: 0,
            recompute_tokens: 0,
            max_new_tokens: new,
        }
    }

    /// Runs steps until nothing is left; returns the steps taken.
    fn drain(s: &mut Scheduler) -> usize {
        let mut steps = 0;
        loop {
            let step = s.schedule();
            if step.is_empty() {
                return steps;
            }
            s.complete(&step, &[]);
            steps += 1;
            assert!(steps < 10_000, "no progress");
        }
    }

    #[test]
    fn cached_prompt_tokens_are_not_scheduled() {
        let mut s = Scheduler::new(cfg());
        s.submit(req(1, "a", 100, 3)).unwrap();
        s.submit(req(2, "b", 40, 3)).unwrap();
        assert_eq!(s.admit(), vec![1, 2]);
        s.cached(1, 80);
        // Never the whole prompt: its last token gives the first answer token.
        s.cached(2, 40);
        let step = s.plan();
        assert_eq!(
            step.items,
            vec![StepItem { id: 1, tokens: 20, samples: true }, StepItem { id: 2, tokens: 1, samples: true }]
        );
        s.complete(&step, &[]);
        // Once prefilling, a late report changes nothing.
        s.cached(1, 99);
        assert_eq!(
            s.plan().items,
            vec![StepItem { id: 1, tokens: 1, samples: true }, StepItem { id: 2, tokens: 1, samples: true }]
        );
        // Two decode steps each to their third token.
        assert_eq!(drain(&mut s), 2);
        assert_eq!(s.free_blocks(), cfg().total_blocks);
    }

    #[test]
    fn decodes_come_first_and_prompts_are_chunked_to_the_budget() {
        let mut s = Scheduler::new(cfg());
        s.submit(req(1, "a", 10, 5)).unwrap();
        let first = s.schedule();
        assert_eq!(first.items, vec![StepItem { id: 1, tokens: 10, samples: true }]);
        s.complete(&first, &[]);
        s.submit(req(2, "b", 150, 5)).unwrap();
        let step = s.schedule();
        // Request 1 decodes one token; request 2's 150-token prompt takes the other 63.
        assert_eq!(step.items[0], StepItem { id: 1, tokens: 1, samples: true });
        assert_eq!(step.items[1], StepItem { id: 2, tokens: 63, samples: false });
        assert_eq!(step.tokens(), 64);
        s.complete(&step, &[]);
        let step = s.schedule();
        assert_eq!(step.items[1], StepItem { id: 2, tokens: 63, samples: false });
        s.complete(&step, &[]);
        let step = s.schedule();
        assert_eq!(step.items[1], StepItem { id: 2, tokens: 24, samples: true });
    }

    #[test]
    fn admission_waits_for_blocks_and_injected_tokens_count() {
        let mut s = Scheduler::new(cfg());
        // 16 + 300 injected + 4 new = 320 tokens = 20 blocks each: two fit in 40.
        for id in 0..3 {
            let mut r = req(id, &format!("u{id}"), 16, 4);
            r.injected_tokens = 300;
            s.submit(r).unwrap();
        }
        s.schedule();
        assert_eq!((s.running(), s.waiting(), s.free_blocks()), (2, 1, 0));
        assert!(s.cancel(0), "the client went away");
        assert_eq!(s.free_blocks(), 20, "blocks are back at once");
        s.schedule();
        assert_eq!((s.running(), s.waiting(), s.free_blocks()), (2, 0, 0));
    }

    #[test]
    fn recomputed_injected_tokens_take_compute_not_blocks() {
        let mut s = Scheduler::new(cfg());
        // 300 injected tokens of which 100 are recomputed, a 16-token
        // question, 4 new: 20 blocks (as without blend), 116 rows of prefill.
        let mut r = req(1, "a", 16, 4);
        r.injected_tokens = 300;
        r.recompute_tokens = 100;
        s.submit(r).unwrap();
        let step = s.schedule();
        assert_eq!(s.free_blocks(), 20);
        assert_eq!(step.items, vec![StepItem { id: 1, tokens: 64, samples: false }]);
        s.complete(&step, &[]);
        let step = s.schedule();
        assert_eq!(step.items, vec![StepItem { id: 1, tokens: 52, samples: true }]);
        s.complete(&step, &[]);
        assert_eq!(s.schedule().items, vec![StepItem { id: 1, tokens: 1, samples: true }], "then it decodes");
    }

    #[test]
    fn users_are_admitted_in_turn() {
        let mut s = Scheduler::new(SchedulerConfig { max_running: 2, ..cfg() });
        for id in 0..10 {
            s.submit(req(id, "flood", 8, 2)).unwrap();
        }
        s.submit(req(100, "quiet", 8, 2)).unwrap();
        let step = s.schedule();
        let ids: Vec<RequestId> = step.items.iter().map(|i| i.id).collect();
        assert!(ids.contains(&100), "the quiet user runs in the first batch: {ids:?}");
    }

    #[test]
    fn refusals_are_clear_and_leave_state_alone() {
        let mut s = Scheduler::new(SchedulerConfig { max_queue: 2, ..cfg() });
        assert_eq!(s.submit(req(1, "a", 16 * 41, 0)), Err(AdmitError::TooLarge { needed: 41, total: 40 }));
        assert_eq!(s.submit(req(1, "a", 0, 4)), Err(AdmitError::Empty(1)));
        s.submit(req(1, "a", 8, 4)).unwrap();
        assert_eq!(s.submit(req(1, "b", 8, 4)), Err(AdmitError::Duplicate(1)));
        s.submit(req(2, "a", 8, 4)).unwrap();
        assert_eq!(s.submit(req(3, "c", 8, 4)), Err(AdmitError::QueueFull(2)));
        assert_eq!((s.waiting(), s.free_blocks()), (2, 40));
        assert!(s.cancel(2) && !s.cancel(2) && !s.cancel(99));
        assert_eq!(s.waiting(), 1);
    }

    #[test]
    fn requests_leave_at_max_tokens_or_when_finished() {
        let mut s = Scheduler::new(cfg());
        s.submit(req(1, "a", 4, 3)).unwrap();
        s.submit(req(2, "b", 4, 100)).unwrap();
        let step = s.schedule();
        assert_eq!(s.complete(&step, &[]), Vec::<RequestId>::new());
        let step = s.schedule();
        assert_eq!(s.complete(&step, &[2]), vec![2], "request 2 hit end of sequence");
        let step = s.schedule();
        assert_eq!(s.complete(&step, &[]), vec![1], "request 1 has its 3 tokens");
        assert_eq!((s.running(), s.free_blocks()), (0, 40));
    }

    proptest! {
        /// Any mix of requests and cancellations: the block budget and the
        /// token budget always hold, and every request that is not
        /// cancelled finishes with exactly its tokens.
        #[test]
        fn budgets_hold_and_everything_finishes(
            reqs in prop::collection::vec((0usize..4, 1usize..200, 0usize..300, 1usize..20), 1..40),
            cancel_every in 0usize..7,
        ) {
            let c = SchedulerConfig { max_batch_tokens: 96, max_running: 6, max_queue: 64, total_blocks: 48, block_size: 16 };
            let mut s = Scheduler::new(c);
            let mut accepted = Vec::new();
            for (i, &(user, prompt, injected, new)) in reqs.iter().enumerate() {
                let spec = RequestSpec { id: i as u64, user: format!("u{user}"), prompt_tokens: prompt, injected_tokens: injected, recompute_tokens: 0, max_new_tokens: new };
                if s.submit(spec.clone()).is_ok() {
                    accepted.push(spec);
                }
            }
            let mut computed: BTreeMap<RequestId, usize> = BTreeMap::new();
            let mut done = Vec::new();
            let mut cancelled = Vec::new();
            for step_no in 0..5000 {
                let step = s.schedule();
                prop_assert!(step.tokens() <= c.max_batch_tokens);
                let held: usize = s.running.iter().map(|r| r.blocks).sum();
                prop_assert_eq!(held + s.free_blocks(), c.total_blocks);
                if step.is_empty() {
                    break;
                }
                for it in &step.items {
                    *computed.entry(it.id).or_default() += it.tokens;
                }
                done.extend(s.complete(&step, &[]));
                if cancel_every > 0
                    && step_no % (cancel_every * 5) == 3
                    && let Some(id) = s.running.first().map(|r| r.spec.id)
                {
                    s.cancel(id);
                    cancelled.push(id);
                }
            }
            prop_assert_eq!(s.running(), 0);
            prop_assert_eq!(s.waiting(), 0);
            prop_assert_eq!(s.free_blocks(), c.total_blocks);
            for spec in &accepted {
                if cancelled.contains(&spec.id) {
                    continue;
                }
                prop_assert!(done.contains(&spec.id), "request {} never finished", spec.id);
                // Prompt once, then one token per generated token after the first.
                let want = spec.prompt_tokens + spec.max_new_tokens - 1;
                prop_assert_eq!(computed.get(&spec.id).copied().unwrap_or(0), want);
            }
        }
    }

    #[test]
    fn an_idle_scheduler_schedules_nothing() {
        let mut s = Scheduler::new(cfg());
        assert!(s.schedule().is_empty());
        assert_eq!(drain(&mut s), 0);
    }
}
