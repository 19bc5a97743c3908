"""``--rope-scaling`` refused in one line where the context limit is computed (``planner.config.context_limit``),
rather than planned and then trained unscaled or wrongly scaled; a too-long --seq-len is then not told to reach for it.
Gemma 4: its full-attention layers' rotary type is transformers 5.24's "proportional" (configuration_gemma4.py
l.201-203), which none of the scaling types keeps and no published recipe extends. A model whose config.json already
scales its RoPE (Llama 3.1: llama3 x8 from 8192; Gemma 3 4B+: linear x8 on its full-attention layers): the merge
train.py and the worker make (transformers' own, configuration_gemma3.py l.143) would replace that scaling with the
requested one, e.g. x8 -> x2, shrinking the interpolation the model was trained with. Gemma 3 1B (per-layer-type
rope, no scaling of its own) keeps the knob: 32768 x 2."""

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


@pytest.mark.parametrize("model, has, table", [("meta-llama/Llama-3.1-8B", "llama3 x8", 131072),
                                               ("google/gemma-3-4b-it", "linear x8", 131072)])
def test_a_model_already_scaled_by_its_config_refuses_a_second_scaling(cli, model, has, table):
    spec = resolve_model(model)
    with pytest.raises(InvalidConfigError) as error:
        context_limit(spec, {"rope_scaling": "2"})
    assert str(error.value) == (f"--rope-scaling would replace the RoPE scaling {model}'s config already has ({has}), "
                                f"not extend it (no rule composes two): drop --rope-scaling (at most {table} tokens)")
    assert context_limit(spec) == table
    r = cli("estimate", "-m", model, "-g", "h100-80gb", "--method", "qlora", "--seq-len", "4096", "--rope-scaling", "yarn:2")
    assert_user_error(r, "would replace the RoPE scaling", f"({has})")
