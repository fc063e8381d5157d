"""The fleet's contexts: per model, the least `max_model_len` of the pods serving it that publish
one in /v1/models (router/collectors/scrape.py). The one definition: extauthz reads it here when
it holds the router, and from the fleet load the publisher writes (router/publisher.py) when not.

The least, because a request may be sent to any pod of the model; a pod that has left the fleet
no longer counts, one that fails its scrapes still does (with what it last published).
"""

from __future__ import annotations

from collections.abc import Mapping

from router import metrics
from router.types import PodId


class Contexts:
    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self._pods: dict[PodId, Mapping[str, int]] = {}

    def context(self, model: str) -> int | None:
        """llmgw/fleetload.py `ModelContexts`."""
        return self.current.get(model)

    def observe(self, pod: PodId, contexts: Mapping[str, int]) -> None:
        """The pod's models' contexts as last read (unchanged: nothing to do)."""
        if self._pods.get(pod) != contexts:
            self._pods[pod] = contexts
            self._update()

    def forget(self, pod: PodId) -> None:
        if self._pods.pop(pod, None) is not None:
            self._update()

    def _update(self) -> None:
        current: dict[str, int] = {}
        for contexts in self._pods.values():
            for model, context in contexts.items():
                current[model] = min(context, current.get(model, context))
        for model in self.current.keys() - current.keys():
            metrics.MODEL_CONTEXT.remove(model)
        for model, context in current.items():
            metrics.MODEL_CONTEXT.labels(model).set(context)
        self.current = current
