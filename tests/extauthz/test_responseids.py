from __future__ import annotations

import base64

import pytest

from extauthz.__main__ import response_ids
from extauthz.responseids import PREFIX, Kept, ResponseIds
from extauthz.settings import SessionSettings, Settings

SECRET = b"s" * 16 + b"0123456789abcdef"
POD = "10.0.3.7:8000"
KEPT = Kept(POD, 5_000)


def test_an_id_names_its_pod_for_its_tenant_only() -> None:
    ids = ResponseIds(SECRET)
    minted = ids.mint("acme", KEPT)
    assert minted.startswith(PREFIX) and ids.kept("acme", minted) == KEPT
    assert ids.kept("globex", minted) is None  # another tenant's
    assert ids.kept("acme", minted) == KEPT  # verifying twice: no state
    assert ids.mint("acme", KEPT) != minted  # each response its own ID


def test_the_pod_is_not_readable_in_the_id() -> None:
    minted = ResponseIds(SECRET).mint("acme", KEPT)
    text = minted[len(PREFIX) :]
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    assert POD.encode() not in raw and b"acme" not in raw
    assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def test_an_id_changed_anywhere_verifies_for_nobody() -> None:
    ids = ResponseIds(SECRET)
    minted = ids.mint("acme", KEPT)
    text = minted[len(PREFIX) :]
    raw = bytearray(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    for i in range(len(raw)):
        for bit in (1, 0x80):
            changed = bytearray(raw)
            changed[i] ^= bit
            forged = PREFIX + base64.urlsafe_b64encode(bytes(changed)).rstrip(b"=").decode()
            assert ids.kept("acme", forged) is None
    # Cut short, made longer, another key's, or no ID of ours at all.
    for forged in (minted[:-1], minted + "A", ResponseIds(b"k" * 32).mint("acme", KEPT)):
        assert ids.kept("acme", forged) is None
    for junk in ("", "resp_", "resp_!!!", "resp_" + "A" * 10_000, "chatcmpl-1", "resp_" + "A" * 44):
        assert ids.kept("acme", junk) is None


def test_a_rotated_secret_still_reads_the_ids_of_the_previous_one() -> None:
    old = ResponseIds(SECRET).mint("acme", KEPT)
    rotated = ResponseIds(b"n" * 16 + b"fedcba9876543210", previous=SECRET)
    assert rotated.kept("acme", old) == KEPT
    assert rotated.kept("globex", old) is None


@pytest.mark.parametrize("pod", ["a:1", "vllm-12.vllm.inference.svc.cluster.local:8000", "h" * 300])
def test_pods_of_any_length_round_trip(pod: str) -> None:
    ids = ResponseIds(SECRET)
    kept = Kept(pod, 2**32 - 1)
    assert ids.kept("t", ids.mint("t", kept)) == kept


def test_an_id_has_one_spelling() -> None:
    """Padding, unused low bits set, or anything past the alphabet: another string for the same
    bytes is no ID of this gateway's, refused before any pod is asked."""
    ids = ResponseIds(SECRET)
    minted = ids.mint("acme", KEPT)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    others = {minted[:-1] + c for c in alphabet} - {minted}
    for spelling in (
        *others,
        minted + "==",
        minted + "=",
        minted + "\n",
        minted + "%",
        minted + ".",
    ):
        assert ids.kept("acme", spelling) is None, spelling


def test_extauthz_reads_the_ids_of_its_previous_session_secret() -> None:
    """The composition root gives the IDs the sessions' rotation: an ID minted under the old
    secret is still read while it is `previous_secret` (else a rotation loses every response)."""
    old, new = "9f2c41e8a7b3d6055f1e2a9c0b7d64e3", "5b0e93c17fa2d84e6c1b05f9a3e7d20c"
    before = response_ids(Settings(sessions=SessionSettings(secret=old)))  # type: ignore[arg-type]
    during = response_ids(
        Settings(sessions=SessionSettings(secret=new, previous_secret=old))  # type: ignore[arg-type]
    )
    after = response_ids(Settings(sessions=SessionSettings(secret=new)))  # type: ignore[arg-type]
    minted = before.mint("acme", KEPT)
    assert during.kept("acme", minted) == KEPT
    assert after.kept("acme", minted) is None
