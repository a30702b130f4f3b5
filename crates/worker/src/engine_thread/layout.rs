//! Layout: a newly admitted request's sequence made — the header forked,
//! its facts injected or pasted, the question appended, the prefix cache
//! consulted.

use super::*;

impl<B: Backend> Core<B> {
    /// Lays out a newly admitted request: fork the header, inject or paste
    /// its facts, append the question, take what the prefix cache holds of
    /// its prompt. Returns the prompt tokens the prefix cache saved.
    pub(super) fn layout(&mut self, id: RequestId) -> Result<usize> {
        let Some(l) = self.live.get_mut(&id) else { return Ok(0) };
        let now = Instant::now();
        l.admitted = Some(now);
        // Retrieval ran at arrival; the rest of the wait was for admission.
        l.timings.queue_ms = (ms(now - l.job.arrived) - l.timings.retrieve_ms).max(0.0);
        self.metrics.admitted(l.timings.queue_ms / 1e3);
        l.phase = Span::none();
        let mode = l.job.mode();
        let compose = info_span!(parent: &l.job.span, "compose", mode = mode.as_str(), facts = l.fact_ids.len() as i64);
        let _entered = compose.enter();
        let facts = match l.fact_ids.is_empty() {
            true => Vec::new(),
            false => {
                let all = self.session.memory().facts(l.job.user())?;
                let by_id: HashMap<&str, usize> =
                    all.iter().enumerate().map(|(i, f)| (f.unit.id.as_str(), i)).collect();
                l.fact_ids
                    .iter()
                    .map(|f| {
                        by_id.get(f.as_str()).copied().ok_or_else(|| WorkerError::Forgotten(l.job.user().to_string()))
                    })
                    .collect::<Result<Vec<usize>>>()?
            }
        };
        let paste: Vec<usize> =
            l.fact_ids.iter().zip(&facts).filter(|(id, _)| l.paste.contains(id)).map(|(_, &i)| i).collect();
        if mode.injects() && !facts.is_empty() && self.audits.sample() {
            l.audit = Some(l.fact_ids.clone());
        }
        let placed = Facts { user: l.job.user(), order: &facts, paste: &paste, recall: l.job.recall() };
        let p = self.session.prepare_chat(&l.job.chat, placed, &l.tail)?;
        if mode.injects() {
            self.metrics.memory_tokens(p.memory_tokens - p.pasted_tokens, p.pasted_tokens);
        }
        l.header_cached = p.header_cached;
        l.header_tokens = p.header_tokens;
        let mut seq = p.seq;
        // Every token of a prompt- or none-mode request is computed: its
        // prompt may start with blocks an earlier request computed.
        if matches!(mode, Mode::Prompt | Mode::None)
            && let Some(salt) = self.cfg.prefix_cache.salt(l.job.user())
        {
            l.prefix_cached = self.session.engine_mut().reuse_prefix(&mut seq, salt);
            self.metrics.prefix_cache(seq.len().saturating_sub(l.header_tokens), l.prefix_cached);
        }
        // No wait for the device: the injection runs on the backend's side
        // stream and overlaps this step's forward, which waits for a layer's
        // injected KV only when it reaches that layer. Waiting here cost a
        // host-tier request the whole bus transfer before its step began.
        l.timings.inject_ms = ms(now.elapsed());
        l.phase = info_span!(parent: &l.job.span, "prefill", tokens = seq.pending() as i64);
        l.fact_ids = p.fact_ids;
        l.seq = Some(seq);
        // Injected: the cache may move or evict those facts now.
        l.pinned = None;
        Ok(l.prefix_cached)
    }
}
