"""One short real training run in the current process, measured by a memory probe.

MEASUREMENT CONVENTION (``planner.memory.estimate_memory`` predicts exactly this):

* The probe is started BEFORE the model is built, so weights, DeepSpeed's flat buffers and the
  optimizer states created later are all counted (CPU: the bytes c10's CPU allocator holds,
  from ``torch.profiler``'s memory events, with the live tensor-storage bytes seen through the
  dispatcher beside them by category; CUDA: the caching allocator's ``max_memory_allocated``).
  details["memory_events"] is the measured step's curve, ``[seconds since the step started,
  bytes allocated]`` (CPU: c10's allocation events; CUDA: the caching allocator's trace), and
  details["memory_phases"] the ``[seconds, phase]`` of each phase change in it.
* The run does ``steps`` optimizer steps (default 3, at least 2 so that optimizer states exist
  during the measured step). Each step is ``grad_accum`` micro-steps of forward -> loss /
  grad_accum -> backward, then ``optimizer.step()`` (through the GradScaler for fp16-mixed),
  then ``optimizer.zero_grad(set_to_none=True)`` (HF Trainer's behaviour). With ZeRO the
  engine's own ``engine.backward(loss)`` / ``engine.step()`` do the scaling, stepping and
  zeroing.
* The reported peak is the maximum of live bytes during the LAST optimizer step only: the peak
  is reset to the bytes live right before its first forward (steady state, optimizer states
  present).
* The step time is that of the last step on CUDA. On the CPU one more step runs after the probe
  is stopped, and is the one timed: the probe's per-op Python would otherwise dominate it.
* Inputs: random token ids ``input_ids`` [micro_batch, seq_len] (int64), ``labels =
  input_ids`` (causal LMs shift them; for masked-LM encoders every position is a label), no
  attention mask (no padding; sdpa takes its causal path), ``model.train()`` (dropout as the
  config says), the model-config settings the HF Trainer applies (the KV cache:
  ``planner.emit.settings.model_config_settings``).
* Step time is the wall time of the last optimizer step; tokens/s = micro_batch x seq_len x
  grad_accum / step time (one device).

Precision: ``*-mixed`` runs an fp32 model under ``torch.autocast`` (plus a GradScaler for fp16);
pure fp16/bf16 casts the model and the optimizer works on those parameters. QLoRA saves the
random model with ``save_pretrained`` and reloads it with a 4-bit NF4 ``BitsAndBytesConfig``
(the real loading path), then ``prepare_model_for_kbit_training`` (which upcasts the
non-quantized parameters to fp32: real behaviour) unless the plan keeps them 16-bit
(``kbit_upcast`` False, as fms-acceleration, torchtune and LLaMA-Factory do), and LoRA. A
16-bit loss (``loss_upcast`` False) is computed on the logits as the head makes them, as emit's
train.py does (``_install_loss_in_logits_dtype``); transformers <= 4.45's loss (``loss_shift``) on a
shifted copy of the logits inside the model's forward, as those versions ran it
(``_install_shifted_copy_loss``); 4.46-4.48's (``loss_returns_head``) as the model's own
``loss_function``, as emit's train.py sets it (``_install_loss_returning_head``).
"""

from __future__ import annotations

import contextlib
import gc
import platform
import socket
import tempfile
import time
from datetime import datetime, timezone
from typing import Any, Mapping

from planner.config import Loop, Method, Precision, TrainConfig
from planner.emit.causal_lm_loss import calls_loss_function, causal_lm_loss_448
from planner.emit.deepspeed import ADAM_BETAS, ADAM_EPS, LEARNING_RATE, WEIGHT_DECAY
from planner.emit.settings import (
    adapter_settings,
    bnb_config,
    model_config_settings,
    rope_parameters,
    scale_rope,
    sets_loss_function_448,
    training_arguments,
)
from planner.errors import InvalidConfigError
from planner.optim import OPTIMIZERS
from planner.results import Measurement, RunOutcome
from workers import seq2seq

#: transformers model types trained as masked LM (bidirectional encoders)
ENCODER_MODEL_TYPES = frozenset(
    {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "camembert", "deberta", "deberta-v2"}
)

#: phrases torch and the allocators use for a refused allocation (c10 CPUAllocator.cpp:
#: "DefaultCPUAllocator: can't allocate memory"; CUDACachingAllocator: "CUDA out of memory")
_OOM_PHRASES = ("out of memory", "can't allocate memory", "cannot allocate memory")


def run_in_process(
    *,
    model_config: Mapping[str, Any],
    config: TrainConfig,
    device: str = "cpu",
    steps: int = 3,
    memory_limit_bytes: int | None = None,
    checkpoint_dir: str | None = None,
    seed: int = 0,
    trace: bool = False,
) -> tuple[Measurement, dict[str, Any]]:
    """Train ``config`` for ``steps`` optimizer steps here and measure it.

    Returns the ``Measurement`` and a details dict (peak breakdown by category, peak phase,
    parameter counts, ...). A refused allocation is outcome ``oom``, any other failure of the
    run outcome ``error``; both carry the error text. Bad arguments raise ``InvalidConfigError``.
    ``trace`` (CPU): details["peak_storages"] lists what was live at the peak, by the op and the
    library line that made it (``CpuProbe.peak_storages``; slow, for finding a missing term).
    """
    _check_args(model_config=model_config, device=device, steps=steps, memory_limit_bytes=memory_limit_bytes)
    if config.precision is Precision.FP8:
        # the run below would be bf16 autocast without torchao's float8 linears: not what the plan counts
        raise InvalidConfigError("the worker does not run fp8 (torchao's float8 linears): verify or measure bf16-mixed")
    _check_compiler(config, device)
    started = _now()
    details: dict[str, Any] = {}
    from workers.probes import make_probe

    probe = make_probe(device=device, limit_bytes=memory_limit_bytes, trace=trace)
    outcome, error, step_s = RunOutcome.OK, None, None
    device_name = "cpu"
    try:
        device_name = _device_name(device)
        step_s = _train(
            model_config=dict(model_config), config=config, device=device, steps=steps,
            checkpoint_dir=checkpoint_dir, seed=seed, probe=probe, details=details,
        )
    except BaseException as exc:  # noqa: BLE001 - every failure of the run is reported, not raised
        if isinstance(exc, KeyboardInterrupt):
            raise
        outcome = RunOutcome.OOM if _is_oom(exc) else RunOutcome.ERROR
        error = f"{type(exc).__name__}: {exc}".strip()
    finally:
        probe.stop()
        _reset_deepspeed_linear()
        gc.collect()
    details.update(_probe_details(probe, trace=trace))
    ok = outcome is RunOutcome.OK
    tokens = config.micro_batch * config.seq_len * config.grad_accum
    measurement = Measurement(
        outcome=outcome,
        device=device_name,
        peak_allocated_bytes=probe.peak_allocated_bytes if ok else None,
        peak_reserved_bytes=probe.peak_reserved_bytes if ok else None,
        process_total_bytes=probe.process_total_bytes if ok else None,
        step_s=step_s if ok else None,
        tokens_per_s=tokens / step_s if ok and step_s else None,
        library_versions=library_versions(deepspeed=_uses_deepspeed(config)),
        node=socket.gethostname(),
        started_at=started,
        finished_at=_now(),
        error=error,
    )
    return measurement, details


def _reset_deepspeed_linear() -> None:
    """Give this process back the stock ``torch.nn.functional.linear``. DeepSpeed's ZeRO-3 swaps in
    its memory-efficient linear for the rest of the process ("This will persist unless manually
    reset": deepspeed/runtime/zero/partition_parameters.py ``_enable_mem_efficient_linear``, which
    keeps the original as ``InsertPostInitMethodToModuleSubClasses.linear_bk``), so a later run in
    the same process (the tests' and benches' in-process runs) trained through it and saved fewer
    tensors than its configuration does. A run in a fresh process (measure, Ray) never sees it."""
    import sys

    zero_init = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(zero_init, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None:
        import torch

        torch.nn.functional.linear = original


def _probe_details(probe, *, trace: bool) -> dict[str, Any]:
    """What the probe knows beyond the peak: the measured curve and, on the CPU, the dispatch
    count beside the allocator's with what each attributes the bytes to."""
    out: dict[str, Any] = {"peak_phase": probe.peak_phase}
    if probe.memory_events is not None:
        out["memory_events"] = probe.memory_events
        out["memory_phases"] = probe.memory_phases
    if hasattr(probe, "peak_dispatch_bytes"):
        out |= {
            "peak_reference": probe.reference,
            # the dispatch count: its peak, and what each category held at that peak
            "peak_dispatch_bytes": probe.peak_dispatch_bytes,
            "peak_dispatch_phase": probe.peak_dispatch_phase,
            "run_peak_bytes": probe.run_peak_bytes,
            "peak_breakdown": dict(probe.peak_breakdown),
            # the allocator's attribution: what the step had allocated at its peak, by the ops
            # that made it, and what it left out at the step's start (top groups)
            "peak_allocations": probe.peak_allocations()[:16],
            "untracked_at_step_start": probe.untracked_at_step_start()[:16],
            "allocator_drift_bytes": probe.allocator_drift_bytes,
        }
    if trace:
        out["peak_storages"] = probe.peak_storages()
    return out


def _check_args(*, model_config: Mapping[str, Any], device: str, steps: int, memory_limit_bytes: int | None) -> None:
    if not isinstance(model_config, Mapping) or not model_config.get("model_type"):
        raise InvalidConfigError("model_config must be a config.json dict with a model_type")
    if device != "cpu" and not device.startswith("cuda"):
        raise InvalidConfigError(f"device must be cpu or cuda[:N], got {device!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise InvalidConfigError(
            f"steps must be >= 2 so that optimizer states exist in the measured step, got {steps!r}"
        )
    if memory_limit_bytes is not None and memory_limit_bytes <= 0:
        raise InvalidConfigError(f"memory limit must be > 0 bytes, got {memory_limit_bytes}")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(p in str(exc).lower() for p in _OOM_PHRASES)


def _device_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def library_versions(*, deepspeed: bool) -> dict[str, str]:
    """Versions from package metadata (no import needed)."""
    from importlib import metadata

    names = ["torch", "transformers", "peft", "accelerate", "bitsandbytes"] + (["deepspeed"] if deepspeed else [])
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


# ---- building ------------------------------------------------------------------------------
def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _is_encoder(model_config: Mapping[str, Any]) -> bool:
    return str(model_config["model_type"]) in ENCODER_MODEL_TYPES


def _build_model(*, model_config: dict[str, Any], config: TrainConfig, checkpoint_dir: str | None):
    """The transformers model in the dtype the precision stores weights in (random or local)."""
    import torch
    from transformers import AutoConfig

    auto = seq2seq.auto_class(model_config, encoder=_is_encoder(model_config))
    pure16 = config.precision in (Precision.FP16, Precision.BF16)
    dtype = _torch_dtype(config.precision.compute_dtype) if pure16 else torch.float32
    attn = config.attention.hf_name
    if checkpoint_dir is not None:
        return auto.from_pretrained(checkpoint_dir, local_files_only=True, dtype=dtype, attn_implementation=attn,
                                    **_scaled_config(checkpoint_dir, config))
    cfg = {k: v for k, v in model_config.items() if not k.startswith("_") and k not in ("model_type", "torch_dtype", "dtype")}
    hf_config = AutoConfig.for_model(str(model_config["model_type"]), **seq2seq.config_kwargs(model_config, cfg))
    if (rope := rope_parameters(config)) is not None:
        scale_rope(hf_config, rope)
    return auto.from_config(hf_config, attn_implementation=attn, dtype=dtype)


def _scaled_config(checkpoint_dir: str, config: TrainConfig) -> dict[str, Any]:
    """``from_pretrained``'s ``config`` keyword for a local checkpoint under ``--rope-scaling``: its config with
    the scaling merged before the model is built, as emit's train.py loads it (``scale_rope``); {} without."""
    rope = rope_parameters(config)
    if rope is None:
        return {}
    from transformers import AutoConfig

    return {"config": scale_rope(AutoConfig.from_pretrained(checkpoint_dir, local_files_only=True), rope)}


def _build_qlora_base(*, model_config: dict[str, Any], config: TrainConfig, checkpoint_dir: str | None, tmp: str):
    """Reload the (random or local) weights through bitsandbytes' 4-bit NF4 loading path."""
    from transformers import BitsAndBytesConfig

    compute = _torch_dtype(config.precision.compute_dtype)
    scaled: dict[str, Any] = {}
    if checkpoint_dir is not None:
        scaled = _scaled_config(checkpoint_dir, config)
    else:  # the random model is built scaled and its config saved so: reloaded as it is
        random_model = _build_model(
            model_config=model_config, config=config.replace(precision=Precision.FP32), checkpoint_dir=None
        )
        # each rank writes the copy it reads: once a process group is up, save_pretrained writes on
        # rank 0 only (transformers 5 distributed/mixin.py should_save_on_this_rank)
        from safetensors.torch import save_model

        random_model.config.save_pretrained(tmp)
        save_model(random_model, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        del random_model
        gc.collect()
        checkpoint_dir = tmp
    auto = seq2seq.auto_class(model_config, encoder=_is_encoder(model_config))
    # the config emit writes (bnb_config.json): NF4, double quantisation, the compute dtype, and under
    # FSDP the 4-bit weights stored in the load dtype (bnb_4bit_quant_storage)
    quant = BitsAndBytesConfig(**bnb_config(config))
    return auto.from_pretrained(
        checkpoint_dir, local_files_only=True, quantization_config=quant, dtype=compute,
        attn_implementation=config.attention.hf_name, **scaled,
    )


def _apply_training_setup(model, *, model_config: Mapping[str, Any], config: TrainConfig):
    """Checkpointing, k-bit preparation and LoRA adapters, in the order HF recipes apply them."""
    ckpt_kwargs = {"use_reentrant": False}
    if config.method is Method.QLORA and config.kbit_upcast:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=config.grad_ckpt, gradient_checkpointing_kwargs=ckpt_kwargs
        )
    elif config.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
    if config.method.uses_adapters:
        from peft import LoraConfig, get_peft_model

        # the adapter emit writes (lora_config.json), with the task type of the model's config
        lora = LoraConfig(**adapter_settings(config),
                          task_type=seq2seq.peft_task_type(model_config, encoder=_is_encoder(model_config)))
        model = get_peft_model(model, lora)
    return model


def _uses_deepspeed(config: TrainConfig) -> bool:
    """The run needs deepspeed (the sharding scheme's library, ``planner.sharding``)."""
    return config.sharding.spec.library == "deepspeed"


def _build_optimizer(config: TrainConfig, params: list):
    """The optimizer as its descriptor builds it (``planner.optim``)."""
    return OPTIMIZERS[config.optimizer].build(params, lr=LEARNING_RATE)


# ---- the run -------------------------------------------------------------------------------
def _train(
    *, model_config: dict[str, Any], config: TrainConfig, device: str, steps: int,
    checkpoint_dir: str | None, seed: int, probe, details: dict[str, Any],
) -> float:
    """Build and train; returns the wall time of the last optimizer step."""
    import torch

    scheme = config.sharding.spec  # how the model states are spread over the ranks (planner.sharding)
    torch.manual_seed(seed)
    scheme.worker_init(device)  # its library's environment and process group, outside the probe
    tracks = hasattr(probe, "track")  # the CPU probe can attribute bytes to categories
    probe.start()
    model, forward_settings = _prepared_model(
        model_config=model_config, config=config, device=device, checkpoint_dir=checkpoint_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    _record_parameters(details, model=model, params=params)
    if tracks:
        probe.track(model.parameters(), category="parameters")
        probe.track(model.buffers())

    setup = scheme.worker_setup(
        model, params, config, device=device, build_optimizer=lambda ps: _build_optimizer(config, ps),
        hidden_size=model.config.hidden_size,
        hyperparameters={"lr": LEARNING_RATE, "betas": ADAM_BETAS, "eps": ADAM_EPS, "weight_decay": WEIGHT_DECAY})
    engine, optimizer, use_ds = setup.engine, setup.optimizer, setup.engine_steps
    if not use_ds:
        # the scheme may have replaced the parameters (FSDP2's DTensor shards): the old ones must
        # not stay alive through this list
        params = [p for p in engine.parameters() if p.requires_grad]
    details.update(setup.details)
    scaler = None
    autocast_dtype = _torch_dtype(config.precision.compute_dtype) if setup.autocast else None
    if not use_ds:
        if config.precision is Precision.FP16_MIXED:
            scaler = torch.amp.GradScaler(device.split(":")[0])
        if tracks:
            for p in params:
                p.register_post_accumulate_grad_hook(lambda p: probe.track([p.grad], category="gradients"))

    device_type = device.split(":")[0]
    dev = torch.device(device)
    vocab = int(model_config.get("vocab_size") or model.config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    batches = [_batch(config, vocab=vocab, gen=gen, device=dev) for _ in range(config.grad_accum)]

    def set_phase(name: str) -> None:
        probe.phase = name

    one_step = _step_function(
        engine=engine, optimizer=optimizer, config=config, batches=batches, use_ds=use_ds, scaler=scaler,
        autocast=(device_type, autocast_dtype), forward_settings=forward_settings, set_phase=set_phase)
    for _ in range(steps - 1):
        one_step()
    if tracks:
        _tag_states(probe, model=model, optimizer=optimizer, use_ds=use_ds)
    if device_type == "cuda":
        torch.cuda.synchronize(dev)
    set_phase("forward")
    probe.reset_peak()
    t0 = time.perf_counter()
    one_step()
    if device_type == "cuda":
        torch.cuda.synchronize(dev)
    step_s = time.perf_counter() - t0
    if config.evaluates:
        # the HF Trainer evaluates after an optimizer step (_maybe_log_save_evaluate): the
        # measured peak is the run's, the larger of the step and the eval pass
        _evaluate(engine, model, config, vocab=vocab, gen=gen, device=dev, autocast_dtype=autocast_dtype,
                  set_phase=set_phase)
    details["live_bytes_after"] = getattr(probe, "live_bytes", None)
    if tracks:
        # The CPU probe's dispatch mode runs Python on every op (tens of microseconds each),
        # which makes a small model's step many times slower: its step time comes from one more
        # step with the probe stopped (the CUDA probe costs nothing; its step is timed as is).
        details["probed_step_s"] = step_s
        probe.stop()
        if config.compile:
            _compile_after_probe(one_step, details)
        t0 = time.perf_counter()
        one_step()
        step_s = time.perf_counter() - t0
    if scaler is not None:
        details["grad_scaler_scale"] = float(scaler.get_scale())
    return step_s


def _prepared_model(*, model_config: dict[str, Any], config: TrainConfig, device: str, checkpoint_dir: str | None):
    """The model as the emitted training script has it at its first step, and the settings its forward takes."""
    with tempfile.TemporaryDirectory(prefix="workers-qlora-") as tmp:
        if config.method is Method.QLORA:
            model = _build_qlora_base(model_config=model_config, config=config, checkpoint_dir=checkpoint_dir, tmp=tmp)
        else:
            model = _build_model(model_config=model_config, config=config, checkpoint_dir=checkpoint_dir)
    if device != "cpu" and config.method is not Method.QLORA:
        model = model.to(device)
    model = _apply_training_setup(model, model_config=model_config, config=config)
    if config.method is Method.QLORA and device != "cpu":
        model = model.to(device)
    # the emitted TrainingArguments as the HF Trainer applies them to the model before its first
    # step: the settings it copies onto model.config (the KV cache; checkpointing turns it off
    # inside transformers), and Liger's kernels (transformers integrations/liger.py), of which
    # liger_kernel_config leaves the fused linear cross-entropy alone on
    for key, value in model_config_settings(config).items():
        setattr(model.config, key, value)
    # an encoder-decoder's decoder keeps its own copy of the config (T5ForConditionalGeneration's
    # __init__ deep-copies it, KV cache on), and T5Stack.forward reads the KV cache setting
    # from that copy (merge_with_config_defaults): under the Trainer it builds an
    # EncoderDecoderCache in training whatever model.config says (+196,608 B, +1.0 %, on a 2-layer
    # T5 at bf16-mixed). The memory model has no term for it yet and its estimate says so
    # (planner.memory.estimate); the run passes the setting to the forward, as the worker always
    # did, so that it measures what the model plans
    forward_settings = model_config_settings(config) if seq2seq.is_seq2seq(model_config) else {}
    if training_arguments(config, on_cpu=device == "cpu").get("use_liger_kernel"):
        _install_fused_ce(model, model_config=model_config)
    if sets_loss_function_448(config):
        _install_loss_returning_head(model, model_config=model_config)
    elif config.loss_shift:
        _install_shifted_copy_loss(model, model_config=model_config, upcast=config.loss_upcast)
    elif not config.loss_upcast:
        _install_loss_in_logits_dtype(model, model_config=model_config)
    model.train()
    if config.compile:
        model = _compiled(model)
    return model, forward_settings


def _compiled(model):
    """The model as the HF Trainer's ``torch_compile`` runs it: accelerate's ``prepare`` wraps it in
    ``torch.compile`` with the Inductor backend and the default mode (transformers 5.24 training_args.py l.1623-1629
    sets the backend, trainer.py l.796-800 hands it to accelerate's TorchDynamoPlugin; accelerate accelerator.py
    l.1701 compiles). The first steps compile it (the run's warm-up steps: the measured step is a later one);
    Inductor on the CPU builds C++ kernels with the machine's compiler (``_check_compiler``)."""
    import torch

    return torch.compile(model)


def _compile_after_probe(one_step, details: dict[str, Any]) -> None:
    """Compile the model for the timed step once the CPU probe has stopped. Dynamo does not trace a frame under a
    TorchDispatchMode, the probe's, and marks the frame skipped for good (torch 2.13 torch/_dynamo/convert_frame.py
    l.2538-2569, "non-infra torch dispatch mode present"): the probed steps ran eager, so the measured memory is
    eager's, the bound the plan counts (``TrainConfig.compile``). ``torch._dynamo.reset`` forgets the skip; one step
    compiles (not timed), and the next is the timed one."""
    import torch

    torch._dynamo.reset()
    t0 = time.perf_counter()
    one_step()
    details["compile_s"] = time.perf_counter() - t0
    details["compiled"] = "the timed step (the probed steps ran eager: the probe's dispatch mode stops Dynamo)"


def _check_compiler(config: TrainConfig, device: str) -> None:
    """A compiled run on the CPU needs a C++ compiler: Inductor's CPU kernels are C++ it builds with $CXX, else g++
    (torch 2.13 torch/_inductor/config.py l.1690-1693 ``cpp.cxx``; cpp_builder.py l.83-108 ``cpp_compiler_search``)."""
    import os
    import shutil

    if config.compile and device == "cpu" and not shutil.which(os.environ.get("CXX", "g++")):
        raise InvalidConfigError("compile: torch.compile's Inductor builds C++ kernels on the CPU and this machine has "
                                 "no C++ compiler (g++): install one, or verify without --compile")


def _record_parameters(details: dict[str, Any], *, model, params: list) -> None:
    details["params_total"] = sum(p.numel() for p in model.parameters())
    details["params_trainable"] = sum(p.numel() for p in params)
    details["trainable_bytes"] = sum(p.numel() * p.element_size() for p in params)
    details["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    details["param_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})


def _step_function(*, engine, optimizer, config: TrainConfig, batches: list, use_ds: bool, scaler, autocast,
                   forward_settings: Mapping[str, Any], set_phase):
    """One optimizer step over the accumulated micro-batches, as the HF Trainer or a manual loop runs it."""
    import torch

    device_type, autocast_dtype = autocast
    held: list = [None]  # the manual loop's ``outputs``: alive until the next forward returns

    def one_step() -> None:
        for batch in batches:
            set_phase("forward")
            ctx = torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
            with ctx:
                if config.loop is Loop.MANUAL:
                    # outputs = model(**batch); loss = outputs.loss: the name keeps the outputs
                    held[0] = engine(**batch, **forward_settings)
                    loss = held[0].loss
                else:
                    # HF Trainer: compute_loss returns the loss alone, the outputs die here
                    loss = engine(**batch, **forward_settings).loss
            set_phase("backward")
            if use_ds:
                engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
                set_phase("optimizer")
                engine.step()  # steps (and zeroes) only at the accumulation boundary
                continue
            loss = loss / config.grad_accum
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            del loss
        if use_ds:
            return
        set_phase("optimizer")
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return one_step


def _evaluate(engine, model, config: TrainConfig, *, vocab: int, gen, device, autocast_dtype, set_phase) -> None:
    """One eval batch as the HF Trainer's evaluation_loop runs it after an optimizer step (the
    gradients already None: ``model.zero_grad()`` in its training loop, transformers 5 trainer.py):
    ``model.eval()``, then under ``torch.no_grad()`` Seq2SeqTrainer's prediction_step with
    ``predict_with_generate`` (trainer_seq2seq.py: ``model.generate(**inputs)``, then the loss
    forward ``model(**inputs)``), or without generation Trainer.prediction_step's loss forward; the
    loss alone is kept (prediction_loss_only, the default when no compute_metrics is given:
    Trainer.evaluate). Mixed precision runs the forwards under autocast, as accelerate wraps the
    model's forward. The batch is ``eval_batch`` random rows of ``eval_tokens`` tokens, labels =
    inputs; generation is greedy, exactly ``generate_tokens`` new tokens (no EOS), the KV cache on."""
    import torch

    ids = torch.randint(0, vocab, (config.eval_batch, config.eval_tokens), generator=gen).to(device)
    autocast = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype else contextlib.nullcontext
    model.eval()
    with torch.no_grad():
        if config.generate_tokens:
            set_phase("eval_generate")
            with autocast():
                # no EOS, so every row generates all its tokens with no logits processor (a
                # min_new_tokens one would add a copy of the scores)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=config.generate_tokens, do_sample=False, use_cache=True,
                                     eos_token_id=None, pad_token_id=0)
            if out.shape[-1] != config.eval_tokens + config.generate_tokens:
                raise RuntimeError(f"generate stopped at {out.shape[-1] - config.eval_tokens} of "
                                   f"{config.generate_tokens} new tokens")
            del out
        set_phase("eval")
        with autocast():
            loss = engine(input_ids=ids, labels=ids).loss
        del loss
    model.train()


def _batch(config: TrainConfig, *, vocab: int, gen, device) -> dict[str, Any]:
    """One micro-batch. Packed: ``micro_batch`` rows of ``seq_len`` real tokens, ``labels =
    input_ids``, no attention mask. Padded to the longest: the first row is ``seq_len`` long (the
    batch that sets the peak), the others shorter, right-padded, with the attention mask and
    labels -100 on the padding (DataCollatorForSeq2Seq / DataCollatorWithPadding)."""
    import torch

    ids = torch.randint(0, vocab, (config.micro_batch, config.seq_len), generator=gen)
    if config.packing:
        ids = ids.to(device)
        return {"input_ids": ids, "labels": ids}
    lengths = torch.randint(1, config.seq_len + 1, (config.micro_batch,), generator=gen)
    lengths[0] = config.seq_len
    mask = (torch.arange(config.seq_len)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def _install_fused_ce(model, *, model_config: Mapping[str, Any]) -> None:
    """Replace the causal LM's forward with a fused linear cross-entropy one, as Liger's
    ``apply_liger_kernel_to_*`` does (its ``lce_forward``: the decoder, then the loss on the hidden
    states without logits). liger-kernel runs on Triton (no CPU backend), so the loss is the torch
    function ``workers.fused_ce.ChunkedLinearCrossEntropy``, which follows Liger's
    ``fused_linear_cross_entropy_forward`` chunk by chunk."""
    import types

    from transformers.modeling_outputs import CausalLMOutputWithPast

    from workers.fused_ce import fused_linear_cross_entropy

    if _is_encoder(model_config):
        raise InvalidConfigError("--fused-ce applies to causal LMs: the worker has no fused masked-LM head")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, base.base_model_prefix)
    head = base.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        # the decoder reads the KV cache setting from the model's config, as the Trainer's forward
        out = decoder(input_ids=input_ids, attention_mask=attention_mask)
        hidden = out.last_hidden_state
        loss = fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, labels)
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=out.past_key_values)

    base.forward = types.MethodType(forward, base)


def _install_loss_in_logits_dtype(model, *, model_config: Mapping[str, Any]) -> None:
    """The 16-bit loss (``loss_upcast`` False) as emit's train.py gives it to the HF Trainer
    (planner/emit/train_script.py ``loss_in_logits_dtype``, the same lines): the model's forward
    without the labels, then ForCausalLMLoss without its ``logits.float()`` (transformers
    loss/loss_utils.py), autocast off so that the cross-entropy runs on the 16-bit logits."""
    import torch

    if _is_encoder(model_config) or seq2seq.is_seq2seq(model_config):
        raise InvalidConfigError("--no-loss-upcast is a causal LM's loss: the worker has no 16-bit masked-LM or "
                                 "encoder-decoder loss")
    forward = model.forward

    def with_loss(*args, labels=None, **kwargs):
        out = forward(*args, **kwargs)
        if labels is not None:
            logits = out.logits
            shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous().to(logits.device)
            with torch.autocast(logits.device.type, enabled=False):
                out["loss"] = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.view(-1),
                                                                ignore_index=-100)
        return out

    model.forward = with_loss


def _install_shifted_copy_loss(model, *, model_config: Mapping[str, Any], upcast: bool) -> None:
    """transformers <= 4.45's causal-LM forward with its loss (``loss_shift``): the decoder, the head,
    then the lines 4.45's models ran in their forward (4.45.2 models/llama/modeling_llama.py
    l.1214-1229): ``logits = self.lm_head(hidden_states).float()``, ``shift_logits = logits[...,
    :-1, :].contiguous()``, ``CrossEntropyLoss`` on it, the upcast logits returned; the last hidden
    state a local until the forward returns. Under the run's autocast, as the model's forward ran
    it; with ``upcast`` False on the logits as they are, autocast off, as the 16-bit loss. (emit's
    train.py passes the Trainer the same lines as a compute_loss_func, ``shifted_copy_loss``, which
    runs after the forward returned.)"""
    import types

    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if _is_encoder(model_config) or seq2seq.is_seq2seq(model_config):
        raise InvalidConfigError("--loss-shift is a causal LM's loss: the worker has no shifted masked-LM or "
                                 "encoder-decoder loss")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, base.base_model_prefix)
    head = base.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        # the decoder reads the KV cache setting from the model's config, as the Trainer's forward
        outputs = decoder(input_ids=input_ids, attention_mask=attention_mask)
        hidden_states = outputs[0]
        logits = head(hidden_states)
        if upcast:
            logits = logits.float()  # the head's own output dies here
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous().to(logits.device)
            with contextlib.nullcontext() if upcast else torch.autocast(logits.device.type, enabled=False):
                loss = torch.nn.CrossEntropyLoss()(shift_logits.view(-1, shift_logits.shape[-1]), shift_labels.view(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)

    base.forward = types.MethodType(forward, base)


def _install_loss_returning_head(model, *, model_config: Mapping[str, Any]) -> None:
    """transformers 4.46-4.48's loss (``loss_returns_head``): the model's own forward, which returns the
    head's 16-bit output and calls ``self.loss_function`` on it (5.24 models/llama/modeling_llama.py
    ``LlamaForCausalLM.forward``, as 4.48.1 models/mistral/modeling_mistral.py l.848-852), with 4.48.1's
    ``ForCausalLMLoss`` as that function (``planner.emit.causal_lm_loss``, which emit's train.py sets alike)."""
    if _is_encoder(model_config) or seq2seq.is_seq2seq(model_config):
        raise InvalidConfigError("--loss-returns-head is a causal LM's loss: plan an encoder or encoder-decoder without it")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not calls_loss_function(base):
        raise InvalidConfigError(f"{type(base).__name__}.forward computes its own loss, not self.loss_function: plan "
                                 f"{model_config.get('model_type')} without --loss-returns-head")
    base.loss_function = causal_lm_loss_448


def _tag_states(probe, *, model, optimizer, use_ds: bool) -> None:
    """Tag the storages alive before the measured step by what holds them (CPU probe only)."""
    import torch

    probe.track(model.parameters(), category="parameters")
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO wrapper holds the torch one
    states = [v for s in getattr(inner, "state", {}).values() for v in s.values() if isinstance(v, torch.Tensor)]
    probe.track(states, category="optimizer_states")
    if use_ds:
        # fp32 master partitions and their gradient partitions: stage 1/2
        # (stage_1_and_2.py single_partition_of_fp32_groups) and stage 3 (stage3.py
        # fp32_partitioned_groups_flat). With CPU offload they (and Adam's moments) live in host
        # memory on a GPU machine: tagged "offloaded", kept out of the device peak.
        masters = list(getattr(optimizer, "single_partition_of_fp32_groups", None) or [])
        masters += list(getattr(optimizer, "fp32_partitioned_groups_flat", None) or [])
        masters = [m for m in masters if isinstance(m, torch.Tensor)]
        master_grads = [m.grad for m in masters if m.grad is not None]
        offloaded = bool(getattr(optimizer, "cpu_offload", False) or getattr(optimizer, "offload_optimizer", False))
        category = "offloaded" if offloaded else "optimizer_states"
        probe.track(masters + states, category=category)
        probe.track(master_grads, category="offloaded" if offloaded else "gradients")
        if offloaded:
            # host-side staging buffers of ZeRO-1/2 offload: the 16-bit copy of the partition and
            # one parameter's gradient (stage_1_and_2.py __init__)
            host = list(getattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups", None) or [])
            host.append(getattr(optimizer, "temp_grad_buffer_for_cpu_offload", None))
            probe.track([t for t in host if isinstance(t, torch.Tensor)], category="offloaded")


__all__ = ["ENCODER_MODEL_TYPES", "library_versions", "run_in_process"]
