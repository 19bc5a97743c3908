"""The golden ``suggest`` dump: about a thousand planning requests and the planner's whole answer to each.

    python bench/golden.py --check      # compare with the stored dump, request by request (exit 1 on a difference)
    python bench/golden.py --write      # write the stored dump anew (a change of answers on purpose: say why in the commit)
    python bench/golden.py --out FILE   # write the current answers to FILE (to compare two checkouts)

The requests are catalog models x GPUs x target batches x GPU counts x search spaces (the default
space, every precision, no offload, ``--prefer speed``, full fine-tuning only on a GPU whose node
RAM the catalog does not know, LoRA/QLoRA with the recipe knobs, a short sequence, one precision), plus requests
that nothing fits and requests the planner refuses. Each answer is the JSON of ``planner suggest
--json`` (``PlanResult.to_dict``), the closest tries when nothing fits, or the refusal's one line,
with the warnings given; one canonical JSON line per request, gzipped.

``tests/integration/test_golden.py`` holds the planner to the stored file: a restructure must keep every
answer byte-identical, and a change of the model or the ranking changes the file only on purpose.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import gzip
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STORED = Path(__file__).resolve().parent.parent / "tests" / "data" / "golden_suggest.jsonl.gz"

MODELS = (
    "gpt2", "bert-base-uncased", "t5-large", "Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.2-1B", "microsoft/phi-2",
    "meta-llama/Llama-2-7b-hf", "meta-llama/Llama-3.1-8B", "google/gemma-2-9b", "mistralai/Mixtral-8x7B-v0.1",
    "Qwen/Qwen2.5-32B", "meta-llama/Llama-2-70b-hf",
)
#: rtx4090: the catalog knows no standard machine (offload plans ask for --cpu-mem); cpu: given
#: its device and host memory, so the answers do not depend on the machine they are computed on
GPUS = ("t4", "a10g", "l4", "v100-32gb", "a100-80gb", "h100-80gb", "rtx4090", "cpu")
BATCHES = (1, 12, 32, 128)
#: the search spaces, as the request fields that make them
SPACES: dict[str, dict[str, Any]] = {
    "default": {},
    "every-precision": {"every_precision": True},
    "no-offload": {"allow_offload": False},
    "speed": {"prefer": "speed"},
    "full-only": {"method": "full", "top_k": 3},
    "lora-recipe": {"method": "lora", "lora_dropout": 0.1, "fused_ce": True, "packing": False},
    "qlora-recipe": {"method": "qlora", "loop": "manual", "use_cache": True, "seq_len": 1024, "top_k": 8},
    "short-seq": {"seq_len": 512},
    "bf16-mixed": {"precision": "bf16-mixed"},
}
#: the requests the planner must refuse or finds nothing for, each a point of its own
EDGE_REQUESTS: tuple[dict[str, Any], ...] = (
    {"model": "gpt2", "gpu": "a10g", "target_batch": 7, "gpus": 2},
    {"model": "gpt2", "gpu": "a10g", "target_batch": 8, "seq_len": 4096},
    {"model": "gpt2", "gpu": "a10g", "target_batch": 0},
    {"model": "gpt2", "gpu": "a10g", "target_batch": 8, "gpus": 17},
    {"model": "gpt2", "gpu": "t4", "target_batch": 8, "precision": "bf16-mixed"},
    {"model": "gpt2", "gpu": "a10g", "target_batch": 8, "method": "full", "lora_dropout": 0.1},
    {"model": "bert-base-uncased", "gpu": "a10g", "target_batch": 8, "fused_ce": True},
    {"model": "gpt2", "gpu": "a10g", "target_batch": 8, "method": "nope"},
    {"model": "gpt2", "gpu": "a10g", "target_batch": 8, "prefer": "cost"},
    {"model": "gpt2", "gpu": "a10g", "target_batch": 8, "loop": "bogus"},
    {"model": "gpt2", "gpu": "a10g", "target_batch": 8, "top_k": 0},
    {"model": "gpt2", "gpu": "a10g", "target_batch": 1 << 21},
    {"model": "meta-llama/Llama-2-70b-hf", "gpu": "t4", "target_batch": 32},
    {"model": "meta-llama/Llama-2-70b-hf", "gpu": "a10g", "target_batch": 32, "allow_offload": False, "gpus": 4},
    {"model": "Qwen/Qwen2.5-32B", "gpu": "a100-80gb", "target_batch": 32, "method": "full", "allow_offload": False},
    {"model": "meta-llama/Llama-3.1-8B", "gpu": "a10g", "target_batch": 1, "seq_len": 16384},
    {"model": "meta-llama/Llama-3.1-8B", "gpu": "a10g", "target_batch": 1, "seq_len": 16384, "fused_ce": True,
     "method": "qlora"},
    {"model": "meta-llama/Llama-3.1-8B", "gpu": "a100-80gb", "target_batch": 128, "gpus": 8},
    {"model": "meta-llama/Llama-3.1-8B", "gpu": "a100-80gb", "target_batch": 32},
    {"model": "meta-llama/Llama-3.2-1B", "gpu": "t4", "target_batch": 128},
    {"model": "Qwen/Qwen2.5-0.5B", "gpu": "a10g", "target_batch": 32, "prefer": "speed"},
    {"model": "meta-llama/Llama-3.2-3B", "gpu": "l4", "target_batch": 128, "prefer": "speed"},
    {"model": "meta-llama/Llama-2-7b-hf", "gpu": "t4", "target_batch": 32, "method": "lora"},
    {"model": "Qwen/Qwen2.5-32B", "gpu": "a100-80gb", "target_batch": 32},
    {"model": "gpt2", "gpu": "a10g", "target_batch": 32, "cpu_mem_bytes": 8 << 30, "gpu_mem_bytes": 2 << 30},
)


def _base(model: str, gpu: str) -> dict[str, Any]:
    if gpu == "cpu":
        return {"model": model, "gpu": gpu, "gpu_mem_bytes": 8 << 30, "cpu_mem_bytes": 16 << 30}
    return {"model": model, "gpu": gpu}


def requests() -> Iterator[dict[str, Any]]:
    """Every request of the dump, in a fixed order: the grid (each model on each GPU in each
    space, the batch and GPU count rotating so that every pair of them is met), the multi-GPU
    node requests, then the edge requests."""
    n = 0
    for model in MODELS:
        for gpu in GPUS:
            for space, fields in SPACES.items():
                batch = BATCHES[n % len(BATCHES)]
                gpus = 2 if (n // len(BATCHES)) % 3 == 2 and gpu != "cpu" else 1
                n += 1
                if batch % gpus:
                    batch *= gpus
                yield {**_base(model, gpu), "target_batch": batch, "gpus": gpus, "space": space, **fields}
    for model in MODELS[3:]:
        for gpu in ("a100-80gb", "h100-80gb", "a10g"):
            for space in ("default", "speed"):
                yield {"model": model, "gpu": gpu, "target_batch": 64, "gpus": 8 if gpu != "a10g" else 4,
                       "space": space, **SPACES[space]}
    for edge in EDGE_REQUESTS:
        yield {"space": "edge", **edge}


#: the CPU the dump's ``cpu`` answers are planned on: the ``cpu`` profile follows the machine's CPU
#: (``planner.gpus.bf16_matmul_fp32_buffer``: an AMX CPU's bf16 matmul holds an fp32 buffer), and the
#: dump must not, so it is pinned to the AMX Xeon's flags that the CPU bench ran on
GOLDEN_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_bf16"})


@contextlib.contextmanager
def _golden_cpu() -> Iterator[None]:
    import planner.gpus

    real = planner.gpus.cpu_flags
    planner.gpus.cpu_flags = lambda: GOLDEN_CPU_FLAGS
    try:
        yield
    finally:
        planner.gpus.cpu_flags = real


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """The planner's answer to one request of the dump, as a JSON-able dict."""
    from planner.errors import NothingFitsError, PlannerError
    from planner.planning import SuggestRequest, make_plan

    fields = {k: v for k, v in request.items() if k not in ("space", "every_precision")}
    with _golden_cpu(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if request.get("every_precision"):
                planned = _every_precision(fields)
            else:
                planned = make_plan(SuggestRequest(**fields))
            out: dict[str, Any] = {"outcome": "planned", "result": planned.result.to_dict(),
                                   "host_bytes": planned.host_bytes, "host_source": planned.host_source}
        except NothingFitsError as exc:
            out = {"outcome": "nothing-fits", "error": str(exc),
                   "result": exc.result.to_dict() if exc.result is not None else None}
        except PlannerError as exc:
            out = {"outcome": "refused", "error": f"{type(exc).__name__}: {exc}"}
    out["warnings"] = [str(w.message) for w in caught]
    return {"request": request, **out}


def _every_precision(fields: dict[str, Any]):
    """``make_plan``'s search over every precision the GPU runs (``SearchSpace(precisions=
    tuple(Precision))``, as ``bench/cli_speed.py`` searches it), which no request field asks for:
    the fp16 twins of bf16 plans and the other 16-bit type."""
    from planner import planning
    from planner.catalog import fingerprint
    from planner.config import Precision
    from planner.estimation import default_seq_len, resolve
    from planner.host import node_host_ram
    from planner.ranking import suggest
    from planner.search import SearchSpace

    request = planning.SuggestRequest(**fields)
    spec, device = resolve(model=request.model, gpu=request.gpu, gpu_mem_bytes=request.gpu_mem_bytes)
    host, source = node_host_ram(cpu_mem_bytes=request.cpu_mem_bytes, local_node=request.local_node,
                                 gpus=request.gpus, device=device)
    space = SearchSpace(precisions=tuple(Precision), cpu_mem_bytes=host, host_ram_source=source)
    result = suggest(model=spec, gpu=device, target_batch=request.target_batch, seq_len=default_seq_len(spec),
                     gpus=request.gpus, space=space, model_fingerprint=fingerprint(spec))
    return planning.Planned(result=result, spec=spec, device=device, host_bytes=host, host_source=source,
                            seq_defaulted=True)


def lines(*, shard: int = 0, shards: int = 1) -> Iterator[str]:
    """The dump's lines in request order; ``shard``/``shards``: only every ``shards``-th request
    from the ``shard``-th (``sharded_lines`` runs the shards in processes side by side)."""
    for n, request in enumerate(requests()):
        if n % shards == shard:
            yield json.dumps({"n": n, **answer(request)}, sort_keys=True, separators=(",", ":"))


def sharded_lines(processes: int) -> list[str]:
    """``lines()``, computed by ``processes`` fresh interpreters (``--shard K/N``) at once: the same
    answers in the same order (each line carries its request's index ``n``), in about 1/N of the
    time on N cores. Fresh processes, not forks: the caller may hold threads (torch, Ray)."""
    import subprocess
    import tempfile

    if processes <= 1:
        return list(lines())
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"shard{k}.jsonl.gz" for k in range(processes)]
        procs = [subprocess.Popen([sys.executable, __file__, "--out", str(out), "--shard", f"{k}/{processes}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for k, out in enumerate(outs)]
        failed = [(k, p.stderr.read().decode()[-2000:]) for k, p in enumerate(procs) if p.wait() != 0]
        if failed:
            raise RuntimeError(f"golden shard {failed[0][0]} failed:\n{failed[0][1]}")
        merged = [line for out in outs for line in read_stored(out)]
    return sorted(merged, key=lambda line: json.loads(line)["n"])


def read_stored(path: Path = STORED) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def write(path: Path, current: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = ("\n".join(current) + "\n").encode()
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(data)


def differences(stored: list[str], current: list[str], *, show: int = 3) -> list[str]:
    """A readable account of where two dumps differ: the count, then the first ``show`` requests'
    answers as a unified diff of their indented JSON."""
    if stored == current:
        return []
    report = [f"{len(stored)} stored answers, {len(current)} now"] if len(stored) != len(current) else []
    differing = [i for i, (a, b) in enumerate(zip(stored, current)) if a != b]
    report.append(f"{len(differing)} of {min(len(stored), len(current))} answers differ")
    for i in differing[:show]:
        a = json.dumps(json.loads(stored[i]), indent=1, sort_keys=True).splitlines()
        b = json.dumps(json.loads(current[i]), indent=1, sort_keys=True).splitlines()
        report.append(f"--- request {i}: {json.dumps(json.loads(current[i])['request'], sort_keys=True)}")
        report += list(difflib.unified_diff(a, b, "stored", "now", n=2, lineterm=""))[:80]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true", help="compare with the stored dump")
    group.add_argument("--write", action="store_true", help="write the stored dump anew")
    group.add_argument("--out", type=Path, help="write the current answers to this file (gzipped JSON lines)")
    parser.add_argument("--shard", default="0/1", metavar="K/N",
                        help="only every N-th request from the K-th (with --out; sharded_lines merges them)")
    parser.add_argument("--processes", type=int, default=1, help="compute the dump in this many processes at once")
    args = parser.parse_args(argv)
    shard, _, shards = args.shard.partition("/")
    if (int(shard), int(shards)) != (0, 1) and args.out is None:
        parser.error("--shard K/N writes part of the dump: use it with --out (sharded_lines merges the parts)")
    if (int(shard), int(shards)) != (0, 1):
        current = list(lines(shard=int(shard), shards=int(shards)))
    else:
        current = sharded_lines(args.processes)
    if args.check:
        report = differences(read_stored(), current)
        print("\n".join(report) if report else f"identical: {len(current)} answers")
        return 1 if report else 0
    write(STORED if args.write else args.out, current)
    outcomes: dict[str, int] = {}
    for line in current:
        outcome = json.loads(line)["outcome"]
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"wrote {len(current)} answers ({', '.join(f'{k} {v}' for k, v in sorted(outcomes.items()))}) to "
          f"{STORED if args.write else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
