"""The kernels of one training micro-step and what each costs on a device: the parts
``planner.throughput`` sums into a step time.

Pure arithmetic on a ``ModelSpec`` and a ``TrainConfig``; no torch. The micro-step is counted in
two currencies, FLOPs at the device's achieved GEMM rate and bytes at its achieved bandwidth, so
its seconds are linear in the two rates (``planner calibrate`` fits them). Every GEMM costs its
FLOPs plus its operands' traffic (A and B read, C written once): NVIDIA Deep Learning Performance
Guide, "Matrix Multiplication Background": a GEMM is math-limited when its arithmetic intensity
``2MNK / (bytes of A, B and C)`` exceeds the device's FLOP/byte ratio, else memory limited. The
sum (no overlap of the two) is the roofline's upper bound: a large square-ish GEMM runs at ~90%
of the achieved matmul rate, a skinny one (LoRA's rank-r products, a small hidden size) at
memory speed. The elementwise work of a block
(norms, activations, rotary, residual adds, casts, dropout) and eager attention's materialised
scores run at achieved memory bandwidth; each kernel also costs a host-side launch, which bounds
small models (Horace He, "Making Deep Learning Go Brrrr From First Principles", 2022: overhead,
bandwidth and compute are the three regimes; eager PyTorch spends ~10 us of host time per op).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.config import Attention, Method, Precision, TrainConfig
from planner.gpus import GPUSpec
from planner.memory.parameters import stack_targets
from planner.memory.shapes import drops_adapter_inputs
from planner.modelspec import ModelSpec

# ---- achieved matmul rate per device ---------------------------------------------------------

#: Maximum achievable matmul FLOPS (MAMF) as a fraction of the dense bf16 peak: the best mean
#: rate of a brute-force search over GEMM shapes (stas00/ml-engineering, compute/accelerator/
#: README.md, "Maximum Achievable Matmul FLOPS comparison table", BF16): A100 SXM 271.2 of 312
#: (86.9%), A100 PCIe 81.1%, GH200 83.8%, H100 SXM 80.3% ("H200 is the same"), B200 77.6%,
#: GB200 72.9%, MI300X 51.4% (ROCm 6.3, TunableOp on).
MAMF_FRACTION = {
    "a100-40gb": 0.869, "a100-80gb": 0.869, "gh200": 0.838, "h100-80gb": 0.803, "h200": 0.803,
    "h100-pcie": 0.803, "b200": 0.776, "gb200": 0.729, "mi300x": 0.514,
}
#: Tensor-core GPUs the table does not list: 0.80, the median of its NVIDIA rows (0.73-0.87).
DEFAULT_MAMF_FRACTION = 0.80
#: fp32 matmuls on CUDA cores: a 10240^2 fp32 torch matmul measured 23.4 of the A10G's 31.2
#: TFLOP/s (zzc0721/torch-performance-test-data#126): 0.75.
FP32_MATMUL_FRACTION = 0.75
#: The CPU profile's FLOP/s are its MEASURED 2048^2 GEMM rates (``planner.gpus``): 1.0.
CPU_MATMUL_FRACTION = 1.0

# ---- attention kernels -----------------------------------------------------------------------

#: FlashAttention-2 forward + backward relative to the device's achieved GEMM rate: FA2 reaches
#: 50-73% of the A100's peak (Dao 2023, "FlashAttention-2", sec. 4.1; its backward is the slower
#: half), i.e. ~0.70 of the A100's 0.87 MAMF. SDPA's flash backend is the same kernel.
FLASH_FRACTION_OF_GEMM = 0.70
#: SDPA with an attention mask (padding: ``packing=False``) takes the memory-efficient kernel,
#: which computes the full masked product and runs slower than flash (xformers/cutlass fMHA);
#: 0.5 of the GEMM rate (assumption).
MASKED_SDPA_FRACTION_OF_GEMM = 0.50
#: Eager attention (and fp32 SDPA's math path) materialises the B x heads x T x T scores: bytes
#: moved per score element per 16-bit activation byte, forward + backward. HF eager forward: the
#: QK^T product written (1), scaled and masked (2), fp32 softmax read 16-bit/write fp32 (3), cast
#: back (3), dropout where p > 0 (2), read by PV (1) ~ 10-12 element-bytes-of-2; backward about
#: twice that: 30 x 2 B = 60 B per score element per layer at 16-bit (assumption from the ops).
EAGER_SCORE_PASSES = 30

# ---- elementwise work of a block --------------------------------------------------------------

#: Bytes moved per hidden element per token per layer, FORWARD, by unfused HF modules at 16-bit
#: activations (read + write of each op): an RMSNorm in transformers is six ops (to fp32 2+4,
#: pow 4+4, mean 4, rsqrt-mul 4+4, to dtype 4+2, weight mul 2+2 = 36 B), two per block; a
#: LayerNorm is one fused aten kernel reading 16-bit and writing fp32 under autocast (~8 B);
#: each residual add reads two and writes one (6 B), two per block.
RMSNORM_BYTES = 36
LAYERNORM_BYTES = 8
RESIDUAL_BYTES = 12
#: Rotary embedding per query/key element: q*cos (6), rotate_half's slices + cat (4), neg (4),
#: *sin (6), add (6) ~ 28 B (transformers apply_rotary_pos_emb).
ROTARY_BYTES = 28
#: MLP activation per intermediate element: gated act(gate) (4) and * up (6) = 10 B; plain GELU 4.
GATED_ACT_BYTES = 10
ACT_BYTES = 4
#: Dropout per element where p > 0: read, write and the bool mask (5 B); two per block.
DROPOUT_BYTES = 10
#: QLoRA's fp32 residual stream: the norm and residual bytes double (see ``block_forward_bytes``).
QLORA_FP32_STREAM = 2.0
#: Backward of elementwise work moves about twice its forward (each op reads the incoming
#: gradient and its saved input and writes the outgoing gradient).
BACKWARD_ELEMENTWISE = 2.0
#: Mixed-precision full fine-tuning under torch AMP keeps fp32 weights: autocast casts each linear weight to 16
#: bits per forward (read 4, write 2) and the backward's 16-bit weight gradient is cast up and
#: accumulated into the fp32 ``.grad`` (read 2 write 4, then read 4 + 4 write 4) = 18 B.
WEIGHT_CAST_BYTES = 6
GRAD_ACCUMULATE_BYTES = 18
#: The loss: the logits cast to fp32 (transformers' ``logits.float()``: 2 + 4), cross-entropy's
#: log-softmax read and its gradient written (4 + 4 + 4), cast back for the head's backward (4 + 2).
LOSS_BYTES_PER_LOGIT = 24

# ---- per-kernel overhead ---------------------------------------------------------------------

#: Device time per kernel beyond its work: the launch-to-launch gap of back-to-back kernels in one
#: stream, ~1 us on the GPU (NVIDIA Developer Blog, "Getting Started with CUDA Graphs", 2019:
#: 2.9 us kernels ran at 3.8 us each when launched back to back); eager PyTorch's host dispatch
#: (~10 us per op, Horace He, "Making Deep Learning Go Brrrr", overhead) hides behind the queue
#: unless the kernels are tiny, where this gap and the host both bound the step.
GPU_OP_SECONDS = 1e-6
#: Ops per decoder block, forward: 7 linears, 2 RMSNorms x 6, rotary ~10, attention 3, activation
#: 2, residual 2, views/transposes ~10 = ~45; backward about twice: ~135 per block per micro-step.
OPS_PER_BLOCK = 135
#: Ops per LoRA-adapted module per micro-step: dropout/identity, A, B, scale, add forward; their
#: backward ~2x: 15. QLoRA adds the dequantisation kernel forward and backward: 2.
OPS_PER_ADAPTER = 15
OPS_PER_QUANTIZED = 2


@dataclass(frozen=True, kw_only=True)
class DeviceRates:
    """Achieved rates of one device for one precision."""

    gemm: float
    """FLOP/s of a large GEMM: the precision's peak x the large-GEMM efficiency."""
    bandwidth: float
    """Bytes/s memory-bound kernels reach."""
    op_seconds: float
    """Seconds per eager op the device's kernels cannot hide."""


def matmul_fraction(gpu: GPUSpec, precision: Precision) -> float:
    """The large-GEMM efficiency of a device: its MAMF fraction (the default where unmeasured)."""
    if gpu.is_cpu:
        return CPU_MATMUL_FRACTION
    if precision is Precision.FP32:
        return FP32_MATMUL_FRACTION
    return MAMF_FRACTION.get(gpu.name, DEFAULT_MAMF_FRACTION)


class Work:
    """FLOPs (weighted by the kernel's rate relative to a large GEMM) and bytes of some kernels."""

    __slots__ = ("flops", "bytes")

    def __init__(self, flops: float = 0.0, bytes_: float = 0.0) -> None:
        self.flops, self.bytes = flops, bytes_

    def add(self, other: "Work", times: float = 1.0) -> None:
        self.flops += other.flops * times
        self.bytes += other.bytes * times

    def seconds(self, rates: DeviceRates) -> float:
        return self.flops / rates.gemm + self.bytes / rates.bandwidth


def gemm(m: float, n: int, k: int, *, elem: int) -> Work:
    """One (m x k) @ (k x n) GEMM: 2mnk FLOPs and its operands read and written once."""
    return Work(2.0 * m * n * k, (m * k + k * n + m * n) * elem)


def gemm_seconds(m: float, n: int, k: int, *, rates: DeviceRates, elem: int) -> float:
    """Seconds of one GEMM at ``rates``."""
    return gemm(m, n, k, elem=elem).seconds(rates)


@dataclass(frozen=True, kw_only=True)
class MicroStep:
    """One micro-step's device work by kind: (FLOPs, bytes) each; checkpointing's recompute apart."""

    gemm: tuple[float, float]
    """Block linears, vocab projection and adapters, forward and backward."""
    attention: tuple[float, float]
    """Attention's products, forward and backward (FLOPs weighted by the kernel's rate)."""
    recompute: tuple[float, float]
    """The second forward's GEMMs and attention."""
    elementwise: tuple[float, float]
    """Norms, activations, rotary, residuals, dropout, casts, loss, eager scores (incl. recompute's)."""
    ops: int
    """Kernels launched."""

    def seconds(self, rates: DeviceRates) -> tuple[float, float, float, float, float]:
        """(gemm, attention, recompute, elementwise, overhead) seconds at ``rates``."""
        g, b = rates.gemm, rates.bandwidth
        return (self.gemm[0] / g + self.gemm[1] / b, self.attention[0] / g + self.attention[1] / b,
                self.recompute[0] / g + self.recompute[1] / b, self.elementwise[0] / g + self.elementwise[1] / b,
                self.ops * rates.op_seconds)

    @property
    def flops(self) -> float:
        return self.gemm[0] + self.attention[0] + self.recompute[0] + self.elementwise[0]

    @property
    def bytes(self) -> float:
        return self.gemm[1] + self.attention[1] + self.recompute[1] + self.elementwise[1]


def _linears(model: ModelSpec):
    # every kind of block (ModelSpec.all_blocks): the dense and MoE blocks of a mixed model differ
    for n, linears in model.all_blocks:
        for lin in linears:
            yield n, lin


def _gemms(model: ModelSpec, config: TrainConfig) -> tuple[tuple[float, float, float], ...]:
    """(forward, backward, head-forward) GEMM work of the block linears, the vocab projection and
    the adapters, each as (FLOPs per token, bytes per token, bytes per micro-step): ``gemm`` summed
    over the linears, in closed form (a linear of ``count`` experts, ``active`` per token, sees
    ``tokens x active / count`` tokens per expert: its FLOPs and activations scale with the
    tokens, its weights are read once per pass)."""
    elem = config.precision.compute_bytes
    backward = 2 if config.method is Method.FULL else 1  # dX always; dW only for trained weights
    f = t = w = 0.0
    for n, lin in _linears(model):
        f += 2.0 * n * lin.active * lin.out_features * lin.in_features
        t += n * lin.active * (lin.in_features + lin.out_features) * elem
        w += n * lin.count * lin.in_features * lin.out_features * elem
    hf = ht = hw = 0.0
    if model.lm_head_params:
        hf = 2.0 * model.vocab_size * model.hidden_size
        ht = (model.hidden_size + model.vocab_size) * elem
        hw = model.vocab_size * model.hidden_size * elem
    af = at = aw = 0.0
    if config.method is not Method.FULL:
        r = config.lora_r or 0
        for n, linears in stack_targets(model, config.lora_targets):
            for lin in linears:  # A: in -> r, B: r -> out
                af += 2.0 * n * lin.active * r * (lin.in_features + lin.out_features)
                at += n * lin.active * (lin.in_features + 2 * r + lin.out_features) * elem
                aw += n * lin.count * r * (lin.in_features + lin.out_features) * elem
    forward = (f + hf + af, t + ht + at, w + hw + aw)
    back = (backward * (f + hf) + 2 * af, backward * (t + ht) + 2 * at, backward * (w + hw) + 2 * aw)
    return forward, back, (hf, ht, hw)


def _attention_layers(model: ModelSpec, config: TrainConfig) -> tuple[tuple[int, int, int, int], ...]:
    """(layers, heads, head dim, keys each query reads) of each kind of softmax-attention block: every block
    of a model whose blocks are alike; per kind where they differ (Gemma 4's global layers' head dim and
    their full context beside the sliding ones; Gated DeltaNet layers have none: ``_linear_attention_flops``)."""
    def context(sliding: bool) -> int:
        return min(config.seq_len, model.sliding_window) if model.sliding_window and sliding else config.seq_len
    if not model.other_blocks:
        return ((model.num_layers + 2 * model.decoder_layers, model.num_heads, model.head_dim, context(True)),)
    per_layer = any(view.sliding_attention for _, _, view in model.block_kinds)
    kinds: dict[tuple[int, int, int], int] = {}  # kinds alike in these (dense and MoE blocks) summed as one
    for n, _, view in model.block_kinds:
        if view.mixer == "attention":
            key = (view.num_heads, view.head_dim, context(view.sliding_attention or not per_layer))
            kinds[key] = kinds.get(key, 0) + n
    return tuple((n, heads, head_dim, ctx) for (heads, head_dim, ctx), n in kinds.items())


def _linear_attention_flops(model: ModelSpec, tokens: int) -> float:
    """Forward FLOPs of the Gated DeltaNet layers' chunked delta rule (torch_chunk_gated_delta_rule /
    fla chunk_gated_delta_rule, chunks of C tokens), per token and value head: the C x C products k_beta·kᵀ
    and q·kᵀ (2·C·dk each), the two triangular solves against C x (dv + dk), the intra-chunk product with
    v_new (2·C·dv), and the state's read and update (2 x 2·dk·dv)."""
    gdn = model.gated_deltanet
    if gdn is None:
        return 0.0
    layers = sum(n for n, _, view in model.block_kinds if view.mixer == "gated_deltanet")
    c = gdn.chunk
    per_head = 4 * c * gdn.k_dim + c * (gdn.v_dim + gdn.k_dim) + 2 * c * gdn.v_dim + 4 * gdn.k_dim * gdn.v_dim
    return float(layers * gdn.v_heads * per_head * tokens)


def attention_flops(model: ModelSpec, config: TrainConfig, tokens: int) -> tuple[float, float]:
    """(forward + backward, one more forward) FLOPs of attention's products, each weighted by the
    kernel's rate relative to a large GEMM (FLOPs / fraction). Causal fused kernels (flash; SDPA's
    flash backend on packed 16-bit batches, ``is_causal``) skip the masked half of T x T; eager
    attention's materialised scores are memory traffic (``_score_bytes``). Linear-attention layers
    add their chunked products (``_linear_attention_flops``) at the fused kernels' rate."""
    forward = sum(4.0 * layers * ctx * heads * head_dim * tokens
                  for layers, heads, head_dim, ctx in _attention_layers(model, config))
    if _fused_attention(config):
        if not model.is_encoder and not model.is_encoder_decoder and config.packing:
            forward /= 2  # causal: the kernel skips the masked half
        causal_kernel = config.packing or config.attention is Attention.FLASH
        forward /= FLASH_FRACTION_OF_GEMM if causal_kernel else MASKED_SDPA_FRACTION_OF_GEMM
    if linear := _linear_attention_flops(model, tokens):
        forward += linear / FLASH_FRACTION_OF_GEMM
    return 3 * forward, forward


def _fused_attention(config: TrainConfig) -> bool:
    """Whether attention runs a fused kernel (no materialised scores): flash, or SDPA at 16 bits
    (fp32 SDPA on CUDA takes the math path or the slower fp32 efficient kernel: eager-like)."""
    if config.attention is Attention.FLASH:
        return True
    return config.attention is Attention.SDPA and config.precision is not Precision.FP32


def _score_bytes(model: ModelSpec, config: TrainConfig) -> float:
    """Bytes eager attention's materialised scores move per token, forward + backward."""
    if _fused_attention(config):
        return 0.0
    return float(sum(layers * heads * ctx * EAGER_SCORE_PASSES * config.precision.compute_bytes
                     for layers, heads, _, ctx in _attention_layers(model, config)))


def block_forward_bytes(model: ModelSpec, config: TrainConfig) -> float:
    """Bytes the elementwise ops of one block's forward move per token (16-bit activations;
    x2 for fp32 ones)."""
    h = model.hidden_size
    per = h * ((RMSNORM_BYTES if model.norm == "rmsnorm" else LAYERNORM_BYTES) * 2 + RESIDUAL_BYTES)
    if config.method is Method.QLORA:
        # peft's prepare_model_for_kbit_training casts every non-quantised parameter (the norms'
        # weights) to fp32: the norms return fp32 and the residual stream they feed stays fp32
        per *= QLORA_FP32_STREAM
    if model.position == "rope":
        per += (model.num_heads + model.num_kv_heads) * model.head_dim * ROTARY_BYTES
    per += model.intermediate_size * (GATED_ACT_BYTES if model.gated_mlp else ACT_BYTES)
    if model.hidden_dropout:
        per += h * DROPOUT_BYTES
    return per * config.precision.compute_bytes / 2


def elementwise_bytes(model: ModelSpec, config: TrainConfig, tokens: int) -> float:
    """Bytes of the micro-step's memory-bound non-GEMM work that grows with the tokens: the blocks'
    elementwise ops (forward, backward, and the recompute's forward), eager scores, the loss and the
    adapters' scale-and-add (mixed precision's weight casts: ``weight_cast_bytes``)."""
    blocks = model.num_layers + model.decoder_layers
    forward = block_forward_bytes(model, config) * blocks
    per_token = forward * (1 + BACKWARD_ELEMENTWISE + int(config.grad_ckpt)) + _score_bytes(model, config)
    if model.lm_head_params:
        per_token += model.vocab_size * LOSS_BYTES_PER_LOGIT
    if config.method is not Method.FULL:
        # each adapted output is scaled and added to the base output (10 B fwd, 4 B bwd); in
        # backward the adapter's input gradient is added to the base's (6 B per input element)
        # and with a LoRA dropout each adapter drops its own copy of its input (5 B fwd, 5 B bwd)
        ins = 6 + (DROPOUT_BYTES if drops_adapter_inputs(config) else 0)
        outs = sum(n * sum(lin.active * (lin.out_features * 14 + lin.in_features * ins) for lin in linears)
                   for n, linears in stack_targets(model, config.lora_targets))
        per_token += outs * config.precision.compute_bytes / 2
    return per_token * tokens


def block_weights(model: ModelSpec) -> int:
    """Weights of the block linears (all experts)."""
    return sum(n * lin.count * lin.in_features * lin.out_features for n, lin in _linears(model))


def weight_cast_bytes(config: TrainConfig, weights: int) -> float:
    """Bytes per micro-step of torch AMP's fp32 weights: cast to 16 bits per forward (and per
    recompute) and the 16-bit gradients accumulated into fp32 ``.grad``; none where the weights
    are 16-bit already (LoRA's frozen base, pure 16-bit) or the scheme keeps its own fp32 master
    copy (DeepSpeed ZeRO runs 16-bit model weights)."""
    if not casts_weights(config):
        return 0.0
    return weights * (WEIGHT_CAST_BYTES * (1 + int(config.grad_ckpt)) + GRAD_ACCUMULATE_BYTES)


def casts_weights(config: TrainConfig) -> bool:
    """Whether torch AMP casts fp32 weights each micro-step (see ``weight_cast_bytes``)."""
    return (config.method is Method.FULL and config.precision.is_mixed
            and not config.sharding.spec.master_update_bytes(config))


def ops_per_micro_step(model: ModelSpec, config: TrainConfig) -> int:
    """Eager ops one micro-step launches (forward, backward, recompute)."""
    blocks = model.num_layers + model.decoder_layers
    ops = blocks * OPS_PER_BLOCK * (4 if config.grad_ckpt else 3) // 3
    if config.method is not Method.FULL:
        adapted = sum(n * len(linears) for n, linears in stack_targets(model, config.lora_targets))
        ops += adapted * OPS_PER_ADAPTER
    if config.method is Method.QLORA:
        ops += sum(n * len(linears) for n, linears in model.all_blocks) * OPS_PER_QUANTIZED * (3 if config.grad_ckpt else 2) // 2
    return ops


@dataclass(frozen=True, kw_only=True)
class MicroTerms:
    """A micro-step's work as ``fixed + per_token x tokens`` (every term is affine in the tokens:
    GEMMs read their weights once and their activations per token), so one search prices every
    micro-batch of a sequence length from one count."""

    fixed: MicroStep
    per_token: MicroStep

    def at(self, tokens: int) -> MicroStep:
        f, p = self.fixed, self.per_token

        def term(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
            return (a[0] + b[0] * tokens, a[1] + b[1] * tokens)

        return MicroStep(gemm=term(f.gemm, p.gemm), attention=term(f.attention, p.attention),
                         recompute=term(f.recompute, p.recompute), elementwise=term(f.elementwise, p.elementwise),
                         ops=f.ops)


@dataclass(frozen=True, kw_only=True)
class PricedTerms:
    """``MicroTerms`` priced at one device's rates: (gemm, attention, recompute, elementwise,
    overhead) seconds as ``fixed + per_token x tokens``."""

    fixed: tuple[float, ...]
    per_token: tuple[float, ...]

    def at(self, tokens: int) -> tuple[float, ...]:
        f, p = self.fixed, self.per_token
        return (f[0] + p[0] * tokens, f[1] + p[1] * tokens, f[2] + p[2] * tokens, f[3] + p[3] * tokens,
                f[4] + p[4] * tokens)


def price(terms: MicroTerms, rates: DeviceRates) -> PricedTerms:
    """The seconds of a micro-step's work at ``rates``."""
    return PricedTerms(fixed=terms.fixed.seconds(rates), per_token=terms.per_token.seconds(rates))


def micro_terms(model: ModelSpec, config: TrainConfig) -> MicroTerms:
    """The work of a micro-step of ``config``'s kind at any micro-batch (its ``micro_batch`` unread)."""
    forward, backward, head = _gemms(model, config)
    attention, attention_fwd = attention_flops(model, config, 1)
    recompute_fixed, recompute_token = (0.0, 0.0), (0.0, 0.0)
    if config.grad_ckpt:  # the blocks' forward again, not the head's
        recompute_fixed = (0.0, forward[2] - head[2])
        recompute_token = (forward[0] - head[0] + attention_fwd, forward[1] - head[1])
    fixed = MicroStep(gemm=(0.0, forward[2] + backward[2]), attention=(0.0, 0.0), recompute=recompute_fixed,
                      elementwise=(0.0, 0.0), ops=ops_per_micro_step(model, config))
    per_token = MicroStep(gemm=(forward[0] + backward[0], forward[1] + backward[1]), attention=(attention, 0.0),
                          recompute=recompute_token, elementwise=(0.0, elementwise_bytes(model, config, 1)), ops=0)
    return MicroTerms(fixed=fixed, per_token=per_token)


def micro_step(model: ModelSpec, config: TrainConfig) -> MicroStep:
    """The work of one micro-step's kernels (no device in it: ``MicroStep.seconds`` prices it)."""
    return micro_terms(model, config).at(config.micro_batch * config.seq_len)


__all__ = [
    "DeviceRates",
    "MicroStep",
    "MicroTerms",
    "PricedTerms",
    "Work",
    "attention_flops",
    "block_forward_bytes",
    "block_weights",
    "casts_weights",
    "elementwise_bytes",
    "gemm",
    "gemm_seconds",
    "matmul_fraction",
    "micro_step",
    "micro_terms",
    "ops_per_micro_step",
    "price",
    "weight_cast_bytes",
]
