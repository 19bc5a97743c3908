"""The analytical memory model: what one training configuration needs on one device.

Pure functions over frozen dataclasses: no torch, no I/O. ``estimate_memory`` returns a
``MemoryEstimate`` whose ``breakdown`` names every term and sums to ``peak_allocated_bytes``.

How the peak is found. A training step goes through five moments, and the peak is the largest:

* ``forward``: static model states + every tensor saved for backward + the logits/loss
  temporaries at the end of the forward pass (the last micro-step of an accumulation, when the
  previous micro-steps' gradients already exist);
* ``backward_start``: the saved tensors are still alive and the loss' backward allocates the
  gradient of the logits (for large vocabularies this is the peak);
* ``backward_end``: most saved tensors are released and every gradient exists;
* ``optimizer_start``: DeepSpeed ZeRO-1/2 flattens this rank's gradients into an fp32 partition;
* ``optimizer``: gradients + optimizer states + the optimizer's own temporaries.

What "saved for backward" means is taken from the code that runs: per transformer block we
list the tensors autograd keeps (``torch.autograd.graph.saved_tensors_hooks`` on transformers
5.x shows exactly these), e.g. for a Llama block under bf16 autocast: the fp32 input and the fp32
normalised activations of both RMSNorms, one bf16 cast of the normed input per q/k/v/gate/up
projection (autocast casts per call), q/k/v/out and the fp32 log-sum-exp of SDPA, and the four
b·s·intermediate tensors of the SwiGLU MLP. Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", eq. 1: 34·s·b·h + 5·a·s²·b bytes per layer in 16-bit
with dropout) is the same accounting for Megatron's GPT block; we follow the HF modules instead,
since those are what users fine-tune.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, §3.1): mixed-precision AdamW keeps
16 bytes per parameter (2+2+12 with DeepSpeed; with HF autocast fp32 weights 4 + fp32 grads 4 +
two fp32 moments 8), which is also the seeds' "16 bytes/param" rule (shared/seeds/001).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

from planner.config import ALL_LINEAR, Method, Offload, Optimizer, Precision, TrainConfig
from planner.errors import InvalidConfigError
from planner.modelspec import LinearKind, ModelSpec
from planner.results import MemoryEstimate

MiB = 1024**2

# --- constants, each with its source -------------------------------------------------------
#: bitsandbytes NF4: 4 bits per weight, one absmax per block of 64 (bnb.functional.quantize_4bit
#: blocksize=64 for 4-bit); with double quantisation the absmax are 8-bit with one fp32 scale per
#: 256 of them (QLoRA paper, Dettmers et al. 2023, §3: 0.127 bits/param instead of 0.5).
NF4_BLOCK = 64
NF4_DQ_BLOCK = 256
#: bitsandbytes 8-bit optimizers: blockwise quantisation with 256-element blocks and an fp32
#: absmax per block (bnb.optim.optimizer.Optimizer8bit, Dettmers et al. 2022 "8-bit Optimizers").
BNB_8BIT_BLOCK = 256
#: bnb keeps 32-bit states for tensors smaller than this (Optimizer8bit min_8bit_size=4096).
BNB_MIN_8BIT_SIZE = 4096


def deepspeed_buckets(hidden_size: int) -> dict[str, int]:
    """The communication buffer sizes (elements) our DeepSpeed configs set and this model assumes.

    DeepSpeed's own defaults are 5e8 elements for reduce_bucket_size and allgather_bucket_size
    (deepspeed/runtime/zero/config.py), about 1 GB of 16-bit buffers whatever the model; the HF
    Trainer's "auto" values scale with the model instead (transformers integrations/deepspeed.py
    HfTrainerDeepSpeedConfig): reduce bucket hidden², ZeRO-3 prefetch 0.9·hidden², parameter
    persistence threshold 10·hidden. ``workers.deepspeed_config`` writes these; the model counts
    the reduce bucket (``zero/reduce_bucket``) and, for ZeRO-3, two layers of gathered parameters,
    which cover the prefetch.
    """
    return {
        "reduce_bucket_size": hidden_size * hidden_size,
        "allgather_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }


#: Intermediate-sized tensors an MLP activation (transformers' ACT2FN) saves for its backward,
#: besides its output, counted with saved_tensors_hooks (transformers 5.23, torch 2.13). Fused
#: kernels save their input (derivatives.yaml: gelu_backward(grad, self)); the Python ones save
#: every operand of their tensor-tensor products, e.g. NewGELUActivation x, tanh(.), 0.5·x and
#: 1 + tanh(.) (also seen on gpt2 with the CPU probe).
ACTIVATION_SAVED = {
    "silu": 1, "swish": 1, "gelu": 1, "gelu_pytorch_tanh": 1, "mish": 1, "relu2": 1, "relu6": 1,
    "leaky_relu": 1, "laplace": 1, "gelu_10": 2, "quick_gelu": 2, "gelu_python": 3, "gelu_new": 4,
    "gelu_accurate": 4, "gelu_python_tanh": 4, "gelu_fast": 7, "relu": 0, "tanh": 0, "sigmoid": 0,
    "linear": 0,
}
#: Activations whose backward reads their own output: it stays saved even when nothing after
#: them needs it (a frozen fc2).
ACTIVATION_SAVES_OUTPUT = frozenset({"relu", "tanh", "sigmoid"})
#: What an activation missing from ACTIVATION_SAVED is assumed to save (a fused kernel's input);
#: estimate_memory states the assumption.
ACTIVATION_SAVED_DEFAULT = 1
#: CUDA caching allocator: blocks >1 MiB are rounded up to 2 MiB multiples
#: (c10/cuda/CUDACachingAllocator.cpp kRoundLarge), so each large live tensor wastes 1 MiB on
#: average; segments of the large pool are at least 20 MiB (kLargeBuffer).
CUDA_ROUND_LARGE = 2 * MiB
#: Fraction of the activation churn the caching allocator keeps reserved but unused at the
#: peak. PyTorch's memory docs show reserved exceeding allocated by a few percent in steady
#: training; 5% of the transient bytes is our stated assumption until GPU measurements
#: calibrate it (bench/accuracy.py on a GPU machine).
CUDA_FRAGMENTATION = 0.05


@dataclass(frozen=True, kw_only=True)
class _Dims:
    """Sizes one forward pass works with (per device, per micro-step)."""

    b: int  # micro batch
    s: int  # sequence length
    h: int
    a: int  # attention heads
    kv: int  # key/value heads
    d: int  # head dim
    i: int  # intermediate size
    v: int  # vocab

    @property
    def tokens(self) -> int:
        return self.b * self.s


@dataclass(frozen=True, kw_only=True)
class _Mode:
    """How tensors are typed in this configuration."""

    autocast: bool
    """HF mixed precision: fp32 weights, matmuls in 16-bit under torch.autocast."""
    compute: int
    """bytes of projection outputs (MLP intermediates)."""
    attn: int
    """bytes of the tensors the attention kernel saves (q, k, v, out)."""
    residual: int
    """bytes of the residual stream (fp32 under autocast, else the model dtype)."""
    weight: int
    """bytes of a stored (unquantised) weight element."""
    adapter_input: int
    """bytes of the input copy each LoRA adapter saves (0: it shares the base layer's input)."""


def _mode(config: TrainConfig) -> _Mode:
    return _mode_of(config.method, config.precision, config.zero > 0)


@functools.cache
def _mode_of(method: Method, p: Precision, deepspeed: bool) -> _Mode:
    lora = method.uses_adapters
    if deepspeed and p.is_mixed:
        # DeepSpeed's bf16/fp16 mode casts the model to 16-bit and keeps the fp32 master copy in
        # the optimizer partition (deepspeed/runtime/engine.py _configure_distributed_model):
        # no autocast, activations are those of a pure 16-bit model.
        return _Mode(autocast=False, compute=2, attn=2, residual=2, weight=2, adapter_input=4 if lora else 0)
    if method is Method.QLORA:
        # peft.prepare_model_for_kbit_training upcasts every non-4-bit parameter to fp32
        # (peft/utils/other.py), so the residual stream is fp32; bnb's Linear4bit casts its input
        # to the compute dtype and its output back to the input dtype (bitsandbytes/nn/modules.py
        # Linear4bit.forward), so projection outputs are fp32 too; only under autocast does SDPA
        # cast q/k/v to 16-bit.
        return _Mode(
            autocast=p.is_mixed, compute=4, attn=2 if p.is_mixed else 4, residual=4, weight=4,
            adapter_input=2 if p.is_mixed else 0,
        )
    if p is Precision.FP32:
        return _Mode(autocast=False, compute=4, attn=4, residual=4, weight=4, adapter_input=0)
    if p.is_mixed:
        # autocast casts the fp32 input anew for every linear call, adapters included
        return _Mode(autocast=True, compute=2, attn=2, residual=4, weight=4, adapter_input=2)
    # pure 16-bit: peft keeps adapters in fp32 (autocast_adapter_dtype=True) and casts each
    # adapter's input to fp32 (LoraLayer._cast_input_dtype): one fp32 copy per adapter
    return _Mode(autocast=False, compute=2, attn=2, residual=2, weight=2, adapter_input=4 if lora else 0)


# ---- parameters ------------------------------------------------------------------------------
def lora_targets(model: ModelSpec, config: TrainConfig) -> tuple:
    """The per-block linear layers LoRA wraps (peft's "all-linear" skips only the output head)."""
    if not config.method.uses_adapters:
        return ()
    return _cached("lora_targets", model, (config.lora_targets,), lambda: _lora_targets(model, config.lora_targets))


def _lora_targets(model: ModelSpec, targets: tuple[str, ...] | None) -> tuple:
    if targets == (ALL_LINEAR,):
        return tuple(model.layer_linears)
    names = set(targets or ())
    available = model.linear_names()
    missing = sorted(names - set(available))
    if missing:
        raise InvalidConfigError(
            f"--lora-targets {','.join(missing)} not found in {model.id}: "
            f"its linear layers are {','.join(available)} (or use all-linear)"
        )
    return tuple(lin for lin in model.layer_linears if lin.name in names)


def lora_params(model: ModelSpec, config: TrainConfig) -> int:
    """LoRA adds A (r x in) and B (out x r) per wrapped linear (per expert copy)."""
    r = config.lora_r or 0
    return model.num_layers * sum(lin.count * r * (lin.in_features + lin.out_features) for lin in lora_targets(model, config))


def trainable_params(model: ModelSpec, config: TrainConfig) -> int:
    if config.method is Method.FULL:
        return model.params_total
    return _cached("lora_params", model, (config.lora_r, config.lora_targets), lambda: lora_params(model, config))


def _zero_partition(model: ModelSpec, config: TrainConfig) -> int:
    """Trainable elements in this rank's DeepSpeed partition: one flat tensor of T/N."""
    return math.ceil(trainable_params(model, config) / config.gpus)


def _param_tensor_sizes(model: ModelSpec, config: TrainConfig) -> tuple[int, ...]:
    """Element counts of the trainable parameter tensors (for per-tensor optimizer rules)."""
    adapters = config.method.uses_adapters
    key = (adapters, config.lora_r, config.lora_targets) if adapters else (False,)
    return _cached("param_sizes", model, key, lambda: tuple(_compute_param_tensor_sizes(model, config)))


def _compute_param_tensor_sizes(model: ModelSpec, config: TrainConfig) -> list[int]:
    if config.method.uses_adapters:
        r = config.lora_r or 0
        sizes = []
        for lin in lora_targets(model, config):
            sizes += [r * lin.in_features, r * lin.out_features] * lin.count
        return sizes * model.num_layers
    sizes = [model.embedding_params]
    if model.other_embedding_params:
        sizes.append(model.other_embedding_params)
    per_layer: list[int] = []
    for lin in model.layer_linears:
        per_layer += [lin.in_features * lin.out_features] * lin.count
        if lin.bias:
            per_layer += [lin.out_features] * lin.count
    # norm weights/biases are tensors of hidden_size (q/k norms of head_dim are smaller still)
    norm = model.layer_norm_params + model.layer_other_params
    while norm > 0:
        per_layer.append(min(norm, model.hidden_size))
        norm -= model.hidden_size
    sizes += per_layer * model.num_layers
    if model.final_norm_params:
        sizes.append(model.final_norm_params)
    if model.head_params:
        sizes.append(model.head_params)
    return sizes


def _nf4_bytes(n: int) -> float:
    """Bytes of n weights stored as bitsandbytes NF4 with double quantisation."""
    blocks = n / NF4_BLOCK
    return n / 2 + blocks * 1 + (blocks / NF4_DQ_BLOCK) * 4


def _quantized_linear_params(model: ModelSpec) -> int:
    """bitsandbytes quantises every nn.Linear but the output head (get_keys_to_not_convert)."""
    return model.num_layers * model.linear_params_per_layer


# ---- optimizer states ----------------------------------------------------------------------
def optimizer_state_bytes(*, sizes: tuple[int, ...] | list[int], optimizer: Optimizer, param_bytes: int) -> int:
    """Persistent optimizer state for trainable tensors of these element counts.

    * AdamW (torch): exp_avg and exp_avg_sq like the parameter (2 x param dtype) plus a 4-byte
      ``step`` tensor per parameter (torch/optim/adamw.py _init_group).
    * SGD with momentum: one momentum buffer like the parameter (torch/optim/sgd.py).
    * Adafactor (transformers, beta1=None): factored second moment for >=2-D tensors, one fp32
      row and column vector; a full fp32 vector for 1-D tensors (transformers/optimization.py).
      Our ``sizes`` are flat, so a 2-D tensor of n elements is taken as sqrt-ish: rows+cols is
      bounded by the true shape, which the caller cannot know here; we use 2·sqrt(n).
    * bitsandbytes AdamW8bit/PagedAdamW8bit: two uint8 states + one fp32 absmax per 256-element
      block each, and 32-bit states for tensors under 4096 elements (bnb Optimizer8bit).
    """
    optimizer = Optimizer(optimizer)
    total = 0
    for n, copies in Counter(sizes).items():  # a model has few distinct tensor shapes
        if optimizer is Optimizer.ADAMW:
            each = 2 * n * param_bytes + 4
        elif optimizer is Optimizer.SGD:
            each = n * param_bytes
        elif optimizer is Optimizer.ADAFACTOR:
            each = 4 * (2 * math.isqrt(n)) if n > 0 else 0
        elif n < BNB_MIN_8BIT_SIZE:
            each = 2 * n * 4
        else:
            each = 2 * (n + math.ceil(n / BNB_8BIT_BLOCK) * 4)
        total += each * copies
    return total


def _adafactor_state_bytes(model: ModelSpec, config: TrainConfig) -> int:
    """Adafactor with true shapes: rows + cols per 2-D weight, full vectors for 1-D tensors."""
    r = config.lora_r or 0
    total = 0
    if config.method.uses_adapters:
        for lin in lora_targets(model, config):
            total += lin.count * ((r + lin.in_features) + (lin.out_features + r))
        return 4 * total * model.num_layers
    per_layer = 0
    for lin in model.layer_linears:
        per_layer += lin.count * (lin.in_features + lin.out_features + (lin.out_features if lin.bias else 0))
    per_layer += model.layer_norm_params + model.layer_other_params
    total = per_layer * model.num_layers
    total += model.vocab_size + model.hidden_size  # embedding rows + cols
    total += model.other_embedding_params and (model.max_seq_len + model.hidden_size)
    total += model.final_norm_params
    if model.head_params:
        total += model.vocab_size + model.hidden_size + (model.head_params - model.vocab_size * model.hidden_size if model.head_params > model.vocab_size * model.hidden_size else 0)
    return 4 * total


def _optimizer_step_transient(*, sizes: tuple[int, ...] | list[int], optimizer: Optimizer, param_bytes: int, is_cpu: bool) -> int:
    """Temporaries inside optimizer.step(), beyond states and gradients.

    * torch AdamW on CUDA defaults to the foreach implementation, whose
      ``torch._foreach_sqrt(exp_avg_sqs)`` materialises one extra copy of every second moment
      (torch/optim/adamw.py _multi_tensor_adamw). On the CPU it runs tensor by tensor
      (_single_tensor_adamw), where ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` holds two
      temporaries of the largest parameter.
    * Adafactor holds two full fp32 tensors of the current parameter at once: ``grad**2 + eps``
      while ``_approx_sq_grad`` builds the factored estimate, then ``update`` while
      ``p.add_(-update)`` makes its negation (transformers optimization.py Adafactor.step); a
      16-bit parameter adds its fp32 copy and its gradient's (``p.float()``, ``grad.float()``).
    * SGD updates in place; the 8-bit optimizers dequantise one block-sized chunk at a time on
      CUDA (in-kernel). bitsandbytes' CPU backend dequantises a whole tensor's states to fp32,
      but inside one custom op (backends/cpu/ops.py _optimizer_update_8bit_blockwise_cpu), below
      the dispatch mode the CPU probe (like torch's MemTracker) counts with: the ``cpu`` profile
      sees no temporaries either.
    """
    largest = max(sizes, default=0)
    if optimizer is Optimizer.ADAMW:
        return 2 * largest * param_bytes if is_cpu else sum(sizes) * param_bytes
    if optimizer is Optimizer.ADAFACTOR:
        return (2 + (2 if param_bytes == 2 else 0)) * largest * 4
    return 0


# ---- activations -----------------------------------------------------------------------------
def _block_activations(
    model: ModelSpec, config: TrainConfig, dims: _Dims, mode: _Mode, *, first: bool, is_cpu: bool = False
) -> dict[str, int]:
    """Bytes one transformer block keeps for backward, by component.

    Autograd saves an operand only when the other operand needs a gradient (the codegen checks
    ``should_compute_output``). So with LoRA, frozen weights save nothing for their own input;
    and in the ``first`` block, which reads the frozen embedding's output, nothing upstream of
    the first adapter needs a gradient (unless checkpointing makes the inputs require grad,
    peft's ``enable_input_require_grads``).
    """
    e, h = dims.tokens, dims.h
    c, res = mode.compute, mode.residual
    full = config.method is Method.FULL
    targets = {lin.name for lin in lora_targets(model, config)}
    by_kind = {kind: [lin for lin in model.layer_linears if lin.kind is kind] for kind in LinearKind}
    attn_targeted = any(lin.name in targets for lin in by_kind[LinearKind.ATTN_IN] + by_kind[LinearKind.ATTN_OUT])
    block_input_needs_grad = full or not first or config.grad_ckpt
    out: dict[str, int] = {}

    def add(key: str, n: float) -> None:
        out[key] = out.get(key, 0) + int(n)

    # -- norms -----------------------------------------------------------------------------
    def norm(input_needs_grad: bool) -> None:
        if model.norm == "rmsnorm":
            # x.to(fp32) -> pow -> mean -> rsqrt -> x*rsqrt -> weight * (.).to(dtype): the fp32
            # input and rsqrt are saved when the input needs a gradient, the normalised tensor
            # (model dtype) when the weight does (LlamaRMSNorm.forward, measured with
            # saved_tensors_hooks).
            if input_needs_grad:
                add("norms", e * h * 4 + e * 4)
            if full:
                add("norms", e * h * (4 if model.norm_weight_fp32 else res))
        elif input_needs_grad or full:
            # native_layer_norm saves its input and the fp32 mean and rstd (derivatives.yaml)
            add("norms", e * h * res + 2 * e * 4)

    norm(block_input_needs_grad)
    if not model.parallel_block:
        norm(block_input_needs_grad or attn_targeted)

    # -- projections' inputs -------------------------------------------------------------------
    def inputs(group: list, shared: float) -> float:
        """Input copies saved by the linears of a group reading the same tensor."""
        if full:
            # autocast casts per call: one 16-bit copy per linear; otherwise one shared tensor
            return sum(e * lin.in_features * 2 for lin in group) if mode.autocast else shared
        hit = [lin for lin in group if lin.name in targets]
        if not hit:
            return 0.0
        if mode.adapter_input:
            return sum(e * lin.in_features * mode.adapter_input for lin in hit)
        return shared

    add("attention/qkv_input", inputs(by_kind[LinearKind.ATTN_IN], e * h * (c if full else res)))

    # -- attention core ------------------------------------------------------------------------
    q = e * dims.a * dims.d
    kvn = e * dims.kv * dims.d
    attention = str(config.attention)
    o_targeted = any(lin.name in targets for lin in by_kind[LinearKind.ATTN_OUT])

    def out_input(copy_bytes: int) -> None:
        """What o_proj's input costs beyond the kernel's saved output: ``copy_bytes`` when the
        attention output reaches o_proj as a separate (transposed, contiguous) copy and o_proj
        or a sharing adapter keeps it, plus the adapters' own input casts."""
        if copy_bytes and (full or (o_targeted and not mode.adapter_input)):
            add("attention/out_input", copy_bytes)
        if not full and mode.adapter_input and o_targeted:
            add("attention/out_input", sum(e * lin.in_features * mode.adapter_input for lin in by_kind[LinearKind.ATTN_OUT]))

    if attention == "sdpa" and is_cpu and model.attn_dropout > 0:
        # On the CPU, SDPA's flash kernel refuses dropout (aten sdp_utils_cpp.cpp
        # use_flash_attention_cpp: check_for_dropout), so training falls back to the math path,
        # which upcasts 16-bit inputs to fp32 on the CPU and saves q·scale, kᵀ·scale and v (fp32,
        # all heads), the fp32 softmax, the dropout mask and the dropped probabilities; its
        # (b, a, s, d) output needs a contiguous copy before o_proj. Measured on gpt2 and bert
        # (bench/accuracy.py, CPU probe). On a GPU the flash/efficient kernels take dropout.
        scores = dims.b * dims.a * dims.s * dims.s
        add("attention/core", 4 * 3 * q + 4 * 3 * scores)
        out_input(e * h * mode.attn)
    elif attention in ("sdpa", "flash"):
        # SDPA/flash save q, k, v, out and the fp32 log-sum-exp; transformers uses the native GQA
        # path when there is no mask, so k/v keep kv heads (integrations/sdpa_attention.py).
        # o_proj reads the output in place: its (b, s, a, d) layout makes the reshape a view.
        if not model.fused_qkv:
            add("attention/core", mode.attn * (2 * q + 2 * kvn) + e * dims.a * 4)
            out_input(0)
        else:
            # q, k and v are views of one projection's output. Rope makes new q and k; a dtype
            # change (QLoRA's fp32 outputs under autocast) makes copies of all three; whatever
            # stays a view keeps the whole fused buffer saved. Rope on a strided slice of q
            # returns a (b, a, s, d)-contiguous q, so the kernel's output is laid out that way
            # too and o_proj reads a transposed copy (measured on phi3 and gpt2: qkv_proj's
            # output and sdpa_attention.py's .contiguous(), which copies for phi3 only).
            roped = model.position == "rope"
            cast = mode.compute != mode.attn
            copies = (q + kvn) if roped or cast else 0
            copies += kvn if cast else 0
            fused = 0 if cast else (q + 2 * kvn) * mode.compute
            add("attention/core", mode.attn * (copies + q) + fused + e * dims.a * 4)
            out_input(q * mode.attn if roped else 0)
    else:
        # eager: q and k for the scores, the fp32 softmax and its cast back for probs @ v, v
        # repeated to all heads (repeat_kv), and the transposed output copied before o_proj
        # (eager_attention_forward).
        scores = dims.b * dims.a * dims.s * dims.s
        add("attention/core", mode.attn * 3 * q)
        add("attention/probs", scores * _eager_probs_bytes_per_score(model, mode, is_cpu=is_cpu))
        out_input(e * h * mode.attn)

    # -- MLP -----------------------------------------------------------------------------------
    add("mlp/input", inputs(by_kind[LinearKind.MLP_IN], e * h * (c if full else res)))
    inter = e * dims.i * c
    # gated: act(gate) saves what ACTIVATION_SAVED says, act*up saves act's output and up, down
    # saves the product (LlamaMLP); plain: the activation's own tensors, fc2 saves its output.
    # A frozen, unadapted down/fc2 computes no weight gradient, so it saves no input (LoRA on the
    # attention projections only; measured on mistral), unless the activation keeps its output.
    act_saved = ACTIVATION_SAVED.get(model.hidden_act, ACTIVATION_SAVED_DEFAULT)
    down_needs_input = full or any(lin.name in targets for lin in by_kind[LinearKind.MLP_OUT])
    if model.gated_mlp:
        saved_tensors = act_saved + 2 + (1 if down_needs_input else 0)
    else:
        saved_tensors = act_saved + (1 if down_needs_input or model.hidden_act in ACTIVATION_SAVES_OUTPUT else 0)
    add("mlp/intermediate", saved_tensors * inter)
    if not full and mode.adapter_input:
        add("mlp/intermediate", sum(e * l.in_features * (mode.adapter_input - c) for l in by_kind[LinearKind.MLP_OUT] if l.name in targets))
    if model.hidden_dropout > 0:
        # dropout on the attention and MLP outputs keeps only its mask (the residual add that
        # reads the output saves nothing), in the projections' output dtype on the CPU
        add("dropout", 2 * e * h * _dropout_mask_bytes(c, is_cpu=is_cpu))

    # -- LoRA: lora_B saves lora_A's output (e x r) ----------------------------------------------
    if targets:
        r = config.lora_r or 0
        a_bytes = 2 if mode.autocast else 4
        add("lora/activations", sum(lin.active * e * r * a_bytes for lin in model.layer_linears if lin.name in targets))

    # -- autocast: the 16-bit weight copies F.linear saves for backward -------------------------
    if mode.autocast and config.method is not Method.QLORA:
        cast = 0
        for lin in model.layer_linears:
            reads_block_input = lin.kind in (LinearKind.ATTN_IN,)
            input_needs_grad = block_input_needs_grad or not reads_block_input
            if full or input_needs_grad:
                cast += lin.count * lin.in_features * lin.out_features * 2
        add("autocast/weight_casts", cast)
    if mode.autocast and targets:
        # the fp32 adapters are cast per call too: B's copy is always saved (lora_A's output
        # needs a gradient), A's when the adapter's input does (measured on a tiny llama:
        # 9 A and 14 B copies over two blocks, the first block's q/k/v A copies missing)
        r = config.lora_r or 0
        lora_cast = 0
        for lin in model.layer_linears:
            if lin.name not in targets:
                continue
            input_needs_grad = block_input_needs_grad or lin.kind is not LinearKind.ATTN_IN
            lora_cast += lin.count * r * (lin.out_features + (lin.in_features if input_needs_grad else 0)) * 2
        add("lora/weight_casts", lora_cast)
    return out


def _dropout_mask_bytes(dropped_dtype_bytes: int, *, is_cpu: bool) -> int:
    """Bytes per element of the mask dropout keeps for backward: CUDA's fused native_dropout
    makes a bool mask, the CPU's bernoulli path a mask in the dropped tensor's dtype (aten
    Dropout.cpp is_fused_kernel_acceptable; measured on gpt2 and bert)."""
    return dropped_dtype_bytes if is_cpu else 1


def _eager_probs_bytes_per_score(model: ModelSpec, mode: _Mode, *, is_cpu: bool) -> int:
    """Bytes per attention score the eager path keeps: softmax's output (its backward reads it),
    a cast for probs @ v when the dtypes differ, and with attention dropout the mask
    (``_dropout_mask_bytes``) and the dropped probabilities. CUDA autocast runs softmax in fp32, CPU autocast does not (its
    fp32 list has no softmax: BERT's probabilities stay bf16, measured with the CPU probe)."""
    if model.eager_softmax == "fp32":
        p = 4
    elif model.eager_softmax == "residual":
        p = mode.residual
    else:
        p = 4 if mode.autocast and not is_cpu else mode.attn
    dropout = model.attn_dropout > 0
    mask = functools.partial(_dropout_mask_bytes, is_cpu=is_cpu)
    if model.eager_softmax in ("fp32", "input_then_cast"):
        # cast to q's / v's dtype, then dropout on that: the cast is kept by probs @ v only
        # when there is no dropout between them
        if dropout:
            return p + mask(mode.attn) + mode.attn
        return p + (mode.attn if p != mode.attn else 0)
    # dropout on softmax's output, then probs @ v casts (autocast) what it reads
    kept = p + (mask(p) if dropout else 0)
    if p != mode.attn:
        return kept + mode.attn
    return kept + (p if dropout else 0)


def _model_level_activations(
    model: ModelSpec, config: TrainConfig, dims: _Dims, mode: _Mode, *, is_cpu: bool = False
) -> dict[str, int]:
    """Tensors saved outside the blocks: token ids, rotary tables, final norm, lm_head, loss."""
    e, h = dims.tokens, dims.h
    full = config.method is Method.FULL
    out = {"embeddings": e * 8}  # int64 token ids kept by the embedding backward
    if model.position == "rope":
        # cos and sin (1, s, head_dim) in the residual dtype, shared by all blocks
        out["embeddings"] += 2 * dims.s * dims.d * mode.residual
    if model.embedding_norm:
        # the LayerNorm saves its input, the summed embeddings (in the residual dtype)
        out["embeddings"] += e * h * mode.residual
    if model.is_encoder:
        # the masked-LM head's transform: dense -> gelu -> LayerNorm before the decoder; gelu
        # saves the dense output (BertPredictionHeadTransform), the norm is counted as final_norm
        out["lm_head/transform"] = e * h * mode.compute
    if model.embedding_dropout > 0 and (full or config.grad_ckpt):
        # its mask (in the residual dtype on the CPU), kept only when the embeddings' output needs a gradient: trained embeddings, or peft's
        # enable_input_require_grads under checkpointing
        out["dropout"] = e * h * _dropout_mask_bytes(mode.residual, is_cpu=is_cpu)
    if model.norm == "rmsnorm":
        normalised = 4 if model.norm_weight_fp32 else mode.residual
        out["final_norm"] = e * h * 4 + e * 4 + (e * h * normalised if full else 0)
    else:
        out["final_norm"] = e * h * mode.residual + 2 * e * 4
    if full:
        out["lm_head/input"] = e * h * (2 if mode.autocast else mode.residual)
    if mode.autocast:
        out["autocast/weight_casts"] = model.vocab_size * h * 2
    # cross_entropy = log_softmax + nll_loss: the fp32 log-probabilities and the int64 shifted
    # labels are saved (transformers/loss/loss_utils.py ForCausalLMLoss)
    out["loss/log_softmax"] = e * dims.v * 4 + e * 8
    return out


def _logits_forward_transient(dims: _Dims, mode: _Mode) -> int:
    """At the loss: the logits in the lm_head's output dtype + their fp32 upcast
    (``logits.float()`` in ForCausalLMLoss), before the upcast is released."""
    ev = dims.tokens * dims.v
    logits = 2 if mode.autocast else mode.weight
    return ev * logits + (ev * 4 if logits != 4 else 0)


def _logits_backward_transient(dims: _Dims, mode: _Mode) -> int:
    """Backward of the loss: nll_loss's dense fp32 gradient and log_softmax's fp32 grad input
    exist together (the saved log-probabilities counted elsewhere), then the cast back to the
    compute dtype."""
    ev = dims.tokens * dims.v
    return 2 * ev * 4


def activation_breakdown(model: ModelSpec, config: TrainConfig, *, is_cpu: bool = False) -> dict[str, int]:
    """Bytes saved for backward over the whole forward pass, by component (one device;
    ``is_cpu``: the ``cpu`` profile, whose attention kernels differ, see _block_activations)."""
    dims = _dims(model, config)
    mode = _mode(config)
    total: dict[str, int] = {}

    def merge(prefix: str, part: dict[str, int], times: int = 1) -> None:
        for k, v in part.items():
            key = f"activations/{k}" if not k.startswith(("autocast", "lora")) else k
            total[key] = total.get(key, 0) + v * times

    if config.grad_ckpt:
        # Non-reentrant checkpointing keeps each block's input (the residual stream) and
        # recomputes one block at a time during backward (torch.utils.checkpoint).
        total["activations/checkpoints"] = model.num_layers * dims.tokens * dims.h * mode.residual
    else:
        first = _block_activations(model, config, dims, mode, first=True, is_cpu=is_cpu)
        rest = _block_activations(model, config, dims, mode, first=False, is_cpu=is_cpu)
        merge("", first)
        merge("", rest, model.num_layers - 1)
    merge("", _model_level_activations(model, config, dims, mode, is_cpu=is_cpu))
    return {k: v for k, v in total.items() if v}


def _dims(model: ModelSpec, config: TrainConfig) -> _Dims:
    inter = model.intermediate_size
    if model.is_moe:
        # tokens are routed to top-k experts: k intermediate activations per token
        inter = model.intermediate_size * model.experts_per_token
    return _Dims(
        b=config.micro_batch,
        s=config.seq_len,
        h=model.hidden_size,
        a=model.num_heads,
        kv=model.num_kv_heads,
        d=model.head_dim,
        i=inter,
        v=model.vocab_size,
    )


# ---- model states ----------------------------------------------------------------------------
def model_state_breakdown(model: ModelSpec, config: TrainConfig) -> tuple[dict[str, int], int]:
    """(device bytes by component, host bytes) of weights, gradients and optimizer states."""
    n = config.gpus
    mode = _mode(config)
    p_total = model.params_total
    trainable = trainable_params(model, config)
    sizes = _param_tensor_sizes(model, config)
    full = config.method is Method.FULL
    # dtype of the trainable tensors: LoRA adapters are fp32 (peft autocast_adapter_dtype=True)
    param_bytes = mode.weight if full else 4
    out: dict[str, int] = {}
    host = 0

    # weights
    if config.method is Method.QLORA:
        q = _quantized_linear_params(model)
        out["weights/nf4"] = int(_nf4_bytes(q))
        out["weights/unquantized"] = (p_total - q) * 4
    else:
        out["weights"] = p_total * mode.weight
    if config.method.uses_adapters:
        out["lora/weights"] = trainable * 4

    opt_state = (
        _adafactor_state_bytes(model, config)
        if config.optimizer is Optimizer.ADAFACTOR
        else _cached(
            "optimizer_states", model, (config.method.uses_adapters, config.lora_r, config.lora_targets, config.optimizer, param_bytes),
            lambda: optimizer_state_bytes(sizes=sizes, optimizer=config.optimizer, param_bytes=param_bytes),
        )
    )
    grads = trainable * param_bytes

    if config.zero == 0:
        out["gradients"] = grads
        out["optimizer_states"] = opt_state
        if n > 1:
            # DDP copies every gradient into its flat buckets (gradient_as_bucket_view=False,
            # the default; torch DDP docs: "saved memory size will be equal to the total
            # gradients size" with it on).
            out["ddp/buckets"] = grads
        return out, host

    # ---- DeepSpeed ZeRO -------------------------------------------------------------------
    # 16-bit params (or fp32 in fp32 mode), gradients in the same dtype, an fp32 master copy of
    # the trainable partition and the optimizer states of that partition (ZeRO paper §3.1).
    gb = 2 if config.precision.is_mixed else 4
    # DeepSpeed flattens the trainable parameters into one fp32 master partition per device and
    # runs the optimizer (its own or the client's) on that flat tensor
    # (deepspeed/runtime/zero/stage_1_and_2.py single_partition_of_fp32_groups): the states are
    # those of ONE fp32 tensor of T/N elements (no per-tensor 8-bit threshold, no Adafactor
    # factoring of a 1-D tensor).
    partition = _zero_partition(model, config)
    states_per_device = optimizer_state_bytes(sizes=[partition], optimizer=config.optimizer, param_bytes=4)
    if config.optimizer is Optimizer.ADAFACTOR:
        states_per_device = 4 * partition
    master = 4 * trainable
    if config.method is Method.FULL:
        weights_dev = p_total * gb
        out["weights"] = weights_dev
    if config.zero == 3:
        if full:
            out["weights"] = weights_dev // n
        # one layer's parameters gathered at a time (+ prefetch), persistent small tensors
        out["zero3/gathered_params"] = model.params_per_layer * gb * 2
        if config.offload is Offload.OPTIMIZER_PARAMS:
            host += out.pop("weights", 0)
    if config.zero == 3:
        # ZeRO-3 allocates the flat 16-bit gradient partition when it is built, so it is alive
        # through the whole step (stage3.py _setup_for_real_optimizer grad_partitions_flat_buffer)
        out["zero3/grad_partitions"] = grads * gb // param_bytes // n
    else:
        out["gradients"] = grads * gb // param_bytes if config.zero == 1 else grads * gb // param_bytes // n
    out["zero/reduce_bucket"] = deepspeed_buckets(model.hidden_size)["reduce_bucket_size"] * gb
    if config.offload is Offload.NONE:
        out["master_weights"] = master // n
        out["optimizer_states"] = states_per_device
    else:
        # host: the fp32 master partition, DeepSpeedCPUAdam's moments and the fp32 gradient
        # partition it steps from (ZeRO-Offload, Ren et al. 2021, §4.1); stage 1/2 add the 16-bit
        # copy of the partition it writes back from (stage_1_and_2.py
        # param_buffer_of_bit16_for_cpu_offload_groups) and a host gradient buffer of the
        # largest parameter (temp_grad_buffer_for_cpu_offload)
        host += master // n + states_per_device + 4 * trainable // n
        if config.zero in (1, 2):
            largest = max(_param_tensor_sizes(model, config), default=0)
            host += gb * partition + gb * largest
            # the device-side staging buffer gradients go through to the host, one parameter
            # at a time (stage_1_and_2.py temp_grad_buffer_for_gpu_offload)
            out["zero/offload_grad_buffer"] = gb * largest
    return out, host


def _optimizer_phase_gradients(model: ModelSpec, config: TrainConfig, device_grads: int) -> int:
    """Gradient bytes alive on the device while optimizer.step() runs.

    Without ZeRO: the gradients themselves. With ZeRO and no offload, DeepSpeed flattens this
    rank's gradients into one fp32 partition (stage 1/2: ``single_grad_partition``; stage 3: the
    fp32 partition's ``.grad``) and frees the 16-bit ones before stepping
    (stage_1_and_2.py step: free_grad_in_param_list). With offload the step runs on the host.
    """
    if config.zero == 0:
        return device_grads
    if config.offload is not Offload.NONE:
        return 0
    return 4 * _zero_partition(model, config)


# ---- the estimate ------------------------------------------------------------------------------
_CACHE: dict[tuple, tuple] = {}
_CACHE_LIMIT = 50_000


def _cached(kind: str, model: ModelSpec, key: tuple, compute):
    """Memoise a pure term per model object (the search evaluates thousands of configurations
    that share their model states or their per-sequence activations). Keyed by the model's
    identity, re-checked on every hit so that a recycled id can never return another model's
    numbers."""
    full_key = (kind, id(model)) + key
    hit = _CACHE.get(full_key)
    if hit is not None and hit[0] is model:
        return hit[1]
    if len(_CACHE) > _CACHE_LIMIT:
        _CACHE.clear()
    value = compute()
    _CACHE[full_key] = (model, value)
    return value


def _static_key(config: TrainConfig, is_cpu: bool) -> tuple:
    """What the batch-independent terms depend on."""
    return (config.method, config.precision, config.optimizer, config.zero, config.offload, config.gpus,
            config.lora_r, config.lora_targets, is_cpu)


def _batch_key(config: TrainConfig, b: int, is_cpu: bool) -> tuple:
    """What the per-micro-batch terms depend on (DeepSpeed only through zero > 0: its dtype mode)."""
    return (config.method, config.precision, config.zero > 0, config.lora_r, config.lora_targets,
            config.grad_ckpt, config.attention, config.seq_len, b, is_cpu)


@dataclass(frozen=True)
class _StaticTerms:
    """The batch-independent terms of one configuration on one device."""

    resident: dict[str, int]
    """Model states alive through the whole step, by component."""
    gradients: int
    """Gradient bytes once backward has produced them (and during accumulation)."""
    gathered: int
    """ZeRO-3: parameters gathered for the block running now (forward and backward only)."""
    paged: int
    """Paged 8-bit states outside the caching allocator (GPU only)."""
    host: int
    """Host RAM (offload)."""
    optimizer_step: int
    """Temporaries inside optimizer.step()."""
    optimizer_gradients: int
    """Gradient bytes alive while the optimizer steps."""
    zero_gradient_flatten: int = 0
    """ZeRO-1/2 without offload, as the step begins: the 16-bit gradients of this rank's partition
    flattened into one tensor and that tensor's fp32 copy, both alive with the 16-bit gradients
    (stage_1_and_2.py step: flatten_dense_tensors_aligned(...).to(fp32); measured on gpt2 with an
    8-bit optimizer, whose own step adds nothing the probe sees)."""
    tied_gradient_sum: int = 0
    """A trained embedding tied to the output head gets two partial gradients (the head's matmul
    and the embedding's backward), which autograd's input buffer adds into a third tensor: the
    two partials are alive with every other gradient at the end of backward (measured on gpt2)."""

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())


def _static_terms(model: ModelSpec, config: TrainConfig, is_cpu: bool) -> _StaticTerms:
    """The batch-independent terms of ``config`` (memoised per model).

    Paged 8-bit states are split off on a GPU: bitsandbytes allocates them with
    cudaMallocManaged, outside PyTorch's caching allocator, so max_memory_allocated does not see
    them while nvidia-smi does when they are resident (bitsandbytes/functional.py get_paged)."""

    def compute():
        states, host = model_state_breakdown(model, config)
        gradients = states.pop("gradients", 0)
        gathered = states.pop("zero3/gathered_params", 0)
        paged = 0
        if config.optimizer is Optimizer.PAGED_ADAMW_8BIT and not is_cpu:
            paged = states.pop("optimizer_states", 0)
        mode = _mode(config)
        param_bytes = mode.weight if config.method is Method.FULL else 4
        transient = 0
        if config.offload is Offload.NONE:
            if config.zero:
                # the optimizer steps one flat fp32 partition (see model_state_breakdown)
                sizes, param_bytes = [_zero_partition(model, config)], 4
            else:
                sizes = _param_tensor_sizes(model, config)
            transient = _optimizer_step_transient(
                sizes=sizes, optimizer=config.optimizer, param_bytes=param_bytes, is_cpu=is_cpu
            )
        flatten = 0
        if config.zero in (1, 2) and config.offload is Offload.NONE:
            partition = _zero_partition(model, config)
            # in fp32 the flat copy already is the fp32 partition (.to() returns it)
            flatten = partition * 2 + 4 * partition if config.precision.is_mixed else 4 * partition
        tied = 0
        if model.tied_embeddings and config.method is Method.FULL and config.offload is Offload.NONE:
            tied = 2 * model.vocab_size * model.hidden_size * mode.weight
        return _StaticTerms(
            resident=states, gradients=gradients, gathered=gathered, paged=paged, host=host,
            optimizer_step=transient, optimizer_gradients=_optimizer_phase_gradients(model, config, gradients),
            tied_gradient_sum=tied, zero_gradient_flatten=flatten,
        )

    return _cached("static", model, _static_key(config, is_cpu), compute)


def _batch_terms(model: ModelSpec, config: TrainConfig, is_cpu: bool):
    """(saved activations by component, recompute bytes, forward and backward logits
    transients) for this micro-batch: every term is affine in the micro-batch, so two
    evaluations (b = 1 and 2) give all of them exactly."""

    def at(b: int):
        def compute():
            cfg = config if config.micro_batch == b else config.with_split(micro_batch=b, grad_accum=config.grad_accum)
            dims, mode = _dims(model, cfg), _mode(cfg)
            recompute = (
                sum(_block_activations(model, cfg, dims, mode, first=False, is_cpu=is_cpu).values()) if cfg.grad_ckpt else 0
            )
            return (activation_breakdown(model, cfg, is_cpu=is_cpu), recompute,
                    _logits_forward_transient(dims, mode), _logits_backward_transient(dims, mode))

        return _cached("batch", model, _batch_key(config, b, is_cpu), compute)

    b = config.micro_batch
    if b == 1:
        return at(1)

    def scaled():
        one, two = at(1), at(2)
        acts = {k: one[0].get(k, 0) + (b - 1) * (two[0].get(k, 0) - one[0].get(k, 0)) for k in two[0].keys() | one[0].keys()}
        return (acts,) + tuple(x1 + (b - 1) * (x2 - x1) for x1, x2 in zip(one[1:], two[1:]))

    return _cached("batch_scaled", model, _batch_key(config, b, is_cpu), scaled)


def _reserved_and_total(model: ModelSpec, gpu, *, peak: int, static: int, paged: int) -> tuple[int, int]:
    """CUDA caching allocator on top of the allocated peak, then the process total.

    Large-block rounding on the live large tensors plus the stated fragmentation of the
    activation churn; the CUDA context and paged (unified-memory) states come on top."""
    n_large = model.num_layers * 8 + 4
    transient = max(peak - static, 0)
    reserved = peak + n_large * CUDA_ROUND_LARGE // 2 + int(CUDA_FRAGMENTATION * transient)
    return reserved, reserved + int(gpu.cuda_context_bytes) + paged


def _phases(*, static: _StaticTerms, saved: int, recompute: int, fwd_logits: int, bwd_logits: int,
            accumulating: bool) -> dict[str, dict[str, int]]:
    """What lives beside the resident model states at each moment of a step (see the module
    docstring), by breakdown component ("activations" stands for every saved-activation term).
    During accumulation the previous micro-steps' gradients exist in the forward."""
    grads_fwd = static.gradients if accumulating else 0
    return {
        # ZeRO-3 holds the running block's gathered parameters (lm_head's at the end of forward)
        "forward": {"activations": saved, "logits/transient": fwd_logits, "gradients": grads_fwd,
                    "zero3/gathered_params": static.gathered},
        # the loss' backward runs before any checkpointed block is recomputed or any parameter
        # is gathered again: both belong to the rest of backward, after the logits' gradients
        # are freed (measured: ZeRO-3 on one rank holds no gathered parameters here)
        "backward_start": {"activations": saved, "logits/transient": bwd_logits, "gradients": grads_fwd},
        "backward_end": {"activations/recompute": recompute, "gradients": static.gradients,
                         "zero3/gathered_params": static.gathered,
                         "gradients/tied_embedding_partials": static.tied_gradient_sum},
        "optimizer_start": {"gradients": static.gradients, "zero/gradient_flatten": static.zero_gradient_flatten},
        "optimizer": {"gradients": static.optimizer_gradients, "optimizer_step/transient": static.optimizer_step},
    }


def totals_by_split(*, model: ModelSpec, config: TrainConfig, gpu, splits) -> list[tuple[int, int]]:
    """(process_total_bytes, cpu_bytes) of ``config`` with each (micro_batch, grad_accum) of
    ``splits`` instead of its own, exactly as ``estimate_memory`` computes them: the search's
    inner loop.

    Every phase of ``_phases`` is affine in the micro-batch (its activation and logits terms
    are, its gradient and optimizer terms do not depend on it), so the phase totals at b = 1 and
    b = 2 give each phase's line, and a split costs five multiply-adds.
    """
    is_cpu = bool(getattr(gpu, "is_cpu", False))
    static = _static_terms(model, config, is_cpu)

    def phase_lines():
        at = []
        for b in (1, 2):
            at_b = config.with_split(micro_batch=b, grad_accum=config.grad_accum)

            def batch_sums():
                acts, recompute, fwd_logits, bwd_logits = _batch_terms(model, at_b, is_cpu)
                return sum(acts.values()), recompute, fwd_logits, bwd_logits

            # shared by every optimizer and ZeRO stage of the same method, precision and shape
            saved, recompute, fwd_logits, bwd_logits = _cached("batch_sums", model, _batch_key(at_b, b, is_cpu), batch_sums)
            at.append([
                [sum(parts.values()) for parts in _phases(
                    static=static, saved=saved, recompute=recompute, fwd_logits=fwd_logits, bwd_logits=bwd_logits,
                    accumulating=accumulating,
                ).values()]
                for accumulating in (False, True)
            ])
        # lines[accumulating] = [(phase total at b = 1, its increase per sample), ...]
        return static.resident_bytes, [[(one, two - one) for one, two in zip(at[0][acc], at[1][acc])] for acc in (0, 1)]

    resident, lines = _cached("phase_lines", model, _batch_key(config, 0, is_cpu) + _static_key(config, is_cpu), phase_lines)
    out = []
    for micro, accum in splits:
        k = micro - 1
        (f0, f1), (s0, s1), (e0, e1), (p0, p1), (o0, o1) = lines[accum > 1]  # the phases of _phases
        peak = resident + max(f0 + k * f1, s0 + k * s1, e0 + k * e1, p0 + k * p1, o0 + k * o1)
        total = peak if is_cpu else _reserved_and_total(model, gpu, peak=peak, static=resident, paged=static.paged)[1]
        out.append((total, static.host))
    return out


def estimate_memory(*, model: ModelSpec, config: TrainConfig, gpu) -> MemoryEstimate:
    """Predict peak memory per device for one configuration on one GPU (or the ``cpu`` profile)."""
    is_cpu = bool(getattr(gpu, "is_cpu", False))
    static = _static_terms(model, config, is_cpu)
    acts, recompute_bytes, fwd_logits, bwd_logits = _batch_terms(model, config, is_cpu)
    resident = static.resident_bytes
    paged = static.paged
    assumptions: list[str] = []
    phases = _phases(static=static, saved=sum(acts.values()), recompute=recompute_bytes, fwd_logits=fwd_logits,
                     bwd_logits=bwd_logits, accumulating=config.grad_accum > 1)
    totals = {name: resident + sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(totals, key=lambda k: totals[k])
    peak = totals[peak_phase]

    breakdown = dict(static.resident)
    for component, size in phases[peak_phase].items():
        if component == "activations":
            breakdown.update(acts)
        else:
            breakdown[component] = size
    breakdown = {k: int(v) for k, v in breakdown.items() if v}
    assert sum(breakdown.values()) == peak, (sum(breakdown.values()), peak)

    if is_cpu:
        reserved = peak
        total = peak
        assumptions.append("cpu profile: live tensor bytes; no caching allocator, no CUDA context")
    else:
        reserved, total = _reserved_and_total(model, gpu, peak=peak, static=resident, paged=paged)
        if paged:
            assumptions.append("paged 8-bit optimizer states counted in the process total, not in the allocator")
        assumptions.append(
            f"allocator: +1 MiB rounding per large tensor and {CUDA_FRAGMENTATION:.0%} of transient bytes reserved (uncalibrated on GPU)"
        )
    if model.hidden_act not in ACTIVATION_SAVED:
        assumptions.append(
            f"activation {model.hidden_act!r} is not in the model's table: assumed to save its input like a fused kernel"
        )
    if config.method is Method.QLORA:
        assumptions.append("NF4 with double quantisation, blocksize 64; non-4-bit params upcast to fp32 by prepare_model_for_kbit_training")
    return MemoryEstimate(
        peak_allocated_bytes=peak,
        peak_reserved_bytes=reserved,
        process_total_bytes=total,
        cpu_bytes=static.host,
        breakdown=breakdown,
        peak_phase=peak_phase,
        assumptions=tuple(assumptions),
    )


def model_states_bytes(model: ModelSpec, config: TrainConfig) -> int:
    """Weights + gradients + optimizer states on one device: the floor under any batch size."""
    states, _ = model_state_breakdown(model, config)
    return sum(states.values())
