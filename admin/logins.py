"""The console's logins: who logged in with the admin token, by a cookie that is not the token.

A login is a random session ID kept in this process's memory (one admin replica; a restart logs
everyone out). The cookie carries the ID and its HMAC under a key made at start, checked in
constant time before the ID is looked up, so a forged cookie is refused without probing the
table. Logging out forgets the ID: a copied cookie stops working. Each login's CSRF token is
another HMAC of its ID: a form posted from elsewhere cannot know it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

COOKIE = "llmgw_console"
LIFETIME_S = 12 * 3600.0


class Logins:
    def __init__(
        self,
        token: str,
        lifetime_s: float = LIFETIME_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._token = token.encode()
        self._key = secrets.token_bytes(32)
        self._lifetime_s = lifetime_s
        self._clock = clock
        self._live: dict[str, float] = {}  # session ID → when it expires (the clock's time)

    def start(self, token: str) -> str | None:
        """A new login's cookie value if `token` is the admin token, else None."""
        if not hmac.compare_digest(token.encode(errors="surrogateescape"), self._token):
            return None
        now = self._clock()
        self._live = {sid: end for sid, end in self._live.items() if end > now}
        sid = secrets.token_urlsafe(32)
        self._live[sid] = now + self._lifetime_s
        return f"{sid}.{self._mac('login', sid)}"

    def session(self, cookie: str | None) -> str | None:
        """The live session the cookie names, or None."""
        sid, _, mac = (cookie or "").partition(".")
        if not sid or not hmac.compare_digest(
            mac.encode(errors="surrogateescape"), self._mac("login", sid).encode()
        ):
            return None
        end = self._live.get(sid)
        return sid if end is not None and end > self._clock() else None

    def end(self, sid: str) -> None:
        self._live.pop(sid, None)

    def csrf(self, sid: str) -> str:
        return self._mac("csrf", sid)

    def csrf_ok(self, sid: str, given: str) -> bool:
        return hmac.compare_digest(given.encode(errors="surrogateescape"), self.csrf(sid).encode())

    def _mac(self, purpose: str, sid: str) -> str:
        return hmac.new(
            self._key, f"{purpose}:{sid}".encode(errors="surrogateescape"), hashlib.sha256
        ).hexdigest()
