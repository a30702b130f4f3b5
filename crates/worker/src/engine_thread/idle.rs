//! Work the engine thread does between and beside serving: the KV of
//! facts stored without it (replicas, deferred ingests) encoded within the
//! background share of its time, and the scrub of stored KV records.

use super::*;

/// Users read per idle slice: a few milliseconds each from a cold disk, so
/// that a request arriving meanwhile waits tens of milliseconds at most.
pub(super) const OPEN_USERS: usize = 8;

/// How often idle time saves which facts the KV tiers hold, for a start
/// after a crash (a clean stop saves them last thing).
const RESIDENT_EVERY: Duration = Duration::from_secs(60);

impl<B: Backend> Core<B> {
    /// While requests run: encodes stored facts' KV within the encoding
    /// share of the thread's time, in slices of about one step — or not
    /// at all while one fact takes longer than two steps (a CPU encoding a
    /// windowed fact), which waits for idle time (`throttle.rs`).
    pub(super) fn encode_beside_serving(&mut self, step: Duration) {
        let n = self.encode_throttle.allowance(Instant::now(), true, step);
        if n == 0 {
            return;
        }
        let t = Instant::now();
        let done = match self.session.encode_pending(n) {
            Ok(done) => done,
            Err(e) => {
                eprintln!("inferscale worker: encoding stored facts beside serving: {e}");
                0
            }
        };
        if done > 0 {
            self.encode_throttle.done(Instant::now(), done, t.elapsed(), true);
        }
    }

    /// When idle: encodes a few facts still without KV (a replica's copy,
    /// an import without KV, an ingest stored while requests ran), in a
    /// slice a request that arrives need not wait long for. Returns
    /// whether it did any.
    pub(super) fn encode_pending(&mut self) -> bool {
        let n = self.encode_throttle.allowance(Instant::now(), false, self.step_time.get());
        let t = Instant::now();
        match self.session.encode_pending(n) {
            Ok(done) => {
                if done > 0 {
                    self.encode_throttle.done(Instant::now(), done, t.elapsed(), false);
                }
                done > 0
            }
            Err(e) => {
                eprintln!("inferscale worker: encoding stored facts in the background: {e}");
                false
            }
        }
    }

    /// When idle: reads a few of the users a memory opened lazily has not
    /// read yet (a restart serves before it has read them all), so that the
    /// background encoding, the scrub and the holdings' counts reach every
    /// user soon after a start. Returns whether it read any.
    pub(super) fn open_users(&mut self) -> bool {
        self.session.memory_mut().open_some(OPEN_USERS) > 0
    }

    /// Saves which facts the KV tiers hold (`Memory::save_resident`), for
    /// the next start to read back ([`WorkerConfig::kv_warm_restart`]):
    /// when the worker stops, and when idle at most every
    /// [`RESIDENT_EVERY`] if they changed.
    pub(super) fn save_resident(&mut self, stopping: bool) {
        if !self.cfg.kv_warm_restart {
            return;
        }
        let memory = self.session.memory_mut();
        let due = self.last_resident_save.elapsed() >= RESIDENT_EVERY && memory.resident_changed();
        if !(stopping || due) {
            return;
        }
        self.last_resident_save = Instant::now();
        match memory.save_resident() {
            Ok(n) if stopping => {
                eprintln!("inferscale worker: saved the {n} facts the KV tiers hold, for the next start")
            }
            Ok(_) => {}
            Err(e) => eprintln!("inferscale worker: saving which facts the KV tiers hold, for the next start: {e}"),
        }
    }

    /// When idle, at most once a second: checks the next stored KV records'
    /// checksums (`Memory::scrub_step`), so that damage is found and
    /// re-encoded before a request needs that KV.
    pub(super) fn scrub(&mut self) {
        if self.last_scrub.elapsed() < SCRUB_EVERY {
            return;
        }
        self.last_scrub = Instant::now();
        let failed = self.session.memory_mut().scrub_step(SCRUB_BYTES);
        if failed > 0 {
            eprintln!("inferscale worker: {failed} stored KV records failed their check; they are re-encoded");
        }
    }
}
