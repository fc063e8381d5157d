"""protobuf Struct → plain Python values, for metadata Envoy hands the services.

Several times cheaper than `json_format.MessageToDict`, which goes through JSON-shaped
conversion of every field; readers here only need the values.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from google.protobuf import struct_pb2

_SCALARS = frozenset({"string_value", "number_value", "bool_value"})


def value(v: struct_pb2.Value) -> Any:
    kind = v.WhichOneof("kind")
    if kind in _SCALARS:  # first: nearly every value is one
        return getattr(v, kind)
    if kind == "struct_value":
        return to_dict(v.struct_value)
    if kind == "list_value":
        return [value(x) for x in v.list_value.values]
    return None  # null_value, or no kind set


def to_dict(s: struct_pb2.Struct) -> dict[str, Any]:
    return {k: value(v) for k, v in s.fields.items()}


class View(Mapping[str, Any]):
    """A Struct read as `to_dict(s)` would read, converting only the keys looked up: a reader
    of a few keys skips converting the rest (extauthz's namespace has about twenty)."""

    __slots__ = ("_fields",)

    def __init__(self, s: struct_pb2.Struct) -> None:
        self._fields = s.fields

    def __getitem__(self, key: str) -> Any:
        found = self._fields.get(key)  # `fields[key]` would insert a missing key
        if found is None:
            raise KeyError(key)
        return value(found)

    def get(self, key: str, default: Any = None) -> Any:
        found = self._fields.get(key)
        return default if found is None else value(found)

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)
