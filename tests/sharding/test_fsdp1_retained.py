"""FSDP1 keeps each frozen unit's input gradient to the end of backward under a reentrant checkpoint
called around the unit (planner/sharding/fsdp1.py ``retained_input_gradients``): the bytes by hand,
and the real torch FSDP1 holding them on one CPU process (gloo, world size 1)."""

from __future__ import annotations

import functools

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.sharding.fsdp1 import retained_input_gradients

MISTRAL = "mistralai/Mistral-7B-v0.1"
LLAMA_70B = "meta-llama/Llama-2-70b-hf"
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
FP16 = 2  # the fp16 residual stream of these configurations


def _config(**changes) -> TrainConfig:
    fields = {"method": "lora", "precision": "fp16", "gpus": 2, "sharding": "fsdp1", "micro_batch": 2,
              "seq_len": 4096, "grad_ckpt": True, "attention": "flash", "lora_r": 16, "lora_targets": QKVO}
    return TrainConfig(**(fields | changes))


def test_mistral_lora_by_hand():
    """fms' 2-GPU Mistral-7B LoRA rows: 32 layers, hidden 4096, 2 sequences of 4096 tokens a rank, an
    fp16 residual stream: (32 - 2) x 2 x 4096 x 4096 x 2 B = 2,013,265,920 B (1.875 GiB), the
    30 gradients of layers 31..2 at layer 1's backward."""
    assert retained_input_gradients(resolve_model(MISTRAL), _config(), reentrant_around_unit=True, residual_bytes=FP16) == 2_013_265_920


def test_llama_70b_qlora_by_hand():
    """Llama-2-70B QLoRA without the k-bit upcast (16-bit stream): 80 layers, hidden 8192:
    78 x 2 x 4096 x 8192 x 2 B = 10,468,982,784 B (9.75 GiB; the row measured 10.07 GiB above the
    prediction)."""
    config = _config(method="qlora", precision="fp16-mixed", kbit_upcast=False)
    assert retained_input_gradients(resolve_model(LLAMA_70B), config, reentrant_around_unit=True, residual_bytes=FP16) == 10_468_982_784


@pytest.mark.parametrize("changes, around", [
    ({}, False),                          # transformers 5 / non-reentrant: the planner's own runs
    ({"grad_ckpt": False}, True),         # no checkpoint, no detached inputs
    ({"method": "full", "lora_r": None, "lora_targets": None}, True),  # trained flat parameters hook their AccumulateGrad
])
def test_none_without_the_reentrant_checkpoint_of_frozen_units(changes, around):
    assert retained_input_gradients(resolve_model(MISTRAL), _config(**changes), reentrant_around_unit=around, residual_bytes=FP16) == 0


def _stack(layers: int, hidden: int):
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Stack(nn.Module):
        """Frozen layers each checkpointed from the outside, as transformers 4's model loop does."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(layers))
            self.layers.requires_grad_(False)
            self.head = nn.Linear(hidden, 1, bias=False)

        def forward(self, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
            for layer in self.layers:
                x = checkpoint(layer.__call__, x, use_reentrant=reentrant)
            return self.head(x).sum()

    torch.manual_seed(0)
    return Stack()


def _peak(model, x, reentrant: bool) -> int:
    from workers.probes import CpuProbe

    probe = CpuProbe(allocator=False)
    probe.start()
    for step in range(2):
        if step:
            probe.reset_peak()
        model(x.clone().requires_grad_(True), reentrant).backward()
    probe.stop()
    return probe.peak_dispatch_bytes


@pytest.mark.parametrize("layers", [4, 8])
def test_real_fsdp1_holds_them(layers, monkeypatch):
    """One process, FSDP1 over gloo (world size 1: NO_SHARD, the same hooks): each frozen Linear its
    own unit, the input a leaf as transformers' enable_input_require_grads makes it. With the
    reentrant checkpoint the peak is (layers - 2) input-sized fp32 gradients higher over the same
    model without FSDP than with the non-reentrant one (4096 x 64 x 4 B = 1 MiB each: 2 MiB at 4
    layers, 6 at 8), what retained_input_gradients gives for that shape."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    from support.ranks import one_rank_group

    hidden, tokens = 64, 4096
    # an in-process run of another test in this process may have left its group of one rank: use it
    with one_rank_group(monkeypatch):
        assert dist.get_world_size() == 1
        x = torch.randn(tokens, hidden)
        excess = {}
        for reentrant in (True, False):
            plain = _peak(_stack(layers, hidden), x, reentrant)
            policy = functools.partial(lambda_auto_wrap_policy,
                                       lambda_fn=lambda m: isinstance(m, nn.Linear) and m.out_features == hidden)
            wrapped = FullyShardedDataParallel(_stack(layers, hidden), auto_wrap_policy=policy,
                                               sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
                                               device_id=torch.device("cpu"))
            excess[reentrant] = _peak(wrapped, x, reentrant) - plain
    model = type("Dims", (), {"num_layers": layers, "hidden_size": hidden})()
    config = _config(precision="fp32", attention="sdpa", micro_batch=1, seq_len=tokens)
    retained = retained_input_gradients(model, config, reentrant_around_unit=True, residual_bytes=4)
    assert retained == (layers - 2) * 2**20
    # beside them the moment holds 512 B more (the head's 64 fp32 weights' gradient and the like),
    # at 4 layers and at 8: nothing that grows with the layers or the tokens
    assert 0 <= excess[True] - retained <= 1024
    assert excess[False] == 0


def test_the_estimate_holds_them_at_the_last_blocks_backward():
    """``reentrant_ckpt`` (transformers 4's checkpoint) puts the retained gradients into the moments of the
    last block's backward (which stand at the first layer's backward, planner/memory/step.py ``retention``),
    under their own key, in the breakdown and in the search's sums alike: the 31 of layers 32..2, each
    2 x 4096 x 4096 x 2 B = 67,108,864 B, one of them the block's incoming gradient, which the block's
    own terms then leave out: 30 x 67,108,864 = 2,013,265,920 B more than without. FSDP2, full
    fine-tuning and the default add nothing. The estimate's peak moves there: the forward's end (where
    the default peaks) is lower than that moment with 1.875 GiB more."""
    from planner.gpus import get_gpu
    from planner.memory import estimate_memory
    from planner.memory.step import RETAINED_KEY, batch_moments, batch_terms, batch_totals

    model, gpu = resolve_model(MISTRAL), get_gpu("a100-80gb")
    kernels = gpu.kernels
    on, off = _config(reentrant_ckpt=True), _config()
    held, without = batch_terms(model, on, kernels), batch_terms(model, off, kernels)
    assert held.retained == 31 * 67_108_864
    assert sum(held.block_backward.values()) + held.retained - sum(without.block_backward.values()) == 2_013_265_920
    assert batch_totals(model, on, kernels) == batch_moments(held.sizes())
    for other in (off, _config(reentrant_ckpt=True, sharding="fsdp2", precision="bf16"),
                  _config(reentrant_ckpt=True, method="full", lora_r=None, lora_targets=None)):
        terms = batch_terms(model, other, kernels)
        assert RETAINED_KEY not in terms.block_backward and not terms.retained and not terms.retained_end
    with_them, plain = (estimate_memory(model=model, config=c, gpu=gpu) for c in (on, off))
    assert with_them.peak_phase == "first_block_backward" and plain.peak_phase != "first_block_backward"
    assert with_them.peak_allocated_bytes > plain.peak_allocated_bytes
    assert with_them.breakdown[RETAINED_KEY] == 31 * 67_108_864


def test_the_setting_is_written_only_where_set_and_keys_its_own_batch_line():
    from planner.memory.step import line_reads

    assert "reentrant_ckpt" not in _config().to_dict()
    payload = _config(reentrant_ckpt=True).to_dict()
    assert payload["reentrant_ckpt"] is True and payload["version"] == 3
    assert TrainConfig.from_dict(payload).reentrant_ckpt is True
    assert "reentrant ckpt" in _config(reentrant_ckpt=True).label()
    # FSDP1 keeps them and FSDP2 does not: their memory terms are otherwise one (memory_twin), so the
    # search's batch key tells the two apart where the setting is on
    fsdp1 = _config(reentrant_ckpt=True, precision="bf16")
    assert line_reads(fsdp1) != line_reads(fsdp1.replace(sharding="fsdp2"))
    assert line_reads(_config(precision="bf16")) == line_reads(_config(precision="bf16", sharding="fsdp2"))


def test_an_encoder_decoder_is_refused_with_it():
    """``retention`` counts one stack's layers: an encoder-decoder would get no term, so it is refused."""
    from planner.errors import InvalidConfigError
    from planner.request import check_for_model

    with pytest.raises(InvalidConfigError, match="--reentrant-ckpt is not modelled for an encoder-decoder"):
        check_for_model(model_id="t5-large", is_encoder=False, is_encoder_decoder=True, values={"reentrant_ckpt": True})
    check_for_model(model_id="m", is_encoder=False, is_encoder_decoder=False, values={"reentrant_ckpt": True})


def test_emit_refuses_it_with_its_own_fix():
    """The emitted run is transformers 5's: the HF Trainer has no reentrant_ckpt; beside torchtune's settings
    each gets its own fix (the message once named both torchtune's)."""
    from planner.emit.settings import training_arguments
    from planner.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=r"^the HF Trainer has no reentrant_ckpt \(reentrant_ckpt is "
                                               r"transformers 4's checkpoint.*: plan without it\)$"):
        training_arguments(_config(reentrant_ckpt=True), on_cpu=True)
    both = TrainConfig(optimizer_in_bwd=True, reentrant_ckpt=True)
    with pytest.raises(UnsupportedError, match=r"no optimizer_in_bwd, reentrant_ckpt \(reentrant_ckpt is .*; "
                                               r"torchtune's recipe settings: emit --for torchtune"):
        training_arguments(both, on_cpu=True)
