"""The gateway's side of the endpoint picker protocol, played against a real router process in
inference-pool mode with two simulated vLLM pods (router/picker.py, docs/inference-pool.md)."""

from __future__ import annotations

import json
import os
import string
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct

from llmgw import wire
from router.picker import HEALTH_SERVICES
from tests.eventually import eventually
from tests.http import call
from tools.procs import Process, bin_path, free_port, grpc_serving, http_ok, stop_all

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default


@dataclass
class Picker:
    target: str
    metrics: str
    pods: list[str]


@pytest.fixture(scope="module")
def picker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Picker]:
    tmp = tmp_path_factory.mktemp("picker")
    procs: list[Process] = []
    try:
        pods = []
        for i in range(2):
            port = free_port()
            argv = [sys.executable, "-m", "sim", "--port", str(port), "--seed", str(i)]
            ready = http_ok(f"http://127.0.0.1:{port}/health")
            procs.append(Process(f"pod-{i}", argv, ready, tmp / f"pod-{i}.log").start())
            pods.append(f"127.0.0.1:{port}")
        port, metrics = free_port(), free_port()
        base = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env = base | {
            "LLMGW_ROUTER__SERVE__PORT": str(port),
            "LLMGW_ROUTER__SERVE__METRICS_PORT": str(metrics),
            "LLMGW_ROUTER__FLEET__PODS": json.dumps(pods),
            "LLMGW_ROUTER__INFERENCE_POOL__ENABLED": "true",
        }
        ready = grpc_serving(f"127.0.0.1:{port}", "readiness")
        router = Process("router", [sys.executable, "-m", "router"], ready, tmp / "r.log", env)
        procs.append(router.start(60))
        yield Picker(f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics", pods)
    finally:
        stop_all(procs)


def headers(method: str, path: str, end: bool) -> pb.HttpHeaders:
    pairs = [(":method", method), (":path", path), (":authority", "gw"), ("x-request-id", "r1")]
    if not end:
        pairs.append(("content-type", "application/json"))
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
        ),
        end_of_stream=end,
    )


def first(mode: int, msg: pb.ProcessingRequest) -> pb.ProcessingRequest:
    msg.protocol_config.CopyFrom(pb.ProtocolConfiguration(request_body_mode=mode))  # type: ignore[arg-type]
    return msg


def subset(pods: list[str]) -> base_pb2.Metadata:
    hint = Struct()
    hint.update({wire.SUBSET_HINT_NAMESPACE: {wire.SUBSET_HINT_KEY: pods}})
    return base_pb2.Metadata(
        filter_metadata={
            wire.SUBSET_HINT_NAMESPACE: hint.fields[wire.SUBSET_HINT_NAMESPACE].struct_value
        }
    )


def exchange(picker: Picker, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    with grpc.insecure_channel(picker.target) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        return list(stub.Process(iter(messages), timeout=10))


def chat(model: str = MODEL) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hello " * 40}]}
    return json.dumps(body).encode()


def the_pick(resp: pb.ProcessingResponse, common: pb.CommonResponse) -> list[str]:
    """The picked list, after checking the header and the metadata carry the same value."""
    (header,) = common.header_mutation.set_headers
    assert header.header.key == wire.DESTINATION_ENDPOINT
    meta = resp.dynamic_metadata.fields[wire.LB_NAMESPACE].struct_value
    value = meta.fields[wire.DESTINATION_ENDPOINT].string_value
    assert header.header.raw_value.decode() == value
    return value.split(",")


def full_duplex(
    picker: Picker, body: bytes, meta: base_pb2.Metadata | None = None
) -> list[pb.ProcessingResponse]:
    half = len(body) // 2
    start = pb.ProcessingRequest(request_headers=headers("POST", "/v1/chat/completions", False))
    if meta is not None:
        start.metadata_context.CopyFrom(meta)
    return exchange(
        picker,
        [
            first(pm.ProcessingMode.FULL_DUPLEX_STREAMED, start),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body[:half])),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body[half:], end_of_stream=True)),
        ],
    )


def wait_scraped(picker: Picker) -> None:
    """The router scrapes the pods every 75 ms: wait (bounded) for its first view of both."""

    def both() -> bool:
        text = urllib.request.urlopen(picker.metrics, timeout=5).read().decode()
        return sum(f'llmgw_router_pod_pickable{{pod="{p}"}} 1.0' in text for p in picker.pods) == 2

    eventually(both, 30, "the router never saw both pods")


def test_the_picker_answers_the_protocols_health_services(picker: Picker) -> None:
    for service in ("", *HEALTH_SERVICES):
        assert grpc_serving(picker.target, service)(), service


def test_full_duplex_picks_after_the_body_and_sends_the_body_back(picker: Picker) -> None:
    wait_scraped(picker)
    body = chat()
    answers = full_duplex(picker, body)
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    pods = the_pick(answers[0], answers[0].request_headers.response)
    assert set(pods) <= set(picker.pods) and pods
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == body and streamed.end_of_stream


def test_buffered_mode_sets_the_pick_on_the_bodys_answer(picker: Picker) -> None:
    wait_scraped(picker)
    answers = exchange(
        picker,
        [
            first(
                pm.ProcessingMode.BUFFERED,
                pb.ProcessingRequest(
                    request_headers=headers("POST", "/v1/chat/completions", False)
                ),
            ),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=chat(), end_of_stream=True)),
        ],
    )
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert not answers[0].request_headers.response.HasField("header_mutation")
    assert set(the_pick(answers[1], answers[1].request_body.response)) <= set(picker.pods)


def test_a_request_without_a_body_is_picked_at_its_headers(picker: Picker) -> None:
    wait_scraped(picker)
    msg = pb.ProcessingRequest(request_headers=headers("GET", "/v1/models", True))
    (answer,) = exchange(picker, [first(pm.ProcessingMode.FULL_DUPLEX_STREAMED, msg)])
    assert set(the_pick(answer, answer.request_headers.response)) <= set(picker.pods)


def test_the_subset_hint_bounds_the_pick(picker: Picker) -> None:
    wait_scraped(picker)
    for pod in picker.pods * 3:  # each pod, more than once: not the best pick by chance
        answers = full_duplex(picker, chat(), subset([pod]))
        assert the_pick(answers[0], answers[0].request_headers.response) == [pod]


@pytest.mark.parametrize(
    ("hint", "body"),
    [(["10.9.9.9:8000"], chat()), ([], chat()), (None, chat("no-such-model"))],
    ids=["no-eligible-pod-in-the-subset", "empty-subset", "no-pod-serves-the-model"],
)
def test_no_eligible_pod_is_an_openai_shaped_503(
    picker: Picker, hint: list[str] | None, body: bytes
) -> None:
    wait_scraped(picker)
    answers = full_duplex(picker, body, subset(hint) if hint is not None else None)
    (answer,) = answers  # and nothing after it
    reply = answer.immediate_response
    assert reply.status.code == 503
    assert json.loads(reply.body)["error"]["type"] == "server_error"


def in_flight(picker: Picker) -> float:
    text = urllib.request.urlopen(picker.metrics, timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmgw_router_in_flight{")
    )


def test_the_served_endpoint_and_the_end_of_the_stream_release_the_pick(picker: Picker) -> None:
    wait_scraped(picker)
    before = in_flight(picker)
    served = Struct()
    served.update({wire.SERVED_ENDPOINT: picker.pods[0]})
    response = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]
            )
        ),
        metadata_context=base_pb2.Metadata(filter_metadata={wire.LB_NAMESPACE: served}),
    )
    msg = first(
        pm.ProcessingMode.NONE,
        pb.ProcessingRequest(request_headers=headers("POST", "/v1/chat/completions", False)),
    )
    answers = exchange(picker, [msg, response])
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "response_headers"]
    # A stream that ends without response headers (client gone) releases its pick too.
    exchange(picker, [msg])
    assert in_flight(picker) == before


def test_a_body_beyond_the_limit_is_an_openai_shaped_413(picker: Picker) -> None:
    chunk = b" " * (3 << 20)  # 3 MiB a message, under gRPC's 4 MiB; 9 MiB > the 8 MiB limit
    start = pb.ProcessingRequest(request_headers=headers("POST", "/v1/chat/completions", False))
    messages = [first(pm.ProcessingMode.FULL_DUPLEX_STREAMED, start)]
    messages += [pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk)) for _ in range(3)]
    (answer,) = exchange(picker, messages)
    assert answer.immediate_response.status.code == 413
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "request_too_large"


# The same, through a real Envoy configured as conformant gateways configure it for a picker
# (tests/router/gateway.yaml).


GATEWAY = Path(__file__).with_name("gateway.yaml")


def gateway_config(picker: Picker, listen: int, admin: int, body_mode: str) -> str:
    pod0, pod1 = (p.rpartition(":")[2] for p in picker.pods)
    return string.Template(GATEWAY.read_text()).substitute(
        admin=admin,
        listen=listen,
        body_mode=body_mode,
        # Full duplex: trailers tell the picker the body ended when the client sent trailers.
        trailer_mode="SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
        pod0=pod0,
        pod1=pod1,
        picker=picker.target.rpartition(":")[2],
    )


def picks(picker: Picker) -> dict[str, float]:
    text = urllib.request.urlopen(picker.metrics, timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("llmgw_router_picks_total{"):
            pod = line.split('pod="', 1)[1].split('"', 1)[0]
            out[pod] = out.get(pod, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_a_real_envoy_gateway_sends_each_request_to_the_picked_pod(
    picker: Picker, body_mode: str, tmp_path: Path
) -> None:
    wait_scraped(picker)
    listen, admin = free_port(), free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(gateway_config(picker, listen, admin, body_mode))
    argv = [bin_path("envoy"), "-c", str(config), "--disable-hot-restart", "--base-id", str(admin)]
    argv += ["--concurrency", "1", "--log-level", "warn"]
    envoy = Process("envoy", argv, http_ok(f"http://127.0.0.1:{admin}/ready"), tmp_path / "e.log")
    envoy.start(60)
    try:
        url = f"http://127.0.0.1:{listen}/v1/chat/completions"
        # 90 kB: more than one of the picker's 62 kB streamed chunks goes back to Envoy.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 30_000}]}
        for _ in range(8):  # a pick honoured by chance: 1 in 256
            before = picks(picker)
            reply = call("POST", url, {**body, "max_tokens": 2}, timeout=30)
            after = picks(picker)
            assert reply.status == 200, reply.body  # the body reached the pod whole
            (picked,) = [pod for pod in after if after[pod] != before.get(pod, 0.0)]
            assert reply.headers["x-upstream"] == picked
        unknown = call("POST", url, {**body, "model": "no-such-model"}, timeout=30)
        assert unknown.status == 503 and unknown.json()["error"]["type"] == "server_error"
    finally:
        envoy.stop()
