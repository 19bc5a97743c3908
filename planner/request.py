"""The request's fields, declared once: what a user sets when asking for an estimate or a plan.

Each ``RequestField`` says its name (``TrainConfig``'s, the API body's, the Python API's keyword),
its plain type and default, its bounds as the command line and the body state them, the help text,
the command-line flag, and how the search's memo keys hold it (``planner/search.py``
``_static_key``/``_batch_key``: a field the memory terms read must be in one, or two
configurations that differ in it would share a wrong prediction). From this table are derived:
the options of ``planner estimate``, ``measure``, ``suggest`` and ``submit`` (``planner.cli.plan``),
the API bodies (``planner.service.schemas``), ``SuggestRequest``'s and ``SearchSpace``'s recipe
fields (``with_recipe_fields``), ``planner.estimation.CONFIG_OPTIONS`` and the memo keys; and
from its library keys (``training_args``, ``peft``, ``trl``) the settings ``planner emit`` writes,
the worker applies and ``planner check`` reads back. Adding a recipe setting is one entry here, its
``TrainConfig`` field, the memory term that reads it and what PLAN.md says of it
(``planner.emit.settings.run_assumptions``).

Foundation layer: plain data, no torch, no typer, no pydantic (the surfaces build their own
objects from it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

#: how the search's memo keys hold a ``TrainConfig`` field (``RequestField.memo``)
STATIC = "static"
"""In ``_static_key`` as it is: the batch-independent terms (``memory.states.static_terms``) read it."""
BATCH = "batch"
"""In ``_batch_key`` as it is: the per-micro-batch terms (``memory.step.batch_line``) read it."""
DERIVED = "derived"
"""Read through what it decides, which the keys hold instead: the precision as the dtype mode
(``memory.dtypes.mode_of``) and the stored weight's bytes, the sharding as ``Sharding.memory_key``; in
the batch key the method, precision and sharding as what the per-micro-batch terms read of them
(``memory.step.line_reads``)."""
SPLIT = "split"
"""The split the screen varies (micro-batch x accumulation): the keys leave it out on purpose, the
batch lines are affine in the micro-batch and the static parts are kept per accumulating or not."""
FIXED = "fixed"
"""Not varied by the search (it keeps the field's default, or a recipe setting's given value that no
memory term reads), so no key needs it."""
OPTION = "option"
"""Not a ``TrainConfig`` field: an option that makes one (``--zero``/``--offload`` make the sharding)."""

_MEMO = frozenset({STATIC, BATCH, DERIVED, SPLIT, FIXED, OPTION})


@dataclass(frozen=True, kw_only=True)
class RequestField:
    """One field of a request, as every surface spells it."""

    name: str
    """``TrainConfig``'s field, the body's key and the Python API's keyword."""
    type: type
    """The plain value on the command line and in the body: bool, int, float or str."""
    default: Any
    """The value when not given (None: an optional field whose absence means "decide for me")."""
    help: str
    """What it means, said once for the command line's ``--help`` and the API's schema."""
    flag: str | None
    """The command-line option ("--name", or "--name/--no-name" for a switch); None: no option."""
    memo: tuple[str, ...]
    """How the search's memo keys hold it (``STATIC``, ``BATCH``, ``DERIVED``, ``SPLIT``, ``FIXED``,
    ``OPTION``): a field read by a memory term must be ``STATIC`` or ``BATCH`` or ``DERIVED``
    (``tests/cli/test_request_fields.py`` checks each against ``estimate_memory``)."""
    terms: str = ""
    """The memory terms that read it (where a ``STATIC`` or ``BATCH`` field is read)."""
    upper: int | None = None
    """A count's sanity bound (``TrainConfig`` refuses more): far above any real run, low enough that
    every derived byte count fits the store's 64-bit integers."""
    max_length: int | None = None
    """The longest text the API takes (a str field)."""
    short: str | None = None
    """The option's one-letter spelling ("-b"), if it has one."""
    names_of: str | None = None
    """The registry whose names the help lists where it says ``{names}`` ("optim", "sharding"):
    read when a surface asks (``help_text``), so a new optimizer or scheme is its module alone."""
    recipe: bool = False
    """A recipe setting: fixed by the user and given to every candidate of a search that takes it
    (``recipe_for``: those of the adapters to LoRA/QLoRA's, those of QLoRA to QLoRA's)."""
    adapters_only: bool = False
    """Only LoRA/QLoRA take it (the search gives full fine-tuning the default)."""
    full_only: bool = False
    """Only full fine-tuning takes it: ``TrainConfig`` refuses it with adapters, and a trainer's
    config for LoRA/QLoRA leaves its key out (``trainer_values``)."""
    estimate: bool = True
    """An option of ``planner estimate``/``measure`` after the model and device options (and a key
    of ``POST /v1/estimate``)."""
    build: bool = True
    """A keyword of ``planner.estimation.build_config`` (``CONFIG_OPTIONS``; the sequence length is
    given apart, the sharding as ``zero`` and ``offload``)."""
    # How the libraries a run uses spell it, declared here once: ``planner emit`` writes it under
    # these keys (planner.emit.settings), the worker applies the settings emit writes
    # (workers/train.py), and ``planner check`` reads a user's file back through them
    # (planner.check.reading, planner.check.diff).
    training_args: str | None = None
    """Its key in ``transformers.TrainingArguments`` (TRL's configs subclass it)."""
    switch: bool = False
    """``training_args`` is a switch the field turns on: the key is written (and read) only when
    on; off leaves it out, the library's default."""
    model_config: bool = False
    """The HF Trainer copies the ``training_args`` value onto ``model.config``, where the forward
    reads it (transformers trainer.py, before the first step: ``self.model.config.<key> =
    self.args.<key>``): the emitted train.py and the worker set it there too, and a
    ``model_init_kwargs`` value of it is overwritten."""
    advised: Any = None
    """The value the advice tries when nothing fits (planner.advice) for a recipe setting that
    lowers memory: the search keeps the recipe as given, so it never tries it (None: not tried)."""
    peft: str | None = None
    """Its key in PEFT's ``LoraConfig`` (adapter_config.json, emit's lora_config.json)."""
    trl: str | None = None
    """Its key in TRL's ``ModelConfig``, which a TRL trainer config takes with the training arguments."""
    trainers: tuple[tuple[str, str | None], ...] = ()
    """(trainer, key) for the trainers ``planner check`` reads and ``planner emit --for`` writes
    (axolotl, llama-factory, torchtune; "hf", the HF Trainer's ``TrainingArguments``, only as None:
    its keys are ``training_args``): the key of their own config that spells the field (dotted for
    torchtune's components), or None where that trainer's config has none, so a value other than the
    default cannot be written there (``unexpressible``)."""
    qlora_only: bool = False
    """Only QLoRA takes it (a setting of the k-bit preparation): ``TrainConfig`` refuses a value other
    than the default with any other method."""
    evaluation: bool = False
    """A setting of the evaluation pass: absent (None) where the run does not evaluate, so
    ``planner emit`` writes its ``training_args`` key only when given (with an ``eval_strategy``
    that evaluates), and ``planner check`` reads it from a file only where the file's
    ``eval_strategy`` evaluates (its eval batch size says nothing otherwise)."""

    def __post_init__(self) -> None:
        assert set(self.memo) <= _MEMO and self.memo, (self.name, self.memo)

    @property
    def optional(self) -> bool:
        return self.default is None


def help_text(field: RequestField) -> str:
    """``field``'s help as the command line and the API show it: ``{names}`` is its registry's
    names (``names_of``: ``planner.optim``, ``planner.sharding``), imported only when asked."""
    if field.names_of is None:
        return field.help
    import importlib

    return field.help.format(names=importlib.import_module(f"planner.{field.names_of}").names())


def _field(name: str, type_: type, default: Any, help: str, *, memo: tuple[str, ...], flag: str | None = "",
           **more: Any) -> RequestField:
    """A field whose flag is its name with dashes (a bool one a --x/--no-x switch) unless ``flag``."""
    if flag == "":
        dashed = "--" + name.replace("_", "-")
        flag = f"{dashed}/--no-{dashed[2:]}" if type_ is bool else dashed
    return RequestField(name=name, type=type_, default=default, help=help, flag=flag, memo=memo, **more)


# The order is ``planner estimate``'s (its --help lists them so): the model and device options
# come first in each command, then these.
#: the trainers' core configs have no key for a fused cross-entropy, use_cache in training or a
#: hand-written loop (axolotl's AxolotlInputConfig, LLaMA-Factory's argument dataclasses, torchtune's
#: single-device recipes: planner/data/trainers/*.json)
_NO_TRAINER_KEY = (("axolotl", None), ("llama-factory", None), ("torchtune", None))

_FIELDS = (
    _field("method", str, "full", "full|lora|qlora", memo=(STATIC, DERIVED), max_length=32,
           terms="what is trained and stored (memory/parameters.py, memory/states.py) and the activations"),
    _field("precision", str, None, "fp32|fp16-mixed|bf16-mixed|fp16|bf16|fp8 (default: bf16-mixed, or fp16-mixed where the "
           "GPU has no bf16; lora: bf16, or fp16, a 16-bit frozen base with fp32 adapters).", memo=(DERIVED,),
           max_length=32),
    # the help is the registry's names (planner.optim.names), filled in when asked (help_text)
    _field("optimizer", str, "adamw", "{names}", memo=(STATIC,), max_length=32, names_of="optim",
           terms="the optimizer's states and step temporaries (planner.optim, memory/states.py)"),
    _field("micro_batch", int, 1, "Sequences per forward/backward on one device.", memo=(SPLIT,), upper=1 << 20),
    _field("seq_len", int, None, "Tokens per sequence (default: min(2048, the model's maximum)).", memo=(BATCH,),
           build=False, upper=1 << 24, terms="every activation (memory/activations.py, memory/step.py)"),
    _field("grad_accum", int, 1, "Micro-steps per optimizer step.", memo=(SPLIT,), upper=1 << 20),
    _field("gpus", int, 1, "Data-parallel devices.", memo=(STATIC,), estimate=False, upper=1 << 16,
           terms="the sharded model states and the collectives' buffers (planner.sharding, memory/states.py)"),
    _field("grad_ckpt", bool, False, "Gradient checkpointing.", memo=(BATCH,),
           terms="what each layer saves for backward (memory/activations.py, memory/step.py)"),
    _field("attention", str, "sdpa", "sdpa|eager|flash", memo=(BATCH,), max_length=32,
           terms="the attention's saved tensors and workspaces (memory/attention.py)"),
    _field("lora_r", int, None, "LoRA rank (default: 16 for lora/qlora).", memo=(STATIC, BATCH), adapters_only=True,
           upper=1 << 16, terms="the adapters' parameters and states (memory/parameters.py) and activations"),
    _field("lora_targets", str, None, "all-linear or a comma list of module names (default: all-linear).",
           memo=(STATIC, BATCH), max_length=1000, adapters_only=True,
           terms="which linears carry adapters (memory/parameters.py) and what they save"),
    _field("zero", int, 0, "DeepSpeed ZeRO stage 0|1|2|3.", memo=(OPTION,)),
    _field("offload", str, "none", "none|optimizer|optimizer+params (DeepSpeed CPU offload).", memo=(OPTION,),
           max_length=32),
    _field("alloc_conf", str, None, "PyTorch CUDA caching allocator settings as PYTORCH_CUDA_ALLOC_CONF takes them, "
           "e.g. max_split_size_mb:128,expandable_segments:True.", memo=(FIXED,), max_length=500),
    _field("lora_dropout", float, 0.0, "PEFT's lora_dropout for lora/qlora (recipes use 0.05-0.1; 0: no dropout).",
           memo=(BATCH,), recipe=True, adapters_only=True,
           terms="each adapter's dropout mask and dropped input (memory/activations.py lora/dropout, memory/shapes.py)",
           peft="lora_dropout", trl="lora_dropout",
           trainers=(("axolotl", "lora_dropout"), ("llama-factory", "lora_dropout"), ("torchtune", "model.lora_dropout"))),
    _field("loop", str, "trainer", "trainer|manual: the HF Trainer (the logits die at the loss) or a hand-written "
           "loop `outputs = model(**batch); outputs.loss.backward()` (outputs live through backward).",
           memo=(BATCH,), max_length=32, recipe=True,
           terms="the outputs a hand-written loop keeps (memory/step.py loop/manual_outputs)", trainers=_NO_TRAINER_KEY),
    _field("fused_ce", bool, False, "A fused linear cross-entropy (Liger's): the logits are never materialised.",
           memo=(BATCH,), recipe=True, terms="the logits and the loss (memory/activations.py, memory/timeline.py)",
           training_args="use_liger_kernel", switch=True, advised=True, trainers=_NO_TRAINER_KEY),
    _field("packing", bool, True, "Sequences packed to --seq-len (default), or padded to the longest in the batch.",
           memo=(BATCH,), recipe=True, terms="the attention mask (memory/attention.py)"),
    _field("use_cache", bool, False, "transformers' use_cache in the training forward (a KV cache; the HF Trainer "
           "turns it off, so does --grad-ckpt).", memo=(BATCH,), recipe=True,
           terms="the KV cache (memory/activations.py kv_cache_block_bytes)", training_args="use_cache",
           model_config=True, trainers=_NO_TRAINER_KEY),
    # torchtune's recipe settings (its single-device full recipe: recipes/full_finetune_single_device.py);
    # the HF Trainer (emit's and the worker's "hf", TRL's too), axolotl and LLaMA-Factory have neither
    _field("optimizer_in_bwd", bool, False, "torchtune's optimizer_in_bwd: the optimizer steps each parameter in "
           "backward as its gradient is made, which is then freed (only the largest tensor's gradient is alive); "
           "full fine-tuning on one device without accumulation.", memo=(STATIC,), recipe=True, full_only=True,
           terms="the gradients alive (memory/parameters.py largest_gradient_elements, memory/states.py)",
           trainers=(("hf", None), ("axolotl", None), ("llama-factory", None), ("torchtune", "optimizer_in_bwd"))),
    _field("loss_chunks", int, 1, "Pieces a chunked cross-entropy splits the logits into along the sequence, each "
           "upcast to fp32 alone (torchtune's CEWithChunkedOutputLoss num_output_chunks, 8 in its configs; 1: the "
           "whole logits at once).", memo=(BATCH,), recipe=True, upper=1 << 16,
           terms="the loss' fp32 transients (memory/activations.py loss_chunk_tokens, memory/step.py)",
           trainers=(("hf", None), ("axolotl", None), ("llama-factory", None), ("torchtune", "loss.num_output_chunks"))),
    # The loss' dtype: transformers' ForCausalLMLoss upcasts the whole logits to fp32 before the
    # cross-entropy (transformers 5.24 loss/loss_utils.py:61, ``logits = logits.float()``), so the HF
    # Trainer, TRL, axolotl and LLaMA-Factory do; torchtune's CEWithChunkedOutputLoss upcasts one
    # piece at a time (loss_chunks); litgpt's chunked_cross_entropy runs F.cross_entropy on the bf16
    # pieces with no upcast (litgpt/utils.py). No trainer's config spells it: emit's train.py passes
    # the HF Trainer a compute_loss_func without the upcast (planner.emit.train_script).
    _field("loss_upcast", bool, True, "The cross-entropy upcasts the logits to fp32 first (transformers' "
           "ForCausalLMLoss, the default); --no-loss-upcast: it runs on the logits in the head's 16-bit dtype "
           "(litgpt's chunked_cross_entropy): 16-bit log-probabilities and loss gradients, no fp32 copy.",
           memo=(BATCH,), recipe=True,
           terms="the loss' log-probabilities and transients (memory/activations.py log_softmax_bytes, memory/step.py)",
           trainers=_NO_TRAINER_KEY),
    # Where the loss shifts: transformers 5's ForCausalLMLoss pads the labels and shifts them
    # (transformers 5.24 loss/loss_utils.py:64-66); transformers <= 4.45 computed the loss in each
    # causal LM's forward on a contiguous copy of the logits less each sequence's last position
    # (4.45.2 models/mistral/modeling_mistral.py l.1059-1074, llama l.1214-1229, qwen2 l.1187-1202;
    # 4.40.0 mistral l.1171-1185, qwen2 l.1182-1196), the logits upcast to fp32 first (GPT-2 and
    # BLOOM shift the head's logits with no upcast of their own: 4.40.0 modeling_gpt2.py l.1327-1334,
    # modeling_bloom.py l.864-871). The installed transformers never runs it: emit's train.py and the
    # worker pass the model no labels and compute that loss on its logits (``shifted_copy_loss``).
    _field("loss_shift", bool, False, "The causal-LM loss as transformers <= 4.45 computes it in the model's forward: "
           "the upcast logits returned and a contiguous copy of all but each sequence's last position for "
           "CrossEntropyLoss, whose backward fills a zero gradient of the whole logits (default: transformers 5's "
           "ForCausalLMLoss, which shifts the labels instead).", memo=(BATCH,), recipe=True,
           terms="the loss' logits-sized tensors and their order (memory/activations.py shifted_loss, "
           "memory/timeline.py)", trainers=_NO_TRAINER_KEY),
    # transformers 4.46-4.48's loss: the model returns the head's 16-bit logits and ForCausalLMLoss upcasts
    # them and makes the shifted contiguous copy (4.48.1 models/mistral/modeling_mistral.py l.848-852,
    # loss/loss_utils.py l.36-47); transformers PR #35646 dropped the copy after 4.48.1. emit's train.py
    # sets that loss as the model's loss_function (planner/emit/causal_lm_loss.py)
    _field("loss_returns_head", bool, False, "With --loss-shift: the loss as transformers 4.46-4.48 compute it, "
           "the model returning the head's own 16-bit logits and ForCausalLMLoss upcasting them before the shifted "
           "copy, so the 16-bit logits are alive beside the fp32 ones until the outputs die (default: 4.45's, "
           "which returns the upcast logits).", memo=(BATCH,), recipe=True,
           terms="the head's logits kept beside the loss' tensors (memory/activations.py shifted_loss, "
           "memory/timeline.py)", trainers=_NO_TRAINER_KEY),
    # transformers 4's model-level checkpoint: the model's loop calls each decoder layer inside a reentrant
    # torch.utils.checkpoint (4.45.2 models/mistral/modeling_mistral.py l.805-806; use_reentrant True by
    # default, modeling_utils.py l.2404), so under FSDP1 the checkpoint runs around the layer's unit;
    # transformers 5 checkpoints inside the layer (GradientCheckpointingLayer) and the planner's own runs ask
    # for a non-reentrant one: emit and the worker cannot run it (no trainer key)
    _field("reentrant_ckpt", bool, False, "Gradient checkpointing as transformers 4 runs it: a reentrant checkpoint "
           "called around each decoder layer (its default). Under FSDP1 with LoRA/QLoRA each layer's input "
           "gradient is then kept to the end of backward (default: transformers 5's checkpoint inside the layer).",
           memo=(BATCH,), recipe=True,
           terms="FSDP1's retained layer-input gradients (planner/sharding/fsdp1.py retained_input_gradients, "
           "memory/step.py)", trainers=(("hf", None),) + _NO_TRAINER_KEY),
    # transformers 4's MoE experts: MixtralSparseMoeBlock held an nn.ModuleList of MixtralBlockSparseTop2MLP, each
    # with nn.Linear w1/w3/w2, and looped over them in Python (4.48.1 models/mixtral/modeling_mixtral.py l.67-150,
    # ``for expert_idx in range(self.num_experts)``); transformers 5 fuses them into 3D stacks run by grouped_mm
    # (planner/memory/moe.py). The installed transformers builds the fused stacks: emit and the worker cannot run it
    _field("experts_loop", bool, False, "MoE experts as transformers 4 built them (Mixtral): per-expert nn.Linear "
           "modules in an eager loop, 4-bit under QLoRA (default: transformers 5's fused stacks).",
           memo=(STATIC, BATCH), recipe=True,
           terms="the experts' weights, quantisation, adapters and saved tensors (memory/moe.py per_expert_layout, "
           "loop_expert_bytes)", trainers=(("hf", None),) + _NO_TRAINER_KEY),
    # transformers 4.36-4.39's loop: each expert's routed indices copied to the host and used as Python lists
    # (4.39.3 models/mixtral/modeling_mixtral.py l.866-877, "in torch it is faster to index using lists"); 4.40
    # indexes with the tensors. Host time on the step's path, no memory term (planner.moe_loop)
    _field("experts_list_index", bool, False, "With --experts-loop: the loop as transformers 4.36-4.39 ran it, "
           "indexing each expert's tokens with Python lists copied from the device (default: 4.40's tensor index).",
           memo=(FIXED,), recipe=True, trainers=(("hf", None),) + _NO_TRAINER_KEY),
    # transformers 4's rotary embeddings: each attention layer's own cos and sin tables of max_position_embeddings x
    # head_dim, built at init as buffers in the load dtype (4.39.3 models/mistral/modeling_mistral.py l.93-116, one
    # per attention l.232; Llama to 4.40, Mistral to 4.41, Qwen2 to 4.44, Mixtral to 4.47); transformers 5 makes cos
    # and sin per forward. The installed transformers builds none: emit and the worker cannot run it
    _field("rope_caches", bool, False, "Rotary tables as transformers 4 kept them: cos and sin of every position up "
           "to max_position_embeddings, a pair per attention layer, resident on the device (Llama to 4.40, Mistral "
           "to 4.41, Qwen2 to 4.44, Mixtral to 4.47; default: transformers 5's, made per forward).",
           memo=(STATIC,), recipe=True, terms="the rotary tables beside the weights (memory/buffers.py)",
           trainers=(("hf", None),) + _NO_TRAINER_KEY),
    # the transformers release the run uses, which sets the six knobs above as that version runs them
    # (planner/transformers_versions.py, the one home of the version table; planner.estimation.versioned applies
    # it once the model is resolved, before it is built as run): an option, not a TrainConfig field
    _field("transformers", str, None, "The transformers release the run uses, e.g. 4.39.3 (4.36 or newer): sets "
           "--loss-shift, --loss-returns-head, --reentrant-ckpt, --experts-loop, --experts-list-index and "
           "--rope-caches as that version runs the model (planner/transformers_versions.py); a knob given "
           "explicitly wins over the version's. Default: transformers 5's (none of them).",
           memo=(OPTION,), recipe=True, build=False, max_length=32),
    # torch.compile: a user's choice, as the attention is (never searched). The HF Trainer compiles the model under
    # TrainingArguments.torch_compile (transformers 5.24 trainer.py, ``model = torch.compile(model, ...)`` where
    # ``args.torch_compile``); axolotl passes its ``torch_compile`` to those arguments, LLaMA-Factory's
    # ``torch_compile`` is that argument itself (planner/data/trainers/llama_factory.json), torchtune's recipes
    # compile each layer and the loss under their config's top-level ``compile`` (training.compile_model,
    # compile_loss). The step is priced as Inductor's fused kernels (planner.kernels); no memory term reads it:
    # the plan keeps eager's saved tensors and says so (planner.throughput)
    _field("compile", bool, False, "torch.compile (Inductor, mode default): the norms, activations, rotary, residual "
           "adds, casts and the loss' pointwise work between GEMMs run as fused kernels; priced as such, memory as "
           "eager's saved tensors (a bound). Default: eager PyTorch.", memo=(FIXED,), recipe=True,
           training_args="torch_compile", switch=True,
           trainers=(("axolotl", "torch_compile"), ("llama-factory", "torch_compile"), ("torchtune", "compile"))),
    # QLoRA's k-bit preparation: peft's prepare_model_for_kbit_training (the HF/TRL path, emit's
    # train.py and the worker) upcasts every non-4-bit parameter to fp32 (peft 0.21 utils/other.py:204-209);
    # fms-acceleration's accelerated-peft-bnb, torchtune's QLoRA recipes, LLaMA-Factory
    # (model/model_utils/checkpointing.py prepare_model_for_training: fp32 norms only under
    # upcast_layernorm) and axolotl (which casts the norms, embeddings and head back to torch_dtype
    # after it: src/axolotl/loaders/model.py _configure_embedding_dtypes) keep them in the 16-bit
    # compute dtype. No trainer spells it by a key: planner check's readers set it as each trainer
    # runs (planner/check/axolotl.py, llama_factory.py, torchtune.py).
    _field("kbit_upcast", bool, True, "QLoRA: peft's prepare_model_for_kbit_training upcasts every non-4-bit parameter "
           "(norms, embeddings, head) to fp32, and with them the residual stream (default); --no-kbit-upcast: they "
           "stay in the 16-bit compute dtype (fms-acceleration's accelerated-peft-bnb, torchtune's, LLaMA-Factory's and "
           "axolotl's QLoRA).", memo=(STATIC, DERIVED), recipe=True, qlora_only=True,
           terms="the unquantised weights' and the residual stream's dtype (memory/dtypes.py dtype_mode)"),
    # the evaluation pass during training (planner.memory.evaluation): the HF Trainer's
    # evaluation_loop after an optimizer step, with generation where asked
    _field("eval_batch", int, None, "Evaluate during training with this many sequences per eval forward (the HF "
           "Trainer's per_device_eval_batch_size; default: no evaluation). The plan's peak is the larger of the "
           "training step and the eval pass.", memo=(BATCH,), recipe=True, upper=1 << 20, evaluation=True,
           terms="the eval pass (memory/evaluation.py, the eval moments of memory/step.py)",
           training_args="per_device_eval_batch_size"),
    _field("eval_seq_len", int, None, "Tokens per eval sequence, the prompt's under --generate-tokens (default: "
           "--seq-len).", memo=(BATCH,), recipe=True, upper=1 << 24, evaluation=True,
           terms="the eval pass's logits and KV cache (memory/evaluation.py)"),
    _field("generate_tokens", int, 0, "Tokens each eval sequence generates with the KV cache on (model.generate("
           "max_new_tokens=N): predict_with_generate, a generating eval callback); needs --eval-batch.",
           memo=(BATCH,), recipe=True, upper=1 << 20, evaluation=True,
           terms="the eval pass's KV cache at prompt + N tokens (memory/evaluation.py)"),
    # RoPE context extension: transformers' rope_parameters (rope_scaling before v5) rescale the rotary
    # frequencies, which lifts the model's context limit (planner.config.context_limit). No memory term reads
    # it: the scaling changes the values of the per-forward cos/sin tables only, not their shapes or count
    # (transformers 5.24 modeling_rope_utils.py l.134-191, l.270-343, l.346-484, l.581-664: an inv_freq vector
    # of head_dim / 2; models/llama/modeling_llama.py l.109-116: cos/sin computed per forward, times YaRN's
    # attention_scaling, a Python float that is 1.0 otherwise). Emit's train.py sets it on the model's config;
    # planner check reads axolotl's model_config.rope_scaling and LLaMA-Factory's rope_scaling (planner/check).
    _field("rope_scaling", str, None, "RoPE context extension as FACTOR or TYPE:FACTOR (linear, dynamic, yarn, llama3; "
           "default linear), e.g. 4 or yarn:4: the longest --seq-len becomes the model's max_position_embeddings x "
           "FACTOR (RoPE models only). It rescales the rotary frequencies alone: no memory or time.",
           memo=(FIXED,), recipe=True, max_length=32, trainers=(("torchtune", None),)),
    # TrainConfig's own (its memory terms read it as Sharding.memory_key): named here, or made from
    # --zero and --offload, the older spelling (planner.estimation.build_config refuses both at once)
    _field("sharding", str, None, "{names}: the sharding scheme, with --offload its CPU offload (default: what --zero "
           "names).", memo=(DERIVED,), max_length=32, names_of="sharding"),
)

#: The default of a field a request must give.
REQUIRED: Any = ...

#: What a search is asked besides the recipe (``planner suggest``/``submit``, ``POST /v1/plans``),
#: in ``planner suggest``'s order: its method and precision may be "auto" (every method; the
#: device's precisions).
SEARCH: Mapping[str, RequestField] = {f.name: f for f in (
    _field("target_batch", int, REQUIRED, "Global batch: micro x accumulation x GPUs.", memo=(OPTION,), short="-b"),
    _field("method", str, "auto", "auto|full|lora|qlora", memo=(OPTION,), max_length=32),
    _field("precision", str, "auto", "auto|fp32|fp16-mixed|bf16-mixed|fp16|bf16|fp8", memo=(OPTION,), max_length=32),
    _field("top_k", int, 5, "Plans to show (and the pool verification falls back on).", memo=(OPTION,), short="-k"),
    _field("prefer", str, "fidelity", "Ranking policy: fidelity (full > LoRA > QLoRA > pure-16-bit full, then speed) | "
           "speed (fastest first). The other policy's first plan is shown under the table.", memo=(OPTION,),
           max_length=32),
)}

FIELDS: Mapping[str, RequestField] = {f.name: f for f in _FIELDS}
"""Every field by name, in ``planner estimate``'s order."""

RECIPE: tuple[RequestField, ...] = tuple(f for f in _FIELDS if f.recipe)
"""The recipe settings: the knobs a search keeps fixed (``SuggestRequest``, ``SearchSpace``,
``POST /v1/plans`` and ``planner suggest``/``submit`` take them)."""

ESTIMATE: tuple[RequestField, ...] = tuple(f for f in _FIELDS if f.estimate)
"""``planner estimate``'s and ``measure``'s options after the model and device, in their order."""

CONFIG_OPTIONS: tuple[str, ...] = tuple(f.name for f in _FIELDS if f.build)
"""The options ``planner.estimation.build_config`` takes (``TrainConfig``'s fields, the sharding as
``zero`` and ``offload``)."""

#: The fields the memo keys end with, in this order: the search groups its knobs by the key less
#: them (``_Knobs.static_prefix``/``batch_prefix``), one group per adapter variant and checkpointing.
MEMO_TAIL = ("lora_r", "lora_targets", "grad_ckpt")


def trainer_keys(trainer: str) -> list[tuple[RequestField, str]]:
    """The fields ``trainer``'s own config spells, with its key for each (``RequestField.trainers``)."""
    return [(f, key) for f in _FIELDS for name, key in f.trainers if name == trainer and key is not None]


def trainer_values(values: Any, trainer: str, *, adapters: bool) -> dict[str, Any]:
    """{key: value} of the fields ``trainer``'s config spells, from a config or any object with the
    fields as attributes (the adapters' fields only where the plan trains adapters, full fine-tuning's
    only where it does not)."""
    return {key: getattr(values, f.name) for f, key in trainer_keys(trainer)
            if not (f.full_only if adapters else f.adapters_only)}


def unexpressible(values: Any, trainer: str) -> list[str]:
    """The fields set away from their default that ``trainer``'s config has no key for."""
    return [f.name for f in _FIELDS for name, key in f.trainers
            if name == trainer and key is None and getattr(values, f.name) != f.default]


def memo_fields(key: str) -> tuple[str, ...]:
    """The fields ``key`` (``STATIC`` or ``BATCH``) holds as they are, those of ``MEMO_TAIL`` last."""
    held = [f.name for f in _FIELDS if key in f.memo]
    return tuple([n for n in held if n not in MEMO_TAIL] + [n for n in MEMO_TAIL if n in held])


#: The fields only LoRA/QLoRA take (the adapter's), in the order ``planner check`` lists them.
ADAPTER: tuple[str, ...] = tuple(f.name for f in _FIELDS if f.adapters_only)

ADAPTER_RECIPE: tuple[RequestField, ...] = tuple(f for f in RECIPE if f.adapters_only)
"""The recipe settings of the adapter (``peft``/``trl`` keys): the search keeps them, so they
change only with the method (full fine-tuning takes their defaults)."""

TRAINING_ARGS: tuple[RequestField, ...] = tuple(f for f in _FIELDS if f.training_args)
"""The fields ``transformers.TrainingArguments`` holds, by their ``training_args`` key."""


def recipe_of(source: Any) -> dict[str, Any]:
    """The recipe settings of a request, a body, a space or a configuration (read by name), as
    plain values (an enum member as its value); an option among them that makes settings (``transformers``)
    is left out, read by name where the request is resolved (``planner.estimation.versioned``)."""
    out = {}
    for f in RECIPE:
        if OPTION in f.memo:  # an option that makes settings (``transformers``), not a setting: read by name
            continue
        value = getattr(source, f.name)
        out[f.name] = value.value if isinstance(value, enum.Enum) else value
    return out


def own_loss(values: Mapping[str, Any]) -> bool:
    """The recipe computes a loss of its own, a fused (Liger's) or chunked (torchtune's) cross-entropy, not the
    model's: a transformers version's loss (``loss_shift``, ``loss_returns_head``) is not run with it."""
    return bool(values.get("fused_ce")) or (values.get("loss_chunks") or 1) > 1


def recipe_words(values: Mapping[str, Any], *, encoder: bool = False) -> str:
    """The recipe settings of ``values`` (a configuration's ``to_dict``) that differ from the HF
    Trainer's defaults, in words; a setting the step ignores says so (use_cache under
    checkpointing, or in an encoder, which has no KV cache: memory/activations.py
    ``kv_cache_block_bytes``)."""
    parts = []
    if values.get("lora_dropout"):
        parts.append(f"lora_dropout {values['lora_dropout']:g}")
    if values.get("loop", "trainer") != "trainer":
        parts.append(f"{values['loop']} loop (outputs kept through backward: loop/manual_outputs)")
    if values.get("fused_ce"):
        parts.append("fused linear cross-entropy")
    if values.get("packing") is False:
        parts.append("padded to the longest")
    if values.get("use_cache"):
        parts.append("use_cache" + (" (ignored: an encoder has no KV cache)" if encoder
                                    else " (off under checkpointing)" if values.get("grad_ckpt") else ""))
    if values.get("optimizer_in_bwd"):
        parts.append("optimizer stepped in backward")
    if values.get("kbit_upcast") is False:
        parts.append("16-bit non-4-bit parameters (no k-bit upcast)")
    if values.get("loss_chunks", 1) > 1:
        parts.append(f"loss over {values['loss_chunks']} chunks")
    if values.get("loss_upcast") is False:
        parts.append("16-bit loss (no fp32 upcast of the logits)")
    if values.get("loss_shift"):
        parts.append("transformers 4's loss on a shifted copy of the logits"
                     + (" (the head's 16-bit logits returned, 4.46-4.48)" if values.get("loss_returns_head") else ""))
    if values.get("reentrant_ckpt"):
        parts.append("transformers 4's reentrant checkpoint around each layer")
    if values.get("experts_loop"):
        parts.append("transformers 4's per-expert MoE modules"
                     + (" indexed with Python lists (4.36-4.39)" if values.get("experts_list_index") else ""))
    if values.get("rope_caches"):
        parts.append("transformers 4's rotary tables per layer")
    if values.get("compile"):
        parts.append("torch.compile")
    if values.get("rope_scaling"):
        parts.append(f"RoPE scaling {values['rope_scaling']}")
    if values.get("eval_batch"):
        tokens = values.get("eval_seq_len") or values.get("seq_len")
        parts.append(f"eval batch {values['eval_batch']}" + (f" x {tokens} tokens" if tokens else "")
                     + (f", generating {values['generate_tokens']}" if values.get("generate_tokens") else ""))
    return ", ".join(parts)


def recipe_for(values: Mapping[str, Any], *, adapters: bool, qlora: bool) -> dict[str, Any]:
    """``values`` as a candidate takes them: those of LoRA/QLoRA only at their defaults without adapters,
    those of QLoRA (its k-bit preparation: ``kbit_upcast``) only at their defaults with another method,
    so a search for every method plans QLoRA with the fixed setting and LoRA and full fine-tuning as
    they are. A setting of full fine-tuning alone is refused: the search (its one reader) gives every
    method the same recipe and splits the batch with accumulation, which torchtune's
    ``optimizer_in_bwd`` forbids, so it is planned by estimate and check, not searched."""
    from planner.errors import UnsupportedError

    held = [f.flag.split("/")[0] for name, f in FIELDS.items() if f.full_only and values.get(name, f.default) != f.default]
    if held:
        raise UnsupportedError(f"the search does not take {', '.join(held)} (it varies the method and the gradient "
                               "accumulation, which that setting fixes at full fine-tuning without accumulation): "
                               "planner estimate --method full --grad-accum 1 and planner check plan it")
    def dropped(f: RequestField) -> bool:
        return (f.adapters_only and not adapters) or (f.qlora_only and not qlora)

    return {name: FIELDS[name].default if dropped(FIELDS[name]) else value for name, value in values.items()}


def changed(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of ``values`` that differ from their defaults."""
    return {name: value for name, value in values.items() if value != FIELDS[name].default}


def check_for_model(*, model_id: str, is_encoder: bool, values: Mapping[str, Any],
                    is_encoder_decoder: bool = False, max_seq_len: int | None = None,
                    seq_len: int | None = None) -> None:
    """The recipe settings a model cannot take: a fused linear cross-entropy fuses a causal LM's
    head and its loss, which a masked-LM encoder does not have; a 16-bit loss is a causal LM's
    cross-entropy written without ForCausalLMLoss' upcast (emit's train.py), which a masked LM's
    or an encoder-decoder's own loss is not; an eval sequence (its prompt, ``seq_len`` by default,
    and the tokens it generates) longer than the model's ``max_seq_len``, as a training one is."""
    from planner.errors import InvalidConfigError

    prompt = values.get("eval_seq_len") or seq_len
    if values.get("eval_batch") and max_seq_len is not None and prompt is not None:
        generated = values.get("generate_tokens") or 0
        if prompt + generated > max_seq_len:
            said = (f"--eval-seq-len {prompt}" if values.get("eval_seq_len") else f"the eval prompt (--seq-len {prompt})")
            total = f"{said} + --generate-tokens {generated} = {prompt + generated:,} tokens" if generated else said
            raise InvalidConfigError(f"{total} is longer than {model_id} allows ({max_seq_len}): keep the eval "
                                     f"sequence within {max_seq_len} tokens (a shorter --eval-seq-len or fewer "
                                     "--generate-tokens)")

    if values.get("fused_ce") and is_encoder:
        raise InvalidConfigError(f"--fused-ce fuses a causal LM's head and loss; {model_id} is a masked-LM encoder: "
                                 "drop --fused-ce")
    if values.get("loss_upcast") is False and (is_encoder or is_encoder_decoder):
        raise InvalidConfigError(f"--no-loss-upcast is a causal LM's cross-entropy on its 16-bit logits; {model_id} "
                                 f"is {'a masked-LM encoder' if is_encoder else 'an encoder-decoder'}: drop it")
    if values.get("loss_shift") and (is_encoder or is_encoder_decoder):
        raise InvalidConfigError(f"--loss-shift is a causal LM's loss on its shifted logits; {model_id} is "
                                 f"{'a masked-LM encoder' if is_encoder else 'an encoder-decoder'} (its labels are not "
                                 "shifted): drop it")
    if values.get("reentrant_ckpt") and is_encoder_decoder:
        raise InvalidConfigError(f"--reentrant-ckpt is not modelled for an encoder-decoder ({model_id}: FSDP1's retained "
                                 "gradients are counted over one stack of layers): drop it")
    if values.get("generate_tokens") and is_encoder:
        raise InvalidConfigError(f"--generate-tokens generates with a causal LM; {model_id} is a masked-LM encoder: "
                                 "drop --generate-tokens")


_KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}


def check_types(values: Mapping[str, Any], fields: Mapping[str, RequestField]) -> None:
    """Each of ``values`` of the type its field declares, as the command line's parser and the
    HTTP API's schema hold them (the Python API's keywords are not typed by anything else: a list
    for ``method`` reached a set lookup, ``grad_ckpt=None`` a kernel count, as TypeErrors). None
    only where the field's default is None; an int for a float; ``lora_targets`` also a list of names."""
    from planner.errors import InvalidConfigError

    for name, value in values.items():
        field = fields.get(name)
        if field is None or (value is None and field.default is None):
            continue
        kind = field.type
        if kind is str and name == "lora_targets" and isinstance(value, (list, tuple)):
            ok = all(isinstance(v, str) for v in value)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            option = (field.flag or f"--{name}").split("/")[0]
            raise InvalidConfigError(f"{option} must be {_KINDS[kind]}, got {value!r}")


def with_recipe_fields(cls: type) -> type:
    """``cls`` with a field per recipe setting (its plain type and default, its help as docstring),
    after its own: apply it under ``@dataclass``."""
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    for f in RECIPE:
        annotations[f.name] = f.type.__name__
        setattr(cls, f.name, f.default)
    cls.__annotations__ = annotations
    return cls


__all__ = ["trainer_keys", "trainer_values", "unexpressible", "ADAPTER", "ADAPTER_RECIPE", "BATCH", "CONFIG_OPTIONS", "REQUIRED", "SEARCH", "DERIVED", "ESTIMATE", "FIELDS", "FIXED", "MEMO_TAIL", "OPTION", "RECIPE",
           "RequestField", "SPLIT", "STATIC", "TRAINING_ARGS", "changed", "check_for_model", "check_types", "memo_fields", "own_loss", "recipe_for", "recipe_of", "recipe_words",
           "with_recipe_fields"]
