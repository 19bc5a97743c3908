"""The trade-off lines under a suggestion say what a plan's choice saves and costs in words that read
right whichever way the numbers go (planner/cli/suggest_view.py ``_trade``)."""

from planner.cli.suggest_view import _trade
from planner.units import GiB


def test_a_choice_that_saves_memory_and_costs_time():
    # the plan steps in 1.06 s where the usual choice steps in 1.00 s: 6% slower
    assert _trade(2 * GiB, 1.06 / 1.00 - 1) == "saves 2 GiB, costs 6% step time"


def test_a_choice_that_saves_memory_and_is_faster_says_faster():
    # adamw_8bit against adamw_fused on a B200: 22.2 GiB less and 1% faster ("costs -1% step time" before)
    assert _trade(int(22.2 * GiB), 0.99 / 1.00 - 1) == "saves 22.2 GiB, 1% faster"


def test_a_choice_that_takes_memory_and_under_half_a_percent_is_the_same_time():
    assert _trade(-GiB // 2, 0.004) == "takes 512 MiB more, the same step time"
