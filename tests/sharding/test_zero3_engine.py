"""ZeRO-3 as DeepSpeed 0.19.8 builds and steps it, and a user's own ds_config's buckets
(planner/sharding/zero.py: zero_buckets, step_checks, build_sequence, gradient_flatten_tensors,
lazy_states, fused_step; planner/memory/timeline.py draws them; planner/memory/allocator.py keeps a
side stream's pool apart). Every number is derived by hand in the comment above its assert.

The model is gpjt's Qwen1.5-0.5B (bench/model_configs/Qwen1.5-0.5B/config.json): 463,987,712
parameters P, hidden 1024, a tied 151,936 x 1024 embedding (155,582,464 elements, the largest
tensor), full fine-tuning in DeepSpeed's fp16 mode on one GPU: the rank's partition is all P.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.config import TrainConfig
from planner.estimation import build_config, resolve
from planner.memory.allocator import AllocatorConfig, replay
from planner.memory.parameters import trained
from planner.memory.states import static_terms
from planner.memory.step import static_sizes
from planner.memory.timeline import Event, step_timeline
from planner.sharding import SCHEMES, Sharding
from planner.sharding.zero import DS_DEFAULTS, zero_buckets

CONFIG = Path(__file__).resolve().parents[2] / "bench" / "model_configs" / "Qwen1.5-0.5B" / "config.json"
P = 463_987_712
EMBEDDING = 151_936 * 1024
MiB = 2**20


def _config(sharding: Sharding | None = None, **options):
    spec, gpu = resolve(model=str(CONFIG), gpu="rtx3090")
    options.setdefault("method", "full")
    options.setdefault("precision", "fp16-mixed")
    config = build_config(spec, gpu, seq_len=512, optimizer="adamw", micro_batch=1,
                          **({"sharding": sharding} if sharding is not None else {"zero": 3}), **options)
    return spec, gpu, config


def test_a_ds_config_that_leaves_the_buckets_out_gets_deepspeeds_defaults():
    # deepspeed 0.19.8 runtime/zero/config.py: reduce_bucket_size pp_int(5e8), allgather 5e8,
    # prefetch 5e7, persistence 1e5, max live / reuse 1e9
    assert zero_buckets(Sharding("zero3", "none", {}), 1024) == {
        "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
        "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9}
    # "auto" is the HF Trainer's fill: reduce bucket hidden^2 = 1024^2 = 1,048,576, persistence
    # 10 x hidden = 10,240; a number is taken as written
    mine = zero_buckets(Sharding("zero3", "none", {"reduce_bucket_size": "auto",
                                                   "stage3_param_persistence_threshold": "auto",
                                                   "stage3_max_live_parameters": 12345}), 1024)
    assert (mine["reduce_bucket_size"], mine["stage3_param_persistence_threshold"]) == (1_048_576, 10_240)
    assert mine["stage3_max_live_parameters"] == 12345 and mine["allgather_bucket_size"] == DS_DEFAULTS["allgather_bucket_size"]
    # the planner's own file (no buffers): hidden^2 as emit writes it
    assert zero_buckets(Sharding("zero3"), 1024)["reduce_bucket_size"] == 1_048_576


def test_the_reduce_bucket_is_the_files_size():
    # DeepSpeed's default: 5e8 fp16 elements = 1,000,000,000 B (953.7 MiB); the planner's file:
    # 1024^2 x 2 = 2,097,152 B
    spec, gpu, theirs = _config(Sharding("zero3", "none", {}))
    _, _, ours = _config()
    assert static_terms(spec, theirs, gpu.kernels).resident["zero/reduce_bucket"] == 1_000_000_000
    assert static_terms(spec, ours, gpu.kernels).resident["zero/reduce_bucket"] == 2_097_152


def test_a_users_buffers_survive_the_payload():
    _, _, config = _config(Sharding("zero3", "none", {"torch_adam": 0}))
    payload = config.to_dict()
    assert payload["buffers"] == {"torch_adam": 0}
    assert TrainConfig.from_dict(payload).sharding is config.sharding
    # the planner's own plans keep their payloads: no buffers entry
    assert "buffers" not in _config()[2].to_dict()


def test_the_step_checks_and_the_flatten():
    spec, gpu, config = _config(Sharding("zero3", "none", {}))
    static = static_terms(spec, config, gpu.kernels)
    # fp16: torch.isinf over the 16-bit gradient partition, one byte per element: P bytes (on the
    # reduce stream, drawn by the timeline only); the norm: the largest gradient (the tied
    # embedding) in float64: 8 x 155,582,464 = 1,244,659,712
    assert config.sharding.spec.stream_checks(trained(spec, config), config) == (("zero3/overflow_check", P),)
    assert static.step_checks == (("zero3/norm_copy", 8 * EMBEDDING),)
    assert 8 * EMBEDDING == 1_244_659_712
    # flatten of the 16-bit partition (2P) beside its fp32 copy (4P): 6P = 2,783,926,272 B, the
    # largest of the three, so the moment's size
    assert static.zero_gradient_flatten == 6 * P == 2_783_926_272
    assert static_sizes(static, accumulating=False).gradient_flatten == 6 * P
    assert config.sharding.spec.gradient_flatten_tensors(trained(spec, config), config) == (2 * P, 4 * P)
    # bf16 runs no overflow check (stage3.py l.2815: fp16 only), and its static terms are fp16's
    _, _, bf16 = _config(Sharding("zero3", "none", {}), precision="bf16-mixed")
    assert bf16.sharding.spec.stream_checks(trained(spec, bf16), bf16) == ()
    assert static_terms(spec, bf16, gpu.kernels) == static


def test_fused_adam_has_no_step_temporaries_where_the_users_file_builds_it():
    spec, gpu, fused = _config(Sharding("zero3", "none", {"torch_adam": 0}))
    _, _, ours = _config()
    # FusedAdam: none; the planner's file asks for torch's AdamW (foreach on CUDA): one fp32 copy
    # of the partition, 4P = 1,855,950,848 B
    assert static_terms(spec, fused, gpu.kernels).optimizer_step == 0
    assert static_terms(spec, ours, gpu.kernels).optimizer_step == 4 * P == 1_855_950_848


def test_the_engine_builds_the_states_in_deepspeeds_order_and_the_first_step_makes_adams():
    spec, gpu, config = _config(Sharding("zero3", "none", {"torch_adam": 0}))  # FusedAdam: no step temporary
    timeline = step_timeline(model=spec, config=config, kernels=gpu.kernels)
    built = [(e.op, e.key, e.nbytes, e.tensors) for e in timeline.events[:8]]
    # the flat fp16 partition (2P, one tensor), the fp32 cast (4P) beside its clone, the master (4P),
    # the init gradient buffer (4P), the 5e8-element bucket (1e9 B), the 16-bit gradient partition (2P)
    assert built == [("alloc", "weights", 2 * P, 1), ("alloc", "zero3/master_cast", 4 * P, 1),
                     ("alloc", "master_weights", 4 * P, 1), ("free", "zero3/master_cast", 4 * P, 1),
                     ("alloc", "zero3/init_gradient_buffer", 4 * P, 1), ("free", "zero3/init_gradient_buffer", 4 * P, 1),
                     ("alloc", "zero/reduce_bucket", 10**9, 1), ("alloc", "zero3/grad_partitions", 2 * P, 1)]
    first = [(e.op, e.key, e.nbytes) for e in timeline.events[:timeline.start] if e.where == "step 1: optimizer step"]
    # the overflow check, the norm copy, the flatten, then the fp32 gradient (4P) and Adam's two
    # flat states (8P + the 4-byte step) made inside the first step()
    assert first == [("alloc", "zero3/overflow_check", P), ("free", "zero3/overflow_check", P),
                     ("alloc", "zero3/norm_copy", 8 * EMBEDDING), ("free", "zero3/norm_copy", 8 * EMBEDDING),
                     ("alloc", "zero/gradient_flatten", 6 * P), ("free", "zero/gradient_flatten", 6 * P),
                     ("alloc", "gradients", 4 * P), ("alloc", "optimizer_states", 8 * P + 4)]
    # the step the moments read: optimizer_start marked at the flatten, the largest (6P over the
    # resident 2P + 2P + 1e9 + 4P + 8P + 4 = 16P + 1e9 + 4)
    curve = timeline.curve()
    assert curve[timeline.marks["optimizer_start"]] == 16 * P + 10**9 + 4 + 6 * P


def test_a_side_streams_blocks_are_not_reused_by_the_default_stream():
    # 100 MiB made and freed on the reduce stream, then 100 MiB on the default stream: one
    # segment each (200 MiB reserved) when the streams are apart, one reused segment otherwise
    events = [Event("alloc", "zero3/overflow_check", 100 * MiB, 1, 1, "step"),
              Event("free", "zero3/overflow_check", 100 * MiB, 1, 1, "step"),
              Event("alloc", "gradients", 100 * MiB, 1, 2, "step")]
    apart = replay(events, capacity=2**34, config=AllocatorConfig(), streams=SCHEMES["zero3"].streams(None))
    shared = replay(events, capacity=2**34, config=AllocatorConfig())
    assert (apart.peak_reserved, shared.peak_reserved) == (200 * MiB, 100 * MiB)
    assert apart.allocated_peak == shared.allocated_peak == 100 * MiB


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params"])
def test_offloaded_zero3_keeps_the_old_build(offload):
    # the partitions live on the host: no device cast, no init buffer, no device step checks
    spec, _, config = _config(Sharding("zero3", offload, {}))
    t = trained(spec, config)
    assert config.sharding.spec.build_sequence(spec, config, t, {}) == ()
    assert config.sharding.spec.step_checks(spec, t, config) == ()


def test_planner_check_reads_a_users_buckets_with_deepspeeds_defaults(tmp_path):
    """tests/data/check/hf: LoRA r16 on Qwen-0.5B-sized q/k/v/o, ZeRO-2 with optimizer offload, bf16.
    Its ds_config leaves reduce_bucket_size out: DeepSpeed's 5e8 elements x 2 B = 1,000,000,000 B
    on the device, where the planner's own file ("auto": hidden^2 elements) holds hidden^2 x 2."""
    import json
    import shutil

    from planner.check import check

    hf = Path(__file__).resolve().parents[1] / "data" / "check" / "hf"
    for name in ("training_args.json", "adapter_config.json"):
        shutil.copy(hf / name, tmp_path / name)
    ds = json.loads((hf / "ds_config.json").read_text())
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    left_out = check([tmp_path / "training_args.json"], gpu="a10g", seq_len=1024)
    assert left_out.config.sharding.buffers == ()
    assert left_out.estimate["memory"]["breakdown"]["zero/reduce_bucket"] == 10**9
    ds["zero_optimization"]["reduce_bucket_size"] = "auto"  # the Trainer fills hidden^2: the planner's own plan
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    auto = check([tmp_path / "training_args.json"], gpu="a10g", seq_len=1024)
    assert auto.config.sharding.buffers is None
    hidden = auto.estimate["memory"]["breakdown"]["zero/reduce_bucket"] // 2
    assert hidden == int(hidden**0.5) ** 2  # hidden^2 elements of 2 bytes


def test_zero3_in_fp32_steps_its_partition_without_a_master_copy():
    # fp32: the flat partition is fp32 already, the master aliases it (stage3.py l.1163-1168):
    # weights 4P, no master_weights; in fp16 the master is its own 4P beside the 2P partition
    spec, gpu, fp32 = _config(Sharding("zero3", "none", {}), precision="fp32")
    resident = static_terms(spec, fp32, gpu.kernels).resident
    assert resident["weights"] == 4 * P and "master_weights" not in resident
    _, _, fp16 = _config(Sharding("zero3", "none", {}))
    assert static_terms(spec, fp16, gpu.kernels).resident["master_weights"] == 4 * P
    # nor a cast at build: the flat partition, the init gradient buffer, the bucket (5e8 x 4 B), the gradients
    timeline = step_timeline(model=spec, config=fp32, kernels=gpu.kernels)
    assert [(e.op, e.key, e.nbytes) for e in timeline.events[:5]] == [
        ("alloc", "weights", 4 * P), ("alloc", "zero3/init_gradient_buffer", 4 * P),
        ("free", "zero3/init_gradient_buffer", 4 * P), ("alloc", "zero/reduce_bucket", 2 * 10**9),
        ("alloc", "zero3/grad_partitions", 4 * P)]
