"""vLLM's Responses API store (`VLLM_ENABLE_RESPONSES_API_STORE=1`; responses/serving.py's
`response_store` and `msg_store`): each finished Response object by its id, beside the chat
messages its request was rendered into, for `previous_response_id` and GET /v1/responses/{id}.

vLLM keeps every response for the life of the server (its FIXME calls it a memory leak); this
store keeps the newest `capacity` and drops the oldest first, so a long load cannot grow a pod
without bound. Off, vLLM keeps nothing (it turns every request's `store` off): capacity 0.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sim.errors import ApiError
from sim.types import SimSettings


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]  # the Response object as it was sent
    messages: list[dict[str, Any]]  # its request's rendered conversation (vLLM's msg_store)


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    @classmethod
    def of(cls, settings: SimSettings) -> ResponseStore:
        on = settings.enable_responses_api_store
        return cls(settings.responses_api_store_max if on else 0)

    def find(self, response_id: str) -> Stored:
        """The response of that id, or vLLM's 404 (serving.py::_make_not_found_error)."""
        found = self._kept.get(response_id)
        if found is None:
            message = f"Response with id '{response_id}' not found."
            raise ApiError(404, message, "invalid_request_error", "response_id")
        return found

    def put(self, stored: Stored) -> None:
        """Keep a response (replacing one of its id, as vLLM's dict does), dropping the oldest
        past the capacity: with capacity 0, the one just put."""
        key = str(stored.response["id"])
        self._kept[key] = stored
        self._kept.move_to_end(key)
        if len(self._kept) > self.capacity:
            self._kept.popitem(last=False)
