#!/usr/bin/env python3
"""Hit rates of KV-cache replacement policies on two request streams (a
model of `crates/memory/src/cache.rs`, not the cache itself).

The memory store caches a fact's KV in a device tier (filled once after a
restart: it keeps the first facts asked for and does not turn over unless
--kv-promote-after is set) and a host tier (least recently used). Every
request of the tier benchmark (`scripts/gpu_tiers.sh`) retrieves all k = 8
facts of one user, so a user is the unit here. The device and host budgets
of that benchmark hold about 32 and 129 users' facts of 400.

Two streams:
- zipf: users picked by a Zipf law of exponent s, popularity fixed for the
  whole run (the tier benchmark's stream);
- sessions: A users active at once, each asking 10 questions in a row (in
  random interleaving with the others) and then never again, replaced by a
  new user (churn: what a chat service sees when users come and go).

Policies for the host tier:
- lru: what the store does;
- slru: segmented LRU, 80 % of the tier for facts hit twice;
- arc: adaptive replacement (recency and frequency lists, self-tuned split);
- tinylfu: a read that must evict enters only if it was asked for more
  often than the fact it would evict (frequencies halved every 10 × the
  tier's size of requests);
- w-tinylfu: the same behind a 1 % LRU window.

Hit rates are over the last three quarters of 200,000 requests.

    python3 scripts/cache_policy_sim.py
"""
import bisect
import collections
import random

REQUESTS = 200_000
DEVICE, HOST = 32, 129


def zipf_stream(n, s, seed=1):
    rnd = random.Random(seed)
    weights = [1 / (i + 1) ** s for i in range(n)]
    total, acc, cdf = sum(weights), 0.0, []
    for w in weights:
        acc += w / total
        cdf.append(acc)
    order = list(range(n))
    rnd.shuffle(order)
    for _ in range(REQUESTS):
        yield order[min(bisect.bisect_left(cdf, rnd.random()), n - 1)]


def session_stream(active, questions=10, seed=2):
    rnd = random.Random(seed)
    sessions = [[u, questions] for u in range(active)]
    next_user = active
    for _ in range(REQUESTS):
        s = sessions[rnd.randrange(active)]
        yield s[0]
        s[1] -= 1
        if s[1] == 0:
            s[0], s[1] = next_user, questions
            next_user += 1


class Lru:
    def __init__(self, size):
        self.size, self.items = size, collections.OrderedDict()

    def access(self, x):
        if x in self.items:
            self.items.move_to_end(x)
            return True
        self.items[x] = True
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return False


class Slru:
    def __init__(self, size, protected=0.8):
        self.size, self.cap = size, int(size * protected)
        self.probation, self.protected = collections.OrderedDict(), collections.OrderedDict()

    def access(self, x):
        if x in self.protected:
            self.protected.move_to_end(x)
            return True
        if x in self.probation:
            del self.probation[x]
            self.protected[x] = True
            if len(self.protected) > self.cap:
                y, _ = self.protected.popitem(last=False)
                self.probation[y] = True
            return True
        self.probation[x] = True
        if len(self.probation) + len(self.protected) > self.size:
            (self.probation if self.probation else self.protected).popitem(last=False)
        return False


class Arc:
    def __init__(self, size):
        self.c, self.p = size, 0
        self.t1, self.t2, self.b1, self.b2 = (collections.OrderedDict() for _ in range(4))

    def _replace(self, x):
        if self.t1 and (len(self.t1) > self.p or (x in self.b2 and len(self.t1) == self.p)):
            y, _ = self.t1.popitem(last=False)
            self.b1[y] = True
        else:
            y, _ = self.t2.popitem(last=False)
            self.b2[y] = True

    def access(self, x):
        t1, t2, b1, b2, c = self.t1, self.t2, self.b1, self.b2, self.c
        if x in t1:
            del t1[x]
            t2[x] = True
            return True
        if x in t2:
            t2.move_to_end(x)
            return True
        if x in b1:
            self.p = min(c, self.p + max(len(b2) // max(len(b1), 1), 1))
            self._replace(x)
            del b1[x]
            t2[x] = True
            return False
        if x in b2:
            self.p = max(0, self.p - max(len(b1) // max(len(b2), 1), 1))
            self._replace(x)
            del b2[x]
            t2[x] = True
            return False
        if len(t1) + len(b1) == c:
            if len(t1) < c:
                b1.popitem(last=False)
                self._replace(x)
            else:
                t1.popitem(last=False)
        elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
            if len(t1) + len(t2) + len(b1) + len(b2) == 2 * c:
                b2.popitem(last=False)
            self._replace(x)
        t1[x] = True
        return False


class TinyLfu:
    def __init__(self, size, window=0.0):
        self.wsize = max(1, int(size * window)) if window else 0
        self.msize = size - self.wsize
        self.window, self.main = collections.OrderedDict(), collections.OrderedDict()
        self.freq, self.added, self.sample = collections.Counter(), 0, 10 * size

    def _count(self, x):
        self.freq[x] += 1
        self.added += 1
        if self.added >= self.sample:
            for k in list(self.freq):
                self.freq[k] //= 2
                if not self.freq[k]:
                    del self.freq[k]
            self.added = 0

    def _admit(self, x):
        if len(self.main) < self.msize:
            self.main[x] = True
            return
        victim = next(iter(self.main))
        if self.freq[x] > self.freq[victim]:
            self.main.popitem(last=False)
            self.main[x] = True

    def access(self, x):
        self._count(x)
        for part in (self.window, self.main):
            if x in part:
                part.move_to_end(x)
                return True
        if not self.wsize:
            self._admit(x)
            return False
        self.window[x] = True
        if len(self.window) > self.wsize:
            y, _ = self.window.popitem(last=False)
            self._admit(y)
        return False


POLICIES = {
    "lru": Lru,
    "slru": Slru,
    "arc": Arc,
    "tinylfu": TinyLfu,
    "w-tinylfu": lambda n: TinyLfu(n, window=0.01),
}


def hit_rate(policy, stream, promote_after=0, demote=False):
    """The host tier under `policy`; the device tier filled once, or, with
    `promote_after` = N, turning over: a host-tier user hit N times moves
    to the device, whose least recently used user leaves for the disk
    (`--kv-promote-after`) — or, with `demote`, for the host tier."""
    device, host = collections.OrderedDict(), POLICIES[policy](HOST)
    host_hits = collections.Counter()
    hits = counted = 0
    for i, user in enumerate(stream):
        if user in device:
            device.move_to_end(user)
            hit = True
        elif len(device) < DEVICE:
            device[user] = True
            hit = False
        else:
            hit = host.access(user)
            if hit and promote_after:
                host_hits[user] += 1
                if host_hits[user] >= promote_after:
                    del host_hits[user]
                    del host.items[user]  # one tier at a time (the lru host tier)
                    victim, _ = device.popitem(last=False)
                    device[user] = True
                    if demote:
                        host.access(victim)
        if i >= REQUESTS // 4:
            counted += 1
            hits += hit
    return hits / counted


def main():
    streams = [(f"zipf s = {s}", lambda s=s: zipf_stream(400, s)) for s in (0.8, 1.0, 1.2)]
    streams += [(f"sessions, {a} active", lambda a=a: session_stream(a)) for a in (100, 150, 200, 300)]
    turning = ["lru, promote after 2, victims to disk", "lru, promote after 2, victims to the host tier"]
    print("| stream | " + " | ".join(list(POLICIES) + turning) + " |")
    print("|---|" + "--:|" * (len(POLICIES) + 2))
    for name, make in streams:
        rates = [hit_rate(p, make()) for p in POLICIES]
        rates += [hit_rate("lru", make(), promote_after=2), hit_rate("lru", make(), promote_after=2, demote=True)]
        print(f"| {name} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
