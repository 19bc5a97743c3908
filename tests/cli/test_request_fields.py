"""The request's fields are declared once (``planner.request``): every ``TrainConfig`` field is
declared with how the search's memo keys hold it, the keys tell apart every two configurations the
memory model predicts apart, and the surfaces' options and fields are the declaration's."""

from __future__ import annotations

import dataclasses

import pytest

from planner import request
from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.request import (
    BATCH,
    DERIVED,
    ESTIMATE,
    FIELDS,
    FIXED,
    OPTION,
    RECIPE,
    REQUIRED,
    SEARCH,
    SPLIT,
    STATIC,
)
from planner.search import _batch_key, _static_key

#: Another value of each field the memo keys must hold, given to one of the bases below; a
#: ``TrainConfig`` field read by the memory terms and declared ``STATIC``, ``BATCH`` or ``DERIVED``
#: needs one here (``test_every_keyed_field_has_an_alternative``).
ALTERNATIVES: dict[str, list] = {
    "method": ["qlora"],
    "precision": ["fp32", "bf16", "fp16-mixed"],
    "optimizer": ["sgd", "adamw_8bit", "adafactor"],
    "seq_len": [256],
    "gpus": [2],
    "grad_ckpt": [True],
    "attention": ["eager"],
    "lora_r": [8],
    "lora_targets": [("c_attn",)],
    "sharding": ["zero1", "zero2", "zero3"],
    "lora_dropout": [0.1],
    "loop": ["manual"],
    "fused_ce": [True],
    "packing": [False],
    "use_cache": [True],
    "optimizer_in_bwd": [True],
    "loss_chunks": [8],
    "loss_upcast": [False],
    "loss_shift": [True],
    "loss_returns_head": [True],
    "reentrant_ckpt": [True],
    "experts_loop": [True],
    "rope_caches": [True],
    "kbit_upcast": [False],
    "eval_batch": [4],
    "eval_seq_len": [128],
    "generate_tokens": [16],
}
#: the configurations each field is varied from: LoRA (every adapter and recipe field), full
#: fine-tuning on two GPUs (the sharding's terms) and on one (torchtune's optimizer_in_bwd),
#: LoRA with an eval pass (the eval settings other than the eval batch need one) and QLoRA (its
#: k-bit preparation's upcast), and LoRA under transformers 4's loss (the head's logits returned needs it)
BASES = (dict(method="lora", precision="bf16-mixed", micro_batch=2, seq_len=512),
         dict(method="lora", precision="bf16-mixed", micro_batch=2, seq_len=512, loss_shift=True),
         dict(method="full", precision="bf16-mixed", micro_batch=2, seq_len=512, gpus=2),
         {"method": "full", "precision": "bf16-mixed", "micro_batch": 2, "seq_len": 512},
         dict(method="lora", precision="bf16-mixed", micro_batch=2, seq_len=512, eval_batch=8),
         dict(method="qlora", precision="bf16-mixed", micro_batch=2, seq_len=512))


def test_every_trainconfig_field_is_declared_with_its_memo_key():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    declared = {name for name, f in FIELDS.items() if OPTION not in f.memo}
    assert fields == declared, "declare each TrainConfig field in planner/request.py with how the memo keys hold it"
    for name, f in FIELDS.items():
        if OPTION in f.memo:
            assert name not in fields and len(f.memo) == 1


def test_every_keyed_field_has_an_alternative():
    keyed = {name for name, f in FIELDS.items() if set(f.memo) & {STATIC, BATCH, DERIVED}}
    assert keyed == set(ALTERNATIVES)
    for name in keyed - {"precision", "sharding"}:
        assert FIELDS[name].terms, f"say which memory terms read {name} (RequestField.terms)"


def test_the_declared_defaults_are_trainconfigs():
    config = TrainConfig()
    for name, f in FIELDS.items():
        if OPTION not in f.memo and f.estimate and f.default is not None:
            assert getattr(config, name) == f.default, name


def _variants():
    for base in BASES:
        for name, values in ALTERNATIVES.items():
            for value in values:
                eval_id = "-eval" if "eval_batch" in base else ""
                yield pytest.param(base, name, value, id=f"{base['method']}{eval_id}-{name}={value}")


@pytest.mark.parametrize(("base", "name", "value"), list(_variants()))
def test_configurations_predicted_apart_have_apart_memo_keys(base, name, value):
    """Two configurations that differ in one declared field: when the memory model predicts them
    apart, the search's memo keys (static or per-batch) tell them apart too; a field the terms read
    but the keys left out would share one memo entry and give one of them the other's answer."""
    model, gpu = resolve_model("gpt2"), get_gpu("a100-80gb")
    try:
        a = TrainConfig(**base)
        b = TrainConfig(**{**base, name: value})
    except Exception:  # a combination TrainConfig refuses (fused CE with full fine-tuning, ...)
        pytest.skip(f"{name}={value!r} is refused with {base}")
    ea, eb = estimate_memory(model=model, config=a, gpu=gpu), estimate_memory(model=model, config=b, gpu=gpu)
    predicted_apart = (ea.process_total_bytes, dict(ea.breakdown), ea.cpu_bytes) != \
        (eb.process_total_bytes, dict(eb.breakdown), eb.cpu_bytes)
    if predicted_apart:
        assert (_static_key(a), _batch_key(a)) != (_static_key(b), _batch_key(b)), \
            f"{name} changes the prediction but not the memo keys: declare it STATIC or BATCH in planner/request.py"


def test_the_memo_keys_hold_the_declared_fields():
    assert request.memo_fields(STATIC)[-2:] == ("lora_r", "lora_targets")
    assert request.memo_fields(BATCH)[-3:] == ("lora_r", "lora_targets", "grad_ckpt")
    for name in request.memo_fields(BATCH):
        assert BATCH in FIELDS[name].memo
    # a field the search does not vary is not one of its knobs (a recipe setting no memory term reads is
    # FIXED and held by the space as given, for every candidate: the RoPE scaling)
    from planner.search import SearchSpace

    space = {f.name for f in dataclasses.fields(SearchSpace)}
    assert not {name for name, f in FIELDS.items() if (FIXED in f.memo and not f.recipe) or SPLIT in f.memo} & space
    assert {name for name, f in FIELDS.items() if FIXED in f.memo and f.recipe} <= space


def _click_params(command: str):
    import typer

    from planner.cli import get_app
    from planner.cli._click import click_module

    group = typer.main.get_command(get_app(command))
    ctx = click_module().Context(group)
    return {p.name: p for p in group.get_command(ctx, command).params}


_ASKED = (*SEARCH.values(), *RECIPE)


@pytest.mark.parametrize(("command", "fields"), [("estimate", ESTIMATE), ("measure", ESTIMATE), ("suggest", _ASKED),
                                                 ("submit", _ASKED)])
def test_the_cli_options_are_the_declarations(command, fields):
    from planner.request import help_text

    params = _click_params(command)
    for f in fields:
        param = params[f.name]
        flags = f.flag.split("/")
        assert param.opts == [flags[0], *([f.short] if f.short else [])], f.name
        assert list(param.secondary_opts) == flags[1:], f.name
        if f.default is REQUIRED:
            assert param.required, f.name
        else:
            assert param.default == f.default, f.name
        assert param.help == help_text(f), f.name


def test_the_api_bodies_are_the_declarations():
    from pydantic import ValidationError

    from planner.service.schemas import EstimateBody, PlanBody

    for body, fields in ((PlanBody, _ASKED), (EstimateBody, ESTIMATE)):
        for f in fields:
            info = body.model_fields[f.name]
            assert info.is_required() if f.default is REQUIRED else info.default == f.default, f.name
            assert info.description == request.help_text(f), f.name
            lengths = [m.max_length for m in info.metadata if hasattr(m, "max_length")]
            assert lengths == ([f.max_length] if f.max_length else []), f.name
            # strict: a value of another plain type is refused (a number is not a flag, text not a number)
            wrong = {bool: 1, int: "1", float: "0.1", str: 1}[f.type]
            with pytest.raises(ValidationError):
                body(**{"model": "gpt2", "gpu": "a10g", **({"target_batch": 8} if body is PlanBody else {}),
                        f.name: wrong})
    assert set(EstimateBody.model_fields) >= set(request.CONFIG_OPTIONS) - {"gpus"}


def test_suggest_request_and_search_space_take_the_recipe():
    from planner.planning import SuggestRequest
    from planner.search import SearchSpace

    for cls in (SuggestRequest, SearchSpace):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for f in RECIPE:
            assert fields[f.name].default == f.default, (cls, f.name)
    from planner.estimation import CONFIG_OPTIONS

    assert CONFIG_OPTIONS == request.CONFIG_OPTIONS


#: The most source files (outside the tests) that may name a request field: its entry
#: (planner/request.py), its ``TrainConfig`` field (planner/config.py), and the few that must spell
#: it (the memory term that reads it, emit's settings, train.py's template, a worker module named
#: after it). Every other reader goes through the entry's declarations (its library keys, the
#: adapter's recipe settings, the advice's value) or a fact the core derives from it once.
MAX_FILES_PER_FIELD = 5
#: An optimizer's name: its descriptor module, and at most one other.
MAX_FILES_PER_OPTIMIZER = 2


def _source_files_naming(name: str) -> list[str]:
    """The .py files of planner/, workers/ and oom_planner/ naming ``name`` as a whole word (as
    ``grep -rlw`` finds it)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])")
    return sorted(path.relative_to(root).as_posix() for top in ("planner", "workers", "oom_planner")
                  if (root / top).is_dir() for path in (root / top).rglob("*.py") if word.search(path.read_text()))


@pytest.mark.parametrize("name", ["use_cache", "fused_ce", "lora_dropout", "optimizer_in_bwd", "loss_chunks"])
def test_a_request_field_is_named_in_at_most_five_source_files(name):
    files = _source_files_naming(name)
    assert "planner/request.py" in files and "planner/config.py" in files, files  # the search is not blind
    assert len(files) <= MAX_FILES_PER_FIELD, f"{name} is named in {len(files)} source files: {files}"


def test_an_optimizer_name_is_named_in_at_most_two_source_files():
    files = _source_files_naming("adafactor")
    assert "planner/optim/adafactor.py" in files
    assert len(files) <= MAX_FILES_PER_OPTIMIZER, files


def test_the_help_lists_every_registered_optimizer_and_scheme():
    """A new optimizer or sharding scheme is its module alone: the help reads the registries."""
    from planner.optim import OPTIMIZERS
    from planner.request import help_text
    from planner.sharding import SPECS

    optim, sharding = help_text(request.FIELDS["optimizer"]), help_text(request.FIELDS["sharding"])
    assert optim.split("|") == [str(name) for name in OPTIMIZERS]
    assert sharding.split(":")[0].split("|") == [spec.name for spec in SPECS]
    assert "fsdp1" in sharding and "lion_8bit" in optim and "{names}" not in optim + sharding
