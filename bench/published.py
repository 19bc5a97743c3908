"""Accuracy of the planner against *published* GPU measurements (issue 10, item 3).

No GPU is needed: ``bench/published_rows.json`` holds peaks that docs pages, READMEs and benchmark
tables publish for fine-tuning runs, each with its source (URL or repository, path and
commit), the quoted line (every measured number appears in it verbatim), the metric and unit it
was measured in, every setting the source states, and ``guessed`` naming each setting it does not.

Each row is mapped to a ``TrainConfig`` through ``planner.estimation.resolve`` + ``build_config``
(every setting whose name is a ``TrainConfig`` field is passed; the others are listed as not
modelled), predicted with ``planner.memory.estimate_memory`` (and ``estimate_throughput`` where
the row gives samples/s or tokens/s, per GPU), and scored on the metric it measured:

    max_memory_allocated -> peak_allocated_bytes
    max_memory_reserved  -> peak_reserved_bytes
    nvml_used (nvidia-smi / pynvml) -> process_total_bytes

A row of a multi-GPU run (``gpus`` > 1, e.g. FSDP1 FULL_SHARD) is one rank's peak, as its source
measured it (fms-acceleration: rank 0's Trainer memory metrics; nvidia-smi's per-device peak,
averaged over the devices), and the estimate is per device: its shard of the model states, its
own micro-batch's activations, and on the nvidia-smi rows NCCL's buffers outside the allocator
(planner/memory/overhead.py), which ``process_total_bytes`` carries.

No per-source or per-model factor is applied: the report names, row by row, the physical terms
(with their sources, from the data file's ``terms``) that the model does not carry.

Two checks of the allocator's reserve (issue 25 item 4): the rows that measured it
(max_memory_reserved, nvidia-smi's used memory) with the predicted reserve over the allocated
peak beside each, and the plans that ran but the planner calls "does not fit" (each row is a
run that ran; ``verdict`` judges it as ``planner estimate`` and ``suggest`` do, the allocator
replayed on the usable memory), with what refuses each (``refused_by``). A row whose measurement
cannot be its stated run (a term marked ``not_the_run``) is scored and shown but not counted there.
A recipe's own terms are request fields the rows state (torchtune's ``optimizer_in_bwd`` and
chunked loss, litgpt's 16-bit chunked loss: ``loss_chunks``, ``loss_upcast``), so each row is
estimated with them.

    python bench/published.py [--rows PATH] [--out PATH] [--quiet]

Writes ``bench/results/accuracy-gpu-published.md`` and prints the summary. Offline, ~1 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROWS = HERE / "published_rows.json"
RESULTS = HERE / "results" / "accuracy-gpu-published.md"

#: bytes per unit as the sources print them (B: raw bytes; MiB: ``//1024**2`` or nvidia-smi; GB: ``/1e9``; GiB: ``/1024**3``)
UNITS = {"B": 1, "MiB": 2**20, "GiB": 2**30, "GB": 10**9, "MB": 10**6}
#: the measured counter -> the ``MemoryEstimate`` field that predicts it
METRICS = {
    "max_memory_allocated": "peak_allocated_bytes",
    "max_memory_reserved": "peak_reserved_bytes",
    "nvml_used": "process_total_bytes",
}
#: settings a row may carry that describe, not configure (never passed to TrainConfig)
DESCRIPTIVE = frozenset({"model", "model_id", "gpu", "gpu_id", "seq_len", "framework", "task", "dataset", "epochs",
                         "max_seq_length", "quantize", "optimizer_in_bwd", "torch_dtype", "fp16_amp",
                         "seq_len_from", "transformers_major", "transformers_from", "model_config",
                         "sharding_from"})
#: the guess/targets thresholds of issue 10
TARGET_MEDIAN = 0.05
TARGET_UNDER = -0.05


class Unscorable(Exception):
    """The planner cannot predict this row (unknown model, rejected configuration)."""


def load(path: Path = ROWS) -> dict[str, Any]:
    """The data file (sources, terms, rows)."""
    return json.loads(path.read_text())


def measured_bytes(row: dict[str, Any]) -> int:
    return int(round(float(row["value"]) * UNITS[row["unit"]]))


def config_fields() -> frozenset[str]:
    """The options build_config takes (``planner.estimation.CONFIG_OPTIONS``: the CLI's names,
    ``zero`` and ``offload`` for the sharding; seq_len is given apart)."""
    from planner.estimation import CONFIG_OPTIONS

    return frozenset(CONFIG_OPTIONS)


def map_row(row: dict[str, Any]) -> tuple[Any, Any, Any, list[str]]:
    """(spec, gpu, TrainConfig, settings the planner has no knob for) of one row.

    Raises ``Unscorable`` when the model does not resolve or the configuration is refused."""
    from planner.errors import PlannerError
    from planner.estimation import build_config, model_as_run, resolve

    settings = row["settings"]
    fields = config_fields()
    options = {k: v for k, v in settings.items() if k in fields}
    unmodelled = sorted(k for k in settings if k not in fields and k not in DESCRIPTIVE and k != "ds_buffers")
    unmodelled += sorted(k for k in ("task",) if settings.get(k))
    if options.get("optimizer_in_bwd") and int(settings.get("gpus") or 1) > 1:
        # a request field on one device (torchtune's full_finetune_single_device recipe); the
        # distributed recipe's is not modelled: planned without it, and listed
        del options["optimizer_in_bwd"]
        unmodelled.append("optimizer_in_bwd")
    try:
        spec, gpu = resolve(model=model_source(settings), gpu=settings["gpu_id"])
        if spec.is_moe and settings.get("transformers_major", 5) < 5 and not settings.get("experts_loop"):
            # transformers 4 built each expert of an MoE layer from nn.Linear modules (bitsandbytes
            # quantised them, and the eager loop ran each on its tokens); 5 fuses them into 3D
            # parameters run by grouped_mm, which stay unquantised (planner/memory/moe.py): a row
            # that ran on 4 is planned with experts_loop, which it must state
            raise Unscorable(f"ran on transformers {settings['transformers_major']}, whose MoE experts were "
                             "nn.Linear modules, and does not state experts_loop")
        spec = model_as_run(spec, options)  # experts_loop: transformers 4's per-expert modules
        if "ds_buffers" in settings:
            # the run read its own ds_config: the bucket keys it sets (none: DeepSpeed's defaults,
            # planner.sharding.zero.zero_buckets), not the file the planner writes
            from planner.sharding import Sharding, from_zero

            named = from_zero(options.pop("zero"), options.pop("offload", "none"))
            options["sharding"] = Sharding(named.scheme, named.offload, settings["ds_buffers"])
        config = build_config(spec, gpu, seq_len=settings["seq_len"], **options)
    except PlannerError as exc:
        raise Unscorable(str(exc)) from None
    return spec, gpu, config, unmodelled


def model_source(settings: dict[str, Any]) -> str:
    """What ``resolve`` reads for a row's model: its ``model_config`` (a config.json under bench/,
    for a model neither in the catalog nor in the local cache, with its provenance in ``_source``),
    else its ``model_id``."""
    config = settings.get("model_config")
    return str(HERE / config) if config else settings["model_id"]


def _measured_tokens_per_s(row: dict[str, Any]) -> float | None:
    """The row's tokens/s per GPU (every source here prints one rank's: fms-acceleration's
    train_tokens_per_second is one rank's tokens over the run time)."""
    tp = row.get("throughput")
    if not tp:
        return None
    value = float(tp["value"])
    return value * row["settings"]["seq_len"] if tp["unit"] == "samples/s" else value


def stated_device(gpu: Any, source: dict[str, Any]) -> Any:
    """The row's device as its source measured it: a source that prints its own CUDA context
    (the HF page's ``torch.ones((1, 1)).to("cuda")`` -> "GPU memory occupied: 1343 MB", CUDA 11.2
    loading every kernel module eagerly) is planned with that context instead of the planner's
    lazy-loading constant (planner/gpus.py CUDA_CONTEXT_BYTES). A measured input of the run, like
    its batch size; never a fitted factor."""
    mib = source.get("context_mib")
    return dataclasses.replace(gpu, cuda_context_bytes=int(mib) * 2**20) if mib else gpu


def score_row(row: dict[str, Any], sources: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prediction and signed errors of one row; ``status`` is ``scored`` or ``unscorable``.

    ``sources``: the data file's sources (a source's measured CUDA context is applied to its rows)."""
    from planner.memory import estimate_memory
    from planner.throughput import estimate_throughput

    out: dict[str, Any] = {"id": row["id"], "source": row["source"], "measured": measured_bytes(row), "metric": row["metric"],
                           "guessed": list(row.get("guessed", [])), "terms": list(row.get("terms", []))}
    out["note"] = row.get("note", "")
    try:
        spec, gpu, config, unmodelled = map_row(row)
    except Unscorable as exc:
        return {**out, "status": "unscorable", "reason": str(exc)}
    default_context = int(gpu.cuda_context_bytes)
    gpu = stated_device(gpu, (sources or {}).get(row["source"], {}))
    estimate = estimate_memory(model=spec, config=config, gpu=gpu)
    predicted = int(getattr(estimate, METRICS[row["metric"]]))
    out.update(status="scored", model_type=spec.model_type, config=config, predicted=predicted,
               error=(predicted - out["measured"]) / out["measured"], unmodelled=unmodelled,
               peak_phase=estimate.peak_phase, context_bytes=int(gpu.cuda_context_bytes),
               default_context_bytes=default_context, predicted_allocated=estimate.peak_allocated_bytes,
               **verdict(spec, config, gpu, estimate))
    moment = block_moment(spec, config, gpu)
    if moment is not None and row["metric"] == "max_memory_allocated":
        out.update(block_moment=moment[0], without_moment=moment[1],
                   without_moment_error=(max(moment[1], 0) - out["measured"]) / out["measured"])
    tokens = _measured_tokens_per_s(row)
    if tokens is not None:
        speed = estimate_throughput(model=spec, config=config, gpu=gpu, paged_host=estimate.paged_host_bytes)
        per_gpu = speed.tokens_per_s / config.gpus  # the estimate is summed over the GPUs, the row per GPU
        out.update(tokens_measured=tokens, tokens_predicted=per_gpu, tokens_error=(per_gpu - tokens) / tokens)
    return out


def verdict(spec: Any, config: Any, gpu: Any, estimate: Any) -> dict[str, Any]:
    """What the planner says of the row's plan, as ``planner estimate`` and ``suggest`` say it:
    ``fits`` when its process total, the allocator replayed on the usable memory (the device less
    planner.search.safety_margin), is within it. Every row ran, so ``fits`` False is a plan that
    ran called "does not fit"; ``states_over`` says whether the allocated peak alone (with the
    CUDA context) is past the usable memory, where no reserve could make it fit. Also the
    predicted reserve over the allocated peak (``reserve_over``)."""
    from planner.memory import estimate_memory
    from planner.search import safety_margin

    usable = gpu.memory_bytes - safety_margin(gpu.memory_bytes)
    total = estimate.process_total_bytes
    if total > usable:  # (within the budget the replay never reached it: the same estimate)
        total = estimate_memory(model=spec, config=config, gpu=gpu, budget=usable).process_total_bytes
    allocated = estimate.peak_allocated_bytes
    return {"usable": usable, "fits": total <= usable, "budget_total": total,
            "states_over": allocated + int(gpu.cuda_context_bytes) > usable,
            "reserve_over": estimate.peak_reserved_bytes / allocated - 1 if allocated else 0.0}


def not_the_run(r: dict[str, Any], terms: dict[str, Any]) -> bool:
    """A row whose measurement cannot be the run its settings state (a term marked ``not_the_run``:
    measured below the bytes its model states must hold): scored and shown, but not a plan that ran."""
    return any(terms.get(k, {}).get("not_the_run") for k in r["terms"])


def refused(results: list[dict[str, Any]], terms: dict[str, Any]) -> list[dict[str, Any]]:
    """The scored rows that are plans that ran (not ``not_the_run``) the planner calls "does not fit"."""
    return [r for r in results if r["status"] == "scored" and not r["fits"] and not not_the_run(r, terms)]


def refused_by(r: dict[str, Any]) -> str:
    """What makes a refused row's plan too large: its allocated peak alone past the usable memory;
    else an allocated peak predicted over what the run measured (more than 5% over its
    max_memory_allocated, or over the reserve it measured); else the reserve."""
    if r["states_over"]:
        return "the allocated peak"
    bound = r["measured"] * (1 + TARGET_MEDIAN) if r["metric"] == "max_memory_allocated" else r["measured"]
    return "the allocated peak's over-prediction" if r["predicted_allocated"] > bound else "the reserve"


def reserve_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The scored rows that measured the reserve: max_memory_reserved, or nvidia-smi's used memory
    (the reserve, the CUDA context and what is outside the allocator)."""
    return [r for r in results if r["status"] == "scored" and r["metric"] in ("max_memory_reserved", "nvml_used")]


def score_all(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [score_row(row, data["sources"]) for row in data["rows"]]


def block_moment(spec: Any, config: Any, gpu: Any) -> tuple[int, int] | None:
    """(allocated bytes at the model's ``first_block_backward`` moment, the largest of the other
    moments): the backward of the last checkpointed block (planner/memory/step.py PHASES), and
    what the prediction would be without it. None without checkpointing."""
    if not config.grad_ckpt:
        return None
    from planner.memory.overhead import with_workspaces
    from planner.memory.step import PHASES
    from planner.memory.timeline import step_timeline

    # with the cuBLAS workspaces the estimate's allocated peak holds (planner/memory/overhead.py)
    timeline = with_workspaces(step_timeline(model=spec, config=config, kernels=gpu.kernels), gpu)
    curve = timeline.curve()
    return curve[timeline.marks["first_block_backward"]], max(curve[timeline.marks[m]] for m in PHASES
                                                               if m != "first_block_backward")


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered) + 0.5) - 1)] if ordered else float("nan")


def summary(scored: list[dict[str, Any]]) -> dict[str, Any]:
    """Median / p90 absolute error, worst under- and over-prediction of a set of scored rows."""
    if not scored:
        return {"n": 0}
    errors = [r["error"] for r in scored]
    under = min(scored, key=lambda r: r["error"])
    over = max(scored, key=lambda r: r["error"])
    return {"n": len(scored), "median": statistics.median(abs(e) for e in errors),
            "p90": _p90([abs(e) for e in errors]), "signed_median": statistics.median(errors),
            "worst_under": (under["id"], under["error"]), "worst_over": (over["id"], over["error"])}


def groups(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    scored = [r for r in results if r["status"] == "scored"]
    return {"all scored rows": scored,
            "fully stated": [r for r in scored if not r["guessed"]],
            "with guessed settings": [r for r in scored if r["guessed"]],
            "one GPU": [r for r in scored if r["config"].gpus == 1],
            "one rank of a multi-GPU run": [r for r in scored if r["config"].gpus > 1]}


# --- the report ------------------------------------------------------------------------------------

def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _config_text(config: Any) -> str:
    parts = [str(config.method)]
    if config.lora_r:
        parts[0] += f" r{config.lora_r} {','.join(config.lora_targets)}"
    parts += [str(config.precision), str(config.optimizer), f"mb{config.micro_batch}x{config.grad_accum}",
              f"seq {config.seq_len}"]
    parts += ["ckpt"] * bool(config.grad_ckpt) + [str(config.attention)] * (str(config.attention) != "sdpa")
    if config.zero:
        parts.append(f"zero{config.zero} offload {config.offload}")
    if config.gpus > 1:
        parts.append(f"{config.sharding.scheme} x{config.gpus}, per rank")
    return ", ".join(parts)


def _explain(result: dict[str, Any], terms: dict[str, Any]) -> str:
    """The unmodelled terms, those that push the way of the error first."""
    direction = "under" if result["error"] < 0 else "over"
    keys = sorted(result["terms"], key=lambda k: terms[k]["effect"] != direction)
    marks = [f"**{k}**" if terms[k]["effect"] == direction else k for k in keys]
    return ", ".join(marks) or "-"


def _summary_lines(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| rows | n | median abs error | p90 abs error | signed median | worst under-prediction | worst over-prediction |",
             "|---|---:|---:|---:|---:|---|---|"]
    for name, rows in groups(results).items():
        s = summary(rows)
        if not s["n"]:
            lines.append(f"| {name} | 0 | - | - | - | - | - |")
            continue
        lines.append(f"| {name} | {s['n']} | {s['median'] * 100:.1f}% | {s['p90'] * 100:.1f}% | {_pct(s['signed_median'])} "
                     f"| {s['worst_under'][0]} {_pct(s['worst_under'][1])} | {s['worst_over'][0]} {_pct(s['worst_over'][1])} |")
    return lines


def _target_lines(results: list[dict[str, Any]]) -> list[str]:
    g = groups(results)
    s = summary(g["all scored rows"])
    under = [r for r in g["fully stated"] if r["error"] < TARGET_UNDER]
    lines = [f"- median absolute error <= 5%: **{'met' if s['n'] and s['median'] <= TARGET_MEDIAN else 'not met'}** "
             f"({s['median'] * 100:.1f}% over {s['n']} rows)" if s["n"] else "- no row scored"]
    lines.append(f"- no fully-stated row under-predicted by more than 5%: **{'met' if not under else 'not met'}**"
                 + (f" ({len(under)} rows: {', '.join(r['id'] for r in under)})" if under else ""))
    return lines


def _by_source_lines(results: list[dict[str, Any]], data: dict[str, Any]) -> list[str]:
    lines = ["| source | rows | scored | median abs error | signed median | how it was measured |", "|---|---:|---:|---:|---:|---|"]
    for key, src in data["sources"].items():
        rows = [r for r in results if r["source"] == key]
        s = summary([r for r in rows if r["status"] == "scored"])
        med = f"{s['median'] * 100:.1f}%" if s["n"] else "-"
        signed = _pct(s["signed_median"]) if s["n"] else "-"
        lines.append(f"| [{src['title']}]({src['url']}) | {len(rows)} | {s['n']} | {med} | {signed} | {src['how']} |")
    return lines


def _throughput_lines(results: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in results if r.get("tokens_error") is not None]
    if not rows:
        return ["No row publishes a throughput."]
    errs = [abs(r["tokens_error"]) for r in rows]
    lines = [f"{len(rows)} rows publish samples/s or tokens/s (per GPU; a multi-GPU run's prediction is divided by its "
             "GPUs). Median absolute throughput error "
             f"{statistics.median(errs) * 100:.0f}%, p90 {_p90(errs) * 100:.0f}% (memory error of the same rows beside it). "
             "The throughput model runs on its uncalibrated defaults (MFU and bandwidth efficiency per device, see each "
             "estimate's assumptions); these rows are measurements `planner calibrate` (item 4) can fit them from.", "",
             "| row | measured tokens/s | predicted tokens/s | throughput error | memory error |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['id']} | {r['tokens_measured']:.0f} | {r['tokens_predicted']:.0f} | {_pct(r['tokens_error'])} | {_pct(r['error'])} |"
              for r in rows]
    return lines


def _row_lines(results: list[dict[str, Any]], data: dict[str, Any]) -> list[str]:
    rows_by_id = {row["id"]: row for row in data["rows"]}
    lines = ["| row | model | GPU | metric | config | measured GiB | predicted GiB | signed error | guessed | not modelled (bold: pushes the way of the error) |",
             "|---|---|---|---|---|---:|---:|---:|---|---|"]
    for r in results:
        row = rows_by_id[r["id"]]
        st = row["settings"]
        head = f"| {r['id']} | {st['model']} | {st['gpu_id']} | {row['metric']} |"
        if r["status"] != "scored":
            lines.append(f"{head} {st['method']} | {_gib(r['measured'])} | - | unscorable | {', '.join(r['guessed']) or '-'} | {r['reason']} |")
            continue
        knobs = f" (no knob: {', '.join(r['unmodelled'])})" if r["unmodelled"] else ""
        lines.append(f"{head} {_config_text(r['config'])} | {_gib(r['measured'])} | {_gib(r['predicted'])} | {_pct(r['error'])} "
                     f"| {', '.join(r['guessed']) or '-'} | {_explain(r, data['terms'])}{knobs} |")
    return lines


def batch_pairs(results: list[dict[str, Any]], data: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of one source and metric whose settings differ only in the micro-batch: the measured and
    predicted bytes per extra sequence (activations) and the intercept at zero sequences (model states)."""
    rows_by_id = {row["id"]: row for row in data["rows"]}
    buckets: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r["status"] != "scored":
            continue
        row = rows_by_id[r["id"]]
        key = json.dumps([row["source"], row["metric"], {k: v for k, v in row["settings"].items()
                                                         if k not in ("micro_batch", "seq_len_from")}], sort_keys=True)
        buckets.setdefault(key, []).append(r)
    pairs = []
    for members in buckets.values():
        members.sort(key=lambda r: r["config"].micro_batch)
        lo, hi = members[0], members[-1]
        if lo["config"].micro_batch == hi["config"].micro_batch:
            continue
        db = hi["config"].micro_batch - lo["config"].micro_batch
        slope_m, slope_p = (hi["measured"] - lo["measured"]) / db, (hi["predicted"] - lo["predicted"]) / db
        pairs.append({"rows": (lo["id"], hi["id"]), "slope_measured": slope_m, "slope_predicted": slope_p,
                      "intercept_measured": lo["measured"] - slope_m * lo["config"].micro_batch,
                      "intercept_predicted": lo["predicted"] - slope_p * lo["config"].micro_batch})
    return pairs


def _pair_lines(results: list[dict[str, Any]], data: dict[str, Any]) -> list[str]:
    pairs = batch_pairs(results, data)
    if not pairs:
        return ["No source publishes the same run at two micro-batch sizes."]
    lines = ["Rows that differ only in the micro-batch split the error into a per-sequence part (activations, logits) "
             "and a part that does not grow with the batch (weights, optimizer states, context):", "",
             "| rows | GiB per sequence measured | predicted | error | GiB at zero sequences measured | predicted | error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for p in pairs:
        # a peak that does not grow with the batch (the optimizer step) has no per-sequence error to speak of
        slope_err = (_pct((p["slope_predicted"] - p["slope_measured"]) / p["slope_measured"])
                     if p["slope_measured"] >= 2**30 / 16 else "- (peak does not grow with the batch)")
        lines.append(f"| {p['rows'][0]} / {p['rows'][1]} | {_gib(p['slope_measured'])} | {_gib(p['slope_predicted'])} "
                     f"| {slope_err} | {_gib(p['intercept_measured'])} "
                     f"| {_gib(p['intercept_predicted'])} | {_pct((p['intercept_predicted'] - p['intercept_measured']) / p['intercept_measured'])} |")
    return lines


def _context_lines(results: list[dict[str, Any]], data: dict[str, Any]) -> list[str]:
    """The CUDA context a source measured itself, applied to its rows, and what the planner's own
    constant would have given (nvml rows only: the context is outside the allocator)."""
    lines = []
    for key, src in data["sources"].items():
        mib = src.get("context_mib")
        rows = [r for r in results if r["source"] == key and r["status"] == "scored"]
        if not mib or not rows:
            continue
        default = rows[0]["default_context_bytes"]
        # the context is outside the allocator: only the nvml rows see it
        shift = {r["id"]: (r["context_bytes"] - default) * (_metric(data, r["id"]) == "nvml_used") for r in rows}
        before = [(r["predicted"] - shift[r["id"]] - r["measured"]) / r["measured"] for r in rows]
        lines.append(f"- {src['title']}: the page measures its CUDA context at {mib} MiB ({src.get('context_quote', '')!r}); its rows "
                     f"are planned with it (`stated_device`). With the planner's own {default / 2**20:.0f} MiB lazy-loading constant "
                     f"the signed errors of its {len(rows)} rows would be {', '.join(_pct(e) for e in before)} "
                     f"(median {_pct(statistics.median(before))}); with the measured one they are "
                     f"{', '.join(_pct(r['error']) for r in rows)} (median {_pct(statistics.median(r['error'] for r in rows))}). "
                     + src.get("context_remainder", ""))
    return lines


def _reserve_lines(results: list[dict[str, Any]]) -> list[str]:
    """The rows that measured the reserve, the predicted reserve over the allocated peak beside
    each (PyTorch's caching allocator replayed on the step, planner/memory/allocator.py)."""
    rows = reserve_rows(results)
    lines = []
    for name, group in (("fully stated", [r for r in rows if not r["guessed"]]), ("all", rows)):
        if group:
            errs = [abs(r["error"]) for r in group]
            lines.append(f"- {name}: {len(group)} rows, median absolute error {statistics.median(errs) * 100:.1f}%, "
                         f"max {max(errs) * 100:.1f}%")
    lines += ["", "| row | counter | measured GiB | predicted GiB | signed error | predicted reserve over allocated | guessed |",
              "|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['id']} | {r['metric']} | {_gib(r['measured'])} | {_gib(r['predicted'])} | {_pct(r['error'])} | "
              f"{_pct(r['reserve_over'])} | {', '.join(r['guessed']) or '-'} |" for r in rows]
    return lines


def _refused_lines(results: list[dict[str, Any]], terms: dict[str, Any]) -> list[str]:
    """Every row (a run that ran) the planner calls "does not fit", whether its allocated peak
    alone is past the usable memory (a memory term's error, not the reserve's), the run's terms the
    model lacks; the rows that cannot be the stated run apart."""
    rows = refused(results, terms)
    scored = [r for r in results if r["status"] == "scored"]
    ran = [r for r in scored if not not_the_run(r, terms)]
    reserve = [r for r in rows if refused_by(r) == "the reserve"]
    lines = [(f"{len(rows)} of {len(ran)} scored rows that are plans that ran are called \"does not fit\"; "
              f"{len(reserve)} of them by the reserve (an allocated peak within the usable memory and not over what the "
              "run measured); the others by an allocated peak past the usable memory or predicted over the measured one.")]
    apart = [r for r in scored if not_the_run(r, terms)]
    if apart:
        lines += ["", f"Not counted as plans that ran ({len(apart)}): the measurement cannot be the stated run "
                  "(a term marked not_the_run), so the planner's verdict on the stated plan says nothing of it: "
                  + "; ".join(f"{r['id']} ({', '.join(k for k in r['terms'] if terms[k].get('not_the_run'))}: "
                              f"{'does not fit' if not r['fits'] else 'fits'})" for r in apart) + "."]
    if rows:
        lines += ["", "| row | usable GiB | predicted allocated + context GiB | process total on the usable memory GiB | refused by | "
                  "the run's terms not in the model that push over | guessed |",
                  "|---|---:|---:|---:|---|---|---|"]
        lines += [f"| {r['id']} | {_gib(r['usable'])} | {_gib(r['predicted_allocated'] + r['context_bytes'])} | "
                  f"{_gib(r['budget_total'])} | {refused_by(r)} | "
                  f"{', '.join(k for k in r['terms'] if terms[k]['effect'] == 'over') or '-'} | "
                  f"{', '.join(r['guessed']) or '-'} |" for r in rows]
    return lines


def _metric(data: dict[str, Any], row_id: str) -> str:
    return next(row["metric"] for row in data["rows"] if row["id"] == row_id)


def _block_moment_lines(results: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in results if r.get("block_moment") is not None]
    lines = ["The model's `first_block_backward` moment (planner/memory/step.py PHASES; terms in "
             "planner/memory/activations.py `block_backward_terms`): the backward of the last checkpointed block, the first "
             "backward reaches, with every block's checkpoint held, that block recomputed (less what its MLP output "
             "projection saved, released by then), the gradient of its output and the MLP's three gradients at the "
             "activation product. Measured on the CPU (bench/results/accuracy-cpu.md, the llama-v2k rows: QLoRA from "
             "-29 % to -0.05 %). Below, every checkpointed max_memory_allocated row: the moment, the largest of the "
             "other moments (the end of the block's recompute among them), and the row's error without the moment. A row moved where the moment is its peak.", "",
             "| row | measured GiB | predicted GiB | error | first_block_backward GiB | other moments' max GiB | error without it | moved |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        moved = "yes" if r["block_moment"] > r["without_moment"] else "no"
        lines.append(f"| {r['id']} | {_gib(r['measured'])} | {_gib(r['predicted'])} | {_pct(r['error'])} | "
                     f"{_gib(r['block_moment'])} | {_gib(r['without_moment'])} | {_pct(r['without_moment_error'])} | {moved} |")
    return lines


def _note(r: dict[str, Any]) -> str:
    """The row's note from the data file (``{bm}`` stands for the row's error without the
    checkpointed block's backward, the model's ``first_block_backward`` moment)."""
    bm = _pct(r["without_moment_error"]) if r.get("without_moment_error") is not None else "-"
    return (r["note"] or "no reason written").replace("{bm}", bm)


def needs_note(r: dict[str, Any]) -> bool:
    """A row the report must explain: unscorable, or scored outside +-5%."""
    return r["status"] != "scored" or abs(r["error"]) > TARGET_MEDIAN


def _miss_lines(results: list[dict[str, Any]]) -> list[str]:
    """Each fully-stated row under-predicted by more than 5%, with the reason its data file gives."""
    under = [r for r in groups(results)["fully stated"] if r["error"] < TARGET_UNDER]
    if not under:
        return ["Every fully-stated row is within the under-prediction target."]
    lines = ["| row | signed error | why it cannot be met with the model's terms |", "|---|---:|---|"]
    lines += [f"| {r['id']} | {_pct(r['error'])} | {_note(r)} |" for r in under]
    return lines


def _note_lines(results: list[dict[str, Any]]) -> list[str]:
    """Every row outside +-5% and every unscorable row, with what its remaining error comes from."""
    rows = [r for r in results if needs_note(r)]
    lines = ["| row | signed error | guessed | where the error comes from |", "|---|---:|---|---|"]
    for r in rows:
        err = _pct(r["error"]) if r["status"] == "scored" else "unscorable"
        lines.append(f"| {r['id']} | {err} | {', '.join(r['guessed']) or '-'} | {_note(r)} |")
    return lines


def _reading_lines(data: dict[str, Any]) -> list[str]:
    return [f"- **{src['title']}.** {src['analysis']}" for src in data["sources"].values() if src.get("analysis")]


def _terms_lines(data: dict[str, Any]) -> list[str]:
    lines = ["| term | what | pushes the prediction | source |", "|---|---|---|---|"]
    lines += [f"| {k} | {t['what']} | {t['effect']} | {t['source']} |" for k, t in data["terms"].items()]
    return lines


def markdown(results: list[dict[str, Any]], data: dict[str, Any]) -> str:
    n_unscorable = sum(r["status"] != "scored" for r in results)
    parts = [
        "# Planner vs published GPU measurements",
        "",
        "Generated by `python bench/published.py` from `bench/published_rows.json`. Each row is a peak a public source "
        "published for a fine-tuning run on one GPU, or for one rank of a multi-GPU run (the config column says "
        "`fsdp1 x2, per rank`: that rank's shard of the model states and its own micro-batch; on nvidia-smi rows NCCL's "
        "buffers too); it is predicted with `planner.memory.estimate_memory`, per device, for the stated "
        "model, GPU and settings and scored on the counter it measured (max_memory_allocated -> peak_allocated_bytes, "
        "max_memory_reserved -> peak_reserved_bytes, nvidia-smi/NVML used -> process_total_bytes). "
        "Signed error = (predicted - measured) / measured: negative is an under-prediction, the error that costs an OOM. "
        "No per-source or per-model factor is applied.",
        "",
        f"{len(results)} rows from {len(data['sources'])} sources; {len(results) - n_unscorable} scored, {n_unscorable} the planner cannot "
        "predict (listed below, not dropped).",
        "",
        "## Summary", "", *_summary_lines(results), "",
        "Targets (issue 10):", "", *_target_lines(results), "",
        "## By source", "", *_by_source_lines(results, data), "",
        "## Reading the errors, source by source", "", *_reading_lines(data), "",
        "## Throughput", "", *_throughput_lines(results), "",
        "## Row by row", "",
        "`guessed` names each setting the source does not state. The last column names the physical terms the model "
        "does not carry for that row (see the legend); those in bold push the prediction the way of the remaining error.",
        "", *_row_lines(results, data), "",
        "## Per-sequence vs fixed error", "", *_pair_lines(results, data), "",
        "## Fully-stated rows that miss the under-prediction target, and why", "", *_miss_lines(results), "",
        "## Every row outside +-5% (and every unscorable row), and why", "",
        "Where a row's settings are guessed (`guessed`), its error is that of the guess as much as the model's.", "",
        *_note_lines(results), "",
        "## The checkpointed block's backward", "", *_block_moment_lines(results), "",
        "## The allocator's reserve", "",
        "Rows that measured the reserve (max_memory_reserved, or nvidia-smi's used memory: the reserve plus the CUDA "
        "context). The reserve is PyTorch's caching allocator replayed on the step's allocations, each tensor of the "
        "size it has (planner/memory/timeline.py Grains), the optimizer's states made at the first step.", "",
        *_reserve_lines(results), "",
        "## Plans that ran, called \"does not fit\"", "", *_refused_lines(results, data["terms"]), "",
        "## A source's own CUDA context", "", *(_context_lines(results, data) or ["No source measures its context."]), "",
        "## Terms not in the model", "", *_terms_lines(data), "",
    ]
    return "\n".join(parts)


def _print_summary(results: list[dict[str, Any]], terms: dict[str, Any]) -> None:
    for name, rows in groups(results).items():
        s = summary(rows)
        if s["n"]:
            print(f"{name:24s} n={s['n']:3d}  median |err| {s['median'] * 100:5.1f}%  p90 {s['p90'] * 100:5.1f}%  "
                  f"worst under {s['worst_under'][0]} {_pct(s['worst_under'][1])}")
    for line in _target_lines(results):
        print(line)
    for name, rows in (("reserve rows", reserve_rows(results)),
                       ("reserve rows, stated", [r for r in reserve_rows(results) if not r["guessed"]])):
        if rows:
            errs = [abs(r["error"]) for r in rows]
            print(f"{name:24s} n={len(rows):3d}  median |err| {statistics.median(errs) * 100:5.1f}%  max {max(errs) * 100:5.1f}%  "
                  f"within 5%: {sum(e <= 0.05 for e in errs)}")  # issue 25: every stated reserve row
    no = refused(results, terms)
    print(f'ran but "does not fit": {len(no)} ({sum(refused_by(r) == "the reserve" for r in no)} by the reserve, '
          'the rest by the allocated peak)')
    speed = [abs(r["tokens_error"]) for r in results if r.get("tokens_error") is not None]
    if speed:
        print(f"throughput (uncalibrated)  n={len(speed):3d}  median |err| {statistics.median(speed) * 100:5.1f}%  "
              f"p90 {_p90(speed) * 100:5.1f}%")


# --- the memory error distribution the planner ships (planner/uncertainty.py MEMORY_ERROR) ---------

#: a method's own distribution needs this many rows of a kind, from at least MIN_SOURCES sources; with
#: fewer it is pooled over methods (one source's rows are one harness, one trainer and mostly one model:
#: eight fms-acceleration Mistral-7B LoRA rows within 1-6 % of each other would otherwise give every
#: LoRA plan a 95th percentile of +5.7 %)
MIN_ROWS = 8
MIN_SOURCES = 2


def _order_stat(ordered: list[float], q: float, *, upper: bool) -> float:
    """The q-quantile of ``ordered`` as an order statistic, rounded outward (the lower quantile
    down, the upper up), so an interval between two of them covers at least its share of the rows
    it was taken from."""
    import math as _math

    at = q * (len(ordered) - 1)
    return ordered[_math.ceil(at) if upper else _math.floor(at)]


def uncertainty_table(results: list[dict[str, Any]], sources: dict[str, Any] | None = None,
                      ) -> dict[tuple[str, bool, bool], tuple[int, float, float, float]]:
    """{(method or "all", guessed, several GPUs): (rows, q05, median, q95)} of ln(measured / predicted)
    over the scored rows, every counter together (a plan is compared with the device by its process
    total; the counters measure parts of it, and split by counter and method only full fine-tuning's
    NVML rows reach MIN_ROWS stated rows). ``guessed``: rows with at least one guessed setting, whose
    error is the guess's as much as the model's. ``several GPUs``: one rank of a multi-GPU run, whose
    error is the sharding's and the collectives' as much as the step's (the fms FSDP1 rows: median
    |error| twice the one-GPU rows'), kept apart so that it widens the multi-GPU plans' interval and
    not the one-GPU plans'. A method with fewer than MIN_ROWS rows of a kind, or rows of fewer than
    MIN_SOURCES sources, takes the pooled ("all") entry's median and its interval widened to hold the
    method's own rows. Sources are counted by what they published (``sources``' url: the data file's
    by default), so one harness's re-run is not a second source."""
    import math as _math

    if sources is None:
        sources = load()["sources"]
    harness = {name: source.get("url", name) for name, source in sources.items()}
    cells: dict[tuple[str, bool, bool], list[float]] = {}
    published: dict[tuple[str, bool, bool], set[str]] = {}
    for r in results:
        if r["status"] != "scored":
            continue
        x = _math.log(r["measured"] / r["predicted"])
        kind = (bool(r["guessed"]), r["config"].gpus > 1)
        for key in ((str(r["config"].method), *kind), ("all", *kind)):
            cells.setdefault(key, []).append(x)
            published.setdefault(key, set()).add(harness.get(r["source"], r["source"]))
    table = {}
    for key, xs in sorted(cells.items(), key=lambda kv: (kv[0][0] != "all", kv[0])):
        xs.sort()
        # four decimals, rounded outward as the order statistics are
        own = (len(xs), _math.floor(_order_stat(xs, 0.05, upper=False) * 1e4) / 1e4, round(statistics.median(xs), 4),
               _math.ceil(_order_stat(xs, 0.95, upper=True) * 1e4) / 1e4)
        if (len(xs) < MIN_ROWS or len(published[key]) < MIN_SOURCES) and key[0] != "all":
            # too few rows (or sources) for quantiles of its own: the pooled interval, widened to
            # hold this method's rows (the pooled median)
            _, q05, median, q95 = table[("all", *key[1:])]
            own = (len(xs), min(q05, _math.floor(xs[0] * 1e4) / 1e4), median, max(q95, _math.ceil(xs[-1] * 1e4) / 1e4))
        table[key] = own
    return table


def _print_uncertainty(results: list[dict[str, Any]]) -> None:
    """The table as the Python constant planner/uncertainty.py ships."""
    print("MEMORY_ERROR = {  # (method, guessed, several GPUs): (rows, q05, median, q95) of ln(measured / predicted)")
    for key, value in uncertainty_table(results).items():
        print(f"    {key!r}: {value!r},")
    print("}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=Path, default=ROWS, help="the data file (default: bench/published_rows.json)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the markdown report to write")
    parser.add_argument("--quiet", action="store_true", help="write the report, print nothing")
    parser.add_argument("--uncertainty", action="store_true",
                        help="print the memory error table planner/uncertainty.py ships, write nothing")
    args = parser.parse_args(argv)
    data = load(args.rows)
    results = score_all(data)
    if args.uncertainty:
        _print_uncertainty(results)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(results, data))
    if not args.quiet:
        _print_summary(results, data["terms"])
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
