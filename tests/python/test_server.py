"""Integration tests of `nucleus serve` through the official `openai` client (and raw HTTP
where the client cannot say it): the OpenAI shapes, usage, streaming, n, logprobs, seeds,
structured output, stop strings, errors, admission (503) and client disconnects.

Models: stories260K (a real tiny Llama, no chat template) from `<repo>/../shared/models`, and
a tiny random Qwen3 written at test time with MiniMind's tokenizer (ChatML template)."""

from __future__ import annotations

import json
import math
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from conftest import STORIES, Server, httpx

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story."}]


def tokenize(server: Server, **body) -> dict:
    with server.http() as h:
        r = h.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_usage(usage, completion_tokens: int | None = None) -> None:
    assert usage is not None
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens, usage


def metric(server: Server, name: str) -> float:
    """The value of one series of /metrics (the server labels each with `model_name`)."""
    with server.http() as h:
        r = h.get("/metrics")
    assert r.status_code == 200, r.text
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", re.M)
    m = pattern.search(r.text)
    assert m, f"no {name} in /metrics:\n{r.text}"
    return float(m.group(2))


def error_of(exc: openai.APIStatusError) -> dict:
    """The `error` object of an OpenAI-shaped error body, checked for its four keys."""
    body = exc.response.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]


# --- basics ---------------------------------------------------------------------------------

def test_metrics_shape(stories):
    with stories.http() as h:
        r = h.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    for name in ("nucleus:num_requests_running", "nucleus:num_requests_waiting"):
        assert re.search(rf'^{name}{{model_name="tiny"}} \d+$', r.text, re.M), r.text
        assert f"# TYPE {name} gauge" in r.text


def test_latency_buckets_reach_hours(stories):
    # vLLM's buckets (vllm/v1/metrics/loggers.py): a 10-minute request is in a bucket.
    with stories.http() as h:
        text = h.get("/metrics").text
    for name, top in (("time_to_first_token_seconds", "2560"),
                      ("inter_token_latency_seconds", "80"),
                      ("e2e_request_latency_seconds", "7680")):
        les = re.findall(rf'^nucleus:{name}_bucket\{{[^}}]*le="([^"]+)"', text, re.M)
        assert les[-2:] == [top, "+Inf"], (name, les)


def test_logit_bias_keys_are_canonical_ids(stories):
    client = stories.client()
    args = dict(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    # A +100 bias on one id makes it the greedy choice.
    r = client.completions.create(logit_bias={"300": 100}, **args)
    with stories.http() as h:
        d = h.post("/detokenize", json={"tokens": [300, 300]})
    assert d.status_code == 200, d.text
    # (A completion's first piece keeps SentencePiece's leading space; a decode from the start
    # drops it.)
    assert r.choices[0].text.lstrip() == d.json()["prompt"], (r.choices[0].text, d.text)
    for key in ("01", "+1", " 1", "1.0", "-1"):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(logit_bias={key: 1}, **args)
        err = error_of(e.value)
        assert err["param"] == "logit_bias", err
        assert repr(key).strip("'") in err["message"] or key in err["message"], err


def test_logprobs_mode_processed_is_the_distribution_drawn_from(stories):
    client = stories.client()
    args = dict(model="tiny", prompt=PROMPT, max_tokens=6, seed=3, logprobs=5)
    raw = client.completions.create(extra_body={"top_k": 2}, **args).choices[0].logprobs
    processed = client.completions.create(
        extra_body={"top_k": 2, "logprobs_mode": "processed_logprobs"}, **args).choices[0].logprobs
    # The same seed draws the same tokens whichever distribution is reported.
    assert processed.tokens == raw.tokens
    for pos, (r, p) in enumerate(zip(raw.top_logprobs, processed.top_logprobs)):
        assert all(v > -9999.0 for v in r.values()), r
        kept = {t: v for t, v in p.items() if v > -9999.0}
        # top_k 2 keeps two candidates (ties aside), renormalised to 1 at temperature 1.
        assert len(kept) == 2, p
        assert abs(sum(math.exp(v) for v in kept.values()) - 1.0) < 1e-5, p
        # The kept ones are the raw two most likely, in the same order.
        raw_top2 = sorted(r, key=r.get, reverse=True)[:2]
        assert sorted(kept) == sorted(raw_top2), (pos, r, p)
        assert processed.tokens[pos] in kept


@pytest.mark.parametrize("extra, param, code", [
    ({"logprobs_mode": "processed_logprobs"}, "logprobs_mode", None),  # without logprobs
    ({"logprobs_mode": "raw_logits", "logprobs": 1}, "logprobs_mode", "not_supported"),
    ({"logprobs_mode": "processed", "logprobs": 1}, "logprobs_mode", None),
    ({"logprobs_mode": 1, "logprobs": 1}, "logprobs_mode", None),
])
def test_logprobs_mode_refusals(stories, extra, param, code):
    with stories.http() as h:
        r = h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if code:
        assert err["code"] == code, err


def test_models_and_health(stories):
    models = stories.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with stories.http() as h:
        r = h.get("/health")
    assert r.status_code == 200


# --- 1. completions -------------------------------------------------------------------------

def test_completion_usage(stories):
    client = stories.client()
    count = tokenize(stories, prompt=PROMPT)["count"]
    for seed, max_tokens in [(1, 16), (2, 40), (3, 5)]:
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens,
                                      seed=seed, temperature=1.0)
        assert r.object == "text_completion"
        assert r.model == "tiny"
        assert len(r.choices) == 1
        c = r.choices[0]
        assert c.index == 0
        assert isinstance(c.text, str) and c.text != ""
        assert c.finish_reason in ("stop", "length")
        assert_usage(r.usage)
        assert r.usage.prompt_tokens == count
        assert 1 <= r.usage.completion_tokens <= max_tokens
        if c.finish_reason == "length":
            assert r.usage.completion_tokens == max_tokens


def test_greedy_known_output(stories):
    """stories260K's greedy text from BOS alone (shared/models/README.md)."""
    r = stories.client().completions.create(model="tiny", prompt=[1], max_tokens=60,
                                            temperature=0)
    assert r.choices[0].text == (
        "Once upon a time, there was a little girl named Lily. She loved to play outside in "
        "the park. One day, she saw a big, red ball. She wanted to play with it, but it was "
        "too high")
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (1, 60)


def test_no_seed_is_random(stories):
    client = stories.client()
    texts = {client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                       temperature=1.0).choices[0].text for _ in range(4)}
    assert len(texts) > 1, f"four unseeded requests at temperature 1 gave one text: {texts}"


def test_prompt_as_token_ids_and_echo(stories):
    client = stories.client()
    ids = tokenize(stories, prompt=PROMPT)["tokens"]
    args = dict(model="tiny", max_tokens=12, seed=7, temperature=1.0)
    text = client.completions.create(prompt=PROMPT, **args)
    by_ids = client.completions.create(prompt=ids, **args)
    assert by_ids.choices[0].text == text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(prompt=PROMPT, echo=True, **args)
    assert echoed.choices[0].text == PROMPT + text.choices[0].text
    with stories.http() as h:
        r = h.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"].strip() == PROMPT
    # `echo` of token ids shows them as the completion is shown: the BOS the tokenizer added
    # (`<s>`, id 1) only with skip_special_tokens false.
    assert ids[0] == 1, ids
    echo_ids = client.completions.create(prompt=ids, echo=True, **args).choices[0].text
    assert "<s>" not in echo_ids
    assert echo_ids == r.json()["prompt"] + text.choices[0].text
    kept = client.completions.create(prompt=ids, echo=True, extra_body={
        "skip_special_tokens": False}, **args).choices[0].text
    assert kept.startswith("<s>"), kept


def test_list_of_prompts(stories):
    client = stories.client()
    prompts = ["Once upon a time", "The little dog"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, seed=3,
                                  temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    counts = [tokenize(stories, prompt=p)["count"] for p in prompts]
    assert r.usage.prompt_tokens == sum(counts)
    # Each prompt's choice is the same as that prompt alone with the same seed.
    for p, c in zip(prompts, r.choices):
        alone = client.completions.create(model="tiny", prompt=p, max_tokens=8, seed=3,
                                          temperature=1.0)
        assert c.text == alone.choices[0].text


# --- 2. chat ----------------------------------------------------------------------------------

def test_chat(qwen3):
    client = qwen3.client()
    count = tokenize(qwen3, messages=CHAT)["count"]
    r = client.chat.completions.create(model="qwen", messages=CHAT, max_tokens=12, seed=1)
    assert r.object == "chat.completion"
    assert r.model == "qwen"
    assert len(r.choices) == 1
    m = r.choices[0].message
    assert m.role == "assistant"
    assert isinstance(m.content, str) and m.content != ""
    assert r.choices[0].finish_reason in ("stop", "length")
    assert_usage(r.usage)
    assert r.usage.prompt_tokens == count
    assert 1 <= r.usage.completion_tokens <= 12
    # max_completion_tokens is the newer name of max_tokens.
    r2 = client.chat.completions.create(model="qwen", messages=CHAT, max_completion_tokens=12,
                                        seed=1)
    assert r2.choices[0].message.content == m.content


def test_chat_template_in_prompt(qwen3):
    """The prompt is MiniMind's ChatML rendering of the messages."""
    ids = tokenize(qwen3, messages=CHAT)["tokens"]
    with qwen3.http() as h:
        text = h.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        raw = h.post("/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    assert "Tell me a story." in text
    assert "<|im_start|>" in raw["token_strs"] and "<|im_end|>" in raw["token_strs"], raw


# --- 3. streaming -----------------------------------------------------------------------------

def test_completion_stream_matches_non_stream(stories):
    client = stories.client()
    args = dict(model="tiny", prompt=PROMPT, max_tokens=40, seed=11, temperature=1.0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **args))
    assert len(chunks) >= 2
    last = chunks[-1]
    assert last.choices == []
    assert_usage(last.usage, whole.usage.completion_tokens)
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    body = chunks[:-1]
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]


def test_completion_stream_without_usage(stories):
    client = stories.client()
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, seed=1,
                                            stream=True))
    assert chunks and all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_chat_stream_matches_non_stream(qwen3):
    client = qwen3.client()
    args = dict(model="qwen", messages=CHAT, max_tokens=24, seed=5, temperature=1.2)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **args))
    last = chunks[-1]
    assert last.choices == []
    assert_usage(last.usage, whole.usage.completion_tokens)
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    body = chunks[:-1]
    assert body[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]


def test_stream_n_choices(stories):
    """n > 1 streamed: each index's deltas make that choice's non-streamed text."""
    client = stories.client()
    args = dict(model="tiny", prompt=PROMPT, max_tokens=16, n=3, seed=21, temperature=1.0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **args))
    assert chunks[-1].choices == []
    assert_usage(chunks[-1].usage, whole.usage.completion_tokens)
    texts = {i: "" for i in range(3)}
    finishes = {}
    for c in chunks[:-1]:
        assert len(c.choices) == 1
        ch = c.choices[0]
        texts[ch.index] += ch.text
        if ch.finish_reason:
            assert ch.index not in finishes, "two finish reasons for one choice"
            finishes[ch.index] = ch.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


def test_chat_stream_logprobs(qwen3):
    client = qwen3.client()
    args = dict(model="qwen", messages=CHAT, max_tokens=10, seed=8, temperature=1.2,
                logprobs=True, top_logprobs=1)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **args))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [e.token for e in entries] == [e.token for e in whole.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == \
        pytest.approx([e.logprob for e in whole.choices[0].logprobs.content])


# --- 4. n > 1 ---------------------------------------------------------------------------------

def test_n_choices(stories):
    client = stories.client()
    n = 4
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, n=n, seed=42,
                                  temperature=1.0, logprobs=0)
    assert sorted(c.index for c in r.choices) == list(range(n))
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1, f"all {n} choices are the same at temperature 1: {texts}"
    per_choice = [len(c.logprobs.tokens) for c in r.choices]
    assert all(1 <= k <= 20 for k in per_choice), per_choice
    assert r.usage.completion_tokens == sum(per_choice)
    assert_usage(r.usage)
    assert r.usage.prompt_tokens == tokenize(stories, prompt=PROMPT)["count"]
    # The same request again gives the same choices (the seed fixes all of them).
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, n=n, seed=42,
                                      temperature=1.0, logprobs=0)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def test_chat_n_choices(qwen3):
    client = qwen3.client()
    r = client.chat.completions.create(model="qwen", messages=CHAT, max_tokens=10, n=3,
                                       seed=2, temperature=1.5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * 10
    assert len({c.message.content for c in r.choices}) > 1


# --- 5. logprobs ------------------------------------------------------------------------------

def test_completion_logprobs(stories):
    client = stories.client()
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, seed=3,
                                  temperature=1.0, logprobs=3)
    lp = r.choices[0].logprobs
    k = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == k
    assert len(lp.text_offset) == k
    assert all(x <= 0.0 for x in lp.token_logprobs), lp.token_logprobs
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # The 3 best and the sampled token (vLLM's form: up to logprobs + 1 entries).
        assert 3 <= len(top) <= 4, top
        assert top[tok] == pytest.approx(val), (tok, top)
        assert all(v <= 0.0 for v in top.values()), top
    assert "".join(lp.tokens) == r.choices[0].text
    # text_offset: where each token's text starts in the completion (OpenAI counts characters).
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(k)]


def test_completion_logprobs_greedy_top_is_sampled(stories):
    """At temperature 0 the chosen token is the most likely: its logprob is the top one."""
    client = stories.client()
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok in top, (tok, top)
        assert top[tok] == pytest.approx(val)
        assert val == pytest.approx(max(top.values()))


def test_completion_logprobs_text_offset_non_ascii(qwen3):
    """text_offset in characters also where tokens are not ASCII (MiniMind's vocabulary is
    mostly Chinese: the random Qwen3 at a high temperature writes such tokens)."""
    client = qwen3.client()
    r = client.completions.create(model="qwen", prompt="你好", max_tokens=24, seed=3,
                                  temperature=1.5, logprobs=1,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    text = r.choices[0].text
    assert any(ord(ch) > 127 for ch in text), f"no non-ASCII text to test with: {text!r}"
    assert "".join(lp.tokens) == text
    expected = [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.text_offset == expected, (
        "SERVER BUG: completions logprobs.text_offset counts UTF-8 bytes, not characters "
        f"(OpenAI and vLLM count characters): got {lp.text_offset}, expected {expected}")


def test_completion_logprobs_with_echo_is_refused(stories):
    """echo with logprobs would need the prompt's log-probabilities (OpenAI and vLLM list the
    prompt's tokens too), which nucleus does not compute: a 400 not_supported, not an object
    whose tokens and offsets miss the echoed prompt."""
    with pytest.raises(openai.BadRequestError) as e:
        stories.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=6, seed=2,
                                            temperature=1.0, logprobs=1, echo=True)
    assert e.value.code == "not_supported"
    assert e.value.param == "echo"


def test_chat_logprobs(qwen3):
    client = qwen3.client()
    r = client.chat.completions.create(model="qwen", messages=CHAT, max_tokens=12, seed=4,
                                       temperature=1.2, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2, entry
        assert all(t.logprob <= 0.0 for t in entry.top_logprobs)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert "".join(e.token for e in content) == r.choices[0].message.content
    # Without logprobs, none come back.
    plain = client.chat.completions.create(model="qwen", messages=CHAT, max_tokens=4, seed=4)
    assert plain.choices[0].logprobs is None


# --- 6. seeds ---------------------------------------------------------------------------------

def test_seed_reproducible_alone_and_in_batch(stories):
    client = stories.client()
    args = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0)
    ref_seed = 1234
    alone = client.completions.create(seed=ref_seed, **args).choices[0].text
    assert client.completions.create(seed=ref_seed, **args).choices[0].text == alone

    seeds = [ref_seed] + [100 + i for i in range(15)]
    barrier = threading.Barrier(len(seeds))

    def one(seed: int) -> str:
        barrier.wait(10)
        return client.completions.create(seed=seed, **args).choices[0].text

    with ThreadPoolExecutor(len(seeds)) as pool:
        texts = list(pool.map(one, seeds))
    assert texts[0] == alone, "the same seed gave another text when batched with 15 others"
    # Other seeds give other texts (in practice: at most a coincidence or two).
    others = texts[1:]
    differ = sum(t != alone for t in others)
    assert differ >= 13, f"only {differ} of 15 other seeds gave a text other than seed {ref_seed}"
    assert len(set(others)) >= 12, others
    # A few of the batched ones are also the same as alone.
    for seed, text in list(zip(seeds, texts))[1:4]:
        assert client.completions.create(seed=seed, **args).choices[0].text == text, seed


# --- 7. structured output ---------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "enum": [1, 2, 3]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def check_json_outputs(outputs: list[tuple[str, str]]) -> None:
    stopped = 0
    for text, finish in outputs:
        assert finish in ("stop", "length"), finish
        if finish == "stop":
            stopped += 1
            value = json.loads(text)
            jsonschema.validate(value, SCHEMA)
    assert stopped >= len(outputs) - 1, f"too few finished with stop: {outputs}"


def test_json_schema_completions(stories):
    client = stories.client()
    outputs = []
    for seed in range(6):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, seed=seed,
                                      temperature=1.0,
                                      extra_body={"response_format": RESPONSE_FORMAT})
        outputs.append((r.choices[0].text, r.choices[0].finish_reason))
    check_json_outputs(outputs)


def test_json_schema_chat(qwen3):
    client = qwen3.client()
    outputs = []
    for seed in range(4):
        r = client.chat.completions.create(model="qwen", messages=CHAT, max_tokens=200,
                                           seed=seed, temperature=1.0,
                                           response_format=RESPONSE_FORMAT)
        outputs.append((r.choices[0].message.content, r.choices[0].finish_reason))
    check_json_outputs(outputs)


def test_json_object(stories):
    """`json_object`: any object. The model likes long objects, so `}` gets a logit bias to
    close them within max_tokens (the bias applies where the grammar allows `}`)."""
    client = stories.client()
    brace = tokenize(stories, prompt="}", add_special_tokens=False)["tokens"][-1]
    with stories.http() as h:
        assert h.post("/detokenize", json={"tokens": [brace]}).json()["prompt"] == "}"
    stopped = 0
    for seed in range(3):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=150, seed=seed,
                                      logit_bias={str(brace): 10},
                                      extra_body={"response_format": {"type": "json_object"}})
        text = r.choices[0].text
        assert text.lstrip().startswith("{"), text
        if r.choices[0].finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(text), dict), text
    assert stopped >= 2


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_choice(stories, field):
    client = stories.client()
    choices = ["yes", "no", "maybe so"]
    extra = {"guided_choice": choices} if field == "guided_choice" else \
        {"structured_outputs": {"choice": choices}}
    seen = set()
    for seed in range(6):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, seed=seed,
                                      temperature=1.0, extra_body=extra)
        assert r.choices[0].text in choices, r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
        seen.add(r.choices[0].text)
    assert seen  # at least one answer; which ones depends on the model


def test_regex(stories):
    client = stories.client()
    for seed in range(3):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, seed=seed,
                                      temperature=1.0,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
        assert re.fullmatch("[0-9]{3}", r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"


# --- 8. stop strings --------------------------------------------------------------------------

def test_stop_string(stories):
    client = stories.client()
    args = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0)
    checked = 0
    for seed in range(8):
        free = client.completions.create(seed=seed, **args).choices[0].text
        stopped = client.completions.create(seed=seed, stop=[" was"], **args).choices[0]
        assert " was" not in stopped.text
        if " was" in free:
            checked += 1
            assert stopped.text == free[:free.index(" was")], (seed, free, stopped.text)
            assert stopped.finish_reason == "stop"
        else:
            assert stopped.text == free
    assert checked >= 3, "too few seeds wrote ` was` to test the stop string with"


def test_stop_string_streamed(stories):
    client = stories.client()
    args = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=0,
                stop=" was")
    whole = client.completions.create(**args).choices[0]
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_stop_token_ids(stories):
    client = stories.client()
    there = tokenize(stories, prompt=", there", add_special_tokens=False)["tokens"][-1]
    with stories.http() as h:
        assert h.post("/detokenize", json={"tokens": [there]}).json()["prompt"].strip() == \
            "there"
    args = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0)
    checked = 0
    for seed in range(4):
        free = client.completions.create(seed=seed, logprobs=0, **args).choices[0]
        cut = client.completions.create(seed=seed, logprobs=0,
                                        extra_body={"stop_token_ids": [there]}, **args)
        c = cut.choices[0]
        if " there" in free.logprobs.tokens:
            checked += 1
            at = free.logprobs.tokens.index(" there")
            # The engine's contract: the stop token ends the sample and is not in the text.
            assert c.finish_reason == "stop"
            assert c.text == "".join(free.logprobs.tokens[:at])
            assert cut.usage.completion_tokens == at + 1
    assert checked >= 2, "too few seeds wrote ` there`"


# --- 9. errors --------------------------------------------------------------------------------

def test_bad_temperature(stories):
    with pytest.raises(openai.BadRequestError) as e:
        stories.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                            temperature=-1)
    assert e.value.status_code == 400
    assert e.value.param == "temperature"
    assert error_of(e.value)["type"] == "invalid_request_error"


def test_unknown_field(stories):
    with pytest.raises(openai.BadRequestError) as e:
        stories.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                            extra_body={"no_such_field": 1})
    assert e.value.param == "no_such_field"
    assert "no_such_field" in error_of(e.value)["message"]


def test_tools_not_supported(qwen3):
    tools = [{"type": "function",
              "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        qwen3.client().chat.completions.create(model="qwen", messages=CHAT, tools=tools)
    assert e.value.code == "not_supported"
    assert e.value.param == "tools"


def test_best_of_not_supported(stories):
    with pytest.raises(openai.BadRequestError) as e:
        stories.client().completions.create(model="tiny", prompt=PROMPT, best_of=2)
    assert e.value.code == "not_supported"
    assert e.value.param == "best_of"


def test_malformed_json(stories):
    with stories.http() as h:
        r = h.post("/v1/completions", content=b'{"prompt":',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_wrong_model(stories):
    with pytest.raises(openai.NotFoundError) as e:
        stories.client().completions.create(model="not-this-one", prompt=PROMPT, max_tokens=4)
    assert e.value.status_code == 404
    assert e.value.param == "model"


def test_chat_without_template(stories):
    with pytest.raises(openai.BadRequestError) as e:
        stories.client().chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert e.value.param == "messages"


def test_unknown_route(stories):
    with stories.http() as h:
        r = h.get("/v1/nothing-here")
    assert r.status_code == 404
    assert set(r.json()) == {"error"}


def test_default_body_limit_is_over_2_mib(stories):
    """The default --max-body-bytes is 16 MiB: a 2.2 MB body is read (and then refused for its
    prompt's length, not its size)."""
    big = "Once upon a time. " * 125_000
    with stories.http() as h:
        r = h.post("/v1/completions", json={"model": "tiny", "prompt": big, "max_tokens": 2})
    assert len(big) > 2 * 1024 * 1024
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt", r.text


@pytest.fixture(scope="module")
def limited():
    """stories260K with a small body limit and a short context."""
    s = Server(STORIES, "--served-model-name", "tiny", "--max-body-bytes", "2000",
               "--max-model-len", "64")
    yield s
    s.stop()


def test_body_limit(limited):
    client = limited.client()
    ok = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    assert ok.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a " * 1500, max_tokens=4)
    assert e.value.status_code == 400
    error_of(e.value)


def test_prompt_over_max_model_len(limited):
    long_prompt = "Once upon a time there was a dog. " * 12
    assert len(long_prompt.encode()) < 1500  # under the body limit: the length is at fault
    count = tokenize(limited, prompt=long_prompt)["count"]
    assert count >= 64
    with pytest.raises(openai.BadRequestError) as e:
        limited.client().completions.create(model="tiny", prompt=long_prompt, max_tokens=4)
    assert e.value.param == "prompt"
    # A prompt that fits but asks for more tokens than are left names max_tokens.
    with pytest.raises(openai.BadRequestError) as e:
        limited.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=100)
    assert e.value.param == "max_tokens"
    # Without max_tokens the completion fills at most the context.
    r = limited.client().completions.create(model="tiny", prompt=PROMPT, seed=1,
                                            extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == 64
    assert r.choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def keyed():
    """stories260K behind `--api-key secret`, with the default served model name."""
    s = Server(STORIES, api_key="secret")
    yield s
    s.stop()


def test_api_key(keyed):
    with keyed.http() as h:
        assert h.get("/health").status_code == 200
        models = h.get("/v1/models")
        assert models.status_code == 200
        # The default served name is the --model value as given.
        assert [m["id"] for m in models.json()["data"]] == [str(STORIES)]
        r = h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
        # RFC 6750 section 3: the 401 names the scheme.
        assert r.headers.get("www-authenticate") == "Bearer", r.headers
        r = h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4},
                   headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4},
                   headers={"Authorization": "Bearer secret"})
        assert r.status_code == 200, r.text
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="wrong").completions.create(model=str(STORIES), prompt=PROMPT,
                                                         max_tokens=4)
    r = keyed.client().completions.create(model=str(STORIES), prompt=PROMPT, max_tokens=4)
    assert r.choices[0].text


# --- 10. admission: 503 when the queue is full ------------------------------------------------

@pytest.fixture(scope="module")
def tight():
    s = Server(STORIES, "--served-model-name", "tiny", "--max-num-seqs", "1",
               "--max-queue", "1")
    yield s
    s.stop()


def test_queue_full_503(tight):
    client = tight.client(timeout=120.0)
    rejected_before = metric(tight, "nucleus:admission_rejections_total")
    total = 8
    barrier = threading.Barrier(total)

    def one(i: int):
        barrier.wait(10)
        try:
            r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1000,
                                          seed=i, extra_body={"ignore_eos": True})
            return ("ok", r.usage.completion_tokens, None)
        except openai.APIStatusError as e:
            assert error_of(e)["type"] == "unavailable_error", e.response.text
            return ("error", e.status_code, e.response.headers.get("retry-after"))

    with ThreadPoolExecutor(total) as pool:
        results = list(pool.map(one, range(total)))
    assert len(results) == total
    ok = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "error"]
    assert all(r[1] == 1000 for r in ok), results
    assert all(r[1] == 503 and r[2] is not None and int(r[2]) >= 1 for r in refused), results
    assert len(ok) >= 1 and len(refused) >= 1, results
    assert len(ok) + len(refused) == total
    assert metric(tight, "nucleus:admission_rejections_total") - rejected_before == len(refused)


def raw_request(server: Server, body: dict) -> socket.socket:
    """A POST /v1/completions sent on a bare socket (to hang up on it at a chosen moment)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % len(data) + data)
    return sock


def wait_for(server: Server, want: dict[str, float], within_s: float = 5.0) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        got = {k: metric(server, k) for k in want}
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_hang_up_while_waiting_and_running(tight):
    """On the one-seat server: a running request and a waiting one; the waiting client hangs
    up (it leaves the queue), then the running one (it leaves the engine); the two places
    are free again afterwards."""
    running, waiting = "nucleus:num_requests_running", "nucleus:num_requests_waiting"
    aborted_before = metric(tight, "nucleus:request_aborted_total")
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    a = raw_request(tight, long)
    try:
        assert wait_for(tight, {running: 1, waiting: 0}) == {running: 1, waiting: 0}
        b = raw_request(tight, long)
        try:
            assert wait_for(tight, {running: 1, waiting: 1}) == {running: 1, waiting: 1}
        finally:
            b.close()
        assert wait_for(tight, {running: 1, waiting: 0}) == {running: 1, waiting: 0}, \
            "the waiting request stayed queued after its client hung up"
    finally:
        a.close()
    assert wait_for(tight, {running: 0, waiting: 0}) == {running: 0, waiting: 0}, \
        "the running (non-streamed) request stayed in the engine after its client hung up"
    assert metric(tight, "nucleus:request_aborted_total") - aborted_before == 2
    # Both places are free: two requests at once are both served.
    client = tight.client()
    with ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda i: client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=50, seed=i,
            extra_body={"ignore_eos": True}), range(2)))
    assert [r.usage.completion_tokens for r in rs] == [50, 50]


# --- 11. disconnects --------------------------------------------------------------------------

def test_disconnects_free_the_engine(stories):
    aborted_before = metric(stories, "nucleus:request_aborted_total")
    generated_before = metric(stories, "nucleus:generation_tokens_total")
    streams = 10
    max_tokens = 2000
    barrier = threading.Barrier(streams)

    def one(i: int) -> str:
        with httpx.Client(base_url=stories.base, timeout=30.0) as h:
            barrier.wait(10)
            with h.stream("POST", "/v1/completions",
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens,
                                "seed": i, "stream": True, "ignore_eos": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        return line  # leaving the blocks closes the response and connection
        return ""

    with ThreadPoolExecutor(streams) as pool:
        firsts = list(pool.map(one, range(streams)))
    assert all(f.startswith("data: {") for f in firsts), firsts

    deadline = time.monotonic() + 5.0
    running = waiting = None
    while time.monotonic() < deadline:
        running = metric(stories, "nucleus:num_requests_running")
        waiting = metric(stories, "nucleus:num_requests_waiting")
        if running == 0 and waiting == 0:
            break
        time.sleep(0.05)
    assert (running, waiting) == (0, 0), \
        f"requests still in the engine 5 s after their clients left: {running} running, " \
        f"{waiting} waiting"
    assert metric(stories, "nucleus:request_aborted_total") - aborted_before == streams
    generated = metric(stories, "nucleus:generation_tokens_total") - generated_before
    assert generated < streams * max_tokens / 4, f"{generated} tokens generated for left clients"
    # The server still answers.
    r = stories.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    assert r.choices[0].text


# --- shutdown ---------------------------------------------------------------------------------

def test_sigterm_lets_a_running_request_finish():
    s = Server(STORIES, "--served-model-name", "tiny")
    try:
        with httpx.Client(base_url=s.base, timeout=60.0) as h:
            with h.stream("POST", "/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": 400, "stream": True,
                                "ignore_eos": True, "seed": 1,
                                "stream_options": {"include_usage": True}}) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                assert first.startswith("data: {")
                s.proc.send_signal(signal.SIGTERM)
                data = [line[len("data: "):] for line in lines if line.startswith("data:")]
        assert data[-1] == "[DONE]", data[-3:]
        usage = json.loads(data[-2])["usage"]
        assert usage["completion_tokens"] == 400
        assert s.proc.wait(20) == 0
        # Closed: no new connections.
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{s.base}/health", timeout=2.0)
    finally:
        s.stop()
