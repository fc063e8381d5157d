"""What a pod serves, as the ready file tells scripts and tests: its model's name and context.

Read from where each engine takes it, never assumed: a simulated pod's own flags, parsed as the
simulator parses them; a real vLLM pod's settings; an upstream's `/v1/models`.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from sim.__main__ import settings_from
from tools.engine import VllmSettings


@dataclass(frozen=True)
class Serving:
    model: str | None  # None: not known (an upstream that did not answer)
    max_model_len: int | None

    @classmethod
    def simulated(cls, flags: Sequence[str]) -> Serving:
        """A simulated pod started with `python -m sim FLAGS`."""
        settings = settings_from(list(flags))
        return cls(settings.model, settings.max_model_len)

    @classmethod
    def vllm(cls, settings: VllmSettings) -> Serving:
        return cls(settings.served_model_name, settings.max_model_len)

    @classmethod
    def upstream(cls, url: str, api_key: str | None, timeout_s: float = 5.0) -> Serving:
        """The first model an upstream vLLM lists; unknown if it cannot be read now."""
        headers = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
        request = urllib.request.Request(f"{url}/v1/models", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                card = json.load(reply)["data"][0]
            model, length = str(card["id"]), card.get("max_model_len")
        except (OSError, ValueError, LookupError, TypeError, AttributeError):
            return cls(None, None)
        return cls(model, length if isinstance(length, int) else None)
