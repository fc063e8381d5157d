"""Secret settings that are not secret are refused at load: a placeholder left from an example
(deploy/k8s/examples/secrets.yaml) or a value anyone could guess. The messages never show it."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, SecretStr

# Words of the placeholders in examples and docs, ours and others' (lowercase).
PLACEHOLDER_WORDS = ("change-me", "changeme", "change_me", "replace", "example", "placeholder")
# `openssl rand -hex 16` has all but a few of the 16 hex digits; "aaaa…" or "abab…" has two.
MIN_DISTINCT = 8
HOW = "generate one, e.g. `openssl rand -hex 32`"


def _refuse_weak(secret: SecretStr) -> SecretStr:
    value = secret.get_secret_value()
    lowered = value.lower()
    word = next((w for w in PLACEHOLDER_WORDS if w in lowered), None)
    if word is not None:
        raise ValueError(f"a placeholder (it contains {word!r}), not a secret: {HOW}")
    # A repeated pattern: the value is found inside itself doubled, short of both ends.
    if len(set(value)) < MIN_DISTINCT or value in (value + value)[1:-1]:
        raise ValueError(
            f"too little variety (under {MIN_DISTINCT} distinct characters, or one pattern "
            f"repeated) to be a secret: {HOW}"
        )
    return secret


Secret = Annotated[SecretStr, AfterValidator(_refuse_weak)]
