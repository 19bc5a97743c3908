"""Each emitted setting, derived from the plan's ``TrainConfig``: pure functions, no I/O, no torch.

Every value here is one the memory model (``planner.memory``) and the measurement worker
(``workers.train``) assume; a comment names where each comes from. The dicts are keyword
arguments of the real library classes: ``transformers.TrainingArguments``, ``peft.LoraConfig``,
``transformers.BitsAndBytesConfig``, DeepSpeed's config and accelerate's ``ClusterConfig``.
"""

from __future__ import annotations

from typing import Any, Mapping

from planner.config import Loop, Method, Precision, TrainConfig
from planner.emit.deepspeed import ADAM_BETAS, ADAM_EPS, LEARNING_RATE, WEIGHT_DECAY
from planner.errors import UnsupportedError
from planner.modelspec import ModelSpec
from planner.optim import OPTIMIZERS
from planner.request import ADAPTER_RECIPE, TRAINING_ARGS, unexpressible
from planner.sharding.zero import DEEPSPEED_FILE

#: the HF Trainer's default gradient clipping, written out so DeepSpeed clips alike
MAX_GRAD_NORM = 1.0
#: the checkpointing the worker applies (workers/train.py _apply_training_setup): non-reentrant,
#: which saves each checkpointed block's input only and needs no input that requires grad
CHECKPOINTING_KWARGS = {"use_reentrant": False}
#: Liger's kernels the Trainer applies with use_liger_kernel (transformers integrations/liger.py
#: apply_liger_kernel passes these to _apply_liger_kernel_to_instance): only the fused linear
#: cross-entropy the plan counts (``--fused-ce``); the others change activations the model
#: counts for the stock modules
LIGER_FUSED_CE_ONLY = {"fused_linear_cross_entropy": True, "cross_entropy": False, "rms_norm": False,
                       "rope": False, "swiglu": False}
#: what a switch of TrainingArguments (``RequestField.switch``) is written with when on
SWITCHED_WITH = {"use_liger_kernel": {"liger_kernel_config": LIGER_FUSED_CE_ONLY}}
#: fp8: accelerate's ``mixed_precision`` value and FP8 backend (accelerate utils/dataclasses.py
#: ``FP8BackendType.AO``: torchao's float8 linears, the backend ``Precision.FP8`` models). ``accelerate
#: launch`` exports them as ACCELERATE_MIXED_PRECISION and ACCELERATE_FP8_BACKEND (utils/launch.py
#: ``setup_fp8_env``); TrainingArguments keeps the launcher's value when bf16 and fp16 are off
#: (transformers training_args.py ``__post_init__``: ``os.environ.get("ACCELERATE_MIXED_PRECISION", "no")``).
FP8_MIXED_PRECISION = "fp8"
FP8_BACKEND = "AO"
#: lora_alpha = 2 r (the worker's choice; alpha only scales the update, it costs no memory)
LORA_ALPHA_PER_RANK = 2
#: with --eval-batch: evaluate every EVAL_STEPS optimizer steps (TrainingArguments' eval_steps; a run
#: shorter than that never evaluates, and the plan's eval moment is not reached) on EVAL_BATCHES eval
#: batches held out of the dataset (evaluation's memory does not grow with their number: each batch's
#: logits are freed with it, the Trainer's evaluation_loop without compute_metrics)
EVAL_STEPS = 100
EVAL_BATCHES = 4
#: the file names the settings refer to each other by (and the sharding scheme's, ``DEEPSPEED_FILE``)
OUTPUT_DIR = "output"


def model_dtype(config: TrainConfig) -> str:
    """The torch dtype the model is loaded in (``from_pretrained(dtype=...)``).

    ``*-mixed`` and fp32 keep fp32 weights (autocast does 16-bit compute; with ZeRO DeepSpeed
    casts to 16-bit itself and keeps the fp32 master copy); pure fp16/bf16 load the model in that
    dtype, so weights, gradients and optimizer states are 16-bit; QLoRA loads the non-quantized
    parts in the compute dtype (the worker's ``_build_qlora_base``)."""
    if config.method is Method.QLORA or config.precision in (Precision.FP16, Precision.BF16):
        return config.precision.compute_dtype
    return "float32"


#: the settings no trainer emit writes for can express, with what to do instead (the others the HF Trainer has
#: no key for are torchtune's)
_NOT_EMITTED = {"reentrant_ckpt": "reentrant_ckpt is transformers 4's checkpoint, which the emitted transformers 5 "
                                  "run cannot take: plan without it",
               "experts_loop": "experts_loop is transformers 4's per-expert MoE modules, which the emitted "
                               "transformers 5 run does not build: plan without it",
               "rope_caches": "rope_caches is transformers 4's per-layer rotary tables, which the emitted "
                              "transformers 5 run does not build: plan without it"}


def sets_loss_function_448(config: TrainConfig) -> bool:
    """Whether train.py (and the worker) set the model's ``loss_function`` to 4.48.1's ForCausalLMLoss
    (``planner.emit.causal_lm_loss``) for ``loss_returns_head``. With a 16-bit loss (``loss_upcast``
    False) the head's output is itself the loss' logits and 4.45's lines are the same tensors
    (``planner.memory.activations.ShiftedLoss.head_returned``): those run (``loss_shift``)."""
    return config.loss_returns_head and config.loss_upcast


def training_arguments(config: TrainConfig, *, on_cpu: bool) -> dict[str, Any]:
    """Keyword arguments of ``transformers.TrainingArguments`` (transformers 5.x names); a plan
    with a setting the HF Trainer has no key for (torchtune's, transformers 4's checkpoint: ``planner.request``)
    is refused."""
    if missing := unexpressible(config, "hf"):
        fixes = [_NOT_EMITTED[name] for name in missing if name in _NOT_EMITTED]
        if any(name not in _NOT_EMITTED for name in missing):
            fixes.append("torchtune's recipe settings: emit --for torchtune, or plan without them")
        raise UnsupportedError(f"the HF Trainer has no {', '.join(missing)} ({'; '.join(fixes)})")
    if (spec := OPTIMIZERS[config.optimizer]).hf_removed:
        raise UnsupportedError(f"transformers {spec.hf_removed} has no optim={spec.hf_optim!r} "
                               "(plan with --optimizer adamw_fused or adamw to emit)")
    args: dict[str, Any] = {
        "output_dir": OUTPUT_DIR,
        "per_device_train_batch_size": config.micro_batch,
        "gradient_accumulation_steps": config.grad_accum,
        # *-mixed is the Trainer's autocast (plus a GradScaler for fp16); pure 16-bit is the
        # model's dtype (train.py MODEL_DTYPE) with both flags off
        "bf16": config.precision is Precision.BF16_MIXED,
        "fp16": config.precision is Precision.FP16_MIXED,
        # transformers 5 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs)
        # (the old names are deprecated aliases: training_args.py)
        "activation_checkpointing": config.grad_ckpt,
        # transformers' OptimizerNames value and the arguments beside it: the optimizer's descriptor
        "optim": OPTIMIZERS[config.optimizer].hf_optim,
        "learning_rate": LEARNING_RATE,
        "weight_decay": WEIGHT_DECAY,
        "adam_beta1": ADAM_BETAS[0],
        "adam_beta2": ADAM_BETAS[1],
        "adam_epsilon": ADAM_EPS,
        "max_grad_norm": MAX_GRAD_NORM,
        # the recipe settings TrainingArguments holds as they are (planner.request, each field's
        # training_args key): the KV cache the plan counts (transformers drops it under checkpointing)
        **{f.training_args: getattr(config, f.name) for f in TRAINING_ARGS
           if not f.switch and not (f.evaluation and getattr(config, f.name) is None)},
        # evaluation only where the plan holds its pass (planner.memory.evaluation): every EVAL_STEPS
        # optimizer steps on the sequences train.py holds out
        "eval_strategy": "steps" if config.evaluates else "no",
        **({"eval_steps": EVAL_STEPS} if config.evaluates else {}),
        "num_train_epochs": 1,
        "logging_steps": 10,
        "save_strategy": "no",
        "report_to": "none",
    }
    if config.grad_ckpt:
        args["activation_checkpointing_kwargs"] = dict(CHECKPOINTING_KWARGS)
    args.update(OPTIMIZERS[config.optimizer].hf_args)
    args.update(config.sharding.spec.training_arguments(config))  # the sharding scheme's (planner.sharding)
    for f in TRAINING_ARGS:  # the switches the recipe turns on: Liger's, its fused linear cross-entropy alone; torch_compile
        if f.switch and getattr(config, f.name):
            args[f.training_args] = True
            args.update({key: dict(value) for key, value in SWITCHED_WITH.get(f.training_args, {}).items()})
    if on_cpu:
        # the Trainer refuses bf16 on a machine without a GPU unless told to train on the CPU
        args["use_cpu"] = True
    return args


def run_assumptions(config: TrainConfig) -> list[str]:
    """What the emitted files make true and the prediction rests on (PLAN.md's assumptions), the
    recipe settings' among them."""
    lines = [
        f"every sequence is exactly {config.seq_len} tokens (packed, no padding, no attention mask)" if config.packing
        else f"sequences padded to the longest in the batch, with an attention mask; the plan takes the longest as "
             f"{config.seq_len} tokens (train.py truncates to it)",
        ("a KV cache built in the forward (use_cache=True" + (", which transformers turns off under checkpointing)"
                                                                if config.grad_ckpt else ")")
         if config.use_cache else "no KV cache in training (use_cache=False)"),
        _evaluation_assumption(config),
        "the HF Trainer's step: forward, loss, the outputs freed before backward; gradients zeroed (set to None) "
        "after each optimizer step",
        f"gradients clipped to norm {MAX_GRAD_NORM} (a few scalars per step)",
    ]
    if config.loop is Loop.MANUAL:
        lines.append("the plan counts a hand-written loop that keeps `outputs` (logits, KV cache) alive through "
                     "backward (--loop manual); train.py uses the HF Trainer, which frees them: it needs less")
    if config.fused_ce:
        lines.append("Liger's fused linear cross-entropy only (use_liger_kernel with liger_kernel_config; needs "
                     "`pip install liger-kernel` and a CUDA GPU): the full logits are never materialised")
    if config.grad_ckpt:
        lines.append("non-reentrant activation checkpointing of every decoder layer (use_reentrant=False)")
    if config.method.uses_adapters:
        lines.append(f"LoRA dropout {config.lora_dropout}: " + ("each adapted layer keeps a dropped copy of its input and "
                     "the mask" if config.lora_dropout else "no dropped copy of each adapted layer's input"))
    if not config.loss_upcast:
        lines.append("a 16-bit loss: train.py passes the Trainer a compute_loss_func that computes the cross-entropy on "
                     "the logits in the head's dtype, without transformers' fp32 upcast (and with autocast off)")
    if sets_loss_function_448(config):
        lines.append("transformers 4.46-4.48's loss: train.py sets the model's loss_function to 4.48.1's ForCausalLMLoss, "
                     "which the model's forward calls on the head's 16-bit logits it returns (an upcast copy and a "
                     "contiguous shifted copy of it for the cross-entropy), as those versions did")
    elif config.loss_shift:
        lines.append("transformers <= 4.45's loss: train.py passes the Trainer a compute_loss_func that keeps the "
                     "upcast logits in the outputs and computes the cross-entropy on a contiguous shifted copy of them, "
                     "as those versions' models did in their forward; it runs after the forward returned, so the last "
                     "hidden state, which the plan counts beside the loss as those versions held it, is already freed: "
                     "it needs that much less")
    if not config.kbit_upcast:  # (peft's upcast, the default, is what every QLoRA plan says of itself)
        lines.append("no k-bit upcast: the non-4-bit parameters (norms, embeddings, head) and the residual stream stay "
                     f"{model_dtype(config)} (train.py skips peft's prepare_model_for_kbit_training)")
    if config.compile:
        lines.append("torch.compile (torch_compile: the Trainer compiles the model with Inductor, mode default): the first "
                     "steps compile it, which the step time does not count; the memory planned is eager's saved tensors, "
                     "an upper bound (AOTAutograd's partitioner recomputes pointwise ops in backward instead of saving them)")
    if config.rope_scaling:
        lines.append(f"RoPE scaling {config.rope_scaling} set on the model's config before it is built (train.py "
                     "ROPE_SCALING): it rescales the rotary frequencies only, the same tensors and time as without it")
    if config.precision is Precision.FP8:
        lines.append("fp8: accelerate's torchao backend converts every nn.Linear but the first and the lm_head whose "
                     "dims divide by 16 to torchao's Float8Linear (needs `pip install torchao` and an FP8 GPU); bf16 "
                     "autocast and fp32 weights otherwise, as bf16-mixed; eager (no torch.compile)")
    if OPTIMIZERS[config.optimizer].bnb_8bit_states:
        lines.append("8-bit states for the embeddings too (train.py undoes the Trainer's 32-bit override)")
    lines += config.sharding.spec.plan_notes
    return lines


def model_config_settings(config: TrainConfig) -> dict[str, Any]:
    """The training arguments the HF Trainer copies onto ``model.config`` before its first step,
    where the forward reads them (``RequestField.model_config``): train.py sets them there itself
    and the worker applies them alike (workers/train.py)."""
    return {f.training_args: getattr(config, f.name) for f in TRAINING_ARGS if f.model_config}


#: llama3's frequency band edges, as LLaMA-Factory sets them (model/model_utils/rope.py l.76-79) and Llama 3.1's
#: config.json has them (transformers 5.24 modeling_rope_utils.py l.646-647: "`1`/`4` in the original implementation")
LLAMA3_FREQ_FACTORS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


def rope_parameters(config: TrainConfig) -> dict[str, Any] | None:
    """What train.py merges into the model config's ``rope_parameters`` before the model is built: the type
    and factor of ``--rope-scaling`` (None: none). ``rope_parameters`` is transformers 5's name (5.24
    configuration_utils.py l.721-733: ``rope_scaling`` is its deprecated alias, and setting it drops the
    ``rope_theta`` the merge keeps); yarn and llama3 read the pretraining length from
    ``original_max_position_embeddings``, dynamic NTK from ``max_position_embeddings``
    (modeling_rope_utils.py l.329-342, l.422, l.648), which train.py's ``scaled_config`` sets accordingly."""
    if config.rope_scaling is None:
        return None
    kind, factor = config.rope_scaling.split(":")
    return {"rope_type": kind, "factor": float(factor), **(LLAMA3_FREQ_FACTORS if kind == "llama3" else {})}


#: transformers 5.24's ``default_theta`` of a model type whose config.json says no rope_theta: the base class's
#: 10000.0 (modeling_rope_utils.py: "Defaults to `config.default_theta`"), but for these
#: (models/<type>/configuration_<type>.py: mixtral l.43, llama4 l.110, gpt_oss l.37)
DEFAULT_ROPE_THETA = {"mixtral": 1_000_000.0, "llama4_text": 500_000.0, "gpt_oss": 150_000.0}
#: the share of each head's dimensions that rotates, where a config.json says none and it is not 1
#: (configuration_gpt_neox.py l.98: rotary_pct, 0.25; configuration_phi.py l.87: 0.5)
DEFAULT_PARTIAL_ROTARY = {"gpt_neox": 0.25, "phi": 0.5}
#: model types whose transformers 5 config keeps rope parameters per layer type, whatever their config.json says
#: (configuration_gemma3.py l.98 and l.138-139: sliding_attention / full_attention; configuration_gemma4.py l.201-202)
PER_LAYER_ROPE = frozenset({"gemma3_text", "gemma4_text"})


def model_rope_parameters(model_config: Mapping[str, Any]) -> dict[str, Any]:
    """The model's own rotary parameters that a whole ``rope_parameters`` must carry besides the type and factor:
    its ``rope_theta`` and, where not every dimension rotates, its ``partial_rotary_factor``, read from its
    config.json as transformers 5.24 does (the top-level v4 names, ``rope_parameters`` or v4's ``rope_scaling``,
    a wrapper's ``text_config``), else the model type's default. A trainer that sets a rope dict on the config
    (axolotl's model_config) replaces rope_parameters whole: without these, rope_theta is None (configuration_utils.py
    l.724-733, then standardize_rope_params reads a ``rope_theta`` attribute v5 configs no longer have) and the
    model fails to build. Models whose rope parameters are per layer type (Gemma 3/4) are refused."""
    text = model_config.get("text_config")
    config = text if isinstance(text, Mapping) else model_config
    nested = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    model_type = str(config.get("model_type"))
    if model_type in PER_LAYER_ROPE or any(isinstance(value, Mapping) for value in nested.values()):
        raise UnsupportedError(f"{model_type} has rope parameters per layer type (sliding and full attention), which "
                               "one rope dict on the model config replaces whole: not written; emit --for hf, whose "
                               "train.py scales the full-attention layers' as transformers does (scale_rope)")
    theta = next((v for v in (nested.get("rope_theta"), config.get("rope_theta"), config.get("rotary_emb_base"))
                  if v is not None), DEFAULT_ROPE_THETA.get(model_type, 10_000.0))
    partial = next((v for v in (nested.get("partial_rotary_factor"), config.get("partial_rotary_factor"),
                                config.get("rotary_pct")) if v is not None), DEFAULT_PARTIAL_ROTARY.get(model_type))
    return {"rope_theta": float(theta), **({"partial_rotary_factor": float(partial)} if partial is not None else {})}


def scale_rope(config, rope):
    """The transformers model config ``config`` with ``rope`` (``rope_parameters``' type and factor) merged into its
    rope_parameters, set before the model is built (its rotary embedding computes its frequencies in __init__).
    yarn and llama3 read the pretraining length from original_max_position_embeddings; dynamic NTK reads it
    from max_position_embeddings, which the others raise to the extended length. A multimodal config is scaled in
    its text config (where the language model reads both). Where the parameters are per layer type (Gemma 3's
    sliding_attention / full_attention), the full-attention layers' alone are scaled, as transformers' own Gemma 3
    config applies a rope_scaling (5.24 configuration_gemma3.py l.142-143); the sliding window's keep theirs.
    (OOM Planner's planner/emit/settings.py: the emitted train.py carries this text, and the measuring worker calls
    it.)"""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    old, current = text.max_position_embeddings, dict(text.rope_parameters or {})
    per_layer = "full_attention" in current
    rope = {**(current["full_attention"] if per_layer else current), **rope}
    if rope["rope_type"] in ("yarn", "llama3"):
        rope["original_max_position_embeddings"] = old
    text.rope_parameters = {**current, "full_attention": rope} if per_layer else rope
    if rope["rope_type"] != "dynamic":
        text.max_position_embeddings = int(old * rope["factor"])
    return config


def scaled_model_config(config: TrainConfig, model_config: Mapping[str, Any]) -> dict[str, Any]:
    """The model-config attributes train.py's ``scale_rope`` sets for ``config``'s ``--rope-scaling`` on the model whose
    config.json is ``model_config``: the whole ``rope_parameters`` (the model's rope_theta and partial_rotary_factor,
    ``model_rope_parameters``, then the type and factor, and yarn's and llama3's ``original_max_position_embeddings``)
    and ``max_position_embeddings`` where the scaling raises it. What a trainer that sets config attributes one by one
    (axolotl's ``model_config``) writes to build the model train.py builds: with the pretraining length written out,
    the keys' order does not matter (transformers 5.24 standardize_rope_params, modeling_rope_utils.py l.843, would
    otherwise take it from a max_position_embeddings already raised). Computed by ``scale_rope`` itself on a stand-in
    config, so the two cannot drift; without a max_position_embeddings in the config.json, the rope parameters
    alone (transformers then takes the pretraining length from the unchanged config)."""
    from types import SimpleNamespace

    text = model_config.get("text_config")
    length = (text if isinstance(text, Mapping) else model_config).get("max_position_embeddings")
    rope = {**model_rope_parameters(model_config), **rope_parameters(config)}  # config has a --rope-scaling
    if not isinstance(length, int):
        return {"rope_parameters": rope}
    stand_in = scale_rope(SimpleNamespace(max_position_embeddings=length, rope_parameters=None), rope)
    raised = stand_in.max_position_embeddings != length
    return {"rope_parameters": stand_in.rope_parameters,
            **({"max_position_embeddings": stand_in.max_position_embeddings} if raised else {})}


def script_recipe(config: TrainConfig) -> dict[str, Any]:
    """The recipe settings train.py applies itself (``planner.emit.train_script``): packing, the
    launcher's environment, the model-config settings (the KV cache), the evaluation pass's sequences
    QLoRA's k-bit preparation (peft's fp32 upcast or none), the loss' dtype (transformers' fp32
    upcast or train.py's 16-bit ``loss_in_logits_dtype``) and transformers <= 4.45's loss on a shifted
    copy of the logits (train.py's ``shifted_copy_loss``), 4.46-4.48's as the model's loss_function (train.py's
    ``causal_lm_loss_448``) and the RoPE scaling (``rope_parameters``)."""
    return {"packed": config.packing, "launch_env": launch_env(config), **model_config_settings(config),
            "eval_sequences": eval_sequences(config), "eval_seq_len": config.eval_tokens,
            "generate_tokens": config.generate_tokens, "kbit_upcast": config.kbit_upcast,
            "loss_upcast": config.loss_upcast, "loss_shift": config.loss_shift,
            "loss_returns_head": sets_loss_function_448(config), "rope": rope_parameters(config)}


def launch_env(config: TrainConfig) -> dict[str, str]:
    """The environment ``accelerate launch`` sets from accelerate_config.yaml that train.py sets too,
    so that ``python train.py`` runs the same precision: fp8's (``FP8_MIXED_PRECISION``, ``FP8_BACKEND``)."""
    if config.precision is not Precision.FP8:
        return {}
    return {"ACCELERATE_MIXED_PRECISION": FP8_MIXED_PRECISION, "ACCELERATE_FP8_BACKEND": FP8_BACKEND}


def eval_sequences(config: TrainConfig) -> int:
    """Sequences train.py holds out for evaluation: EVAL_BATCHES eval batches (0: no evaluation)."""
    return EVAL_BATCHES * config.eval_batch if config.evaluates else 0


def _evaluation_assumption(config: TrainConfig) -> str:
    if not config.evaluates:
        return "no evaluation while training"
    tokens = config.eval_tokens
    generation = (f", then greedy generation of {config.generate_tokens} tokens from the first eval batch's "
                  f"{tokens}-token prompts (train.py's callback)" if config.generate_tokens else "")
    return (f"evaluation every {EVAL_STEPS} optimizer steps on {eval_sequences(config)} held-out sequences of "
            f"{tokens} tokens, {config.eval_batch} per forward{generation}; the logits of each eval batch are freed "
            f"with it (no compute_metrics)")


def adapter_settings(config: TrainConfig) -> dict[str, Any]:
    """Keyword arguments of ``peft.LoraConfig`` but the task type: the adapter the worker builds
    (workers/train.py) and emit writes (``lora_config``)."""
    targets: str | list[str] = "all-linear" if config.lora_all_linear else list(config.lora_targets or ())
    return {
        "r": config.lora_r,
        "lora_alpha": LORA_ALPHA_PER_RANK * config.lora_r,
        # the adapter's recipe settings by their PEFT keys (planner.request): its dropout
        **{f.peft: getattr(config, f.name) for f in ADAPTER_RECIPE},
        "target_modules": targets,
        "bias": "none",
    }


def lora_config(config: TrainConfig, *, spec: ModelSpec) -> dict[str, Any] | None:
    """Keyword arguments of ``peft.LoraConfig``; None for full fine-tuning."""
    if not config.method.uses_adapters:
        return None
    return {
        **adapter_settings(config),
        # encoders train as masked LM without a task head wrapper, as in the worker
        "task_type": None if spec.is_encoder else "SEQ_2_SEQ_LM" if spec.is_encoder_decoder else "CAUSAL_LM",
    }


def bnb_config(config: TrainConfig) -> dict[str, Any] | None:
    """Keyword arguments of ``transformers.BitsAndBytesConfig``; None unless QLoRA.

    4-bit NF4 with double quantization (the memory model's ``_nf4_bytes``; QLoRA paper §3),
    compute in the plan's 16-bit dtype. Where the sharding scheme shards the 4-bit weights
    (``ShardingSpec.shards_4bit``: FSDP), they are stored in the dtype the model loads in: FSDP
    shards floating-point parameters of one dtype per flat parameter, and bitsandbytes then packs
    the codes into that dtype (bitsandbytes docs/source/fsdp_qlora.md, "Quantized data storage";
    transformers utils/quantization_config.py ``bnb_4bit_quant_storage``)."""
    if config.method is not Method.QLORA:
        return None
    out = {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": config.precision.compute_dtype,
    }
    if config.sharding.spec.shards_4bit:
        out["bnb_4bit_quant_storage"] = model_dtype(config)
    return out


def deepspeed_config(config: TrainConfig, *, spec: ModelSpec, on_cpu: bool) -> dict[str, Any] | None:
    """The DeepSpeed config (the worker's builder); None without ZeRO."""
    return sharding_files(config, spec=spec, on_cpu=on_cpu).get(DEEPSPEED_FILE)


def sharding_files(config: TrainConfig, *, spec: ModelSpec, on_cpu: bool) -> dict[str, dict[str, Any]]:
    """The files the sharding scheme's run reads, by name (``ShardingSpec.emitted_files``): pinned
    host buffers on a GPU machine, as the worker runs them (workers/train.py)."""
    return config.sharding.spec.emitted_files(
        config, hidden_size=spec.hidden_size, pin_memory=not on_cpu, gradient_clipping=MAX_GRAD_NORM,
        hyperparameters={"lr": LEARNING_RATE, "betas": ADAM_BETAS, "eps": ADAM_EPS, "weight_decay": WEIGHT_DECAY})


def accelerate_config(config: TrainConfig, *, on_cpu: bool) -> dict[str, Any]:
    """accelerate's ``ClusterConfig`` fields for ``accelerate launch`` (one machine)."""
    # the distribution and its plugin's section are the sharding scheme's (planner.sharding)
    sharding = dict(config.sharding.spec.accelerate(config, on_cpu=on_cpu))
    mixed = {Precision.BF16_MIXED: "bf16", Precision.FP16_MIXED: "fp16",
             Precision.FP8: FP8_MIXED_PRECISION}.get(config.precision, "no")
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": sharding.pop("distributed_type"),
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": config.gpus,
        "mixed_precision": mixed,
        "use_cpu": on_cpu,
        "debug": False,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
    }
    if config.precision is Precision.FP8:
        # the section ``accelerate config`` writes for fp8 (commands/config/cluster.py: fp8_config["backend"])
        out["fp8_config"] = {"backend": FP8_BACKEND}
    out.update(sharding)
    return out


def to_yaml(data: dict[str, Any], indent: int = 0) -> str:
    """A flat or nested dict of scalars as YAML (no PyYAML needed to write it)."""
    lines = []
    for key, value in data.items():
        pad = " " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(value, indent + 2).rstrip("\n"))
        elif isinstance(value, bool):
            lines.append(f"{pad}{key}: {'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            lines.append(f"{pad}{key}: {value}")
        else:
            # quoted: "no" would otherwise read as the boolean false
            lines.append(f"{pad}{key}: '{value}'")
    return "\n".join(lines) + "\n"


__all__ = [
    "CHECKPOINTING_KWARGS", "DEEPSPEED_FILE", "FP8_BACKEND", "FP8_MIXED_PRECISION", "LIGER_FUSED_CE_ONLY", "MAX_GRAD_NORM",
    "accelerate_config", "adapter_settings", "bnb_config", "deepspeed_config", "launch_env", "lora_config", "model_config_settings",
    "model_dtype", "sets_loss_function_448", "to_yaml", "training_arguments",
]
