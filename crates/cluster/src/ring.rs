//! Consistent hashing of users onto workers, with virtual nodes and bounded
//! load (Mirrokni et al., "Consistent Hashing with Bounded Loads").
//!
//! Each worker owns `vnodes` points on a 64-bit ring; a user belongs to the
//! first point clockwise from the user's hash. Adding a worker moves only
//! the users that now fall on its points, and removing one moves only its
//! users — so a membership change migrates about 1/n of the shards, never
//! shuffles them between the workers that stayed. Under load, a request
//! walks clockwise past workers already at `⌈factor · average⌉` in-flight
//! requests, so no worker runs far above the mean while placement stays
//! sticky for everyone else.
//!
//! Pure logic: no I/O, no clocks, no randomness. The hash is spelled out
//! here (FNV-1a, then a SplitMix64 finaliser) rather than taken from `std`,
//! whose hashers may change between releases: every router, of any build,
//! must agree on every user's home.

/// Virtual nodes per worker when none is given: enough that shares stay
/// within a few percent of even for a handful of workers.
pub const DEFAULT_VNODES: usize = 160;

/// A stable 64-bit hash of `bytes`.
pub fn hash64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    // FNV alone clusters similar keys; the finaliser spreads them.
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The ring over a set of workers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ring {
    /// Worker names, sorted and deduplicated.
    workers: Vec<String>,
    /// (point, worker index), sorted by point.
    points: Vec<(u64, usize)>,
}

impl Ring {
    /// A ring of `workers` (order and duplicates do not matter) with
    /// `vnodes` points each (at least one).
    pub fn new<I, S>(workers: I, vnodes: usize) -> Ring
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut names: Vec<String> = workers.into_iter().map(Into::into).collect();
        names.sort();
        names.dedup();
        let mut points: Vec<(u64, usize)> = names
            .iter()
            .enumerate()
            .flat_map(|(w, name)| (0..vnodes.max(1)).map(move |v| (hash64(format!("{name}#{v}").as_bytes()), w)))
            .collect();
        // Ties (astronomically rare) go to the smaller worker name, so every
        // router orders them alike.
        points.sort_unstable();
        Ring { workers: names, points }
    }

    pub fn workers(&self) -> &[String] {
        &self.workers
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Index of the first point at or after `user`'s hash (wrapping).
    fn start(&self, user: &str) -> usize {
        let h = hash64(user.as_bytes());
        let i = self.points.partition_point(|&(p, _)| p < h);
        if i == self.points.len() { 0 } else { i }
    }

    /// The distinct workers in clockwise order from `user`: its home first,
    /// then the successors that take it over or hold its replica.
    pub fn successors<'a>(&'a self, user: &str) -> impl Iterator<Item = &'a str> + 'a {
        let n = self.points.len();
        let start = if n == 0 { 0 } else { self.start(user) };
        let mut seen = vec![false; self.workers.len()];
        (0..n).filter_map(move |i| {
            let w = self.points[(start + i) % n].1;
            (!std::mem::replace(&mut seen[w], true)).then(|| self.workers[w].as_str())
        })
    }

    /// `user`'s home worker, ignoring load; `None` on an empty ring.
    pub fn home(&self, user: &str) -> Option<&str> {
        self.successors(user).next()
    }

    /// The worker for a new request of `user` under bounded load: the first
    /// worker clockwise whose in-flight count (`load`) is below
    /// `⌈factor · (total + 1) / workers⌉`, counting this request. Some
    /// worker is always below that bound, so this is `None` only on an
    /// empty ring. `factor` is clamped to at least 1.
    pub fn assign<F>(&self, user: &str, load: F, factor: f64) -> Option<&str>
    where
        F: Fn(&str) -> usize,
    {
        self.assign_among(user, |_| true, load, factor)
    }

    /// [`Ring::assign`] over the `eligible` workers only (healthy, not yet
    /// tried): the same answer as a ring of just those workers, since each
    /// worker's points do not depend on the others — without building one.
    pub fn assign_among<E, F>(&self, user: &str, eligible: E, load: F, factor: f64) -> Option<&str>
    where
        E: Fn(&str) -> bool,
        F: Fn(&str) -> usize,
    {
        let members: Vec<&str> = self.workers.iter().map(String::as_str).filter(|w| eligible(w)).collect();
        if members.is_empty() {
            return None;
        }
        let total: usize = members.iter().map(|w| load(w)).sum();
        let cap = (factor.max(1.0) * (total + 1) as f64 / members.len() as f64).ceil() as usize;
        self.successors(user).find(|w| eligible(w) && load(w) < cap)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn users(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("user-{i}")).collect()
    }

    fn homes(ring: &Ring, users: &[String]) -> Vec<String> {
        users.iter().map(|u| ring.home(u).map(str::to_string).unwrap_or_default()).collect()
    }

    #[test]
    fn the_hash_is_stable_across_builds() {
        // Values from an independent implementation (Python, the same
        // FNV-1a + SplitMix64 finaliser): a change here would re-place every
        // user of a running cluster.
        assert_eq!(hash64(b""), 0xf52a_15e9_a9b5_e89b);
        assert_eq!(hash64(b"user-1"), 0xc499_b5f8_a721_df58);
        assert_eq!(hash64(b"worker-a#0"), 0x7f5e_ea9e_39a9_bed8);
    }

    #[test]
    fn placement_ignores_order_and_duplicates() {
        let a = Ring::new(["w1", "w2", "w3"], DEFAULT_VNODES);
        let b = Ring::new(["w3", "w1", "w2", "w1"], DEFAULT_VNODES);
        assert_eq!(a, b);
        let us = users(1000);
        assert_eq!(homes(&a, &us), homes(&b, &us));
    }

    #[test]
    fn shares_are_even() {
        let ring = Ring::new(["w1", "w2", "w3", "w4"], DEFAULT_VNODES);
        let us = users(20_000);
        let mut count: HashMap<String, usize> = HashMap::new();
        for h in homes(&ring, &us) {
            *count.entry(h).or_default() += 1;
        }
        assert_eq!(count.len(), 4);
        for (w, c) in &count {
            let share = *c as f64 / us.len() as f64;
            assert!((share - 0.25).abs() < 0.04, "{w}: {share:.3}");
        }
    }

    #[test]
    fn adding_a_worker_moves_only_users_to_it_and_about_a_fifth() {
        let before = Ring::new(["w1", "w2", "w3", "w4"], DEFAULT_VNODES);
        let after = Ring::new(["w1", "w2", "w3", "w4", "w5"], DEFAULT_VNODES);
        let us = users(20_000);
        let (hb, ha) = (homes(&before, &us), homes(&after, &us));
        let moved: Vec<usize> = (0..us.len()).filter(|&i| hb[i] != ha[i]).collect();
        assert!(moved.iter().all(|&i| ha[i] == "w5"), "a user moved between old workers");
        let share = moved.len() as f64 / us.len() as f64;
        assert!((share - 0.2).abs() < 0.04, "moved {share:.3}");
    }

    #[test]
    fn removing_a_worker_moves_only_its_users() {
        let before = Ring::new(["w1", "w2", "w3", "w4"], DEFAULT_VNODES);
        let after = Ring::new(["w1", "w2", "w4"], DEFAULT_VNODES);
        let us = users(10_000);
        let (hb, ha) = (homes(&before, &us), homes(&after, &us));
        for i in 0..us.len() {
            if hb[i] != "w3" {
                assert_eq!(hb[i], ha[i], "{} moved though its worker stayed", us[i]);
            } else {
                // It goes to its next distinct successor on the old ring.
                let next = before.successors(&us[i]).nth(1).unwrap_or_default();
                assert_eq!(ha[i], next);
            }
        }
    }

    #[test]
    fn successors_list_every_worker_once() {
        let ring = Ring::new(["a", "b", "c"], 8);
        for u in users(100) {
            let mut s: Vec<&str> = ring.successors(&u).collect();
            assert_eq!(s[0], ring.home(&u).unwrap_or_default());
            s.sort_unstable();
            assert_eq!(s, ["a", "b", "c"]);
        }
    }

    #[test]
    fn bounded_load_caps_every_worker_and_keeps_homes_when_there_is_room() {
        let ring = Ring::new(["w1", "w2", "w3"], DEFAULT_VNODES);
        // Every request comes from users whose home is w1: without the bound
        // w1 would take them all.
        let hot: Vec<String> = users(5000).into_iter().filter(|u| ring.home(u) == Some("w1")).take(300).collect();
        let mut load: HashMap<String, usize> = HashMap::new();
        for u in &hot {
            let w = ring.assign(u, |w| load.get(w).copied().unwrap_or(0), 1.25).unwrap_or_default().to_string();
            *load.entry(w).or_default() += 1;
            let total: usize = load.values().sum();
            let cap = (1.25 * total as f64 / 3.0).ceil() as usize;
            assert!(load.values().all(|&l| l <= cap), "{load:?} above {cap}");
        }
        assert!(load.len() == 3, "overflow spread to the others: {load:?}");
        // With nothing in flight, a request goes home.
        for u in &hot[..10] {
            assert_eq!(ring.assign(u, |_| 0, 1.25), Some("w1"));
        }
    }

    #[test]
    fn assigning_among_a_subset_equals_a_ring_of_that_subset() {
        let all = Ring::new(["w1", "w2", "w3", "w4"], DEFAULT_VNODES);
        let sub = Ring::new(["w1", "w3", "w4"], DEFAULT_VNODES);
        let load = |w: &str| if w == "w3" { 5 } else { 1 };
        for u in users(500) {
            assert_eq!(all.assign_among(&u, |w| w != "w2", load, 1.25), sub.assign(&u, load, 1.25), "{u}");
        }
        assert_eq!(all.assign_among("u", |_| false, load, 1.25), None);
    }

    #[test]
    fn an_empty_ring_places_nobody() {
        let ring = Ring::new(Vec::<String>::new(), DEFAULT_VNODES);
        assert!(ring.is_empty());
        assert_eq!(ring.home("u"), None);
        assert_eq!(ring.assign("u", |_| 0, 1.25), None);
        assert_eq!(ring.successors("u").count(), 0);
    }
}
