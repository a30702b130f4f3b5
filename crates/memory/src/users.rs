//! The table of a memory's users, each read from disk when first used.
//!
//! Opening a user reads its fact log and the heads of its KV records: a few
//! milliseconds from a cold disk (400 users of the 8B shape took 3.3 s on
//! an H200 node). A node of thousands of users that read them all before
//! serving would be minutes from a restart to its first answer. So opening
//! a memory lists the user directories and reads none: a user is read when
//! something first asks for it (a request, an ingest, a transfer), and the
//! engine's idle time reads the rest a few at a time
//! ([`crate::Memory::open_some`]), so that the background work over every
//! user (encoding, the scrub) and the counts over them catch up within
//! moments of a restart without holding up the first request.
//!
//! A user is read through a shared borrow (the table behaves like a map of
//! opened shards to its callers): what the reading finds beyond the shard —
//! warnings about dropped tails, facts without KV — is queued here for the
//! memory to take with [`Users::take_opened`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use inferscale_engine::Backend;

use crate::error::{MemoryError, Result};
use crate::kvseg::KvHeader;
use crate::shard::user_dir_name;
use crate::user::UserShard;

/// One listed user: unread, read, or found unreadable (with why).
struct Slot<B: Backend> {
    shard: OnceLock<std::result::Result<UserShard<B>, String>>,
}

impl<B: Backend> Slot<B> {
    fn opened(shard: UserShard<B>) -> Self {
        Slot { shard: OnceLock::from(Ok(shard)) }
    }
}

/// What reading users through shared borrows found, for the memory to act
/// on once it holds itself mutably.
#[derive(Default)]
pub(crate) struct Opened {
    pub(crate) warnings: Vec<String>,
    /// Users read with facts whose KV is missing (background encoding's work).
    pub(crate) need_kv: Vec<String>,
    /// Users found unreadable, with why.
    pub(crate) failed: Vec<(String, String)>,
}

pub(crate) struct Users<B: Backend> {
    slots: BTreeMap<String, Slot<B>>,
    /// `users/` of the memory directory.
    dir: PathBuf,
    /// The KV every user's segment must hold (the memory's header).
    header: KvHeader,
    /// Where [`Users::open_some`] goes on from.
    cursor: String,
    /// Slots not read yet (kept, so that idle time and scrapes need not
    /// count them).
    unread: AtomicUsize,
    opened: Mutex<Opened>,
}

impl<B: Backend> Users<B> {
    /// A table of `listed` users under `dir` (`users/`), none read yet.
    pub(crate) fn listed(dir: PathBuf, header: KvHeader, listed: impl IntoIterator<Item = String>) -> Self {
        let slots: BTreeMap<String, Slot<B>> =
            listed.into_iter().map(|u| (u, Slot { shard: OnceLock::new() })).collect();
        let unread = AtomicUsize::new(slots.len());
        Users { slots, dir, header, cursor: String::new(), unread, opened: Default::default() }
    }

    /// `slot`'s shard, reading `user` if it was not read yet; an error
    /// only when the reading failed for want of file descriptors (then
    /// nothing is recorded and the next use reads again).
    fn read<'a>(&self, user: &str, slot: &'a Slot<B>) -> Result<Option<&'a UserShard<B>>> {
        if let Some(read) = slot.shard.get() {
            return Ok(read.as_ref().ok());
        }
        let mut warnings = Vec::new();
        let shard = UserShard::open(&self.dir.join(user_dir_name(user)), &self.header, &mut warnings);
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        opened.warnings.extend(warnings);
        let read = match shard {
            Err(e) if e.out_of_files() => return Err(e),
            Ok(shard) => {
                if shard.kv.iter().any(|k| k.at.is_none()) {
                    opened.need_kv.push(user.to_string());
                }
                Ok(shard)
            }
            Err(e) => {
                opened.warnings.push(format!("user {user:?} is unavailable until repaired: {e}"));
                opened.failed.push((user.to_string(), e.to_string()));
                Err(e.to_string())
            }
        };
        // The memory is used by one thread at a time: nothing else set it.
        if slot.shard.set(read).is_ok() {
            self.unread.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(slot.shard.get().and_then(|r| r.as_ref().ok()))
    }

    fn open<'a>(&self, user: &str, slot: &'a Slot<B>) -> Option<&'a UserShard<B>> {
        self.read(user, slot).ok().flatten()
    }

    /// `user`'s shard, read now if it was not yet; `None` for a user not
    /// here or found unreadable ([`Users::failures`] lists those).
    pub(crate) fn get(&self, user: &str) -> Option<&UserShard<B>> {
        let slot = self.slots.get(user)?;
        self.open(user, slot)
    }

    pub(crate) fn get_mut(&mut self, user: &str) -> Option<&mut UserShard<B>> {
        self.get(user)?;
        self.slots.get_mut(user)?.shard.get_mut()?.as_mut().ok()
    }

    /// Whether `user` is here and readable (reading it if need be).
    pub(crate) fn contains_key(&self, user: &str) -> bool {
        self.get(user).is_some()
    }

    /// Whether `user` was read from disk already (readable or not).
    pub(crate) fn is_read(&self, user: &str) -> bool {
        self.slots.get(user).is_some_and(|s| s.shard.get().is_some())
    }

    /// Whether `user` is listed, read or not, readable or not: no disk read.
    pub(crate) fn listed_user(&self, user: &str) -> bool {
        self.slots.contains_key(user)
    }

    /// Every user found unreadable so far, with why.
    pub(crate) fn failures(&self) -> impl Iterator<Item = (&str, &str)> {
        self.slots.iter().filter_map(|(u, s)| Some((u.as_str(), s.shard.get()?.as_ref().err()?.as_str())))
    }

    pub(crate) fn insert(&mut self, user: String, shard: UserShard<B>) {
        if let Some(old) = self.slots.insert(user, Slot::opened(shard))
            && old.shard.get().is_none()
        {
            self.unread.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Takes `user` out of the table: its shard if it was readable (read
    /// now if need be).
    pub(crate) fn remove(&mut self, user: &str) -> Option<UserShard<B>> {
        self.get(user);
        self.slots.remove(user)?.shard.into_inner()?.ok()
    }

    /// Users listed here, read or not, readable or not yet known not to be.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &String> {
        self.slots.iter().filter(|(_, s)| s.shard.get().is_none_or(|r| r.is_ok())).map(|(u, _)| u)
    }

    /// The users read so far, with their shards.
    pub(crate) fn opened(&self) -> impl Iterator<Item = (&String, &UserShard<B>)> {
        self.slots.iter().filter_map(|(u, s)| Some((u, s.shard.get()?.as_ref().ok()?)))
    }

    /// Every readable user with its shard, reading those not read yet.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&String, &UserShard<B>)> {
        self.slots.iter().filter_map(|(u, s)| Some((u, self.open(u, s)?)))
    }

    /// The first listed user at or after `from` (by name).
    pub(crate) fn next_from(&self, from: &str) -> Option<String> {
        use std::ops::Bound::{Included, Unbounded};
        self.slots.range::<str, _>((Included(from), Unbounded)).next().map(|(u, _)| u.clone())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Users listed but not read yet.
    pub(crate) fn unread(&self) -> usize {
        self.unread.load(Ordering::Relaxed)
    }

    /// Reads up to `max` users not read yet, in name order from where the
    /// last call stopped (wrapping around); returns how many it read.
    pub(crate) fn open_some(&mut self, max: usize) -> usize {
        use std::ops::Bound::{Excluded, Included, Unbounded};
        if self.unread() == 0 {
            return 0;
        }
        let start = std::mem::take(&mut self.cursor);
        let after = self.slots.range::<str, _>((Included(start.as_str()), Unbounded));
        let before = self.slots.range::<str, _>((Unbounded, Excluded(start.as_str())));
        let (mut n, mut stop) = (0, None);
        for (u, slot) in after.chain(before).filter(|(_, s)| s.shard.get().is_none()) {
            if n == max {
                stop = Some(u.clone());
                break;
            }
            if let Err(e) = self.read(u, slot) {
                // Retried at the next idle slice (or the user's first use).
                tracing::warn!(error = %e, "reading users in idle time");
                stop = Some(u.clone());
                break;
            }
            n += 1;
        }
        self.cursor = stop.unwrap_or_default();
        n
    }

    /// What reading users found since the last call.
    pub(crate) fn take_opened(&self) -> Opened {
        std::mem::take(&mut *self.opened.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Reads `user` now, for a caller that must know at once whether it is
    /// readable: its error if not.
    pub(crate) fn open_now(&self, user: &str) -> Result<()> {
        let Some(slot) = self.slots.get(user) else { return Ok(()) };
        match self.read(user, slot)? {
            Some(_) => Ok(()),
            None => Err(MemoryError::UserDamaged(user.to_string())),
        }
    }
}
