from __future__ import annotations

import base64

import pytest

from extauthz.responseids import PREFIX, ResponseIds

SECRET = b"s" * 16 + b"0123456789abcdef"
POD = "10.0.3.7:8000"


def test_an_id_names_its_pod_for_its_tenant_only() -> None:
    ids = ResponseIds(SECRET)
    minted = ids.mint("acme", POD)
    assert minted.startswith(PREFIX) and ids.pod("acme", minted) == POD
    assert ids.pod("globex", minted) is None  # another tenant's
    assert ids.pod("acme", minted) == POD  # verifying twice: no state
    assert ids.mint("acme", POD) != minted  # each response its own ID


def test_the_pod_is_not_readable_in_the_id() -> None:
    minted = ResponseIds(SECRET).mint("acme", POD)
    text = minted[len(PREFIX) :]
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    assert POD.encode() not in raw and b"acme" not in raw
    assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def test_an_id_changed_anywhere_verifies_for_nobody() -> None:
    ids = ResponseIds(SECRET)
    minted = ids.mint("acme", POD)
    text = minted[len(PREFIX) :]
    raw = bytearray(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    for i in range(len(raw)):
        for bit in (1, 0x80):
            changed = bytearray(raw)
            changed[i] ^= bit
            forged = PREFIX + base64.urlsafe_b64encode(bytes(changed)).rstrip(b"=").decode()
            assert ids.pod("acme", forged) is None
    # Cut short, made longer, another key's, or no ID of ours at all.
    for forged in (minted[:-1], minted + "A", ResponseIds(b"k" * 32).mint("acme", POD)):
        assert ids.pod("acme", forged) is None
    for junk in ("", "resp_", "resp_!!!", "resp_" + "A" * 10_000, "chatcmpl-1", "resp_" + "A" * 44):
        assert ids.pod("acme", junk) is None


def test_a_rotated_secret_still_reads_the_ids_of_the_previous_one() -> None:
    old = ResponseIds(SECRET).mint("acme", POD)
    rotated = ResponseIds(b"n" * 16 + b"fedcba9876543210", previous=SECRET)
    assert rotated.pod("acme", old) == POD
    assert rotated.pod("globex", old) is None


@pytest.mark.parametrize("pod", ["a:1", "vllm-12.vllm.inference.svc.cluster.local:8000", "h" * 300])
def test_pods_of_any_length_round_trip(pod: str) -> None:
    ids = ResponseIds(SECRET)
    assert ids.pod("t", ids.mint("t", pod)) == pod
