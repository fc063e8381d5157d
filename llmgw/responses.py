"""A Responses API body (`POST /v1/responses`) as the chat request vLLM renders it into, so that
the gateway counts, reserves, caps and routes it as chat (llmgw/facts.py reads the result).

vLLM 0.32 (entrypoints/openai/responses/utils.py `construct_input_messages`): `instructions` is a
system message, then each input item a message: messages as they are (their parts with a "text"
read as text, others as images or files), a function or custom tool call an assistant message
with a tool call (its name under its namespace, `NS__name`; a custom call's `input` as its
arguments), a call's output a tool message (its parts too), reasoning an assistant message. An
item vLLM would refuse still counts, by the size of its JSON. Function tools are shown to the
template in chat's shape (`construct_tool_dicts`). The output cap, `max_output_tokens`, reads as
chat's; the usage always ends the stream (no `n`, no stream_options).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llmgw.facts import lax_bool

# vLLM keeps responses (its store: `store`, `previous_response_id`, GET /v1/responses/{id})
# only where its server starts with this set to 1; the simulator reads it too.
STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"

_CALLS = ("function_call", "custom_tool_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output")
_NAMESPACE_SEPARATOR = "__"  # vLLM's tool_parsers/utils.py flat_namespace_tool_name


def as_chat(request: Mapping[str, Any]) -> dict[str, Any]:
    messages: list[Any] = []
    instructions = request.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = request.get("input")
    items = given if isinstance(given, list) else [{"role": "user", "content": given}]
    messages += map(_message, items)
    stream = lax_bool(request.get("stream"))
    tools = request.get("tools")
    chat: dict[str, Any] = {
        "messages": messages,
        "stream": stream,
        "stream_options": {"include_usage": stream},
        "tools": [_tool(t) for t in tools] if isinstance(tools, list) else tools,
        "max_completion_tokens": request.get("max_output_tokens"),
    }
    if "model" in request:
        chat["model"] = request["model"]
    return chat


def _message(item: object) -> object:
    if not isinstance(item, dict):
        return {"role": "user", "content": _json(item)}
    kind = item.get("type")
    if kind in _CALLS:
        name = item.get("name")
        namespace = item.get("namespace")
        if isinstance(namespace, str) and namespace and isinstance(name, str):
            name = f"{namespace}{_NAMESPACE_SEPARATOR}{name}"
        arguments = item.get("input") if kind == "custom_tool_call" else item.get("arguments")
        call = {"name": name, "arguments": arguments}
        return {"role": "assistant", "tool_calls": [{"id": item.get("call_id"), "function": call}]}
    if kind in _OUTPUTS:
        output = item.get("output")
        # A list is parts (text, images, files), as a chat message's content.
        content = output if isinstance(output, str | list) else _json(output)
        return {"role": "tool", "content": content}
    if kind == "reasoning":
        return {"role": "assistant", "reasoning": _json(item.get("content") or item.get("summary"))}
    if isinstance(item.get("role"), str):
        return item  # as vLLM passes it on
    return {"role": "user", "content": _json(item)}


def _tool(tool: object) -> object:
    """A flat Responses function tool in chat's shape; any other tool as it is."""
    if isinstance(tool, dict) and tool.get("type") == "function":
        return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    return tool


def _json(value: object) -> str:
    return json.dumps(value) if value is not None else ""
