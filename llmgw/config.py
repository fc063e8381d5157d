"""Settings: a YAML file, then environment overrides, validated by a pydantic schema.

Environment overrides use the service's prefix and ``__`` between nested keys, e.g.
``LLMGW_EXTAUTHZ__GRPC__PORT=9001``. Values are parsed as YAML scalars, so ``true``, ``20``
and ``[a, b]`` mean what they say. Unknown keys are errors that name the file and the key.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)


class Strict(BaseModel):
    """Base of every settings model: unknown keys are rejected, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def reveal(secret: SecretStr | None) -> str | None:
    """A secret setting's value, for the one call that needs it (a connect, never a log line)."""
    return None if secret is None else secret.get_secret_value()


class ConfigError(Exception):
    """A settings file or override that does not fit its schema."""


def deprecated(name: str, instead: str) -> None:
    """The one warning for an old setting, flag or environment variable still read."""
    log.warning("%s is deprecated: use %s", name, instead)


def renamed(data: object, names: Mapping[str, str], where: str) -> object:
    """A model's input with each deprecated key (old → new, dotted for a nested one:
    "redis.timeout_s") read under its new name, and a warning; both names at once is an error
    (which one was meant?). For a `mode="before"` model validator, so files, environment
    overrides and flags written for the old name still load."""
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    for old, new in names.items():
        found, value = _pop(out, old.split("."))
        if not found:
            continue
        if not _put(out, new.split("."), value):
            raise ValueError(f"{old}: the deprecated name of {new}; set only {new}")
        deprecated(f"{where}{old}", new)
    return out


def _pop(data: dict[str, Any], path: list[str]) -> tuple[bool, Any]:
    """Remove the key at `path`, copying the mappings on the way (the caller's stay whole)."""
    *parents, last = path
    node = data
    for part in parents:
        child = node.get(part)
        if not isinstance(child, Mapping):
            return False, None
        node[part] = dict(child)
        node = node[part]
    if last not in node:
        return False, None
    return True, node.pop(last)


def _put(data: dict[str, Any], path: list[str], value: Any) -> bool:
    """Set the key at `path`; False when it is already set (or a parent is not a mapping)."""
    *parents, last = path
    node = data
    for part in parents:
        child = node.get(part, {})
        if not isinstance(child, Mapping):
            return False
        node[part] = dict(child)
        node = node[part]
    if last in node:
        return False
    node[last] = value
    return True


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def env_overrides(prefix: str, environ: Mapping[str, str]) -> dict[str, Any]:
    """Nested dict from ``PREFIX__A__B=value`` variables."""
    out: dict[str, Any] = {}
    head = prefix.upper() + "__"
    for name, raw in environ.items():
        if not name.startswith(head):
            continue
        path = [part.lower() for part in name[len(head) :].split("__") if part]
        if not path:
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = yaml.safe_load(raw) if raw else raw
    return out


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def validate(model: type[M], data: Mapping[str, Any], source: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{source}: {problems}") from exc


def load(
    model: type[M],
    path: Path | None,
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
) -> M:
    """Parse the file (if any), apply environment overrides, validate."""
    data = read_yaml(path) if path is not None else {}
    data = merge(data, env_overrides(env_prefix, os.environ if environ is None else environ))
    return validate(model, data, str(path) if path is not None else env_prefix)
