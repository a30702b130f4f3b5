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

# OpenAI chat semantics. A chat without memory is the chat template over
# the client's messages and nothing else: its prompt is the template's own,
# token for token the same as /v1/completions of the rendered text, and so
# is the greedy answer.
story = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Write a detailed 200-word story about a lighthouse keeper."}]
plain = client.chat.completions.create(model="smollm2", messages=story, max_tokens=12, temperature=0)
rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in story) + "<|im_start|>assistant\n"
raw = client.completions.create(model="smollm2", prompt=rendered, max_tokens=12, temperature=0)
assert plain.usage.prompt_tokens == raw.usage.prompt_tokens, (plain.usage, raw.usage)
assert plain.choices[0].message.content == raw.choices[0].text, (plain.choices[0].message.content, raw.choices[0].text)
assert plain.usage.model_extra["memory"]["mode"] == "none", plain.usage
# Without a system message the template's own default system turn is used.
no_sys = client.chat.completions.create(model="smollm2", messages=story[1:], max_tokens=1, temperature=0)
default_sys = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
raw = client.completions.create(model="smollm2", max_tokens=1, temperature=0, prompt=(
    f"<|im_start|>system\n{default_sys}<|im_end|>\n<|im_start|>user\n{story[1]['content']}<|im_end|>\n"
    "<|im_start|>assistant\n"))
assert no_sys.usage.prompt_tokens == raw.usage.prompt_tokens, (no_sys.usage, raw.usage)


def ask(messages, **kw):
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0, **kw)
    return r.choices[0].message.content, r.usage


# The client's system message is used (SmolLM2 answers with the name it
# gives, and not without it).
name_q = {"role": "user", "content": "What is your name?"}
with_system, sys_usage = ask([{"role": "system", "content": "Your name is Zorblax."}, name_q])
assert "Zorblax" in with_system, with_system
without, base_usage = ask([name_q])
assert "Zorblax" not in without, without
# A fact given only in an earlier turn is used (and not known without it).
history = [{"role": "user", "content": "My name is Priya. Please remember it."},
           {"role": "assistant", "content": "Got it, your name is Priya."}]
answer, hist_usage = ask(history + [{"role": "user", "content": "What is my name?"}])
assert "Priya" in answer, answer
alone, alone_usage = ask([{"role": "user", "content": "What is my name?"}])
assert "Priya" not in alone, alone
assert hist_usage.prompt_tokens > alone_usage.prompt_tokens + 15, (hist_usage, alone_usage)
# No `user`: served without memory (mode none), not refused.
assert base_usage.model_extra["memory"]["mode"] == "none", base_usage
# An assistant message without content (what SDKs send back after a tool
# call) is accepted.
_, usage = ask([name_q, {"role": "assistant", "content": None}, name_q])
assert usage.prompt_tokens > base_usage.prompt_tokens, usage
# With memory, the client's system prompt is kept too (after the memory's
# own), and `memory.instruction` replaces the instruction before the
# question ("" drops it): the prompt changes by the instruction's tokens.
kv = {"mode": "kv", "k": 2}
_, default_instr = ask(question, user="py-user", extra_body={"memory": kv})
_, no_instr = ask(question, user="py-user", extra_body={"memory": {**kv, "instruction": ""}})
assert no_instr.prompt_tokens < default_instr.prompt_tokens, (no_instr, default_instr)
named, _ = ask([{"role": "system", "content": "Your name is Zorblax."}, name_q], user="py-user",
               extra_body={"memory": {**kv, "instruction": ""}})
assert "Zorblax" in named, named

# Sampling parameters: each changes the output as specified, or is refused
# naming it. top_k = 1 and min_p = 1 keep only the most likely token: at
# temperature 1 they answer as greedy decoding does.
greedy, _ = ask([name_q])
for extra in ({"top_k": 1}, {"min_p": 1.0}):
    r = client.chat.completions.create(model="smollm2", messages=[name_q], max_tokens=16, temperature=1.0, seed=7,
                                       extra_body=extra)
    assert r.choices[0].message.content == greedy, (extra, r.choices[0].message.content, greedy)
# Without them, temperature 2 wanders off the greedy answer.
hot = client.chat.completions.create(model="smollm2", messages=[name_q], max_tokens=16, temperature=2.0, seed=7)
assert hot.choices[0].message.content != greedy, hot.choices[0].message.content
# Penalties against repeating: the greedy answer repeats a word; each
# penalty changes it.
rep = [{"role": "user", "content": "Say the word 'apple' twenty times, separated by spaces."}]
r = client.chat.completions.create(model="smollm2", messages=rep, max_tokens=24, temperature=0)
echo = r.choices[0].message.content
assert echo.lower().count("apple") >= 5, echo
for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
    r = client.chat.completions.create(model="smollm2", messages=rep, max_tokens=24, temperature=0, **kw)
    assert r.choices[0].message.content != echo, (kw, r.choices[0].message.content)
    assert r.choices[0].message.content.lower().count("apple") < echo.lower().count("apple"), kw
for param, kw in [("top_k", {"extra_body": {"top_k": -2}}), ("min_p", {"extra_body": {"min_p": 1.5}}),
                  ("repetition_penalty", {"extra_body": {"repetition_penalty": 0}}),
                  ("presence_penalty", {"presence_penalty": 3.0}), ("frequency_penalty", {"frequency_penalty": -3.0}),
                  ("top_logprobs", {"logprobs": True, "top_logprobs": 21}), ("n", {"n": 2}),
                  ("max_tokens", {"max_tokens": 100000})]:
    try:
        client.chat.completions.create(model="smollm2", messages=[name_q], **kw)
        raise AssertionError(f"{param}: accepted")
    except openai.BadRequestError as e:
        assert e.param == param, (param, e.param, str(e))
        assert "unknown variant" not in str(e) and "untagged" not in str(e), str(e)
# A prompt longer than the context, without memory: refused up front with a
# hint that fits it (not "lower k").
try:
    client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "word " * 9000}],
                                   max_tokens=4)
    raise AssertionError("a 9,000-token prompt accepted on an 8,192-token context")
except openai.BadRequestError as e:
    assert e.param == "messages" and "context" in str(e) and "memory.k" not in str(e), (e.param, str(e))

# Log-probabilities, as OpenAI reports them: one entry per generated token,
# its text, its logprob and the most likely alternatives; the chosen token
# is the most likely one under greedy decoding.
r = client.chat.completions.create(model="smollm2", messages=[name_q], max_tokens=8, temperature=0, logprobs=True,
                                   top_logprobs=3)
content = r.choices[0].logprobs.content
assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
assert "".join(t.token for t in content) == r.choices[0].message.content, content
for t in content:
    assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token, t
    assert t.logprob <= 0 and abs(t.logprob - t.top_logprobs[0].logprob) < 1e-6, t
    assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob, t
    assert bytes(t.bytes).decode("utf-8") == t.token, t
streamed = []
for chunk in client.chat.completions.create(model="smollm2", messages=[name_q], max_tokens=8, temperature=0,
                                            logprobs=True, stream=True):
    for c in chunk.choices:
        if c.logprobs and c.logprobs.content:
            streamed.extend(c.logprobs.content)
assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in content], streamed
r = client.chat.completions.create(model="smollm2", messages=[name_q], max_tokens=4, temperature=0)
assert r.choices[0].logprobs is None, r.choices[0]
c = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0,
                              logprobs=2)
lp = c.choices[0].logprobs
assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == len(lp.tokens), lp
# Offsets into the completion's text (as vLLM gives them without `echo`).
assert all(len(t) == 2 for t in lp.top_logprobs), lp
assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))], lp

# One model, also by id.
m = client.models.retrieve("smollm2")
assert m.id == "smollm2" and m.created > 1_700_000_000, m
try:
    client.models.retrieve("gpt-4")
    raise AssertionError("an unknown model retrieved")
except openai.NotFoundError as e:
    assert "gpt-4" in str(e), e

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
    client.chat.completions.create(model="smollm2", messages=[name_q], tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}])
    raise AssertionError("tools accepted")
except openai.BadRequestError as e:
    assert e.param == "tools" and body(e)["type"] == "invalid_request_error", body(e)
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
