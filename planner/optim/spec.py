"""What a descriptor of an optimizer holds: ``OptimizerSpec``, and the shape of its memory model.

One ``OptimizerSpec`` per optimizer (``planner.optim.<name>``) carries every fact the planner
uses about it: the memory model, the names and settings of the libraries that run it, the words
and notes the plans print, its place in the ranking, and how the worker builds it. This module
imports nothing of the planner: the descriptors sit below ``planner.config``, whose
``Optimizer`` type is built from them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple

#: bytes of an fp32 element (the dtype of every optimizer state that is neither 8-bit nor the
#: parameter's own: torch's ``step`` tensors, bitsandbytes' 32-bit states and block scales,
#: Adafactor's factors, DeepSpeed's master partition)
FP32 = 4
#: Tensors one kernel of torch's multi-tensor apply takes when it reads or writes four lists (a foreach op over
#: params, grads and both moments; the fused AdamW kernel): TensorListMetadata must fit the 4 KB kernel argument
#: space (torch 2.13 include/ATen/native/cuda/MultiTensorApply.cuh l.42, ``depth_to_max_tensors[5] = {110, 64,
#: 48, 36, 30}``; 252 only in builds against CUDA 13, l.31). A foreach or fused op launches one kernel per chunk.
TENSOR_LIST_CHUNK = 36
#: bytes of an fp16/bf16 element (DeepSpeed's communication dtype under mixed precision, the 16-bit
#: weights, activations and gradients of the memory model)
HALF = 2


class StepOps(NamedTuple):
    """What ``optimizer.step()`` dispatches from its one Python thread: ``ops`` aten calls (each the host's
    dispatch), ``launches`` of them kernels on a GPU (each a CUDA launch more; ops on the CPU-resident step
    counters and views launch none). ``*`` by a tensor count and ``+`` add counts (not tuple repetition)."""

    ops: int
    launches: int

    def __mul__(self, k: int) -> StepOps:  # type: ignore[override]
        return StepOps(self.ops * k, self.launches * k)

    def __add__(self, other: StepOps) -> StepOps:  # type: ignore[override]
        return StepOps(self.ops + other.ops, self.launches + other.launches)


#: nothing counted
NO_STEP_OPS = StepOps(0, 0)


class OptimizerModel:
    """What one optimizer keeps and allocates (subclasses fill in the rules).

    ``state_bytes`` takes the element counts of the trainable tensors (per-tensor rules such as
    bitsandbytes' 32-bit fallback for small tensors need them); ``step_transient`` (over (element
    count, tensors) pairs) the temporaries ``optimizer.step()`` holds beyond states and gradients
    on a device whose kernels are described by a ``planner.gpus.KernelProfile``;
    ``update_bytes_per_param`` the device memory traffic of one update (``planner.throughput``).
    """

    def tensor_state_bytes(self, n: int, param_bytes: int) -> int:
        """Persistent state of one trainable tensor of ``n`` elements."""
        raise NotImplementedError

    def state_bytes(self, sizes: Iterable[int], param_bytes: int) -> int:
        """Persistent state of trainable tensors of these element counts."""
        return self.counted_state_bytes(Counter(sizes).items(), param_bytes)

    def counted_state_bytes(self, counts: Iterable[tuple[int, int]], param_bytes: int) -> int:
        """``state_bytes`` of tensors given as (element count, number of such tensors) pairs (a
        model has few distinct tensor shapes; an element count may come in more than one pair)."""
        # (a list, not a generator: the search sums a few pairs ~430 times a search)
        return sum([self.tensor_state_bytes(n, param_bytes) * copies for n, copies in counts])

    def model_state_bytes(self, model, config, t, param_bytes: int) -> int:
        """Persistent state of the configuration's trainable tensors ``t`` (a
        ``planner.memory.parameters.Trained`` of ``model``, a ``ModelSpec``)."""
        return self.counted_state_bytes(t.size_counts, param_bytes)

    def flat_partition_state_bytes(self, partition: int) -> int:
        """State of one flat fp32 tensor of ``partition`` elements (DeepSpeed's master partition)."""
        return self.tensor_state_bytes(partition, FP32)  # (``counted_state_bytes`` of the one tensor)

    def step_transient(self, counts: Iterable[tuple[int, int]], param_bytes: int, kernels) -> int:
        """Temporaries inside ``optimizer.step()`` beyond states and gradients, for trainable tensors
        given as (element count, number of such tensors) pairs (``Trained.size_counts``: a model
        has few distinct shapes, and the search asks for thousands of these). None by default:
        SGD updates in place."""
        return 0

    def update_bytes_per_param(self, w: int) -> float:
        """Device memory traffic of one update per trainable parameter of ``w`` bytes."""
        raise NotImplementedError

    def step_ops(self, tensors: int, matrices: int, param_bytes: int, kernels) -> StepOps:
        """What ``optimizer.step()`` dispatches from its one Python thread for ``tensors`` trainable tensors of
        ``param_bytes`` per element, ``matrices`` of them at least 2-D, on a device whose kernels are ``kernels``:
        host time the device waits for when its kernels are shorter (``planner.throughput``). Counted from each
        optimizer's code (``planner.optim.<name>``); none by default."""
        return NO_STEP_OPS

    #: ``step()`` waits for the device after each tensor (bitsandbytes), so its host dispatch and the device's
    #: update add up instead of overlapping
    syncs_each_tensor: bool = False

    def largest_state_bytes(self, counts: Iterable[tuple[int, int]], param_bytes: int) -> int:
        """The state of the largest of these tensors ((element count, number of such tensors)
        pairs): what a paged optimizer (``OptimizerSpec.paged``) must have on the device at once.
        bitsandbytes (95f9af30) allocates paged state with ``cudaMallocManaged(...,
        cudaMemAttachHost)`` (bitsandbytes/functional.py:91-99 ``get_paged``,
        csrc/pythonInterface.cpp:557-563) and, in ``step``, prefetches one parameter's states to
        the device, updates it and synchronises before the next (optim/optimizer.py:325-335:
        ``prefetch_state(p)``, ``update_step``, ``sync_gpu(p)``; ``prefetch_state`` l.392-400).
        Counted as the whole state of a paged optimizer, as its unified-memory bytes are
        (``planner.memory.states.static_terms``): its fp32 absmax (optimizer.py:528-529) and the
        states of tensors under 1e5 elements (optimizer.py:383) are ``torch.zeros`` in the caching
        allocator, ~1.6% of the states, which the allocator replay would make at the end of the
        first step (``planner.memory.timeline._first_step``), not in each parameter's hook as under
        optimizer_in_bwd: left with the paged bytes until that timing is modelled."""
        return max((self.tensor_state_bytes(n, param_bytes) for n, copies in counts if copies), default=0)


#: ``build(params, *, lr)``: the torch optimizer the measurement worker steps (torch and the
#: optimizer's library imported inside it, when it is called)
Builder = Callable[..., Any]
#: ``deepspeed_section(*, lr, betas, eps, weight_decay, offload)``: the ``optimizer`` section of a
#: ds_config that makes DeepSpeed build this optimizer itself
DeepSpeedSection = Callable[..., "dict[str, Any]"]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """Everything the planner knows about one optimizer, read by name from ``planner.optim``."""

    name: str
    """The planner's name: ``--optimizer``, the API's ``optimizer``, stored payloads."""
    memory: OptimizerModel
    """Its states, step temporaries and update traffic."""
    build: Builder
    """The worker's construction of the torch optimizer (``workers.train``)."""
    hf_optim: str
    """``transformers.TrainingArguments.optim`` that makes the HF Trainer build the optimizer the
    memory model counts (transformers training_args.py ``OptimizerNames``)."""
    words: str
    """What PLAN.md says the optimizer is."""
    preference: int
    """Within a speed tie, lower ranks first: closest to the usual recipe (AdamW) first
    (``planner.ranking``). Also the order of the registry, the CLI's list and the search space."""
    hf_removed: str | None = None
    """The transformers release that no longer takes ``hf_optim`` (None: the installed one does): emit refuses
    the optimizer and names the fix; a config that names it is still read as it (``planner.check``)."""
    hf_args: Mapping[str, Any] = field(default_factory=dict)
    """TrainingArguments beside ``optim`` that the Trainer needs to build what the model counts."""
    note: str | None = None
    """Its trade-off against AdamW, with the source, as the plans show it (None: AdamW itself)."""
    library: str | None = None
    """The package the run needs beyond torch, transformers and accelerate (None: none)."""
    paged: bool = False
    """States in bitsandbytes' paged (unified) memory, outside the caching allocator on CUDA."""
    unpaged: str | None = None
    """The same optimizer without paging (ZeRO's partitions cannot be paged: the fix to name)."""
    bnb_8bit_states: bool = False
    """bitsandbytes 8-bit states: the HF Trainer keeps the embeddings' states in 32 bits (trainer.py
    ``create_optimizer``, ``register_module_override``), the emitted train.py undoes that."""
    deepspeed_section: DeepSpeedSection | None = None
    """The ds_config ``optimizer`` section; None: the optimizer is handed to DeepSpeed as a client
    optimizer (``zero_allow_untested_optimizer``)."""
    deepspeed_offload: bool = False
    """DeepSpeed can offload its states to the host (only its own CPU optimizers step there)."""
    searched: bool = True
    """``suggest`` tries it by default. False for an optimizer that is not a drop-in for AdamW's
    hyperparameters (it is planned when named)."""


__all__ = ["FP32", "HALF", "NO_STEP_OPS", "TENSOR_LIST_CHUNK", "StepOps", "Builder", "DeepSpeedSection", "OptimizerModel", "OptimizerSpec"]
