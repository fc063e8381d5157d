"""No outcome lost: Envoy's file access log, reconciled against the ledger's database.

The gRPC access log is fast but not durable: what the ledger holds unsettled or unwritten when it
dies, and what was on its way, is gone (Envoy counts it delivered). Envoy also writes every entry
to a file (ledger/filelog.py reads it). This tails that file from a checkpoint (inode, offset),
waits `lag_s` for the gRPC path to deliver each record, then asks the database which request IDs
it has and hands the rest to the recorder, to be settled in Redis and stored; but not those the
live path of this process still holds (e.g. while Redis or PostgreSQL is down): they are on
their way. Settling and storing are idempotent by request ID (settle.lua's done key, the insert's
ON CONFLICT), so a record both paths deliver counts once. The checkpoint moves past a record only
once the database has it: a ledger killed, or PostgreSQL down, leaves it to the next pass.
Requests without a tenant (strangers' 401s) are counted by the gRPC path, not reconciled.

Rotation: rename the file and ask Envoy to reopen it (admin `POST /reopen_logs`); what is left of
the old file is read to its end while this process runs. A file replaced while none runs loses
its unread tail (logged: how much is unknown).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import asyncpg

from ledger import metrics
from ledger.detectors import Gap
from ledger.entry import outcome_of
from ledger.filelog import Malformed, parse
from llmgw.outcome import Outcome

log = logging.getLogger("ledger.reconcile")

READ_MAX = 1 << 20  # bytes read in one pass
FAILURES = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)


class Sink(Protocol):
    def add(self, outcomes: Sequence[Outcome]) -> None: ...


class Holder(Protocol):
    """Part of the live path in this process: what it holds is on its way, not lost."""

    def holding(self, request_ids: set[str]) -> set[str]: ...


class Known(Protocol):
    async def known(self, request_ids: Sequence[str]) -> set[str]: ...
    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Where the next unconfirmed record of the file starts."""

    inode: int
    offset: int

    @classmethod
    def load(cls, path: Path) -> Checkpoint | None:
        try:
            data = json.loads(path.read_text())
            return cls(int(data["inode"]), int(data["offset"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, path: Path) -> None:
        """Atomically: a crash leaves the old checkpoint or the new one."""
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"inode": self.inode, "offset": self.offset}, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)


@dataclass(slots=True)
class Held:
    inode: int
    end: int  # the offset after the record's line
    outcome: Outcome | None  # None: nothing to reconcile (no tenant, malformed)
    seen: float  # monotonic time it was read
    submitted: float | None = None


class Database:
    """The ledger's `outcomes` table, asked which request IDs it has (a connection of its own)."""

    def __init__(self, database_url: str, timeout_s: float = 10.0) -> None:
        self.database_url = database_url
        self.timeout_s = timeout_s
        self._conn: asyncpg.Connection | None = None

    async def known(self, request_ids: Sequence[str]) -> set[str]:
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = await asyncpg.connect(
                    self.database_url, timeout=self.timeout_s, command_timeout=self.timeout_s
                )
            rows = await self._conn.fetch(
                "SELECT request_id FROM outcomes WHERE request_id = ANY($1::text[])",
                list(request_ids),
            )
        except BaseException:
            await self.close()
            raise
        return {r["request_id"] for r in rows}

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.terminate()


class Reconciler:
    def __init__(
        self,
        access_log: Path,
        sink: Sink,
        known: Known,
        *,
        checkpoint: Path | None = None,
        lag_s: float = 10.0,
        interval_s: float = 1.0,
        holders: Sequence[Holder] = (),
        held_max: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = access_log
        self.sink = sink
        self.database = known
        self.checkpoint_path = checkpoint or access_log.with_name(access_log.name + ".checkpoint")
        self.lag_s = lag_s
        self.interval_s = interval_s
        self.holders = holders
        self.held_max = held_max  # records read ahead of the checkpoint; the rest wait in the file
        self._clock = clock
        self._resumed = False  # the checkpoint is read on the first open only
        self.missing = 0  # records that could not be recovered
        self._file: BinaryIO | None = None
        self._inode = 0
        self._offset = 0  # read up to here
        self._held: list[Held] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="ledger-reconcile")

    async def close(self, drain_s: float = 0.0) -> None:
        """Stop; with `drain_s`, first hand over what the database lacks up to the end of the
        file without waiting for the gRPC path (a sidecar whose pod and file are going away)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_s
        while loop.time() < deadline:
            with contextlib.suppress(*FAILURES):
                self.read()
                await self.confirm(lag_s=0.0)
            if not self._held:
                break
            await asyncio.sleep(min(self.interval_s, max(deadline - loop.time(), 0)))
        if self._file is not None:
            self._file.close()
        await self.database.close()

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                await self.step()
                failures = 0
            except FAILURES as exc:
                failures += 1
                if failures == 1:
                    log.warning("reconciliation failing; will retry", extra={"error": repr(exc)})
            await asyncio.sleep(self.interval_s)

    async def step(self) -> None:
        """One pass: read what is new, confirm or recover what is old enough, move the
        checkpoint past what the database has."""
        self.read()
        await self.confirm()
        self._gauges()

    def read(self) -> None:
        if self._file is None and not self._open():
            return
        assert self._file is not None
        self._read_to_end(self._file)
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        if st.st_ino != self._inode:  # rotated: the old file is read to its end
            self._file.close()
            self._file = None
            self._open()
        elif st.st_size < self._offset:  # truncated in place
            self._file.seek(0)
            self._offset = 0

    def _open(self) -> bool:
        try:
            f = open(self.path, "rb")  # noqa: SIM115 (kept open: read on rotation)
        except FileNotFoundError:
            return False
        inode = os.fstat(f.fileno()).st_ino
        offset = 0
        if not self._resumed:
            self._resumed = True
            saved = Checkpoint.load(self.checkpoint_path)
            if saved is not None and saved.inode == inode:
                offset = saved.offset
            elif saved is not None:  # how much of the old file was unread is unknown
                log.warning("access log replaced since the checkpoint; reading the new one")
        f.seek(offset)
        self._file, self._inode, self._offset = f, inode, offset
        return True

    def _read_to_end(self, f: BinaryIO) -> None:
        while len(self._held) < self.held_max:
            chunk = f.read(READ_MAX)
            end = chunk.rfind(b"\n") + 1
            if end == 0:
                if len(chunk) == READ_MAX:  # no line of ours is this long: skip it
                    self._malformed()
                    self._offset += len(chunk)
                    continue
                f.seek(self._offset)  # nothing new, or a line still being written
                return
            now = self._clock()
            for line in chunk[:end].split(b"\n")[:-1]:
                if len(self._held) >= self.held_max:
                    break
                self._offset += len(line) + 1
                self._held.append(Held(self._inode, self._offset, self._outcome(line), now))
            f.seek(self._offset)

    def _outcome(self, line: bytes) -> Outcome | None:
        if not line.strip():
            return None
        try:
            outcome = outcome_of(parse(line))
        except Malformed:
            self._malformed()
            return None
        return outcome if outcome is not None and outcome.tenant else None

    async def confirm(self, lag_s: float | None = None) -> None:
        now = self._clock()
        lag = self.lag_s if lag_s is None else lag_s
        due = [h for h in self._held if now - h.seen >= lag]
        ids = [h.outcome.request_id for h in due if h.outcome is not None]
        have = await self.database.known(ids) if ids else set()
        missing = set(ids) - have
        on_its_way = set().union(*(holder.holding(missing) for holder in self.holders))
        lost = []
        for h in due:
            if h.outcome is None or h.outcome.request_id not in missing - on_its_way:
                continue
            # Not (yet) written: hand it over, again if a handover was itself lost.
            if h.submitted is None or now - h.submitted >= max(lag, self.interval_s):
                if h.submitted is None:
                    metrics.RECONCILED.inc()
                h.submitted = now
                lost.append(h.outcome)
        if lost:
            log.info("outcomes recovered from the access log", extra={"count": len(lost)})
            self.sink.add(lost)
        done = 0
        for h in due:  # the confirmed prefix
            if h.outcome is not None and h.outcome.request_id not in have:
                break
            done += 1
        if done:
            last = self._held[done - 1]
            Checkpoint(last.inode, last.end).save(self.checkpoint_path)
            del self._held[:done]

    def gap(self) -> Gap:
        """For the alert rules (ledger/detectors.py, outcomes_missing)."""
        oldest = self._held[0].seen if self._held else None
        return Gap(0.0 if oldest is None else self._clock() - oldest, self.missing)

    def _malformed(self) -> None:
        self.missing += 1
        metrics.MISSING.labels("malformed").inc()

    def _gauges(self) -> None:
        metrics.UNCONFIRMED.set(len(self._held))
        oldest = self._held[0].seen if self._held else None
        metrics.UNCONFIRMED_AGE.set(0 if oldest is None else self._clock() - oldest)
