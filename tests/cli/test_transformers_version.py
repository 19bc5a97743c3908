"""--transformers VERSION: the knobs a release sets (planner/transformers_versions.py), at the table's
boundaries, applied once the model is resolved, with the knobs given explicitly winning over the version's."""

from __future__ import annotations

import json

import pytest

from planner.errors import InvalidConfigError, UnsupportedError
from planner.transformers_versions import KNOBS, knobs_for


def _on(version: str, model_type: str = "llama", *, is_moe: bool = False, **more) -> set[str]:
    return {name for name, value in knobs_for(version, model_type, is_moe=is_moe, **more).items() if value}


@pytest.mark.parametrize(("version", "shift", "head"), [
    ("4.36.0", True, False), ("4.45.2", True, False), ("4.46.0", True, True), ("4.48.1", True, True),
    ("4.49.0", False, False), ("4.57.1", False, False), ("5.0", False, False)])
def test_the_loss_by_version(version, shift, head):
    on = _on(version, "gpt2")
    assert ("loss_shift" in on, "loss_returns_head" in on) == (shift, head)


def test_the_loss_is_a_causal_lms_only():
    assert not {"loss_shift", "loss_returns_head"} & _on("4.45.2", "bert", causal_lm=False)
    assert not {"loss_shift", "loss_returns_head"} & _on("4.46.0", "t5", causal_lm=False, encoder_decoder=True)


def test_the_reentrant_checkpoint_is_every_4x():
    assert "reentrant_ckpt" in _on("4.36.0") and "reentrant_ckpt" in _on("4.57.1")
    assert "reentrant_ckpt" in _on("4.45.2", "bert", causal_lm=False)
    assert "reentrant_ckpt" not in _on("5.0")
    # not modelled for an encoder-decoder (request.check_for_model refuses it): left off
    assert "reentrant_ckpt" not in _on("4.45.2", "t5", causal_lm=False, encoder_decoder=True)


@pytest.mark.parametrize(("version", "listed"), [("4.36.2", True), ("4.39.3", True), ("4.40.0", False),
                                                 ("4.40.2", False), ("4.48.1", False)])
def test_mixtrals_loop_and_its_list_index(version, listed):
    on = _on(version, "mixtral", is_moe=True)
    assert "experts_loop" in on
    assert ("experts_list_index" in on) == listed
    assert not {"experts_loop", "experts_list_index"} & _on(version, "mistral")


@pytest.mark.parametrize(("model_type", "last", "first_without"), [
    ("llama", "4.40.2", "4.41.0"), ("mistral", "4.41.2", "4.42.0"), ("qwen2", "4.44.2", "4.45.0"),
    ("mixtral", "4.47.1", "4.48.0")])
def test_the_rotary_tables_by_family(model_type, last, first_without):
    moe = model_type == "mixtral"
    assert "rope_caches" in _on(last, model_type, is_moe=moe)
    assert "rope_caches" not in _on(first_without, model_type, is_moe=moe)
    assert "rope_caches" not in _on("5.0", model_type, is_moe=moe)


def test_other_families_keep_no_rotary_tables():
    assert "rope_caches" not in _on("4.36.0", "gpt2")
    assert "rope_caches" not in _on("4.36.0", "qwen3")


def test_transformers_5_sets_nothing():
    for version in ("5.0", "5.0.0", "5.24.1", "6.1"):
        assert knobs_for(version, "mixtral", is_moe=True) == dict.fromkeys(KNOBS, False)


def test_another_moe_on_4x_is_refused_in_one_line():
    with pytest.raises(UnsupportedError, match="Mixtral only.*--transformers 5") as caught:
        knobs_for("4.51.0", "qwen3_moe", is_moe=True, model_id="Qwen/Qwen3-30B-A3B")
    assert "\n" not in str(caught.value)
    assert knobs_for("5.0", "qwen3_moe", is_moe=True) == dict.fromkeys(KNOBS, False)
    # the user said the experts' layout (--no-experts-loop): the rest of 4.x's knobs, the fused experts
    assert _on("4.51.0", "qwen3_moe", is_moe=True, experts_stated=True) == {"reentrant_ckpt"}


def test_no_experts_loop_plans_another_moe_on_4x(cli):
    args = ("estimate", "-m", "Qwen/Qwen3-30B-A3B", "--gpu", "a100-80gb", "--method", "qlora", "--json")
    refused = cli(*args, "--transformers", "4.51.0")
    assert refused.code == 2 and refused.err.strip().count("\n") == 0 and "Mixtral only" in refused.err, refused
    fused = cli(*args, "--transformers", "4.51.0", "--no-experts-loop")
    assert fused.code in (0, 3), fused  # an estimate (3: it does not fit the device)
    config = json.loads(fused.out)["config"]
    assert config.get("reentrant_ckpt") and not config.get("experts_loop")


@pytest.mark.parametrize("bad", ["4.x", "", "four", "4", "4.35.2", "3.5.0", "4..1"])
def test_a_bad_or_old_version_is_one_line(bad):
    with pytest.raises(InvalidConfigError) as caught:
        knobs_for(bad, "llama", is_moe=False)
    assert "\n" not in str(caught.value) and "--transformers" in str(caught.value)


def test_release_spellings():
    assert _on("4.48.0.dev0") == _on("4.48.0") and _on("v4.39.3") == _on("4.39.3") and _on("4.46") == _on("4.46.0")


# ---- applied to a request (planner.estimation.versioned) ----------------------------------------------------
def test_a_knob_stated_wins_over_the_version():
    from planner.catalog import resolve_model
    from planner.estimation import versioned

    spec = resolve_model("mistralai/Mixtral-8x7B-v0.1")
    options = {"transformers": "4.39.3", "reentrant_ckpt": False, "loss_shift": False, "experts_loop": False,
               "experts_list_index": False, "rope_caches": False, "loss_returns_head": False}
    applied = versioned(spec, options)
    assert "transformers" not in applied
    assert {k for k in KNOBS if applied[k]} == {"loss_shift", "reentrant_ckpt", "experts_loop", "experts_list_index",
                                                 "rope_caches"}
    # stated off: kept off; stated on where the version sets it off: kept on
    kept = versioned(spec, {**options, "loss_returns_head": True}, stated=("reentrant_ckpt",))
    assert not kept["reentrant_ckpt"] and kept["loss_returns_head"] and kept["loss_shift"]
    assert versioned(spec, {"micro_batch": 2}) == {"micro_batch": 2}  # no version: as given


def test_a_loss_of_the_recipes_own_keeps_its_loss_knobs():
    from planner.catalog import resolve_model
    from planner.estimation import versioned

    spec = resolve_model("mistralai/Mistral-7B-v0.1")
    fused = versioned(spec, {"transformers": "4.45.2", "fused_ce": True})
    assert not fused.get("loss_shift") and fused["reentrant_ckpt"]
    assert not versioned(spec, {"transformers": "4.45.2", "loss_chunks": 8}).get("loss_shift")


# ---- the command line ----------------------------------------------------------------------------------------
MIXTRAL = ("estimate", "-m", "mistralai/Mixtral-8x7B-v0.1", "--gpu", "a100-80gb", "--method", "qlora", "--grad-ckpt",
           "--json")
BY_HAND = ("--loss-shift", "--reentrant-ckpt", "--experts-loop", "--experts-list-index", "--rope-caches")


def test_estimate_with_a_version_is_the_knobs_by_hand(cli):
    versioned, by_hand, plain = cli(*MIXTRAL, "--transformers", "4.39.3"), cli(*MIXTRAL, *BY_HAND), cli(*MIXTRAL)
    assert versioned.code == by_hand.code == 0, (versioned, by_hand)
    assert json.loads(versioned.out) == json.loads(by_hand.out)
    assert json.loads(versioned.out) != json.loads(plain.out)
    five = cli(*MIXTRAL, "--transformers", "5.0")
    assert json.loads(five.out) == json.loads(plain.out)


def test_estimate_a_flag_given_overrides_the_version(cli):
    overridden = cli(*MIXTRAL, "--transformers", "4.39.3", "--no-reentrant-ckpt", "--no-experts-list-index")
    by_hand = cli(*MIXTRAL, "--loss-shift", "--experts-loop", "--rope-caches")
    assert overridden.code == 0, overridden
    config = json.loads(overridden.out)["config"]
    assert config.get("experts_loop") and not config.get("reentrant_ckpt") and not config.get("experts_list_index")
    assert json.loads(overridden.out) == json.loads(by_hand.out)


@pytest.mark.parametrize("bad", ["4.x", "4.30.2"])
def test_estimate_a_bad_version_is_one_line(cli, bad):
    result = cli("estimate", "-m", "gpt2", "--gpu", "a10g", "--transformers", bad)
    assert result.code != 0
    assert result.err.strip().count("\n") == 0 and "--transformers" in result.err, result


def test_measure_refuses_a_version_it_does_not_run(cli):
    result = cli("measure", "-m", "gpt2", "--gpu", "cpu", "--transformers", "4.45.2", "--no-save")
    assert result.code == 2 and "transformers 5" in result.err and result.err.strip().count("\n") == 0, result


def test_suggest_plans_the_versions_knobs(cli):
    args = ("suggest", "-m", "mistralai/Mistral-7B-v0.1", "--gpu", "a100-80gb", "-b", "8", "--method", "lora",
            "--no-save", "--json")
    versioned = cli(*args, "--transformers", "4.41.2")
    assert versioned.code == 0, versioned
    by_hand = cli(*args, "--loss-shift", "--reentrant-ckpt", "--rope-caches")
    plans = json.loads(versioned.out)["plans"]
    assert all(p["config"].get("loss_shift") and p["config"].get("rope_caches") for p in plans)
    assert [p["config"] for p in plans] == [p["config"] for p in json.loads(by_hand.out)["plans"]]


def test_the_python_api_takes_the_version():
    from planner.planning import SuggestRequest, make_plan

    planned = make_plan(SuggestRequest(model="mistralai/Mixtral-8x7B-v0.1", gpu="a100-80gb", target_batch=8,
                                       method="qlora", transformers="4.39.3"), first_only=True, alternative=False)
    config = planned.result.plans[0].config
    assert config.experts_loop and config.experts_list_index and config.loss_shift and config.rope_caches


@pytest.mark.parametrize("args", [
    ("suggest", "-m", "gpt2", "--gpu", "a10g", "-b", "8", "--emit", "{tmp}/out"),
    ("suggest", "-m", "gpt2", "--gpu", "a10g", "-b", "8", "--verify"),
    ("submit", "-m", "gpt2", "--gpu", "a10g", "-b", "8")], ids=["suggest-emit", "suggest-verify", "submit"])
def test_what_runs_transformers_5_refuses_an_older_version(cli, tmp_path, args):
    result = cli(*(a.format(tmp=tmp_path) for a in args), "--transformers", "4.45.2")
    assert result.code == 2 and "transformers 5" in result.err and result.err.strip().count("\n") == 0, result
    assert not (tmp_path / "out").exists()
