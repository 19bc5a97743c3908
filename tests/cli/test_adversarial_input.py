"""Input a demanding new user sends that the fuzz grammar does not: each one line naming what is
wrong and the fix (exit 2), never a traceback, never an empty answer read as a result."""

from __future__ import annotations

import pytest
from support.cli import assert_user_error, write_config


@pytest.fixture
def tiny(tmp_path):
    return write_config(tmp_path / "tiny")


@pytest.mark.parametrize("epochs, tokens", [("1e300", "1e16"), ("1e10", "1e16")])
def test_epochs_times_the_epoch_tokens_past_the_bound_is_one_line_naming_both(cli, tiny, epochs, tokens):
    # 1e300 x 1e16 overflowed round() (OverflowError); 1e10 x 1e16 blamed a --tokens never given
    assert_user_error(cli("suggest", "-m", tiny, "-b", "8", "--gpu", "a10g,l4", "--epochs", epochs,
                          "--dataset-tokens", tokens), "--epochs", "more than 1e16")


def test_an_empty_gpu_list_is_refused_not_answered_with_no_option(tiny):
    from planner.errors import InvalidConfigError
    from planner.planning import SuggestRequest
    from planner.pricing import load_prices
    from planner.rent import compare_gpus, workload

    with pytest.raises(InvalidConfigError, match="no GPU type to compare"):
        compare_gpus(SuggestRequest(model=str(tiny), gpu="any", target_batch=8), workload=workload(),
                     prices=load_prices(), gpu_names=[])
