"""A continuous-batching engine in the manner of vLLM V1's scheduler.

One asyncio task steps the engine. Each step schedules every running sequence (one decode
token, or the next prefill chunk) and admits waiting ones while seats, the token budget and
KV blocks allow; its duration comes from the profile. Tokens reach each sequence as they are
produced, so streams are truly incremental. A running sequence that cannot grow preempts the
most recently admitted one (recompute: its blocks are freed and it waits again).

Two clocks: simulated seconds (what the profiled GPU would take; metrics use them) advance
by each step's duration and stand still while the engine idles; the event loop's wall clock
paces the steps at `time_scale` wall seconds per simulated second.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterator

from llmgw.sim.kvcache import BlockPool
from llmgw.sim.metrics import Stats
from llmgw.sim.profile import Profile, step_seconds
from llmgw.sim.tokens import block_hashes, words
from llmgw.sim.types import Job, SimSettings

log = logging.getLogger(__name__)

_MAX_LAG = 0.05  # wall seconds a late step may catch up on before the pace resets


class Sequence:
    """One request inside the engine."""

    __slots__ = (
        "arrival",
        "chain",
        "computed",
        "done",
        "ended",
        "finished",
        "first_token",
        "job",
        "last_token",
        "output",
        "owned",
        "private",
        "progress",
        "promotable",
        "source",
    )

    def __init__(self, job: Job, seed: int, block_size: int, arrival: float) -> None:
        self.job = job
        self.chain = block_hashes(job.prompt, block_size)
        self.owned: list[int] = []  # cached blocks referenced: a prefix of `chain`
        self.private = 0  # other blocks held
        self.promotable = True
        self.computed = 0  # tokens whose KV is computed
        self.output: list[str] = []
        self.source: Iterator[str] = words(seed, job.prompt)
        self.arrival = arrival  # simulated seconds
        self.first_token: float | None = None
        self.last_token = arrival
        self.finished = False
        self.done = False  # finished with every output token (not aborted)
        self.progress = asyncio.Event()  # set when output grows or the sequence finishes
        self.ended = asyncio.Event()

    @property
    def num_tokens(self) -> int:
        return self.job.prompt_tokens + len(self.output)


class Engine:
    def __init__(self, settings: SimSettings, profile: Profile, stats: Stats) -> None:
        self.settings = settings
        self.profile = profile
        self.stats = stats
        self.pool = BlockPool(settings.num_gpu_blocks)
        self.running: list[Sequence] = []  # in admission order
        self.waiting: deque[Sequence] = deque()
        self._work = asyncio.Event()
        self._sim = 0.0
        self._task: asyncio.Task[None] | None = None

    def sim_now(self) -> float:
        """Simulated seconds the engine has spent stepping (frozen while idle)."""
        return self._sim

    # Requests.

    async def submit(self, job: Job) -> Sequence:
        """Queue a request after the API server's overhead (time spent before the engine)."""
        overhead = self.profile.request_overhead_ms / 1e3 / self.settings.speed_factor
        await asyncio.sleep(overhead * self.settings.time_scale)
        seq = Sequence(job, self.settings.seed, self.settings.block_size, self._sim - overhead)
        self.waiting.append(seq)
        self._work.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        """The client went away: free its seat and blocks."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
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
        while True:
            batch, tokens = self._schedule()
            if not batch:
                self._work.clear()
                await self._work.wait()
                pace = clock()
                continue
            simulated = step_seconds(self.profile, len(batch), tokens - len(batch))
            simulated /= self.settings.speed_factor
            now = clock()
            end = (pace if now - pace < _MAX_LAG else now) + simulated * self.settings.time_scale
            await asyncio.sleep(max(0.0, end - now))
            pace = end
            self._sim += simulated
            self._complete(batch)

    def _blocks_short(self, seq: Sequence, tokens: int) -> int:
        size = self.settings.block_size
        return -(-tokens // size) - len(seq.owned) - seq.private

    def _schedule(self) -> tuple[list[tuple[Sequence, int]], int]:
        """Pick this step's work: (sequence, tokens to compute) pairs and their token total."""
        budget = self.settings.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.computed, budget)
            before = self.stats.preemptions
            grown = self._grow(seq, seq.computed + n)
            preempted = preempted or self.stats.preemptions > before
            if not grown:
                break
            batch.append((seq, n))
            budget -= n
            i += 1
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.settings.max_num_seqs
        ):
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch, self.settings.max_num_batched_tokens - budget

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Blocks for `tokens`, preempting the newest sequences; False if `seq` was preempted."""
        short = max(0, self._blocks_short(seq, tokens))
        while not self.pool.allocate(short):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        seq.private += short
        return True

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take cached prefix blocks and blocks for the first chunk; 0 if the cache is full."""
        size = self.settings.block_size
        # At least one token must be computed to sample from, as in vLLM.
        hits = min(self.pool.cached_prefix(seq.chain), (seq.num_tokens - 1) // size)
        prefix = seq.chain[:hits]
        self.pool.acquire(prefix)
        n = min(seq.num_tokens - hits * size, budget)
        short = -(-(hits * size + n) // size) - hits
        if not self.pool.allocate(short):
            self.pool.release(prefix, 0)
            return 0
        seq.owned, seq.private, seq.computed = prefix, short, hits * size
        self.stats.prefix_queries += seq.job.prompt_tokens
        self.stats.prefix_hits += hits * size
        return n

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.computed = 0
        seq.promotable = True
        self.waiting.appendleft(seq)
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
            seq.output.append(next(seq.source))
            stats.generation_tokens += 1
            if len(seq.output) >= seq.job.output_tokens:
                stats.e2e.observe(now - seq.arrival)
                self._release(seq)
                seq.done = True
                self._finish(seq)
                finished = True
            else:
                seq.progress.set()
        if finished:
            self.running = [seq for seq in self.running if not seq.finished]

    def _finish(self, seq: Sequence) -> None:
        seq.finished = True
        seq.progress.set()
        seq.ended.set()
