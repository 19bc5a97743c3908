"""Per-sequence peak of a LoRA training step under FSDP1 (2 CPU ranks over gloo) against one process.

fms-acceleration's 2-GPU FSDP1 rows with LoRA/QLoRA adapters grow more per sequence than the same
method on one GPU (bench/published_rows.json, term ``fsdp1_adapter_gap``). This runs the setting
on the CPU, arm by arm, and prints each arm's peak at micro-batch 1 and 2 and the slope:

* ``single``: the model alone (no FSDP), one process;
* ``fsdp1``: ``FullyShardedDataParallel`` FULL_SHARD over 2 gloo ranks with peft's
  ``fsdp_auto_wrap_policy`` (each ``lora_A``/``lora_B`` its own unit), ``use_orig_params`` as
  accelerate launch sets it (its ``--fsdp_use_orig_params`` default "true": accelerate v1.0.1
  commands/launch.py l.564-566, utils/launch.py l.282) or False, MixedPrecision optional.

The model is Mistral-shaped from its config (random weights) in bf16, peft LoRA r 16 on q, k, v, o
(fp32 adapters: peft's ``autocast_adapter_dtype``), HF gradient checkpointing (reentrant, as
transformers 4.45's ``gradient_checkpointing_enable`` defaults), the peak counted by the project's
CPU probe (workers/probes.py ``CpuProbe``, live storage bytes through the dispatcher).

    python bench/fsdp1_adapters.py [--seq 512] [--dropout 0.0] [--orig 1] [--mp none|bf16] [--trace]
    python bench/fsdp1_adapters.py --rows   # the published FSDP1 adapter rows with the retained gradients

``--rows`` prints, for each max_memory_allocated row of bench/published_rows.json that ran FSDP1 with
adapters under transformers 4's reentrant checkpoint, the planner's prediction and the prediction with
the estimate without and with ``reentrant_ckpt`` (FSDP1's retained layer-input gradients,
planner.sharding.fsdp1.retained_input_gradients, at the first layer's backward).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _model(args: argparse.Namespace) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=args.vocab,
                           max_position_embeddings=args.seq, head_dim=args.hidden // 4)
    config._attn_implementation = "sdpa"
    model = MistralForCausalLM(config).to(torch.bfloat16)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=args.dropout,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if args.ckpt:
        model.base_model.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": bool(args.reentrant)})
        model.base_model.model.enable_input_require_grads()
    model.train()
    return model


def _wrap(model: Any, args: argparse.Namespace) -> Any:
    import torch
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

    mp = None
    if args.mp != "none":
        dtype = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[args.mp])
        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    return FullyShardedDataParallel(model, auto_wrap_policy=fsdp_auto_wrap_policy(model),
                                    sharding_strategy=ShardingStrategy.FULL_SHARD, limit_all_gathers=True,
                                    use_orig_params=bool(args.orig), device_id=torch.device("cpu"),
                                    mixed_precision=mp)


def _measure(engine: Any, args: argparse.Namespace, batch: int, rank: int) -> dict[str, Any]:
    import torch

    from workers.probes import CpuProbe

    optimizer = torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    ids = torch.randint(0, args.vocab, (batch, args.seq), generator=torch.Generator().manual_seed(rank))
    probe = CpuProbe(allocator=False, trace=args.trace)
    probe.start()
    out: dict[str, Any] = {}
    try:
        for step in range(2):
            if step == 1:
                probe.reset_peak()
            probe.phase = "forward"
            # accelerate's native_amp wraps the model's forward in autocast (accelerator.py v1.0.1 l.1413-1424)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.autocast)):
                loss = engine(input_ids=ids, labels=ids).loss
            probe.phase = "backward"
            loss.backward()
            probe.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
    finally:
        probe.stop()
    out.update(peak=probe.peak_dispatch_bytes, phase=probe.peak_dispatch_phase)
    if args.trace:
        out["storages"] = [(n, c, cat, by) for n, c, cat, by in probe.peak_storages()[:25]]
    return out


def _run(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for batch in args.batches:
        model = _model(args)
        engine = _wrap(model, args) if world > 1 else model
        results[batch] = _measure(engine, args, batch, rank)
        del engine, model
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def rows() -> list[dict[str, Any]]:
    """The FSDP1 adapter rows of bench/published_rows.json: measured, predicted, and predicted with
    the retained layer-input gradients at the first layer's backward."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import published

    from planner.memory import estimate_memory
    from planner.memory.dtypes import mode_of
    from planner.sharding.fsdp1 import retained_input_gradients

    out = []
    for row in published.load()["rows"]:
        s = row["settings"]
        if (s.get("sharding") != "fsdp1" or row["metric"] != "max_memory_allocated"
                or s.get("method") not in ("lora", "qlora")):
            continue
        try:
            spec, gpu, config, _ = published.map_row(row)
        except published.Unscorable:
            continue  # the Mixtral rows: not scored by bench/published.py either
        # the rows state transformers 4's reentrant checkpoint (reentrant_ckpt), which the estimate now
        # plans: without it is the model before the term, with it the estimate as bench/published.py scores it
        without = config.replace(reentrant_ckpt=False)
        predicted = estimate_memory(model=spec, config=without, gpu=gpu).peak_allocated_bytes
        retained = retained_input_gradients(spec, without, reentrant_around_unit=s.get("transformers_major") == 4,
                                            residual_bytes=mode_of(without).residual)
        measured = published.measured_bytes(row)
        with_term = estimate_memory(model=spec, config=without.replace(reentrant_ckpt=True), gpu=gpu).peak_allocated_bytes
        out.append({"id": row["id"], "measured": measured, "predicted": predicted, "retained": retained,
                    "with_term": with_term, "error": (predicted - measured) / measured,
                    "error_with_term": (with_term - measured) / measured})
    return out


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    if argv is None and "--rows" in sys.argv[1:] or argv is not None and "--rows" in argv:
        gib = 2**30
        print("| row | measured GiB | predicted GiB | error | retained GiB | with it GiB | error |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in rows():
            print(f"| {r['id']} | {r['measured'] / gib:.2f} | {r['predicted'] / gib:.2f} | {r['error']:+.1%} | "
                  f"{r['retained'] / gib:.2f} | {r['with_term'] / gib:.2f} | {r['error_with_term']:+.1%} |")
        return 0

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=("single", "fsdp1"), default="fsdp1")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--orig", type=int, default=1)
    parser.add_argument("--mp", choices=("none", "bf16", "fp32"), default="none")
    parser.add_argument("--autocast", type=int, default=0)
    parser.add_argument("--ckpt", type=int, default=1)
    parser.add_argument("--reentrant", type=int, default=1)
    parser.add_argument("--batches", type=lambda text: tuple(int(b) for b in text.split(",")), default=(1, 2),
                        help="two micro-batches, e.g. 2,4 (both peaking at the forward's end)")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--port", type=int, default=29731)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = 2 if args.arm == "fsdp1" else 1
    procs = [ctx.Process(target=_run, args=(r, world, args.port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    import queue as queue_module

    try:
        results = queue.get(timeout=1800)
    except queue_module.Empty:  # a rank failed (its traceback is on stderr): stop the other
        for p in procs:
            p.terminate()
        raise SystemExit("no result from rank 0")
    for p in procs:
        p.join()
    mib, (low, high) = 2**20, args.batches
    slope = (results[high]["peak"] - results[low]["peak"]) / mib / (high - low)
    print(json.dumps({"args": vars(args), "peak_b1_mib": results[low]["peak"] / mib, "peak_b2_mib": results[high]["peak"] / mib,
                      "phase": [results[low]["phase"], results[high]["phase"]], "slope_mib_per_seq": round(slope, 3)}))
    if args.trace:
        for b in args.batches:
            print(f"-- batch {b} at the peak:")
            for n, c, cat, by in results[b]["storages"]:
                print(f"   {n / mib:9.3f} MiB x{c:<4d} {cat:12s} {by[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
