"""FSDP1's host time per wrapped unit per training step, measured on 2 CPU ranks over gloo.

fms-hf-tuning runs its 2-GPU LoRA rows under accelerate's FSDP1 (``FullyShardedDataParallel``,
FULL_SHARD, limit_all_gathers, use_orig_params False: accelerate's defaults) with peft's
``fsdp_auto_wrap_policy``, which wraps every LoRA adapter (each ``lora_A``/``lora_B`` Linear) as its
own unit beside the decoder layers: 8 adapter units per layer with LoRA on q, k, v, o. This script
builds a Mistral-shaped model from its config (random weights, tiny widths so the kernels cost
next to nothing), puts peft's LoRA on q, k, v, o, wraps it as fms does, and times a training step
(forward, backward with the layers' gradient checkpointing, the optimizer step) at several layer
counts L: the slope of the step time over the adapter units (8 L) is the host time each unit adds.

Three arms per L, each timed on both ranks at once (the same load on the shared cores):

* ``plain``: the same peft model, no FSDP (each rank trains its own copy): the model's own host
  time, which grows with L too;
* ``layers``: FSDP1 on the decoder layers and the root only (use_orig_params True, which lets a
  unit mix frozen and trainable parameters): the layer units' share;
* ``adapters``: peft's policy, every adapter its own unit (as fms runs).

With ``--arms mp`` (the settings of fms' 2-GPU QLoRA rows, which alone ran under accelerate's FSDP1
MixedPrecision: baseline-peft-bnb sets ``bf16: True``), at bf16 weights and bf16 adapters:

* ``plain16`` and ``lora16``: no FSDP, and peft's policy without MixedPrecision (the LoRA rows' pure bf16);
* ``lora16_ac``: ``lora16`` with its forward under autocast, to tell autocast from MixedPrecision;
* ``lora16_mp``: ``lora16_ac`` under accelerate's ``MixedPrecision`` with the trained units upcast to fp32
  (``_mixed_precision``, ``_upcast_trainable``);
* ``plainq`` and ``qlora_mp``: every decoder-layer Linear an NF4 ``Linear4bit`` (bitsandbytes' CPU
  backend), without FSDP and as ``lora16_mp``; bitsandbytes' forward and backward are timed per call.

The host time is the training thread's CPU time (``time.thread_time``): the machine's 2 cores are
shared with other processes, which inflate wall times several fold but not the time this thread
runs, and gloo's collectives run on gloo's own threads, so a thread waiting for a collective (on a
GPU: NCCL's streams, queued by the host and overlapped with other work) is not counted. The wall
time inside the collectives (``torch.distributed``'s collectives wrapped with a timer, counted per
step) is printed beside it, and so are:

* ``bare``: one adapter-sized gloo all-gather and reduce-scatter called alone: the training
  thread's CPU seconds per call (the collectives' own share of the host time) and their wall time;
* ``hooks``: the thread's CPU seconds in each of FSDP1's hooks (``_pre_forward``,
  ``_post_forward``, ``_pre_backward_hook``, ``_post_backward_hook``) per call of an adapter unit,
  and the calls per unit per step, at the largest L: the unshards are in the two "pre" hooks; and
  ``launch_gap``, the CPU seconds from the rate limiter's wait to the all-gather's call (``_LaunchGap``).

    python bench/fsdp1_host.py [--arms lora,mp] [--layers 2,4,8,16] [--steps 15] [--out results/fsdp1_host.json]

(the ``mp`` arms need bitsandbytes with its CPU backend, 0.46 or later)

Ranks are ``torch.multiprocessing`` children of this process, joined over a free local port and
ended before it returns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
#: the collectives FSDP1 calls (torch/distributed/fsdp/_flat_param.py unshard: all_gather_single;
#: _runtime_utils.py _reduce_grad: reduce_scatter_single; the no-grad count's all_reduce)
_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather", "all_gather_into_tensor",
                "reduce_scatter_tensor", "broadcast")
#: adapter units per decoder layer under peft's policy: lora_A and lora_B on q, k, v, o (fms' scenarios)
ADAPTER_UNITS_PER_LAYER = 8


#: the arms and the model each builds (``_model``'s kind): the LoRA arms' fp32 model, and the arms
#: of the QLoRA runs' settings (bf16 weights; ``qlora``: bitsandbytes' Linear4bit bases)
ARM_KINDS = {"plain": "lora32", "layers": "lora32", "adapters": "lora32",
             "plain16": "lora16", "lora16": "lora16", "lora16_ac": "lora16", "lora16_mp": "lora16", "plainq": "qlora", "qlora_mp": "qlora"}
#: the arms each ``--arms`` group times at every L
ARM_GROUPS = {"lora": ("plain", "layers", "adapters"), "mp": ("plain16", "lora16", "lora16_ac", "lora16_mp", "plainq", "qlora_mp")}
#: the bases bitsandbytes quantises in the ``qlora`` kind (every decoder-layer Linear, as
#: transformers' BitsAndBytesConfig does: all but lm_head)
QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantise(model: Any) -> None:
    """Replace every decoder-layer Linear by bitsandbytes' ``Linear4bit`` as fms' baseline-peft-bnb
    loads it (fms-acceleration plugins/accelerated-peft framework_plugin_bnb.py:143-149: nf4, double
    quantisation, compute dtype and, under FSDP, ``bnb_4bit_quant_storage`` the model's bf16), quantised
    on the CPU (bitsandbytes' CPU backend)."""
    import bitsandbytes as bnb
    import torch

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in QUANTISED:
                linear = getattr(parent, name, None)
                if linear is None:
                    continue
                q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=torch.bfloat16,
                                      compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16)
                # module=q: the quantisation keeps its state on the module too, which Linear4bit's forward
                # restores after FSDP1 replaced the weight by a plain view (nn/modules.py
                # fix_4bit_weight_quant_state_from_module)
                q.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, compress_statistics=True,
                                             quant_type="nf4", quant_storage=torch.bfloat16, module=q)
                setattr(parent, name, q.to("cpu"))
    model.is_loaded_in_4bit = True  # peft's LoRA dispatch then wraps the Linear4bit bases (lora/bnb.py)


def _model(layers: int, kind: str = "lora32") -> Any:
    """A Mistral-shaped causal LM with ``layers`` decoder layers, LoRA r 4 on q, k, v, o (peft).
    ``lora32``: fp32 weights and adapters; ``lora16``: bf16 weights and bf16 adapters (TRL's sharded
    QLoRA path builds them in the weights' dtype: autocast_adapter_dtype False); ``qlora``: ``lora16``
    with bitsandbytes' NF4 ``Linear4bit`` bases (``_quantise``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, head_dim=16)
    model = MistralForCausalLM(config)
    model.config.use_cache = False
    if kind != "lora32":
        model = model.to(torch.bfloat16)
    if kind == "qlora":
        _quantise(model)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
                           autocast_adapter_dtype=kind == "lora32")
    # HF Trainer's gradient checkpointing (the fms runs'), non-reentrant
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _wrap(model: Any, arm: str) -> Any:
    """FSDP1 as accelerate prepares it for ``arm`` (``adapters``, ``lora16``: peft's policy; ``layers``:
    the decoder layers only; ``*_mp``: peft's policy under accelerate's MixedPrecision, ``_mixed``);
    ``plain*``: the model itself."""
    if arm.startswith("plain"):
        return model
    import functools

    import torch
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

    if arm == "layers":
        policy, orig = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MistralDecoderLayer}), True
    else:
        policy, orig = fsdp_auto_wrap_policy(model), False
    mixed = arm.endswith("_mp")
    # torch 2.13 _init_utils.py _init_device_handle: without device_id a CPU module is refused
    # ("FSDP needs a non-CPU accelerator device"); device_id cpu gives torch.cpu's Stream/Event stubs
    engine = FullyShardedDataParallel(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                                      limit_all_gathers=True, use_orig_params=orig, device_id=torch.device("cpu"),
                                      mixed_precision=_mixed_precision() if mixed else None)
    if mixed:
        _upcast_trainable(engine)
    return engine


def _mixed_precision() -> Any:
    """accelerate's FSDP1 policy under ``bf16: True`` (accelerate v1.0.1 utils/dataclasses.py:1758-1784
    ``set_mixed_precision``: param, reduce and buffer dtype all bf16)."""
    import torch
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)


def _upcast_trainable(engine: Any) -> None:
    """What accelerate does after wrapping when mixed precision is on (v1.0.1 accelerator.py:1549-1578):
    every unit whose flat parameter trains and is not fp32 is upcast to fp32 and told so
    (``_handle._orig_param_dtype``), so each unshard of an adapter unit first casts its fp32 shard to a
    bf16 one (torch fsdp/_flat_param.py ``_use_low_precision_shard``) and its gradient is reduced in bf16
    and cast back (``_runtime_utils._cast_grad_to_param_dtype``)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    for module in FullyShardedDataParallel.fsdp_modules(engine):
        if not module._has_params:
            continue
        param = module._flat_param
        if param.dtype != torch.float32 and param.requires_grad:
            param.data = param.data.to(torch.float32)
            module._handle._orig_param_dtype = torch.float32


def _autocast(arm: str) -> Any:
    """The step's forward context: under bf16 autocast where the run had HF Trainer's ``bf16: True``
    (accelerate wraps the model's forward in autocast: accelerator.py:1413-1419): the QLoRA arms, the
    MixedPrecision arm and ``lora16_ac`` (autocast without MixedPrecision, to tell the two apart)."""
    import contextlib

    import torch

    autocast = arm in ("plainq", "qlora_mp", "lora16_mp", "lora16_ac")
    return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()


class _CollectiveTimer:
    """Wraps ``torch.distributed``'s collectives: how many ran and the seconds spent in them."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls, self.seconds, self._saved = 0, 0.0, {}
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._timed(self._saved[name]))

    def _timed(self, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return run

    def restore(self) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)


class _Linear4bitTimer:
    """Wraps bitsandbytes' ``Linear4bit.forward`` and ``MatMul4Bit.backward`` (the autograd function
    looks its backward up on the class at each call): calls and the thread's CPU seconds in them."""

    WHAT = ("linear4bit_forward", "matmul4bit_backward")

    def __init__(self) -> None:
        import bitsandbytes as bnb
        from bitsandbytes.autograd._functions import MatMul4Bit

        self.totals: dict[str, list[float]] = {}
        self.reset()
        self._saved = (bnb.nn.Linear4bit.forward, MatMul4Bit.backward)
        bnb.nn.Linear4bit.forward = self._timed("linear4bit_forward", self._saved[0])
        MatMul4Bit.backward = staticmethod(self._timed("matmul4bit_backward", self._saved[1]))

    def reset(self) -> None:
        self.totals = {what: [0.0, 0] for what in self.WHAT}

    def _timed(self, what: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[what][0] += time.thread_time() - start
                self.totals[what][1] += 1
        return run

    def restore(self) -> None:
        import bitsandbytes as bnb
        from bitsandbytes.autograd._functions import MatMul4Bit

        bnb.nn.Linear4bit.forward = self._saved[0]
        MatMul4Bit.backward = staticmethod(self._saved[1])


def _time_arm(layers: int, arm: str, steps: int, warmup: int) -> dict[str, float]:
    """Median step seconds of ``arm`` at ``layers`` layers, and the collectives per step."""
    import torch
    import torch.distributed as dist

    engine = _wrap(_model(layers, ARM_KINDS[arm]), arm)
    optimizer = torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    timer, bnb_timer = _CollectiveTimer(), _Linear4bitTimer() if ARM_KINDS[arm] == "qlora" else None
    times, comm, cpu, calls = [], [], [], []
    bnb_steps: list[dict[str, list[float]]] = []
    try:
        for step in range(warmup + steps):
            dist.barrier()
            timer.calls, timer.seconds = 0, 0.0
            if bnb_timer is not None:
                bnb_timer.reset()
            start, start_cpu = time.perf_counter(), time.thread_time()
            with _autocast(arm):
                loss = engine(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
            if step >= warmup:
                times.append(elapsed)
                comm.append(timer.seconds)
                cpu.append(elapsed_cpu)
                calls.append(timer.calls)
                if bnb_timer is not None:
                    bnb_steps.append(dict(bnb_timer.totals))
    finally:
        timer.restore()
        if bnb_timer is not None:
            bnb_timer.restore()
    # the host time: the training thread's CPU seconds (gloo's collectives run on its own threads,
    # and a thread waiting for them or for the shared cores is not on the CPU); beside it each step's
    # wall time less its time inside collectives (gloo's latency and the other rank's skew), which
    # the other processes on the shared cores inflate
    rest = [t - c for t, c in zip(times, comm)]
    out = {"step_s": statistics.median(times), "comm_s": statistics.median(comm), "cpu_s": statistics.median(cpu),
           "min_cpu_s": min(cpu), "wall_less_comm_s": statistics.median(rest), "collectives": statistics.median(calls)}
    for what in _Linear4bitTimer.WHAT if bnb_steps else ():
        # thread CPU seconds per call of bitsandbytes' Linear4bit forward (its Python, the dequantisation
        # and the matmul) and of MatMul4Bit's backward, the median step's; the calls per step
        out[f"{what}_cpu_s_per_call"] = statistics.median(t[what][0] / max(t[what][1], 1) for t in bnb_steps)
        out[f"{what}_calls"] = statistics.median(t[what][1] for t in bnb_steps)
    return out


def _bare_collectives(calls: int = 300) -> dict[str, float]:
    """One gloo all-gather and one reduce-scatter of an adapter-sized flat parameter (r 4 x 64: 256
    elements a rank), called alone ``calls`` times: the training thread's CPU seconds and the wall
    seconds per call, what the FSDP arms' collectives cost beside FSDP1's own bookkeeping."""
    import torch
    import torch.distributed as dist

    shard, world = torch.zeros(256), dist.get_world_size()
    full = torch.zeros(256 * world)
    out: dict[str, float] = {}
    for name, call in (("all_gather", lambda: dist.all_gather_single(full, shard)),
                       ("reduce_scatter", lambda: dist.reduce_scatter_single(shard, full))):
        for _ in range(20):
            call()
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            call()
        out[f"{name}_cpu_s"] = (time.thread_time() - start_cpu) / calls
        out[f"{name}_wall_s"] = (time.perf_counter() - start) / calls
    return out


#: FSDP1's per-unit hooks (torch 2.13 fsdp/_runtime_utils.py), by the module that calls each
_HOOKS = {"_pre_forward": ("fully_sharded_data_parallel", "_runtime_utils"),
          "_post_forward": ("fully_sharded_data_parallel", "_runtime_utils"),
          "_pre_backward_hook": ("_runtime_utils",), "_post_backward_hook": ("_runtime_utils",)}


def _hook_split(layers: int, steps: int, arm: str = "adapters") -> dict[str, dict[str, float]]:
    """The training thread's CPU seconds in each of FSDP1's hooks, per call, for the adapter units
    (an ``nn.Linear`` wrapped alone) of ``arm``, and the calls per unit per step.
    ``_pre_forward`` and ``_pre_backward_hook`` hold the unshards (the rate limiter's wait, the
    all-gather and its launch, the flat parameter's views), ``_post_forward`` the reshard,
    ``_post_backward_hook`` the reduce-scatter."""
    import importlib

    import torch
    import torch.distributed as dist

    modules = {name: importlib.import_module(f"torch.distributed.fsdp.{name}")
               for name in ("fully_sharded_data_parallel", "_runtime_utils")}
    totals: dict[str, list[float]] = {hook: [0.0, 0] for hook in _HOOKS}
    saved = {(m, hook): getattr(modules[m], hook) for hook, where in _HOOKS.items() for m in where}

    def timed(hook: str, fn: Any) -> Any:
        def run(state: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(getattr(state, "_fsdp_wrapped_module", None), torch.nn.Linear):
                return fn(state, *args, **kwargs)
            start = time.thread_time()
            try:
                return fn(state, *args, **kwargs)
            finally:
                totals[hook][0] += time.thread_time() - start
                totals[hook][1] += 1
        return run

    for (m, hook), fn in saved.items():
        setattr(modules[m], hook, timed(hook, fn))
    gap = _LaunchGap()
    try:
        engine = _wrap(_model(layers, ARM_KINDS[arm]), arm)
        optimizer = torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad], lr=1e-4, foreach=False)
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
        for step in range(steps + 2):
            if step == 2:  # after the warm-up (the lazy init's first steps)
                totals.update({hook: [0.0, 0] for hook in _HOOKS})
            dist.barrier()
            with _autocast(arm):
                loss = engine(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == 1:
                gap.gaps.clear()
    finally:
        gap.restore()
        for (m, hook), fn in saved.items():
            setattr(modules[m], hook, fn)
    units = ADAPTER_UNITS_PER_LAYER * layers
    out = {hook: {"cpu_s_per_call": seconds / max(calls, 1), "calls_per_unit_step": calls / (units * steps)}
           for hook, (seconds, calls) in totals.items()}
    out["launch_gap"] = {"cpu_s_per_call": statistics.median(gap.gaps) if gap.gaps else 0.0,
                         "calls_per_unit_step": len(gap.gaps) / (units * steps)}
    return out


class _LaunchGap:
    """The host CPU seconds from the rate limiter's wait to the next all-gather's call, for the adapter
    units' unshards (a shard of at most ``ADAPTER_SHARD_MAX`` elements): the span PyTorch profiled at
    235 us on GPUs (pytorch/pytorch PR #108234), measured here on the same code path (torch fsdp
    _runtime_utils.py ``_unshard``: ``event.synchronize()``, then ``handle.unshard()``: the padded
    unsharded flat parameter's allocation, then the all-gather; on the CPU ``dist.all_gather``)."""

    ADAPTER_SHARD_MAX = 1024

    def __init__(self) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import _limiter_utils

        self.gaps: list[float] = []
        self._start: float | None = None
        self._queue = _limiter_utils._FreeEventQueue
        self._saved = (self._queue.dequeue_if_needed, dist.all_gather, dist.all_gather_single)
        box = self

        class _Waited:
            def __init__(self, event: Any) -> None:
                self.event = event

            def synchronize(self) -> None:
                self.event.synchronize()
                box._start = time.thread_time()

        def dequeue(queue: Any) -> Any:
            event = box._saved[0](queue)
            return _Waited(event) if event is not None else None

        def gathered(fn: Any, shard_arg: int) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                if box._start is not None and args[shard_arg].numel() <= self.ADAPTER_SHARD_MAX:
                    self.gaps.append(time.thread_time() - box._start)
                box._start = None
                return fn(*args, **kwargs)
            return run

        self._queue.dequeue_if_needed = dequeue
        dist.all_gather = gathered(self._saved[1], 1)  # (tensor_list, sharded_flat_param)
        dist.all_gather_single = gathered(self._saved[2], 1)  # (padded_unsharded, sharded_flat_param)

    def restore(self) -> None:
        import torch.distributed as dist

        self._queue.dequeue_if_needed = self._saved[0]
        dist.all_gather, dist.all_gather_single = self._saved[1], self._saved[2]


def _rank(rank: int, world: int, port: int, layers: list[int], steps: int, warmup: int, out: str,
          groups: tuple[str, ...] = ("lora",)) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # two ranks on the machine's cores: one thread each
    dist.init_process_group("gloo", rank=rank, world_size=world)
    found: dict[str, Any] = {}
    try:
        found["bare"] = _bare_collectives()
        # the adapter units' hooks of the LoRA arm and, with the mp group, of the bf16 arms without and with
        # accelerate's MixedPrecision and of the QLoRA one
        hooked = (("adapters",) if "lora" in groups else ()) + (("lora16", "lora16_ac", "lora16_mp", "qlora_mp") if "mp" in groups else ())
        for arm in hooked:
            found["hooks" if arm == "adapters" else f"hooks/{arm}"] = _hook_split(max(layers), steps, arm)
        if rank == 0:
            print(f"bare collectives {json.dumps(found['bare'])}", flush=True)
            for key in (k for k in found if k.startswith("hooks")):
                print(f"{key} {json.dumps(found[key])}", flush=True)
        for n in layers:
            for arm in (a for g in groups for a in ARM_GROUPS[g]):
                found[f"{arm}/{n}"] = _time_arm(n, arm, steps, warmup)
                if rank == 0:
                    print(f"L={n:3d} {arm:9s} {json.dumps(found[f'{arm}/{n}'])}", flush=True)
    finally:
        dist.destroy_process_group()
    Path(f"{out}.rank{rank}").write_text(json.dumps(found))


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def summarize(found: dict[str, Any], layers: list[int]) -> dict[str, Any]:
    """The per-unit slopes (seconds per unit per step) from one rank's timings, for the arms it has."""
    units = [ADAPTER_UNITS_PER_LAYER * n for n in layers]
    keys = ("step_s", "comm_s", "cpu_s", "min_cpu_s", "wall_less_comm_s", "collectives")
    out: dict[str, Any] = {}

    def diff(arm: str, base: str, key: str) -> list[float]:
        return [found[f"{arm}/{n}"][key] - found[f"{base}/{n}"][key] for n in layers]

    if "adapters/%d" % layers[0] in found:
        for arm in ("layers", "adapters"):
            # each FSDP arm over the plain model at the same L
            out[arm] = {key: diff(arm, "plain", key) for key in keys}
        for key in keys:
            # the adapter units' own: the adapters arm over the layers arm, per adapter unit (8 a layer)
            out[f"per_adapter_unit/{key}"] = _slope(units, [a - b for a, b in zip(out["adapters"][key], out["layers"][key])])
            # the layer units' own: the layers arm over the plain model, per layer
            out[f"per_layer_unit/{key}"] = _slope(layers, out["layers"][key])
    if "qlora_mp/%d" % layers[0] in found:
        for key in ("cpu_s", "min_cpu_s"):
            # FSDP1 at bf16 (the adapter and layer units) over the plain bf16 model, per adapter unit
            out[f"bf16_fsdp_per_adapter_unit/{key}"] = _slope(units, diff("lora16", "plain16", key))
            # what autocast adds to the bf16 FSDP1 step (every op of the model: per layer, over 8 units)
            out[f"autocast_per_adapter_unit/{key}"] = _slope(units, diff("lora16_ac", "lora16", key))
            # what accelerate's MixedPrecision adds beside autocast (fp32 adapter shards cast to bf16 at each
            # unshard, bf16 reductions cast back to fp32), per adapter unit
            out[f"mixed_precision_per_adapter_unit/{key}"] = _slope(units, diff("lora16_mp", "lora16_ac", key))
            # bitsandbytes' Linear4bit bases without FSDP (under autocast), per Linear4bit per step
            out[f"linear4bit_plain_per_module/{key}"] = _slope([len(QUANTISED) * n for n in layers],
                                                              diff("plainq", "plain16", key))
            # the Linear4bit bases (7 a layer) under FSDP1 and MixedPrecision, per Linear4bit per step
            out[f"linear4bit_fsdp_per_module/{key}"] = _slope([len(QUANTISED) * n for n in layers],
                                                             diff("qlora_mp", "lora16_mp", key))
        for what in _Linear4bitTimer.WHAT:
            for arm in ("plainq", "qlora_mp"):
                out[f"{arm}/{what}_cpu_s_per_call"] = statistics.median(
                    found[f"{arm}/{n}"][f"{what}_cpu_s_per_call"] for n in layers)
    return out


def main(argv: list[str] | None = None) -> int:
    import socket

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,4,8,16", help="decoder layer counts (comma separated)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per arm")
    parser.add_argument("--arms", default="lora,mp",
                        help="arm groups (comma separated): lora (fp32 LoRA: plain, layers, adapters), mp (bf16: "
                             "plain16, lora16, lora16_mp with accelerate's MixedPrecision, plainq and qlora_mp with "
                             "bitsandbytes' Linear4bit bases)")
    parser.add_argument("--out", default=str(RESULTS / "fsdp1_host.json"))
    args = parser.parse_args(argv)
    groups = tuple(args.arms.split(","))
    layers = [int(x) for x in args.layers.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn joins its children (and raises if one failed) before it returns
    mp.spawn(_rank, args=(2, port, layers, args.steps, args.warmup, args.out, groups), nprocs=2, join=True)
    ranks = [json.loads(Path(f"{args.out}.rank{r}").read_text()) for r in range(2)]
    for r in range(2):
        Path(f"{args.out}.rank{r}").unlink()
    result = {"layers": layers, "adapter_units_per_layer": ADAPTER_UNITS_PER_LAYER, "steps": args.steps,
              "arms": groups, "ranks": ranks, "summary": [summarize(found, layers) for found in ranks]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if "lora" in groups:
        _print_lora(result)
    for r, (found, s) in enumerate(zip(ranks, result["summary"])):
        for key in (k for k in s if "/" in k and not k.startswith("per_")):
            print(f"rank {r}, {key}: {1e3 * s[key]:.3f} ms")
        for key in (k for k in found if k.startswith("hooks/")):
            split = ", ".join(f"{hook} {1e6 * v['cpu_s_per_call']:.0f} us x {v['calls_per_unit_step']:.1f}"
                              for hook, v in found[key].items())
            print(f"rank {r}, {key[6:]} adapter unit hooks (CPU per call x calls per unit per step): {split}")
    return 0


def _print_lora(result: dict[str, Any]) -> None:
    """The LoRA arms' figures, a line per rank."""
    ranks = result["ranks"]
    for r, found in enumerate(ranks):
        split = ", ".join(f"{hook} {1e6 * v['cpu_s_per_call']:.0f} us x {v['calls_per_unit_step']:.1f}"
                          for hook, v in found["hooks"].items())
        bare = found["bare"]
        print(f"rank {r}, adapter unit hooks (CPU per call x calls per unit per step): {split}; bare gloo all-gather "
              f"{1e6 * bare['all_gather_cpu_s']:.0f} us CPU ({1e6 * bare['all_gather_wall_s']:.0f} us wall), "
              f"reduce-scatter {1e6 * bare['reduce_scatter_cpu_s']:.0f} us CPU ({1e6 * bare['reduce_scatter_wall_s']:.0f} us wall)")
    for r, s in enumerate(result["summary"]):
        for unit in ("adapter", "layer"):
            def ms(key: str, s: dict[str, Any] = s, unit: str = unit) -> str:
                return f"{1e3 * s[f'per_{unit}_unit/{key}']:.3f} ms"
            print(f"rank {r}, per {unit} unit per step: host CPU {ms('cpu_s')} (least {ms('min_cpu_s')}); wall "
                  f"{ms('step_s')}, of it in gloo's collectives {ms('comm_s')}, the rest {ms('wall_less_comm_s')}; "
                  f"{s[f'per_{unit}_unit/collectives']:.2f} collectives")


if __name__ == "__main__":
    sys.exit(main())
