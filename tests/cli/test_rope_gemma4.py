"""``--rope-scaling`` on Gemma 4: its full-attention layers' rotary type is transformers 5.24's "proportional"
(configuration_gemma4.py l.201-203), which none of the scaling types keeps and no published recipe extends, so the
request is refused in one line where the context limit is computed (``planner.config.context_limit``), rather than
planned and then trained unscaled; and a too-long --seq-len is not told to reach for it. Gemma 3 (per-layer-type
rope, default type) keeps the knob: 32768 x 2."""

from __future__ import annotations

import pytest
from support.cli import assert_user_error

from planner.catalog import resolve_model
from planner.config import check_context, context_limit
from planner.errors import InvalidConfigError

GEMMA4 = "google/gemma-4-26B-A4B"  # max_position_embeddings 262144


def test_gemma4_refuses_the_scaling_in_one_line_naming_its_rope():
    spec = resolve_model(GEMMA4)
    with pytest.raises(InvalidConfigError, match=r"^--rope-scaling has no rule for google/gemma-4-26B-A4B's "
                                                 r"\"proportional\" RoPE .*: drop --rope-scaling \(at most 262144 tokens\)$"):
        context_limit(spec, {"rope_scaling": "yarn:2"})
    assert context_limit(spec) == 262144  # without the knob: its table, as before
    with pytest.raises(InvalidConfigError) as error:
        check_context(spec, 262145)
    assert str(error.value).endswith("use at most 262144")  # no "--rope-scaling 2" hint


def test_gemma4_s_refusal_through_the_cli(cli):
    r = cli("estimate", "-m", GEMMA4, "-g", "h100-80gb", "--method", "qlora", "--seq-len", "4096", "--rope-scaling", "2")
    assert_user_error(r, "--rope-scaling has no rule for", "drop --rope-scaling")


def test_gemma3_keeps_the_scaling():
    assert context_limit(resolve_model("google/gemma-3-1b-it"), {"rope_scaling": "2"}) == 65536  # 32768 x 2
