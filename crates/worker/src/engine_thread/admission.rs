//! Admission: a request the protocol admitted is retrieved for, sized
//! (its output fitted to the model's context) and queued, its facts' KV
//! looked up — cached, read from disk beside the step, or to be
//! prefilled; requests whose client left or whose deadline passed are
//! reaped; cold reads that completed are collected.

use super::*;

impl<B: Backend> Core<B> {
    /// Admits the requests that arrived since the last call
    /// ([`Core::arrivals`]): the questions that retrieve are embedded in
    /// one batch — the encoder's forward pass costs about the same for one
    /// question as for a loop turn's dozen — then each request is admitted
    /// in arrival order. Should the batch fail, each request embeds its own
    /// question, and fails alone.
    pub(super) fn admit_arrivals(&mut self) {
        if self.arrivals.is_empty() {
            return;
        }
        let arrivals = std::mem::take(&mut self.arrivals);
        let t0 = Instant::now();
        let mut embeddings: Vec<Option<Vec<f32>>> = vec![None; arrivals.len()];
        let asking: Vec<usize> = (0..arrivals.len()).filter(|&i| self.retrieves(&arrivals[i].0)).collect();
        if asking.len() > 1 {
            let questions: Vec<&str> = asking.iter().map(|&i| arrivals[i].0.chat.question.as_str()).collect();
            if let Ok(batch) = self.session.embed_questions(&questions) {
                for (&i, e) in asking.iter().zip(batch) {
                    embeddings[i] = Some(e);
                }
            }
        }
        self.profile.add(|p| &mut p.retrieval, t0);
        for ((job, events), embedding) in arrivals.into_iter().zip(embeddings) {
            let span = job.span.clone();
            if let Err(e) = self.admit(job, events.clone(), embedding.as_deref()) {
                self.fail(&span, &events, e);
            }
        }
    }

    /// Whether `job` retrieves from a memory (a mode with memory, a user
    /// who has one).
    fn retrieves(&self, job: &GenerateJob) -> bool {
        job.mode() != Mode::None && self.session.memory().has_user(job.user())
    }

    /// Retrieves, sizes and queues a request the protocol admitted; its
    /// question's embedding when [`Core::admit_arrivals`] computed it.
    pub(super) fn admit(&mut self, job: GenerateJob, events: Events, embedding: Option<&[f32]>) -> Result<()> {
        let mode = job.mode();
        let tail = self.session.tail(&job.chat, mode)?;
        let header = self.session.header_len(&job.chat, mode);
        let t0 = Instant::now();
        let retrieve = info_span!(parent: &job.span, "retrieve", k = job.k() as i64, candidates = Empty, retrieved = Empty, loaded = Empty);
        let entered = retrieve.enter();
        let mut facts = Vec::new();
        if self.retrieves(&job) {
            let (user, question, k) = (job.user(), job.chat.question.as_str(), job.k());
            facts = match embedding {
                Some(e) => self.session.retrieve_embedded(user, question, e, k, job.scope())?,
                None => self.session.retrieve_in(user, question, k, job.scope())?,
            };
            retrieve.record("candidates", self.session.memory().facts(job.user()).map_or(0, <[_]>::len) as i64);
        }
        retrieve.record("retrieved", facts.len() as i64);
        let looked = self.profile.add(|p| &mut p.retrieval, t0);
        let all = if facts.is_empty() { &[][..] } else { self.session.memory().facts(job.user())? };
        let memory_tokens: usize = facts.iter().map(|&i| all[i].tokens.len()).sum();
        let limit = self.session.engine().model().config().max_position_embeddings;
        let prompt_len = header + memory_tokens + tail.len();
        let max_new = fit_context(&job, prompt_len, memory_tokens, limit)?;
        // The facts' KV is pinned in the cache until layout. Facts whose
        // KV is on disk only are read by the reader threads and, in kv
        // mode, prefilled this time (or waited for, `ColdKv::Wait`);
        // otherwise read now, while the request waits for admission.
        let (mut pinned, mut cold, mut unencoded, mut sources) = (None, Vec::new(), Vec::new(), None);
        let mut backlog = 0;
        if mode.injects() && !facts.is_empty() {
            self.complete_reads();
            let read_now = mode != Mode::Kv || self.cfg.cold_kv == ColdKv::Read;
            // Facts whose KV is not encoded yet (an ingest stored while the
            // engine served, a replica's copy): kv mode pastes them and the
            // background encodes them; blend, which recomputes injected KV,
            // encodes its few now.
            let encode_now = mode != Mode::Kv;
            let got = self.session.fetch_with(job.user(), &facts, read_now, encode_now)?;
            if got.report.loaded > 0 {
                self.metrics.kv_loaded(got.report.load_seconds);
            }
            retrieve.record("loaded", got.report.loaded as i64);
            sources = Some(FactSources {
                device: got.report.device_hits as u32,
                host: got.report.host_hits as u32,
                disk: got.report.loaded as u32,
                prefilled: (got.cold.len() + got.missing.len()) as u32,
            });
            if !got.cold.is_empty() {
                backlog = self.reader.pending();
                let jobs = self.session.memory_mut().read_jobs(job.user(), &got.cold)?;
                self.reader.read(jobs);
                cold = got.cold;
            }
            unencoded = got.missing;
            pinned = Some(got.pinned);
        }
        drop(entered);
        drop(retrieve);
        self.profile.add(|p| &mut p.lookup, looked);
        let wait = match self.cfg.cold_kv {
            ColdKv::Wait if !cold.is_empty() => self.cfg.cold_kv_wait,
            ColdKv::Auto if !cold.is_empty() => {
                let costs = ColdCosts {
                    read_s: self.read_s.get(),
                    readers: self.reader.threads(),
                    backlog,
                    prefill_s_per_token: self.prefill_s_per_token.get(),
                    // Everyone running or waiting: the worker's load.
                    sharing: {
                        let load = self.load();
                        load.running + load.waiting
                    },
                };
                let all = self.session.memory().facts(job.user())?;
                let tokens: Vec<usize> = cold.iter().map(|&i| all.get(i).map_or(0, |f| f.tokens.len())).collect();
                crate::cold::wait_limit(&costs, &tokens, self.cfg.cold_kv_wait)
            }
            _ => Duration::ZERO,
        };
        let arrival = Arrival {
            job,
            events,
            tail,
            header,
            facts,
            memory_tokens,
            max_new,
            pinned,
            cold,
            unencoded,
            sources,
            arrived: t0,
            until: t0 + wait,
        };
        if wait.is_zero() {
            return self.queue(arrival);
        }
        self.waiting.push(arrival);
        Ok(())
    }

    /// Requests waiting for their cold facts' reads: those whose reads are
    /// all cached or whose wait is over go to the scheduler, with what is
    /// still cold pasted. Looks only when reads were cached since the last
    /// look (by `complete_reads`, wherever it ran) or a wait ran out.
    pub(super) fn release_waiting(&mut self) {
        let now = Instant::now();
        let read = std::mem::take(&mut self.reads_cached);
        if self.waiting.is_empty() || (!read && self.waiting.iter().all(|a| a.until > now)) {
            return;
        }
        for mut a in std::mem::take(&mut self.waiting) {
            match self.session.fetch_with(a.job.user(), &a.cold, false, false) {
                Ok(got) => {
                    let read = (a.cold.len() - got.cold.len()) as u32;
                    if let Some(s) = a.sources.as_mut() {
                        s.disk += read;
                        s.prefilled -= read;
                    }
                    if let Some(p) = a.pinned.as_mut() {
                        p.extend(got.pinned);
                    }
                    a.cold = got.cold;
                    a.unencoded.extend(got.missing);
                }
                Err(e) => {
                    self.fail(&a.job.span, &a.events, e.into());
                    continue;
                }
            }
            if !a.cold.is_empty() && a.until > now {
                self.waiting.push(a);
                continue;
            }
            let (events, span) = (a.events.clone(), a.job.span.clone());
            if let Err(e) = self.queue(a) {
                self.fail(&span, &events, e);
            }
        }
    }

    /// Fails a request the protocol already answered for (it was accepted).
    pub(super) fn fail(&self, span: &Span, events: &Events, e: WorkerError) {
        self.metrics.failed();
        span.record("otel.status_code", "error");
        let _ = events.send(Event::Failed(e));
    }

    /// Sizes a request and hands it to the scheduler; its still-cold facts
    /// are pasted.
    pub(super) fn queue(&mut self, a: Arrival<B>) -> Result<()> {
        let Arrival {
            job,
            events,
            tail,
            header,
            facts,
            memory_tokens,
            max_new,
            pinned,
            cold,
            unencoded,
            sources,
            arrived,
            ..
        } = a;
        let paste: Vec<usize> = cold.into_iter().chain(unencoded).collect();
        let retrieve_ms = ms(arrived.elapsed());
        let all = if facts.is_empty() { &[][..] } else { self.session.memory().facts(job.user())? };
        // A request that waited for reads retrieved these indices then; a
        // forget since fails it before this (`drop_unstarted`).
        if facts.iter().chain(&paste).any(|&i| i >= all.len()) {
            return Err(WorkerError::Forgotten(job.user().to_string()));
        }
        let pasted_tokens: usize = paste.iter().map(|&i| all[i].tokens.len()).sum();
        let (computed, injected) = match job.mode() {
            Mode::Kv | Mode::Blend => (tail.len() + pasted_tokens, memory_tokens - pasted_tokens),
            Mode::Prompt => (tail.len() + memory_tokens, 0),
            Mode::None => (tail.len(), 0),
        };
        // A header's full blocks are shared (the fork copies its partial
        // last block); a request without memory has none.
        let header_blocks = header % BLOCK_SIZE;
        // Blend runs injected tokens through the first layers, so the
        // scheduler budgets them like prompt tokens (an upper bound of the
        // pass's cost): exactly the rows `prepare` will plan.
        let recompute = match job.mode() {
            Mode::Blend => blend_rows(memory_tokens, job.request.memory.blend.ratio),
            _ => 0,
        };
        let id = self.next_id;
        self.next_id += 1;
        self.sched.submit(RequestSpec {
            id,
            user: job.user().to_string(),
            prompt_tokens: computed,
            injected_tokens: injected + header_blocks,
            recompute_tokens: recompute,
            max_new_tokens: max_new,
        })?;
        let mut job = job;
        job.params.max_tokens = max_new;
        let phase = info_span!(parent: &job.span, "queue");
        self.live.insert(
            id,
            Live {
                rng: Rng::new(job.params.seed),
                job,
                events,
                fact_ids: facts.iter().map(|&i| all[i].unit.id.clone()).collect(),
                memory_tokens,
                seq: None,
                generated: Vec::new(),
                text: TextStream::default(),
                finish: None,
                timings: Timings { retrieve_ms, ..Default::default() },
                admitted: None,
                phase,
                tail,
                header_tokens: header,
                header_cached: true,
                prefix_cached: 0,
                pinned,
                paste: paste.iter().map(|&i| all[i].unit.id.clone()).collect(),
                pasted_tokens,
                sources,
                audit: None,
            },
        );
        Ok(())
    }

    /// Drops requests whose client went away or whose deadline passed;
    /// their blocks are free at once.
    pub(super) fn reap(&mut self) {
        let now = Instant::now();
        let gone: Vec<(RequestId, bool)> = self
            .live
            .iter()
            .filter_map(|(&id, l)| {
                let late = l.job.deadline.is_some_and(|d| now > l.job.arrived + d);
                (l.events.is_closed() || late).then_some((id, late))
            })
            .collect();
        for (id, late) in gone {
            self.sched.cancel(id);
            if let Some(l) = self.live.remove(&id) {
                if late && !l.events.is_closed() {
                    self.metrics.failed();
                    let ms = l.job.deadline.map_or(0, |d| d.as_millis() as u64);
                    l.job.span.record("otel.status_code", "error");
                    let _ = l.events.send(Event::Failed(WorkerError::Deadline(ms)));
                } else {
                    self.metrics.cancelled();
                }
            }
        }
        // Those waiting for reads, likewise.
        for a in std::mem::take(&mut self.waiting) {
            let late = a.job.deadline.is_some_and(|d| now > a.job.arrived + d);
            if a.events.is_closed() {
                self.metrics.cancelled();
            } else if late {
                let ms = a.job.deadline.map_or(0, |d| d.as_millis() as u64);
                self.fail(&a.job.span, &a.events, WorkerError::Deadline(ms));
            } else {
                self.waiting.push(a);
            }
        }
    }

    /// Fails `user`'s requests that were not laid out yet, with `why`: the
    /// facts they retrieved may be gone.
    pub(super) fn drop_unstarted(&mut self, user: &str, why: fn(String) -> WorkerError) {
        let ids: Vec<RequestId> =
            self.live.iter().filter(|(_, l)| l.job.user() == user && l.seq.is_none()).map(|(&id, _)| id).collect();
        for id in ids {
            self.sched.cancel(id);
            if let Some(l) = self.live.remove(&id) {
                self.metrics.failed();
                l.job.span.record("otel.status_code", "error");
                let _ = l.events.send(Event::Failed(why(user.to_string())));
            }
        }
        let (theirs, others) = std::mem::take(&mut self.waiting).into_iter().partition(|a| a.job.user() == user);
        self.waiting = others;
        for a in theirs {
            self.fail(&a.job.span, &a.events, why(user.to_string()));
        }
    }

    /// Hands the promotions due (host-tier facts hit often, `cache.rs`),
    /// then the reads of facts resident before the last stop
    /// (`Memory::warm_jobs`), to reader threads that have nothing else:
    /// never ahead of a request's cold reads. A warm-up reads users from
    /// disk only while no request runs: a request reads its own user.
    pub(super) fn start_background_reads(&mut self) {
        let free = self.reader.threads().saturating_sub(self.reader.pending());
        if free > 0 {
            let memory = self.session.memory_mut();
            let mut jobs = memory.promotion_jobs(free);
            if jobs.len() < free && memory.warm_left() > 0 {
                let opens = if self.live.is_empty() { super::idle::OPEN_USERS } else { 0 };
                jobs.extend(memory.warm_jobs(free - jobs.len(), opens));
            }
            self.reader.read(jobs);
        }
        if !self.warm_reported && self.session.memory().warm_left() == 0 && self.reader.pending() == 0 {
            self.warm_reported = true;
            let n = self.session.memory().cache_stats().warmed;
            eprintln!("inferscale worker: read back {n} facts the KV tiers held at the last stop");
        }
    }

    /// Whether reads are in flight or a warm-up is left: the idle loop
    /// then looks for finished reads often rather than napping.
    pub(super) fn reading(&self) -> bool {
        self.reader.pending() > 0 || self.session.memory().warm_left() > 0
    }

    /// Caches the KV the reader threads have read since the last call.
    pub(super) fn complete_reads(&mut self) {
        for done in self.reader.finished() {
            self.metrics.kv_loaded(done.seconds);
            self.read_s.observe(done.seconds);
            self.reads_cached = true;
            if let Err(e) = self.session.complete_read(done) {
                eprintln!("inferscale worker: caching KV read from disk: {e}");
            }
        }
    }
}

/// The most tokens a request may generate in the model's context: its own
/// `max_tokens` if it fits after its prompt (memory included), the server's
/// default lowered to what fits, or a refusal that says which to shorten.
fn fit_context(job: &GenerateJob, prompt_len: usize, memory_tokens: usize, limit: usize) -> Result<usize> {
    let memory = match memory_tokens {
        0 => String::new(),
        n => format!(" ({n} of them the memory's)"),
    };
    if prompt_len >= limit {
        let (param, fix) = match (&job.request.input, memory_tokens > 0) {
            (_, true) => ("memory.k", "lower memory.k or shorten the messages"),
            (inferscale_types::Input::Prompt(_), false) => ("prompt", "shorten the prompt"),
            (inferscale_types::Input::Chat(_), false) => ("messages", "shorten the messages"),
        };
        return Err(Refusal::new(
            param,
            format!("the prompt is {prompt_len} tokens{memory}; the model's context is {limit}: {fix}"),
        )
        .into());
    }
    let room = limit - prompt_len;
    let asked = job.params.max_tokens;
    if asked > room && !job.request.sampling.max_tokens_defaulted {
        return Err(Refusal::new(
            "max_tokens",
            format!(
                "{asked} tokens after a prompt of {prompt_len}{memory} exceed the model's context of {limit}: \
                 at most {room} fit"
            ),
        )
        .into());
    }
    Ok(asked.min(room))
}
