"""``planner emit``: every emitted file loads with the real library, and every knob of the plan
comes back out of the library's object unchanged (plan -> file -> object -> knob).

The reader of the files here is written independently of ``planner.emit``: it knows the
libraries' classes, not our builders. Runs of the emitted train.py are in test_emit_runs.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.catalog import fingerprint, resolve_model
from planner.config import Attention, Method, Offload, Optimizer, Precision, TrainConfig
from planner.emit import plan_files
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.optim import OPTIMIZERS
from planner.results import Candidate, PlanRequest
from planner.throughput import estimate_throughput

MODEL = "Qwen/Qwen2.5-0.5B"  # hidden 896: DeepSpeed's reduce bucket is 896² elements
GPU = "a100-80gb"

#: plans that together take every value of every knob (checked by test_the_plans_cover_every_knob)
PLANS = [
    dict(method="full", precision="fp32", optimizer="adamw", micro_batch=2, grad_accum=4, seq_len=512),
    dict(method="full", precision="bf16-mixed", micro_batch=4, grad_ckpt=True, attention="eager", zero=2,
         offload="optimizer", gpus=4, seq_len=1024),
    dict(method="full", precision="fp16-mixed", optimizer="sgd", zero=1, gpus=2, grad_accum=2, seq_len=256),
    dict(method="full", precision="bf16", optimizer="adamw_8bit", grad_ckpt=True, seq_len=2048),
    dict(method="full", precision="fp16", optimizer="adafactor", attention="flash", micro_batch=8, seq_len=128),
    dict(method="lora", lora_r=8, lora_targets=("q_proj", "v_proj"), precision="bf16-mixed",
         optimizer="paged_adamw_8bit", micro_batch=3, grad_accum=5, seq_len=384),
    dict(method="lora", precision="fp32", zero=3, offload="optimizer+params", gpus=8, seq_len=512),
    dict(method="qlora", lora_r=64, precision="bf16-mixed", grad_ckpt=True, zero=2, gpus=2, seq_len=4096),
    dict(method="qlora", lora_r=4, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), precision="fp16-mixed",
         optimizer="adafactor", seq_len=64),
    dict(method="lora", precision="fp16", optimizer="sgd", seq_len=200),
    dict(method="lora", precision="bf16", attention="flash", micro_batch=16, seq_len=32),
    dict(method="qlora", precision="bf16", optimizer="adamw_8bit", gpus=3, seq_len=96),
    dict(method="lora", precision="bf16-mixed", optimizer="adamw_8bit", zero=1, gpus=2, seq_len=96),
    dict(method="qlora", precision="fp32", seq_len=100),
    # the recipe settings (--lora-dropout, --fused-ce, --no-packing, --use-cache, --compile)
    dict(method="lora", precision="bf16-mixed", lora_dropout=0.05, fused_ce=True, packing=False, use_cache=True,
         compile=True, seq_len=256),
    dict(method="qlora", precision="bf16-mixed", lora_dropout=0.1, grad_ckpt=True, packing=False, seq_len=512),
    # fp8 on an FP8 GPU (``FP8_GPU``): accelerate's torchao backend, DDP over 2
    dict(method="full", precision="fp8", grad_ckpt=True, gpus=2, seq_len=512),
]
#: where the fp8 plans are emitted (the A100 has no FP8)
FP8_GPU = "h100-80gb"
#: a LoRA plan for each registered optimizer the plans above do not name (planner.optim: adding an
#: optimizer is its descriptor module and its tests, and its emitted files are held here as well)
#: (an optimizer the installed transformers no longer names, ``hf_removed``, is refused by emit:
#: tests/optim/test_optim_adamw_hf.py)
EMITTED = tuple(o for o in Optimizer if not OPTIMIZERS[o].hf_removed)
PLANS += [dict(method="lora", precision="bf16-mixed", optimizer=str(o), seq_len=128)
          for o in EMITTED if o not in {plan.get("optimizer", "adamw") for plan in PLANS}]


def candidate_for(spec, gpu, config: TrainConfig) -> Candidate:
    return Candidate(config=config, memory=estimate_memory(model=spec, config=config, gpu=gpu),
                     throughput=estimate_throughput(model=spec, config=config, gpu=gpu), fits=True, rank=1)


def emit_into(folder: Path, config: TrainConfig, *, model: str = MODEL, gpu: str | None = None) -> Path:
    gpu = gpu or (FP8_GPU if config.precision is Precision.FP8 else GPU)
    spec, device = resolve_model(model), get_gpu(gpu)
    request = PlanRequest(model_id=model, model_fingerprint=fingerprint(spec), gpu=gpu, gpu_count=config.gpus,
                          gpu_memory_bytes=device.memory_bytes, target_batch=config.global_batch, seq_len=config.seq_len)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in plan_files(candidate=candidate_for(spec, device, config), spec=spec, request=request).items():
        (folder / name).write_text(text)
    return folder


def import_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"emitted_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def clean_process_state():
    """TrainingArguments with a DeepSpeed file sets globals (environment, transformers' ZeRO-3
    flag) that would leak into later tests of this process."""
    environ = dict(os.environ)
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    os.environ.clear()
    os.environ.update(environ)


# ---- reading the files back with the real libraries -------------------------------------------
def read_training_arguments(folder: Path):
    from transformers import TrainingArguments

    settings = json.loads((folder / "training_args.json").read_text())
    # this machine has no GPU: the Trainer refuses bf16 without use_cpu, and a GPU plan does not set it
    settings.setdefault("use_cpu", True)
    return TrainingArguments(**settings)


def precision_back(args, script, bnb, cluster) -> str:
    if cluster.mixed_precision == "fp8":
        # accelerate's torchao backend, which train.py names too for `python train.py`; the Trainer's flags
        # off, so it keeps the launcher's ACCELERATE_MIXED_PRECISION (transformers training_args.py)
        assert cluster.fp8_config == {"backend": "AO"} and not (args.bf16 or args.fp16)
        assert script.os.environ["ACCELERATE_MIXED_PRECISION"] == "fp8"
        assert script.os.environ["ACCELERATE_FP8_BACKEND"] == "AO" and script.MODEL_DTYPE == "float32"
        return "fp8"
    if args.bf16:
        return "bf16-mixed"
    if args.fp16:
        return "fp16-mixed"
    dtype = str(bnb.bnb_4bit_compute_dtype).removeprefix("torch.") if bnb is not None else script.MODEL_DTYPE
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]


def optimizer_back(args) -> str:
    """The registered optimizer whose HF name the emitted arguments carry, with the arguments its
    descriptor sets beside it."""
    from transformers.training_args import OptimizerNames

    if args.optim == OptimizerNames.SGD:
        # the memory model's SGD: one momentum buffer, in-place update (no weight-decay copy)
        assert args.optim_args == "momentum=0.9" and args.weight_decay == 0.0
    [spec] = [spec for spec in OPTIMIZERS.values() if spec.hf_optim == args.optim]
    for key, value in spec.hf_args.items():
        assert getattr(args, key) == value, key
    return spec.name


def adapters_back(folder: Path) -> tuple[dict, object]:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    bnb = None
    if (folder / "bnb_config.json").exists():
        bnb = BitsAndBytesConfig(**json.loads((folder / "bnb_config.json").read_text()))
        assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_use_double_quant
    if not (folder / "lora_config.json").exists():
        assert bnb is None
        return {"method": "full"}, None
    lora = LoraConfig(**json.loads((folder / "lora_config.json").read_text()))
    targets = ("all-linear",) if lora.target_modules == "all-linear" else tuple(sorted(lora.target_modules))
    return {"method": "qlora" if bnb else "lora", "lora_r": lora.r, "lora_targets": targets,
            "lora_dropout": lora.lora_dropout}, bnb


def deepspeed_back(folder: Path, args, hidden: int) -> dict:
    if not args.deepspeed:
        assert not (folder / "ds_config.json").exists()
        return {}
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig(str(folder / args.deepspeed))
    zero = ds.zero_config
    assert ds.train_micro_batch_size_per_gpu == args.per_device_train_batch_size
    assert ds.gradient_accumulation_steps == args.gradient_accumulation_steps
    assert ds.gradient_clipping == args.max_grad_norm
    # the bucket the memory model counts (hidden², the HF Trainer's "auto"), not DeepSpeed's 5e8
    assert zero.reduce_bucket_size == hidden * hidden
    offload = "none"
    if zero.offload_optimizer is not None and str(zero.offload_optimizer.device).endswith("cpu"):
        offload = "optimizer"
    if zero.offload_param is not None and str(zero.offload_param.device).endswith("cpu"):
        offload = "optimizer+params"
    return {"zero": ds.zero_optimization_stage, "offload": offload}


def accelerate_back(folder: Path, args) -> dict:
    from accelerate.commands.config.config_args import load_config_from_file

    cluster = load_config_from_file(str(folder / "accelerate_config.yaml"))
    assert (str(cluster.distributed_type).endswith("DEEPSPEED")) == bool(args.deepspeed)
    mixed = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    assert cluster.mixed_precision in (mixed, "fp8")
    return {"gpus": cluster.num_processes}


def read_cluster(folder: Path):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(folder / "accelerate_config.yaml"))


def knobs_back(folder: Path, hidden: int) -> TrainConfig:
    """The TrainConfig the emitted files describe, read through the libraries' own classes."""
    args = read_training_arguments(folder)
    script = import_script(folder / "train.py")
    adapters, bnb = adapters_back(folder)
    if args.activation_checkpointing:
        assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert script.USE_CACHE == args.use_cache
    if args.use_liger_kernel:  # the fused linear cross-entropy alone
        assert args.liger_kernel_config == {"fused_linear_cross_entropy": True, "cross_entropy": False,
                                            "rms_norm": False, "rope": False, "swiglu": False}
    attention = {"flash_attention_2": "flash"}.get(script.ATTENTION, script.ATTENTION)
    return TrainConfig(
        **adapters, precision=precision_back(args, script, bnb, read_cluster(folder)), optimizer=optimizer_back(args),
        micro_batch=args.per_device_train_batch_size, grad_accum=args.gradient_accumulation_steps,
        seq_len=script.SEQ_LEN, grad_ckpt=args.activation_checkpointing, attention=attention,
        fused_ce=args.use_liger_kernel, packing=script.PACKED, use_cache=args.use_cache, compile=args.torch_compile,
        **deepspeed_back(folder, args, hidden), **accelerate_back(folder, args),
    )


# ---- the tests ------------------------------------------------------------------------------
def test_the_plans_cover_every_knob():
    configs = [TrainConfig(**kw) for kw in PLANS]
    for field, values in (("method", Method), ("precision", Precision), ("optimizer", set(EMITTED)),
                          ("attention", Attention), ("offload", Offload), ("zero", (0, 1, 2, 3)),
                          ("grad_ckpt", (False, True))):
        assert {getattr(c, field) for c in configs} == set(values), field
    assert {c.lora_all_linear for c in configs if c.method.uses_adapters} == {True, False}
    assert len({c.gpus for c in configs}) > 2 and len({c.micro_batch for c in configs}) > 2
    assert len({c.grad_accum for c in configs}) > 2 and len({c.lora_r for c in configs}) > 3
    for field in ("fused_ce", "packing", "use_cache", "compile"):
        assert {getattr(c, field) for c in configs} == {False, True}, field
    assert len({c.lora_dropout for c in configs}) > 2


@pytest.mark.parametrize("plan", PLANS, ids=lambda kw: TrainConfig(**kw).label())
def test_every_knob_comes_back_from_the_libraries_objects(plan, tmp_path, monkeypatch, clean_process_state):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    config = TrainConfig(**plan)
    folder = emit_into(tmp_path / "plan", config)
    monkeypatch.chdir(folder)  # the files name each other relative to their folder, as the user runs them
    back = knobs_back(folder, hidden=resolve_model(MODEL).hidden_size)
    # peft keeps target_modules as a set: the order of the names is not a knob
    assert back == config.replace(lora_targets=tuple(sorted(config.lora_targets)) if config.lora_targets else None)


def test_each_file_is_written_only_when_the_plan_uses_it(tmp_path):
    full = set(os.listdir(emit_into(tmp_path / "a", TrainConfig(precision="bf16-mixed"))))
    assert full == {"train.py", "training_args.json", "accelerate_config.yaml", "PLAN.md"}
    qlora_zero = set(os.listdir(emit_into(tmp_path / "b", TrainConfig(method="qlora", zero=2))))
    assert qlora_zero == full | {"ds_config.json", "lora_config.json", "bnb_config.json"}


def test_the_deepspeed_config_is_the_one_the_worker_runs():
    """One builder: the worker's module re-exports it, and emit adds only the Trainer's clipping
    (and pinned buffers, as the worker uses on a GPU)."""
    import workers.deepspeed_config as worker_ds
    from planner.emit import deepspeed, settings

    assert worker_ds.build is deepspeed.build
    spec = resolve_model(MODEL)
    config = TrainConfig(zero=2, offload="optimizer", micro_batch=2, grad_accum=3)
    emitted = settings.deepspeed_config(config, spec=spec, on_cpu=False)
    worker = worker_ds.build(config, hidden_size=spec.hidden_size, pin_memory=True)
    assert emitted == worker | {"gradient_clipping": 1.0}
    assert emitted["zero_optimization"]["reduce_bucket_size"] == 896 * 896


def test_plan_md_names_the_plan_its_breakdown_and_assumptions(tmp_path):
    config = TrainConfig(method="lora", precision="bf16-mixed", grad_ckpt=True, micro_batch=4, grad_accum=2)
    text = (emit_into(tmp_path / "p", config) / "PLAN.md").read_text()
    estimate = estimate_memory(model=resolve_model(MODEL), config=config, gpu=get_gpu(GPU))
    assert config.label() in text
    assert f"{estimate.peak_allocated_bytes:,}" in text
    for component, size in estimate.breakdown.items():
        assert f"| {component} | {size:,} |" in text
    assert "LoRA dropout 0.0" in text and "use_reentrant=False" in text
    assert "Not measured yet" in text


def test_building_the_files_does_not_import_torch():
    code = (
        "import sys\n"
        "from planner.catalog import resolve_model\n"
        "from planner.emit import settings\n"
        "from planner.config import TrainConfig\n"
        "c = TrainConfig(method='qlora', zero=2)\n"
        "settings.training_arguments(c, on_cpu=False); settings.deepspeed_config(c, spec=resolve_model('gpt2'), on_cpu=False)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- the command ----------------------------------------------------------------------------
@pytest.fixture
def plan_id(cli) -> str:
    result = cli("suggest", "--model", MODEL, "--gpu", GPU, "--target-batch", "8", "--seq-len", "512", "--json")
    assert result.code == 0, result
    return json.loads(result.out)["plan_id"]


def test_emit_writes_the_ranked_plan(cli, plan_id, tmp_path):
    result = cli("emit", plan_id[:8], tmp_path / "out", "--rank", "2", "--dataset", "data.jsonl")
    assert result.code == 0, result
    names = sorted(os.listdir(tmp_path / "out"))
    assert all(name in result.out for name in names)
    assert f"plan {plan_id}, #2" in (tmp_path / "out" / "train.py").read_text()
    assert "DATASET = 'data.jsonl'" in (tmp_path / "out" / "train.py").read_text()


def test_unknown_plan_is_one_line_and_writes_nothing(cli, plan_id, tmp_path):
    result = cli("emit", "ffffffffff", tmp_path / "out")
    assert result.code != 0 and result.err.count("\n") == 1 and "planner history" in result.err, result
    assert not (tmp_path / "out").exists()


def test_a_rank_the_plan_does_not_have_is_one_line(cli, plan_id, tmp_path):
    result = cli("emit", plan_id, tmp_path / "out", "--rank", "99")
    assert result.code != 0 and result.err.count("\n") == 1 and "--rank 1 to" in result.err, result


def test_a_directory_with_files_is_refused_and_left_alone(cli, plan_id, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "train.py").write_text("my own script")
    result = cli("emit", plan_id, out)
    assert result.code != 0 and result.err.count("\n") == 1 and "--force" in result.err, result
    assert (out / "train.py").read_text() == "my own script"
    assert sorted(os.listdir(out)) == ["notes.txt", "train.py"]


def test_force_overwrites_ours_removes_stale_ones_and_keeps_others(cli, plan_id, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "lora_config.json").write_text("{}")  # from an earlier LoRA plan: train.py would read it
    result = cli("emit", plan_id, out, "--force")
    assert result.code == 0, result
    assert (out / "notes.txt").read_text() == "mine"
    assert "plan " + plan_id in (out / "train.py").read_text()
    uses_lora = "lora" in json.loads(cli("show", plan_id, "--json").out)["candidates"][0]["config"]["method"]
    assert (out / "lora_config.json").exists() == uses_lora


def test_plan_md_shows_what_was_measured(cli, plan_id, tmp_path):
    from planner.results import Measurement, RunOutcome
    from planner.store import PlanStatus, open_store

    with open_store() as store:
        plan = store.get_plan(plan_id=plan_id)
        top = next(c for c in plan.candidates if c.candidate.rank == 1)
        predicted = top.candidate.memory.peak_allocated_bytes
        measured = round(predicted / 1.05)  # the prediction 5 % above the measurement
        store.record_measurement(candidate_id=top.id, measurement=Measurement(
            outcome=RunOutcome.OK, device="NVIDIA A100-SXM4-80GB", peak_allocated_bytes=measured, step_s=1.25,
            tokens_per_s=3277.0))
        store.set_status(plan_id=plan_id, status=PlanStatus.VERIFIED)
    result = cli("emit", plan_id, tmp_path / "out")
    assert result.code == 0, result
    text = (tmp_path / "out" / "PLAN.md").read_text()
    assert "Plan status: verified." in text
    row = next(line for line in text.splitlines() if line.startswith("| ok | NVIDIA A100-SXM4-80GB"))
    assert "+5.0%" in row and "1.25 s" in row and "3,277" in row


def test_an_encoder_trains_as_masked_lm_without_a_causal_task(tmp_path):
    from peft import LoraConfig

    folder = emit_into(tmp_path / "bert", TrainConfig(method="lora", lora_targets=("query", "value"), seq_len=128),
                       model="bert-base-uncased")
    assert import_script(folder / "train.py").MASKED_LM is True
    assert LoraConfig(**json.loads((folder / "lora_config.json").read_text())).task_type is None


def test_an_encoder_decoder_trains_as_seq2seq(tmp_path):
    from peft import LoraConfig

    folder = emit_into(tmp_path / "t5", TrainConfig(method="lora", seq_len=256), model="t5-large")
    script = import_script(folder / "train.py")
    assert (script.SEQ2SEQ, script.MASKED_LM) == (True, False)
    assert LoraConfig(**json.loads((folder / "lora_config.json").read_text())).task_type == "SEQ_2_SEQ_LM"


def test_a_manual_loop_plan_says_the_emitted_trainer_needs_less(tmp_path):
    folder = emit_into(tmp_path / "manual", TrainConfig(method="lora", loop="manual", seq_len=256))
    assert "train.py uses the HF Trainer, which frees them: it needs less" in (folder / "PLAN.md").read_text()


def test_suggest_emit_writes_the_top_plan_and_refuses_a_full_directory_before_planning(cli, tmp_path):
    import json

    out = tmp_path / "run"
    r = cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "8", "--emit", str(out))
    assert r.code == 0, r
    assert "wrote" in r.out and "for plan #1" in r.out
    assert {"train.py", "training_args.json", "accelerate_config.yaml", "PLAN.md"} <= {p.name for p in out.iterdir()}
    plans = json.loads(cli("history", "--json").out)
    assert len(plans) == 1 and plans[0]["id"] in (out / "PLAN.md").read_text()
    again = cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "8", "--fresh", "--emit", str(out))
    assert again.code == 2 and "already holds files" in again.err and len(again.err.strip().splitlines()) == 1
    assert len(json.loads(cli("history", "--json").out)) == 1  # refused before anything was planned or stored
    assert cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "8", "--emit", str(out), "--no-save").code == 2


def test_a_16_bit_loss_plan_computes_the_cross_entropy_on_the_16_bit_logits(tmp_path):
    """--no-loss-upcast: train.py gives the Trainer a compute_loss_func (transformers' Trainer
    pops the labels and calls it on the outputs) that is ForCausalLMLoss without its
    ``logits.float()``: the same loss within bf16's precision, computed in bf16, even under autocast."""
    import inspect

    import torch
    from transformers import Trainer
    from transformers.loss.loss_utils import ForCausalLMLoss

    folder = emit_into(tmp_path / "bf16-loss", TrainConfig(method="lora", precision="bf16-mixed", loss_upcast=False,
                                                           seq_len=256))
    script = import_script(folder / "train.py")
    assert script.LOSS_UPCAST is False and "compute_loss_func" in inspect.signature(Trainer).parameters
    assert "16-bit loss" in (folder / "PLAN.md").read_text()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 50, generator=gen).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 50, (2, 8), generator=gen)
    labels[0, :3] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = script.loss_in_logits_dtype(type("Out", (), {"logits": logits})(), labels)
    assert loss.dtype == torch.bfloat16
    assert abs(loss.item() - ForCausalLMLoss(logits, labels, vocab_size=50).item()) < 0.05
    summed = script.loss_in_logits_dtype(type("Out", (), {"logits": logits})(), labels, num_items_in_batch=torch.tensor(11))
    assert abs(summed.item() - ForCausalLMLoss(logits, labels, 50, num_items_in_batch=torch.tensor(11)).item()) < 0.05
    assert TrainConfig(method="lora", seq_len=256).loss_upcast and import_script(
        emit_into(tmp_path / "fp32-loss", TrainConfig(method="lora", seq_len=256)) / "train.py").LOSS_UPCAST is True
