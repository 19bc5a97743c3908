"""The emitted train.py runs, and it uses the memory the measurement worker measured.

A tiny llama (hidden 64, 2 layers, vocab 1000; random weights saved with ``save_pretrained``)
and a word-level tokenizer are built locally, so nothing is downloaded (HF_HUB_OFFLINE=1).
Every test trains for real on the CPU: slow.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from planner.catalog import fingerprint, resolve_model  # noqa: E402
from planner.config import TrainConfig  # noqa: E402
from planner.emit import plan_files  # noqa: E402
from planner.gpus import get_gpu  # noqa: E402
from planner.memory import estimate_memory  # noqa: E402
from planner.results import Candidate, PlanRequest  # noqa: E402
from planner.throughput import estimate_throughput  # noqa: E402

pytestmark = pytest.mark.slow

TINY = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128,
)
WORDS = [f"w{i}" for i in range(990)]

#: Runs the emitted train.py's own ``build_trainer`` under the CPU probe with the worker's
#: measurement convention (workers/train.py): the probe starts before the model is loaded, the
#: peak is reset right before the last optimizer step (after tagging the states the worker tags:
#: weights loaded by safetensors are made outside the dispatch mode, DeepSpeed's offloaded
#: partitions are host memory) and read after it.
PROBED_RUN = r"""
import importlib.util, json, os, sys
from transformers import TrainerCallback
from workers.probes import CpuProbe
from workers.train import _tag_states

folder, data, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
spec = importlib.util.spec_from_file_location("emitted_train", os.path.join(folder, "train.py"))
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
probe = CpuProbe(allocator=False)  # the dispatch count, as the worker's peak_dispatch_bytes

class LastStep(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == steps - 1:
            zero = bool(args.deepspeed)
            optimizer = trainer.optimizer.optimizer if zero else trainer.optimizer
            _tag_states(probe, model=trainer.model, optimizer=optimizer, use_ds=zero)
            probe.track(trainer.model.buffers())
            probe.reset_peak()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == steps:
            probe.stop()

probe.start()
trainer = script.build_trainer(["--dataset", data, "--max-steps", str(steps), "--output-dir", os.path.join(folder, "out")])
trainer.add_callback(LastStep())
trainer.train()
print(json.dumps({"peak": probe.peak_allocated_bytes}))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A local tiny llama with a tokenizer, and datasets in the three formats train.py reads."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).save_pretrained(root / "model")
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>").save_pretrained(root / "model")
    rnd = random.Random(0)
    text = " ".join(rnd.choice(WORDS) for _ in range(3000))
    (root / "data.txt").write_text(text)
    (root / "text.jsonl").write_text("".join(json.dumps({"text": text[i : i + 2000]}) + "\n" for i in range(0, len(text), 2000)))
    (root / "ids.jsonl").write_text("".join(json.dumps({"input_ids": [rnd.randrange(1000) for _ in range(300)]}) + "\n" for _ in range(4)))
    return root


def emit_for(tiny: Path, folder: Path, config: TrainConfig) -> Path:
    """The files of a CPU plan of ``config`` for the tiny model."""
    model = str(tiny / "model" / "config.json")  # as 'planner suggest --model DIR' stores it
    spec, cpu = resolve_model(model), get_gpu("cpu")
    candidate = Candidate(config=config, memory=estimate_memory(model=spec, config=config, gpu=cpu),
                          throughput=estimate_throughput(model=spec, config=config, gpu=cpu), fits=True, rank=1)
    request = PlanRequest(model_id=model, model_fingerprint=fingerprint(spec), gpu="cpu", gpu_count=1,
                          gpu_memory_bytes=cpu.memory_bytes, target_batch=config.global_batch, seq_len=config.seq_len)
    folder.mkdir(parents=True)
    for name, text in plan_files(candidate=candidate, spec=spec, request=request).items():
        (folder / name).write_text(text)
    return folder


def run_env(config: TrainConfig) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if config.zero:
        # one rank of one, as `accelerate launch` would set it; DeepSpeed on the CPU with gloo
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env |= dict(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


SCRIPT_RUNS = [
    ("full", dict(precision="fp32", micro_batch=2, seq_len=32), "data.txt", "model.safetensors"),
    ("lora", dict(method="lora", precision="bf16-mixed", micro_batch=2, grad_accum=2, seq_len=32), "text.jsonl",
     "adapter_model.safetensors"),
    ("qlora", dict(method="qlora", precision="bf16-mixed", grad_ckpt=True, micro_batch=2, seq_len=32), "ids.jsonl",
     "adapter_model.safetensors"),
    ("zero2-offload", dict(precision="bf16-mixed", zero=2, offload="optimizer", micro_batch=2, seq_len=32), "data.txt",
     "model.safetensors"),
    # one row per sequence, padded per batch with an attention mask; LoRA dropout
    ("lora-padded", dict(method="lora", precision="bf16-mixed", lora_dropout=0.1, packing=False, micro_batch=2,
                         seq_len=32), "text.jsonl", "adapter_model.safetensors"),
    # evaluation on held-out sequences every step (--eval-steps 1), then greedy generation from the
    # first eval batch (the callback train.py adds)
    ("lora-eval-generate", dict(method="lora", precision="bf16-mixed", micro_batch=2, seq_len=32, eval_batch=3,
                                eval_seq_len=16, generate_tokens=8), "data.txt", "adapter_model.safetensors"),
]


@pytest.mark.parametrize("name, options, data, saved", SCRIPT_RUNS, ids=[r[0] for r in SCRIPT_RUNS])
def test_the_emitted_script_trains_two_steps(tiny, tmp_path, name, options, data, saved):
    config = TrainConfig(**options)
    folder = emit_for(tiny, tmp_path / name, config)
    # run from elsewhere: the script finds its settings next to itself
    result = subprocess.run(
        [sys.executable, str(folder / "train.py"), "--dataset", str(tiny / data), "--max-steps", "2",
         "--output-dir", str(tmp_path / "trained"), "--eval-steps", "1"],
        cwd=tmp_path, env=run_env(config), capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'train_loss'" in result.stdout + result.stderr
    # evaluation only where the plan holds its pass (--eval-steps is ignored otherwise)
    assert ("'eval_loss'" in result.stdout + result.stderr) == bool(config.eval_batch)
    if config.generate_tokens:
        assert f"generated {config.generate_tokens} tokens for {config.eval_batch} eval prompts" in result.stdout
    assert (tmp_path / "trained" / saved).exists(), os.listdir(tmp_path / "trained")


PEAK_RUNS = [
    dict(precision="fp32", grad_ckpt=True, micro_batch=2, seq_len=32),
    dict(method="lora", precision="bf16-mixed", micro_batch=2, grad_accum=2, seq_len=32),
    dict(method="qlora", precision="bf16-mixed", grad_ckpt=True, micro_batch=2, seq_len=32),
    # the Trainer's 32-bit embedding states for 8-bit optimizers, undone by train.py
    dict(precision="bf16", optimizer="adamw_8bit", micro_batch=2, seq_len=32),
    # torch SGD's weight decay copies every gradient: the emitted SGD has none, as the worker's
    dict(precision="fp32", optimizer="sgd", grad_ckpt=True, micro_batch=2, seq_len=32),
    dict(precision="bf16-mixed", zero=2, offload="optimizer", micro_batch=2, seq_len=32),
]


@pytest.mark.parametrize("options", PEAK_RUNS, ids=lambda o: TrainConfig(**o).label())
def test_the_script_and_the_worker_peak_within_2_percent(tiny, tmp_path, options):
    from workers import measure_with_details

    config = TrainConfig(**options)
    folder = emit_for(tiny, tmp_path / "plan", config)
    result = subprocess.run(
        [sys.executable, "-c", PROBED_RUN, str(folder), str(tiny / "data.txt"), "3"],
        cwd=tmp_path, env=run_env(config), capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    script_peak = json.loads(result.stdout.strip().splitlines()[-1])["peak"]
    measurement, details = measure_with_details(model_config=TINY, config=config, steps=3, timeout_s=1200)
    assert measurement.peak_allocated_bytes, measurement.error
    # both runs counted the same way: the CPU probe's dispatch count of live tensor storages (the
    # worker's measured peak is c10's allocator count; in this probed Trainer script that count
    # reads 15-30 % below the worker's, a difference not explained yet: see issue 11's note)
    worker_peak = details["peak_dispatch_bytes"]
    assert abs(script_peak - worker_peak) / worker_peak <= 0.02, (script_peak, worker_peak)
