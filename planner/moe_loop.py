"""The kernels transformers 4's per-expert MoE loop adds to a micro-step (``TrainConfig.experts_loop``;
``planner.memory.moe.looped``): what ``planner.kernels`` asks of an MoE block whose experts are nn.Linear
modules run one after another in Python.

MixtralSparseMoeBlock.forward (transformers 4.48.1 models/mixtral/modeling_mixtral.py l.112-150) runs, for
each of the E experts, ``torch.where(expert_mask[expert_idx])`` (a nonzero: the host waits for the device
to know the count), the gather ``hidden_states[None, top_x]``, the expert's three nn.Linear GEMMs on its
~T·k/E rows with act and the product between them (MixtralBlockSparseTop2MLP.forward l.79-81), the weighting
``* routing_weights[top_x, idx, None]``, the cast ``.to(hidden_states.dtype)`` and
``final_hidden_states.index_add_(0, top_x, ...)``. The GEMMs' FLOPs and operand bytes are those of the T·k
routed rows (``kernels._base_gemms`` counts them per token, top-k rows each); what the loop adds is the
gather and scatter traffic and the eager ops around each expert's GEMMs.

Pure module: no torch, no I/O.
"""

from __future__ import annotations

from planner.config import Method, TrainConfig
from planner.memory.moe import expert_dims, is_moe_block, looped, moe_layers, routed_experts
from planner.modelspec import ModelSpec

#: Elements each routed slot moves, per hidden element, in the loop's forward outside the GEMMs: the
#: gather ``hidden_states[None, top_x]`` reads and writes a row (2), the weighting's multiply reads and
#: writes one (2), ``index_add_`` reads the source row and reads and writes the destination row (3)
#: (modeling_mixtral.py l.143-148; the cast is a no-op where the output is in the stream's dtype).
LOOP_ELEMENTS_PER_SLOT = 7
#: Eager ops per expert in the loop's forward: where (nonzero and its copy to the host), the gather, w1,
#: w3, act, the product, w2, the routing weight's index, the weighting, the cast, index_add_ (l.138-148).
LOOP_FORWARD_OPS = 12
#: ... and in its backward: index_add_'s (index_select), the cast's, the weighting's two products, the
#: routing weight's IndexBackward (zeros and index_put), w2's input gradient, the product's two, act's, w1's
#: and w3's input gradients and their sum, the gather's IndexBackward (zeros of the whole T x H input and
#: index_put with accumulate, derivatives.yaml ``index.Tensor``: ``index_backward(grad.new_zeros(self.sizes())
#: ...)``) and autograd's accumulation of it into the input's gradient.
LOOP_BACKWARD_OPS = 18
#: A host-device synchronisation (the nonzero in each expert's ``torch.where``, l.138: its count is copied to the host
#: before the output is sized, torch aten/src/ATen/native/cuda/Nonzero.cu ``nonzero_out_cuda``) drains the queue: the
#: host waits for the device, then the device waits for the host's dispatch of what follows until a kernel long
#: enough to let the host run ahead again, the expert's first GEMM: the nonzero's own remainder (the copied count,
#: the output's allocation, the select kernel), the gather ``hidden_states[None, top_x]`` (l.143) and w1's F.linear
#: (l.80), 3 ops of the host's time each (``planner.kernels.host_op_seconds``; the drain is priced in
#: ``planner.throughput``).
SYNC_DRAIN_OPS = 3
#: transformers 4.36-4.39's loop (``TrainConfig.experts_list_index``; 4.39.3 models/mixtral/modeling_mixtral.py
#: l.866-877) copies each expert's routed indices to the host (``top_x.tolist()``, ``idx.tolist()``) and indexes with
#: those Python lists: ``hidden_states[None, top_x_list]`` and ``routing_weights[top_x_list, idx_list, None]``. A list
#: index is built into an int64 tensor on the host element by element and copied to the device with a wait (torch
#: csrc/autograd/python_variable_indexing.cpp ``sequenceToVariable`` -> utils/tensor_new.cpp
#: ``indexing_tensor_from_data``, not non_blocking). Host seconds per routed slot, measured here on one thread
#: (bench/moe_list_index.py, bench/results/moe_list_index.md: the fits' slopes, the tensor index's own time taken off):
#: the two tolist calls together,
LIST_TOLIST_SLOT_SECONDS = 16.3e-9
#: the hidden states' list index (one list),
LIST_INDEX_SLOT_SECONDS = 118.1e-9
#: the routing weights' (two lists). On a GPU the host builds it after the expert's GEMMs are queued and while they
#: run (the left operand of ``*`` is evaluated first): an expert's three GEMMs over its rows take ~1 us a row on
#: the fastest catalog GPUs, against 0.24 us here, so only the CPU profile, which runs everything in turn, pays it.
LIST_PAIR_INDEX_SLOT_SECONDS = 240.1e-9
#: Ops of host time the device waits for per expert beyond the tensor-indexed loop's drain (``SYNC_DRAIN_OPS``):
#: after the nonzero has drained the queue, the two tolist copies and the hidden states' host-to-device index copy;
#: and once the routing weights' index copy has waited for the expert's GEMMs, the ops up to the next expert's
#: nonzero, which the tensor-indexed loop dispatched while the GEMMs ran: the weights' gather, the weighting, the
#: cast and index_add_ (l.877-881).
LIST_DRAIN_OPS = 7
#: Passes over the whole MoE input (T x H elements) each expert's gather adds to the backward: IndexBackward0 of
#: ``hidden_states[None, top_x]`` (modeling_mixtral.py l.143) starts from a zero tensor of the input's full size
#: (torch tools/autograd/derivatives.yaml ``index.Tensor``: ``index_backward(grad.new_zeros_symint(self.sym_sizes(),
#: ...), indices, grad)``: 1 write) and index_puts the expert's rows into it, and autograd's engine sums the E experts'
#: full-size gradients (and the router's) into the input's one (torch/csrc/autograd/input_buffer.cpp ``accumulate``:
#: ``old_var + var`` or in place, read 2 write 1): 4 per expert, whatever the expert's share of the tokens.
LOOP_INPUT_GRAD_PASSES = 4


def loop_slot_elements(model: ModelSpec) -> int:
    """Elements per token the loop's forward moves outside the GEMMs, per block of ``model`` (0 where the
    experts are not looped): ``LOOP_ELEMENTS_PER_SLOT`` x H per routed slot, top-k slots a token."""
    if not looped(model):
        return 0
    _, top_k, _ = expert_dims(model)
    return LOOP_ELEMENTS_PER_SLOT * model.hidden_size * top_k


def loop_input_grad_elements(model: ModelSpec) -> int:
    """Elements per token the loop's backward moves over the whole MoE input, summed over the MoE blocks (0 where
    the experts are not looped): ``LOOP_INPUT_GRAD_PASSES`` x H per expert, all E experts a token (each expert's
    IndexBackward0 makes and adds a full-size gradient). The input needs a gradient wherever anything before the
    block trains (LoRA on the attention, full fine-tuning): counted always."""
    if not looped(model):
        return 0
    return moe_layers(model) * model.num_experts * LOOP_INPUT_GRAD_PASSES * model.hidden_size


def loop_gemms(model: ModelSpec, config: TrainConfig) -> tuple[tuple[int, int, int, bool, float], ...]:
    """The loop's expert GEMMs whose token count the routing sets afresh each step, per micro-step, as (calls, output
    features, inner dimension, whether in the checkpoint's recompute, the expert's rows from one sequence): each routed
    expert linear's forward on its ~T·k/E rows (MixtralBlockSparseTop2MLP.forward, modeling_mixtral.py l.79-81), again
    in the recompute, and its input gradient (the output's gradient times the weight: the input features out, the
    output features inner; counted always, as ``loop_input_grad_elements``), E experts of each MoE block. Empty where
    the experts are not looped. A trained expert's weight gradient (full fine-tuning) runs the tokens as its inner
    dimension: its output tiles are the weight's own, fixed from step to step, so it is not listed."""
    gemms: list[tuple[int, int, int, bool, float]] = []
    for n, _, view in model.block_kinds:
        if not (is_moe_block(view) and looped(view)):
            continue
        for lin in routed_experts(view):
            calls, rows = n * lin.count, config.seq_len * lin.active / lin.count
            gemms.append((calls, lin.out_features, lin.in_features, False, rows))
            if config.grad_ckpt:
                gemms.append((calls, lin.out_features, lin.in_features, True, rows))
            gemms.append((calls, lin.in_features, lin.out_features, False, rows))
    return tuple(gemms)


def loop_syncs(model: ModelSpec, config: TrainConfig) -> int:
    """Host-device synchronisations the loop makes per micro-step: one per expert per MoE block per forward (the
    checkpoint's recompute runs the loop again); 0 where the experts are not looped."""
    if not looped(model):
        return 0
    return moe_layers(model) * model.num_experts * (1 + int(config.grad_ckpt))


def list_index_host(model: ModelSpec, config: TrainConfig, *, cpu: bool) -> tuple[int, float]:
    """(extra drained ops, host seconds of the list conversions) per micro-step of transformers 4.36-4.39's
    list-indexed loop (``TrainConfig.experts_list_index``), over all MoE blocks and forwards (the checkpoint's
    recompute runs the loop again): ``LIST_DRAIN_OPS`` a sync, and every routed slot's conversions, the routing
    weights' pair on the ``cpu`` profile only (``LIST_PAIR_INDEX_SLOT_SECONDS``). (0, 0.0) for any other loop.
    Its index tensors on the device (8 B a slot each, in the block being run) are not counted."""
    if not (config.experts_list_index and looped(model)):
        return 0, 0.0
    _, top_k, _ = expert_dims(model)
    slots = config.micro_batch * config.seq_len * top_k * moe_layers(model) * (1 + int(config.grad_ckpt))
    per_slot = LIST_TOLIST_SLOT_SECONDS + LIST_INDEX_SLOT_SECONDS + (LIST_PAIR_INDEX_SLOT_SECONDS if cpu else 0.0)
    return loop_syncs(model, config) * LIST_DRAIN_OPS, slots * per_slot


def loop_ops(model: ModelSpec, config: TrainConfig, *, quantized_ops: int) -> int:
    """Eager ops the loop adds per micro-step over all MoE blocks: each expert's forward (again in the
    checkpoint's recompute) and backward ops; under QLoRA each expert's three Linear4bit
    modules' dequantisation (``quantized_ops`` per module per forward and backward, ``kernels.OPS_PER_QUANTIZED``)
    beyond the one of each that ``kernels.ops_per_micro_step`` counts per listed linear."""
    if not looped(model):
        return 0
    experts = model.num_experts
    forwards = 1 + int(config.grad_ckpt)
    per_block = experts * (LOOP_FORWARD_OPS * forwards + LOOP_BACKWARD_OPS)
    if config.method is Method.QLORA:
        modules = len(routed_experts(model))  # w1, w3, w2: listed once each, E of each run
        per_block += modules * (experts - 1) * quantized_ops * (forwards + 1) // 2
    return moe_layers(model) * per_block


__all__ = ["LIST_DRAIN_OPS", "LIST_INDEX_SLOT_SECONDS", "LIST_PAIR_INDEX_SLOT_SECONDS", "LIST_TOLIST_SLOT_SECONDS",
           "LOOP_BACKWARD_OPS", "LOOP_ELEMENTS_PER_SLOT", "LOOP_FORWARD_OPS", "LOOP_INPUT_GRAD_PASSES", "SYNC_DRAIN_OPS",
           "list_index_host", "loop_gemms", "loop_input_grad_elements", "loop_ops", "loop_slot_elements", "loop_syncs"]
