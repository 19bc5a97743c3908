"""Limits the planner checks before it prints, stores or computes anything, shared with the store's
schema and the service.

No heavy imports: the planning path checks them without loading SQLAlchemy.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

from planner.errors import InvalidConfigError, ModelConfigError, UnstorableDataError
from planner.modelspec import LinearKind
from planner.text import check_printable

if TYPE_CHECKING:  # pragma: no cover
    from planner.modelspec import ModelSpec

#: The longest model id (catalog id, config path, HF id) the store keeps, on every backend
#: (migration 0002; Linux paths reach 4096 but a config path past 1024 is a typo in practice).
MODEL_ID_MAX_CHARS = 1024

#: The most plans one history query returns (``planner history -n/--limit``): SQLite's LIMIT is a
#: signed 64-bit integer, and no terminal or script wants more at once.
MAX_HISTORY = 100_000


def check_model_id(model_id: str) -> None:
    """Refuse a model id the store could not keep (PostgreSQL refuses what SQLite would silently
    keep, and a NUL byte), or that would reach an operator's terminal as control sequences
    (``planner history`` prints it), before anything is printed or written."""
    if len(model_id) > MODEL_ID_MAX_CHARS:
        raise UnstorableDataError(
            f"the model id is {len(model_id):,} characters and the store keeps at most {MODEL_ID_MAX_CHARS:,}: "
            "give a shorter path to the config.json (e.g. a symlink)"
        )
    problem = check_printable(model_id, what="--model")
    if problem is not None:
        raise UnstorableDataError(f"{problem}; a model id is one line of printable text")


#: The most GPUs one node holds: --gpus counts the data-parallel devices of ONE node (the host RAM
#: of offload plans is the node's, the interconnect is the node's). The largest standard machines
#: hold 16 (NVIDIA DGX-2: 16 x V100; AWS p2.16xlarge: 16 x K80); the GPU catalog's AWS machines
#: hold at most 8.
MAX_GPUS_PER_NODE = 16


def check_gpu_count(gpus: object) -> None:
    """--gpus: a whole number from 1 to the GPUs of one node."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise InvalidConfigError(f"--gpus must be a whole number >= 1, got {gpus!r}")
    if gpus > MAX_GPUS_PER_NODE:
        raise InvalidConfigError(
            f"--gpus {gpus} is more GPUs than one node holds (at most {MAX_GPUS_PER_NODE}): the planner plans the "
            "data-parallel GPUs of one node; give the GPUs per node"
        )




# ---- what one request may cost ------------------------------------------------------------------
# Every size of a config.json has its own bound (SIZE_BOUNDS of planner.catalog), but
# the work of a plan grows with their products: one inline MoE config inside every bound (2,048
# layers x 32,768 experts) took minutes and 8.5 GB. What grows, read off planner/memory and the
# search (profiled: cProfile of planner.planning.make_plan on inline configs):
#
# * parameter tensors. planner.memory.parameters.param_tensor_sizes lists one element count per
#   tensor (an expert's weight is a tensor, so a block holds experts x expert linears of them),
#   and the model-state terms walk those lists: the trainable set of each adapter set the search
#   tries (Trained.sizes and its Counter), and ZeRO-3's split of the base model plus that set
#   (planner.sharding.zero.zero3_param_split). Full fine-tuning walks the base model's tensors
#   twice (what it trains, what ZeRO-3 partitions); each LoRA/QLoRA adapter set (rank x targets:
#   planner.search.LORA_RANKS x {every linear, the attention projections}) walks its adapters and
#   the base model once more. Cost: "tensor sizings" = tensors x (2 + adapter sets).
#   Measured on the 2-core CI machine: at most 0.3 us and 60 bytes per sizing.
# * blocks x plans replayed. Each plan shown is estimated in full: its step is replayed on the
#   caching allocator block by block (planner.memory.timeline, planner.memory.allocator), for at
#   most ``top_k`` plans, two per (method, precision class) (planner.ranking._distinct: 3 methods
#   x 3 classes x 2 = 18), and up to 3 more for the other ranking policy. Measured: at most
#   0.3 ms per block and plan.
# * nothing else grows with the config: the number of (micro-batch, accumulation) splits is the
#   divisors of the per-device batch (at most 240 below the 2^20 batch bound), screened by
#   bisection; activations, attention and throughput are closed forms of the sizes.
#
# The bounds below keep the worst request within them near 1 s of CPU and 60 MB on that machine
# (time.process_time and the peak RSS around planner.planning.make_plan of inline configs at
# each bound: 64 layers x 1,630 experts with every method, 0.6 s and 52 MB; 160 x 3,270 with full
# fine-tuning, 0.9 s and 46 MB; 2,048 blocks with top_k 1, 0.9 s), with room for real models: the
# largest resolvable today (Qwen/Qwen2.5-72B) needs 9,630 sizings and 80 x 21 = 1,680 block
# replays; the largest real MoE (Qwen3.5-397B-A17B, 60 layers x 512 experts) holds at most
# 60 x 512 x 3 = 92,160 expert tensors, under a million sizings with the rest of the model, and
# Llama-3.1-405B's 126 layers need 2,646 block replays with every plan shown.
# What they cannot bound: when the replay finds a plan too large, the ranking replays the next
# smaller split and the next plans (planner.ranking._replayed_plans), up to a few hundred plans on
# a small device (Qwen2.5-0.5B on 12 GiB: 278); 190 layers of it on 40 GiB took 4 s. The service
# holds every request to a CPU budget for that (planner.service.budget).

#: Tensor sizings one request may cost: parameter tensors x (2 + adapter sets searched).
MAX_TENSOR_SIZINGS = 2**21
#: Blocks x plans estimated in full (allocator replay) one request may cost.
MAX_BLOCK_REPLAYS = 4_096
#: Plans a search estimates in full at most: ``planner.ranking`` shows two per (method,
#: precision class), 3 x 3 x 2, and replays up to 3 more for the other ranking policy.
SHOWN_PLANS_MAX = 18
OTHER_POLICY_PLANS = 3


def parameter_tensors(model: "ModelSpec") -> int:
    """The model's parameter tensors, as ``param_tensor_sizes`` lists them for full fine-tuning,
    counted without listing them: every block's linear weights and biases (each expert copy its
    own), its norms in tensors of hidden size, and the embeddings, final norm and head."""
    tensors = 4  # token embedding, another embedding table, the final norm, the head
    if model.is_encoder_decoder:
        tensors += 2 + math.ceil(model.final_norm_params / model.hidden_size)
    # every kind of block (a model's dense and MoE blocks differ), each with its own norms
    for blocks, linears, norm in model.block_tensors:
        per_block = sum(lin.count * (2 if lin.bias else 1) for lin in linears)
        tensors += blocks * (per_block + math.ceil(norm / model.hidden_size))
    return tensors


def adapter_sets(model: "ModelSpec", *, methods: Iterable[object], lora_ranks: Iterable[int]) -> int:
    """Adapter sets a search tries: one per LoRA rank and target set (every linear; the attention
    projections too when the model has them, planner.search.attention_targets), shared by LoRA and
    QLoRA; none for full fine-tuning alone."""
    if not any(getattr(m, "uses_adapters", False) for m in methods):
        return 0
    attention = any(lin.kind in (LinearKind.ATTN_IN, LinearKind.ATTN_OUT) for lin in model.layer_linears)
    return len(tuple(lora_ranks)) * (2 if attention else 1)


def _blocks(model: "ModelSpec") -> int:
    return model.num_layers + model.decoder_layers


def _cost_error(model: "ModelSpec", what: str) -> ModelConfigError:
    source = model.source if model.source and model.source != "catalog" else model.id
    return ModelConfigError(f"{source}: {what}")


def check_tensor_sizings(model: "ModelSpec", *, adapter_sets: int) -> None:
    """``ModelConfigError`` when sizing this model's tensors for ``adapter_sets`` adapter sets (and
    full fine-tuning) costs more than ``MAX_TENSOR_SIZINGS``."""
    tensors = parameter_tensors(model)
    sizings = tensors * (2 + adapter_sets)
    if sizings <= MAX_TENSOR_SIZINGS:
        return
    experts = max((lin.count for _, linears in model.stacks for lin in linears), default=1)
    shape = f"{_blocks(model):,} blocks" + (f" with {experts:,} experts" if experts > 1 else "")
    sets = f"x (2 + {adapter_sets} adapter sets searched)" if adapter_sets else "x 2 (full fine-tuning)"
    raise _cost_error(model, (
        f"the model has {tensors:,} parameter tensors ({shape}), and planning sizes each of them "
        f"{sets} = {sizings:,} tensor sizings, over the bound of {MAX_TENSOR_SIZINGS:,} per request "
        f"(the largest real MoE needs under a million); check the layer and expert counts of the config.json"
        + ("; full fine-tuning alone (--method full) sizes fewer" if adapter_sets and tensors * 2 <= MAX_TENSOR_SIZINGS else "")))


def check_block_replays(model: "ModelSpec", *, plans: int, top_k_hint: bool) -> None:
    """``ModelConfigError`` when replaying ``plans`` plans' steps over every block of the model
    costs more than ``MAX_BLOCK_REPLAYS``."""
    blocks = _blocks(model)
    if blocks * plans <= MAX_BLOCK_REPLAYS:
        return
    fewest = MAX_BLOCK_REPLAYS // blocks
    hint = (f"; ask for fewer plans (--top-k {max(fewest - OTHER_POLICY_PLANS, 1)})"
            if top_k_hint and fewest >= 2 else "; check the layer count of the config.json")
    raise _cost_error(model, (
        f"{blocks:,} blocks x {plans} plans estimated in full (each plan's step replayed block by block) = "
        f"{blocks * plans:,} block replays, over the bound of {MAX_BLOCK_REPLAYS:,} per request{hint}"))


def plans_replayed(top_k: int) -> int:
    """Plans a search with ``top_k`` estimates in full, at most."""
    return min(top_k, SHOWN_PLANS_MAX) + min(top_k, OTHER_POLICY_PLANS)


def check_search_cost(model: "ModelSpec", *, methods: Iterable[object], lora_ranks: Iterable[int], top_k: int) -> None:
    """Refuse, before any work, a search whose cost is past the bounds above (a 422 over HTTP,
    exit 2 on the command line), naming the bound and the fix."""
    check_tensor_sizings(model, adapter_sets=adapter_sets(model, methods=methods, lora_ranks=lora_ranks))
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1:  # suggest words a bad top_k
        check_block_replays(model, plans=plans_replayed(top_k), top_k_hint=True)


def check_estimate_cost(model: "ModelSpec") -> None:
    """The same bounds for one configuration (``planner estimate``, ``measure``): one adapter set
    at most and one plan replayed."""
    check_tensor_sizings(model, adapter_sets=1)
    check_block_replays(model, plans=1, top_k_hint=False)


__all__ = ["MAX_BLOCK_REPLAYS", "MAX_GPUS_PER_NODE", "MAX_HISTORY", "MAX_TENSOR_SIZINGS", "MODEL_ID_MAX_CHARS",
           "adapter_sets", "check_estimate_cost", "check_gpu_count", "check_model_id", "check_search_cost",
           "parameter_tensors", "plans_replayed"]
