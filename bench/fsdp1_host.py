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
  and the calls per unit per step, at the largest L: the unshards are in the two "pre" hooks.

    python bench/fsdp1_host.py [--layers 2,4,8,16] [--steps 15] [--out results/fsdp1_host.json]

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


def _model(layers: int) -> Any:
    """A Mistral-shaped causal LM with ``layers`` decoder layers, LoRA r 4 on q, k, v, o (peft)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, head_dim=16)
    model = MistralForCausalLM(config)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    # HF Trainer's gradient checkpointing (the fms runs'), non-reentrant
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _wrap(model: Any, arm: str) -> Any:
    """FSDP1 as accelerate prepares it for ``arm`` (``adapters``: peft's policy; ``layers``: the
    decoder layers only); ``plain``: the model itself."""
    if arm == "plain":
        return model
    import functools

    import torch
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

    if arm == "adapters":
        policy, orig = fsdp_auto_wrap_policy(model), False
    else:
        policy, orig = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MistralDecoderLayer}), True
    # torch 2.13 _init_utils.py _init_device_handle: without device_id a CPU module is refused
    # ("FSDP needs a non-CPU accelerator device"); device_id cpu gives torch.cpu's Stream/Event stubs
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                                    limit_all_gathers=True, use_orig_params=orig, device_id=torch.device("cpu"))


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


def _time_arm(layers: int, arm: str, steps: int, warmup: int) -> dict[str, float]:
    """Median step seconds of ``arm`` at ``layers`` layers, and the collectives per step."""
    import torch
    import torch.distributed as dist

    engine = _wrap(_model(layers), arm)
    optimizer = torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    timer = _CollectiveTimer()
    times, comm, cpu, calls = [], [], [], []
    try:
        for step in range(warmup + steps):
            dist.barrier()
            timer.calls, timer.seconds = 0, 0.0
            start, start_cpu = time.perf_counter(), time.thread_time()
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
    finally:
        timer.restore()
    # the host time: the training thread's CPU seconds (gloo's collectives run on its own threads,
    # and a thread waiting for them or for the shared cores is not on the CPU); beside it each step's
    # wall time less its time inside collectives (gloo's latency and the other rank's skew), which
    # the other processes on the shared cores inflate
    rest = [t - c for t, c in zip(times, comm)]
    return {"step_s": statistics.median(times), "comm_s": statistics.median(comm), "cpu_s": statistics.median(cpu),
            "min_cpu_s": min(cpu), "wall_less_comm_s": statistics.median(rest), "collectives": statistics.median(calls)}


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


def _hook_split(layers: int, steps: int) -> dict[str, dict[str, float]]:
    """The training thread's CPU seconds in each of FSDP1's hooks, per call, for the adapter units
    (an ``nn.Linear`` wrapped alone) of the ``adapters`` arm, and the calls per unit per step.
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
    try:
        engine = _wrap(_model(layers), "adapters")
        optimizer = torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad], lr=1e-4, foreach=False)
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
        for step in range(steps + 2):
            if step == 2:  # after the warm-up (the lazy init's first steps)
                totals.update({hook: [0.0, 0] for hook in _HOOKS})
            dist.barrier()
            engine(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for (m, hook), fn in saved.items():
            setattr(modules[m], hook, fn)
    units = ADAPTER_UNITS_PER_LAYER * layers
    return {hook: {"cpu_s_per_call": seconds / max(calls, 1), "calls_per_unit_step": calls / (units * steps)}
            for hook, (seconds, calls) in totals.items()}


def _rank(rank: int, world: int, port: int, layers: list[int], steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # two ranks on the machine's cores: one thread each
    dist.init_process_group("gloo", rank=rank, world_size=world)
    found: dict[str, Any] = {}
    try:
        found["bare"] = _bare_collectives()
        found["hooks"] = _hook_split(max(layers), steps)
        if rank == 0:
            print(f"bare collectives {json.dumps(found['bare'])}", flush=True)
            print(f"hooks {json.dumps(found['hooks'])}", flush=True)
        for n in layers:
            for arm in ("plain", "layers", "adapters"):
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
    """The per-unit slopes (seconds per unit per step) from one rank's timings."""
    units = [ADAPTER_UNITS_PER_LAYER * n for n in layers]
    keys = ("step_s", "comm_s", "cpu_s", "min_cpu_s", "wall_less_comm_s", "collectives")
    out: dict[str, Any] = {}
    for arm in ("layers", "adapters"):
        # each FSDP arm over the plain model at the same L
        out[arm] = {key: [found[f"{arm}/{n}"][key] - found[f"plain/{n}"][key] for n in layers] for key in keys}
    for key in keys:
        # the adapter units' own: the adapters arm over the layers arm, per adapter unit (8 a layer)
        out[f"per_adapter_unit/{key}"] = _slope(units, [a - b for a, b in zip(out["adapters"][key], out["layers"][key])])
        # the layer units' own: the layers arm over the plain model, per layer
        out[f"per_layer_unit/{key}"] = _slope(layers, out["layers"][key])
    return out


def main(argv: list[str] | None = None) -> int:
    import socket

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,4,8,16", help="decoder layer counts (comma separated)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per arm")
    parser.add_argument("--out", default=str(RESULTS / "fsdp1_host.json"))
    args = parser.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn joins its children (and raises if one failed) before it returns
    mp.spawn(_rank, args=(2, port, layers, args.steps, args.warmup, args.out), nprocs=2, join=True)
    ranks = [json.loads(Path(f"{args.out}.rank{r}").read_text()) for r in range(2)]
    for r in range(2):
        Path(f"{args.out}.rank{r}").unlink()
    result = {"layers": layers, "adapter_units_per_layer": ADAPTER_UNITS_PER_LAYER, "steps": args.steps,
              "ranks": ranks, "summary": [summarize(found, layers) for found in ranks]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
