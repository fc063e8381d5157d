"""Alert rules over the outcome stream: pure, on a clock the caller passes (`now`, seconds).

`observe()` and `unchecked()` count what arrived; `evaluate()` says which conditions hold and
returns a `Finding` for each one that starts an episode: a condition fires once when it has held
for its `for_s`, and re-arms when an evaluation finds it clear (ledger/alerts.py emits them).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from pydantic import Field

from llmgw.config import Strict
from llmgw.outcome import Outcome

DetectorKind = Literal[
    "quota_refusals",
    "fleet_5xx",
    "pod_errors",
    "ratelimit_fail_open",
    "ledger_backlog",
    "outcomes_missing",
]


class QuotaRefusals(Strict):
    """A tenant refused by the gateway's rate limiter (429 without a pod) for more than `ratio`
    of its requests over `window_s`, continuously for `for_s`: customer success should call."""

    ratio: float = Field(default=0.2, gt=0, lt=1)
    window_s: float = Field(default=60.0, gt=0)
    for_s: float = Field(default=300.0, ge=0)
    min_requests: int = Field(default=10, ge=1)  # fewer in the window: too few to judge


class Fleet5xx(Strict):
    """At least `min_errors` 5xx across the fleet in `window_s`, and more than `ratio` of all
    requests: scale out (or look at the fleet)."""

    ratio: float = Field(default=0.05, gt=0, lt=1)
    min_errors: int = Field(default=20, ge=1)
    window_s: float = Field(default=30.0, gt=0)
    for_s: float = Field(default=0.0, ge=0)


class PodErrors(Strict):
    """One pod with more than `share` of the fleet's upstream errors (at least `min_errors`)
    in `window_s`, failing at least `ratio` times as often as the other pods together: the pod
    is at fault, not the fleet (every pod failing alike is fleet_5xx, not this)."""

    share: float = Field(default=0.5, gt=0, lt=1)
    ratio: float = Field(default=4.0, gt=1)
    min_errors: int = Field(default=10, ge=1)
    window_s: float = Field(default=60.0, gt=0)
    for_s: float = Field(default=0.0, ge=0)


class FailOpen(Strict):
    """At least `min_admissions` requests reached a pod without a rate-limit decision (the
    limiter's answer) in `window_s`: the rate limiter failed open, so no quota applied to them."""

    min_admissions: int = Field(default=10, ge=1)
    window_s: float = Field(default=60.0, gt=0)
    for_s: float = Field(default=0.0, ge=0)


class Backlog(Strict):
    """At least `min_records` waiting (unsettled + unwritten), more than `window_s` ago: the
    ledger is not keeping up. Clears when the backlog falls below `min_records`."""

    min_records: int = Field(default=10_000, ge=1)
    window_s: float = Field(default=30.0, gt=0)


class Missing(Strict):
    """Outcomes Envoy logged that the database has not confirmed for `max_age_s` (PostgreSQL
    down, or a record it cannot take), or any the reconciler could not recover (ledger/
    reconcile.py): the ledger misses outcomes, or is about to. Fires once per episode of the
    first, once per growth of the second."""

    max_age_s: float = Field(default=300.0, gt=0)


@dataclass(frozen=True)
class Gap:
    """What the reconciler has not got into the database."""

    oldest_s: float = 0.0  # how long the oldest record not yet confirmed has waited
    missing: int = 0  # records it could not recover, since it started


class Rules(Strict):
    quota_refusals: QuotaRefusals = QuotaRefusals()
    fleet_5xx: Fleet5xx = Fleet5xx()
    pod_errors: PodErrors = PodErrors()
    ratelimit_fail_open: FailOpen = FailOpen()
    ledger_backlog: Backlog = Backlog()
    outcomes_missing: Missing = Missing()


@dataclass(frozen=True)
class Finding:
    kind: DetectorKind
    tenant: str = ""
    tier: str = ""
    detail: Mapping[str, Any] = field(default_factory=dict)


K = TypeVar("K", bound=Hashable)


class RecentCounts(Generic[K]):
    """Counts by key over the last `span_s` seconds, in one-second buckets."""

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self._buckets: collections.deque[tuple[int, collections.Counter[K]]] = collections.deque()
        self._sum: collections.Counter[K] = collections.Counter()

    def add(self, now: float, key: K, n: int = 1) -> None:
        second = int(now)
        if not self._buckets or self._buckets[-1][0] != second:
            self._buckets.append((second, collections.Counter()))
        self._buckets[-1][1][key] += n
        self._sum[key] += n

    def totals(self, now: float) -> collections.Counter[K]:
        while self._buckets and self._buckets[0][0] <= now - self.span_s:
            self._sum -= self._buckets.popleft()[1]  # `-=` also drops the keys that reach 0
        return self._sum


@dataclass
class _Episode:
    since: float
    fired: bool = False


def _server_error(o: Outcome) -> bool:
    # The gateway's own refusals (the rate limiter, which also enforces the tenant breaker) are
    # not the fleet failing: scaling out would not help.
    return o.status >= 500 and not o.by_gateway


def _quota_refused(o: Outcome) -> bool:
    return o.outcome == "refused" and o.status == 429 and not o.pod


class Detectors:
    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self._quota = RecentCounts[tuple[str, bool]](
            rules.quota_refusals.window_s
        )  # tenant, refused
        self._fleet = RecentCounts[str](rules.fleet_5xx.window_s)  # "requests", "5xx"
        self._pods = RecentCounts[tuple[str, str]](
            rules.pod_errors.window_s
        )  # "seen"|"errors", pod
        self._unchecked = RecentCounts[str](rules.ratelimit_fail_open.window_s)  # by tenant
        self._backlog: collections.deque[tuple[float, int]] = collections.deque()
        self._missing = 0  # the reconciler's count at the last evaluation
        self._tiers: dict[str, str] = {}
        self._episodes: dict[DetectorKind, dict[str, _Episode]] = collections.defaultdict(dict)

    def observe(self, now: float, outcomes: Sequence[Outcome]) -> None:
        for o in outcomes:
            if o.tenant:
                self._quota.add(now, (o.tenant, _quota_refused(o)))
                self._tiers[o.tenant] = o.tier
            self._fleet.add(now, "requests")
            if _server_error(o):
                self._fleet.add(now, "5xx")
            if o.pod:
                self._pods.add(now, ("seen", o.pod))
                if o.outcome == "upstream_error":
                    self._pods.add(now, ("errors", o.pod))

    def unchecked(self, now: float, outcome: Outcome) -> None:
        self._unchecked.add(now, outcome.tenant)

    def evaluate(self, now: float, backlog: Mapping[str, int], gap: Gap = Gap()) -> list[Finding]:
        """`backlog`: the records waiting, by where (e.g. unsettled, unwritten); `gap`: the
        reconciler's."""
        found = [
            *self._quota_refusals(now),
            *self._fleet_5xx(now),
            *self._pod_errors(now),
            *self._fail_open(now),
            *self._ledger_backlog(now, backlog),
            *self._outcomes_missing(now, gap),
        ]
        active = {tenant for tenant, _ in self._quota.totals(now)}
        self._tiers = {t: tier for t, tier in self._tiers.items() if t in active}
        return found

    def _gate(
        self, now: float, kind: DetectorKind, for_s: float, holding: Mapping[str, dict[str, Any]]
    ) -> list[tuple[str, dict[str, Any]]]:
        """The subjects (tenant, pod, "" for the fleet) of `holding` whose episode fires now;
        forgets (re-arms) the episodes of those no longer holding."""
        episodes = self._episodes[kind]
        for subject in episodes.keys() - holding.keys():
            del episodes[subject]
        fired = []
        for subject, detail in holding.items():
            episode = episodes.setdefault(subject, _Episode(now))
            if not episode.fired and now - episode.since >= for_s:
                episode.fired = True
                fired.append((subject, detail))
        return fired

    def _quota_refusals(self, now: float) -> list[Finding]:
        rule = self.rules.quota_refusals
        counts = self._quota.totals(now)
        holding = {}
        for tenant in {t for t, _ in counts}:
            refused = counts[(tenant, True)]
            total = refused + counts[(tenant, False)]
            if total >= rule.min_requests and refused > rule.ratio * total:
                holding[tenant] = {"refused": refused, "requests": total, "window_s": rule.window_s}
        return [
            Finding("quota_refusals", tenant, self._tiers.get(tenant, ""), detail)
            for tenant, detail in self._gate(now, "quota_refusals", rule.for_s, holding)
        ]

    def _fleet_5xx(self, now: float) -> list[Finding]:
        rule = self.rules.fleet_5xx
        counts = self._fleet.totals(now)
        errors, total = counts["5xx"], counts["requests"]
        holding = {}
        if errors >= rule.min_errors and errors > rule.ratio * total:
            holding[""] = {"errors": errors, "requests": total, "window_s": rule.window_s}
        return [
            Finding("fleet_5xx", detail=d)
            for _, d in self._gate(now, "fleet_5xx", rule.for_s, holding)
        ]

    def _pod_errors(self, now: float) -> list[Finding]:
        rule = self.rules.pod_errors
        counts = self._pods.totals(now)
        errors = {pod: n for (what, pod), n in counts.items() if what == "errors"}
        seen = {pod: n for (what, pod), n in counts.items() if what == "seen"}
        fleet, served = sum(errors.values()), sum(seen.values())
        holding = {}
        if fleet >= rule.min_errors and len(seen) > 1:
            for pod, n in errors.items():
                rate = n / max(seen.get(pod, 0), 1)
                others = (fleet - n) / max(served - seen.get(pod, 0), 1)
                if n > rule.share * fleet and rate >= rule.ratio * others:
                    holding[pod] = {
                        "pod": pod,
                        "errors": n,
                        "fleet_errors": fleet,
                        "window_s": rule.window_s,
                    }
        return [
            Finding("pod_errors", detail=d)
            for _, d in self._gate(now, "pod_errors", rule.for_s, holding)
        ]

    def _fail_open(self, now: float) -> list[Finding]:
        rule = self.rules.ratelimit_fail_open
        counts = self._unchecked.totals(now)
        admissions = sum(counts.values())
        holding = {}
        if admissions >= rule.min_admissions:
            top = [t for t, _ in counts.most_common(5)]
            holding[""] = {"admissions": admissions, "tenants": top, "window_s": rule.window_s}
        return [
            Finding("ratelimit_fail_open", detail=d)
            for _, d in self._gate(now, "ratelimit_fail_open", rule.for_s, holding)
        ]

    def _ledger_backlog(self, now: float, backlog: Mapping[str, int]) -> list[Finding]:
        rule = self.rules.ledger_backlog
        records = sum(backlog.values())
        self._backlog.append((now, records))
        # Keep one sample at least window_s old: the one growth is measured from.
        while len(self._backlog) > 1 and self._backlog[1][0] <= now - rule.window_s:
            self._backlog.popleft()
        then_t, then = self._backlog[0]
        growing = then_t <= now - rule.window_s and records > then
        firing = self._episodes["ledger_backlog"].get("", _Episode(now)).fired
        holding = {}
        if records >= rule.min_records and (growing or firing):
            holding[""] = {"records": records, **backlog, "window_s": rule.window_s}
        return [
            Finding("ledger_backlog", detail=d)
            for _, d in self._gate(now, "ledger_backlog", 0.0, holding)
        ]

    def _outcomes_missing(self, now: float, gap: Gap) -> list[Finding]:
        rule = self.rules.outcomes_missing
        holding: dict[str, dict[str, Any]] = {}
        if gap.oldest_s >= rule.max_age_s:
            holding["unconfirmed"] = {"oldest_s": round(gap.oldest_s), "max_age_s": rule.max_age_s}
        if gap.missing > self._missing:
            holding["unrecoverable"] = {"records": gap.missing - self._missing}
        self._missing = gap.missing
        return [
            Finding("outcomes_missing", detail={"cause": cause, **d})
            for cause, d in self._gate(now, "outcomes_missing", 0.0, holding)
        ]
