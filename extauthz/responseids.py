"""Stored responses' IDs: chosen by the gateway, bound to a tenant, naming the pod that holds
the response and the most tokens its conversation can hold.

vLLM keeps a stored response in the memory of the pod that generated it, under the ID the body's
`request_id` gives it. The gateway sends that ID, so no access log needs to be read, and no race
decides, who owns a response or where it lives: the ID carries the pod, encrypted (clients learn
nothing of the fleet's addresses), and a tag over the tenant, so one tenant's ID never verifies
for another, and an ID changed in any character verifies for nobody (one spelling per ID: the
unpadded base64url of its bytes). It also carries a bound on the conversation the pod keeps under
it (the request's prompt, the history before it, and its output cap: known when the ID is
chosen), so that a follow-up reserves what that conversation can be, not the model's context.

Layout: "resp_" + base64url(nonce (16 random bytes) ‖ (tokens (4, big-endian) ‖ pod) XOR
keystream(nonce) ‖ tag (16)), the keystream BLAKE2b keyed and counted, the tag HMAC-SHA256 over
the tenant, the nonce and the ciphertext. Both keys are derived from the sessions' secret (the
same on every replica); the previous one's IDs still verify during a rotation.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
from dataclasses import dataclass

PREFIX = "resp_"
_NONCE = 16
_TAG = 16
_TOKENS = 4
MAX_TOKENS = (1 << 32) - 1
MAX_POD_BYTES = 512
_BLOCK = 64  # BLAKE2b's largest digest
_MAX_CHARS = len(PREFIX) + (_NONCE + _TOKENS + MAX_POD_BYTES + _TAG) * 4 // 3 + 4
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True, slots=True)
class Kept:
    """A stored response as its ID describes it: the pod that holds it, and the most tokens the
    conversation it continues can hold (history, prompt and output)."""

    pod: str
    tokens: int


class _Keys:
    def __init__(self, secret: bytes) -> None:
        self.enc = hmac.new(secret, b"llmgw-response-id-enc", "sha256").digest()
        self.mac = hmac.new(secret, b"llmgw-response-id-mac", "sha256").digest()

    def keystream(self, nonce: bytes, size: int) -> bytes:
        blocks = (
            hashlib.blake2b(nonce + bytes([i]), key=self.enc, digest_size=_BLOCK).digest()
            for i in range(-(-size // _BLOCK))
        )
        return b"".join(blocks)[:size]

    def tag(self, tenant: str, nonce: bytes, sealed: bytes) -> bytes:
        message = tenant.encode() + b"\0" + nonce + sealed
        return hmac.new(self.mac, message, "sha256").digest()[:_TAG]


class ResponseIds:
    def __init__(self, secret: bytes, previous: bytes | None = None) -> None:
        self._keys = _Keys(secret)
        self._previous = _Keys(previous) if previous is not None else None

    def mint(self, tenant: str, kept: Kept) -> str:
        """A new ID for a response of `tenant`'s, described by `kept`."""
        raw = min(kept.tokens, MAX_TOKENS).to_bytes(_TOKENS, "big") + kept.pod.encode()
        if len(raw) > _TOKENS + MAX_POD_BYTES:
            raise ValueError("pod address too long for a response ID")
        nonce = os.urandom(_NONCE)
        sealed = _xor(raw, self._keys.keystream(nonce, len(raw)))
        blob = nonce + sealed + self._keys.tag(tenant, nonce, sealed)
        return PREFIX + base64.urlsafe_b64encode(blob).rstrip(b"=").decode()

    def kept(self, tenant: str, response_id: str) -> Kept | None:
        """What `tenant`'s response `response_id` is; None: not an ID this gateway gave this
        tenant (another tenant's, changed, or made up)."""
        text = response_id[len(PREFIX) :]
        if (
            not response_id.startswith(PREFIX)
            or len(response_id) > _MAX_CHARS
            or not _BASE64URL.fullmatch(text)
        ):
            return None
        try:
            blob = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            return None
        if base64.urlsafe_b64encode(blob).rstrip(b"=").decode() != text:
            return None  # another spelling of the same bytes (unused low bits set)
        if len(blob) <= _NONCE + _TOKENS + _TAG:
            return None
        nonce, sealed, tag = blob[:_NONCE], blob[_NONCE:-_TAG], blob[-_TAG:]
        for keys in (self._keys, self._previous):
            if keys is not None and hmac.compare_digest(keys.tag(tenant, nonce, sealed), tag):
                raw = _xor(sealed, keys.keystream(nonce, len(sealed)))
                try:
                    pod = raw[_TOKENS:].decode()
                except UnicodeDecodeError:
                    return None
                return Kept(pod, int.from_bytes(raw[:_TOKENS], "big"))
        return None


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")
