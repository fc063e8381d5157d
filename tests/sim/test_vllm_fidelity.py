"""The simulator held to real vLLM: the same requests go straight to a real vLLM 0.32 pod (the
CPU build, the tiny model) and to a simulated pod started alike (same served model name, context,
KV block size and count, priority scheduling, forced usage), and what the gateway depends on must
agree: the `/v1/models` document, SSE framing and chunk fields, usage and where it goes, whole
replies, error bodies and statuses, the Prometheus names and labels the router reads.

Structure is compared (keys in order, JSON types, statuses, error bodies), not generated text.
Prompt token counts are compared exactly: the sim tokenizes with the model's own tokenizer
(`--tokenizer`), and the gateway's count (llmgw/tokenizer.py) must agree with both. Where the
two differ on purpose, the difference is a row of sim/README.md's "Differences from vLLM 0.32"
table, keyed by the name this test gives it: a difference not in the table fails, and so does a
row whose difference is gone.

Marked e2e (the real-vLLM tier): one real pod per module, ~1-8 minutes to start on 2 cores.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw import tokenizer
from router.collectors.scrape import _WANTED as ROUTER_READS
from router.collectors.scrape import parse_metrics
from tests.e2e.realpods import MARKS, vllm_settings_or_skip
from tools.engine import configured, ensure_model, pod_argv, pod_env
from tools.procs import Process, free_port, http_ok

pytestmark = [pytest.mark.e2e, *MARKS]

README = Path(__file__).resolve().parents[2] / "sim" / "README.md"
TABLE = "## Differences from vLLM 0.32"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Pod:
    host: str
    port: int

    def send(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> Reply:
        raw = body if isinstance(body, bytes) else None if body is None else json.dumps(body)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request(method, path, raw, {"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return Reply(resp.status, resp.getheader("content-type") or "", resp.read())
        finally:
            conn.close()

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Reply:
        return self.send("POST", path, body, headers)


@dataclass(frozen=True)
class Pair:
    real: Pod
    sim: Pod
    model: str
    tokenizer: Path  # the model's tokenizer.json

    def both(self, method: str, path: str, body: Any = None, **headers: str) -> tuple[Reply, Reply]:
        return self.real.send(method, path, body, headers), self.sim.send(
            method, path, body, headers
        )


def cache_config(text: str) -> dict[str, str]:
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels)
    raise AssertionError("no vllm:cache_config_info")


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    settings = vllm_settings_or_skip()
    logs = tmp_path_factory.mktemp("fidelity")
    real = Pod("127.0.0.1", free_port())
    model = ensure_model(settings)
    argv = pod_argv(settings, model, real.host, real.port)
    vllm = Process(
        "vllm",
        argv,
        http_ok(f"http://{real.host}:{real.port}/health"),
        logs / "vllm.log",
        pod_env(settings, 0, os.environ),
    )
    sim_process: Process | None = None
    try:
        vllm.start(settings.start_timeout)
        # The sim gets the real pod's KV geometry (128-token blocks on CPU), not an H100's.
        config = cache_config(real.send("GET", "/metrics").body.decode())
        sim = Pod("127.0.0.1", free_port())
        sim_argv = [sys.executable, "-m", "sim", "--host", sim.host, "--port", str(sim.port)]
        sim_argv += ["--model", settings.served_model_name]
        sim_argv += ["--max-model-len", str(settings.max_model_len)]
        sim_argv += ["--block-size", config["block_size"]]
        sim_argv += ["--num-gpu-blocks", config["num_gpu_blocks"]]
        # As pod_argv starts vLLM: priority scheduling, usage forced into every stream.
        sim_argv += ["--scheduling-policy", "priority", "--force-include-usage"]
        sim_argv += ["--time-scale", "0.05", "--tokenizer", str(model / "tokenizer.json")]
        sim_process = Process(
            "sim", sim_argv, http_ok(f"http://{sim.host}:{sim.port}/health"), logs / "sim.log"
        )
        sim_process.start(60)
        yield Pair(real, sim, settings.served_model_name, model / "tokenizer.json")
    finally:
        if sim_process is not None:
            sim_process.stop()
        vllm.stop(30)


# The README's table: the differences this test is allowed to find.

# Set by vLLM's CPU platform from the machine it runs on (vllm/platforms/cpu.py: float32 where the
# CPU has AVX-512 BF16, else as configured), so no one simulated value matches every machine.
MACHINE_DEPENDENT = {"mamba_ssm_cache_dtype"}


def listed() -> dict[str, str]:
    """Key -> the row's text, for each row of the README table whose first cell is a `key`."""
    text = README.read_text()
    assert TABLE in text, f"{README} has no {TABLE!r} table"
    rows: dict[str, str] = {}
    for line in text.split(TABLE, 1)[1].split("\n## ", 1)[0].splitlines():
        match = re.match(r"\|\s*`([a-z_.]+)`\s*\|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def allowed(area: str) -> set[str]:
    return {key for key in listed() if key.startswith(area + ".")}


# Structure.


def shape(value: Any) -> Any:
    """Keys in order and JSON types, not values."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def events(reply: Reply) -> list[Any]:
    """An SSE body's JSON events, its framing checked: `data: ` events, blank-line separated,
    `data: [DONE]` last."""
    assert reply.status == 200 and reply.content_type == "text/event-stream; charset=utf-8"
    text = reply.body.decode()
    assert text.endswith("\n\ndata: [DONE]\n\n"), text[-200:]
    frames = text.split("\n\n")[:-2]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames)
    return [json.loads(f.removeprefix("data: ")) for f in frames]


def skeleton(event: dict[str, Any]) -> Any:
    """An event's shape, with what tells one kind of chunk from another: the role, the finish."""
    marks = [(c.get("delta", {}).get("role"), c.get("finish_reason")) for c in event["choices"]]
    return shape(event), marks


def squeezed(items: list[Any]) -> list[Any]:
    """Runs of equal items as one: real vLLM sometimes sends two tokens in one chunk (its
    detokenizer holds back an incomplete character), so token chunks are counted as a run."""
    return [x for i, x in enumerate(items) if i == 0 or items[i - 1] != x]


def check_usage(chunks: list[Any], whole_stream_tokens: int) -> None:
    """Usage as the ledger reads it: every chunk carries it (forced), the usage-only chunk is
    last (`choices: []`) and repeats the last per-chunk count, which is the tokens asked for."""
    *body, last = chunks
    assert last["choices"] == [] and "system_fingerprint" in last
    assert all("usage" in c for c in chunks)
    usage = last["usage"]
    assert {k: body[-1]["usage"][k] for k in usage} == usage  # nulls dropped: no details
    assert usage["completion_tokens"] == whole_stream_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def body(pair: Pair, path: str, **fields: Any) -> dict[str, Any]:
    if path == CHAT:
        base: dict[str, Any] = {"messages": [{"role": "user", "content": "Hello, how are you?"}]}
    else:
        base = {"prompt": "Hello, how are you?"}
    return {"model": pair.model, **base, "max_tokens": 5, "ignore_eos": True, **fields}


# The tests.


def test_models_document(pods: Pair) -> None:
    real, sim = pods.both("GET", "/v1/models")
    assert real.status == sim.status == 200
    assert real.content_type == sim.content_type == "application/json"
    normal = [_models(r.json()) for r in (real, sim)]
    assert shape(normal[0]) == shape(normal[1])
    cards = [n["data"][0] for n in normal]
    assert {f"models.{k}" for k, v in cards[0].items() if cards[1][k] != v} == allowed("models")
    assert cards[0]["id"] == cards[1]["id"] == pods.model
    assert cards[0]["max_model_len"] == cards[1]["max_model_len"]


def _models(doc: dict[str, Any]) -> dict[str, Any]:
    """IDs and timestamps as patterns: `modelperm-` and 16 hex digits, a creation time."""
    card = doc["data"][0]
    assert isinstance(card["created"], int) and card["permission"][0]["created"] == card["created"]
    permission = dict(card["permission"][0])
    assert re.fullmatch(r"modelperm-[0-9a-f]{16}", permission.pop("id"))
    del permission["created"]
    return {**doc, "data": [{**card, "created": 0, "permission": [permission]}]}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    "options",
    [None, {"include_usage": True}, {"include_usage": False},
     {"include_usage": True, "continuous_usage_stats": True}],
)  # fmt: skip
def test_streams(pods: Pair, path: str, options: dict[str, bool] | None) -> None:
    fields: dict[str, Any] = {"stream": True}
    if options is not None:
        fields["stream_options"] = options
    real, sim = pods.both("POST", path, body(pods, path, **fields))
    chunks = [events(real), events(sim)]
    assert squeezed([skeleton(c) for c in chunks[0]]) == squeezed([skeleton(c) for c in chunks[1]])
    for stream in chunks:
        check_usage(stream, 5)
        assert len({c["id"] for c in stream}) == 1
        prefix = "chatcmpl-" if path == CHAT else "cmpl-"
        assert re.fullmatch(prefix + "[0-9a-f]{16}", stream[0]["id"])
        assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", stream[-1]["system_fingerprint"])


@pytest.mark.parametrize(
    ("path", "fields"),
    [(CHAT, {"n": 2}), (COMPLETIONS, {"n": 2}), (COMPLETIONS, {"prompt": ["Hello", "Hi there"]})],
)
def test_streams_of_several_choices(pods: Pair, path: str, fields: dict[str, Any]) -> None:
    """Each choice's chunks in the same shapes (vLLM interleaves choices as its engine steps
    them, so they are compared per choice); the usage-only chunk sums them all."""
    real, sim = pods.both("POST", path, body(pods, path, stream=True, **fields))
    streams = [events(real), events(sim)]
    per_choice = [
        {i: squeezed([skeleton(c) for c in s if c["choices"] and c["choices"][0]["index"] == i])
         for i in range(2)}
        for s in streams
    ]  # fmt: skip
    assert per_choice[0] == per_choice[1]
    for stream in streams:
        *chunks, last = stream
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * 5
        assert all(len(c["choices"]) == 1 for c in chunks)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_whole_replies(pods: Pair, path: str) -> None:
    real, sim = pods.both("POST", path, body(pods, path))
    assert real.status == sim.status == 200
    assert real.content_type == sim.content_type == "application/json"
    assert shape(real.json()) == shape(sim.json())
    for reply in (real.json(), sim.json()):
        assert reply["usage"]["completion_tokens"] == 5
        assert reply["choices"][0]["finish_reason"] == "length"
        assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", reply["system_fingerprint"])


@pytest.mark.parametrize(
    ("path", "cap"),
    [
        (CHAT, {"max_tokens": None}),  # none: vLLM fills the context
        (CHAT, {"max_tokens": "context"}),
        (CHAT, {"max_tokens": None, "max_completion_tokens": "context"}),
        (COMPLETIONS, {"max_tokens": "context"}),
        (CHAT, {"max_tokens": "context", "messages": [{"role": "user", "content": "hi " * 300}]}),
    ],
)
def test_a_cap_up_to_the_context_is_lowered_beside_the_prompt(
    pods: Pair, path: str, cap: dict[str, Any]
) -> None:
    """What the gateway's cap relies on: vLLM refuses a cap above max_model_len (BAD's "over
    max_model_len" rows), and serves one up to it whatever the prompt, lowered to what fits
    beside the prompt (`get_max_tokens`): prompt + completion fill the context exactly."""
    context = configured().max_model_len
    fields = {k: context if v == "context" else v for k, v in cap.items()}
    sent = {k: v for k, v in body(pods, path, **fields).items() if v is not None}
    real, sim = pods.both("POST", path, sent)
    assert real.status == sim.status == 200, real.body
    for reply in (real.json(), sim.json()):
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["total_tokens"] == context
        assert reply["usage"]["prompt_tokens"] > 1


LONG = "hello world " * 2000  # over 1,024 tokens in both: the real tokenizer stops at 1,025

# name -> (path, body fields over the good request, or raw bytes; headers)
BAD: dict[str, tuple[str, dict[str, Any] | bytes, dict[str, str]]] = {
    "bad temperature": (CHAT, {"temperature": -1}, {}),
    "temperature over 2": (COMPLETIONS, {"temperature": 3}, {}),
    "bad top_p": (CHAT, {"top_p": 0}, {}),
    "n 0": (CHAT, {"n": 0}, {}),
    "unknown model": (CHAT, {"model": "nope"}, {}),
    "prompt too long": (CHAT, {"messages": [{"role": "user", "content": LONG}]}, {}),
    "completion prompt too long": (COMPLETIONS, {"prompt": LONG}, {}),
    "max_tokens over max_model_len": (COMPLETIONS, {"max_tokens": 4096}, {}),
    "max_completion_tokens over max_model_len": (CHAT, {"max_completion_tokens": 4096}, {}),
    "no room for output": (COMPLETIONS, {"prompt": list(range(3, 1027))}, {}),
    "max_tokens 0": (CHAT, {"max_tokens": 0}, {}),
    "stream not a boolean": (CHAT, {"stream": 2}, {}),
    "stream a list": (CHAT, {"stream": [1]}, {}),
    "stream_options without stream": (CHAT, {"stream_options": {"include_usage": True}}, {}),
    "include_usage not a boolean": (
        CHAT, {"stream": True, "stream_options": {"include_usage": "maybe"}}, {}),
    "bad JSON": (CHAT, b'{"model": ', {}),
    "not an object": (CHAT, b"[1, 2]", {}),
    "not JSON": (CHAT, {}, {"Content-Type": "text/plain"}),
    "missing messages": (CHAT, {"messages": None}, {}),
    "messages not a list": (CHAT, {"messages": "hi"}, {}),
    "empty conversation": (CHAT, {"messages": []}, {}),
    "missing prompt": (COMPLETIONS, {"prompt": None}, {}),
    "empty prompt": (COMPLETIONS, {"prompt": ""}, {}),
    "empty prompt list": (COMPLETIONS, {"prompt": []}, {}),
    "priority not an integer": (CHAT, {"priority": "high"}, {}),
    "fractional priority": (CHAT, {"priority": 1.5}, {}),
    "empty cache_salt": (CHAT, {"cache_salt": ""}, {}),
    "cache_salt not a string": (COMPLETIONS, {"cache_salt": 5}, {}),
    "cache_salt with a slash": (CHAT, {"cache_salt": "tenant/a"}, {}),
    "cache_salt too long": (CHAT, {"cache_salt": "a" * 129}, {}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_errors(pods: Pair, name: str) -> None:
    path, fields, headers = BAD[name]
    if isinstance(fields, bytes):
        sent: Any = fields
    else:
        sent = {k: v for k, v in (body(pods, path) | fields).items() if v is not None}
    real = pods.real.post(path, sent, headers)
    sim = pods.sim.post(path, sent, headers)
    assert real.status == sim.status and real.status in (400, 404), real.body
    assert real.content_type == sim.content_type == "application/json"
    assert sim.json() == real.json()  # message, type, param and code: all deterministic here


# Dense text: 3 bytes a CJK character and 4 an emoji, a token each byte in the tiny model's BPE
# (trained on English), far above the estimate's 4 characters a token; within its 1,024 context.
CJK = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(300))
EMOJI = "".join(chr(0x1F600 + i % 80) for i in range(200))
PROMPTS: dict[str, tuple[str, dict[str, Any]]] = {
    "cjk chat": (CHAT, {"messages": [{"role": "user", "content": CJK}]}),
    "emoji chat, a system message": (CHAT, {"messages": [
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": EMOJI}]}),
    "several turns": (CHAT, {"messages": [
        {"role": "user", "content": "Hello, how are you today?"},
        {"role": "assistant", "content": "I am fine, thank you. 你好!"},
        {"role": "user", "content": "What is the weather like? 🌦️"}]}),
    "text parts": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "The quick brown fox"}, {"type": "text", "text": CJK[:50]}]}]}),
    "mixed completion": (COMPLETIONS, {"prompt": "Tenants share one fleet: 共有 🚀 " + CJK[:100]}),
    "a list of prompts": (COMPLETIONS, {"prompt": [EMOJI[:50], "The quick brown fox."]}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_prompt_counts(pods: Pair, name: str) -> None:
    """vLLM's prompt count, the sim's with the model's tokenizer, and the gateway's (what it
    reserves) are one number."""
    path, fields = PROMPTS[name]
    sent = body(pods, path, **fields)
    real, sim = pods.both("POST", path, sent)
    assert real.status == sim.status == 200, real.body
    counted = tokenizer.counter(pods.tokenizer).request(sent, image_tokens=0)
    assert counted is not None
    assert real.json()["usage"]["prompt_tokens"] == sim.json()["usage"]["prompt_tokens"]
    assert real.json()["usage"]["prompt_tokens"] == counted.tokens


def test_unknown_route(pods: Pair) -> None:
    real, sim = pods.both("GET", "/v1/nope")
    assert real.status == sim.status == 404 and real.json() == sim.json() == {"detail": "Not Found"}


def test_what_the_gateway_adds_is_accepted(pods: Pair) -> None:
    """The engine priority header and the members Envoy appends (cache_salt, request_id, the
    output cap in both names), with X-Request-Id naming the reply, as the gateway sends them."""
    fields: dict[str, Any] = {"cache_salt": "0123456789abcdef" * 2, "request_id": "from-body"}
    fields |= {"max_tokens": 3, "max_completion_tokens": 3}
    for headers, expected in (
        ({"X-Vllm-Priority": "5", "X-Request-Id": "from-envoy"}, "chatcmpl-from-envoy"),
        ({"X-Vllm-Priority": "not a number"}, "chatcmpl-from-body"),
    ):
        real, sim = pods.both("POST", CHAT, body(pods, CHAT, **fields), **headers)
        assert real.status == sim.status == 200, real.body
        assert shape(real.json()) == shape(sim.json())
        assert real.json()["id"] == sim.json()["id"] == expected
        assert real.json()["usage"]["completion_tokens"] == sim.json()["usage"]["completion_tokens"]


@dataclass(frozen=True)
class Family:
    samples: frozenset[str]  # names: `_total`, `_bucket`, `_sum`, `_count`, ...
    labels: frozenset[tuple[str, ...]]  # the label names of each sample


@dataclass(frozen=True)
class Exported:
    families: dict[str, Family]
    created: frozenset[str]  # prometheus_client's `*_created` families
    samples: frozenset[str]
    content_type: str
    text: str


def exported(pod: Pod) -> Exported:
    reply = pod.send("GET", "/metrics")
    assert reply.status == 200
    text = reply.body.decode()
    families: dict[str, Family] = {}
    created: set[str] = set()
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        if family.name.endswith("_created"):
            created.add(family.name)
            continue
        families[family.name] = Family(
            frozenset(s.name for s in family.samples),
            frozenset(tuple(sorted(s.labels)) for s in family.samples),
        )
    samples = frozenset(n for f in families.values() for n in f.samples)
    return Exported(families, frozenset(created), samples, reply.content_type, text)


def test_metrics(pods: Pair) -> None:
    pods.both("POST", COMPLETIONS, body(pods, COMPLETIONS))  # every counter has counted
    real, sim = exported(pods.real), exported(pods.sim)
    assert real.content_type == sim.content_type
    # Families vLLM exports and the simulator does not: exactly the ones the table names.
    missing = set(real.families) - set(sim.families)
    named = set(re.findall(r"`(vllm:[a-z_:]+)`", listed().get("metrics.families", "")))
    assert missing == named
    assert set(sim.families) <= set(real.families)
    found = {"metrics.families"} if missing else set()
    if real.created - sim.created:
        found.add("metrics.created")
    # The same samples and labels in every shared family; the names the router reads in both.
    for name in set(real.families) & set(sim.families):
        assert real.families[name] == sim.families[name], name
    for name in ROUTER_READS:
        assert (name in real.samples) == (name in sim.samples), name
    # vllm:cache_config_info: the same labels (every CacheConfig field) and values.
    real_config, sim_config = cache_config(real.text), cache_config(sim.text)
    assert set(real_config) == set(sim_config)
    found |= {
        f"cache_config_info.{k}"
        for k in real_config
        if real_config[k] != sim_config[k] and k not in MACHINE_DEPENDENT
    }
    assert found == allowed("metrics") | allowed("cache_config_info")
    # As the router reads them: the same KV geometry, served counters and ITL in both.
    read = [parse_metrics(real.text), parse_metrics(sim.text)]
    assert read[0].block_size == read[1].block_size == int(real_config["block_size"])
    assert read[0].num_gpu_blocks == read[1].num_gpu_blocks
    for parsed in read:
        assert parsed.tokens_served and parsed.requests_served and parsed.itl_count


# The Responses API (POST /v1/responses): the same conversation, its Response object and events.

RESPONSES = "/v1/responses"
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{16}")
ITEM_ID = re.compile(r"msg_[0-9a-f]{16}")


def response_body(pair: Pair, **fields: Any) -> dict[str, Any]:
    base = {"model": pair.model, "input": "Hello, how are you?", "max_output_tokens": 5}
    return {**base, "ignore_eos": True, **fields}


def response_events(reply: Reply) -> list[tuple[str, Any]]:
    """An SSE body's (event, JSON) pairs, its framing checked: an `event:` line before each
    `data:` line, blank-line separated, no `[DONE]`."""
    assert reply.status == 200 and reply.content_type == "text/event-stream; charset=utf-8"
    frames = reply.body.decode().split("\n\n")
    assert frames[-1] == ""
    pairs = []
    for frame in frames[:-1]:
        kind, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        pairs.append((event["type"], event))
    assert [e["sequence_number"] for _, e in pairs] == list(range(len(pairs)))
    return pairs


def test_responses_stream(pods: Pair) -> None:
    real, sim = pods.both("POST", RESPONSES, response_body(pods, stream=True))
    streams = [response_events(real), response_events(sim)]
    assert squeezed([(k, shape(e)) for k, e in streams[0]]) == squeezed(
        [(k, shape(e)) for k, e in streams[1]]
    )
    for stream in streams:
        kinds = [k for k, _ in stream]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]  # fmt: skip
        final = stream[-1][1]["response"]
        assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 5
        deltas = "".join(e["delta"] for k, e in stream if k == "response.output_text.delta")
        assert final["output"][0]["content"][0]["text"] == deltas
        assert RESPONSE_ID.fullmatch(final["id"]) and ITEM_ID.fullmatch(final["output"][0]["id"])


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"instructions": "Answer briefly.", "temperature": 0.5, "top_p": 0.9},
        {"max_output_tokens": None, "input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
            {"type": "message", "role": "user", "content": "Hello, how are you today?"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "I am fine, thank you."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "What is the weather? 🌦️"}]},
        ]},
    ],
)  # fmt: skip
def test_whole_responses(pods: Pair, fields: dict[str, Any]) -> None:
    """The Response object whole, the prompt counted alike (instructions a system message, the
    items the chat messages vLLM makes of them), the cap lowered beside the prompt."""
    sent = {k: v for k, v in response_body(pods, **fields).items() if v is not None}
    real, sim = pods.both("POST", RESPONSES, sent)
    assert real.status == sim.status == 200, real.body
    assert real.content_type == sim.content_type == "application/json"
    assert shape(real.json()) == shape(sim.json())
    usage = [r.json()["usage"] for r in (real, sim)]
    assert usage[0]["input_tokens"] == usage[1]["input_tokens"]
    for reply in (real.json(), sim.json()):
        assert reply["status"] == "incomplete"
        assert reply["incomplete_details"] == {"reason": "max_output_tokens"}
        assert reply["usage"]["output_tokens"] == reply["max_output_tokens"]
        assert reply["temperature"] == fields.get("temperature", 1.0)
        assert reply["top_p"] == fields.get("top_p", 1.0)


def test_responses_report_the_prefix_cache(pods: Pair) -> None:
    """Cached and cache-written input tokens, the same prompt twice (over one 128-token block)."""
    sent = response_body(pods, input="The quick brown fox jumps over the lazy dog. " * 30)
    details = []
    for pod in (pods.real, pods.sim):
        first, second = pod.post(RESPONSES, sent), pod.post(RESPONSES, sent)
        details.append([r.json()["usage"]["input_tokens_details"] for r in (first, second)])
    assert details[0] == details[1]
    assert details[0][1]["cached_tokens"] > 0 == details[0][1]["cache_write_tokens"]


def test_what_the_gateway_adds_to_a_response_is_accepted(pods: Pair) -> None:
    """The body's request_id names the response (X-Request-Id does not); the priority header."""
    fields = {"cache_salt": "0123456789abcdef" * 2, "request_id": "from-body", "max_tokens": 3}
    headers = {"X-Vllm-Priority": "5", "X-Request-Id": "from-envoy"}
    real, sim = pods.both("POST", RESPONSES, response_body(pods, **fields), **headers)
    assert real.status == sim.status == 200, real.body
    assert real.json()["id"] == sim.json()["id"] == "from-body"


BAD_RESPONSES: dict[str, dict[str, Any] | bytes] = {
    "no input": {"input": None},
    "unknown model": {"model": "nope"},
    "store and background": {"background": True},
    "background without store": {"background": True, "store": False},
    "previous response": {"previous_response_id": "resp_0123456789abcdef"},
    "prompt template": {"prompt": {"id": "pmpt_1"}},
    "tool_choice required without tools": {"tool_choice": "required"},
    "max_output_tokens over max_model_len": {"max_output_tokens": 4096},
    "max_output_tokens 0": {"max_output_tokens": 0},
    "prompt too long": {"input": LONG},
    "empty input": {"input": []},
    "unsupported item": {"input": [{"type": "item_reference", "id": "msg_1"}]},
    "bad temperature": {"temperature": -1},
    "bad top_p": {"top_p": 0},
    "priority not an integer": {"priority": "high"},
    "cache_salt with a slash": {"cache_salt": "tenant/a"},
    "stream not a boolean": {"stream": 2},
    "bad service_tier": {"service_tier": "gold"},
    "bad JSON": b'{"model": ',
}


@pytest.mark.parametrize("name", list(BAD_RESPONSES))
def test_response_errors(pods: Pair, name: str) -> None:
    fields = BAD_RESPONSES[name]
    sent: Any = fields
    if isinstance(fields, dict):
        sent = {k: v for k, v in (response_body(pods) | fields).items() if v is not None}
    real, sim = pods.real.post(RESPONSES, sent), pods.sim.post(RESPONSES, sent)
    assert real.status == sim.status and real.status in (400, 404), real.body
    assert real.content_type == sim.content_type == "application/json"
    assert sim.json() == real.json()


def test_a_bad_input_item_is_refused_alike(pods: Pair) -> None:
    """pydantic reports every member of the SDK's item union (hundreds of lines): the status,
    type and param agree, not the message (README: `responses.item_errors`)."""
    sent = response_body(pods, input=[{"role": "tool", "content": "x"}])
    real, sim = pods.real.post(RESPONSES, sent), pods.sim.post(RESPONSES, sent)
    assert real.status == sim.status == 400
    errors = [r.json()["error"] for r in (real, sim)]
    assert {k: errors[0][k] for k in ("type", "param", "code")} == {
        k: errors[1][k] for k in ("type", "param", "code")
    }
    found = {"responses.item_errors"} if errors[0]["message"] != errors[1]["message"] else set()
    assert found == allowed("responses")
