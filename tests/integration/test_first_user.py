"""What a demanding first user found trying every command and option that landed with the recipe
knobs, ``--prefer``, the node's host RAM, ``planner calibrate`` and estimate's exit 3: each is
fixed at its cause, and each test here is its reproduction.

- ``history -n -1`` named ``-n`` even when ``--limit`` was typed (the store's check), and
  ``-n abc`` named ``--limit``: the option is named as typed, with its range and the bad value;
- ``measure --timeout nan`` passed the ``<= 0`` check and reached the child process's wait
  (``ValueError: cannot convert float NaN to integer``, a traceback);
- ``estimate --gpus 17`` planned one node of 17 GPUs that ``suggest`` refuses;
- ``suggest --emit FILE/below`` planned and stored, then died in ``mkdir`` (NotADirectoryError,
  found by bench/fuzz.py);
- over HTTP ``"lora_dropout": true`` was a dropout of 1.0 and ``"fused_ce": "yes"`` a flag; a
  size sent as bytes was echoed as ``'0B'``;
- the README's exit codes said ``submit`` exits 1 (it never waits for its job).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from support.cli import assert_user_error

README = Path(__file__).resolve().parents[2] / "README.md"


# ---- history: the option as typed, its range, the value ------------------------------------------


@pytest.mark.parametrize(("args", "named", "shown"), [
    (["--limit", "-1"], "--limit", "-1"), (["-n", "-1"], "-n", "-1"), (["-n0"], "-n", "0"),
    (["--limit=0"], "--limit", "0"), (["-n", "100001"], "-n", "100001"),
    (["-n", "9223372036854775808"], "-n", "9223372036854775808"),
    # click keeps the last value given: the error is about that spelling
    (["-n", "3", "--limit", "0"], "--limit", "0"), (["--limit", "3", "-n", "0"], "-n", "0"),
])
def test_history_limit_out_of_range_names_the_option_as_typed(cli, args, named, shown):
    result = cli("history", *args)
    assert_user_error(result, f"error: {named} must be a whole number from 1 to 100,000, got {shown} "
                              "(see 'planner history --help')")


@pytest.mark.parametrize(("args", "named"), [(["-n", "abc"], "-n"), (["--limit", "1e3"], "--limit")])
def test_history_limit_that_is_no_number_names_the_option_as_typed(cli, args, named):
    assert_user_error(cli("history", *args), f"error: {named} must be a whole number, got '{args[1]}'")


def test_the_store_names_the_long_option_and_the_cli_bound_is_the_store_bound():
    """The library's own check (the API's GET /v1/plans and any caller) names --limit, which the
    API writes as its field; the CLI's bound and the store's are one constant."""
    from planner.errors import PlannerError
    from planner.limits import MAX_HISTORY
    from planner.service.errors import in_api_terms
    from planner.store import open_store
    from planner.store.api import MAX_HISTORY as STORE_MAX

    assert MAX_HISTORY == STORE_MAX == 100_000
    with open_store() as store, pytest.raises(PlannerError) as caught:
        store.history(limit=-1)
    assert str(caught.value) == "--limit must be a whole number from 1 to 100,000, got -1"
    assert in_api_terms(str(caught.value)) == ("limit must be a whole number from 1 to 100,000, got -1", "limit")


def test_integer_usage_errors_echo_numbers_as_typed(cli):
    """A whole number is echoed as the library echoes its values (``got 0``), text quoted."""
    assert_user_error(cli("estimate", "-m", "gpt2", "-g", "t4", "--micro-batch", "two"),
                      "error: --micro-batch must be a whole number, got 'two'")
    assert_user_error(cli("estimate", "-m", "gpt2", "-g", "t4", "--micro-batch", "0"),
                      "error: --micro-batch must be a whole number >= 1, got 0")


# ---- measure: its run limits before anything runs ------------------------------------------------


@pytest.mark.parametrize(("option", "value", "line"), [
    ("--timeout", "nan", "--timeout must be between 0 and 86400 seconds, got nan"),
    ("--timeout", "inf", "--timeout must be between 0 and 86400 seconds, got inf"),
    ("--timeout", "0", "--timeout must be between 0 and 86400 seconds, got 0.0"),
    ("--steps", "1", "--steps must be a whole number from 2 to 1000000, got 1"),
    ("--steps", "1000001", "--steps must be a whole number from 2 to 1000000, got 1000001"),
])
def test_measure_refuses_its_run_limits_before_anything_runs(cli, monkeypatch, option, value, line):
    import workers

    def trap(**kwargs):
        raise AssertionError("a training run started")

    monkeypatch.setattr(workers, "measure_with_details", trap)
    result = cli("measure", "-m", "gpt2", option, value)
    assert_user_error(result, f"error: {line}")
    assert cli("history", "--json").out.strip() == "[]"  # nothing stored


def test_the_runner_refuses_a_nan_timeout_before_it_starts_a_process(monkeypatch):
    """workers.runner checked ``timeout_s <= 0``, which NaN passes."""
    from support.cli import TINY

    import workers.runner as runner
    from planner.config import TrainConfig
    from planner.errors import InvalidConfigError

    monkeypatch.setattr(runner, "run_job", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(InvalidConfigError, match="timeout must be > 0 seconds, got nan"):
        runner.measure_with_details(model_config=TINY, config=TrainConfig(), timeout_s=math.nan)


# ---- estimate and suggest: one node, one wording -------------------------------------------------


def test_estimate_bounds_gpus_to_one_node_as_suggest_does(cli):
    line = ("error: --gpus 17 is more GPUs than one node holds (at most 16): the planner plans the "
            "data-parallel GPUs of one node; give the GPUs per node")
    assert_user_error(cli("estimate", "-m", "gpt2", "-g", "a10g", "--gpus", "17"), line)
    assert_user_error(cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "34", "--gpus", "17"), line)
    assert cli("estimate", "-m", "gpt2", "-g", "a10g", "--gpus", "16").code == 0


def test_emit_under_a_file_is_refused_before_anything_is_planned_or_stored(cli, tmp_path):
    """bench/fuzz.py's NotADirectoryError: ``--emit FILE/below`` passed the check (the path does
    not exist), the plan was stored, then mkdir raised."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "4", "--emit", blocker / "below" / "deeper")
    assert_user_error(result, f"{blocker} is a file, not a directory")
    assert result.out == ""
    assert cli("history", "--json").out.strip() == "[]"


# ---- the API: strict types, values echoed as sent ------------------------------------------------


@pytest.fixture
def api(tmp_path):
    pytest.importorskip("fastapi", reason="the service extra is not installed")
    from fastapi.testclient import TestClient

    from planner.service import create_app
    from planner.service.settings import ServiceSettings

    with TestClient(create_app(ServiceSettings(database_url=f"sqlite:///{tmp_path / 'api.db'}"))) as client:
        yield client


GPT2 = {"model": "gpt2", "gpu": "a10g"}


@pytest.mark.parametrize(("path", "extra", "field", "reason"), [
    ("/v1/estimate", {"method": "lora", "lora_dropout": True}, "lora_dropout", "Input should be a valid number"),
    ("/v1/estimate", {"method": "lora", "lora_dropout": "0.1"}, "lora_dropout", "Input should be a valid number"),
    ("/v1/estimate", {"method": "lora", "fused_ce": "yes"}, "fused_ce", "Input should be a valid boolean"),
    ("/v1/estimate", {"packing": 0}, "packing", "Input should be a valid boolean"),
    ("/v1/plans", {"target_batch": 4, "use_cache": 1}, "use_cache", "Input should be a valid boolean"),
])
def test_api_types_are_strict(api, path, extra, field, reason):
    response = api.post(path, json={**GPT2, **extra})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field and reason in response.json()["error"]


@pytest.mark.parametrize(("size", "line"), [
    (0, "cpu_mem must be larger than zero, got 0"), (-1, "cpu_mem must be larger than zero, got -1"),
    (2**60, f"cpu_mem {2**60} is more than 1 PiB"), ("0", "cpu_mem '0' is not a size (the unit is required)"),
])
def test_api_sizes_are_echoed_as_sent(api, size, line):
    response = api.post("/v1/plans", json={**GPT2, "target_batch": 4, "cpu_mem": size})
    assert response.status_code == 422 and response.json()["error"].startswith(line), response.text
    assert response.json()["field"] == "cpu_mem"


def test_api_estimate_bounds_gpus_to_one_node(api):
    response = api.post("/v1/estimate", json={**GPT2, "gpus": 17})
    assert response.status_code == 422 and response.json()["field"] == "gpus", response.text
    assert response.json()["error"].startswith("gpus 17 is more GPUs than one node holds (at most 16)")
    assert api.post("/v1/estimate", json={**GPT2, "lora_dropout": 0, "method": "lora"}).status_code == 200


# ---- the README's exit codes ---------------------------------------------------------------------


def _exit_code_rows() -> dict[int, str]:
    text = README.read_text()
    table = text[text.index("| code | meaning | commands |"):].split("\n\n")[0]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| .*? \| (.*) \|$", table, re.M)}


def test_the_readme_lists_every_exit_code_the_cli_gives():
    from support.cli import exit_codes

    assert set(_exit_code_rows()) == exit_codes() | {130}


def test_submit_is_not_documented_to_exit_1_and_never_does():
    """submit sends the job and returns; 'jobs status' is what exits 1 for a failed job."""
    import inspect

    from planner.cli import jobs_cmd

    assert "submit" not in _exit_code_rows()[1]
    assert "typer.Exit" not in inspect.getsource(jobs_cmd.submit)


def test_suggest_names_its_run_timeout_option_as_it_is_called(cli):
    """VerifyOptions said --timeout, an option suggest and submit do not have (theirs is
    --run-timeout); measure's is --timeout."""
    assert_user_error(cli("suggest", "-m", "gpt2", "-g", "t4", "-b", "4", "--verify", "--run-timeout", "-1"),
                      "error: --run-timeout must be between 0 and 86400 seconds, got -1.0")


@pytest.mark.parametrize(("extra", "line"), [
    (["--lora-dropout", "0.1"], "error: --lora-dropout only applies to LoRA: use --method lora or qlora, or drop it"),
    (["--lora-r", "8", "--lora-dropout", "0.1"],
     "error: --lora-r/--lora-dropout only apply to LoRA: use --method lora or qlora, or drop them"),
])
def test_lora_options_with_full_fine_tuning_are_named_as_given(cli, extra, line):
    """The line named all three LoRA options whatever was given, and the API's field was lora_r
    for a request that sent only lora_dropout."""
    assert_user_error(cli("estimate", "-m", "gpt2", "-g", "t4", "--method", "full", *extra), line)


def test_api_names_the_lora_field_that_was_sent(api):
    response = api.post("/v1/estimate", json={**GPT2, "lora_dropout": 0.1})
    assert response.status_code == 422 and response.json()["field"] == "lora_dropout", response.text


@pytest.mark.parametrize("where", ["missing/t.png", "a-file/t.svg", "folder.png"])
def test_a_timeline_that_cannot_be_written_is_refused_before_the_estimate(cli, tmp_path, where):
    """bench/fuzz.py: --timeline in a missing folder raised FileNotFoundError after the estimate."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "folder.png").mkdir()
    result = cli("estimate", "-m", "gpt2", "-g", "t4", "--timeline", tmp_path / where)
    assert_user_error(result, "error: --timeline ")
    assert result.out == ""


def test_use_cache_on_an_encoder_says_it_is_ignored(cli):
    """BERT has no KV cache (the model adds nothing); the recipe line said 'use_cache' as if it
    cost something."""
    with_cache = cli("estimate", "-m", "bert-base-uncased", "-g", "t4", "--use-cache")
    assert with_cache.code == 0, with_cache
    assert "recipe: use_cache (ignored: an encoder has no KV cache)" in with_cache.out
    decoder = cli("estimate", "-m", "gpt2", "-g", "t4", "--use-cache")
    assert "recipe: use_cache\n" in decoder.out, decoder


def test_near_the_edge_never_asks_to_lower_a_micro_batch_of_one():
    """suggest -m Qwen/Qwen2.5-0.5B -g t4 -b 8 advised 'lower the micro-batch' for plans at 1 x 8."""
    from planner.config import TrainConfig
    from planner.results import MemoryEstimate
    from planner.tradeoffs import trade_offs

    memory = MemoryEstimate(peak_allocated_bytes=10 << 30, peak_reserved_bytes=11 << 30, process_total_bytes=12 << 30,
                            cpu_bytes=0, breakdown={"weights": 10 << 30})
    capacity = memory.process_total_bytes  # near the edge: the median error is above the prediction

    def hint(**config):
        return trade_offs(TrainConfig(**config), memory, capacity=capacity)[0].split("; ")[-1]

    assert hint(micro_batch=2) == "lower the micro-batch"
    assert hint(micro_batch=1) == "turn on gradient checkpointing"
    assert hint(micro_batch=1, grad_ckpt=True) == "a shorter --seq-len, or a lighter method or optimizer"


def test_measure_prints_the_recipe_it_trained(cli, monkeypatch, tmp_path):
    """measure's header named method, precision and split but not the recipe knobs, so a run
    with --fused-ce --loop manual read like a plain one."""
    from support.cli import write_config

    import workers
    from planner.results import Measurement, RunOutcome

    config = write_config(tmp_path / "tiny")
    run = Measurement(outcome=RunOutcome.OK, device="cpu", peak_allocated_bytes=2 << 20, step_s=0.1, tokens_per_s=640.0)
    monkeypatch.setattr(workers, "measure_with_details", lambda **kwargs: (run, {}))
    result = cli("measure", "-m", config.parent, "--method", "lora", "--fused-ce", "--loop", "manual", "--seq-len", "32",
                 "--no-save")
    assert result.code == 0, result
    assert "recipe: manual loop (outputs kept through backward: loop/manual_outputs), fused linear cross-entropy\n" in result.out
