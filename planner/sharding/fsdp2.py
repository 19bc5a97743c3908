"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): per-parameter sharding of the model's
units, one per decoder layer plus the root, as accelerate's TRANSFORMER_BASED_WRAP and the HF
Trainer apply it (the classes of transformers' ``_no_split_modules``, then the whole model).

What each rank keeps (N ranks; line numbers: torch 2.13 torch/distributed/fsdp/_fully_shard/):

* every parameter, trainable or frozen, as a dim-0 shard of ceil(rows / N) rows in its own dtype
  (``_fsdp_param.py`` ``_init_sharded_param``: ``padded_sharded_param = param.new_zeros(...)``):
  the fp32 sharded parameters ARE the master weights under the MixedPrecisionPolicy;
* the gradients of its shard, in the sharded parameter's dtype: the reduce-scatter's output
  viewed per parameter (``_fsdp_collectives.py`` foreach_reduce l.692-706: ``_to_dtype_if_needed
  (reduce_output, orig_dtype)``, ``torch.as_strided(reduce_output, ...)``);
* the optimizer's states of its shards (the optimizer steps the sharded DTensors);
* the root unit's parameters unsharded from the first forward to the end of backward: the root is
  not resharded after forward (``_fsdp_state.py`` l.203-207: ``post_forward_mesh_info = None``),
  its inputs (token ids) need no gradient so its post-backward runs in the final callback, with
  its gradients (lm_head's, the embedding's) unsharded until then;
* the running unit's parameters unsharded in the 16-bit ``param_dtype`` and one all-gather
  buffer beside them: in forward the flat all-gather output is kept until the next unit's copy-out
  (``_fsdp_param_group.py`` l.476-485 ``all_gather_state``, world size > 1), in backward the
  next unit is prefetched (``_fsdp_state.py`` ``_pre_backward``: default backward prefetch);
* in backward, the unit's unsharded 16-bit gradients and the previous unit's reduce-scatter
  input in ``reduce_dtype`` (fp32), which is kept until the next unit's reduce-scatter
  (``_fsdp_param_group.py`` l.648-659: ``reduce_scatter_max_input_buffers`` = 1);
* at the root's post-backward, its unsharded gradients and their fp32 reduce-scatter input
  (``_fsdp_collectives.py`` foreach_reduce l.597-610: ``reduce_scatter_input`` of the padded
  unsharded size in ``reduce_dtype``, filled by ``foreach_reduce_scatter_copy_in`` before the
  gradients are freed).

With ``CPUOffloadPolicy`` the shards, their gradients and the optimizer's states live in the host's
RAM and the optimizer steps there; the device holds what is gathered and reduced.

Under QLoRA (``shards_4bit``) the packed 4-bit weights are parameters like the others, sharded and
gathered as stored (``_qlora_weights``), their quantisation state whole on every rank.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from planner.errors import InvalidConfigError, PlannerError, UnsupportedError
from planner.memo import IdentityMemo
from planner.optim import OPTIMIZERS, Optimizer, names
from planner.optim.spec import FP32, HALF
from planner.sharding.spec import BreakdownKey, Offload, ShardingSpec, WorkerSetup, join_process_group, ring
from planner.units import format_bytes

#: peft keeps LoRA's adapters in fp32 (planner.memory.dtypes.ADAPTER_BYTES, which sits above this layer)
ADAPTER_BYTES = FP32

#: the optimizers FSDP2's DTensor parameters take: torch's own (``torch.optim`` steps DTensors
#: through their local shards); bitsandbytes' read the parameter's storage directly
_TORCH_OPTIMIZERS = tuple(o for o in Optimizer if OPTIMIZERS[o].library is None)

#: the state-dict type the emitted configs save with: each rank writes its shards (accelerate's
#: default for FSDP2, utils/dataclasses.py FullyShardedDataParallelPlugin)
STATE_DICT_TYPE = "SHARDED_STATE_DICT"


def shard(size: int, gpus: int) -> int:
    """Elements of one rank's shard of a tensor of ``size`` elements: dim 0 is split into
    ceil(rows / N) rows and padded (``_fsdp_param.py`` ``_init_sharded_param``); the model's
    tensor sizes carry no row count, so the padding is taken on the elements (at most one row
    of difference)."""
    return math.ceil(size / gpus)


def root_params(model: Any) -> int:
    """Parameters of the root unit: what no decoder layer holds (embeddings, their norm, the final
    norm, the output head when untied)."""
    head = model.head_params if not model.tied_embeddings else 0
    return model.embedding_params + model.other_embedding_params + model.final_norm_params + head


def head_params(model: Any) -> int:
    """The root's parameters whose gradients its head's backward makes first (lm_head, the final
    norm; a tied head's is the embedding's)."""
    return model.head_params + model.final_norm_params


def unit_bytes(model: Any, *, compute: int, adapters_per_layer: int) -> int:
    """Bytes of one decoder layer unsharded in the compute dtype, its adapters included."""
    layer = (model.params_total - root_params(model)) // max(1, model.num_layers)
    return (layer + adapters_per_layer) * compute


def _trained_bytes(config: Any) -> int:
    """Bytes per element of what trains, its gradients and its optimizer states: the sharded
    parameter's dtype (fp32 under *-mixed), fp32 adapters for LoRA."""
    return config.precision.weight_bytes if not config.method.uses_adapters else ADAPTER_BYTES


def _compute(config: Any, weight: int) -> int:
    """Bytes per element of what FSDP2 gathers: the MixedPrecisionPolicy's 16-bit ``param_dtype``
    under ``*-mixed``, else the parameters' own dtype."""
    return HALF if config.precision.is_mixed else weight


def _reduce(config: Any, weight: int) -> int:
    """Bytes per element of the reduce-scatter: ``reduce_dtype`` fp32 under ``*-mixed`` (the
    policy the emitted configs and the worker use), else the gradients' own dtype."""
    return FP32 if config.precision.is_mixed else weight


#: (sizes tuple, ranks) -> the sum of each tensor's shard: the search asks for the same model's
#: tensors, sharded over the same ranks, once per static key (hundreds of times a request; 291
#: tensors for Llama-2-7b)
_SHARDS = IdentityMemo(kept=64)
#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow
#: attribute path on CPython 3.11 (``planner.config``'s note), and the search reads it per static key
_NO_OFFLOAD = Offload.NONE


def _sharded_total(sizes: tuple[int, ...], n: int) -> int:
    """The elements of each tensor's shard on one of ``n`` ranks (``shard``), summed: remembered
    per tuple and rank count."""
    hit = _SHARDS.get(sizes, n)
    return hit if hit is not None else _SHARDS.put(sizes, n, sum([shard(s, n) for s in sizes]))


def _qlora_weights(out: dict[str, int], n: int, packed: float) -> dict[str, int]:
    """QLoRA's base weights on one of ``n`` ranks (``out``: as one process holds them). The packed
    4-bit codes are a float tensor of the ``bnb_4bit_quant_storage`` dtype (bitsandbytes 0.50.2
    backends/default/ops.py:257-258 views the packed bytes as it), so FSDP shards and gathers them as
    any parameter: 1/N each. Their quantisation state (absmax, the nested absmax and codes) is no
    parameter or buffer: bitsandbytes keeps it on the module (nn/modules.py:391-393 ``_quantize``:
    ``self.module.quant_state = quant_state``) and gives it back to the weight FSDP's flattening
    replaced (:487-501 ``fix_4bit_weight_quant_state_from_module``: "the quant state got lost when the
    parameter got converted. This happens for example for fsdp"), so each rank holds all of it. The
    other tensors (norms, embeddings, head) are sharded in the 16-bit dtype they were loaded in."""
    state = out["weights/nf4"] - packed
    return {"weights/nf4": int(math.ceil(packed / n) + state), "weights/unquantized": -(-out["weights/unquantized"] // n)}


def qlora_refusal(config: Any, offload: Offload, scheme: str) -> Callable[[], PlannerError] | None:
    """FSDP's refusal of a QLoRA configuration it does not model (None: not QLoRA, or modelled). Modelled:
    the FSDP-QLoRA recipe (bitsandbytes docs/source/fsdp_qlora.md; peft docs accelerate/fsdp.md), whose
    non-4-bit parameters stay in the 16-bit dtype the model loads in (``bnb_4bit_quant_storage`` the
    same): TRL's SFTTrainer skips peft's k-bit preparation under FSDP (trl v0.13.0
    trl/trainer/sft_trainer.py:182-231). peft's upcast (``kbit_upcast``, peft 0.21 utils/other.py:204-209)
    casts the norms to fp32 beside the 16-bit-stored 4-bit weights, which FSDP1 cannot flatten into one
    flat parameter (torch 2.13 fsdp/_flat_param.py:814: "Must flatten tensors with uniform dtype")."""
    if config.method.value != "qlora":
        return None
    if config.kbit_upcast:
        return lambda: UnsupportedError(
            f"--method qlora with --sharding {scheme} and peft's k-bit upcast (fp32 norms beside the 16-bit-stored "
            "4-bit weights) is not modelled: add --no-kbit-upcast (the FSDP-QLoRA recipe: TRL's SFTTrainer skips the "
            "upcast under FSDP), or use --zero 2")
    if offload is not Offload.NONE:
        return lambda: UnsupportedError(f"--method qlora with --sharding {scheme} and --offload is not modelled: "
                                        "use --offload none")
    return None


class FSDP2(ShardingSpec):
    """FSDP2: every unit's parameters sharded over the ranks, gathered for its forward and
    backward, its gradients reduce-scattered after its backward."""

    # ---- words ------------------------------------------------------------------------------
    def label(self, offload: Offload) -> str:
        return self.name + ("+offload:cpu" if offload is not Offload.NONE else "")

    def short(self, offload: Offload) -> str:
        return self.name + ("+cpu" if offload is not Offload.NONE else "")

    def offload_words(self, offload: Offload) -> str:
        return "parameters, gradients and optimizer states offloaded to CPU RAM (CPUOffloadPolicy)" \
            if offload is not Offload.NONE else "no offload"

    def plan_line(self, offload: Offload) -> str:
        return f"FSDP2 (fully_shard, one unit per decoder layer + root), {self.offload_words(offload)}"

    def cast_words(self, dtype: str) -> tuple[str, str]:
        # _fsdp_param.py init_dtype_attrs / _init_sharded_param: the sharded parameters keep their
        # own dtype, the all-gather casts them to MixedPrecisionPolicy.param_dtype
        return (f"FSDP2's MixedPrecisionPolicy: fp32 sharded weights (the master weights), each unit gathered in "
                f"{dtype} for its forward and backward (param_dtype), gradients reduce-scattered in fp32 (reduce_dtype)",
                f"loaded in fp32; FSDP2 keeps the fp32 shards and gathers them in {dtype} (MixedPrecisionPolicy in fsdp_config)")

    def notes(self, config: Any, offload: Offload, *, host_bytes: int) -> list[str]:
        notes = ["FSDP2 keeps the root unit (embeddings, output head) unsharded from forward to the end of "
                 "backward (torch fsdp/_fully_shard/_fsdp_state.py _lazy_init: the root is not resharded after forward)"]
        if offload is not Offload.NONE:
            notes.append(f"CPU offload: {format_bytes(host_bytes)} host RAM per GPU, the optimizer steps on the CPU "
                         "and every unit's shards cross PCIe twice a micro-step (torch CPUOffloadPolicy)")
        return notes

    # ---- validation -------------------------------------------------------------------------
    def refusal(self, config: Any, offload: Offload) -> Callable[[], PlannerError] | None:
        if offload not in self.offloads:
            return lambda: InvalidConfigError("--sharding fsdp2 offloads parameters, gradients and optimizer states "
                                              "together: use --offload optimizer+params (CPUOffloadPolicy) or none")
        if config.precision.value == "fp16-mixed":
            return lambda: UnsupportedError("--precision fp16-mixed with FSDP2 needs a sharded gradient scaler the plan "
                                            "does not model: use bf16-mixed (or fp32)")
        optimizer = config.optimizer
        if optimizer not in _TORCH_OPTIMIZERS:
            return lambda: UnsupportedError(f"--optimizer {optimizer} with FSDP2: bitsandbytes' optimizers do not step "
                                            f"FSDP2's sharded DTensor parameters, use {names(_TORCH_OPTIMIZERS)}")
        return qlora_refusal(config, offload, self.name)

    # ---- memory -----------------------------------------------------------------------------
    def model_states(self, model: Any, config: Any, t: Any, out: dict[str, int], *, param_bytes: int, grads: int,
                     base_sizes: tuple[int, ...], quantized: int = 0,
                     packed: float = 0.0) -> tuple[dict[str, int], int]:
        """``casts_model`` gives the 16-bit model's dtype mode (the unsharded parameters the layers
        compute with are ``param_dtype``, no autocast copies), so the stored dtypes are read from
        the precision here, not from ``out`` or ``param_bytes``. Under QLoRA (``shards_4bit``),
        ``quantized`` and ``packed``: the 4-bit weights' element count and packed bytes."""
        n, offloaded = config.gpus, config.sharding.offload is not _NO_OFFLOAD
        full = not config.method.uses_adapters
        weight = config.precision.weight_bytes  # the sharded parameters' dtype: fp32 under *-mixed
        trained_bytes = _trained_bytes(config)
        compute, reduce = _compute(config, weight), _reduce(config, weight)
        host = 0
        # every base parameter sharded in its own dtype (fp32 master under *-mixed); QLoRA's as loaded
        states = _qlora_weights(out, n, packed) if quantized else {"weights": _sharded_total(base_sizes, n) * weight}
        # each trained tensor's shard, by the few distinct tensor sizes (``Trained.size_counts``)
        shard_counts = [(shard(size, n), count) for size, count in t.size_counts]
        trained_shards = sum([size * count for size, count in shard_counts])
        if config.method.uses_adapters:
            states["lora/weights"] = trained_shards * ADAPTER_BYTES
        states["gradients"] = trained_shards * trained_bytes
        optimizer = OPTIMIZERS[config.optimizer].memory
        states["optimizer_states"] = optimizer.counted_state_bytes(shard_counts, trained_bytes)
        if offloaded:
            host = sum(states.values())
            states = {}
        root = root_params(model)
        root_trainable = root if full else 0
        per_layer = max(1, model.num_layers)
        trainable_unit = (t.count - root_trainable) // per_layer
        unit = unit_bytes(model, compute=compute, adapters_per_layer=0 if full else trainable_unit)
        if quantized:  # a layer's 4-bit weights are gathered packed, as stored (no cast: the storage dtype is param_dtype)
            unit += math.ceil(packed / per_layer) - quantized // per_layer * compute
        # the running unit unsharded; and, from the first unshard to the end of backward, the root
        # unsharded and one all-gather output (forward: the last one, kept until the next unit's
        # copy-out; backward: the prefetched unit's, made as soon as backward starts, by the root's
        # pre-backward, before any unit is copied out: measured on 2 CPU ranks, LoRA's peak at the
        # loss' backward holds it, 1,598,976 B); one rank copies into the unsharded tensors, no
        # buffer kept
        states[self.step_key("gathered")] = unit
        states[self.step_key("held")] = root * compute + (unit if n > 1 else 0)
        # backward: this unit's unsharded 16-bit gradients and the previous unit's fp32
        # reduce-scatter input; the head's gradients wait unsharded in the root
        head = head_params(model) * compute if full else 0
        states[self.step_key("reducing")] = trainable_unit * (compute + reduce) + head
        # the end of backward: every root gradient unsharded and the last unit's reduce-scatter input
        states[self.step_key("reducing_end")] = trainable_unit * reduce + root_trainable * compute
        # the root's post-backward: its fp32 reduce-scatter input (the output is its gradient
        # shard, in "gradients"), the head's unsharded gradient still referenced (measured on the
        # CPU: lm_head's 16-bit gradient is alive there, the embedding's is freed by the copy-in),
        # and on the CPU gloo's copy of the input (ProcessGroupGloo _reduce_scatter_base clones it:
        # measured, "aten::clone < c10d::_reduce_scatter_base_")
        states[self.step_key("gradient_flatten")] = root_trainable * reduce + head
        # gloo's copy of the root's input, alive while its reduce-scatter runs; the last unit's
        # copy is gone by then (its work is dropped as soon as gloo has run it: on 2 CPU ranks the
        # allocator read it still live only where gloo's thread let go last, a free c10 does not
        # report, 84,148,608 B against 81,246,592; the dispatch count read 81,246,580 every time)
        states[_GLOO_COPY] = root_trainable * reduce
        return states, host

    def streams(self, config: Any) -> tuple[tuple[str, str], ...]:
        """The sharded gradients on the reduce-scatter stream (``_STREAMS``)."""
        return _STREAMS

    def optimizer_tensors(self, t: Any, config: Any, param_bytes: int) -> tuple[tuple[tuple[int, int], ...], int] | None:
        if config.sharding.offload is not _NO_OFFLOAD:
            return None  # the optimizer steps the host's shards
        n = config.gpus
        return tuple([(shard(size, n), count) for size, count in t.size_counts]), _trained_bytes(config)

    def optimizer_gradients(self, t: Any, config: Any, device_grads: int) -> int:
        return 0 if config.sharding.offload is not _NO_OFFLOAD else device_grads

    def searched_on(self, gpus: int, offload: Offload) -> bool:
        """Where it shards something (more than one GPU), or on one GPU where its CPU offload lets a
        model fit that does not otherwise."""
        return super().searched_on(gpus, offload) and (gpus > 1 or offload is not Offload.NONE)

    # ---- throughput -------------------------------------------------------------------------
    def comm_bytes(self, config: Any, *, trainable: int, params_total: int, grad_bytes: int, quantized: int = 0,
                   packed: float = 0.0) -> float:
        """Every micro-step all-gathers every parameter for the forward and again for the backward
        (reshard_after_forward; a checkpointed unit's recompute runs on the parameters its backward
        gathered: ``_fsdp_state.py`` _pre_forward returns early in PRE_BACKWARD) in the compute
        dtype, and reduce-scatters the trainable gradients in the reduce dtype (fp32 under
        *-mixed): (n-1)/n · (2 · params · compute + trainable · reduce) per micro-step. Under
        QLoRA (``shards_4bit``) the ``quantized`` weights are gathered as their ``packed`` bytes;
        their quantisation state, on every rank already (``_qlora_weights``), is not gathered."""
        rb = FP32 if config.precision.is_mixed else config.precision.compute_bytes
        gathered = self.gathered_bytes(config, params_total=params_total, quantized=quantized, packed=packed)
        return ring(config.gpus) * (2 * gathered + trainable * rb) * config.grad_accum

    def gathered_bytes(self, config: Any, *, params_total: int, quantized: int = 0, packed: float = 0.0) -> float:
        """Bytes of one all-gather of every unit (before the ring's share): the parameters in the compute
        dtype, the ``quantized`` ones as their ``packed`` bytes."""
        return (params_total - quantized) * config.precision.compute_bytes + packed

    def offload_bytes(self, config: Any, offload: Offload, *, trainable: int, params_total: int) -> float:
        """CPUOffloadPolicy: each unit's shards are copied to the device for its forward and its
        backward (``_fsdp_param.py`` all_gather_inputs: ``sharded_local_tensor.to(self.device)``), the
        reduced gradient shards go back to the host (foreach_reduce: ``to("cpu", non_blocking=True)``),
        every micro-step."""
        if offload is Offload.NONE:
            return 0.0
        n, w = config.gpus, config.precision.weight_bytes
        rb = FP32 if config.precision.is_mixed else config.precision.compute_bytes
        return (2 * params_total / n * w + trainable / n * rb) * config.grad_accum

    # ---- files ------------------------------------------------------------------------------
    def fsdp_settings(self, config: Any) -> dict[str, Any]:
        """The FSDP2 settings of both launchers, by the names of transformers' ``fsdp_config``
        (transformers 5 training_args.py ``_process_fsdp_args``)."""
        return {
            "version": 2,
            # the classes of the model's _no_split_modules (accelerate utils/dataclasses.py
            # FullyShardedDataParallelPlugin: TRANSFORMER_BASED_WRAP reads them when no class is named)
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "reshard_after_forward": True,
            "cpu_offload": config.sharding.offload is not Offload.NONE,
            "state_dict_type": STATE_DICT_TYPE,
            # FSDP's own checkpointing of each unit (the model's as well would gather twice:
            # transformers warns, issue 30404); the memory is the same non-reentrant checkpoint per layer
            "activation_checkpointing": bool(config.grad_ckpt),
            "cpu_ram_efficient_loading": True,
        }

    def training_arguments(self, config: Any) -> dict[str, Any]:
        """``fsdp`` and ``fsdp_config`` (transformers 5: ``fsdp=True``, everything else in the
        config); checkpointing is FSDP's, not the model's."""
        out: dict[str, Any] = {"fsdp": True, "fsdp_config": self.fsdp_settings(config)}
        if config.grad_ckpt:
            out["activation_checkpointing"] = False
            out["activation_checkpointing_kwargs"] = None
        return out

    def accelerate(self, config: Any, *, on_cpu: bool) -> dict[str, Any]:
        """accelerate's ``fsdp_config`` section (``accelerate launch`` turns each key into the
        ``FSDP_*`` variable the plugin reads: accelerate utils/launch.py prepare_multi_gpu_env);
        its CPU-efficient loading needs ``fsdp_sync_module_states``."""
        names = {"version": "fsdp_version", "auto_wrap_policy": "fsdp_auto_wrap_policy",
                 "reshard_after_forward": "fsdp_reshard_after_forward", "cpu_offload": "fsdp_offload_params",
                 "state_dict_type": "fsdp_state_dict_type", "activation_checkpointing": "fsdp_activation_checkpointing",
                 "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading"}
        section = {names[key]: value for key, value in self.fsdp_settings(config).items()}
        return {"distributed_type": "FSDP", "fsdp_config": section | {"fsdp_sync_module_states": True}}

    # ---- the worker -------------------------------------------------------------------------
    def worker_init(self, device: str) -> None:
        join_process_group(device)

    def worker_setup(self, model: Any, params: list, config: Any, *, device: str,
                     build_optimizer: Callable[[list], Any], hidden_size: int,
                     hyperparameters: dict[str, Any]) -> WorkerSetup:
        """``fully_shard`` on each decoder layer (the classes of ``_no_split_modules``), then on the
        whole model, as accelerate's ``fsdp2_prepare_model`` does; the optimizer is built on the
        sharded parameters (fully_shard replaces every parameter by a DTensor one)."""
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mixed = config.precision.is_mixed
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, config.precision.compute_dtype),
                                      reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
        offload = CPUOffloadPolicy(pin_memory=device != "cpu") if config.sharding.offloaded else OffloadPolicy()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        layer_classes = set(getattr(base, "_no_split_modules", None) or ())
        if not layer_classes:
            raise InvalidConfigError(f"{type(base).__name__} names no _no_split_modules: FSDP2 has no decoder layer to wrap")
        kwargs = dict(mp_policy=policy, offload_policy=offload)
        units = [m for m in model.modules() if type(m).__name__ in layer_classes]
        for module in units:
            fully_shard(module, reshard_after_forward=True, **kwargs)
        # the root takes torch's default, not resharded after forward (_fully_shard.py l.246,
        # _fsdp_state.py l.203-207), as accelerate leaves it (utils/fsdp_utils.py
        # fsdp2_prepare_model: root_kwargs without reshard_after_forward); passing True would
        # free its parameters after the forward and gather them again as backward starts
        fully_shard(model, **kwargs)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return WorkerSetup(engine=model, optimizer=build_optimizer(trainable), autocast=False,
                           details={"fsdp_units": len(units) + 1})


#: gloo's copy of the root's reduce-scatter input (the CPU only)
_GLOO_COPY = "fsdp2/gloo_reduce_scatter_copy"
#: the scheme's breakdown keys: its buffers, each a flat tensor per unit
_KEYS = (
    BreakdownKey(_GLOO_COPY, "temporaries", size="gradient_flatten", gloo_only=True),
    BreakdownKey("fsdp2/gathered_unit", "weights", size="gathered"),
    BreakdownKey("fsdp2/root_and_gather_buffer", "weights", size="held"),
    BreakdownKey("fsdp2/reduce_scatter", "gradients", size="reducing"),
    BreakdownKey("fsdp2/reduce_scatter_end", "gradients", size="reducing_end"),
    BreakdownKey("fsdp2/root_reduce_scatter", "temporaries", size="gradient_flatten"),
)

#: Where FSDP2 allocates what its keys count (torch 2.13 torch/distributed/fsdp/_fully_shard/; only
#: where a tensor is allocated decides the pool its block returns to, ``ShardingSpec.streams``):
#:
#: * the sharded gradients (``gradients``): the reduce-scatter output, allocated in the
#:   reduce-scatter stream (_fsdp_collectives.py:611-612 ``with device_handle.stream(
#:   reduce_scatter_stream): reduce_output = reduce_scatter_comm.allocate(...)``; without HSDP the
#:   post-reduce stream is that stream, where a cast to the parameters' dtype is made, l.685-696),
#:   each parameter's gradient a view of it (l.704 ``torch.as_strided``), kept by the sharded
#:   parameters until the optimizer's ``zero_grad`` (l.763-766); on one rank too (its copy, l.625-631);
#: * the gathered unit (``fsdp2/gathered_unit``): the unsharded parameters are the copy-out's
#:   outputs, allocated on the current (default) stream by ``wait_for_unshard``
#:   (_fsdp_param_group.py:463 ``foreach_all_gather_copy_out`` -> _fsdp_collectives.py:463
#:   ``alloc_all_gather_outputs``, _fsdp_param.py:823-825; one rank: _fsdp_param_group.py:455);
#: * the root and the all-gather buffer (``fsdp2/root_and_gather_buffer``): the root's unsharded
#:   parameters on the default stream, as above; the flat all-gather output on the all-gather
#:   copy-in stream (_fsdp_collectives.py:336-351, the streams of _fsdp_param_group.py:116-124 in
#:   forward and pre-backward). One key, mostly the root's (Mistral-7B: 0.52 GB of embeddings and
#:   head against a 0.44 GB layer): left on the default stream;
#: * the reduce-scatter inputs (``fsdp2/reduce_scatter``, ``reduce_scatter_end``,
#:   ``root_reduce_scatter``): allocated on the current stream before the switch to the
#:   reduce-scatter stream (_fsdp_collectives.py:597-601), beside autograd's unsharded gradients
#:   (default stream).
_STREAMS = (("gradients", "reduce_scatter"),)

SPECS = (
    # casts_model: the layers compute with the 16-bit unsharded parameters, no autocast
    FSDP2(name="fsdp2", order=5, offloads=(Offload.NONE, Offload.OPTIMIZER_PARAMS), partitions_optimizer=True,
          shards_4bit=True,
          partial_head="--fused-ce with FSDP2 is not modelled (the fused loss reads lm_head.weight outside the "
                       "module's forward): drop --fused-ce",
          casts_model=True,
          words="FSDP2", keys=_KEYS,
          plan_notes=("FSDP2 as in fsdp_config: one unit per decoder layer plus the root, reshard_after_forward, "
                      "MixedPrecisionPolicy(param_dtype 16-bit, reduce_dtype fp32)",)),
)

__all__ = ["FSDP2", "SPECS", "STATE_DICT_TYPE", "head_params", "qlora_refusal", "root_params", "shard", "unit_bytes"]
