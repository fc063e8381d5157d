"""The price table: costs exact in micro-units, rounded once; validated like the rest of the
tier table."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from llmgw.config import ConfigError
from llmgw.prices import MAX_COST_MICROS, MAX_PRICE, ModelPrice, Prices, amount
from llmgw.tiers import load_tiers

LLAMA = ModelPrice(input=Decimal("0.10"), cached_input=Decimal("0.05"), output=Decimal("0.40"))


def test_a_cost_is_tokens_times_the_price_per_million_in_micro_units() -> None:
    assert LLAMA.cost_micros(1_000_000, 0, 0) == 100_000  # $0.10
    assert LLAMA.cost_micros(0, 0, 1_000_000) == 400_000
    # Cached prompt tokens at the cached price; never more cached than the prompt.
    assert LLAMA.cost_micros(1000, 400, 10) == 60 + 20 + 4  # 600 × 0.10 + 400 × 0.05 + 10 × 0.40
    assert LLAMA.cost_micros(10, 99, 0) == LLAMA.cost_micros(10, 10, 0) == 1  # 0.5, half up
    assert amount(LLAMA.cost_micros(123_456, 0, 7)) == Decimal("0.012348")  # 12,348.4 micro-units


def test_a_cost_is_rounded_once_half_up_not_per_kind() -> None:
    """Per kind, 0.4 + 0.4 would round to 0; the sum, 0.8, is 1."""
    price = ModelPrice(input=Decimal("0.4"), output=Decimal("0.4"))
    assert price.cost_micros(1, 0, 1) == 1
    assert ModelPrice(input=Decimal("0.5"), output=Decimal(0)).cost_micros(1, 0, 0) == 1
    assert ModelPrice(input=Decimal("0.49"), output=Decimal(0)).cost_micros(1, 0, 0) == 0
    # Without a cached price, cached tokens cost the input price.
    assert price.cost_micros(10, 10, 0) == 4


def test_no_request_costs_more_than_the_ledger_can_store() -> None:
    """The highest price on the most tokens a reservation holds still fits a 64-bit column."""
    dearest = ModelPrice(input=MAX_PRICE, output=MAX_PRICE)
    assert dearest.cost_micros(10**15, 0, 10**15) == MAX_COST_MICROS == 2**63 - 1


def test_a_model_not_listed_takes_the_default_or_is_unpriced() -> None:
    assert Prices(models={"m": LLAMA}).of("other") is None
    fallback = ModelPrice(input=Decimal(1), output=Decimal(2))
    assert Prices(models={"m": LLAMA}, default=fallback).of("other") == fallback
    assert Prices(models={"m": LLAMA}, default=fallback).of("m") == LLAMA


def test_the_tier_tables_prices_section(tmp_path: Path) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "prices:\n  currency: EUR\n  models:\n"
        "    llama: {input: 0.10, cached_input: 0.05, output: 0.40}\n"
    )
    prices = load_tiers(path).prices
    assert prices.currency == "EUR" and prices.of("llama") == LLAMA
    assert load_tiers(None).prices == Prices()  # none: every model unpriced


@pytest.mark.parametrize(
    "section",
    [
        "{currency: dollars}",
        "{models: {m: {input: -1, output: 1}}}",
        "{models: {m: {input: .nan, output: 1}}}",
        "{models: {m: {input: 1}}}",
        "{models: {m: {input: 1, output: 1, cashed_input: 1}}}",
        "{models: {m: {input: 1e20, output: 1}}}",  # beyond any price: a typo
        "{models: {m: {input: '1e999999', output: 1}}}",
    ],
)
def test_a_bad_price_table_is_refused_naming_the_key(tmp_path: Path, section: str) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(f"prices: {section}\n")
    with pytest.raises(ConfigError, match="prices"):
        load_tiers(path)
