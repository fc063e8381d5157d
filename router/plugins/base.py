"""Plugin contracts: filters narrow the candidates, scorers rate them in [0, 1], a picker orders.

Each plugin module exports `TYPE` (its type name) and `factory(name, params)`; `router.registry`
registers them explicitly. Plugins that learn from picks (affinity) also implement `Observer`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ValidationError

from router.types import Candidate, PickRequest


class PluginError(ValueError):
    """A plugin that cannot be built or referenced; the message names the plugin."""


class Filter(Protocol):
    name: str

    def filter(self, req: PickRequest, cands: list[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    name: str

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        """One score per candidate, higher is better; the engine clamps to [0, 1]."""
        ...


class Picker(Protocol):
    name: str

    def pick(self, cands: list[Candidate], scores: list[float]) -> tuple[list[Candidate], bool]:
        """Candidates best first (a bounded prefix is enough), and whether it explored."""
        ...


@runtime_checkable
class Observer(Protocol):
    def observe(self, req: PickRequest, chosen: Candidate) -> None:
        """Called with the first pod of every answered pick."""
        ...


Factory = Callable[[str, Mapping[str, Any]], Any]

P = TypeVar("P", bound=BaseModel)


def parse_params(model: type[P], name: str, params: Mapping[str, Any]) -> P:
    try:
        return model.model_validate(dict(params))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(params)'}: {e['msg']}" for e in exc.errors()
        )
        raise PluginError(f"plugin {name!r}: {problems}") from exc
