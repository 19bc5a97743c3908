"""fp8 in the search: in the space on GPUs with FP8 tensor cores only, for full fine-tuning only; refused
in one line where asked for on a GPU without; never ranked first by a speed tie (ranking.PRECISION_PREFERENCE);
each fp8 plan carries its trade-off note."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import Method, Precision
from planner.errors import InvalidConfigError
from planner.gpus import fp8_gpus, get_gpu
from planner.ranking import PRECISION_PREFERENCE, suggest
from planner.search import SearchSpace, enumerate_configs
from planner.tradeoffs import FP8_NOTE, trade_offs


@pytest.fixture(scope="module")
def llama1b():
    return resolve_model("meta-llama/Llama-3.2-1B")


@pytest.mark.parametrize("gpu", ["h100-80gb", "l4", "rtx4090", "a100-80gb", "a10g", "t4"])
def test_fp8_is_in_the_space_where_the_gpu_has_fp8(llama1b, gpu):
    device = get_gpu(gpu)
    configs = list(enumerate_configs(model=llama1b, gpu=device, target_batch=4, seq_len=256, gpus=1,
                                     space=SearchSpace()))
    fp8 = [c for c in configs if c.precision is Precision.FP8]
    assert bool(fp8) == (gpu in fp8_gpus())
    # full fine-tuning, no DeepSpeed: the combinations it is planned with
    assert all(c.method is Method.FULL and c.sharding.spec.replicas for c in fp8)


def test_fp8_asked_for_on_a_gpu_without_it_is_refused_in_one_line(llama1b):
    with pytest.raises(InvalidConfigError) as exc:
        suggest(model=llama1b, gpu=get_gpu("a100-80gb"), target_batch=8, seq_len=512,
                space=SearchSpace(precisions=(Precision.FP8,)))
    assert str(exc.value).startswith("--precision fp8: NVIDIA A100-SXM4-80GB has no FP8 tensor cores")
    assert "\n" not in str(exc.value) and "h100-80gb" in str(exc.value)


def test_a_speed_tie_goes_to_the_other_precisions():
    assert PRECISION_PREFERENCE[Precision.FP8] == max(PRECISION_PREFERENCE.values())
    assert set(PRECISION_PREFERENCE) == set(Precision)


def test_fp8_plans_on_h100_carry_their_note_and_eager_fp8_is_not_first(llama1b):
    h100 = get_gpu("h100-80gb")
    only = suggest(model=llama1b, gpu=h100, target_batch=32, seq_len=2048, space=SearchSpace(precisions=(Precision.FP8,)),
                   alternative=False)
    assert only.plans and all(p.config.precision is Precision.FP8 for p in only.plans)
    assert all(FP8_NOTE in trade_offs(p.config, p.memory, capacity=h100.memory_bytes) for p in only.plans)
    # eager fp8 is predicted slower than bf16-mixed here (tests/throughput/test_fp8_throughput.py): the default
    # search, which has it, ranks bf16-mixed first
    default = suggest(model=llama1b, gpu=h100, target_batch=32, seq_len=2048, alternative=False)
    assert default.plans[0].config.precision is Precision.BF16_MIXED
    assert default.plans[0].throughput.tokens_per_s > only.plans[0].throughput.tokens_per_s
