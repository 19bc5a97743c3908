"""The eval pass during training: what the HF Trainer's evaluation allocates beside the model states.

The Trainer evaluates after an optimizer step (transformers 5 trainer.py ``_inner_training_loop``:
``model.zero_grad()``, then ``_maybe_log_save_evaluate``), so the eval pass finds the weights and
the optimizer states resident and no gradient (``zero_grad`` sets them to None). Its
``evaluation_loop`` calls ``model.eval()`` and, per batch, ``prediction_step`` under
``torch.no_grad()``: nothing is saved for backward, so the pass holds, at its peak, the tensors
alive at one instant of a forward. Two instants are the eval moments of the step
(``planner.memory.step.MOMENTS``):

* ``eval``: the loss forward at the loss (``prediction_step``: ``compute_loss(model, inputs,
  return_outputs=True)``; Seq2SeqTrainer's ``model(**inputs)``), where the logits, their fp32
  upcast and the log-probabilities exist together (ForCausalLMLoss: ``logits.float()``, then
  ``cross_entropy``'s ``log_softmax`` read by ``nll_loss``);
* ``eval_generate``: with ``generate_tokens``, ``model.generate`` (Seq2SeqTrainer.prediction_step
  with ``predict_with_generate``, before the loss forward) at its last decoding step, where the
  KV cache holds the prompt and every generated token but the last.

Under autocast (mixed precision, as accelerate wraps the model's forward) both hold the 16-bit
casts of every weight that requires a gradient: autocast caches a cast of a leaf fp32 tensor
that requires grad until the outermost autocast exits (aten/src/ATen/autocast_mode.cpp
``cached_cast``: ``arg.requires_grad() && arg.is_leaf()``, no grad-mode test), which in training
are the casts F.linear saves for backward and here are the same bytes, kept to the forward's end.

With ``prediction_loss_only`` (the Trainer's choice when no ``compute_metrics`` is given:
``Trainer.evaluate``) the logits die with the batch; with ``compute_metrics`` the loop keeps each
batch's logits on the device in ``all_preds`` until ``eval_accumulation_steps`` moves them to the
host (trainer.py ``evaluation_loop``), which grows with the eval set and is not counted (the
estimate's assumptions say so).
"""

from __future__ import annotations

from planner.config import TrainConfig
from planner.errors import UnsupportedError
from planner.gpus import KernelProfile
from planner.memory.activations import (
    kv_cache_token_bytes,
    logits_forward_transient,
    shifted_loss,
    shifted_tokens,
)
from planner.memory.dtypes import FP32, HALF, INT64, mode_of
from planner.memory.parameters import trainable_params
from planner.memory.saved import activation_breakdown
from planner.memory.shapes import dims_of
from planner.modelspec import ModelSpec
from planner.units import format_bytes

#: the breakdown keys of the eval pass's parts
CASTS, LOGITS, HIDDEN, TOKENS, KV_CACHE, STEP = ("eval/weight_casts", "eval/logits", "eval/hidden", "eval/tokens",
                                                 "eval/kv_cache", "eval/generate_step")

#: hidden-sized tensors of one decoding step alive at the last layer's cache update, in the residual
#: stream's dtype: the embedding's output, the residual, the norm's and the sums' (measured: 5.3 of
#: them on a 2-layer llama at 64 rows, 172 kB)
DECODE_HIDDEN = 5

#: the eval moments (``planner.memory.step.MOMENTS``), in the order Seq2SeqTrainer runs them
EVAL_MOMENTS = ("eval_generate", "eval")


def eval_parts(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
               targets: frozenset[str] | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """(the loss forward's parts at the loss, generation's at its last step), by breakdown key,
    the resident model states not included; both empty when the run does not evaluate.
    Independent of the training micro-batch (the search's batch line holds them flat)."""
    if not config.evaluates:
        return {}, {}
    if model.is_encoder_decoder:
        raise UnsupportedError(f"--eval-batch: the eval pass of an encoder-decoder ({model.id}) is not modelled: "
                               "drop --eval-batch (the plan then covers the training step only)")
    casts = weight_casts(model, config, kernels, targets)
    forward = _forward_parts(model, config) | casts
    generate = _generate_parts(model, config) | casts if config.generate_tokens else {}
    return {k: v for k, v in forward.items() if v}, {k: v for k, v in generate.items() if v}


def _eval_config(config: TrainConfig, tokens: int) -> TrainConfig:
    """``config`` as the eval forward's shapes read it: the eval batch of ``tokens`` each, no
    checkpointing (the model runs in eval mode: transformers' layers checkpoint only in training)."""
    return config.with_split(micro_batch=config.eval_batch, grad_accum=1, grad_ckpt=False).replace(seq_len=tokens)


def weight_casts(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                 targets: frozenset[str] | None = None) -> dict[str, int]:
    """Autocast's cached 16-bit casts of the weights that require a gradient, whatever the batch.
    Full fine-tuning: every linear's and the head's, the casts a training forward without
    checkpointing saves (``activations._weight_casts`` and the head's). LoRA/QLoRA: the adapters'
    only, every one of them (measured: 56 casts, 1,183,744 B, of a 4-layer llama's r16 adapters);
    a frozen weight's cast is made and freed by each F.linear (no grad, nothing saves it)."""
    if not mode_of(config).autocast:
        return {}
    if config.method.uses_adapters:
        return {CASTS: trainable_params(model, config) * HALF}
    saved = activation_breakdown(model, _eval_config(config, 1), kernels=kernels, targets=targets)
    return {CASTS: saved.get("autocast/weight_casts", 0)}


def _forward_parts(model: ModelSpec, config: TrainConfig) -> dict[str, int]:
    """At the loss of the eval forward: the logits and their fp32 upcast (the training forward's
    ``logits_forward_transient``), the log-probabilities ``cross_entropy`` makes from the upcast
    (fp32, freed after ``nll_loss``; in training they are saved for backward), the last hidden
    state the head read (the final norm's output, in the residual stream's dtype), and the int64
    token ids: the batch's, the labels padded by one (ForCausalLMLoss ``nn.functional.pad``) and
    their contiguous shift. A 16-bit loss (``loss_upcast`` False: the Trainer's compute_loss_func
    runs in eval too) has no upcast and makes its log-probabilities in the logits' dtype.
    transformers <= 4.45's loss (``loss_shift``, ``activations.shifted_loss``): the returned logits
    in the loss' dtype, their shifted copy and the log-probabilities of the shifted positions (the
    head's output freed once upcast; returned beside them under 4.46-4.48's, ``loss_returns_head``),
    and the token ids and their shifted labels."""
    eval_config = _eval_config(config, config.eval_tokens)
    dims, mode = dims_of(model, eval_config), mode_of(eval_config)
    e = dims.tokens
    if config.loss_shift:
        loss = shifted_loss(dims, mode, config)
        held = loss.shifted + loss.saved[1] if loss.shifted else loss.head  # (one token: the upcast's moment)
        return {LOGITS: loss.logits + held + (loss.head if loss.head_returned else 0), HIDDEN: e * dims.h * mode.residual,
                TOKENS: (e + shifted_tokens(dims)) * INT64}
    return {
        LOGITS: logits_forward_transient(dims, mode, upcast=config.loss_upcast)
        + e * dims.v * (FP32 if config.loss_upcast else mode.logits),
        HIDDEN: e * dims.h * mode.residual,
        TOKENS: (3 * e + dims.b) * INT64,
    }


def _generate_parts(model: ModelSpec, config: TrainConfig) -> dict[str, int]:
    """Generation's peak (greedy, ``generate_tokens`` new tokens, the KV cache on): the larger of
    its last step and its prefill. At the last step the cache of every layer holds the prompt and
    every generated token but the last, and the last layer's update holds its old keys beside the
    new (``DynamicLayer.update``: ``self.keys = torch.cat([self.keys, key_states])``); the previous
    step's fp32 next-token logits are alive (generation/utils.py ``_sample``:
    ``outputs.logits[:, -1].to(copy=True, dtype=torch.float32)``, a local until the next step
    replaces it; with no logits processor the scores are the same tensor), the step's hidden
    states (``DECODE_HIDDEN``), and the int64 ids and attention mask of the prompt and of the grown
    sequence. The prefill (one position's logits:
    ``logits_to_keep = 1``) holds the cache of the prompt and the last layer's MLP at its widest."""
    if model.is_encoder:
        raise UnsupportedError(f"--generate-tokens: {model.id} is a masked-LM encoder, which does not generate")
    prompt = _eval_config(config, config.eval_tokens)
    dims, mode = dims_of(model, prompt), mode_of(prompt)
    length = config.eval_tokens + config.generate_tokens - 1
    key, value = kv_cache_token_bytes(model, dims, mode)
    batch_ids = 2 * dims.tokens * INT64  # the prompt's ids and attention mask
    last = {
        KV_CACHE: model.num_layers * dims.b * length * (key + value),
        STEP: dims.b * (length - 1) * key + dims.b * dims.v * FP32 + DECODE_HIDDEN * dims.b * dims.h * mode.residual,
        TOKENS: batch_ids + 2 * dims.b * length * INT64,
    }
    prefill = {
        KV_CACHE: model.num_layers * dims.tokens * (key + value),
        STEP: dims.tokens * (2 * dims.h * mode.residual + 3 * dims.i * mode.compute),
        TOKENS: batch_ids,
    }
    return max(last, prefill, key=lambda parts: sum(parts.values()))


def eval_note(config: TrainConfig, curve_at: dict[str, int]) -> str:
    """The assumption line of a plan that evaluates: which pass is the run's peak, each's bytes
    (``curve_at``: the live bytes at each moment of the step)."""
    if not config.evaluates:
        return ""
    train = max((name for name in curve_at if name not in EVAL_MOMENTS), key=lambda name: curve_at[name])
    passes = [name for name in EVAL_MOMENTS if name in curve_at and (name == "eval" or config.generate_tokens)]
    evaluated = max(passes, key=lambda name: curve_at[name])
    peak = "the eval pass" if curve_at[evaluated] > curve_at[train] else "the training step"
    gen = f", generating {config.generate_tokens} tokens with the KV cache on" if config.generate_tokens else ""
    return (f"eval pass (HF Trainer evaluation_loop after an optimizer step, gradients freed, no_grad, the loss alone "
            f"kept: prediction_loss_only): batch {config.eval_batch} x {config.eval_tokens} tokens{gen}; the run's peak "
            f"is {peak} ({evaluated} {format_bytes(curve_at[evaluated])} against the step's {train} "
            f"{format_bytes(curve_at[train])}); "
            "with compute_metrics each eval batch's logits stay on the device until eval_accumulation_steps: not counted")


__all__ = ["CASTS", "EVAL_MOMENTS", "HIDDEN", "KV_CACHE", "LOGITS", "STEP", "TOKENS", "eval_note", "eval_parts", "weight_casts"]
