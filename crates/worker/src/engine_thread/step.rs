//! The step: the scheduler's plan run as one forward pass, each finishing
//! sequence's next token sampled (or taken from the device's argmax),
//! streamed, and finished requests answered with usage and timings.

use super::*;

impl<B: Backend> Core<B> {
    /// One scheduler step: lay out, forward, sample, stream.
    pub(super) fn step(&mut self) {
        // Requests are laid out as they are admitted, before the step is
        // planned: what the prefix cache holds of a prompt is not computed.
        let t0 = Instant::now();
        for id in self.sched.admit() {
            match self.layout(id) {
                Ok(cached) => self.sched.cached(id, cached),
                Err(e) => self.fail_running(id, e),
            }
        }
        let step = self.sched.plan();
        if step.is_empty() {
            return;
        }
        let mut failed: Vec<(RequestId, WorkerError)> = Vec::new();
        let t1 = self.profile.add(|p| &mut p.layout, t0);
        let items = &step.items;
        let mut ids = Vec::with_capacity(items.len());
        let mut takes = Vec::with_capacity(items.len());
        let mut greedy = Vec::with_capacity(items.len());
        let mut seqs: Vec<&mut Sequence> = Vec::with_capacity(items.len());
        let mut by_id: HashMap<RequestId, &mut Live<B>> = self.live.iter_mut().map(|(&id, l)| (id, l)).collect();
        for item in items {
            if let Some(l) = by_id.remove(&item.id) {
                let wants_logits = l.job.params.needs_logits() || l.audit_wants_logits();
                if let Some(seq) = l.seq.as_mut() {
                    ids.push(item.id);
                    takes.push(item.tokens);
                    greedy.push(!wants_logits);
                    seqs.push(seq);
                }
            }
        }
        let forward = Instant::now();
        let logits = if seqs.is_empty() {
            Ok(Vec::new())
        } else {
            self.session.engine_mut().step_scheduled(&mut seqs, &takes, &greedy)
        };
        if !seqs.is_empty() {
            let tokens: usize = takes.iter().sum();
            let took = forward.elapsed();
            self.metrics.stepped(seqs.len(), tokens, took.as_secs_f64());
            self.step_time.observe(took);
            if tokens >= PREFILL_SAMPLE_TOKENS {
                self.prefill_s_per_token.observe(took.as_secs_f64() / tokens as f64);
            }
        }
        drop(seqs);
        let t2 = self.profile.add(|p| &mut p.forward, t1);
        self.profile.steps += 1;
        self.profile.rows += ids.len() as u64;
        let mut finished = Vec::new();
        match logits {
            Err(e) => {
                let msg = e.to_string();
                failed.extend(ids.iter().map(|&id| (id, WorkerError::Internal(format!("engine step failed: {msg}")))));
            }
            Ok(next) => {
                for (id, next) in ids.iter().zip(next) {
                    let Some(next) = next else { continue };
                    if let Err(e) = self.sample_one(*id, next) {
                        failed.push((*id, e));
                    } else if self.live.get(id).is_some_and(|l| l.finish.is_some()) {
                        finished.push(*id);
                    }
                }
            }
        }
        for (id, e) in failed {
            self.fail_running(id, e);
        }
        for id in self.sched.complete(&step, &finished) {
            self.finish(id);
        }
        self.profile.add(|p| &mut p.sample, t2);
    }

    /// Fails a request the scheduler admitted: its blocks are free at once.
    pub(super) fn fail_running(&mut self, id: RequestId, e: WorkerError) {
        self.sched.cancel(id);
        if let Some(l) = self.live.remove(&id) {
            self.metrics.failed();
            l.job.span.record("otel.status_code", "error");
            let _ = l.events.send(Event::Failed(e));
        }
    }

    pub(super) fn sample_one(&mut self, id: RequestId, next: NextToken) -> Result<()> {
        let limit = self.session.engine().model().config().max_position_embeddings;
        let eos = &self.eos;
        let tokenizer = self.session.tokenizer();
        let Some(l) = self.live.get_mut(&id) else { return Ok(()) };
        if let NextToken::Logits(logits) = &next
            && l.audit_wants_logits()
        {
            Self::queue_audit(&mut self.audits, &self.metrics, l, logits);
        }
        let (tok, lp) = match next {
            NextToken::Greedy(t) => (t, None),
            NextToken::Logits(logits) => {
                let seq = l.seq.as_ref();
                let prompt = seq.map_or(&[][..], |s| &s.tokens()[..s.len() - l.generated.len()]);
                let seen = History { prompt, output: &l.generated };
                let tok = sample(&logits, &l.job.params, &mut l.rng, seen);
                let lp = l.job.params.logprobs.map(|n| {
                    let got = logprobs(&logits, tok, n);
                    let one =
                        |(id, logprob): (u32, f32)| TokenLogprob { id, token: tokenizer.token_bytes(id), logprob };
                    Box::new(Logprobs { chosen: one(got.chosen), top: got.top.into_iter().map(one).collect() })
                });
                (tok, lp)
            }
        };
        if l.generated.is_empty() {
            let now = Instant::now();
            l.timings.first_token_ms = ms(now - l.job.arrived);
            l.timings.prefill_ms = l.admitted.map_or(0.0, |a| ms(now - a) - l.timings.inject_ms);
            self.metrics.first_token(l.job.mode(), l.timings.first_token_ms / 1e3);
            l.phase = info_span!(parent: &l.job.span, "decode", tokens = Empty);
        }
        if !l.job.params.ignore_eos && eos.contains(&tok) {
            l.finish = Some(FinishReason::Eos);
            return Ok(());
        }
        l.generated.push(tok);
        let Some(seq) = l.seq.as_mut() else { return Ok(()) };
        seq.push(tok);
        match l.text.push(tokenizer, &l.generated, &l.job.params.stop)? {
            Delta::Text(text) => {
                let _ = l.events.send(Event::Token { id: tok, text, logprobs: lp });
            }
            Delta::Stop(text) => {
                if !text.is_empty() {
                    let _ = l.events.send(Event::Token { id: tok, text, logprobs: lp });
                }
                l.finish = Some(FinishReason::Stop);
                return Ok(());
            }
        }
        if l.generated.len() >= l.job.params.max_tokens || seq.next_position() as usize >= limit {
            l.finish = Some(FinishReason::Length);
        }
        Ok(())
    }

    pub(super) fn finish(&mut self, id: RequestId) {
        let Some(mut l) = self.live.remove(&id) else { return };
        if l.finish != Some(FinishReason::Stop)
            && let Ok(rest) = l.text.finish(self.session.tokenizer(), &l.generated)
            && !rest.is_empty()
        {
            let id = l.generated.last().copied().unwrap_or(0);
            let _ = l.events.send(Event::Token { id, text: rest, logprobs: None });
        }
        let prompt = l.seq.as_ref().map_or(0, |s| s.len() - l.generated.len());
        l.timings.total_ms = ms(l.job.arrived.elapsed());
        // The first token ends the prefill; the decode makes the others.
        let decoded = l.generated.len().saturating_sub(1);
        self.metrics.decoded(l.job.mode(), decoded, (l.timings.total_ms - l.timings.first_token_ms).max(0.0) / 1e3);
        self.metrics.completed(l.job.mode(), prompt, l.generated.len(), l.timings.total_ms / 1e3);
        l.phase.record("tokens", l.generated.len() as i64);
        let reason = l.finish.unwrap_or(FinishReason::Length);
        l.job.span.record("finish_reason", finish_reason(reason));
        let usage = Usage {
            prompt_tokens: prompt,
            injected_tokens: if l.job.mode().injects() { l.memory_tokens - l.pasted_tokens } else { 0 },
            cached_tokens: l.prefix_cached + if l.header_cached { l.header_tokens } else { 0 },
            completion_tokens: l.generated.len(),
            facts: l.fact_ids.len(),
            recomputed_tokens: l.seq.as_ref().map_or(0, Sequence::recomputed),
            sources: l.sources,
        };
        self.metrics.recomputed(usage.recomputed_tokens);
        self.metrics.finished();
        let finished = Finished { reason, usage, timings: l.timings, fact_ids: l.fact_ids };
        let _ = l.events.send(Event::Finished(Box::new(finished)));
    }
}
