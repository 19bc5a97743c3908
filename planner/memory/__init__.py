"""The analytical memory model: what one training configuration needs on one device.

Pure functions over frozen dataclasses: no torch, no I/O, no caches. ``estimate_memory``
returns a ``MemoryEstimate`` whose ``breakdown`` names every term and sums to
``peak_allocated_bytes``. The package's files are the model's parts:

* ``dtypes``: element sizes, the dtype mode of a configuration, the bitsandbytes block layouts;
* ``parameters``: what is trained (LoRA targets, trainable counts, tensor sizes);
* ``shapes``, ``activations``, ``attention``: the tensors saved for backward, block by block,
  as named terms with their sources;
* ``states``: weights, gradients, optimizer states, the batch-independent terms;
* ``step``: the moments of a step at which memory can peak;
* ``evaluation``: the eval pass during training (its moments after the step);
* ``timeline``: the allocations and frees of one optimizer step, from which the peak, its moment
  and its breakdown are read;
* ``reserve``: from allocated to reserved and the process total.

Each optimizer's states, step temporaries and traffic come from its descriptor (``planner.optim``);
what a sharding scheme (DDP, DeepSpeed ZeRO) keeps, splits or offloads from its descriptor
(``planner.sharding``).
Device behaviour comes from the device's ``KernelProfile`` (``planner.gpus``). The search's
memo and its affine fast path live in ``planner.search``.
"""

from __future__ import annotations

from planner.memory.activations import (
    ACTIVATION_SAVED,
    ACTIVATION_SAVED_DEFAULT,
    ACTIVATION_SAVES_OUTPUT,
)
from planner.memory.dtypes import BNB_8BIT_BLOCK, BNB_MIN_8BIT_SIZE, NF4_BLOCK, NF4_DQ_BLOCK
from planner.memory.estimate import estimate_memory
from planner.memory.parameters import lora_params, lora_targets, param_tensor_sizes, trainable_params
from planner.memory.reserve import CUDA_FRAGMENTATION, CUDA_ROUND_LARGE
from planner.memory.saved import activation_breakdown
from planner.memory.states import model_state_breakdown, model_states_bytes

__all__ = [
    "ACTIVATION_SAVED",
    "ACTIVATION_SAVED_DEFAULT",
    "ACTIVATION_SAVES_OUTPUT",
    "BNB_8BIT_BLOCK",
    "BNB_MIN_8BIT_SIZE",
    "CUDA_FRAGMENTATION",
    "CUDA_ROUND_LARGE",
    "NF4_BLOCK",
    "NF4_DQ_BLOCK",
    "activation_breakdown",
    "estimate_memory",
    "lora_params",
    "lora_targets",
    "model_state_breakdown",
    "model_states_bytes",
    "param_tensor_sizes",
    "trainable_params",
]
