"""The throughput model against the CPU's own training runs: predicted vs measured step time.

Each configuration is trained by ``workers.measure_with_details`` (what ``planner measure --gpu cpu``
runs: a fresh process, ``steps`` optimizer steps, the last one timed without the memory probe) and
predicted by ``planner.throughput.estimate_throughput`` on the ``cpu`` profile, uncalibrated. A
configuration is measured ``--repeat`` times and its median step time kept; the 1-minute load
average before each run is recorded; each run waits (up to 20 s) for the cores to be 60% idle over a
second (other processes share the 2 cores: a run beside them is slower).

    python bench/throughput_cpu.py              # measure, print, write results/throughput-cpu.json
    python bench/throughput_cpu.py --repredict  # the stored measurements against the current model

Error = (predicted - measured) / measured of the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results" / "throughput-cpu.json"

#: Small models of real architectures (config.json keys). gpt2-tiny is bench/accuracy.py's gpt2;
#: gpt2 is the real 124M model's config (/work/shared/model-configs/_/gpt2); llama-tiny a 4-layer llama.
MODELS: dict[str, dict[str, Any]] = {
    "gpt2-tiny": dict(model_type="gpt2", n_embd=384, n_layer=4, n_head=6, vocab_size=50257, n_positions=1024),
    "gpt2": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
    "llama-tiny": dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=8192, max_position_embeddings=1024,
                       rms_norm_eps=1e-5, tie_word_embeddings=False),
}

#: (model, options as ``planner measure`` takes them; the precision its default for the method)
CASES: list[tuple[str, dict[str, Any]]] = [
    ("gpt2-tiny", dict(method="full", micro_batch=1, seq_len=64)),
    ("gpt2-tiny", dict(method="full", micro_batch=2, seq_len=256)),
    ("gpt2-tiny", dict(method="lora", micro_batch=2, seq_len=256)),
    ("gpt2", dict(method="full", micro_batch=1, seq_len=128)),
    ("llama-tiny", dict(method="full", micro_batch=1, seq_len=64)),
    ("llama-tiny", dict(method="lora", micro_batch=2, seq_len=256)),
]


def _spec(name: str):
    from planner.catalog import spec_from_config

    return spec_from_config(MODELS[name], model_id=f"bench/{name}", source="bench")


def _config(name: str, options: dict[str, Any]):
    from planner.estimation import build_config
    from planner.gpus import get_gpu

    options = dict(options)
    seq = options.pop("seq_len")
    return build_config(_spec(name), get_gpu("cpu"), seq_len=seq, **options)


def _predict(name: str, config_dict: dict[str, Any]) -> dict[str, Any]:
    from planner.config import TrainConfig
    from planner.gpus import get_gpu
    from planner.throughput import estimate_throughput

    est = estimate_throughput(model=_spec(name), config=TrainConfig.from_dict(config_dict), gpu=get_gpu("cpu"))
    return {"predicted_s": est.step_s, "breakdown_s": est.breakdown_s}


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _idle(seconds: float = 1.0) -> float:
    """Fraction of the machine's CPU time idle over ``seconds`` (/proc/stat's idle + iowait)."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(*, idle: float = 0.6, max_wait_s: float = 20.0) -> float:
    """Wait until the cores are at least ``idle`` idle (other processes share them; a run beside them
    is slower), at most ``max_wait_s``; the idle fraction seen last."""
    deadline = time.monotonic() + max_wait_s
    while True:
        seen = _idle()
        if seen >= idle or time.monotonic() > deadline:
            return seen


def _measure(name: str, config, *, repeat: int, steps: int) -> dict[str, Any]:
    from workers import measure_with_details

    times, loads, idles = [], [], []
    for _ in range(repeat):
        idles.append(wait_quiet())
        loads.append(_load())
        measurement, _ = measure_with_details(model_config=MODELS[name], config=config, device="cpu", steps=steps,
                                              timeout_s=900)
        if measurement.outcome != "ok":
            raise SystemExit(f"{name} {config.label()}: {measurement.outcome}: {measurement.error}")
        times.append(measurement.step_s)
        print(f"  {name} {config.label()} seq {config.seq_len}: {measurement.step_s:.3f} s (load {loads[-1]:.2f}, "
              f"idle before {idles[-1]:.0%})", flush=True)
    return {"measured_s": statistics.median(times), "min_s": min(times), "runs_s": times, "loads": loads,
            "idle": idles}


def _error(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured


def _print(rows: list[dict[str, Any]]) -> str:
    """Print the table; return it as markdown."""
    print(f"{'model':<11} {'config':<42} {'seq':>4} {'predicted s':>11} {'measured s':>10} {'error %':>8}  load")
    errors, before = [], []
    md = ["| model | config | seq | before s | before err % | predicted s | measured s (median) | min s | error % "
          "| load (1-min avg) | predicted parts (s) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        err = _error(r["predicted_s"], r["measured_s"])
        errors.append(abs(err))
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["breakdown_s"].items() if v)
        b = r.get("before_s")
        if b is not None:
            before.append(abs(_error(b, r["measured_s"])))
        print(f"{r['model']:<11} {r['label']:<42} {r['config']['seq_len']:>4} {r['predicted_s']:>11.4f} "
              f"{r['measured_s']:>10.4f} {err:>+8.1f}  {min(r['loads']):.2f}-{max(r['loads']):.2f}")
        print(f"{'':<11} {parts}")
        md.append(f"| {r['model']} | {r['label']} | {r['config']['seq_len']} | "
                  + (f"{b:.3f} | {_error(b, r['measured_s']):+.0f} | " if b is not None else "| | ")
                  + f"{r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['min_s']:.3f} | {err:+.0f} | "
                  f"{min(r['loads']):.1f}-{max(r['loads']):.1f} | {parts} |")
    summary = f"median |error| {statistics.median(errors):.1f}%, max {max(errors):.1f}% over {len(rows)} configurations"
    if before:
        summary += f" (before: median {statistics.median(before):.1f}%, max {max(before):.1f}%)"
    print(summary)
    return "\n".join(md) + f"\n\n**{summary}**\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repredict", action="store_true", help="re-predict the stored measurements, run nothing")
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration (median kept)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the last one timed)")
    parser.add_argument("--filter", default="", help="only configurations whose model or label contains this")
    parser.add_argument("--merge", action="store_true",
                        help="put the measured rows into the stored ones (replacing the same configuration's)")
    parser.add_argument("--baseline", action="store_true",
                        help="store the importable planner's predictions as 'before' (run with the older planner)")
    args = parser.parse_args()
    if args.baseline:
        rows = json.loads(RESULTS.read_text())
        rows = [r | {"before_s": _predict(r["model"], r["config"])["predicted_s"]} for r in rows]
        RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    elif args.repredict:  # the stored measurements, this model's predictions stored beside them
        rows = json.loads(RESULTS.read_text())
        rows = [r | _predict(r["model"], r["config"]) for r in rows]
        RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    else:
        rows = []
        for name, options in CASES:
            config = _config(name, options)
            if args.filter and args.filter not in f"{name} {config.label()}":
                continue
            row = {"model": name, "label": config.label(), "config": config.to_dict()}
            row |= _measure(name, config, repeat=args.repeat, steps=args.steps)
            row |= _predict(name, row["config"])
            rows.append(row)
        if args.merge:  # the stored rows, these in place of the same configuration's
            key = lambda r: (r["model"], r["label"], r["config"]["seq_len"])  # noqa: E731
            new = {key(r): r for r in rows}
            stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
            kept = [new.pop(key(r), r) for r in stored]
            rows = [r | _predict(r["model"], r["config"]) for r in kept + list(new.values())]
            RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
        elif not args.filter:
            RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    table = _print(rows)
    if not args.filter or args.merge:
        RESULTS.with_suffix(".md").write_text(
            "# Throughput model vs the CPU's own runs\n\nGenerated by `python bench/throughput_cpu.py` (`--repredict` "
            "re-predicts the stored measurements). Measured: `workers.measure_with_details` (what `planner measure "
            "--gpu cpu` runs), the last of 3 optimizer steps, the median of the runs (min beside it); predicted: "
            "`estimate_throughput` on the `cpu` profile, uncalibrated. 'before' is the prediction of the model this "
            "was measured against first (`--baseline` run with the older planner on PYTHONPATH). Other processes "
            "shared the 2 cores: the load column is the 1-minute load average before each run.\n\n" + table
            + "\ngpt2 (124M) and llama-tiny have no quiet two-thread run: with other processes on the cores every "
            "parallel region waits for a descheduled thread and steps ran 10-20x slower (gpt2 1 x 128: 6-16 s, "
            "llama-tiny 1 x 64: 4 s). One thread's CPU time is robust to that (`bench/cpu_overhead.py step "
            "--cpu-time`, OMP_NUM_THREADS=1): gpt2 1 x 128 bf16-mixed 1.38 s (forward 0.33, backward 0.62, AdamW "
            "0.43), llama-tiny 1 x 64 52 ms (13, 19, 20 ms), gpt2-tiny 1 x 64 346 ms and 2 x 256 1,081 ms; the "
            "model's parts at one thread (GEMMs at half the two-thread rate, memory-bound work and page faults x "
            "1.5, the serial dropout draw as is) give 1.47 s, 49 ms, 0.35 s and 1.02 s (+6%, -6%, +1%, -6%; "
            "1.59 s, 56 ms, 0.37 s and 1.05 s before the two changes below). The LoRA rows' one-thread steps "
            "(`step --cpu-time`, taken at a load average of 9, when the full 2 x 256 step took 1.33 s): gpt2-tiny "
            "0.82 s, llama-tiny 0.20 s (0.17-0.19 s at a load of 2); gpt2-tiny's LoRA step over its full one "
            "0.62, the model's 0.63.\n\n"
            "Two CPU facts were wrong. The profile's 37 GB/s is a measured, achieved rate (`copy_` into a kept "
            "tensor), yet memory-bound work was priced at 0.8 of it, the GPUs' datasheet efficiency: counted "
            "twice. torch.optim.AdamW's single-tensor path, on one thread without page faults (`bench/"
            "cpu_overhead.py adamw --cpu-time`), ran 2.1-3.4 ns per element, 24-38 GB/s at the model's 80 B, "
            "beside `copy_`'s 23 GB/s: most of its 20 passes are in place. And the CPU's dropout is not "
            "memory-bound: on this AMD CPU `bernoulli_` takes aten's serial kernel (DistributionKernels.cpp: only "
            "Intel CPUs take MKL's), 5.8-6.3 ns per element at one thread and at two (`dropout --cpu-time`), "
            "where 10 B of traffic were priced. Without the first, gpt2's AdamW is 0.35 s of its 0.90 s "
            "prediction (0.42 s before); with the second gpt2-tiny's 2 x 256 step draws 1.8 M mask elements, 10 ms. "
            "The small rows lose the error that hid what is left: glibc hands the heap's top back to the system "
            "when more than twice its largest recent block (up to 32 MiB) is free, so tensors below the 32 MiB "
            "mmap threshold are page-faulted in again each step too: llama-tiny's LoRA step took 12,000 minor "
            "faults (49 MB, 21 ms of its 0.175 s one-thread CPU time), none and 0.153 s with MALLOC_TRIM_THRESHOLD_ "
            "raised; the model counts faults only past the threshold.\n\n"
            "The LoRA rows (pure bf16: peft's adapters stay fp32) were predicted 28% and 42% too fast. Traced on one "
            "thread (each aten op's thread CPU time in the worker's own step), the model lacked: the adapters' "
            "GEMMs run in fp32 (peft casts each input to the adapter's dtype, tuners/lora/layer.py:1100), 53 "
            "GFLOP/s for the rank-16 products against bf16's 200; their output side in fp32 (layer.py:1102 and "
            ":1113: `* scaling`, the add promoted to fp32 by a copy on the CPU, the cast back, and their "
            "gradients: 52 B per output element, not 14); the CPU's SDPA, whose flash kernel runs at 0.13 of the "
            "bf16 GEMM rate (llama-tiny's attention 29 ms of a 0.2 s one-thread step, priced 6 ms) and which "
            "takes the fp32 math path under gpt2's attention dropout (`bench/cpu_overhead.py adapter,attention "
            "--cpu-time`). The host time per adapter (peft's Python, 27 more aten ops) measured 103 us against "
            "the 135 us counted: not a gap.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
