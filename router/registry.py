"""Plugin types by name, and building a profile from the config's named instances.

Types are registered explicitly (`default_registry()`), never as an import side effect. Loading
rejects unknown types, duplicate instance names, dangling references and references of the wrong
kind, naming the plugin.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pydantic import Field

from llmgw.config import Strict
from router.plugins import (
    best_picker,
    healthy,
    kv_headroom,
    load,
    not_saturated,
    prefix_affinity,
    queue_depth,
    seed,
    serves_model,
    session_affinity,
    tenant_priority,
)
from router.plugins.base import Factory, Filter, Picker, PluginError, Scorer


class PluginSpec(Strict):
    name: str
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class WeightedRef(Strict):
    ref: str
    weight: float = Field(default=1.0, ge=0)


class ProfileSpec(Strict):
    filters: list[str]
    scorers: list[WeightedRef]
    picker: str


DEFAULT_PLUGINS: tuple[PluginSpec, ...] = (
    PluginSpec(name="healthy", type="healthy"),
    PluginSpec(name="serves-model", type="serves-model"),
    PluginSpec(name="not-saturated", type="not-saturated"),
    PluginSpec(name="kv", type="kv-headroom"),
    PluginSpec(name="queue", type="queue-depth"),
    PluginSpec(name="load", type="load"),
    PluginSpec(name="session", type="session-affinity"),
    PluginSpec(name="prefix", type="prefix-affinity"),
    PluginSpec(name="priority", type="tenant-priority"),
    PluginSpec(name="pick", type="best-with-exploration"),
)
DEFAULT_PROFILE = ProfileSpec(
    filters=["healthy", "serves-model", "not-saturated"],
    scorers=[
        WeightedRef(ref="kv", weight=1.0),
        WeightedRef(ref="queue", weight=1.0),
        WeightedRef(ref="load", weight=2.0),
        WeightedRef(ref="session", weight=4.0),  # above prefix: replicas agree on sessions
        WeightedRef(ref="prefix", weight=3.0),
        WeightedRef(ref="priority", weight=0.5),
    ],
    picker="pick",
)


@dataclass(frozen=True)
class Profile:
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker


class Registry:
    def __init__(self) -> None:
        self._factories: dict[str, Factory] = {}

    def register(self, type_name: str, factory: Factory) -> None:
        if type_name in self._factories:
            raise PluginError(f"plugin type {type_name!r} registered twice")
        self._factories[type_name] = factory

    def build(self, plugins: Iterable[PluginSpec], profile: ProfileSpec) -> Profile:
        built: dict[str, Any] = {}
        for spec in plugins:
            if spec.name in built:
                raise PluginError(f"plugin {spec.name!r}: duplicate name")
            factory = self._factories.get(spec.type)
            if factory is None:
                known = ", ".join(sorted(self._factories))
                raise PluginError(f"plugin {spec.name!r}: unknown type {spec.type!r} ({known})")
            built[spec.name] = factory(spec.name, spec.params)

        def ref(name: str, method: str, kind: str) -> Any:
            if name not in built:
                raise PluginError(f"profile references undefined plugin {name!r}")
            plugin = built[name]
            if not callable(getattr(plugin, method, None)):
                raise PluginError(f"plugin {name!r} is not a {kind}")
            return plugin

        return Profile(
            filters=tuple(ref(n, "filter", "filter") for n in profile.filters),
            scorers=tuple((ref(s.ref, "score", "scorer"), s.weight) for s in profile.scorers),
            picker=ref(profile.picker, "pick", "picker"),
        )


PLUGIN_MODULES: tuple[ModuleType, ...] = (
    healthy,
    serves_model,
    not_saturated,
    kv_headroom,
    queue_depth,
    load,
    seed,
    session_affinity,
    prefix_affinity,
    tenant_priority,
    best_picker,
)


def default_registry() -> Registry:
    registry = Registry()
    for module in PLUGIN_MODULES:
        registry.register(module.TYPE, module.factory)
    return registry
