"""What a descriptor of a sharding scheme holds: ``ShardingSpec``, and the offload it may add.

One ``ShardingSpec`` per scheme (``planner.sharding.<module>``) carries every fact the planner uses
about how the model states are spread over the data-parallel ranks: its memory terms (what each
rank keeps of the weights, gradients and optimizer states, its buffers, its host RAM), its
communication and host-copy traffic, the files a run of it needs (DeepSpeed's ``ds_config``), the
library the worker sets it up with, the combinations it refuses, its values on the search's axis
and its words. Like ``planner.optim``, this package sits below ``planner.config`` (whose
``TrainConfig`` holds a ``Sharding`` value): the descriptors import nothing of the planner above
the foundation, and read the configuration, the model (``planner.modelspec.ModelSpec``) and what
it trains (``planner.memory.parameters.Trained``) through the arguments they are given.
"""

from __future__ import annotations

import enum
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

from planner.errors import InvalidConfigError, PlannerError
from planner.optim import OPTIMIZERS

#: The end of a side stream's name (``ShardingSpec.streams``, the allocator replay's ``streams``) whose
#: tensors are freed with ``record_stream`` on the compute stream and reused once a rate limiter has waited for that
#: stream: each freed block returns to its pool only after the stream's next allocation. The caching
#: allocator's ``free`` of a block with ``stream_uses`` records an event on each stream used
#: (``insert_events``) and ``process_events``, at the start of every ``malloc``, returns the block
#: only once ``cudaEventQuery`` says the stream passed it (CUDACachingAllocator.cpp). Who frees so,
#: and why one allocation, is the sharding scheme's to say (``planner.sharding.fsdp1``); the replay
#: (``planner.memory.allocator``) holds such blocks back.
RECORDED = ":recorded"


class Offload(enum.StrEnum):
    """What a scheme moves to the host's RAM (the CPU steps the optimizer there)."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    OPTIMIZER_PARAMS = "optimizer+params"


def ring(n: int) -> float:
    """Fraction of a tensor each rank sends in a ring reduce-scatter or all-gather: (n-1)/n."""
    return (n - 1) / n


@dataclass(frozen=True, slots=True)
class BreakdownKey:
    """A breakdown key a scheme adds to the memory model's breakdown, with what the picture and
    the allocator replay need to know of it (``planner.memory.timeline``)."""

    key: str
    """The key, as the breakdown shows it (``zero/reduce_bucket``)."""
    category: str
    """The picture's category (``planner.memory.timeline.CATEGORIES``: ``weights``,
    ``gradients``, ``temporaries``, ...)."""
    size: str | None = None
    """The step's part it counts (the ``StaticSizes`` field ``planner.memory.step.MOMENTS`` reads
    for a ``SCHEME`` part: ``gathered``, ``gradient_flatten``), None for a model state."""
    tensors: int | None = None
    """How many tensors it is when it is always as many (one flat buffer: 1); None: the
    replay's default (one per parameter tensor for a model state)."""
    tensor_bytes: int | None = None
    """Else, the bytes of one of its tensors at most (DDP's 25 MiB buckets)."""
    gloo_only: bool = False
    """A copy only gloo's collectives make (the CPU's process group), not NCCL's: counted on a
    device without the CUDA caching allocator (``KernelProfile.caching_allocator``) only."""


@dataclass(frozen=True, kw_only=True)
class WorkerSetup:
    """What a scheme's ``worker_setup`` hands the measurement worker (``workers.train``) to train
    with: the module to call, the optimizer, and how the loop drives them."""

    engine: Any
    """What the loop calls for the forward (the model, or the library's wrapper of it)."""
    optimizer: Any
    """The optimizer the loop steps (or the library's, when ``engine_steps``)."""
    autocast: bool
    """The loop runs the forward under ``torch.autocast`` (``*-mixed`` without a library that
    casts the model itself)."""
    engine_steps: bool = False
    """The engine scales, steps and zeroes itself (``engine.backward(loss)``, ``engine.step()``
    every micro-step: DeepSpeed)."""
    details: dict[str, Any] = field(default_factory=dict)
    """What the run's details report of the setup (the library's config)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now (the OS picks it): a process group's
    rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_process_group(device: str, init: Callable[[str], None] | None = None) -> None:
    """Join the run's ``torch.distributed`` process group (gloo on the CPU, NCCL on a GPU): the
    launcher's (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment,
    as torchrun and ``workers.ranks`` set them) or, without one, a group of one rank on a free
    local port. ``init``: the library's own init (``deepspeed.init_distributed``), called with
    the backend; else ``torch.distributed.init_process_group``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # an in-process run after another in the same process: the group outlives the first run,
        # whose launcher variables workers.runner put back as it found them; DeepSpeed reads the
        # rank from the environment (deepspeed/comm: "requires the LOCAL_RANK environment
        # variable"), so say the existing group's
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    backend = "gloo" if device == "cpu" else "nccl"
    if init is not None:
        init(backend)
    else:
        dist.init_process_group(backend=backend)


#: ``ShardingSpec.step_key`` by (scheme, part): a scheme hashes by identity (eq=False), and the
#: registry's few schemes and parts keep it small
_STEP_KEYS: dict[tuple[ShardingSpec, str], str] = {}


@dataclass(frozen=True, kw_only=True, eq=False)
class ShardingSpec:
    """Everything the planner knows about one sharding scheme, read by name from
    ``planner.sharding``. The methods' defaults are a scheme that shards nothing (one process:
    every rank holds the whole model, its gradients and its optimizer states); a scheme overrides
    what it changes. ``config`` is a ``TrainConfig``, ``t`` a ``planner.memory.parameters.Trained``
    of ``model`` (a ``ModelSpec``)."""

    name: str
    """The scheme's name: ``Sharding.scheme``, the API's and stored payloads' spelling."""
    order: int
    """Its place in the registry: the order of the search's axis, the help and the errors."""
    zero_stage: int | None = None
    """The ``--zero`` stage that names it (0: no DeepSpeed); None for a scheme ``--zero`` does not
    name (the stored payload then names the scheme)."""
    offloads: tuple[Offload, ...] = (Offload.NONE,)
    """The offloads it takes, in the order the search tries them."""
    searched: bool = True
    """``suggest`` tries it (with each of its ``offloads`` when the space allows offload)."""
    replicas: bool = False
    """It keeps whole replicas (no sharding library): the scheme is DDP on more than one GPU and
    plain one-process training on one (``planner.sharding.for_gpus``)."""
    library: str | None = None
    """The package a run of it needs beyond torch, transformers and accelerate (None: none)."""
    casts_model: bool = False
    """The library casts the model to its 16-bit communication dtype under mixed precision
    (DeepSpeed does), so no fp32 weights and no autocast weight copies
    (``planner.memory.dtypes.dtype_mode``)."""
    linear_saves_input: bool = False
    """Its linear layers save their input for backward whether the weight trains or not (DeepSpeed
    ZeRO-3's ``LinearFunctionForZeroStage3``, runtime/zero/linear.py: ``ctx.save_for_backward(input,
    weight, bias)``), so a frozen output head keeps its input (``planner.memory.activations``)."""
    flat_optimizer: bool = False
    """The optimizer steps one flat fp32 partition per rank (DeepSpeed's
    ``single_partition_of_fp32_groups``), not the model's tensors."""
    partitions_optimizer: bool = False
    """Each rank steps only its 1/N of the trainable parameters."""
    partial_head: str | None = None
    """Outside the output head's forward a rank holds only a partition of its weight, so a loss
    that reads the weight there (a fused linear cross-entropy) cannot run: the refusal with its fix,
    which ``TrainConfig`` gives for that combination (None: the whole weight is there)."""
    words: str = "not used"
    """What PLAN.md says of it (``planner.emit.plan_md``)."""
    plan_notes: tuple[str, ...] = ()
    """PLAN.md's assumptions of the run that come from the scheme (its buffers as emitted)."""
    keys: tuple[BreakdownKey, ...] = ()
    """The breakdown keys it adds (its buffers, its partitions), each declared once here."""
    unit_host: bool = False
    """Its units add host time to the step on more than one GPU (``host_seconds``), which the
    throughput asks it for then only."""
    shards_4bit: bool = False
    """Under QLoRA its units' flat parameters hold bitsandbytes' packed 4-bit weights (stored in the
    ``bnb_4bit_quant_storage`` dtype), which it shards and gathers like any other parameter:
    ``model_states`` is given their element count and packed bytes (``quantized``, ``packed``) and
    ``comm_bytes`` too; a scheme without it holds them whole (its ``model_states`` and
    ``comm_bytes`` are not given them)."""

    # ---- words ------------------------------------------------------------------------------
    def label(self, offload: Offload) -> str:
        """Its part of ``TrainConfig.label()`` ("" for none)."""
        return ""

    def short(self, offload: Offload) -> str:
        """Its cell in ``suggest``'s table ("" for none)."""
        return ""

    def offload_words(self, offload: Offload) -> str:
        """What PLAN.md says is offloaded."""
        return "no offload"

    def plan_line(self, offload: Offload) -> str:
        """PLAN.md's line on it (``DeepSpeed: ZeRO-2, no offload``; ``DeepSpeed: not used``)."""
        return f"DeepSpeed: {self.words}"

    def cast_words(self, dtype: str) -> tuple[str, str] | None:
        """Where it casts the model to 16 bits under mixed precision (``casts_model``): what
        PLAN.md says of the precision and the comment beside train.py's ``MODEL_DTYPE``, for the
        16-bit ``dtype`` ("bf16", "fp16"); None: it does not (autocast does the 16-bit compute)."""
        return None

    def notes(self, config: Any, offload: Offload, *, host_bytes: int) -> list[str]:
        """Its trade-offs as the plans show them, with their sources (``planner.tradeoffs``);
        ``host_bytes``: the host RAM the plan pins per rank."""
        return []

    # ---- validation -------------------------------------------------------------------------
    def check(self, config: Any, offload: Offload) -> None:
        """Raise ``InvalidConfigError``/``UnsupportedError`` (with the fix) for what the scheme
        does not take with the rest of ``config``: what ``refusal`` returns. Called last of
        ``TrainConfig``'s combination checks."""
        refused = self.refusal(config, offload)
        if refused is not None:
            raise refused()

    def refusal(self, config: Any, offload: Offload) -> Callable[[], PlannerError] | None:
        """The error ``check`` raises, made only when called; None where the scheme takes
        ``config``. A scheme states its refusals here: the search asks this of every optimizer and
        sharding of each method and precision, about 450 of which a scheme refuses (Llama-2-7B on
        an A10G, every precision), and raising and catching them was 2% of its instructions. Here:
        an offload, which only the schemes that define one take."""
        if offload is not Offload.NONE:
            return lambda: InvalidConfigError(f"--offload {offload} is a DeepSpeed ZeRO feature: add --zero 1, 2 or 3")
        return None

    # ---- memory -----------------------------------------------------------------------------
    def model_states(self, model: Any, config: Any, t: Any, out: dict[str, int], *, param_bytes: int, grads: int,
                     base_sizes: tuple[int, ...]) -> tuple[dict[str, int], int]:
        """(device bytes by component, host bytes) of the model states, given ``out`` (the
        weights as one process holds them, and LoRA's adapters), ``grads`` (the unpartitioned
        gradient bytes in the trainable dtype ``param_bytes``) and ``base_sizes`` (the element
        counts of the base model's parameter tensors)."""
        out["gradients"] = grads
        out["optimizer_states"] = OPTIMIZERS[config.optimizer].memory.model_state_bytes(model, config, t, param_bytes)
        return out, 0

    def optimizer_tensors(self, t: Any, config: Any, param_bytes: int) -> tuple[tuple[tuple[int, int], ...], int] | None:
        """What ``optimizer.step()`` steps on the device, as ((element count, tensors) pairs,
        bytes per element); None where it steps on the host."""
        return t.size_counts, param_bytes

    def optimizer_gradients(self, t: Any, config: Any, device_grads: int) -> int:
        """Gradient bytes alive on the device while ``optimizer.step()`` runs."""
        return device_grads

    def gradient_flatten(self, t: Any, config: Any) -> int:
        """Bytes of the gradient copies made as the step begins (transient)."""
        return 0

    def gradient_flatten_tensors(self, t: Any, config: Any) -> tuple[int, ...] | None:
        """The bytes of each tensor ``gradient_flatten`` is, in the order they are made (None:
        the moment part's grain)."""
        return None

    def step_checks(self, model: Any, t: Any, config: Any) -> tuple[tuple[str, int], ...]:
        """The library's checks of the gradients as the step begins, before ``gradient_flatten``:
        (breakdown key, bytes) each made and freed in turn (a norm's or an overflow test's
        temporary)."""
        return ()

    def stream_checks(self, t: Any, config: Any) -> tuple[tuple[str, int], ...]:
        """Checks made on a side stream before ``step_checks``, never larger than the flatten
        (keys ``streams`` names): drawn by the timeline for the allocator replay."""
        return ()

    def streams(self, config: Any) -> tuple[tuple[str, str], ...]:
        """The breakdown keys the library allocates on a stream of its own, each as (key, the
        stream's name): its own keys, or a model state's (``gradients``: the sharded gradients a
        reduce-scatter makes). The allocator replay gives each stream its own caching allocator, as
        PyTorch's keeps a stream's freed blocks for that stream's requests
        (CUDACachingAllocator.cpp: ``BlockComparatorSize`` orders a pool by stream first,
        ``get_free_block`` takes the request's stream only), so a side stream's segments are
        reserved beside the default stream's (``planner.memory.allocator.replay``). () : everything
        on the default stream. A tensor freed with ``record_stream`` on another stream still goes
        back to the stream it was allocated on: only where it was allocated counts here."""
        return ()

    def build_sequence(self, model: Any, config: Any, t: Any, resident: dict[str, int]) -> tuple[tuple[str, str, int], ...]:
        """How the library builds the resident model states before the first step, as
        (``alloc``/``free``, breakdown key, bytes): the resident keys in the order it makes them,
        and its temporaries between them (made, then freed); a resident key it does not name is
        made after, in ``resident``'s order. () where the model states are simply made in order."""
        return ()

    def lazy_states(self, config: Any) -> bool:
        """Its optimizer makes its states in the run's first ``step()`` (torch's lazy state
        initialization), not when it is built; the scheme's default: as torch does, unless its
        optimizer steps one flat partition (``flat_optimizer``)."""
        return not self.flat_optimizer

    def fused_step(self, config: Any, kernels: Any) -> bool:
        """The library builds the optimizer itself as one fused kernel with no temporaries
        (DeepSpeed's FusedAdam, where the run's own ds_config asks for it)."""
        return False

    def step_key(self, size: str) -> str:
        """The breakdown key under which the step counts the scheme's part ``size``
        (``planner.memory.step``: the parts ``MOMENTS`` names ``SCHEME``, by the ``StaticSizes``
        field they read: ``gathered``, the parameters gathered whole for the running unit): the
        one of its ``keys`` that says so (a part it does not have is 0 bytes, named generically)."""
        # remembered per scheme and part: its model states ask for up to five per static key
        # (FSDP2), hundreds of times a search, and the keys are its own fixed declaration
        found = _STEP_KEYS.get((self, size))
        if found is None:
            found = _STEP_KEYS[self, size] = next(
                (k.key for k in self.keys if k.size == size and not k.gloo_only), f"sharding/{size}")
        return found

    def searched_on(self, gpus: int, offload: Offload) -> bool:
        """``suggest`` tries it with ``offload`` on ``gpus`` GPUs (``searched`` and ``offloads``
        say which ones it takes; a scheme that is worth trying only on several ranks, or on one
        only with an offload, says so here)."""
        return self.searched and offload in self.offloads

    def memory_twin(self, gpus: int) -> str:
        """The scheme whose memory terms this one's equal on ``gpus`` ranks (the search's memo
        key): itself unless said otherwise."""
        return self.name

    def retained_in_backward(self, model: Any, config: Any, *, residual_bytes: int) -> int:
        """Per-micro-batch bytes of one layer's input gradient the scheme's hooks keep alive to the end
        of backward beyond what one process holds (``planner.memory.step.retention``:
        ``BatchTerms.retained`` at the first layer's backward,
        ``retained_end`` at the end of backward; the timeline draws one per layer); ``residual_bytes``: an
        element of the residual stream (``planner.memory.dtypes.DtypeMode.residual``): none."""
        return 0

    # ---- throughput -------------------------------------------------------------------------
    def comm_bytes(self, config: Any, *, trainable: int, params_total: int, grad_bytes: int) -> float:
        """Bytes each rank sends over the interconnect per optimizer step (more than one GPU)."""
        return 0.0

    def offload_bytes(self, config: Any, offload: Offload, *, trainable: int, params_total: int) -> float:
        """Host<->device bytes per optimizer step per rank."""
        return 0.0

    def host_seconds(self, model: Any, config: Any, *, adapted_modules: int, layer_of: Any = None) -> float:
        """Host seconds per optimizer step its own per-unit work adds on the step's path, beyond the
        eager ops ``planner.kernels`` counts (asked where ``unit_host`` and more than one GPU;
        ``adapted_modules``: the model's LoRA-wrapped linear modules; ``layer_of``: the device's timing of
        a decoder layer, ``planner.throughput.fsdp1_decoder_layer``, None without a device): none."""
        return 0.0

    def master_update_bytes(self, config: Any) -> float:
        """Device traffic per trainable parameter the update adds beyond the optimizer's own."""
        return 0

    # ---- files and the worker ---------------------------------------------------------------
    def emitted_files(self, config: Any, *, hidden_size: int, pin_memory: bool = False,
                      gradient_clipping: float | None = None, hyperparameters: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The JSON files a run of it reads, by file name (none: plain torch)."""
        return {}

    def training_arguments(self, config: Any) -> dict[str, Any]:
        """What it adds to ``transformers.TrainingArguments`` (none: nothing)."""
        return {}

    def accelerate(self, config: Any, *, on_cpu: bool) -> dict[str, Any]:
        """Its fields of accelerate's ``ClusterConfig`` (``distributed_type`` and the plugin's
        section): one process needs no distribution."""
        return {"distributed_type": "NO"}

    # ---- the worker (lazy imports: these run in the measurement process only) ----------------
    def worker_init(self, device: str) -> None:
        """Before the probe starts and the model is built: the environment the library reads at
        import and the process group it needs (none: one plain process)."""

    def worker_setup(self, model: Any, params: list, config: Any, *, device: str,
                     build_optimizer: Callable[[list], Any], hidden_size: int,
                     hyperparameters: dict[str, Any]) -> WorkerSetup:
        """Wrap the built model (adapters and checkpointing applied, ``params`` its trainable
        parameters) for training and build its optimizer (``build_optimizer(params)``, the
        optimizer's descriptor; ``hyperparameters``: the ``lr``, ``betas``, ``eps`` and
        ``weight_decay`` a library's own optimizer is given, as ``emitted_files`` takes them;
        ``hidden_size``: the model's): plain torch, autocast under ``*-mixed``."""
        return WorkerSetup(engine=model, optimizer=build_optimizer(params), autocast=config.precision.is_mixed)


__all__ = ["RECORDED", "BreakdownKey", "Offload", "ShardingSpec", "WorkerSetup", "join_process_group", "ring"]
