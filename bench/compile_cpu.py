"""torch.compile on this CPU against the planner's compiled step (``TrainConfig.compile``, planner.kernels).

    python bench/compile_cpu.py kernels   # the kernels Inductor generates for a LlamaForCausalLM, and their host time
    python bench/compile_cpu.py step      # eager vs compiled step time, measured and predicted (the cpu profile)
    python bench/compile_cpu.py saved     # the bytes autograd saves for backward, eager vs compiled
    python bench/compile_cpu.py all --out bench/results/compile-cpu.json

``kernels``: an 8-block LlamaForCausalLM (hidden 32, 8 tokens: the kernels do no work) compiled with the Inductor
backend, forward + backward; the generated kernels (``cpp_fused_*``), extern GEMMs (``extern_kernels.mm``) and aten
fallbacks (SDPA) are counted in the output code of each graph, and a step's host time (one thread's CPU time,
OMP_NUM_THREADS=1, as bench/cpu_overhead.py ``host``) is divided by them: planner.kernels ``COMPILED_*_KERNELS``
and ``COMPILED_KERNEL_HOST_SECONDS``. The eager step's ops are counted as the planner counts them (135 a block).

``step``: llama-tiny (bench/throughput_cpu.py's) at 2 x 256 tokens, full fine-tuning, fp32 and bf16-mixed, AdamW as
the worker builds it: the median of 5 timed steps after warm-up (the compiled model after its compilation, timed
apart), against ``estimate_throughput`` on the ``cpu`` profile. Other processes share the 2 cores: the 1-minute
load average is recorded with each run.

``saved``: the bytes autograd saves for backward of a 2-block LlamaForCausalLM at 2 x 128 tokens, eager against
compiled (``saved``'s docstring): the memory the planner keeps as eager's for a compiled plan is a bound.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: the model of ``kernels``: hidden 32, 8 blocks (the kernels do no work at 8 tokens)
TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
#: the model of ``step``: bench/throughput_cpu.py's llama-tiny
LLAMA_TINY = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=8192, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
TIMED = 5


def _output_codes() -> list[str]:
    """Start collecting the Python wrapper of every graph Inductor compiles (its ``call``: the kernels it launches)."""
    from torch._inductor import config, graph

    # a cached graph is loaded without being lowered again: compile each afresh (torch/_inductor/config.py
    # force_disable_caches)
    config.force_disable_caches = True
    codes: list[str] = []
    original = graph.GraphLowering.compile_to_module

    def collect(self):
        module = original(self)
        codes.append(Path(module.__file__).read_text())
        return module

    graph.GraphLowering.compile_to_module = collect
    return codes


def count_kernels(code: str) -> dict[str, int]:
    """The kernels one graph's wrapper launches: generated (``cpp_fused_*``), extern GEMMs, aten fallbacks."""
    call = code[code.find("def call("):]
    return {"fused": len(re.findall(r"\n\s+cpp_fused_\w+\(", call)),
            "extern": len(re.findall(r"extern_kernels\.\w+\(", call)),
            "aten": len(re.findall(r"torch\.ops\.aten\.\w+\.\w+\(", call))}


def _model(config_dict: dict[str, Any]):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**config_dict)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _stepper(model, optimizer, batch, autocast: bool):
    import torch

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def _median_s(step, timed: int, clock=time.perf_counter) -> float:
    times = []
    for _ in range(timed):
        t0 = clock()
        step()
        times.append(clock() - t0)
    return statistics.median(times)


def kernels() -> dict[str, Any]:
    """The compiled step's kernels and host time per kernel against eager's ops (fp32 and bf16 autocast)."""
    import torch

    torch.set_num_threads(1)
    codes = _output_codes()
    out: dict[str, Any] = {}
    for autocast in (False, True):
        torch._dynamo.reset()
        codes.clear()
        model = _model(TINY)
        ids = torch.randint(0, TINY["vocab_size"], (1, 8))
        batch = {"input_ids": ids, "labels": ids}
        eager = _stepper(model, None, batch, autocast)
        for _ in range(3):
            eager()
        eager_s = _median_s(eager, 40, time.process_time)
        compiled = _stepper(torch.compile(model), None, batch, autocast)
        for _ in range(3):
            compiled()
        compiled_s = _median_s(compiled, 40, time.process_time)
        counts = [count_kernels(code) for code in codes]
        total = sum(sum(c.values()) for c in counts)
        ops = TINY["num_hidden_layers"] * 135
        out["bf16-autocast" if autocast else "fp32"] = {
            "graphs": counts, "kernels": total, "eager_ops": ops,
            "eager_s": eager_s, "compiled_s": compiled_s,
            "eager_us_per_op": eager_s / ops * 1e6, "compiled_us_per_kernel": compiled_s / total * 1e6}
    return out


def step() -> dict[str, Any]:
    """Eager and compiled step times of llama-tiny, measured and predicted."""
    import torch

    from planner.catalog import spec_from_config
    from planner.config import TrainConfig
    from planner.gpus import get_gpu
    from planner.throughput import estimate_throughput
    from workers.train import _build_optimizer

    spec = spec_from_config(LLAMA_TINY, model_id="llama-tiny", source="bench")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, LLAMA_TINY["vocab_size"], (2, 256), generator=gen)
    batch = {"input_ids": ids, "labels": ids}
    rows = []
    for precision in ("fp32", "bf16-mixed"):
        for compile_ in (False, True):
            config = TrainConfig(micro_batch=2, seq_len=256, precision=precision, compile=compile_)
            predicted = estimate_throughput(model=spec, config=config, gpu=get_gpu("cpu")).step_s
            torch._dynamo.reset()
            model = _model(LLAMA_TINY)
            model.train()
            optimizer = _build_optimizer(config, [p for p in model.parameters() if p.requires_grad])
            run = _stepper(torch.compile(model) if compile_ else model, optimizer, batch, precision == "bf16-mixed")
            t0 = time.perf_counter()
            run()
            first_s = time.perf_counter() - t0
            run()
            load = os.getloadavg()[0]
            measured = _median_s(run, TIMED)
            rows.append({"precision": precision, "compile": compile_, "predicted_s": predicted, "measured_s": measured,
                         "error": (predicted - measured) / measured, "first_step_s": first_s, "load_1min": load})
            print(f"{precision:10} compile={compile_!s:5} predicted {predicted:.3f} s  measured {measured:.3f} s  "
                  f"({(predicted - measured) / measured:+.1%}; first step {first_s:.1f} s, load {load:.1f})", flush=True)
    for precision in ("fp32", "bf16-mixed"):
        eager, compiled = (next(r for r in rows if r["precision"] == precision and r["compile"] is c) for c in (False, True))
        print(f"{precision}: compiled / eager step, measured {compiled['measured_s'] / eager['measured_s']:.2f}, "
              f"predicted {compiled['predicted_s'] / eager['predicted_s']:.2f}")
    return {"rows": rows}


#: the model of ``saved``: 2 blocks at hidden 256, 2 x 128 tokens
SAVED = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512)


def saved() -> dict[str, Any]:
    """Bytes of the tensors autograd saves for backward (their storages, the parameters left out), eager against
    compiled: AOTAutograd's compiled function saves through ``ctx.save_for_backward`` too, so one
    ``saved_tensors_hooks`` pack hook sees both. What the min-cut partitioner's recompute saves of the memory the
    planner counts as eager's (``TrainConfig.compile``: an upper bound)."""
    import torch

    model = _model(SAVED)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, SAVED["vocab_size"], (2, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    def saved_bytes(run, autocast: bool) -> int:
        storages: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = run(**batch).loss
        loss.backward()
        return sum(storages.values())

    out = {}
    for autocast in (False, True):
        torch._dynamo.reset()
        eager = saved_bytes(model, autocast)
        compiled_model = torch.compile(model)
        saved_bytes(compiled_model, autocast)  # the compilation
        compiled = saved_bytes(compiled_model, autocast)
        out["bf16-autocast" if autocast else "fp32"] = {"eager_bytes": eager, "compiled_bytes": compiled,
                                                        "ratio": compiled / eager}
        print(f"{'bf16 autocast' if autocast else 'fp32'}: saved for backward, eager {eager / 2**20:.2f} MiB, compiled "
              f"{compiled / 2**20:.2f} MiB ({compiled / eager:.2f}x)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("kernels", "step", "saved", "all"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {}
    if args.what in ("kernels", "all"):
        result["kernels"] = kernels()
        for name, k in result["kernels"].items():
            print(f"{name}: {k['kernels']} kernels ({k['eager_ops']} eager ops), {k['compiled_us_per_kernel']:.1f} us per "
                  f"kernel ({k['eager_us_per_op']:.1f} us per eager op); graphs {k['graphs']}")
    if args.what in ("step", "all"):
        result["step"] = step()
    if args.what in ("saved", "all"):
        result["saved"] = saved()
    if args.out:
        import torch

        result["torch"] = torch.__version__
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
