"""How long a check has waited since Envoy stamped it, net of the two clocks' offset.

Envoy stamps a request when its body is whole (authzhttp.BODY_AT, Envoy's clock, in ms); this
process reads its own clock, perhaps on another host. Their offset is taken as the least age
seen over the last `window_s` (a check that did not wait at all shows the offset alone), in two
half-window buckets so that it follows clocks that drift. So clocks seconds apart still shed by
the wait alone; under an overload that outlasts the window, the floor rises and checks are no
longer shed (Envoy's own timeout answers then, with retry-after too).
"""

from __future__ import annotations

import math

PLAUSIBLE_MS = 60_000.0  # an age beyond this either way is not a wait: the stamp is ignored


class Waits:
    def __init__(self, window_s: float = 60.0) -> None:
        self.half_ms = window_s * 500
        self._started = -math.inf
        self._earlier = math.inf  # least age of the previous half window
        self._current = math.inf  # ... and of this one

    def waited_ms(self, stamp_ms: int, now_ms: float) -> float | None:
        """The check's wait, or None when its stamp is implausible."""
        age = now_ms - stamp_ms
        if abs(age) > PLAUSIBLE_MS:
            return None
        if now_ms - self._started >= self.half_ms:
            self._earlier, self._current, self._started = self._current, math.inf, now_ms
        self._current = min(self._current, age)
        return age - min(self._earlier, self._current)
