"""PyTorch FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``, FULL_SHARD) as accelerate's
``fsdp_config`` (``fsdp_version: 1``) and the HF Trainer run it: one unit per decoder layer plus the
root (TRANSFORMER_BASED_WRAP), and under LoRA one more per adapter: the Trainer hands accelerate
peft's ``fsdp_auto_wrap_policy`` for a peft model (transformers distributed/fsdp.py
``update_fsdp_plugin_peft``; fms-hf-tuning's sft_trainer.py does the same, v2.5.0 l.390-393), whose
lambda policy wraps every leaf module whose weight trains (peft utils/other.py
``fsdp_auto_wrap_policy``: ``lambda_policy_fn``), so each ``lora_A`` and ``lora_B`` Linear is a unit
of its own (256 more units on Mistral-7B with LoRA on q, k, v, o; 640 on Llama-2-70B).

Chosen by name only (``--sharding fsdp1``): the search does not try it (``searched=False``), FSDP2
is the scheme it plans. It is here for runs that are FSDP1 (accelerate's ``fsdp_config`` before
``fsdp_version: 2``), so their step time is priced as they ran.

Memory: FSDP2's terms (``planner.sharding.fsdp2``), which FSDP1 shares at the precisions it takes
here (fp32, or 16-bit weights with no MixedPrecision: the gathered, computed and reduced dtypes are
the parameters' own):

* flat parameters: each unit's parameters are one ``FlatParameter``, sharded as one 1-D tensor
  padded to a multiple of the ranks (torch 2.13 fsdp/_flat_param.py ``_get_shard``), where FSDP2
  pads each tensor's rows: the same bytes within N-1 elements a unit;
* the root is not resharded after forward (fsdp/_runtime_utils.py ``_post_forward_reshard``: "Do
  not free the root's parameters in the post-forward for FULL_SHARD"), as FSDP2's root;
* ``limit_all_gathers`` (accelerate's default, utils/dataclasses.py FullyShardedDataParallelPlugin)
  keeps at most two all-gathers in flight (fsdp/_limiter_utils.py ``_max_num_inflight_all_gathers =
  2``): the running unit and one gathered ahead, FSDP2's ``gathered`` and ``held`` terms;
* ``record_stream`` on the gathered and reduced tensors (fsdp/_flat_param.py, _runtime_utils.py)
  lets the caching allocator reuse their blocks only once the compute stream passes them; the rate
  limiter waits, before each unshard, for the free two frees back (``_unshard``: the queue holds two
  events, ``dequeue_if_needed`` then ``synchronize``), so a unit freed is reused only by the unshard
  after next: one gathered unit's block more, reserved but not allocated, from backward's first
  gather on (the replay's ``RECORDED`` unshard stream, ``_streams``);
* LoRA's adapters are their own units, so the layers' flat parameters hold frozen weights only: no
  gradient of theirs, no reduce-scatter (FSDP2's trained terms: the adapters' shards);
* QLoRA as the FSDP-QLoRA recipe runs it (``qlora_refusal``: no k-bit upcast): a layer's flat
  parameter is its packed 4-bit weights (``bnb_4bit_quant_storage``, the load dtype) and its 16-bit
  norms, one dtype as FSDP1 needs; at ``*-mixed`` too, since accelerate's MixedPrecision then casts
  only the adapter units (FSDP2's terms at ``*-mixed``: fp32 adapter shards gathered in 16 bits).

Its breakdown keys are FSDP2's (``fsdp2/...``: the same buffers, declared once there).

Step time: FSDP2's bytes (two all-gathers of every parameter and one reduce-scatter of the trained
gradients per micro-step; a third all-gather under a reentrant checkpoint around the unit, ``comm_bytes``),
and the host time of the units whose own kernels are too short to hide
it (``host_seconds``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.errors import InvalidConfigError, PlannerError, UnsupportedError
from planner.optim import names
from planner.sharding.fsdp2 import _KEYS, _TORCH_OPTIMIZERS, FSDP2, STATE_DICT_TYPE, qlora_refusal
from planner.sharding.fsdp1_host import Hooks, Layer, exposed_seconds
from planner.sharding.spec import RECORDED, Offload, WorkerSetup, ring

#: Host seconds from the rate limiter's wait on a GPU to the next unit's all-gather launch: FSDP1's
#: unshard path with ``limit_all_gathers`` (pre-unshard, the free event's ``synchronize()``, the
#: flat parameter's unshard and views), measured by PyTorch's own profile: "when the CPU thread
#: resumes, there is an 235 us overhead between the time the synchronization is met and the time a
#: new all-gather is launched. This overhead would turn into GPU utilization gap" (pytorch/pytorch
#: PR #108234, "[FSDP] New rate limiter and memory reuse system", 2023-08-30; not landed: torch 2.13's
#: _runtime_utils.py ``_unshard`` still waits on the CPU). bench/fsdp1_host.py measures the hooks on 2
#: CPU ranks (bench/results/fsdp1_host.md): 1.6-2.7 ms of host CPU per LoRA adapter unit per step across
#: runs, all its hooks and collectives' calls included, 0.4-0.6 ms per unshard: the work the exposed gap
#: is part of. 3 unshards x 235 us = 0.70 ms per adapter unit per step; fms' 2-GPU LoRA rows imply
#: 0.75 ms. Neither accelerate's MixedPrecision (its shard cast runs before the rate limiter's wait) nor
#: bitsandbytes' Linear4bit lengthens the span after the wait; the Linear4bit calls that a wait leaves
#: running on a drained device are priced apart (``linear4bit_exposed_seconds``).
UNSHARD_HOST_SECONDS = 235e-6

#: Host seconds of one bitsandbytes Linear4bit base call under FSDP1 and MixedPrecision, (forward, backward):
#: ``Linear4bit.forward`` (restore the quantisation state on the weight FSDP1's views replaced, dequantise,
#: matmul) 337 / 343 us on the two ranks, ``MatMul4Bit.backward`` (dequantise again, the input gradient)
#: 244 / 243 us (bench/fsdp1_host.py's ``qlora_mp`` arm, bench/results/fsdp1_host.md: thread CPU per call on
#: the VM's 2 CPU ranks, bitsandbytes 0.50's CPU path standing for 0.43.3's ctypes one). Where the rate
#: limiter has drained the device these run with it idle (``linear4bit_exposed_seconds``).
LINEAR4BIT_HOST_SECONDS = (340e-6, 244e-6)

#: FSDP1's hooks around one adapter unit, host seconds per call (bench/results/fsdp1_host.md, ``qlora_mp``,
#: rank 0): ``_pre_forward`` 462 us, of which 52 us from the rate limiter's wait to the all-gather's call (the
#: rest put before the wait, where pre-unshard and the hook's entry run); the GPU's span after the wait is
#: PyTorch's profiled ``UNSHARD_HOST_SECONDS``; ``_post_forward`` 94 us, ``_post_backward_hook`` 332 us.
UNIT_HOOKS = Hooks(before_wait=462e-6 - 52e-6, after_wait=UNSHARD_HOST_SECONDS, post_forward=94e-6,
                   post_backward=332e-6)

#: Units peft's policy makes of one LoRA-wrapped linear: its ``lora_A`` and its ``lora_B``.
UNITS_PER_ADAPTED_LINEAR = 2


def retained_input_gradients(model: Any, config: Any, *, reentrant_around_unit: bool, residual_bytes: int) -> int:
    """Bytes FSDP1 keeps alive at the backward of the first decoder layer (the last one backward
    reaches) beyond what one process holds, when a reentrant checkpoint is called around each
    frozen unit: (layers - 2) layer-input gradients, ``micro_batch x seq_len x hidden`` in the
    residual stream's dtype each.

    How (torch 2.4.1, the fms runs'; the same code in 2.13): a unit whose flat parameter does not
    require gradients (every decoder layer's under LoRA and QLoRA, whose adapters are units of
    their own) registers, in each forward run with gradients, a multi-grad hook on its inputs that
    require them (fsdp/_runtime_utils.py l.401 ``_pre_forward`` ->
    ``_register_post_backward_reshard_only_hook`` l.1461-1503), kept in
    ``flat_param._post_backward_hook_state`` until ``_finalize_params`` at the end of backward
    (l.1157-1178). ``register_multi_grad_hook`` keeps ``grad_fns`` (autograd/graph.py l.469): for a
    leaf, the ``AccumulateGrad`` node ``_get_grad_fn_or_grad_acc`` makes (l.159-162), which owns the
    leaf. transformers 4's model-level checkpoint calls the FSDP-wrapped layer inside the reentrant
    checkpoint (4.45.2 models/mistral/modeling_mistral.py l.805-806
    ``self._gradient_checkpointing_func(decoder_layer.__call__, ...)``, use_reentrant True by default:
    modeling_utils.py l.2404), whose backward reruns the layer on detached leaves
    (utils/checkpoint.py l.290) and fills their ``.grad`` (l.313-314): each layer's input and its
    gradient then live until backward ends. Every checkpoint is alive at the model's
    ``first_block_backward`` already, so what the first layer's backward adds over it is the
    gradients of the layers between: the one flowing into the first layer is there on one process
    too. Measured on the CPU (bench/fsdp1_adapters.py, bench/results/fsdp1_adapters.md): (L - 2)
    input-sized gradients at 4 and 8 layers, none with a non-reentrant checkpoint.

    ``reentrant_around_unit``: the run's checkpoint is reentrant and called around the FSDP unit
    (transformers <= 4.x's default). The planner's own runs hold none: transformers 5 checkpoints
    inside the layer (``GradientCheckpointingLayer``, inside the unit's forward) and the planner
    asks for a non-reentrant one (planner/emit/settings.py ``CHECKPOINTING_KWARGS``). Full
    fine-tuning holds none either: a unit whose flat parameter trains hooks its ``AccumulateGrad``
    instead (``_register_post_backward_hook``), no input."""
    return max(model.num_layers - 2, 0) * retained_input_gradient(
        model, config, reentrant_around_unit=reentrant_around_unit, residual_bytes=residual_bytes)


def retained_input_gradient(model: Any, config: Any, *, reentrant_around_unit: bool, residual_bytes: int) -> int:
    """One of ``retained_input_gradients``' gradients, ``micro_batch x seq_len x hidden`` in the residual
    stream's dtype; 0 where none is retained beyond one process (fewer than 3 layers among them)."""
    if not (reentrant_around_unit and config.grad_ckpt and config.method.uses_adapters) or model.num_layers <= 2:
        return 0
    return config.micro_batch * config.seq_len * model.hidden_size * residual_bytes


def unshards_per_micro_step(config: Any) -> int:
    """All-gathers each adapter unit runs a micro-step: the forward's and the backward's
    (FULL_SHARD frees it after forward), and with checkpointing the recompute's: an adapter unit
    inside a checkpointed layer is gathered again for its recomputed forward (bench/fsdp1_host.py
    counts 3 all-gathers and 1 reduce-scatter per adapter unit per step with checkpointing)."""
    return 3 if config.grad_ckpt else 2


def linear4bit_exposed_seconds(model: Any, config: Any, layer_of: Callable[[tuple[float, float]], Layer | None] | None
                               ) -> float:
    """Device seconds per micro-step that QLoRA's Linear4bit base calls (``LINEAR4BIT_HOST_SECONDS``) leave
    the device idle under the rate limiter: the timeline of ``planner.sharding.fsdp1_host`` with them, less
    the same timeline with the base calls taking no host time (what the adapter units' own hooks expose,
    ``UNSHARD_HOST_SECONDS``' part, is priced apart). Only the calls launched while the device has drained
    to the free the host waited on count: at fms' 2-GPU shapes on A100s (Mistral-7B, 4,096 tokens), four of
    a layer's 14 forward calls (forward and recompute) and two of its 7 backward ones at micro-batch 2, 0.059 s
    a micro-step, two and one at 4, none at 8 (bench/results/fsdp1_host.md). The recompute is timed for a
    reentrant checkpoint around the unit (``TrainConfig.reentrant_ckpt``) only. ``layer_of(base_host)``: a
    decoder layer's ``Layer`` on the device with its base calls' (forward, backward) host seconds, from the
    throughput model's device rates (``planner.throughput.fsdp1_decoder_layer``), None for a layer order
    the timeline does not know. 0.0 without it (no device), on one GPU (NO_SHARD: nothing gathered, no wait)
    or without 4-bit bases."""
    if layer_of is None or config.gpus == 1 or config.method.value != "qlora":
        return 0.0
    quantized = layer_of(LINEAR4BIT_HOST_SECONDS)
    if quantized is None:
        return 0.0
    bare = layer_of((0.0, 0.0))
    recompute = bool(config.grad_ckpt and config.reentrant_ckpt)
    return (exposed_seconds(quantized, UNIT_HOOKS, layers=model.num_layers, recompute=recompute)
            - exposed_seconds(bare, UNIT_HOOKS, layers=model.num_layers, recompute=recompute))


class FSDP1(FSDP2):
    """FSDP1: FSDP2's bytes and memory at the precisions it takes here, its units' host time on
    the step's path, its own emitted files and worker."""

    # ---- words ------------------------------------------------------------------------------
    def label(self, offload: Offload) -> str:
        return self.name

    def short(self, offload: Offload) -> str:
        return self.name

    def plan_line(self, offload: Offload) -> str:
        return ("FSDP1 (FullyShardedDataParallel FULL_SHARD, limit_all_gathers: one unit per decoder layer + root, "
                "and one per LoRA adapter under peft's fsdp_auto_wrap_policy), no offload")

    def cast_words(self, dtype: str) -> tuple[str, str] | None:
        return None  # it takes no *-mixed precision (``refusal``)

    def notes(self, config: Any, offload: Offload, *, host_bytes: int) -> list[str]:
        notes = [("FSDP1 keeps the root unit (embeddings, output head) unsharded from forward to the end of backward "
                 "(torch fsdp/_runtime_utils.py _post_forward_reshard)")]
        if config.method.uses_adapters and config.gpus > 1:
            notes.append("FSDP1 wraps every LoRA adapter as its own unit (peft's fsdp_auto_wrap_policy); with "
                         "limit_all_gathers the host waits for the GPU before each unit's all-gather, so each adapter "
                         f"unit adds ~{UNSHARD_HOST_SECONDS * 1e6:.0f} us of host time per all-gather to the step "
                         "(pytorch/pytorch PR #108234): --sharding fsdp2 does not")
        return notes

    # ---- validation -------------------------------------------------------------------------
    def refusal(self, config: Any, offload: Offload) -> Callable[[], PlannerError] | None:
        if offload is not Offload.NONE:
            return lambda: InvalidConfigError("--sharding fsdp1 with --offload is not modelled: use --offload none, or "
                                              "--sharding fsdp2 --offload optimizer+params")
        precision = config.precision
        # QLoRA at *-mixed too: under the FSDP-QLoRA recipe every base parameter is 16-bit already
        # (``qlora_refusal``), so accelerate's MixedPrecision casts only the adapters' units
        if precision.is_mixed and config.method.value != "qlora":
            return lambda: UnsupportedError(
                f"--precision {precision} with FSDP1: accelerate's MixedPrecision for FSDP1 (parameters, reductions "
                "and buffers in one 16-bit dtype, under autocast) is not modelled: use --precision "
                f"{precision.value.split('-')[0]} (16-bit weights, as fms-hf-tuning runs), or --sharding fsdp2")
        optimizer = config.optimizer
        if optimizer not in _TORCH_OPTIMIZERS:
            return lambda: UnsupportedError(f"--optimizer {optimizer} with FSDP1 is not modelled: use "
                                            f"{names(_TORCH_OPTIMIZERS)}")
        return qlora_refusal(config, offload, self.name)

    def streams(self, config: Any) -> tuple[tuple[str, str], ...]:
        """The gathered units on the unshard stream, the sharded gradients on the post-backward
        stream (``_streams``); on one GPU FSDP1 runs NO_SHARD (torch 2.13 fsdp/_init_utils.py:430-433:
        "FSDP is switching to use `NO_SHARD`"): nothing gathered, autograd's gradients all-reduced in
        place, all on the default stream."""
        return _streams() if config.gpus > 1 else ()

    def searched_on(self, gpus: int, offload: Offload) -> bool:
        return False  # chosen by name only: FSDP2 is the FSDP the search plans

    def memory_twin(self, gpus: int) -> str:
        # its memory terms are FSDP2's (the module's docstring) but for ``retained_in_backward``, which the
        # search's batch key holds apart (``planner.memory.step.line_reads``)
        return "fsdp2"

    def retained_in_backward(self, model: Any, config: Any, *, residual_bytes: int) -> int:
        """Each frozen layer's input gradient under a reentrant checkpoint around its unit
        (``retained_input_gradient``, ``TrainConfig.reentrant_ckpt``)."""
        return retained_input_gradient(model, config, reentrant_around_unit=config.reentrant_ckpt,
                                       residual_bytes=residual_bytes)

    # ---- throughput -------------------------------------------------------------------------
    def comm_bytes(self, config: Any, *, trainable: int, params_total: int, grad_bytes: int, quantized: int = 0,
                   packed: float = 0.0) -> float:
        """FSDP2's bytes, and under a reentrant checkpoint around each unit (``TrainConfig.reentrant_ckpt``:
        transformers 4's model loop calls the FSDP-wrapped layer inside it) a third all-gather of every unit a
        micro-step: the checkpoint's backward reruns the unit's forward, whose pre-forward gathers it and whose
        post-forward frees it again (FULL_SHARD reshards after forward unless the state is BACKWARD_PRE: torch
        2.4.1 fsdp/_runtime_utils.py ``_post_forward``), then the recomputed outputs' pre-backward hook gathers it
        for its backward. Inside the unit (transformers 5's checkpoint) the recompute runs on the parameters
        the backward gathered: two."""
        total = super().comm_bytes(config, trainable=trainable, params_total=params_total, grad_bytes=grad_bytes,
                                   quantized=quantized, packed=packed)
        if config.grad_ckpt and config.reentrant_ckpt:
            gathered = self.gathered_bytes(config, params_total=params_total, quantized=quantized, packed=packed)
            total += ring(config.gpus) * gathered * config.grad_accum
        return total

    def host_seconds(self, model: Any, config: Any, *, adapted_modules: int,
                     layer_of: Callable[[tuple[float, float]], Layer | None] | None = None) -> float:
        """Host seconds per optimizer step its units add on the step's path (more than one GPU): each
        LoRA adapter unit's all-gathers, each ``UNSHARD_HOST_SECONDS`` after the rate limiter's wait.
        An adapter's own kernels (rank-r products, microseconds) cannot cover that time; a decoder
        layer's GEMMs (milliseconds) cover its own unit's, which is not counted. Under QLoRA, given a
        device's decoder layer (``layer_of``), the share of the 4-bit bases' host time that runs while
        the rate limiter has the device drained (``linear4bit_exposed_seconds``)."""
        units = UNITS_PER_ADAPTED_LINEAR * adapted_modules
        unshards = units * unshards_per_micro_step(config) * UNSHARD_HOST_SECONDS
        return (unshards + linear4bit_exposed_seconds(model, config, layer_of)) * config.grad_accum

    # ---- files ------------------------------------------------------------------------------
    def fsdp_settings(self, config: Any) -> dict[str, Any]:
        """The FSDP1 settings of both launchers, by the names of transformers' ``fsdp_config``
        (transformers 5 training_args.py ``_process_fsdp_args``, its FSDP1 branch)."""
        return {
            "version": 1,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "reshard_after_forward": "full_shard",  # FSDP1's sharding strategy, by name
            "backward_prefetch": "BACKWARD_PRE",
            "forward_prefetch": False,
            "limit_all_gathers": True,  # the rate limiter whose host time ``host_seconds`` prices
            # accelerate's own default (utils/dataclasses.py: FSDP_USE_ORIG_PARAMS "False"); peft's
            # policy gives every unit one requires_grad, which flat parameters need then
            "use_orig_params": False,
            "cpu_offload": False,
            "state_dict_type": STATE_DICT_TYPE,
            "activation_checkpointing": bool(config.grad_ckpt),
            "cpu_ram_efficient_loading": True,
            "sync_module_states": True,
        }

    def accelerate(self, config: Any, *, on_cpu: bool) -> dict[str, Any]:
        """accelerate's ``fsdp_config`` section for FSDP1 (each key becomes the ``FSDP_*`` variable the
        plugin reads: accelerate utils/launch.py prepare_multi_gpu_env)."""
        names_ = {"version": "fsdp_version", "auto_wrap_policy": "fsdp_auto_wrap_policy",
                  "reshard_after_forward": "fsdp_reshard_after_forward",
                  "backward_prefetch": "fsdp_backward_prefetch", "forward_prefetch": "fsdp_forward_prefetch",
                  "use_orig_params": "fsdp_use_orig_params",
                  "cpu_offload": "fsdp_offload_params", "state_dict_type": "fsdp_state_dict_type",
                  "activation_checkpointing": "fsdp_activation_checkpointing",
                  "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
                  "sync_module_states": "fsdp_sync_module_states"}
        # limit_all_gathers has no launcher key: the plugin's default, True (utils/dataclasses.py)
        section = {names_[key]: value for key, value in self.fsdp_settings(config).items() if key in names_}
        # accelerate names FSDP1's strategy fsdp_sharding_strategy (FULL_SHARD); fsdp_reshard_after_forward
        # is FSDP2's boolean (commands/config/cluster.py)
        section["fsdp_sharding_strategy"] = section.pop("fsdp_reshard_after_forward").upper()
        return {"distributed_type": "FSDP", "fsdp_config": section}

    # ---- the worker -------------------------------------------------------------------------
    def worker_setup(self, model: Any, params: list, config: Any, *, device: str,
                     build_optimizer: Callable[[list], Any], hidden_size: int,
                     hyperparameters: dict[str, Any]) -> WorkerSetup:
        """``FullyShardedDataParallel`` with the policy the Trainer gives it: peft's for a peft model
        (each adapter and each decoder layer), else the decoder layers' classes; the optimizer on the
        flat parameters."""
        import functools

        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        layer_names = set(getattr(base, "_no_split_modules", None) or ())
        if not layer_names:
            raise InvalidConfigError(f"{type(base).__name__} names no _no_split_modules: FSDP1 has no decoder layer to wrap")
        if hasattr(model, "peft_config"):
            from peft.utils.other import fsdp_auto_wrap_policy

            policy = fsdp_auto_wrap_policy(model)
        else:
            classes = {type(m) for m in model.modules() if type(m).__name__ in layer_names}
            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
        # torch 2.13 fsdp/_init_utils.py _init_device_handle refuses a CPU module without device_id
        device_id = torch.device("cpu") if device == "cpu" else torch.device(device)
        engine = FullyShardedDataParallel(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                                          limit_all_gathers=True, use_orig_params=False, device_id=device_id,
                                          mixed_precision=_mixed_precision(config))
        units = sum(isinstance(m, FullyShardedDataParallel) for m in engine.modules())
        trainable = [p for p in engine.parameters() if p.requires_grad]
        # accelerate autocasts the forward at *-mixed as well: peft casts an adapter's input to the dtype
        # of its (sharded, fp32) weight before the adapter unit gathers it in 16 bits
        return WorkerSetup(engine=engine, optimizer=build_optimizer(trainable), autocast=config.precision.is_mixed,
                           details={"fsdp_units": units})


#: Where FSDP1 allocates what the keys count (torch 2.13 torch/distributed/fsdp/; only where a
#: tensor is allocated decides the pool its block returns to, ``ShardingSpec.streams``):
#:
#: * the padded unsharded flat parameters, of the running unit, the unit gathered ahead and the
#:   root (``fsdp2/gathered_unit``, ``fsdp2/root_and_gather_buffer``): ``_unshard`` allocates and
#:   all-gathers them on the unshard stream (_runtime_utils.py:304-306 ``with state._device_handle.
#:   stream(unshard_stream): handle.unshard()`` -> _flat_param.py:1408 ``_alloc_storage``), in
#:   forward (_runtime_utils.py:421) and for backward's prefetch (l.1233); the reshard frees them
#:   with ``record_stream`` on the default stream (_flat_param.py:1817-1821), which delays their
#:   blocks' reuse, not the stream they return to: the caching allocator takes a block so freed back
#:   once the default stream passes it (CUDACachingAllocator.cpp ``insert_events``, ``process_events``
#:   at each ``malloc``), which only the rate limiter's wait guarantees, and that waits for the free
#:   two back (_runtime_utils.py:298-303, _limiter_utils.py:15 ``_max_num_inflight_all_gathers = 2``,
#:   the event recorded after each free, l.324-326): a block freed comes back after the stream's next
#:   unshard (``allocator.RECORDED``), and backward's gather, the next after the forward's was freed at
#:   the loss, takes a block of its own (Mistral-7B in fp16: 0.41 GiB more reserved a device);
#: * the sharded gradients (``gradients``): the reduce-scatter output, ``torch.empty_like`` on the
#:   post-backward stream (_runtime_utils.py:755 ``with ...stream(state._post_backward_stream)``,
#:   l.901), kept as ``_saved_grad_shard`` (l.926) and handed to the optimizer as ``.grad``
#:   (_flat_param.py:1708) until ``zero_grad``;
#: * the reduce-scatter inputs (``fsdp2/reduce_scatter``, ``reduce_scatter_end``,
#:   ``root_reduce_scatter``): autograd's unsharded flat gradient, made on the default stream
#:   and kept for the post-backward stream by ``record_stream`` (_runtime_utils.py:772-774); only a
#:   flat parameter whose size the ranks do not divide gets a padded copy there (l.899, ``F.pad``):
#:   the default stream.
def _streams() -> tuple[tuple[str, str], ...]:
    return (("fsdp2/gathered_unit", "unshard" + RECORDED), ("fsdp2/root_and_gather_buffer", "unshard" + RECORDED),
            ("gradients", "post_backward"))


def _mixed_precision(config: Any) -> Any:
    """accelerate's FSDP1 policy at *-mixed (QLoRA only reaches it: ``refusal``): parameters, reductions
    and buffers in the 16-bit dtype (accelerate utils/dataclasses.py FullyShardedDataParallelPlugin
    ``set_mixed_precision``: ``param_dtype``, ``reduce_dtype`` and, for FSDP1, ``buffer_dtype`` all
    ``dtype``); None (no casts) otherwise."""
    if not config.precision.is_mixed:
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecision

    dtype = getattr(torch, config.precision.compute_dtype)
    return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)


SPECS = (
    FSDP1(name="fsdp1", order=6, searched=False, partitions_optimizer=True, unit_host=True, shards_4bit=True,
          partial_head="--fused-ce with FSDP1 is not modelled (the fused loss reads lm_head.weight outside the "
                       "module's forward): drop --fused-ce",
          casts_model=True, words="FSDP1", keys=_KEYS,
          plan_notes=(("FSDP1 as in accelerate's fsdp_config (fsdp_version 1): FULL_SHARD, limit_all_gathers, one unit "
                      "per decoder layer plus the root, and one per LoRA adapter (peft's fsdp_auto_wrap_policy)"),)),
)

__all__ = ["FSDP1", "LINEAR4BIT_HOST_SECONDS", "SPECS", "UNIT_HOOKS", "UNSHARD_HOST_SECONDS", "linear4bit_exposed_seconds", "retained_input_gradient", "retained_input_gradients", "unshards_per_micro_step"]
