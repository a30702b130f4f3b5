"""The official `openai` client against `inferscale serve`, unchanged.

Run by crates/cli/tests/serving.rs with the server's base URL and its one
API key; the server runs one request at a time with a queue of one (to
show 429). Exits non-zero (an assertion) on any difference from what the
API promises.
"""
import base64
import math
import struct
import sys
import threading
import time

import openai

base, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key=key)

models = [m.id for m in client.models.list().data]
assert models == ["smollm2"], models

# Memory goes in through our endpoint (the client has no method for it).
r = client.post(
    "/memories",
    cast_to=object,
    body={
        "user": "py-user",
        "turns": [
            {"id": "D1:1", "speaker": "Caroline", "text": "I adopted a grey cat named Miso last week.",
             "time": "1:56 pm on 8 May, 2023"},
            {"id": "D1:2", "speaker": "Melanie", "text": "I ran a charity race for mental health on Saturday.",
             "time": "1:56 pm on 8 May, 2023"},
        ],
    },
)
assert r["added"] == 2, r

question = [{"role": "user", "content": "What is the name of Caroline's cat?"}]
memory = {"memory": {"mode": "kv", "k": 2}}

full = client.chat.completions.create(
    model="smollm2", messages=question, user="py-user", max_tokens=16, temperature=0, extra_body=memory
)
text = full.choices[0].message.content
assert "Miso" in text, text
assert full.choices[0].finish_reason in ("stop", "length"), full.choices[0].finish_reason
assert full.usage.completion_tokens > 0
mem = full.usage.model_extra["memory"]
assert mem["facts"] == 2 and mem["injected_tokens"] > 0, mem
assert full.usage.prompt_tokens_details.cached_tokens >= mem["injected_tokens"], full.usage

# Streaming: the same greedy answer, piece by piece, then usage.
pieces, finish, usage = [], None, None
stream = client.chat.completions.create(
    model="smollm2", messages=question, user="py-user", max_tokens=16, temperature=0, stream=True,
    stream_options={"include_usage": True}, extra_body=memory,
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(pieces) == text, ("".join(pieces), text)
assert len(pieces) > 1, pieces
assert finish == full.choices[0].finish_reason, finish
assert usage is not None and usage.completion_tokens == full.usage.completion_tokens, usage

# Prompt mode answers from the same facts, pasted as text.
prompt = client.chat.completions.create(
    model="smollm2", messages=question, user="py-user", max_tokens=16, temperature=0,
    extra_body={"memory": {"mode": "prompt", "k": 2}},
)
assert prompt.usage.model_extra["memory"]["injected_tokens"] == 0
assert "Miso" in prompt.choices[0].message.content, prompt.choices[0].message.content

# Errors arrive as the client's typed exceptions.
try:
    client.chat.completions.create(model="no-such-model", messages=question, user="py-user")
    raise AssertionError("unknown model accepted")
except openai.NotFoundError as e:
    assert "no-such-model" in str(e), e
try:
    client.chat.completions.create(model="smollm2", messages=question, extra_body={"memory": {"k": 10**9}},
                                   user="py-user")
    raise AssertionError("k = 1e9 accepted")
except openai.BadRequestError as e:
    assert "memory.k" in str(e), e

# OpenAI chat semantics. A system message replaces the server's system
# prompt: SmolLM2 answers with the name it gives (and not without it).
def ask(messages, **kw):
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0, **kw)
    return r.choices[0].message.content, r.usage


name_q = {"role": "user", "content": "What is your name?"}
with_system, sys_usage = ask([{"role": "system", "content": "Your name is Zorblax."}, name_q])
assert "Zorblax" in with_system, with_system
without, base_usage = ask([name_q])
assert "Zorblax" not in without, without
# A fact given only in an earlier turn is used (and not known without it).
history = [{"role": "user", "content": "Hi! My name is Priya."},
           {"role": "assistant", "content": "Hello Priya, nice to meet you!"}]
answer, hist_usage = ask(history + [{"role": "user", "content": "What is my name?"}])
assert "Priya" in answer, answer
alone, alone_usage = ask([{"role": "user", "content": "What is my name?"}])
assert "Priya" not in alone, alone
assert hist_usage.prompt_tokens > alone_usage.prompt_tokens + 15, (hist_usage, alone_usage)
# No `user`: served without memory (mode none), not refused.
assert base_usage.model_extra["memory"]["mode"] == "none", base_usage
# The same system prompt again: its header is cached now.
_, again = ask([{"role": "system", "content": "Your name is Zorblax."}, name_q])
assert again.prompt_tokens_details.cached_tokens > 0, again
assert sys_usage.prompt_tokens_details.cached_tokens == 0, sys_usage

# Completions: a raw prompt, with memory through the same extension.
c = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
assert "Paris" in c.choices[0].text, c
assert c.object == "text_completion" and c.usage.prompt_tokens == 5, c
c = client.completions.create(model="smollm2", prompt="Caroline: My cat is named", max_tokens=8, temperature=0,
                              user="py-user", extra_body={"memory": {"mode": "kv", "k": 1}})
assert c.usage.model_extra["memory"]["fact_ids"] == ["D1:1"], c.usage
streamed = "".join(ch.choices[0].text for ch in client.completions.create(
    model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if ch.choices)
assert streamed.startswith(" Paris"), streamed

# Embeddings: the retrieval encoder; the client asks for base64 by default.
e = client.embeddings.create(model="all-MiniLM-L6-v2", input=["I have a cat.", "I own a kitten.", "Tax law"])
vecs = [d.embedding for d in e.data]
assert [len(v) for v in vecs] == [384] * 3, [len(v) for v in vecs]
dot = lambda a, b: sum(x * y for x, y in zip(a, b))
assert abs(dot(vecs[0], vecs[0]) - 1) < 1e-4
assert dot(vecs[0], vecs[1]) > dot(vecs[0], vecs[2]) + 0.2, (dot(vecs[0], vecs[1]), dot(vecs[0], vecs[2]))
raw = client.embeddings.create(model="minilm", input="I have a cat.", encoding_format="float")
assert max(abs(a - b) for a, b in zip(raw.data[0].embedding, vecs[0])) < 1e-6
assert e.usage.prompt_tokens > 6, e.usage


# Every error status in OpenAI's shape, as the client's typed exceptions.
def body(e):
    b = e.body if isinstance(e.body, dict) else {}
    return b.get("error", b)


try:
    client.chat.completions.create(model="smollm2", messages=[name_q], logprobs=True)
    raise AssertionError("logprobs accepted")
except openai.BadRequestError as e:
    assert e.param == "logprobs" and body(e)["type"] == "invalid_request_error", body(e)
try:
    openai.OpenAI(base_url=base, api_key="wrong").models.list()
    raise AssertionError("a wrong key accepted")
except openai.AuthenticationError as e:
    assert e.status_code == 401 and "message" in body(e), body(e)
try:
    client.embeddings.create(model="text-embedding-3-small", input="x")
    raise AssertionError("unknown embedding model accepted")
except openai.NotFoundError as e:
    assert "all-MiniLM-L6-v2" in body(e)["message"], body(e)
for method, path, payload, status in [("get", "/chat/completions", None, 405),
                                      ("post", "/chat/completions", {"pad": "x" * (5 << 20)}, 413)]:
    try:
        getattr(client, method)(path, cast_to=object, **({"body": payload} if payload else {}))
        raise AssertionError(f"{method} {path}: no error")
    except openai.APIStatusError as e:
        assert e.status_code == status and body(e)["message"] and "param" in body(e), (status, body(e))

# 429 with Retry-After: one request running, one queued, the third refused.
long = client.chat.completions.create(model="smollm2", messages=[name_q], max_tokens=400, stream=True,
                                      extra_body={"ignore_eos": True})
next(iter(long))
queued = threading.Thread(target=lambda: ask([name_q]))
queued.start()
time.sleep(1.0)
try:
    client.with_options(max_retries=0).chat.completions.create(model="smollm2", messages=[name_q], max_tokens=1)
    raise AssertionError("a third request was accepted with a queue of one")
except openai.RateLimitError as e:
    assert e.response.headers.get("retry-after") == "1", e.response.headers
    assert body(e)["type"] == "rate_limit_error", body(e)
finally:
    long.close()
    queued.join()

print("openai client: ok:", text)
