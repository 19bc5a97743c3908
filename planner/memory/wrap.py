"""FSDP1 wrapping a model loaded on the host: what each device allocates and frees before the first
step, which the caching allocator keeps cached into it (the timeline's "load and wrap" prelude,
``planner.memory.timeline._model_states``; issue 25 item 4).

Drawn where the scheme's own settings say the run loads the weights on one host and FSDP1 syncs
them (``fsdp_settings``: version 1, ``cpu_ram_efficient_loading`` and ``sync_module_states``, as
``FSDP1.fsdp_settings`` writes them and fms-acceleration's scripts/benchmarks/accelerate.yaml sets
them) on more than one GPU. What happens there (torch 2.4.1, accelerate 1.0.1, transformers 4.48.1:
the fms runs' pins, scripts/benchmarks/refs/requirements.txt; read in those wheels):

* **Loading leaves nothing cached.** transformers puts rank 0's weights on the host and every other
  rank's on the meta device (modeling_utils.py l.869-870: ``param_device = "cpu" if
  is_local_dist_rank_0() else "meta"``); a bitsandbytes 4-bit weight is quantised on the device and
  its data moved back at once (l.876-888, quantizer_bnb_4bit.py l.241 ``Params4bit(...).to(
  target_device)``). The Trainer then empties the cache before it wraps the model
  (trainer.py l.2181 ``self.accelerator.free_memory()`` -> accelerate utils/memory.py
  ``release_memory`` -> ``torch.cuda.empty_cache()``; the wrap is l.2320 ``accelerator.prepare``).
* **Wrapping does.** accelerate builds ``FSDP(model, sync_module_states=..., param_init_fn=...,
  device_id=self.device)`` (accelerator.py l.1497-1511; ``param_init_fn`` is ``to_empty`` on the
  device, utils/dataclasses.py l.1689). FSDP1 builds its units children first, the root (embeddings,
  final norm, head) last, each in ``_init_param_handle_from_module`` (fsdp/_init_utils.py l.546-604):

  1. the unit's parameters come to the device one tensor each: rank 0 moves them
     (``_move_module_to_device`` l.922-970 -> ``_move_states_to_device`` l.999 ``param.data =
     param.to(device)``), the other ranks materialise them (``to_empty``): the same sizes;
  2. ``_sync_module_params_and_buffers`` (l.1058-1099) broadcasts them from rank 0 with
     ``dist._broadcast_coalesced`` in buckets of ``PARAM_BROADCAST_BUCKET_SIZE`` = 250 MiB (l.73): a
     bucket takes tensors until it holds at least that (reducer.cpp
     ``compute_bucket_assignment_by_size``: ``bucket.size >= bucket_size_limit``); a bucket of several
     tensors is one new flat tensor, a bucket of one is a view of it (ATen TensorShape.cpp
     ``flatten_dense_tensors``: ``at::cat``, or ``view`` for a single tensor); at most two buckets
     are in flight, the oldest freed before a third is made (c10d comm.cpp ``broadcast_coalesced``:
     ``max_in_flight = 2``);
  3. ``FlatParamHandle`` concatenates them into the unit's flat parameter (_flat_param.py l.736-740
     -> ``flatten_tensors`` l.843 ``torch.cat``; no alignment padding with ``use_orig_params`` off,
     l.535), the parameters become its views (their own tensors freed), and ``shard()`` clones this
     rank's 1/N, padded to a multiple of the ranks (l.902-913, ``_get_shard`` l.1076
     ``chunk.clone()``), then frees the unsharded storage (l.915-917).

  Each unit so leaves its parameters', buckets' and flat parameter's blocks cached; the next unit
  of the same shapes takes them again, and the shard, never freed, may be carved from one.

Not drawn: the LoRA adapters' own units (peft's policy wraps each ``lora_A``/``lora_B``: a few hundred
KiB each, the small pool) and accelerate's fp32 upcast of their flat parameters under mixed
precision (accelerator.py l.1560-1577); the buffers' broadcast (rotary tables: kilobytes); the
order rank 0 moves a unit's tensors in (breadth-first by module: the same sizes, so the same
blocks); FSDP1's lazy init in the first forward, which allocates each unit's padded unsharded
buffer on the default stream and frees it at once (_flat_param.py ``init_flat_param_attributes``):
one unit's size at a time, which the flat parameters' blocks drawn here already hold.
"""

from __future__ import annotations

from typing import Any

from planner.config import Method
from planner.memory.dtypes import mode_of
from planner.modelspec import ModelSpec
from planner.units import MiB

#: torch fsdp/_init_utils.py l.73 ``PARAM_BROADCAST_BUCKET_SIZE = int(250 * 1024 * 1024)``
BROADCAST_BUCKET = 250 * MiB
#: c10d comm.cpp ``broadcast_coalesced``: ``constexpr auto max_in_flight = 2``
BROADCASTS_IN_FLIGHT = 2
#: the prelude's temporaries, by breakdown key (all freed before the first step; copies of the weights, which
#: the picture counts them as: ``timeline.category``)
PARAMETERS_KEY = "weights/wrap/parameters"
BUCKET_KEY = "weights/wrap/broadcast_bucket"
FLAT_KEY = "weights/wrap/flat_parameter"


def draws_wrap(model: ModelSpec, config: Any) -> bool:
    """Whether the run wraps a host-loaded model with FSDP1 on more than one GPU (the module's
    docstring): the scheme's own settings say so (``fsdp_settings``). An encoder-decoder's two
    stacks are not drawn."""
    settings = getattr(config.sharding.spec, "fsdp_settings", None)
    if settings is None or config.gpus <= 1 or model.is_encoder_decoder:
        return False
    s = settings(config)
    return s.get("version") == 1 and bool(s.get("cpu_ram_efficient_loading")) and bool(s.get("sync_module_states"))


def unit_tensors(model: ModelSpec, config: Any) -> list[tuple[int, ...]]:
    """Each FSDP1 unit's parameter tensors in bytes, in the order FSDP1 builds the units (every
    decoder layer, then the root: embeddings, final norm, head), each unit's in the model's order.
    16-bit or fp32 as the weights are (``DtypeMode.weight``); under QLoRA a quantised linear's weight
    is its packed 4-bit codes, two to a byte, which ``bnb_4bit_quant_storage`` lets FSDP1 flatten with
    the 16-bit norms (the quantisation state is not a parameter: it stays on the module)."""
    elt = mode_of(config).weight
    qlora = config.method is Method.QLORA
    units: list[tuple[int, ...]] = []
    for n, linears, norm in model.block_tensors:
        one: list[int] = []
        for lin in linears:
            weight = lin.in_features * lin.out_features
            one += [weight // 2 if qlora and lin.module else weight * elt] * lin.count
            if lin.bias:
                one += [lin.out_features * elt] * lin.count
        h = model.hidden_size
        one += [min(norm - start, h) * elt for start in range(0, norm, h)]
        units += [tuple(one)] * n
    root = (model.embedding_params, model.other_embedding_params, model.final_norm_params, model.head_params)
    units.append(tuple(n * elt for n in root if n))
    return units


def _buckets(tensors: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``compute_bucket_assignment_by_size`` of one dtype: tensors in order, a bucket closed once it
    holds at least ``BROADCAST_BUCKET``."""
    out: list[tuple[int, ...]] = []
    bucket: list[int] = []
    for size in tensors:
        bucket.append(size)
        if sum(bucket) >= BROADCAST_BUCKET:
            out.append(tuple(bucket))
            bucket = []
    if bucket:
        out.append(tuple(bucket))
    return out


def _shard(total: int, elt: int, ranks: int) -> int:
    """One rank's padded shard of a flat parameter of ``total`` bytes (``_get_shard``: the flat
    parameter's elements chunked in ``ranks``, the last chunks padded to the first's size)."""
    elements = -(-total // elt)
    return -(-elements // ranks) * elt


def wrap_ops(model: ModelSpec, config: Any, resident: dict[str, int]) -> list[tuple]:
    """The prelude as ops for the timeline: ``("alloc", slot, key, nbytes, tensors)`` and ``("free",
    slot)``, ``slot`` naming an allocation within the list; the model's resident weights (``resident``'s
    ``weights``, or QLoRA's ``weights/nf4`` and ``weights/unquantized``) allocated unit by unit, each
    unit's share one tensor, never freed, summing to the resident bytes exactly."""
    units = unit_tensors(model, config)
    elt = mode_of(config).weight  # (QLoRA's packed codes too: viewed as the 16-bit storage dtype)
    ranks = config.gpus
    shards = [_shard(sum(unit), elt, ranks) for unit in units]
    kept = _kept(config, resident, shards)
    ops: list[tuple] = []
    slot = 0

    def alloc(key: str, nbytes: int, tensors) -> int:
        nonlocal slot
        slot += 1
        ops.append(("alloc", slot, key, nbytes, tensors))
        return slot

    for unit, (key, nbytes) in zip(units, kept):
        params = alloc(PARAMETERS_KEY, sum(unit), unit)
        flying: list[int] = []
        for bucket in _buckets(unit):
            if len(bucket) == 1:
                continue  # a view of the tensor
            if len(flying) == BROADCASTS_IN_FLIGHT:
                ops.append(("free", flying.pop(0)))
            flying.append(alloc(BUCKET_KEY, sum(bucket), 1))
        ops += [("free", made) for made in flying]
        flat = alloc(FLAT_KEY, _shard(sum(unit), elt, ranks) * ranks, 1)
        ops.append(("free", params))
        if nbytes:
            alloc(key, nbytes, 1)
        ops.append(("free", flat))
    return ops


def _kept(config: Any, resident: dict[str, int], shards: list[int]) -> list[tuple[str, int]]:
    """(breakdown key, bytes) of each unit's shard: the resident weights split in proportion to the
    units' shards (the layers' share of QLoRA's ``weights/nf4``, the root's of
    ``weights/unquantized``, which also counts the layers' norms: kilobytes)."""
    if config.method is Method.QLORA:
        layers = _split(resident.get("weights/nf4", 0), shards[:-1])
        return [("weights/nf4", n) for n in layers] + [("weights/unquantized", resident.get("weights/unquantized", 0))]
    return [("weights", n) for n in _split(resident.get("weights", 0), shards)]


def _split(total: int, weights: list[int]) -> list[int]:
    """``total`` in proportion to ``weights``, the last taking what the divisions leave."""
    whole = sum(weights)
    if not weights or whole <= 0:
        return [0] * len(weights)
    out = [total * w // whole for w in weights[:-1]]
    return out + [total - sum(out)]


__all__ = ["BROADCAST_BUCKET", "BUCKET_KEY", "FLAT_KEY", "PARAMETERS_KEY", "draws_wrap", "unit_tensors", "wrap_ops"]
