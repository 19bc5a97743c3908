"""The optimizer registry (planner.optim): every descriptor is whole, real and read by name.

Each descriptor is checked against the libraries it names: its HF ``optim`` name is one the
installed transformers accepts, its worker construction builds a real optimizer on the CPU whose
states after one step are the bytes its memory model counts, and the configuration, the help and
the API list exactly the registered names.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from planner.config import TrainConfig
from planner.errors import InvalidConfigError, UnsupportedError
from planner.optim import OPTIMIZERS, SEARCHED, SPECS, Optimizer, names, optimizer_state_bytes
from planner.optim.spec import OptimizerModel

ALL = [s.name for s in SPECS]


def test_the_registry_is_every_descriptor_once_in_preference_order():
    assert len(set(ALL)) == len(ALL)
    assert [str(o) for o in Optimizer] == ALL
    assert [s.preference for s in SPECS] == sorted(s.preference for s in SPECS)
    for name in ALL:
        member = Optimizer(name)
        assert member == name and OPTIMIZERS[member] is OPTIMIZERS[name] and OPTIMIZERS[name].name == name
        assert isinstance(OPTIMIZERS[name].memory, OptimizerModel)
    assert set(SEARCHED) <= set(Optimizer) and SEARCHED[0] is Optimizer.ADAMW_FUSED
    assert names() == "|".join(ALL)


def test_the_optimizers_of_the_first_release_keep_their_order_and_places():
    # the search space, the ranking's tie-breaker and the stored names: planned answers depend on them;
    # the fused AdamW (2026-11-27) took AdamW's place in the search, the path torch picks unasked is
    # planned when named
    assert ALL[:6] == ["adamw", "adamw_fused", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd"]
    assert [OPTIMIZERS[n].preference for n in ALL[:6]] == [0, 0, 1, 2, 3, 4]
    assert SEARCHED[:5] == tuple(Optimizer(n) for n in ALL[1:6])


@pytest.mark.parametrize("name", ALL)
def test_each_descriptor_names_what_hf_and_deepspeed_take(name):
    from transformers import TrainingArguments
    from transformers.training_args import OptimizerNames

    spec = OPTIMIZERS[name]
    # a name the installed transformers no longer takes is said so (emit refuses it: test_optim_adamw_hf.py)
    assert (spec.hf_optim in {o.value for o in OptimizerNames}) == (spec.hf_removed is None)
    fields = set(TrainingArguments.__dataclass_fields__)
    assert set(spec.hf_args) <= fields, set(spec.hf_args) - fields
    if spec.paged:
        assert spec.unpaged in OPTIMIZERS and not OPTIMIZERS[spec.unpaged].paged
    else:
        assert spec.unpaged is None
    if spec.deepspeed_offload:  # DeepSpeed offloads only an optimizer it builds itself
        assert spec.deepspeed_section is not None
    if spec.library:
        import importlib.util

        assert importlib.util.find_spec(spec.library) is not None
    assert spec.words and spec.preference >= 0
    assert (spec.note is None) == (spec.preference == 0)  # every alternative to AdamW says its trade-off


def _built_state_bytes(name: str, shapes, *, dtype=None):
    """Bytes of the per-tensor states the worker's optimizer holds after one CPU step, and the
    element counts of the tensors it stepped."""
    import torch

    params = [torch.nn.Parameter(torch.randn(*shape, dtype=dtype or torch.float32)) for shape in shapes]
    optimizer = OPTIMIZERS[name].build(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    total = 0
    for p in params:
        for key, value in optimizer.state[p].items():
            # bitsandbytes' quantisation maps (qmap1/qmap2) are one 256-entry code book shared by
            # every tensor (Optimizer8bit.fill_qmap), not a per-tensor state
            if torch.is_tensor(value) and not key.startswith("qmap"):
                # Adafactor's per-tensor RMS is a 0-dim fp32 scalar the model does not count (4 B)
                if not (key == "RMS" and value.dim() == 0):
                    total += value.numel() * value.element_size()
    return total, [p.numel() for p in params]


@pytest.mark.parametrize("name", ALL)
def test_the_memory_model_counts_the_states_the_worker_builds(name):
    # a 2-D tensor over bitsandbytes' 8-bit threshold (4,096), a small one under it and a bias;
    # Adafactor's flat rule (rows + cols = 2 sqrt(n)) is exact for square weights
    shapes = [(64, 64), (32, 32)] if name == "adafactor" else [(64, 100), (40, 40), (100,)]
    real, sizes = _built_state_bytes(name, shapes)
    assert real == OPTIMIZERS[name].memory.state_bytes(sizes, 4) == optimizer_state_bytes(
        sizes=sizes, optimizer=name, param_bytes=4)


@pytest.mark.parametrize("name", ALL)
def test_every_registered_name_is_a_configuration(name):
    config = TrainConfig(optimizer=name)
    assert config.optimizer is Optimizer(name)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert TrainConfig.from_dict({"optimizer": name}).optimizer is Optimizer(name)  # a stored payload


def test_an_unknown_optimizer_is_told_with_every_name():
    with pytest.raises(InvalidConfigError) as err:
        TrainConfig(optimizer="adam")
    assert str(err.value) == f"--optimizer must be one of {names()}, got 'adam'"


@pytest.mark.parametrize("name", ALL)
def test_deepspeed_takes_what_each_descriptor_says(name):
    spec = OPTIMIZERS[name]
    if spec.paged:
        with pytest.raises(UnsupportedError, match=f"use {spec.unpaged}$"):
            TrainConfig(optimizer=name, zero=1)
        return
    TrainConfig(optimizer=name, zero=2)
    if spec.deepspeed_offload:
        TrainConfig(optimizer=name, zero=2, offload="optimizer")
    else:
        with pytest.raises(UnsupportedError, match=r"use --optimizer adamw\|adamw_fused$"):
            TrainConfig(optimizer=name, zero=2, offload="optimizer")


def test_the_registry_loads_no_library():
    code = ("import sys, planner.optim, planner.config; "
            "print(sorted(m for m in ('torch', 'bitsandbytes', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
