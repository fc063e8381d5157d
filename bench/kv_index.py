"""What the KV index costs the router, by fleet size: a pick's lookup, an event batch, memory.

Synthetic fleets (no pods: 1,024 real ones are beyond this machine) of `--pods` sizes, each pod
holding `--blocks` blocks of prompts `--prompt-blocks` long, shared by `--share` of the pods
(a popular system prompt is cached on several). Timed, one process, one core:

- lookup: `KvIndex.annotate` for a request of 64 blocks against every pod as a candidate (what
  each pick does), for a prompt held by a few pods and for one held by none;
- batch: one KV-event batch as a pod sends it after a step (msgpack bytes: `--batch` blocks
  stored and as many removed), decoded and applied (router/collectors/kvevents.py `apply`): all
  of it on the pick's process with `fleet.collectors: inline`; with the collectors' process
  (the default) the pick's process pays `applied`: the batch's operations, hashes only, decoded
  from the child's frame and applied (router/collectors/process.py `apply`);
- memory: the index's resident growth, per block a pod holds (a block on 4 pods counts 4).

    python -m bench.kv_index [--pods 16,256,1024] [--blocks 4096] [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import time
from collections.abc import Callable

from llmgw import kvevents
from router.collectors import channel
from router.collectors.kvevents import KvEventSubscriber
from router.collectors.process import CollectorProcess
from router.fleet import Fleet, FleetSettings, KvEventSettings
from router.kvindex import KvIndex
from tests.router.conftest import cand

BLOCK = 16


def per_call(call: Callable[[], object], seconds: float) -> float:
    call()
    n, started = 0, time.perf_counter()
    while n < 10 or time.perf_counter() - started < seconds:
        call()
        n += 1
    return (time.perf_counter() - started) / n


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def populated(fleet: Fleet, pods: int, blocks: int, prompt_blocks: int, share: int) -> None:
    """Each pod holds `blocks` blocks: prompts of `prompt_blocks` chained hashes, each prompt on
    `share` consecutive pods."""
    prompts = pods * blocks // (prompt_blocks * share)
    rng = random.Random(0)
    for p in range(prompts):
        chain = [rng.getrandbits(64) for _ in range(prompt_blocks)]
        for k in range(share):
            fleet.kv.stored(f"10.0.{(p * share + k) % pods // 256}.{(p * share + k) % 256}:8000",
                            chain, BLOCK)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pods", default="16,256,1024")
    p.add_argument("--blocks", type=int, default=4096, help="blocks each pod holds")
    p.add_argument("--prompt-blocks", type=int, default=64)
    p.add_argument("--share", type=int, default=4, help="pods holding each prompt")
    p.add_argument("--batch", type=int, default=8, help="blocks stored (and removed) a batch")
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args()
    print(f"kv_index: {args.blocks} blocks/pod, prompts of {args.prompt_blocks} blocks on "
          f"{args.share} pods each; lookups of 64 blocks; batches of {args.batch} stored + "
          f"{args.batch} removed")  # fmt: skip
    print(f"{'pods':>6} {'entries':>10} {'MiB':>7} {'B/held':>8} {'hit µs':>8} "
          f"{'miss µs':>8} {'batch µs':>9} {'applied µs':>10} "
          f"{'µs/pod/s at 10 batch/s':>23}")  # fmt: skip
    for pods in [int(x) for x in args.pods.split(",")]:
        measure(pods, args)


def measure(pods: int, args: argparse.Namespace) -> None:
    gc.collect()
    before = rss_mib()
    fleet = Fleet(FleetSettings(kv_events=KvEventSettings(port=5557)))
    ids = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(pods)]
    fleet.set_pods(ids)
    populated(fleet, pods, args.blocks, args.prompt_blocks, args.share)
    index: KvIndex = fleet.kv
    entries = index.entries()
    grown = max(rss_mib() - before, 0.0)
    cands = [cand(pod) for pod in ids]
    rng = random.Random(1)
    held = next(iter(index._where))  # a block some pods hold
    hit = (held, *(rng.getrandbits(64) for _ in range(63)))
    miss = tuple(rng.getrandbits(64) for _ in range(64))
    t_hit = per_call(lambda: index.annotate(hit, BLOCK, cands), args.seconds)
    t_miss = per_call(lambda: index.annotate(miss, BLOCK, cands), args.seconds)
    subscriber = KvEventSubscriber(fleet, KvEventSettings(port=5557))
    sent = [0]

    def batch() -> None:
        sent[0] += 1
        fresh: list[int | bytes] = [rng.getrandbits(64) for _ in range(args.batch)]
        events: list[kvevents.Event] = [
            kvevents.BlockStored(fresh, None, [], BLOCK, medium="GPU"),
            kvevents.BlockRemoved(fresh, medium="GPU"),
        ]
        subscriber.apply(ids[sent[0] % pods], kvevents.encode(kvevents.EventBatch(0.0, events)))

    t_batch = per_call(batch, args.seconds)
    parent = CollectorProcess(fleet)

    def applied() -> None:
        sent[0] += 1
        pod = ids[sent[0] % pods]
        fresh = [rng.getrandbits(64) for _ in range(args.batch)]
        ops: list[channel.KvOp] = [channel.Stored(pod, fresh, BLOCK), channel.Removed(pod, fresh)]
        parent.apply(channel.to_parent.decode(channel.frame(channel.KvOps(ops))[4:]))

    t_applied = per_call(applied, args.seconds)
    per_entry = grown * 2**20 / (pods * args.blocks)
    print(f"{pods:>6} {entries:>10} {grown:>7.0f} {per_entry:>8.0f} {t_hit * 1e6:>8.1f} "
          f"{t_miss * 1e6:>8.1f} {t_batch * 1e6:>9.1f} {t_applied * 1e6:>10.1f} "
          f"{t_batch * 1e6 * 10:>23.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
