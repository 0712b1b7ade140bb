"""`llmc serve` through the real `openai` client, on 127.0.0.1, against in-process runs."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter

import numpy as np
import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from llmc.runtime.llm import LLM  # noqa: E402
from llmc.runtime.sampling import SamplingParams  # noqa: E402

# The generation prompt's thinking switch is Qwen3's (chat_template_kwargs {"enable_thinking": false}).
TEMPLATE = ("{% for m in messages %}{{ '### ' + m['role'] + '\\n' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '### assistant\\n' }}"
            "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
            "{% endif %}{% endif %}")
CODE = (("model_name", "code"),)  # the served model's labels in `_Server.metrics()` keys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, engine, *args):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "llmc.cli", "serve", str(engine), "--port", str(self.port),
                                      "--model", "code", *map(str, args)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                assert exc.code in (503, 404)  # loading (404: Ray's proxy, before the app's routes are up)
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.close()
                raise RuntimeError(f"llmc serve did not come up: {self.proc.stderr.read()}")
            time.sleep(0.2)

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics") as r:
            text = r.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def post(self, path: str, body: bytes | str, content_type="application/json"):
        req = urllib.request.Request(self.url + path, data=body if isinstance(body, bytes) else body.encode(),
                                     headers={"Content-Type": content_type}, method="POST")
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read()), dict(exc.headers)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def code_engine(engines):
    return engines("code-small")


@pytest.fixture(scope="module")
def server(code_engine, tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "chat.jinja"
    template.write_text(TEMPLATE)
    s = _Server(code_engine, "--chat-template", template)
    yield s
    s.close()


@pytest.fixture(scope="module")
def local(code_engine):
    return LLM(code_engine)


def _client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)


def test_health_models_and_greedy_completion_match_in_process(server, local):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["code"]
    prompt = "def read_lines(path):\n"
    r = client.completions.create(model="code", prompt=prompt, max_tokens=24, temperature=0)
    expected = local.generate(prompt, SamplingParams(max_tokens=24))
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.token_ids)


def test_streamed_completion_with_usage_and_stop_string(server, local):
    client = _client(server)
    prompt = "import os\n"
    plain = local.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    stop = plain.text[10:13]
    expected = local.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=stop))
    chunks = list(client.completions.create(model="code", prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text and stop not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_several_prompts_in_one_request_each_answer_as_alone(server, local):
    """OpenAI's completions take a list of prompts (what evaluation harnesses send): choice i of
    prompt p is choice p * n + i, and each is what the prompt alone gets."""
    client = _client(server)
    prompts = ["def read(path):\n", "class Point:\n"]
    alone = [local.generate(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
    kw = dict(model="code", max_tokens=6, temperature=0, n=2, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [a.text for a in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(a.prompt_token_ids) for a in alone)
    assert r.usage.completion_tokens == 4 * 6
    chunks = list(client.completions.create(prompt=[a.prompt_token_ids for a in alone], stream=True,
                                            stream_options={"include_usage": True}, **kw))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert texts == [a.text for a in alone for _ in range(2)]
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    for body, fragment in [('{"prompt": ["a", 1]}', "valid string"),
                           ('{"prompt": ["a", ""]}', "prompt 1: prompt is empty")]:
        status, error, _ = server.post("/v1/completions", body)
        assert status == 400 and error["error"]["param"] == "prompt" and fragment in error["error"]["message"], error


def test_n_choices_with_a_seed_are_distinct_and_repeatable(server):
    client = _client(server)
    kw = dict(model="code", prompt="class Config:\n", max_tokens=12, temperature=0.9, n=3, seed=5)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1 and a.usage.completion_tokens == 36


def test_a_seeded_completion_through_the_server_is_the_in_process_one(server, local):
    """Sampling draws are keyed by seed and position: the server's batching with other requests,
    and its own process, change no token of a seeded request."""
    client = _client(server)
    kw = dict(model="code", prompt="def parse(line):\n", max_tokens=24, temperature=0.8, top_p=0.95, seed=11)
    texts = [client.completions.create(**kw).choices[0].text for _ in range(2)]
    ids = local.tokenizer.encode(kw["prompt"]).ids
    here = local.generate(ids, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11))
    assert texts == [here.text] * 2


def test_chat_uses_the_template_streamed_and_not(server, local):
    client = _client(server)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a loop"}]
    rendered = "### system\nYou write Python.\n### user\na loop\n### assistant\n"
    ids = local.tokenizer.encode(rendered, add_special_tokens=False).ids
    expected = local.generate(ids, SamplingParams(max_tokens=16))
    r = client.chat.completions.create(model="code", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == expected.text and r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="code", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_chat_template_kwargs_reach_the_template(server, local):
    """A request's chat_template_kwargs (vLLM's extension: Qwen3's enable_thinking) are the
    template's variables; one the server sets itself is a 400 naming it."""
    client = _client(server)
    messages = [{"role": "user", "content": "a loop"}]
    rendered = "### user\na loop\n### assistant\n<think>\n\n</think>\n\n"
    ids = local.tokenizer.encode(rendered, add_special_tokens=False).ids
    expected = local.generate(ids, SamplingParams(max_tokens=8))
    r = client.chat.completions.create(model="code", messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == expected.text
    status, error, _ = server.post("/v1/chat/completions", json.dumps(
        {"messages": messages, "max_tokens": 8, "chat_template_kwargs": {"messages": []}}))
    assert status == 400 and error["error"]["param"] == "chat_template_kwargs"
    assert "cannot set messages" in error["error"]["message"]


@pytest.mark.parametrize("body,param,fragment", [
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens", "greater than or equal to 1"),
    ('{"prompt": "x", "temperature": -1}', "temperature", "greater than or equal to 0"),
    ('{"prompt": "x", "n": "many"}', "n", "valid integer"),
    ('{"max_tokens": 5}', "prompt", "Field required"),
    ('{"prompt": "' + "x " * 300 + '"}', "prompt", "max context"),
    ('{"prompt": "x", "stop": [""]}', "stop", "non-empty"),
    ('{"prompt": [99999]}', "prompt", "outside the vocabulary"),
    ('{bad json', None, "not valid JSON"),
    ('{"prompt": "x", "presence_penalty": 0.5}', "presence_penalty", "presence_penalty: llmc does not implement"),
    ('{"prompt": "x", "logit_bias": {"5": -100}}', "logit_bias", "does not implement logit_bias"),
    ('{"prompt": "x", "echo": true}', "echo", "does not implement echo"),
    ('{"prompt": "x", "best_of": 3}', "best_of", "does not implement best_of"),
])
def test_bad_requests_get_400_naming_the_field(server, body, param, fragment):
    status, error, _ = server.post("/v1/completions", body)
    assert status == 400, error
    assert error["error"]["param"] == param and fragment in error["error"]["message"]
    assert error["error"]["type"] == "invalid_request_error"


def test_a_null_field_takes_its_default(server, local):
    """`"temperature": null` and the like mean "not given", as in OpenAI's API (a 400 saying None
    is not a number, until 2026-12-07)."""
    nulls = {"temperature": None, "top_p": None, "top_k": None, "n": None, "stop": None, "seed": None,
             "presence_penalty": None, "logit_bias": None, "stream": None, "ignore_eos": None}
    status, body, _ = server.post("/v1/completions", json.dumps({"prompt": "def f(x):", "max_tokens": 5, **nulls,
                                                                 "temperature": 0}))
    assert status == 200 and body["choices"][0]["text"] == local.generate("def f(x):", SamplingParams(max_tokens=5)).text
    status, nulled, _ = server.post("/v1/completions", json.dumps({"prompt": "def f(x):", "max_tokens": 5, **nulls}))
    assert status == 200 and len(nulled["choices"]) == 1, nulled
    status, body, _ = server.post("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": None, "max_completion_tokens": 3,
         "temperature": None, "top_logprobs": None}))
    assert status == 200 and body["usage"]["completion_tokens"] <= 3, body


def test_unimplemented_fields_pass_at_their_neutral_values_and_chat_takes_max_completion_tokens(server, local):
    client = _client(server)
    r = client.completions.create(model="code", prompt="def f(x):", max_tokens=6, temperature=0, presence_penalty=0,
                                  frequency_penalty=0, logit_bias={}, best_of=1, echo=False,
                                  extra_body={"repetition_penalty": 1.0, "ignore_eos": True})
    assert r.choices[0].text == local.generate("def f(x):", SamplingParams(max_tokens=6, ignore_eos=True)).text
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="code", messages=messages, max_completion_tokens=5, max_tokens=50,
                                       temperature=0, tools=[], response_format={"type": "text"},
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    status, error, _ = server.post("/v1/chat/completions", json.dumps({"messages": messages,
                                                                       "max_completion_tokens": 100000}))
    assert status == 400 and error["error"]["param"] == "max_completion_tokens", error
    assert "lower max_completion_tokens to" in error["error"]["message"]
    status, error, _ = server.post("/v1/chat/completions", json.dumps({
        "messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]}))
    assert status == 400 and error["error"]["param"] == "tools" and "does not implement tools" in error["error"]["message"]


@pytest.mark.parametrize("messages,fragment", [
    ('[{"role": "robot", "content": "hi"}]', "Input should be"),
    ('[{"role": "user", "content": "hi"}, {"role": "user", "content": "a\\ud800"}]',
     "messages[1].content has an unpaired surrogate '\\ud800' at index 1"),
])
def test_bad_chat_messages_are_400(server, messages, fragment):
    status, error, _ = server.post("/v1/chat/completions", '{"messages": ' + messages + '}')
    assert status == 400 and error["error"]["param"].startswith("messages") and fragment in error["error"]["message"]


def _fuzzed_bodies(count: int, seed: int):
    """(path, raw body) pairs: valid requests with fields overwritten, mostly by values of the field's
    own type at and past its limits, else by any JSON (wrong types, NaN and infinities, huge
    numbers, lone surrogates, nesting); plus truncated JSON and bodies that are not objects."""
    rng = np.random.default_rng(seed)

    def pick(options):
        return options[rng.integers(len(options))]

    ints = [-1, 0, 1, 2, 5, 16, 17, 20, 21, 255, 8191, 8192, 2 ** 31, 2 ** 63]
    floats = [-0.1, 0.0, 1e-9, 0.5, 1.0, 2.0, 2.5, 1e308, float("nan"), float("inf")]
    texts = ["", "a", "\n", "def", "\x00", "\ud800", "<|endoftext|>", "é" * 30, "x " * 400]
    typed = {
        "max_tokens": lambda: pick(ints), "top_k": lambda: pick(ints), "seed": lambda: pick(ints),
        "n": lambda: pick(ints), "logprobs": lambda: pick([*ints, True, False]), "top_logprobs": lambda: pick(ints),
        "temperature": lambda: pick(floats), "top_p": lambda: pick(floats),
        "stream": lambda: pick([True, False]), "ignore_eos": lambda: pick([True, False]),
        "stream_options": lambda: {"include_usage": pick([True, False])},
        "stop": lambda: pick(texts) if rng.random() < 0.3 else [pick(texts) for _ in range(rng.integers(6))],
        "prompt": lambda: pick(texts) if rng.random() < 0.5 else rng.integers(-2, 8200, rng.integers(4)).tolist(),
        "messages": lambda: [{"role": pick(["system", "user", "assistant", "tool", "robot"]), "content": pick(texts)}
                             for _ in range(rng.integers(4))],
        "model": lambda: pick(["code", "other", ""]),
    }
    scalars = [None, True, 0, -1, 2 ** 63, 0.5, float("nan"), "", "\ud800", "x" * 2000]

    def junk(depth=0):
        kind = rng.integers(3 if depth < 2 else 1)
        if kind == 0:
            return pick(scalars)
        if kind == 1:
            return [junk(depth + 1) for _ in range(rng.integers(4))]
        return {pick(["role", "content", "include_usage"]): junk(depth + 1) for _ in range(rng.integers(3))}

    valid = {"/v1/completions": {"prompt": "def f(x):", "max_tokens": 4},
             "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
    for _ in range(count):
        path = pick(list(valid))
        body = dict(valid[path]) if rng.random() < 0.8 else {}
        for _ in range(rng.integers(1, 4)):
            field = pick(list(typed))
            body[field] = typed[field]() if rng.random() < 0.85 else junk()
        if type(body.get("max_tokens")) is int:
            body["max_tokens"] = min(body["max_tokens"], 8)  # keep the valid ones short
        raw = json.dumps(body, allow_nan=True).encode()
        form = rng.integers(12)
        if form == 0:
            raw = raw[:rng.integers(1, len(raw))]
        elif form == 1:
            raw = pick([b"", b"null", b"[]", b"42", b"\xff\xfe{", b'"text"'])
        yield path, raw


def test_any_bad_request_gets_an_error_body_and_disturbs_nothing(server, local):
    """Fuzzed bodies: every answer is 200 or a 400 in OpenAI's error shape, streams that start end
    with [DONE], and afterwards the server answers as before with every KV block free."""
    statuses = Counter()
    for path, raw in _fuzzed_bodies(400, seed=0):
        req = urllib.request.Request(server.url + path, data=raw, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, text = r.status, r.read().decode()
            if r.headers.get_content_type() == "text/event-stream":
                assert text.rstrip().endswith("data: [DONE]"), (raw, text[-200:])
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
            assert status == 400, (raw, status, text)
            error = json.loads(text)
            assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"], (raw, error)
        statuses[status] += 1
    assert statuses[200] >= 20 and statuses[400] >= 100, statuses  # both kinds were exercised
    r = _client(server).completions.create(model="code", prompt="def f(x):", max_tokens=12, temperature=0)
    assert r.choices[0].text == local.generate("def f(x):", SamplingParams(max_tokens=12)).text
    after = server.metrics()
    assert after[("vllm:num_requests_running", CODE)] == 0 and after[("vllm:kv_cache_usage_perc", CODE)] == 0.0


def _delta(after: dict, before: dict, name: str, labels=CODE) -> float:
    return after.get((name, labels), 0) - before.get((name, labels), 0)


def _ended(after: dict, before: dict, reason: str) -> float:
    return _delta(after, before, "vllm:request_success_total", (("finished_reason", reason), *CODE))


def _idle_and_whole(server, timeout=10.0) -> dict:
    """The metrics once nothing runs (aborts land within a step or two), with every block free."""
    deadline = time.time() + timeout
    while True:
        metrics = server.metrics()
        if metrics[("vllm:num_requests_running", CODE)] == 0 or time.time() > deadline:
            break
        time.sleep(0.02)
    assert metrics[("vllm:num_requests_running", CODE)] == 0 and metrics[("vllm:kv_cache_usage_perc", CODE)] == 0.0
    return metrics


def test_64_streams_with_random_disconnects_leave_the_rest_identical_and_the_pool_whole(server, local):
    rng = np.random.default_rng(0)
    prompts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(64)]
    drop = set(rng.choice(64, 16, replace=False).tolist())
    before = server.metrics()

    async def one(client, i):
        # A dropped request asks for more than the others, so that most drops land while it runs.
        stream = await client.completions.create(model="code", prompt=prompts[i], max_tokens=160 if i in drop else 24,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, chunks = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text
            chunks += 1
            if i in drop and chunks == 3:
                await stream.close()  # the client goes away mid-stream
                return None
        return text

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    texts = asyncio.run(main())
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for i, text in enumerate(texts):
        if i not in drop:
            assert text == local.generate(prompts[i], params).text, i
    after = _idle_and_whole(server)
    # A dropped request ends as "abort", or as "length" when the server streamed all of it before
    # the client read its third chunk: on 2 shared cores the 64-stream client lags the engine by
    # whole requests, so how many abort is timing (the test below pins the abort itself down).
    ended = {reason: _ended(after, before, reason) for reason in ("abort", "length", "stop")}
    assert ended["length"] + ended["abort"] == 64 and ended["stop"] == 0 and ended["length"] >= 48
    assert _delta(after, before, "vllm:prompt_tokens_total") == sum(len(local.encode(p)) for p in prompts)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_its_request_and_frees_its_blocks(server, local, stream):
    # The longest request the context allows, left by an otherwise idle client after one chunk
    # (streamed) or once it runs (not): the engine must stop generating long before the request
    # could end (generation tokens are the engine's count, not what the client read).
    prompt = "def leave(x):\n"
    max_tokens = 256 - len(local.encode(prompt)) - 1
    before = server.metrics()
    body = json.dumps({"model": "code", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        if stream:
            received = b""
            while b"data: " not in received:  # the headers, then the first chunk
                data = sock.recv(65536)
                assert data, received
                received += data
        else:
            deadline = time.time() + 10
            while server.metrics()[("vllm:num_requests_running", CODE)] == 0 and time.time() < deadline:
                time.sleep(0.005)
    after = _idle_and_whole(server)
    assert {reason: _ended(after, before, reason) for reason in ("abort", "length", "stop")} == \
        {"abort": 1, "length": 0, "stop": 0}
    generated = _delta(after, before, "vllm:generation_tokens_total")
    assert 0 < generated < max_tokens // 2, generated


def test_metrics_parse_and_count_what_was_sent(server, local):
    before = server.metrics()
    client = _client(server)
    prompts = ["import sys\n", "x = 1\n", "def g():\n"]
    sent_in = sent_out = 0
    for p in prompts:
        r = client.completions.create(model="code", prompt=p, max_tokens=7, temperature=0,
                                      extra_body={"ignore_eos": True})
        sent_in, sent_out = sent_in + r.usage.prompt_tokens, sent_out + r.usage.completion_tokens
    after = server.metrics()
    assert _delta(after, before, "vllm:prompt_tokens_total") == sent_in
    assert _delta(after, before, "vllm:generation_tokens_total") == sent_out == 21
    assert _delta(after, before, "vllm:time_to_first_token_seconds_count") == 3
    assert _delta(after, before, "vllm:inter_token_latency_seconds_count") == 18


def test_full_queue_answers_429_with_retry_after(code_engine):
    s = _Server(code_engine, "--max-waiting", "0")
    try:
        status, error, headers = s.post("/v1/completions", '{"prompt": "x", "max_tokens": 2}')
        assert status == 429 and headers.get("retry-after") == "1"
        assert "queue is full" in error["error"]["message"]
    finally:
        s.close()


def test_a_request_larger_than_the_queue_bound_is_taken_when_nothing_waits(code_engine):
    s = _Server(code_engine, "--max-waiting", "2")
    try:
        status, body, _ = s.post("/v1/completions", '{"prompt": ["a", "b", "c"], "max_tokens": 2}')
        assert status == 200 and len(body["choices"]) == 3, body
    finally:
        s.close()


def test_requests_tokenizing_while_others_arrive_count_against_the_queue_bound():
    """Long prompts are tokenized in a worker after the queue check: requests that arrived meanwhile
    all passed the check and then all queued, past --max-waiting (issue 63). Those admitted but
    still tokenizing now count as waiting."""
    from types import SimpleNamespace

    from llmc.server.app import HttpError, _Server
    from llmc.server.protocol import CompletionRequest

    class Engine:  # queues what it is given; tokenizing yields to the loop, as a worker thread does
        def __init__(self):
            self.num_waiting = 0

        async def tokenize(self, prompt):
            await asyncio.sleep(0.01)
            return prompt

        async def add_request(self, prompt, params, request_id):
            self.num_waiting += 1
            return SimpleNamespace(request_id=request_id)

    server = _Server(None, "m", {}, None, max_waiting=4)
    server.engine = Engine()
    body = CompletionRequest(prompt="x" * 20_000, n=4, max_tokens=2)

    async def both():
        return await asyncio.gather(*(server.start(body, ["x" * 20_000], 2) for _ in range(2)),
                                    return_exceptions=True)

    first, second = asyncio.run(both())
    assert len(first[1]) == 4 and isinstance(second, HttpError) and second.status == 429
    assert server.engine.num_waiting == 4 and server.admitting == 0


def test_chat_without_a_template_is_400_naming_the_fix(code_engine):
    s = _Server(code_engine)
    try:
        status, error, _ = s.post("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}]}')
        assert status == 400 and "--chat-template" in error["error"]["message"]
    finally:
        s.close()


def test_sigterm_stops_accepting_drains_running_streams_then_exits(code_engine):
    import signal
    import threading

    s = _Server(code_engine, "--grace-period", "20")
    client = _client(s)
    result = {}

    started = threading.Event()

    # 16 choices of the longest completion the context holds: thousands of chunks, so the stream outlasts
    # uvicorn's 0.1 s shutdown tick however fast the engine steps (one choice of 240 did not on CI)
    def stream():
        chunks, seen = client.completions.create(model="code", prompt="def main():\n", max_tokens=240, n=16,
                                                 stream=True, extra_body={"ignore_eos": True}), []
        for c in chunks:
            seen.extend(c.choices)
            started.set()
        result["chunks"] = seen

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)  # the stream is running: its first token arrived
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)  # uvicorn has closed its listening socket
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(model="code", prompt="x", max_tokens=2)
    assert reader.is_alive()  # still streaming after SIGTERM and the refused connection: it is drained
    reader.join(timeout=60)
    per_choice = {i: [c for c in result["chunks"] if c.index == i] for i in range(16)}
    assert all(len(cs) == 240 and cs[-1].finish_reason == "length" for cs in per_choice.values())
    assert s.proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained


def test_llmc_chat_renders_the_template_and_keeps_the_conversation(code_engine, local, tmp_path):
    from click.testing import CliRunner

    from llmc.cli import main

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    result = CliRunner().invoke(main, ["chat", str(code_engine), "--chat-template", str(template), "--max-tokens", "12",
                                       "--seed", "3"], input="a loop\nmore\n")
    assert result.exit_code == 0, result.output
    first_ids = local.tokenizer.encode("### user\na loop\n### assistant\n", add_special_tokens=False).ids
    first = local.generate(first_ids, SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=4))
    second_text = f"### user\na loop\n### assistant\n{first.text}\n### user\nmore\n### assistant\n"
    second_ids = local.tokenizer.encode(second_text, add_special_tokens=False).ids
    second = local.generate(second_ids, SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=6))
    assert result.output == f"you> {first.text}\nyou> {second.text}\nyou> \n"


def test_bench_over_http_reports_like_an_engine(server, code_engine, tmp_path):
    from importlib import resources

    import jsonschema
    from click.testing import CliRunner

    from llmc.cli import main

    out = tmp_path / "bench"
    result = CliRunner().invoke(main, ["bench", str(code_engine), "--url", server.url + "/v1", "--num-requests", "6",
                                       "--output-len", "8", "--qps", "20,max", "--warmup", "1", "--no-plots",
                                       "-o", str(out), "--slo", "ttft=2s"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    schema = json.loads(resources.files("llmc.bench").joinpath("report_schema.json").read_text())
    jsonschema.validate(report, schema, cls=jsonschema.Draft202012Validator)
    assert [e["label"] for e in report["engines"]] == ["code-small", "code"]
    for run in report["runs"]:
        assert [r["num_tokens"] for r in run["requests"]] == [8] * 6, run["engine"]
        assert all(r["finish_reason"] == "length" for r in run["requests"])
    http_runs = [r for r in report["runs"] if r["engine"] == "code"]
    assert len(http_runs) == 2 and all(r["other_cpu"] is None for r in http_runs)


def test_bench_url_errors_are_one_line(server):
    from click.testing import CliRunner

    from llmc.cli import main

    for args, fragment in ((["--url", "http://127.0.0.1:9"], "cannot list the models"),
                           (["--url", server.url, "--model", "nope"], "serves code, not 'nope'"),
                           ([], "give an engine to benchmark, or --url")):
        result = CliRunner().invoke(main, ["bench", *args, "--no-plots"])
        assert result.exit_code == 2 and fragment in result.output and result.output.count("\n") == 1, result.output


def test_bench_target_can_send_prompts_as_text(server, code_engine):
    from llmc.bench.http import HttpTarget
    from llmc.bench.workloads import BenchRequest

    target = HttpTarget(server.url, tokenizer=str(code_engine))  # for servers that take no token ids
    assert target.max_context == 256 and target.vocab.max() < 8192
    prompts = [target.vocab[:20].tolist(), target.vocab[100:130].tolist()]
    records, _, wall = target.run([BenchRequest(p, 8, 0.0) for p in prompts])
    assert wall > 0 and [r.output.metrics.num_tokens for r in records] == [8, 8]
    assert all(r.output.finish_reason == "length" for r in records)


def test_logprobs_match_in_process_streamed_and_not(server, local):
    client = _client(server)
    prompt = "def read(path):\n"
    expected = local.generate(prompt, SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True))
    r = client.completions.create(model="code", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    assert "".join(lp.tokens) == r.choices[0].text
    for entry, top in zip(expected.logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the top one
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="code", prompt=prompt, max_tokens=6, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    # A stream's columns, joined, are the whole response's: text offsets go on counting across chunks.
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [x for s in streamed for x in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    chunks = list(client.chat.completions.create(model="code", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    content = [c for chunk in chunks if chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    status, error, _ = server.post("/v1/completions", '{"prompt": "x", "logprobs": 21}')
    assert status == 400 and error["error"]["param"] == "logprobs"


# -- scale-out: `llmc serve --replicas 2` behind Ray Serve --------------------------------------

@pytest.fixture(scope="module")
def replicas(code_engine):
    pytest.importorskip("ray.serve", reason="the scale-out tests need Ray Serve: pip install 'llmc[ray]'")
    s = _Server(code_engine, "--replicas", 2, "--threads", 1)
    seen, deadline = set(), time.time() + 120
    while len(seen) < 2 and time.time() < deadline:  # /health answers once one replica is up
        with urllib.request.urlopen(s.url + "/health", timeout=5) as r:
            seen.add(r.headers["llmc-replica"])
        time.sleep(0.1)
    assert len(seen) == 2, f"one replica of two came up in 120 s: {seen}"
    yield s
    s.close()
    assert s.proc.returncode == 0, s.proc.stderr.read()  # SIGTERM shut Ray down cleanly


def _replica_processes(server) -> list:
    """The replicas' processes: Ray's workers, started by the raylet that `llmc serve` started."""
    import psutil

    return [p for p in psutil.Process(server.proc.pid).children(recursive=True)
            if p.name().startswith("ray::ServeReplica")]


def test_two_replicas_answer_like_in_process_and_share_the_work(replicas, local):
    prompts = [f"def g{i}(items):\n" for i in range(16)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    async def one(client, i):
        raw = await client.completions.with_raw_response.create(
            model="code", prompt=prompts[i], max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
        return raw.headers["llmc-replica"], raw.parse().choices[0].text

    async def main():
        client = openai.AsyncOpenAI(base_url=replicas.url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(16)))

    answers = asyncio.run(main())
    assert [text for _, text in answers] == [local.generate(p, params).text for p in prompts]
    served_by = Counter(name for name, _ in answers)
    assert len(served_by) == 2 and min(served_by.values()) >= 5, served_by  # the router balanced the burst
    chunks = _client(replicas).completions.create(model="code", prompt=prompts[0], max_tokens=20, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == answers[0][1]


def test_a_replica_killed_mid_run_loses_no_request(replicas, local):
    """One replica's process dies while 24 streams run on both: its streams fail (the client sees
    the stream break or an error status), every other one completes identical to in-process, each
    request is counted once, and the deployment serves new requests afterwards."""
    prompts = [f"def h{i}(data):\n" for i in range(24)]
    max_new = 240  # the most the 256-token context leaves: the streams outlast the kill (0.9 s at 160 here)

    async def one(client, i, first_token):
        try:
            stream = await client.completions.create(model="code", prompt=prompts[i], max_tokens=max_new,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            text = ""
            async for chunk in stream:
                text += chunk.choices[0].text
                first_token.set()
            return "completed", text
        except (openai.APIError, openai.APIConnectionError) as exc:
            return "failed", type(exc).__name__

    async def main():
        first_token = asyncio.Event()
        client = openai.AsyncOpenAI(base_url=replicas.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=120)
        tasks = [asyncio.create_task(one(client, i, first_token)) for i in range(24)]
        await asyncio.wait_for(first_token.wait(), 60)
        await asyncio.sleep(0.3)
        victims = _replica_processes(replicas)
        assert len(victims) == 2, victims
        victims[0].kill()
        return await asyncio.wait_for(asyncio.gather(*tasks), 180)  # none hangs

    outcomes = asyncio.run(main())
    completed = [(i, text) for i, (kind, text) in enumerate(outcomes) if kind == "completed"]
    failed = [i for i, (kind, _) in enumerate(outcomes) if kind == "failed"]
    assert len(completed) + len(failed) == 24 and failed and completed, outcomes
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    for i, text in completed:
        assert text == local.generate(prompts[i], params).text, i
    after = _client(replicas).completions.create(model="code", prompt=prompts[0], max_tokens=8, temperature=0)
    assert after.choices[0].text == local.generate(prompts[0], SamplingParams(max_tokens=8)).text


def test_the_router_ranks_replicas_by_slots_in_use_and_kv_usage():
    ray_serve = pytest.importorskip("llmc.server.ray_serve", reason="needs Ray Serve")
    load = ray_serve.engine_load
    idle = {"kv_usage": 0.0, "max_num_seqs": 16}
    assert load(idle, 0) == 0.0 and load(idle, 8) == 0.5
    assert load({"kv_usage": 0.9, "max_num_seqs": 16}, 20) == pytest.approx(20 / 16 + 0.9)
    assert load({}, 4) == load(idle, 4)  # a replica that has not reported yet: the defaults
    assert load({**idle, "kv_usage": 0.8}, 2) > load(idle, 8)  # a nearly full cache outweighs a few requests


@pytest.mark.parametrize("first", [False, True])
def test_an_event_stream_stops_writing_and_closes_its_chunks_when_the_client_leaves(first):
    # The client leaves while the writer waits for its first chunk (`first`) or its third. The
    # writer is cancelled there, the chunks' generator closes (for a request: the abort), and the
    # response ends without an error, its task not left cancelled.
    from llmc.server.app import _EventStream

    written, closed = [], []

    async def main():
        leave, never = asyncio.Event(), asyncio.Event()

        async def chunks():
            try:
                if first:
                    await never.wait()  # the first token is still being computed
                yield b"data: 1\n\n"
                yield b"data: 2\n\n"
                await never.wait()  # nor does the third come
                yield b"data: 3\n\n"
            finally:
                closed.append(True)

        async def receive():
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            written.append(message)
            if len(written) == (1 if first else 3):  # the headers, or the headers and two chunks
                leave.set()

        writer = asyncio.create_task(_EventStream(chunks())(None, receive, send))
        await asyncio.wait({writer}, timeout=10)
        writer.result()  # done, and without an error (a CancelledError too would raise here)
        return writer.cancelling()

    assert asyncio.run(main()) == 0 and closed == [True]
    bodies = [m["body"] for m in written if m["type"] == "http.response.body"]
    assert bodies == ([] if first else [b"data: 1\n\n", b"data: 2\n\n"])
