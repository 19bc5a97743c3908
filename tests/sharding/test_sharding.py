"""The sharding registry (planner/sharding): the values, the old spelling (--zero/--offload) and
the payload codec, the search axis, and each scheme's checks as ``TrainConfig`` gives them."""

from __future__ import annotations

import dataclasses
import itertools
import pickle

import pytest

from planner.config import CONFIG_VERSION, TrainConfig
from planner.errors import InvalidConfigError, UnsupportedError
from planner.sharding import NONE, SCHEMES, Offload, Scheme, Sharding, for_gpus, from_zero, search_axis
from planner.sharding.spec import ShardingSpec


def test_registry_names_each_scheme_once_in_order():
    assert [str(s) for s in Scheme] == ["none", "ddp", "zero1", "zero2", "zero3", "fsdp2", "fsdp1"]
    assert all(isinstance(SCHEMES[s], ShardingSpec) for s in Scheme)
    assert [SCHEMES[s].zero_stage for s in Scheme] == [0, 0, 1, 2, 3, None, None]


def test_values_are_interned_immutable_and_pickle_to_themselves():
    a = Sharding("zero2", "optimizer")
    assert a is Sharding(Scheme.ZERO2, Offload.OPTIMIZER) is from_zero(2, "optimizer")
    assert pickle.loads(pickle.dumps(a)) is a
    with pytest.raises(AttributeError):
        a.offload = Offload.NONE
    assert repr(a) == "Sharding('zero2', 'optimizer')" and a.offloaded and not NONE.offloaded


def test_unknown_names_are_refused_in_one_line():
    with pytest.raises(InvalidConfigError, match=r"--sharding must be one of none\|ddp\|zero1\|zero2\|zero3\|fsdp2\|fsdp1, got 'fsdp9'"):
        Sharding("fsdp9")
    with pytest.raises(InvalidConfigError, match="--offload must be one of none|optimizer|optimizer\\+params"):
        Sharding("zero3", "disk")
    for bad in (4, -1, True, "2", None):
        with pytest.raises(InvalidConfigError, match="--zero must be 0, 1, 2 or 3"):
            from_zero(bad)


def test_replicas_are_ddp_on_more_than_one_gpu():
    assert for_gpus(NONE, 1) is NONE and for_gpus(NONE, 8) is Sharding("ddp")
    assert for_gpus(Sharding("ddp"), 1) is NONE and for_gpus(Sharding("zero3"), 1) is Sharding("zero3")
    config = TrainConfig(gpus=4)
    assert config.sharding is Sharding("ddp") and config.zero == 0
    # a copy with another GPU count is the other one (dataclasses.replace goes through __init__)
    assert config.replace(gpus=1).sharding is NONE
    assert TrainConfig(sharding="ddp").sharding is NONE


def test_the_search_axis_on_one_gpu_is_the_old_zero_offload_list_and_fsdp2_offloaded():
    old = [(0, "none"), (1, "none"), (2, "none"), (3, "none")]
    assert [(s.zero, str(s.offload)) for s in search_axis(allow_offload=False, gpus=1)] == old
    assert [(s.zero, str(s.offload)) for s in search_axis(allow_offload=True, gpus=1)] == old + [
        (1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "optimizer+params"), (None, "optimizer+params")]


def test_on_several_gpus_the_axis_adds_fsdp2_after_zero():
    axis = [(str(s.scheme), str(s.offload)) for s in search_axis(allow_offload=True, gpus=4)]
    assert axis == [("none", "none"), ("zero1", "none"), ("zero2", "none"), ("zero3", "none"), ("fsdp2", "none"),
                    ("zero1", "optimizer"), ("zero2", "optimizer"), ("zero3", "optimizer"),
                    ("zero3", "optimizer+params"), ("fsdp2", "optimizer+params")]
    # one GPU: FSDP2 only with its CPU offload
    assert ("fsdp2", "none") not in [(str(s.scheme), str(s.offload)) for s in search_axis(allow_offload=True, gpus=1)]


def test_the_schemes_breakdown_keys_are_declared_once():
    from planner.sharding import BREAKDOWN_KEYS

    assert BREAKDOWN_KEYS["zero3/gathered_params"].size == "gathered"
    assert SCHEMES[Scheme("zero3")].step_key("gathered") == "zero3/gathered_params"
    assert SCHEMES[Scheme("fsdp2")].step_key("held") == "fsdp2/root_and_gather_buffer"
    # a scheme without the part names it generically (its bytes are 0)
    assert SCHEMES[Scheme("none")].step_key("gathered") == "sharding/gathered"
    assert BREAKDOWN_KEYS["ddp/buckets"].tensor_bytes == 25 * 1024**2


def test_zero_and_offload_make_the_sharding():
    config = TrainConfig(zero=3, offload="optimizer+params", gpus=2)
    assert config.sharding is Sharding("zero3", "optimizer+params")
    assert TrainConfig(sharding="zero3", offload="optimizer", gpus=2).sharding is Sharding("zero3", "optimizer")
    assert TrainConfig(sharding=Sharding("zero1", "optimizer")).sharding is Sharding("zero1", "optimizer")
    # replace with the old spelling changes what it names and keeps the rest
    assert config.replace(offload="optimizer").sharding is Sharding("zero3", "optimizer")
    assert config.replace(zero=2, offload="none").sharding is Sharding("zero2")
    assert dataclasses.replace(config, sharding=NONE).sharding is Sharding("ddp")


@pytest.mark.parametrize("changes, error, message", [
    ({"zero": 0, "offload": "optimizer"}, InvalidConfigError, "--offload optimizer is a DeepSpeed ZeRO feature: add --zero 1, 2 or 3"),
    ({"zero": 2, "offload": "optimizer+params"}, InvalidConfigError, "--offload optimizer+params needs --zero 3"),
    ({"zero": 1, "precision": "bf16"}, UnsupportedError, "--precision bf16 with --zero 1: DeepSpeed always keeps fp32"),
    ({"zero": 2, "offload": "optimizer", "optimizer": "adamw_8bit"}, UnsupportedError,
     "--offload with --optimizer adamw_8bit: DeepSpeed offloads only its CPU Adam"),
    ({"zero": 2, "optimizer": "paged_adamw_8bit"}, UnsupportedError, "paging and ZeRO partitioning do not combine"),
    ({"zero": 3, "method": "qlora"}, UnsupportedError, "--method qlora with --zero 3 is not modelled"),
    ({"zero": 3, "method": "lora", "fused_ce": True}, UnsupportedError, "--fused-ce with --zero 3"),
])
def test_each_scheme_refuses_what_it_does_not_take(changes, error, message):
    with pytest.raises(error, match=message.replace("+", "\\+")):
        TrainConfig(**changes)


def test_a_refusal_is_what_check_raises_and_taken_knobs_leaves_out():
    """``ShardingSpec.refusal`` (the search's question, asked without raising) is None exactly where
    ``check`` passes, and makes the error ``check`` raises, type and words; ``taken_knobs`` gives
    ``with_knobs``' copy, or None where the scheme refuses it. Over every scheme, offload, method,
    precision and optimizer, on one GPU and on two (the default space's base fields pass the
    checks before the scheme's)."""
    from planner.config import Method, Precision
    from planner.errors import PlannerError
    from planner.optim import OPTIMIZERS

    refused = 0
    for gpus, method, precision in itertools.product((1, 2), Method, (p for p in Precision if p.value != "fp8")):
        base = TrainConfig(method=method, precision=precision, gpus=gpus)
        for optimizer, scheme, offload in itertools.product(OPTIMIZERS, Scheme, Offload):
            sharding = Sharding(scheme, offload)
            try:
                expected, error = base.with_knobs(optimizer=optimizer, sharding=sharding), None
            except PlannerError as exc:
                expected, error = None, exc
            assert base.taken_knobs(optimizer=optimizer, sharding=sharding) == expected
            copy = base._knobs_copy(optimizer, sharding)
            refusal = copy.sharding.spec.refusal(copy, copy.sharding.offload)
            if error is None:
                assert refusal is None
            else:
                refused += 1
                assert type(refusal()) is type(error) and str(refusal()) == str(error)
    assert refused > 100  # (the refusals are many: the test would pass vacuously without)


def test_labels_and_words_as_before():
    c = TrainConfig(zero=3, offload="optimizer", gpus=2)
    assert c.label().endswith("x2gpu, zero3+offload:optimizer")
    assert c.sharding.short() == "zero3+optimizer" and c.sharding.words() == "zero 3, offload optimizer"
    assert TrainConfig(gpus=2).sharding.label() == "" and TrainConfig().sharding.words(offload_none=False) == "zero 0"
    assert c.sharding.spec.plan_line(c.offload) == "DeepSpeed: ZeRO-3, optimizer states offloaded to CPU RAM"
    assert NONE.spec.plan_line(Offload.NONE) == "DeepSpeed: not used"


def test_payloads_of_every_version_decode():
    config = TrainConfig(method="lora", zero=2, offload="optimizer", gpus=2)
    payload = config.to_dict()
    # a ZeRO stage names it: written in version 2's shape (zero, offload), as stored plans have it
    assert payload["version"] == 2 < CONFIG_VERSION == 3
    assert (payload["zero"], payload["offload"]) == (2, "optimizer") and "sharding" not in payload
    assert TrainConfig.from_dict(payload) == config
    # version 1 (no version key, no alloc_conf) and version 2 without the recipe knobs
    v1 = {k: v for k, v in payload.items() if k not in ("version", "alloc_conf", "lora_dropout", "loop")}
    assert TrainConfig.from_dict(v1) == config
    # version 3 names the scheme; its offload beside it
    v3 = {k: v for k, v in payload.items() if k != "zero"} | {"version": 3, "sharding": "zero2"}
    assert TrainConfig.from_dict(v3) == config
    # a payload without any sharding key is plain (DDP on its GPUs)
    bare = {k: v for k, v in payload.items() if k not in ("zero", "offload")}
    assert TrainConfig.from_dict(bare).sharding is Sharding("ddp")
    assert Sharding("zero2", "optimizer").payload() == {"zero": 2, "offload": "optimizer"}


def test_a_scheme_no_stage_names_writes_version_3(monkeypatch):
    """The shape FSDP2 will write: the scheme's name instead of a stage (a scheme without a stage
    is made here from ZeRO-2's descriptor, for the codec alone)."""
    spec = dataclasses.replace(SCHEMES[Scheme.ZERO2], zero_stage=None)
    config = TrainConfig(zero=2, gpus=2)
    object.__setattr__(config.sharding, "spec", spec)  # the interned value, restored below
    try:
        payload = config.to_dict()
        assert payload["version"] == 3 and payload["sharding"] == "zero2" and "zero" not in payload
        assert config.sharding.words() == "sharding zero2, offload none"
    finally:
        object.__setattr__(config.sharding, "spec", SCHEMES[Scheme.ZERO2])
    assert TrainConfig.from_dict(payload).sharding is Sharding("zero2")


def test_only_the_sharding_package_reads_the_zero_stage():
    """One home: outside ``planner/sharding`` and ``config.py`` no planner or worker module reads a
    configuration's ``zero``/``offload`` (the old spelling ``TrainConfig`` keeps for the CLI, the API
    and the stored payloads) or compares ZeRO stages; they ask the ``Sharding`` value and its
    descriptor."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(r"\b\w+\.(zero|offload)\b(?!\.)|\bzero\s*(==|!=|>|<)")
    found = []
    for top in ("planner", "workers"):
        for path in (root / top).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if rel.startswith("planner/sharding/") or rel == "planner/config.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if pattern.search(code) and "sharding.offload" not in code and "sharding.zero" not in code:
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_user_buffer_sets_compare_by_value_and_the_kept_table_is_bounded():
    """A service reading many users' ds_configs (``POST /v1/check``) must not grow the values'
    table without bound: the planner's own values stay interned (identity), a user's buffer sets
    compare by value and only the latest ``_BUFFERED_KEPT`` are kept for reuse."""
    from planner import sharding as module

    first = Sharding("zero3", "none", {"reduce_bucket_size": 1})
    assert first is Sharding("zero3", "none", {"reduce_bucket_size": 1})  # reused while kept
    for n in range(2, module._BUFFERED_KEPT + 50):
        Sharding("zero3", "none", {"reduce_bucket_size": n})
    assert len(module._Buffered._kept) == module._BUFFERED_KEPT
    again = Sharding("zero3", "none", {"reduce_bucket_size": 1})
    assert again is not first and again == first and hash(again) == hash(first)
    assert again != Sharding("zero3", "none", {"reduce_bucket_size": 2}) and again != Sharding("zero3")
    assert Sharding("zero3") != again  # the reflected comparison, from an interned value
    # a buffered value made again without its buffers is the interned one
    assert type(again)(again.scheme, again.offload) is Sharding("zero3") and again.with_offload("none") == first
    assert pickle.loads(pickle.dumps(first)) == first
    config = TrainConfig(sharding=again)
    assert config.sharding is again and config == TrainConfig(sharding=first)
