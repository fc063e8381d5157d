"""A continuous-batching engine in the manner of vLLM V1's scheduler.

One asyncio task steps the engine. Each step schedules every running sequence (one decode
token, or the next prefill chunk) and then, unless it preempted, admits waiting ones while
seats, the token budget and KV blocks allow: a waiting request is admitted only if its whole
prompt fits in the free KV (vLLM's scheduler_reserve_full_isl). The step's duration comes
from the profile's roofline model of what it computes. Tokens reach each sequence as they
are produced, so streams are truly incremental. A running sequence that cannot grow
preempts another (recompute: its blocks are freed and it waits again): the most recently
admitted under fcfs, the one with the largest (priority, arrival) under priority.

Two clocks: simulated seconds (what the profiled GPU would take; metrics use them) advance
by each step's duration and stand still while the engine idles; the event loop's wall clock
paces the steps at `time_scale` wall seconds per simulated second.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

from llmgw import kvblocks, kvevents
from llmgw.kvblocks import KvHashing
from sim.kvcache import BlockPool, kv_events
from sim.metrics import Stats
from sim.profile import Profile, StepLoad, step_seconds
from sim.tokens import EOS, block_hashes, words
from sim.types import Job, SimSettings
from sim.waiting import WaitingQueue, waiting_queue

log = logging.getLogger(__name__)

_MAX_LAG = 0.05  # wall seconds a late step may catch up on before the pace resets
GPU_KEPT = 100_000  # requests whose exact GPU time the engine keeps


class Sequence:
    """One request inside the engine."""

    __slots__ = (
        "arrival",
        "cache_created",
        "cached",
        "chain",
        "computed",
        "done",
        "ended",
        "finished",
        "first_token",
        "gpu",
        "job",
        "last_token",
        "name",
        "output",
        "owned",
        "preemptions",
        "private",
        "progress",
        "promotable",
        "queued",
        "scheduled",
        "source",
    )

    def __init__(
        self,
        job: Job,
        seed: int,
        hashing: KvHashing,
        arrival: float,
        progress: asyncio.Event | None = None,
    ) -> None:
        self.job = job
        self.name = ""  # the request's ID, for its GPU time (Engine.gpu_seconds)
        self.gpu = 0.0  # its share of every step it was in, wall seconds
        self.chain = (
            list(kvblocks.block_hashes(job.prompt_ids, hashing, job.cache_salt))
            if job.prompt_ids
            else block_hashes(job.prompt, hashing.block_size, job.cache_salt)
        )
        self.owned: list[int] = []  # cached blocks referenced: a prefix of `chain`
        self.private = 0  # other blocks held
        self.preemptions = 0
        self.cached = 0  # prompt tokens found in the prefix cache when first admitted
        self.cache_created = 0  # and those it then computed into cacheable blocks
        self.promotable = True
        self.computed = 0  # tokens whose KV is computed
        self.output: list[str] = []
        self.source: Iterator[str] = words(seed, job.prompt, job.sample)
        self.arrival = arrival  # simulated seconds, when the API server received it
        self.queued = arrival  # when the engine received it
        self.scheduled: float | None = None  # first admitted
        self.first_token: float | None = None
        self.last_token = arrival
        self.finished = False
        self.done = False  # finished with every output token (not aborted)
        # Set when output grows or the sequence finishes; the n samples of one request share it.
        self.progress = progress or asyncio.Event()
        self.ended = asyncio.Event()

    @property
    def priority(self) -> int:
        return self.job.priority

    @property
    def num_tokens(self) -> int:
        return self.job.prompt_tokens + len(self.output)


class Engine:
    def __init__(self, settings: SimSettings, profile: Profile, stats: Stats) -> None:
        self.settings = settings
        self.profile = profile
        self.stats = stats
        self.pool = BlockPool(settings.num_gpu_blocks)
        self.hashing = settings.kv_hashing()
        # Where the blocks each step stored and evicted go (sim/kvevents.py), if anywhere.
        self.publish: Callable[[list[kvevents.Event]], None] | None = None
        self.max_num_seqs = settings.max_num_seqs or profile.max_num_seqs
        self.max_num_batched_tokens = (
            settings.max_num_batched_tokens or profile.max_num_batched_tokens
        )
        self.policy = settings.scheduling_policy
        self.running: list[Sequence] = []  # in admission order
        # The last GPU_KEPT requests' exact GPU time by request ID (GET /admin/gpu_seconds).
        self.gpu_seconds: dict[str, float] = {}
        self.waiting: WaitingQueue[Sequence] = waiting_queue(settings.scheduling_policy)
        self._work = asyncio.Event()
        self._sim = 0.0
        self._task: asyncio.Task[None] | None = None

    def sim_now(self) -> float:
        """Simulated seconds the engine has spent stepping (frozen while idle)."""
        return self._sim

    # Requests.

    async def submit(self, jobs: list[Job], name: str = "") -> list[Sequence]:
        """Queue a request's sequences after the API server's overhead (before the engine);
        `name`, the request's ID, under which its GPU time is kept."""
        overhead = self.profile.request_overhead_ms / 1e3 / self.settings.speed_factor
        await asyncio.sleep(overhead * self.settings.time_scale)
        progress = asyncio.Event()
        seqs = []
        for job in jobs:
            seq = Sequence(job, self.settings.seed, self.hashing, self._sim - overhead, progress)
            seq.queued = self._sim
            seq.name = name
            self.waiting.add(seq)
            seqs.append(seq)
        self._work.set()
        return seqs

    def abort(self, seq: Sequence) -> None:
        """The client went away: free its seat and blocks."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.stats.success["abort"] += 1
        self._finish(seq)

    def gauges(self) -> tuple[int, int, float]:
        return len(self.running), len(self.waiting), self.pool.usage()

    # The loop.

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")
        self._task.add_done_callback(self._crashed)

    def _crashed(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("engine crashed", exc_info=task.exception())
            for seq in [*self.running, *self.waiting]:
                self._finish(seq)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for seq in [*self.running, *self.waiting]:
            self._finish(seq)
        self.running.clear()
        self.waiting.clear()

    async def _run(self) -> None:
        clock = asyncio.get_running_loop().time
        pace = clock()  # when the previous step ended, on the wall clock
        ended = pace  # … and when it really did
        while True:
            batch = self._schedule()
            if not batch:
                self._work.clear()
                await self._work.wait()
                pace = ended = clock()
                continue
            simulated = self._duration(batch)
            now = clock()
            end = (pace if now - pace < _MAX_LAG else now) + simulated * self.settings.time_scale
            await asyncio.sleep(max(0.0, end - now))
            pace = end
            # What the step took on the wall clock, since the last one really ended: more than
            # simulated on a busy machine.
            began, ended = ended, clock()
            self._advance(batch, simulated, ended - began)

    def step(self) -> bool:
        """One step at once, unpaced; False if there was nothing to do. Tests drive the
        engine with it, so that scheduling is checked in simulated time only."""
        batch = self._schedule()
        if batch:
            self._advance(batch, self._duration(batch))
        return bool(batch)

    def _duration(self, batch: list[tuple[Sequence, int]]) -> float:
        load = StepLoad()
        for seq, n in batch:
            load.add(seq.computed, n)
        self.stats.iteration_tokens.observe(load.tokens)
        return step_seconds(self.profile, load) / self.settings.speed_factor

    def _advance(
        self, batch: list[tuple[Sequence, int]], simulated: float, wall: float | None = None
    ) -> None:
        self._sim += simulated
        # The step's time, shared evenly by its batch: the exact GPU time the gateway's ledger
        # estimates (ledger/gputime.py), in wall seconds as the ledger sees them (unpaced: the
        # simulated time, scaled).
        took = simulated * self.settings.time_scale if wall is None else wall
        share = took / len(batch)
        for seq, _ in batch:
            seq.gpu += share
        self._complete(batch)
        changes = self.pool.take_changes()
        if changes and self.publish is not None:
            self.publish(kv_events(changes, self.settings.block_size))

    def _blocks_short(self, seq: Sequence, tokens: int) -> int:
        size = self.settings.block_size
        return -(-tokens // size) - len(seq.owned) - seq.private

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """Pick this step's work: (sequence, tokens to compute) pairs."""
        budget = self.max_num_batched_tokens
        batch: dict[Sequence, int] = {}  # in scheduling order
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.computed, budget)
            short = max(0, self._blocks_short(seq, seq.computed + n))
            lost = False
            while not lost and not self.pool.allocate(short):
                victim = self._victim()
                where = self.running.index(victim)
                del self.running[where]
                if where < i:
                    i -= 1
                # Under priority the victim may run earlier in this step: it gives its tokens back.
                budget += batch.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                lost = victim is seq
            if lost:
                if self.policy == "priority":
                    continue  # later ones are more urgent and may fit in what it freed
                break
            seq.private += short
            batch[seq] = n
            budget -= n
            i += 1
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting.peek()
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.pop()
            self.running.append(seq)
            if seq.scheduled is None:
                seq.scheduled = self._sim
            batch[seq] = n
            budget -= n
        return list(batch.items())

    def _victim(self) -> Sequence:
        """The running sequence to preempt when KV blocks run out (vLLM's choice per policy)."""
        if self.policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival))
        return self.running[-1]

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take cached prefix blocks and blocks for the first chunk; 0 if it does not fit."""
        size = self.settings.block_size
        # At least one token must be computed to sample from, as in vLLM.
        hits = min(self.pool.cached_prefix(seq.chain), (seq.num_tokens - 1) // size)
        prefix = seq.chain[:hits]
        self.pool.acquire(prefix)
        # Full-ISL reservation: the whole sequence must fit now, not only its first chunk, so
        # that chunked prefills admitted together do not preempt each other half way.
        if -(-seq.num_tokens // size) - hits > self.pool.available:
            self.pool.release(prefix, 0)
            return 0
        n = min(seq.num_tokens - hits * size, budget)
        short = -(-(hits * size + n) // size) - hits
        allocated = self.pool.allocate(short)
        assert allocated  # short <= the whole sequence's blocks, which fit
        seq.owned, seq.private, seq.computed = prefix, short, hits * size
        self.stats.prefix_queries += seq.job.prompt_tokens
        self.stats.prefix_hits += hits * size
        if seq.scheduled is None:  # a first admission; a resumed one recomputes what it had
            seq.cached = hits * size
            # PrefillStats.finalize: the prompt's full blocks, less those found cached.
            seq.cache_created = min(len(seq.chain) * size, seq.job.prompt_tokens) - seq.cached
            self.stats.prompt_tokens_cached += seq.cached
        return n

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.computed = 0
        seq.promotable = True
        seq.preemptions += 1
        self.waiting.prepend(seq)
        self.stats.preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.owned, seq.private)
        seq.owned, seq.private = [], 0

    def _complete(self, batch: list[tuple[Sequence, int]]) -> None:
        """The step's results: computed tokens, newly cacheable blocks, sampled tokens."""
        now, stats, size = self._sim, self.stats, self.settings.block_size
        finished = False
        for seq, n in batch:
            if seq.finished:  # aborted during the step
                continue
            seq.computed += n
            full = min(min(seq.computed, seq.job.prompt_tokens) // size, len(seq.chain))
            while seq.promotable and len(seq.owned) < full and seq.private > 0:
                if self.pool.promote(seq.chain[len(seq.owned)]):
                    seq.owned.append(seq.chain[len(seq.owned)])
                    seq.private -= 1
                else:
                    seq.promotable = False  # another sequence cached that block first
            if seq.computed < seq.num_tokens:
                continue  # a prefill chunk that is not the last
            if seq.first_token is None:
                seq.first_token = now
                stats.ttft.observe(now - seq.arrival)
                stats.prompt_tokens += seq.job.prompt_tokens
            else:
                stats.itl.observe(now - seq.last_token)
            seq.last_token = now
            last = len(seq.output) + 1 >= seq.job.output_tokens
            eos = last and seq.job.finish_reason == "stop"
            seq.output.append(EOS if eos else next(seq.source))
            stats.generation_tokens += 1
            if last:
                self._observe_finished(seq)
                self._release(seq)
                seq.done = True
                self._finish(seq)
                finished = True
            else:
                seq.progress.set()
        if finished:
            self.running = [seq for seq in self.running if not seq.finished]

    def _observe_finished(self, seq: Sequence) -> None:
        """vLLM's per-request phase histograms: queue, prefill, decode, inference, e2e."""
        stats, now = self.stats, self._sim
        scheduled = seq.scheduled if seq.scheduled is not None else seq.queued
        first = seq.first_token if seq.first_token is not None else now
        stats.e2e.observe(now - seq.arrival)
        stats.queue_time.observe(scheduled - seq.queued)
        stats.prefill_time.observe(first - scheduled)
        stats.decode_time.observe(now - first)
        stats.inference_time.observe(now - scheduled)
        stats.success[seq.job.finish_reason] += 1

    def _finish(self, seq: Sequence) -> None:
        if seq.name:
            spent = self.gpu_seconds
            spent[seq.name] = spent.pop(seq.name, 0.0) + seq.gpu
            while len(spent) > GPU_KEPT:
                del spent[next(iter(spent))]
        seq.finished = True
        seq.progress.set()
        seq.ended.set()
