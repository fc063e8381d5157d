"""protobuf Struct → plain Python values, for metadata Envoy hands the services.

Several times cheaper than `json_format.MessageToDict`, which goes through JSON-shaped
conversion of every field; readers here only need the values.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2


def value(v: struct_pb2.Value) -> Any:
    kind = v.WhichOneof("kind")
    if kind == "struct_value":
        return to_dict(v.struct_value)
    if kind == "list_value":
        return [value(x) for x in v.list_value.values]
    if kind == "null_value" or kind is None:
        return None
    return getattr(v, kind)


def to_dict(s: struct_pb2.Struct) -> dict[str, Any]:
    return {k: value(v) for k, v in s.fields.items()}
