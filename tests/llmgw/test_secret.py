"""Secret settings refuse placeholders and guessable values at load, without showing them."""

from __future__ import annotations

import secrets

import pytest

from extauthz.settings import Settings as ExtauthzSettings
from ledger.settings import Settings as LedgerSettings
from llmgw import config
from ratelimit.settings import Settings as RatelimitSettings

WEAK = [
    ("CHANGE-ME-to-a-long-random-string-of-64-chars-0123456789", "placeholder"),
    ("my-example-session-secret-for-the-gateway-1234567", "placeholder"),
    ("Placeholder_session_secret_value_0123456789_abcdefgh", "placeholder"),
    ("REPLACE-WITH-64-HEX-CHARACTERS-FROM-openssl-rand-hex-32-REPLACE", "placeholder"),
    ("a" * 64, "variety"),
    ("abababababababababababababababababab", "variety"),
    ("0123456789abcdef" * 4, "variety"),  # every hex digit, but one pattern repeated
]


def extauthz(secret: str) -> ExtauthzSettings:
    env = {"LLMGW_EXTAUTHZ__SESSIONS__SECRET": secret}
    return config.load(ExtauthzSettings, None, "LLMGW_EXTAUTHZ", env)


@pytest.mark.parametrize(("secret", "why"), WEAK)
def test_weak_session_secrets_are_refused_without_being_shown(secret: str, why: str) -> None:
    with pytest.raises(config.ConfigError, match=why) as refused:
        extauthz(secret)
    assert "sessions.secret" in str(refused.value)
    assert secret not in str(refused.value)


def test_generated_secrets_are_accepted() -> None:
    for _ in range(20):
        assert extauthz(secrets.token_hex(32)).sessions.secret.get_secret_value()
        assert extauthz(secrets.token_urlsafe(32)).sessions.secret.get_secret_value()


def test_redis_passwords_and_alert_secrets_are_checked_too() -> None:
    weak = "changeme-changeme"
    with pytest.raises(config.ConfigError, match=r"redis\.password: .*placeholder"):
        config.load(LedgerSettings, None, "LLMGW_LEDGER", {"LLMGW_LEDGER__REDIS__PASSWORD": weak})
    with pytest.raises(config.ConfigError, match=r"alerts\.secret: .*placeholder"):
        config.load(LedgerSettings, None, "LLMGW_LEDGER", {"LLMGW_LEDGER__ALERTS__SECRET": weak})
    env = {"LLMGW_RATELIMIT__REDIS__PASSWORD": "x" * 32}
    with pytest.raises(config.ConfigError, match=r"redis\.password: .*variety"):
        config.load(RatelimitSettings, None, "LLMGW_RATELIMIT", env)
