"""The official `mem0ai` 2.2.1 `MemoryClient` (hosted-platform client) against our server, unchanged.

Run as `python3 mem0_client.py BASE_URL API_KEY` with PYTHONPATH holding mem0ai 2.2.1 and the
packages its import needs. Exits non-zero (an assertion) on any difference from what Mem0
documents. The client returns `response.json()` untouched, so every assertion below is on the
server's reply. What each call sends, and the reply it expects (2xx replies must be JSON; error
replies should be JSON with the message under "detail"):

  MemoryClient(...)  GET  /v1/ping/                      -> {"status": "ok", "org_id": "<str>",
                     "project_id": "<str>", "user_email": null}: org_id and project_id MUST be
                     non-empty strings (else the constructor raises ValueError "org_id and project_id
                     must be set"); a non-2xx becomes ValueError("Error: <detail>")
  add(...)           POST /v3/memories/add/              body {"messages": [{role, content}...],
                     "user_id", ["agent_id"], ["metadata"], ["infer": false]} (entity ids top level)
                     -> {"results": [{"id", "memory", "data": {"memory"}, "event": "ADD"}, ...]}
                     (infer=false: one memory per non-system message, stored verbatim; Mem0's v3 docs
                     give the text as data.memory, the OSS v1.1 shape as memory: either passes here)
                     no "infer" key (Mem0's default true) -> 400 {"detail": "... infer=false ..."}
  get_all(...)       POST /v3/memories/?page=&page_size= body {"filters": {...}}
                     -> {"count", "next", "previous", "results": [{id, memory, user_id, agent_id,
                     metadata, created_at, updated_at, ...}]} oldest first; next/previous null at the ends;
                     no page/page_size query: page 1 of Mem0's default page_size 100
  search(q, ...)     POST /v3/memories/search/           body {"query", "filters", "top_k",
                     ["threshold"]} -> {"results": [{id, memory, score, user_id, agent_id,
                     metadata, created_at, updated_at}]} best first, score in [0, 1]; no "threshold": Mem0's
                     default 0.1; "threshold": 0.0 returns every match of the filters (up to top_k)
  get(id)            GET  /v1/memories/{id}/             -> {id, memory, user_id, agent_id, metadata,
                     created_at, updated_at}; unknown id -> 404 (MemoryNotFoundError)
  update(id, text=)  PUT  /v1/memories/{id}/             body {"text"} -> the updated memory object
                     (metadata kept; updated_at moves; the search index follows the new text)
  history(id)        GET  /v1/memories/{id}/history/     -> [{id, memory_id, event: ADD|UPDATE|DELETE,
                     old_memory, new_memory, created_at, ...}] oldest first
  delete(id)         DELETE /v1/memories/{id}/           -> {"message": ...}
  delete_all(user_id=) DELETE /v1/memories/?user_id=...  -> {"message": ...}, also when nothing is left

Filters follow Mem0's platform grammar: {"AND"|"OR": [...]}, {"NOT": {...}}, bare field values
(equality), "*" (any non-null value), {"in": [...]} on entity ids, {"metadata": {k: v}},
{"keywords": {"icontains": text}} on the memory text.
"""
import os
import sys
import tempfile
import uuid
from datetime import datetime, timezone

# Before importing mem0: no telemetry (PostHog) and no ~/.mem0 written in $HOME.
os.environ["MEM0_TELEMETRY"] = "false"
os.environ.setdefault("MEM0_DIR", tempfile.mkdtemp(prefix="mem0-home-"))

from mem0 import MemoryClient  # noqa: E402
from mem0.exceptions import MemoryNotFoundError, ValidationError  # noqa: E402

base, key = sys.argv[1], sys.argv[2]
client = MemoryClient(api_key=key, host=base)

USER = "mem0-alex-" + uuid.uuid4().hex[:8]
AGENT = "mem0-petbot"
SCOPE = {"AND": [{"user_id": USER}]}

CAT = "I adopted a grey cat named Miso last week."
CAT_REPLY = "Congratulations! How is Miso settling in?"
CAT_NEW = "I adopted a grey cat named Mochi last week."
WORK = "I work as a nurse in Lisbon and I love hiking on weekends."


def text_of(entry):
    """A memory's text in an add reply: `memory` (v1.1) or `data.memory` (hosted v3)."""
    if "memory" in entry:
        return entry["memory"]
    return (entry.get("data") or {}).get("memory")


def when(stamp):
    t = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def check_memory(m, where):
    for field in ("id", "memory", "user_id", "created_at", "updated_at", "metadata"):
        assert field in m, f"{where}: memory lacks {field!r}: {m}"
    assert m["user_id"] == USER, f"{where}: user_id {m['user_id']!r} != {USER!r}: {m}"


def expect_error(cls, call, *args, **kwargs):
    try:
        out = call(*args, **kwargs)
    except cls as e:
        return e
    raise AssertionError(f"{call.__name__}{args} should raise {cls.__name__}, returned {out!r}")


# --- add, infer=False: a conversation (list of messages) with agent and metadata ---
r = client.add(
    [{"role": "user", "content": CAT}, {"role": "assistant", "content": CAT_REPLY}],
    user_id=USER, agent_id=AGENT, metadata={"topic": "pets"}, infer=False,
)
assert isinstance(r, dict) and isinstance(r.get("results"), list), f"add: no results list: {r}"
assert len(r["results"]) == 2, f"add infer=False: one memory per message expected, got {r}"
for e in r["results"]:
    assert e.get("id") and e.get("event") == "ADD", f"add: entry needs id and event ADD: {e}"
assert sorted(text_of(e) for e in r["results"]) == sorted([CAT, CAT_REPLY]), f"add: verbatim text expected: {r}"
cat_id = next(e["id"] for e in r["results"] if text_of(e) == CAT)

# --- add, infer=False: messages as a plain string (the client wraps it as one user message) ---
r = client.add(WORK, user_id=USER, infer=False)
assert isinstance(r.get("results"), list) and len(r["results"]) == 1, f"add(str): one result expected: {r}"
e = r["results"][0]
assert e.get("id") and e.get("event") == "ADD" and text_of(e) == WORK, f"add(str): {e}"
work_id = e["id"]
TOTAL = 3

# --- add with Mem0's default infer (True): refused with 400 naming infer ---
err = expect_error(ValidationError, client.add, "I also have a dog called Rex.", user_id=USER)
assert "infer" in str(err), f"the 400 should say to send infer=false, got: {err!r}"
assert err.debug_info.get("status_code") == 400, err.debug_info

# --- get_all: everything for the user, then paged ---
page = client.get_all(filters=SCOPE)
assert isinstance(page, dict), f"get_all: a paginated object expected, got {type(page).__name__}: {page}"
for k in ("count", "next", "previous", "results"):
    assert k in page, f"get_all: envelope lacks {k!r}: {page}"
assert page["count"] == TOTAL and len(page["results"]) == TOTAL, f"get_all: {TOTAL} memories expected: {page}"
for m in page["results"]:
    check_memory(m, "get_all")
by_id = {m["id"]: m for m in page["results"]}
assert len(by_id) == TOTAL and cat_id in by_id and work_id in by_id, f"get_all: ids differ from add's: {page}"
assert sorted(m["memory"] for m in page["results"]) == sorted([CAT, CAT_REPLY, WORK]), f"get_all: texts: {page}"
assert by_id[cat_id]["memory"] == CAT and by_id[cat_id]["metadata"].get("topic") == "pets", by_id[cat_id]
assert by_id[cat_id].get("agent_id") == AGENT, f"get_all: agent_id lost: {by_id[cat_id]}"
assert by_id[work_id]["memory"] == WORK, by_id[work_id]

p1 = client.get_all(filters=SCOPE, page=1, page_size=2)
assert p1["count"] == TOTAL and len(p1["results"]) == 2, f"page 1 of size 2: {p1}"
assert p1["next"] is not None and p1["previous"] is None, f"page 1: next set, previous null: {p1}"
p2 = client.get_all(filters=SCOPE, page=2, page_size=2)
assert p2["count"] == TOTAL and len(p2["results"]) == 1, f"page 2 of size 2: {p2}"
assert p2["next"] is None and p2["previous"] is not None, f"page 2: next null, previous set: {p2}"
for m in p1["results"] + p2["results"]:
    check_memory(m, "get_all paged")
paged = [m["id"] for m in p1["results"] + p2["results"]]
assert sorted(paged) == sorted(by_id), f"pages should cover every memory once: {paged} vs {list(by_id)}"

# --- search ---
s = client.search("What is the cat's name?", filters=SCOPE, top_k=3)
res = s.get("results") if isinstance(s, dict) else None
assert res, f"search: non-empty results expected: {s}"
assert len(res) <= 3, f"search: top_k=3 gave {len(res)}"
for m in res:
    for field in ("id", "memory", "score"):
        assert field in m, f"search: result lacks {field!r}: {m}"
    assert m["id"] in by_id, f"search: result from another scope: {m}"
scores = [m["score"] for m in res]
assert scores == sorted(scores, reverse=True), f"search: best first expected, scores {scores}"
assert "Miso" in res[0]["memory"], f"search: best result should name Miso: {res}"

# Filter grammar; threshold=0.0 so only the filter decides what comes back.
s = client.search("pets", filters={"AND": [{"user_id": USER}, {"metadata": {"topic": "pets"}}]}, top_k=10, threshold=0.0)
got = {m["id"] for m in s["results"]}
assert got and work_id not in got, f"metadata filter: only topic=pets memories expected: {s}"
assert all((m.get("metadata") or {}).get("topic") == "pets" for m in s["results"]), s

s = client.search("pets", filters={"AND": [{"user_id": USER}, {"agent_id": "*"}]}, top_k=10, threshold=0.0)
assert s["results"] and all(m.get("agent_id") == AGENT for m in s["results"]), f"agent_id '*': only memories with an agent: {s}"
assert work_id not in {m["id"] for m in s["results"]}, s

s = client.search("work", filters={"AND": [{"user_id": USER}, {"NOT": {"metadata": {"topic": "pets"}}}]}, top_k=10, threshold=0.0)
assert [m["id"] for m in s["results"]] == [work_id], f"NOT metadata: only the work memory expected: {s}"

s = client.search("cat", filters={"AND": [{"user_id": {"in": [USER, USER + "-nobody"]}}]}, top_k=10, threshold=0.0)
assert {m["id"] for m in s["results"]} == set(by_id), f"user_id in [...]: all {TOTAL} expected: {s}"

s = client.search("cat", filters={"AND": [{"user_id": USER + "-nobody"}]}, top_k=10, threshold=0.0)
assert s["results"] == [], f"another user's scope must be empty: {s}"

page = client.get_all(filters={"AND": [{"user_id": USER}, {"keywords": {"icontains": "LISBON"}}]})
assert [m["id"] for m in page["results"]] == [work_id] and page["count"] == 1, f"keywords icontains: {page}"

page = client.get_all(filters={"AND": [{"user_id": USER}, {"OR": [{"metadata": {"topic": "none"}}, {"keywords": {"icontains": "lisbon"}}]}]})
assert [m["id"] for m in page["results"]] == [work_id], f"OR: only the branch that matches: {page}"

# --- get / update / history ---
m = client.get(cat_id)
assert isinstance(m, dict), m
check_memory(m, "get")
assert m["id"] == cat_id and m["memory"] == CAT, f"get: {m}"
assert m.get("agent_id") == AGENT and (m["metadata"] or {}).get("topic") == "pets", f"get: {m}"
before = when(m["updated_at"])

u = client.update(cat_id, text=CAT_NEW)
assert isinstance(u, dict), u
assert u.get("id") == cat_id and u.get("memory") == CAT_NEW, f"update: the updated memory expected: {u}"

m = client.get(cat_id)
assert m["memory"] == CAT_NEW, f"get after update: {m}"
assert when(m["updated_at"]) >= when(m["created_at"]), f"updated_at before created_at: {m}"
assert when(m["updated_at"]) >= before, f"updated_at went back: {m}"
assert (m["metadata"] or {}).get("topic") == "pets", f"update with text only must keep metadata: {m}"

s = client.search("What is the cat's name?", filters=SCOPE, top_k=10, threshold=0.0)
hit = [r for r in s["results"] if r["id"] == cat_id]
assert hit and hit[0]["memory"] == CAT_NEW, f"search after update: the new text expected for {cat_id}: {s}"
assert all(r["memory"] != CAT for r in s["results"]), f"search still shows the old text: {s}"

h = client.history(cat_id)
assert isinstance(h, list) and len(h) >= 2, f"history: a list with ADD and UPDATE expected: {h}"
for e in h:
    for field in ("id", "memory_id", "event", "old_memory", "new_memory", "created_at"):
        assert field in e, f"history entry lacks {field!r}: {e}"
    assert e["memory_id"] == cat_id, e
events = [e["event"] for e in h]
assert events[0] == "ADD" and "UPDATE" in events, f"history: ADD first, then UPDATE: {events}"
assert h[0]["new_memory"] == CAT and h[0]["old_memory"] in (None, ""), h[0]
upd = [e for e in h if e["event"] == "UPDATE"][-1]
assert upd["old_memory"] == CAT and upd["new_memory"] == CAT_NEW, f"history UPDATE: {upd}"

# --- delete one ---
d = client.delete(cat_id)
assert isinstance(d, dict), d
expect_error(MemoryNotFoundError, client.get, cat_id)
page = client.get_all(filters=SCOPE)
assert page["count"] == TOTAL - 1 and cat_id not in {m["id"] for m in page["results"]}, f"after delete: {page}"

# --- delete_all, twice (idempotent), then nothing is left ---
for i in range(2):
    d = client.delete_all(user_id=USER)
    assert isinstance(d, dict), f"delete_all #{i + 1}: {d}"
page = client.get_all(filters=SCOPE)
assert page["results"] == [] and page["count"] == 0, f"get_all after delete_all: {page}"
s = client.search("What is the cat's name?", filters=SCOPE, top_k=3)
assert s["results"] == [], f"search after delete_all: {s}"
expect_error(MemoryNotFoundError, client.get, work_id)

# --- an unknown id ---
err = expect_error(MemoryNotFoundError, client.get, str(uuid.uuid4()))
assert err.debug_info.get("status_code") == 404, err.debug_info

print("mem0 client: ok")
