//! The answer-quality audit of kv and blend mode on live traffic: for a
//! sampled share of injecting requests (`--audit-share`), the first-token
//! logits the request was answered from are kept, and later — in the
//! engine's spare time, never on a request's path — the same facts are
//! laid out as prompt mode would lay them out and prefilled, and the two
//! first-token distributions compared: KL(prompt ‖ served) and whether the
//! greedy tokens agree, as metrics and on an `audit` span that follows from
//! the request's.
//!
//! The audit's prefill borrows free KV blocks for the length of one call
//! on this thread and returns them before the next step is planned; when
//! the pool has too few, or the facts were forgotten meanwhile, the audit
//! is skipped and counted. Beside serving, audits take at most
//! [`AUDIT_TIME_SHARE`] of the thread's time; at most [`AUDIT_QUEUE`] wait.

use std::collections::VecDeque;

use inferscale_engine::sampling::divergence;
use inferscale_memory::{Chat, Recall};

use super::*;

/// The most of the engine thread's time audits take while requests run.
/// An audit is a prompt-mode prefill, several kv requests' worth of device
/// time: at 1 % sampling on the Llama-3.1-8B shape (k = 50, 100 clients,
/// H100) audits wanted about 4 % of the time, and under a 5 % cap cost
/// 4.3 % of the throughput. 2 % keeps the cost within 2 % whatever the
/// share asked; sampled requests beyond it wait, then are skipped (counted).
pub(super) const AUDIT_TIME_SHARE: f64 = 0.02;

/// Audits waiting at most; a sampled request beyond is counted as skipped.
pub(super) const AUDIT_QUEUE: usize = 16;

/// A served first token to check against prompt mode.
pub(super) struct AuditJob {
    user: String,
    chat: Chat,
    tail: Vec<u32>,
    /// The retrieved facts, best first (the order prompt mode pastes).
    fact_ids: Vec<String>,
    mode: Mode,
    /// The logits the first token was sampled from.
    served: Vec<f32>,
    /// The request's span, which the audit's follows from.
    request: Span,
}

/// Which requests are audited, and those waiting.
pub(super) struct Audits {
    share: Arc<AuditShare>,
    /// Sampling by accumulation: each injecting request adds `share`, and
    /// one is audited each time the sum passes a whole number, so exactly
    /// that share is audited, evenly spread, with no random draw to test.
    credit: f64,
    queue: VecDeque<AuditJob>,
    /// Before this instant no audit runs while requests do.
    next: Instant,
}

impl Audits {
    pub(super) fn new(share: Arc<AuditShare>) -> Audits {
        Audits { share, credit: 0.0, queue: VecDeque::new(), next: Instant::now() }
    }

    /// Whether the injecting request being laid out is to be audited.
    pub(super) fn sample(&mut self) -> bool {
        let share = self.share.get();
        if share <= 0.0 {
            return false;
        }
        self.credit += share;
        if self.credit >= 1.0 - 1e-9 {
            self.credit -= 1.0;
            return true;
        }
        false
    }
}

impl<B: Backend> Live<B> {
    /// Whether this request's next token must come back as logits for the
    /// audit (its first token, when audited).
    pub(super) fn audit_wants_logits(&self) -> bool {
        self.audit.is_some() && self.generated.is_empty()
    }
}

impl<B: Backend> Core<B> {
    /// Queues `l`'s audit with the logits its first token came from.
    pub(super) fn queue_audit(audits: &mut Audits, metrics: &WorkerMetrics, l: &mut Live<B>, served: &[f32]) {
        let Some(fact_ids) = l.audit.take() else { return };
        if audits.queue.len() >= AUDIT_QUEUE {
            metrics.audit_skipped();
            return;
        }
        audits.queue.push_back(AuditJob {
            user: l.job.user().to_string(),
            chat: l.job.chat.clone(),
            tail: l.tail.clone(),
            fact_ids,
            mode: l.job.mode(),
            served: served.to_vec(),
            request: l.job.span.clone(),
        });
        metrics.audits_waiting(audits.queue.len());
    }

    /// Runs the next waiting audit if its time has come: at once when idle,
    /// beside serving only within [`AUDIT_TIME_SHARE`]. Returns whether it
    /// ran one.
    pub(super) fn audit_some(&mut self, busy: bool) -> bool {
        if self.audits.queue.is_empty() || (busy && Instant::now() < self.audits.next) {
            return false;
        }
        let Some(job) = self.audits.queue.pop_front() else { return false };
        let t = Instant::now();
        let span = info_span!(
            parent: None,
            "audit",
            mode = job.mode.as_str(),
            facts = job.fact_ids.len() as i64,
            kl = Empty,
            top1_agrees = Empty
        );
        span.follows_from(&job.request);
        let outcome = span.in_scope(|| self.prompt_first_token(&job));
        match outcome {
            Ok(prompt) => {
                let (kl, agrees) = divergence(&prompt, &job.served);
                span.record("kl", kl);
                span.record("top1_agrees", agrees);
                self.metrics.audited(job.mode, kl, agrees);
            }
            Err(e) => {
                span.record("otel.status_code", "error");
                tracing::debug!(parent: &span, "audit skipped: {e}");
                self.metrics.audit_skipped();
            }
        }
        // Counted as waiting until its outcome is: whoever sees none
        // waiting sees every audit's outcome.
        self.metrics.audits_waiting(self.audits.queue.len());
        if busy {
            self.audits.next = Instant::now() + t.elapsed().mul_f64(1.0 / AUDIT_TIME_SHARE - 1.0);
        }
        true
    }

    /// Prompt mode's first-token logits for the audited request: its facts
    /// pasted in their retrieved order before its question, prefilled.
    fn prompt_first_token(&mut self, job: &AuditJob) -> Result<Vec<f32>> {
        let all = self.session.memory().facts(&job.user)?;
        let by_id: HashMap<&str, usize> = all.iter().enumerate().map(|(i, f)| (f.unit.id.as_str(), i)).collect();
        let order = job
            .fact_ids
            .iter()
            .map(|id| by_id.get(id.as_str()).copied().ok_or_else(|| WorkerError::Forgotten(job.user.clone())))
            .collect::<Result<Vec<usize>>>()?;
        let facts = Facts::new(&job.user, &order, Recall::of(Mode::Prompt));
        let mut p = self.session.prepare_chat(&job.chat, facts, &job.tail)?;
        // Dropped on return: its blocks go back to the pool before the
        // next step is planned.
        Ok(self.session.engine_mut().prefill(&mut p.seq)?)
    }
}
