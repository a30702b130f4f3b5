//! Finding damage before a read needs it: a pass over the users' KV
//! segments in idle time, a few records at a time, checking each record's
//! checksum (what a read checks). Opening a memory reads every record of
//! every fact log (each one's checksum checked: damage there makes the
//! user unavailable at once) but only the heads of KV records; this pass
//! covers the rest. A KV record that fails is dropped from the index and
//! its fact re-encoded in idle time (KV is derived from the facts), as a
//! read that found it would have.

use inferscale_engine::Backend;

use crate::shard::{Memory, ScrubCursor};

impl<B: Backend> Memory<B> {
    /// Checks KV records until about `max_bytes` were read (at least one,
    /// if any has a record), continuing where the last call stopped and
    /// starting over after the last user. Returns the records that failed
    /// (dropped, to re-encode).
    pub fn scrub_step(&mut self, max_bytes: u64) -> usize {
        let mut read = 0u64;
        let mut failed = 0;
        let mut wrapped = false;
        while read < max_bytes.max(1) {
            let next = self.users.next_from(&self.scrub.user);
            let Some(user) = next else {
                if wrapped || self.users.is_empty() {
                    break;
                }
                wrapped = true;
                self.scrub = ScrubCursor::default();
                continue;
            };
            if user != self.scrub.user {
                self.scrub = ScrubCursor { user: user.clone(), fact: 0 };
            }
            let Some(shard) = self.users.get_mut(&user) else {
                // Unreadable (refused until repaired): the next user.
                self.scrub = ScrubCursor { user: format!("{user}\0"), fact: 0 };
                continue;
            };
            let Some(kv) = shard.kv.get(self.scrub.fact) else {
                // Past this user's last fact: the next user (names sort, and
                // a NUL is below every character a user id may hold).
                self.scrub = ScrubCursor { user: format!("{user}\0"), fact: 0 };
                continue;
            };
            if let Some(frame) = kv.at {
                read += u64::from(frame.len);
                if shard.kv_log.read(frame).is_err() {
                    shard.kv[self.scrub.fact].at = None;
                    self.cache.stats.corrupt += 1;
                    self.pending.insert(user.clone());
                    failed += 1;
                    tracing::warn!(
                        user,
                        fact = self.scrub.fact,
                        "a stored KV record failed its check; it is re-encoded"
                    );
                }
            }
            self.scrub.fact += 1;
        }
        failed
    }
}
