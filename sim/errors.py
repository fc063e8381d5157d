"""Error replies in vLLM 0.32's shape: `{"error": {"message", "type", "param", "code"}}`.

Three families, as vLLM's exception handlers make them (entrypoints/serve/exception_handling):
- request-model validation (pydantic, before the handler runs): type "Bad Request", `param`
  the field path ("body.priority"), message "N validation error(s):" + one line per error;
- checks in the serving code (VLLMValidationError): type "BadRequestError", `param` the
  parameter, the message suffixed " (parameter=..., value=...)";
- others: the status's error class name ("NotFoundError", "InternalServerError", ...).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

_BRACKETED = re.compile(r"[\[\]{}()]")
# pydantic-core schema kinds that show up in `loc` but are no field names (vLLM's list).
_INTERNAL = frozenset(
    [
        "function-wrap",
        "function-after",
        "function-before",
        "function-plain",
        "json-or-python",
        "lax-or-strict",
        "chain",
        "default",
        "nullable",
        "tagged-union",
        "union",
        "call",
        "arguments",
        "is-instance",
        "is-subclass",
        "callable",
        "str",
        "int",
        "float",
        "bool",
        "bytes",
        "bytearray",
        "list",
        "tuple",
        "dict",
        "set",
        "frozenset",
        "complex",
        "none",
        "nonetype",
    ]
)
_MAX_REPORTED = 10
_MAX_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000  # one error's line


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def invalid(message: str, parameter: str | None = None, value: Any = None) -> ApiError:
    """A VLLMValidationError raised by the serving code or SamplingParams."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return ApiError(400, text, "BadRequestError", parameter)


def param_path(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not _internal(str(p))]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def _internal(segment: str) -> bool:
    return bool(_BRACKETED.search(segment)) or segment.lower() in _INTERNAL


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "...[truncated]"


def _summary(value: Any) -> Any:
    """handlers/validation.py::_summarize_error_input: containers described, text bounded."""
    if isinstance(value, str):
        return _bounded(value, _MAX_INPUT_CHARS)
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | dict | set | frozenset):
        return f"<{type(value).__name__} of {len(value)} items>"
    return _bounded(str(value), _MAX_INPUT_CHARS)


def request_invalid(errors: list[Any], param: str | None = None) -> ApiError:
    """FastAPI's RequestValidationError through vLLM's handler (errors as pydantic gives them,
    `loc` already prefixed with "body")."""
    lines = []
    for err in errors[:_MAX_REPORTED]:
        if isinstance(err, dict):
            err = dict(err)
            if "input" in err:
                err["input"] = _summary(err["input"])
            err["loc"] = param_path(tuple(err.get("loc", ())))
        lines.append(f"  {_bounded(str(err), _MAX_ERROR_CHARS)}")
    if param is None and errors and isinstance(errors[0], dict) and errors[0].get("loc"):
        param = param_path(tuple(errors[0]["loc"]))
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(lines)
    if len(errors) > _MAX_REPORTED:
        message += f"\n  ...and {len(errors) - _MAX_REPORTED} more {label}"
    return ApiError(400, message, "Bad Request", param)


def from_pydantic(exc: ValidationError, source: str = "body") -> ApiError:
    """A model of the body (or of the "query" parameters) that failed, as FastAPI reports it."""
    errors = [{**e, "loc": (source, *e["loc"])} for e in exc.errors(include_url=False)]
    return request_invalid(errors)


def not_found_route() -> dict[str, str]:
    """Starlette's reply to a path no route serves."""
    return {"detail": "Not Found"}
