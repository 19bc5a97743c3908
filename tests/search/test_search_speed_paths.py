"""The search's cheap paths give what the full ones give, over the search's whole space.

* ``TrainConfig.with_split`` / ``with_lora`` copy a validated configuration and check only what
  they change: every copy the search makes must equal (field by field, types included) the
  configuration ``TrainConfig(...)`` builds and validates in full from the same fields, and every
  combination the search leaves out must be one ``TrainConfig(...)`` refuses.
* ``TrainConfig.__init__`` is written by hand (one dict for every field, not one
  ``object.__setattr__`` per field): its signature must stay the dataclass's fields and defaults.
* ``ThroughputMemo`` computes ``step_breakdown`` with its shared terms memoised: the same floats
  for every configuration of the space, in any order.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest

from planner.catalog import resolve_model
from planner.config import ALL_LINEAR, Loop, Method, Offload, TrainConfig
from planner.errors import InvalidConfigError, PlannerError
from planner.gpus import get_gpu
from planner.search import SearchSpace, _combinations, _precisions, attention_targets, divisors
from planner.sharding import NONE as NONE_SHARDING
from planner.sharding import Sharding, search_axis
from planner.throughput import ThroughputMemo, step_breakdown

GiB = 1024**3

#: (model, gpu, target batch, seq_len, gpus, recipe settings of the space)
SPACES = [
    ("meta-llama/Llama-2-7b-hf", "a10g", 32, 4096, 1, {}),  # the bench request
    ("meta-llama/Llama-2-7b-hf", "t4", 16, 2048, 2, {}),  # fp16 precisions (no bf16)
    ("mistralai/Mistral-7B-v0.1", "a100-80gb", 64, 2048, 8, {"lora_dropout": 0.1, "loop": Loop.MANUAL}),
    ("Qwen/Qwen2.5-1.5B", "cpu", 12, 512, 1, {"packing": False, "use_cache": True}),
    ("gpt2", "h100", 48, 1024, 4, {"fused_ce": True}),  # full fine-tuning refused, ZeRO-3 refused
    ("t5-large", "a10g", 8, 512, 2, {}),  # encoder-decoder
    ("mistralai/Mixtral-8x7B-v0.1", "h100", 16, 4096, 8, {}),  # experts
]
IDS = [f"{m.split('/')[-1]}-{g}-x{n}" for m, g, _, _, n, _ in SPACES]


def _typed(config: TrainConfig) -> dict:
    """Every field with its type: ``==`` alone takes ``Method.FULL`` for ``"full"`` (StrEnum)."""
    return {f.name: (type(getattr(config, f.name)), getattr(config, f.name)) for f in dataclasses.fields(config)}


def _rebuilt(config: TrainConfig, **changes) -> TrainConfig:
    """``config``'s fields (with ``changes``) through the full, validating constructor."""
    return TrainConfig(**({f.name: getattr(config, f.name) for f in dataclasses.fields(config)} | changes))


def _space(n: int):
    model_id, gpu_name, batch, seq, gpus, recipe = SPACES[n]
    model, gpu = resolve_model(model_id), get_gpu(gpu_name)
    space = SearchSpace(cpu_mem_bytes=256 * GiB, **recipe)
    return model, gpu, dict(target_batch=batch, seq_len=seq, gpus=gpus, space=space)


def _every_construction(model, gpu, *, target_batch, seq_len, gpus, space):
    """The search's whole space built the slow way: one ``TrainConfig(...)`` per knob setting and
    split, None where it refuses."""
    per_device = target_batch // gpus
    attn = attention_targets(model)
    variants = [(r, t) for r in space.lora_ranks for t in ((ALL_LINEAR,), attn) if t]
    # every scheme and offload the sharding registry has (the cpu profile has no offload: the host is
    # the device), each as the scheme's name and the offload, not the search's interned values
    shardings = [(str(s.scheme), str(s.offload)) for s in search_axis(allow_offload=not gpu.is_cpu, gpus=gpus)]
    out = {}
    for method in space.methods:
        for precision, (r, targets), optimizer, (scheme, offload), ckpt, micro in itertools.product(
            _precisions(gpu, space), [(None, None)] if method is Method.FULL else variants, space.optimizers,
            shardings, (False, True), divisors(per_device),
        ):
            # keyed by the sharding the configuration holds (no sharding on several GPUs is DDP)
            try:
                config = TrainConfig(method=method, precision=precision, optimizer=optimizer, micro_batch=micro,
                                     seq_len=seq_len, grad_accum=per_device // micro, gpus=gpus, grad_ckpt=ckpt,
                                     lora_r=r, lora_targets=targets, sharding=Sharding(scheme, offload),
                                     **space.recipe(method))
            except PlannerError:
                config = None
            held = config.sharding if config is not None else Sharding(scheme, offload)
            out[(method, precision, r, targets, optimizer, held, ckpt, micro)] = config
    return out


@pytest.mark.parametrize("n", range(len(SPACES)), ids=IDS)
def test_the_search_copies_equal_full_constructions(n):
    """Each combination the search makes (``with_lora`` per adapter variant, ``with_split`` for
    checkpointing) and each of its splits (``with_split``) is the configuration the validating
    constructor builds from the same knobs, and the search makes exactly the valid ones."""
    model, gpu, request = _space(n)
    expected = _every_construction(model, gpu, **request)
    made = {}
    for base, splits in _combinations(model=model, gpu=gpu, **request):
        assert _typed(base) == _typed(_rebuilt(base))
        for micro, accum in splits:
            copy = base.with_split(micro_batch=micro, grad_accum=accum)
            key = (copy.method, copy.precision, copy.lora_r, copy.lora_targets, copy.optimizer, copy.sharding,
                   copy.grad_ckpt, micro)
            assert key not in made
            made[key] = copy
            assert expected[key] is not None, copy.label()
            assert _typed(copy) == _typed(expected[key]) and hash(copy) == hash(expected[key])
    assert set(made) == {key for key, config in expected.items() if config is not None}


@pytest.mark.parametrize("n", range(len(SPACES)), ids=IDS)
def test_throughput_memo_equals_step_breakdown(n):
    """The memo's breakdown and sum are ``step_breakdown``'s floats for every configuration of the
    space, asked in the search's order and again in reverse (the memo filled by others)."""
    model, gpu, request = _space(n)
    configs = [base.with_split(micro_batch=micro, grad_accum=accum)
               for base, splits in _combinations(model=model, gpu=gpu, **request) for micro, accum in splits]
    memo = ThroughputMemo(model, gpu)
    for config in configs + configs[::-1]:
        expected = step_breakdown(model=model, config=config, gpu=gpu)
        assert memo.breakdown(config) == expected, config.label()
        assert memo.step_seconds(config) == sum(expected.values()), config.label()


@pytest.mark.parametrize("n", range(len(SPACES)), ids=IDS)
def test_configurations_of_one_knob_class_take_one_step_time(n):
    """``ThroughputMemo.knob_class`` (the screen times a plan once per class, adapter variant,
    checkpointing, split and paging: ``planner.search._timed``): configurations of the space equal
    but for their optimizer and sharding whose classes are equal take the same step seconds, with
    paged states on the host too; and on one GPU the classes do share (the test is not vacuous)."""
    model, gpu, request = _space(n)
    memo = ThroughputMemo(model, gpu)
    seen: dict[tuple, float] = {}
    shared = 0
    for base, splits in _combinations(model=model, gpu=gpu, **request):
        knob_class = memo.knob_class(base)
        if knob_class is None:
            assert gpu.is_cpu
            return
        for micro, accum in splits:
            config = base.with_split(micro_batch=micro, grad_accum=accum)
            rest = dataclasses.replace(config, optimizer=TrainConfig.optimizer, sharding=NONE_SHARDING)
            for paged in (0, 3 * GiB):
                key = (rest, knob_class, paged)
                step = memo.step_seconds(config, paged)
                if key in seen:
                    shared += 1
                    assert seen[key] == step, config.label()
                seen.setdefault(key, step)
    assert shared or request["gpus"] > 1  # (on several GPUs a class is its optimizer and sharding)


def test_throughput_memo_with_a_given_utilization():
    model, gpu = resolve_model("meta-llama/Llama-2-7b-hf"), get_gpu("a10g")
    memo = ThroughputMemo(model, gpu, utilization=0.3)
    for config in (TrainConfig(method="lora", micro_batch=4, seq_len=1024, grad_accum=8),
                   TrainConfig(method="full", precision="fp32", zero=3, gpus=4, offload="optimizer+params", grad_ckpt=True),
                   TrainConfig(method="qlora", precision="bf16", optimizer="adamw_8bit", grad_accum=2, grad_ckpt=True)):
        assert memo.breakdown(config) == step_breakdown(model=model, config=config, gpu=gpu, utilization=0.3)
    with pytest.raises(InvalidConfigError, match="utilization must be a fraction"):
        ThroughputMemo(model, gpu, utilization=1.5).step_seconds(TrainConfig())


def test_init_signature_is_the_dataclass_fields():
    """The hand-written ``__init__`` takes every field, keyword-only, with the field's default,
    then the old spelling of ``sharding`` (``zero``, ``offload``: not fields, None when not given)."""
    parameters = list(inspect.signature(TrainConfig).parameters.values())
    assert [(p.name, p.kind, p.default) for p in parameters] == [
        (f.name, inspect.Parameter.KEYWORD_ONLY, f.default) for f in dataclasses.fields(TrainConfig)] + [
        ("zero", inspect.Parameter.KEYWORD_ONLY, None), ("offload", inspect.Parameter.KEYWORD_ONLY, None)]
    with pytest.raises(TypeError):
        TrainConfig(mehtod="lora")  # noqa - a misspelt field
    with pytest.raises(TypeError):
        TrainConfig("lora")  # keyword-only


def test_constructions_from_spellings_hold_the_members():
    """Strings are coerced to the enums, ints to floats, names to tuples, as before."""
    config = TrainConfig(method="qlora", precision="fp16-mixed", optimizer="adamw", attention="eager", zero=2,
                         offload="optimizer", loop="manual", lora_dropout=0, lora_targets="q_proj, v_proj",
                         alloc_conf="expandable_segments:True")
    enum_like = TrainConfig(method=Method.QLORA, precision="fp16-mixed", optimizer="adamw", attention="eager", zero=2,
                            offload=Offload.OPTIMIZER, loop=Loop.MANUAL, lora_dropout=0.0,
                            lora_targets=("q_proj", "v_proj"), alloc_conf="expandable_segments:True")
    assert _typed(config) == _typed(enum_like)
    assert type(config.lora_dropout) is float and config.lora_r == 16
    assert dataclasses.replace(config, micro_batch=2) == config.with_split(micro_batch=2, grad_accum=1)


BAD_SPLITS = [0, -1, True, 1.5, "4", None, (1 << 20) + 1]


@pytest.mark.parametrize("bad", BAD_SPLITS, ids=repr)
@pytest.mark.parametrize("field", ["micro_batch", "grad_accum"])
def test_with_split_refuses_what_the_constructor_refuses(field, bad):
    base = TrainConfig(method="lora", micro_batch=4, grad_accum=2)
    with pytest.raises(InvalidConfigError) as full:
        TrainConfig(method="lora", **{"micro_batch": 4, "grad_accum": 2, field: bad})
    with pytest.raises(InvalidConfigError) as copy:
        base.with_split(**{"micro_batch": 4, "grad_accum": 2, field: bad})
    assert str(copy.value) == str(full.value)


@pytest.mark.parametrize("lora_r, lora_targets", [
    (0, None), (True, None), (2.0, None), ((1 << 16) + 1, None), (8, ()), (8, ""), (8, ("all-linear", "q_proj")),
])
def test_with_lora_refuses_what_the_constructor_refuses(lora_r, lora_targets):
    base = TrainConfig(method="qlora")
    with pytest.raises(InvalidConfigError) as full:
        TrainConfig(method="qlora", lora_r=lora_r, lora_targets=lora_targets)
    with pytest.raises(InvalidConfigError) as copy:
        base.with_lora(lora_r=lora_r, lora_targets=lora_targets)
    assert str(copy.value) == str(full.value)


def test_with_lora_defaults_and_spellings_as_the_constructor():
    base = TrainConfig(method="lora", lora_r=8, lora_targets=("q_proj",))
    for r, targets in [(None, None), (32, "q_proj,k_proj"), (4, ["v_proj"]), (64, (ALL_LINEAR,))]:
        assert _typed(base.with_lora(lora_r=r, lora_targets=targets)) == _typed(
            TrainConfig(method="lora", lora_r=r, lora_targets=targets))
