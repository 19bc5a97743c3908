"""torch's own FSDP2 memory tracker on the multi-rank rows of ``bench/accuracy.py``: the third column
beside the planner's prediction and c10's allocator.

Each rank is a fresh process joined to the others over gloo (the rendezvous ``workers.ranks`` gives
its ranks), builds the row's model as the measurement worker does (``workers.train``: the same
model, adapters, checkpointing, ``fully_shard`` units and optimizer, the same batches), and trains
under ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``: the warm-up steps in one
``with`` block, the last step in a second one (the tracker's peak starts again from what is live
when a block is entered: mem_tracker.py ``MemTracker.__enter__``), so its peak is the last step's,
like the allocator's. The tracker follows FSDP2 modules only (``FSDPMemTracker.__init__`` refuses
anything else): the ZeRO rows have no third column.

    python bench/fsdp2_tracker.py [--filter TEXT]

writes ``results/accuracy-cpu-tracker.json`` (per row: each rank's tracker peak and its breakdown),
which ``bench/accuracy.py`` shows beside the rows it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
TRACKER_FILE = RESULTS / "accuracy-cpu-tracker.json"


def _rank_main() -> int:
    """One rank: the job on stdin, its tracker peak written to the job's result path."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from planner.config import TrainConfig
    from planner.emit.deepspeed import ADAM_BETAS, ADAM_EPS, LEARNING_RATE, WEIGHT_DECAY
    from workers.train import _apply_training_setup, _batch, _build_model, _build_optimizer

    job = json.loads(sys.stdin.read())
    config, model_config = TrainConfig.from_dict(job["config"]), job["model_config"]
    scheme = config.sharding.spec
    torch.manual_seed(job["seed"])
    scheme.worker_init("cpu")
    model = _build_model(model_config=model_config, config=config, checkpoint_dir=None)
    model = _apply_training_setup(model, model_config=model_config, config=config)
    model.config.use_cache = config.use_cache
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    setup = scheme.worker_setup(
        model, params, config, device="cpu", build_optimizer=lambda ps: _build_optimizer(config, ps),
        hidden_size=model.config.hidden_size,
        hyperparameters={"lr": LEARNING_RATE, "betas": ADAM_BETAS, "eps": ADAM_EPS, "weight_decay": WEIGHT_DECAY})
    del params  # the pre-shard parameters (as workers.train drops them)
    engine, optimizer = setup.engine, setup.optimizer
    gen = torch.Generator().manual_seed(job["seed"])
    vocab = int(model_config["vocab_size"])
    batches = [_batch(config, vocab=vocab, gen=gen, device=torch.device("cpu")) for _ in range(config.grad_accum)]

    def one_step() -> None:
        for batch in batches:
            loss = engine(**batch, use_cache=config.use_cache).loss / config.grad_accum
            loss.backward()
            del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    tracker = FSDPMemTracker(engine, optimizer)
    tracker.track_inputs(tuple(t for batch in batches for t in batch.values()))
    with tracker:
        for _ in range(job["steps"] - 1):
            one_step()
            tracker.reset_mod_stats()  # it refuses a module's second forward otherwise
    with tracker:  # the peak starts again from what is live now: the last step's
        one_step()
    peak = tracker.get_tracker_snapshot("peak")
    snap = next(v for k, v in peak.items() if torch.device(k).type == "cpu")
    Path(job["result_path"]).write_text(json.dumps({"peak": snap["Total"], "breakdown": snap}))
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def track(arch: str, config: Any, model_config: dict[str, Any], *, steps: int = 3, timeout_s: float = 900) -> list[dict]:
    """Each rank's tracker peak for one row, in rank order."""
    from planner.sharding.spec import free_port

    world, port = config.gpus, free_port()
    with tempfile.TemporaryDirectory(prefix="fsdp2-tracker-") as tmp:
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
            job = {"config": config.to_dict(), "model_config": model_config, "steps": steps, "seed": 0,
                   "result_path": os.path.join(tmp, f"rank-{rank}.json")}
            log = open(os.path.join(tmp, f"rank-{rank}.log"), "wb")
            proc = subprocess.Popen([sys.executable, __file__, "--rank"], stdin=subprocess.PIPE, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
            procs.append((proc, log))
        out = []
        for rank, (proc, log) in enumerate(procs):
            try:
                proc.wait(timeout=timeout_s)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                log.close()
            path = Path(tmp, f"rank-{rank}.json")
            if proc.returncode == 0 and path.exists():
                out.append(json.loads(path.read_text()) | {"rank": rank})
            else:
                tail = Path(tmp, f"rank-{rank}.log").read_text(errors="replace")[-1500:]
                out.append({"rank": rank, "peak": None, "error": f"exit {proc.returncode}: {tail}"})
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--filter", dest="text", default=None, help="only rows whose label contains TEXT")
    args = parser.parse_args(argv)
    if args.rank:
        return _rank_main()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import accuracy

    rows = json.loads(TRACKER_FILE.read_text()) if TRACKER_FILE.exists() else []
    for arch, config in accuracy._cases(quick=False, text=args.text):
        if config.gpus == 1 or config.sharding.scheme != "fsdp2":
            continue
        ranks = track(arch, config, accuracy.ARCHS[arch])
        row = {"arch": arch, "config": config.label(), "config_dict": config.to_dict(), "ranks": ranks}
        rows = [r for r in rows if (r["arch"], r["config"]) != (arch, row["config"])] + [row]
        print(f"{arch} {row['config']}: " + ", ".join(f"rank {r['rank']} {r['peak']}" for r in ranks), flush=True)
        TRACKER_FILE.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if "--rank" in sys.argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
