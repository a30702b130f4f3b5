"""The official `openai` client against `inferscale serve`, unchanged.

Run by crates/cli/tests/serving.rs with the server's base URL. Exits
non-zero (an assertion) on any difference from what the API promises.
"""
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="any-key-works-without-keys")

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

print("openai client: ok:", text)
