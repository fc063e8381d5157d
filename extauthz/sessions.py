"""Session IDs: Snowflake 64-bit IDs inside, signed tenant-bound `sess_…` strings outside.

ID layout (63 bits used): milliseconds since EPOCH_MS (41 bits, ~69 years) | worker (10) | seq (12).
External form: "sess_" + base62(ID, 11 chars) + base62(HMAC-SHA256(secret, ID ‖ tenant)[:10], 14
chars). Fixed widths and a strict alphabet make every ID/tag pair have exactly one spelling, so no
mutated string can verify.
"""

from __future__ import annotations

import hmac

EPOCH_MS = 1_704_067_200_000  # 2024-01-01T00:00:00Z
WORKER_BITS = 10
SEQUENCE_BITS = 12
MAX_WORKER = (1 << WORKER_BITS) - 1
_SEQ_MASK = (1 << SEQUENCE_BITS) - 1
_TIME_SHIFT = WORKER_BITS + SEQUENCE_BITS

PREFIX = "sess_"
_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_INDEX = {c: i for i, c in enumerate(_ALPHABET)}
_PAIRS = [high + low for high in _ALPHABET for low in _ALPHABET]  # base-62 digit pairs, 00…zz
_ID_CHARS = 11  # 62**11 > 2**64
_TAG_BYTES = 10
_TAG_CHARS = 14  # 62**14 > 2**80
LENGTH = len(PREFIX) + _ID_CHARS + _TAG_CHARS
_DOMAIN = b"llmgw-session-v1\x00"


class Snowflake:
    """Time-ordered 64-bit IDs for one worker; strictly increasing even if the clock steps back.

    The caller passes the time, so the generator is deterministic under test. Not thread-safe: one
    instance per thread or event loop (each with its own worker ID).
    """

    def __init__(self, worker_id: int) -> None:
        if not 0 <= worker_id <= MAX_WORKER:
            raise ValueError(f"worker_id must be in 0..{MAX_WORKER}")
        self.worker_id = worker_id
        self._last_ms = 0
        self._seq = -1

    def next_id(self, now_ms: int) -> int:
        ms = max(now_ms - EPOCH_MS, self._last_ms)  # a clock stepping back reuses the last ms
        if ms == self._last_ms:
            self._seq += 1
            if self._seq > _SEQ_MASK:  # sequence exhausted: borrow the next millisecond
                ms += 1
                self._seq = 0
        else:
            self._seq = 0
        self._last_ms = ms
        return (ms << _TIME_SHIFT) | (self.worker_id << SEQUENCE_BITS) | self._seq


def id_time_ms(session_id: int) -> int:
    """Unix milliseconds at which the ID was minted."""
    return (session_id >> _TIME_SHIFT) + EPOCH_MS


def _encode(value: int, width: int) -> str:
    # Two digits a step: half the loop turns of one a step, on every minted session.
    out = []
    for _ in range(width // 2):
        value, pair = divmod(value, 62 * 62)
        out.append(_PAIRS[pair])
    if width % 2:
        out.append(_ALPHABET[value % 62])
    return "".join(reversed(out))


def _decode(text: str) -> int | None:
    value = 0
    for char in text:
        digit = _INDEX.get(char)
        if digit is None:
            return None
        value = value * 62 + digit
    return value


class SessionCodec:
    """Signs and verifies external session IDs; `previous` keeps verifying during a rotation."""

    def __init__(self, secret: bytes, previous: bytes | None = None, max_age_ms: int = 0) -> None:
        # Keyed once and copied per tag: a one-shot hmac.digest fetches SHA-256 from OpenSSL
        # and keys a new HMAC on every call (~21 µs with the server's cold caches; a copy ~14).
        self._mac = hmac.new(secret, digestmod="sha256")
        self._previous_mac = None if previous is None else hmac.new(previous, digestmod="sha256")
        self.max_age_ms = max_age_ms  # 0: no age limit

    @staticmethod
    def _tag(keyed: hmac.HMAC, tenant: str, session_id: int) -> bytes:
        mac = keyed.copy()
        mac.update(_DOMAIN + session_id.to_bytes(8, "big") + tenant.encode())
        return mac.digest()[:_TAG_BYTES]

    def encode(self, tenant: str, session_id: int) -> str:
        tag = int.from_bytes(self._tag(self._mac, tenant, session_id), "big")
        return PREFIX + _encode(session_id, _ID_CHARS) + _encode(tag, _TAG_CHARS)

    def decode(self, tenant: str, text: str, now_ms: int) -> int | None:
        """The session ID if `text` was signed for `tenant` and is not too old, else None."""
        if len(text) != LENGTH or not text.startswith(PREFIX):
            return None
        session_id = _decode(text[len(PREFIX) : len(PREFIX) + _ID_CHARS])
        tag = _decode(text[len(PREFIX) + _ID_CHARS :])
        if session_id is None or tag is None or session_id >= 1 << 64 or tag >= 1 << 80:
            return None
        given = tag.to_bytes(_TAG_BYTES, "big")
        macs = (self._mac,) if self._previous_mac is None else (self._mac, self._previous_mac)
        if not any(hmac.compare_digest(self._tag(m, tenant, session_id), given) for m in macs):
            return None
        if self.max_age_ms and now_ms - id_time_ms(session_id) > self.max_age_ms:
            return None
        return session_id


class Sessions:
    """Mints and verifies the session IDs of one replica."""

    def __init__(self, codec: SessionCodec, worker_id: int) -> None:
        self.codec = codec
        self.snowflake = Snowflake(worker_id)

    def mint(self, tenant: str, now_ms: int) -> str:
        return self.codec.encode(tenant, self.snowflake.next_id(now_ms))

    def verify(self, tenant: str, text: str, now_ms: int) -> bool:
        return self.codec.decode(tenant, text, now_ms) is not None
