"""FSDP1's gathers in backward under a reentrant checkpoint called around each unit (transformers 4's model
loop, fms-acceleration's 2-GPU runs): no unit is prefetched for the next layer, each is gathered twice on demand.

Why it matters (bench/published_rows.json ``allocator_reserved_growth``, issue 25): BACKWARD_PRE's prefetch
(torch fsdp/_runtime_utils.py ``_get_handle_to_prefetch``) takes a target only if its
``_needs_pre_backward_unshard`` is set, which ``_register_pre_backward_hooks`` sets only when the unit's forward
ran with gradients; the checkpointed forward runs without, so before the checkpoint's recompute no unit is a
target. Each layer's backward then gathers it in the recompute's pre-forward, frees it in its post-forward, and
gathers it again in the pre-backward hook: at most two of a layer's gathered blocks in the unshard stream's pool
(the one just freed, recorded on the compute stream, and the new one), never a third for a prefetched next layer.
"""

from __future__ import annotations

import functools

import pytest


def _model(layers: int, hidden: int):
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Layer(nn.Module):
        """A frozen linear with a trained adapter unit inside, as peft's policy wraps a LoRA layer."""

        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(hidden, hidden, bias=False).requires_grad_(False)
            self.adapter = nn.Linear(hidden, hidden, bias=False)

        def forward(self, x):
            return self.base(x) + self.adapter(x)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.head = nn.Linear(hidden, 1, bias=False).requires_grad_(False)

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer.__call__, x, use_reentrant=True)
            return self.head(x).sum()

    torch.manual_seed(0)
    return Stack()


@pytest.mark.parametrize("layers", [3])
def test_backward_gathers_each_layer_twice_on_demand_and_prefetches_none(layers, monkeypatch):
    import torch
    import torch.distributed.fsdp._runtime_utils as runtime
    from torch import nn
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    from support.ranks import one_rank_group

    with one_rank_group(monkeypatch):
        model = _model(layers, 16)
        units = {id(layer): f"layer{k}" for k, layer in enumerate(model.layers)}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in units or (
            isinstance(m, nn.Linear) and m.weight.requires_grad))
        engine = FullyShardedDataParallel(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                                          backward_prefetch=BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True,
                                          use_orig_params=False, device_id=torch.device("cpu"))
        names = {id(m._handle): units[id(m.module)] for m in engine.modules()
                 if isinstance(m, FullyShardedDataParallel) and id(m.module) in units}
        log: list[tuple[str, str]] = []
        phase = ["forward"]
        unshard = runtime._unshard

        def logged(state, handle, *args, **kwargs):
            if handle is not None and id(handle) in names:
                log.append((phase[0], names[id(handle)]))
            return unshard(state, handle, *args, **kwargs)

        monkeypatch.setattr(runtime, "_unshard", logged)
        x = torch.randn(8, 16, requires_grad=True)
        for _ in range(2):  # the second step: the execution order recorded in the first
            log.clear()
            phase[0] = "forward"
            loss = engine(x)
            phase[0] = "backward"
            loss.backward()
    backward = [name for when, name in log if when == "backward"]
    # last layer first, each twice in a row (the recompute's gather, then the pre-backward hook's): a prefetch of
    # the next layer would put its name between
    assert backward == [f"layer{k}" for k in reversed(range(layers)) for _ in range(2)]
    assert [name for when, name in log if when == "forward"] == [f"layer{k}" for k in range(layers)]
