"""The body pool: large request bodies read in a worker process, so that one tenant's megabytes
of JSON never hold the event loop that decides everyone's requests (`json.loads` holds the GIL: a
thread would not help). Small ones are read inline: the hop costs more than they do."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from extauthz import metrics
from extauthz.body import Body
from extauthz.body import read as read_body
from extauthz.decision import Decider
from llmgw import tokenizer, wire

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _start_worker(parent: int, tokenizers: tuple[Path, ...]) -> None:
    """A pool worker's first act: SIGTERM when the process that started it dies, however it
    dies (SIGKILL included), so no worker outlives extauthz; and gone now if it already has.
    Then the models' tokenizers loaded (a large one takes a second), not on a check's time."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(0)
    for path in tokenizers:
        with contextlib.suppress(tokenizer.TokenizerError):  # a check then counts without it
            tokenizer.counter(path)


class PoolDown(Exception):
    """The body pool read no body: its worker died under it twice, or no new one starts."""


class BodyPool:
    """Bodies from `from_bytes` on read by `workers` processes. A worker that dies (killed, out
    of memory) breaks its whole executor: it is replaced at once, and the pool is unhealthy only
    while no replacement can be made."""

    def __init__(self, decider: Decider, from_bytes: int, workers: int = 1) -> None:
        self.decider = decider
        self.from_bytes = from_bytes
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = self._new_executor()

    def _new_executor(self) -> ProcessPoolExecutor:
        # spawn, not fork: this process runs gRPC's threads.
        context = multiprocessing.get_context("spawn")
        tokenizers = tuple(self.decider.settings.tokenizer.values())
        return ProcessPoolExecutor(
            self.workers,
            mp_context=context,
            initializer=_start_worker,
            initargs=(os.getpid(), tokenizers),
        )

    @property
    def healthy(self) -> bool:
        return self._pool is not None

    async def start(self) -> None:
        """Start the workers now, not on the first large body."""
        await self._run(b"{}", wire.CHAT_PATH)

    async def read(self, body: bytes, path: str) -> Body | None:
        """The body of a request to `path` read in a worker if it is large, else None (the
        decision reads it)."""
        if len(body) < self.from_bytes:
            return None
        metrics.POOLED_BODIES.inc()
        return await self._run(body, path)

    async def _run(self, body: bytes, path: str) -> Body:
        """The body read in a worker; on a broken pool, once more on its replacement (not
        twice: the body may be what killed it)."""
        loop = asyncio.get_running_loop()
        for _ in range(2):
            pool = self._pool or self._replace(None)
            if pool is None:
                break
            try:
                settings = self.decider.settings
                return await loop.run_in_executor(pool, read_body, body, settings, path)
            except (BrokenProcessPool, OSError):  # OSError: a worker could not be started
                self._replace(pool)
        raise PoolDown

    def _replace(self, broken: ProcessPoolExecutor | None) -> ProcessPoolExecutor | None:
        """A new pool for `broken`, unless another check replaced it already; None if none
        can be made (tried again on the next large body)."""
        if self._pool is not broken:
            return self._pool
        if broken is not None:
            # Not cancel_futures: its pending bodies fail as broken and are read again or
            # answered; cancelled, their checks would end unanswered.
            broken.shutdown(wait=False)
        try:
            self._pool = self._new_executor()
        except Exception:
            log.exception("body pool not replaced")
            self._pool = None
            return None
        log.warning("body pool replaced: its worker died")
        metrics.POOL_RESTARTS.inc()
        return self._pool

    async def close(self) -> None:
        """Stop the workers and wait until they have exited (a worker mid-body finishes it)."""
        if self._pool is not None:
            await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
