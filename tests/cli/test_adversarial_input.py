"""Input a demanding new user sends that the fuzz grammar does not: each one line naming what is
wrong and the fix (exit 2), never a traceback, never an empty answer read as a result."""

from __future__ import annotations

import pytest
from support.cli import assert_user_error, write_config


@pytest.fixture
def tiny(tmp_path):
    return write_config(tmp_path / "tiny")


@pytest.mark.parametrize("epochs, tokens", [("1e300", "1e16"), ("1e10", "1e16")])
def test_epochs_times_the_epoch_tokens_past_the_bound_is_one_line_naming_both(cli, tiny, epochs, tokens):
    # 1e300 x 1e16 overflowed round() (OverflowError); 1e10 x 1e16 blamed a --tokens never given
    assert_user_error(cli("suggest", "-m", tiny, "-b", "8", "--gpu", "a10g,l4", "--epochs", epochs,
                          "--dataset-tokens", tokens), "--epochs", "more than 1e16")


def test_an_empty_gpu_list_is_refused_not_answered_with_no_option(tiny):
    from planner.errors import InvalidConfigError
    from planner.planning import SuggestRequest
    from planner.pricing import load_prices
    from planner.rent import compare_gpus, workload

    with pytest.raises(InvalidConfigError, match="no GPU type to compare"):
        compare_gpus(SuggestRequest(model=str(tiny), gpu="any", target_batch=8), workload=workload(),
                     prices=load_prices(), gpu_names=[])


@pytest.mark.parametrize("lines", [
    ['{"text": ""}'],
    ['{"messages": [{"role": "user"}]}', '{"messages": "hello"}'],
])
def test_a_dataset_of_empty_samples_names_the_data_not_a_seq_len_never_given(cli, tiny, tmp_path, lines):
    # padded, the longest batch was 0 tokens: "--seq-len must be a whole number >= 1, got 0";
    # packed, --gpu any priced 0 tokens at $0.00
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    for extra in (["--no-packing", "-g", "a10g", "--no-save"], ["-g", "a10g,l4", "--epochs", "1"]):
        assert_user_error(cli("suggest", "-m", tiny, "-b", "8", "--dataset", data, *extra), "hold", "no tokens",
                          "--dataset-field")


def test_a_jsonl_file_saved_with_a_byte_order_mark_is_read(cli, tiny, tmp_path):
    data = tmp_path / "bom.jsonl"
    data.write_bytes(b'\xef\xbb\xbf{"input_ids": [1, 2, 3, 4, 5]}\n{"input_ids": [1, 2]}\n')
    r = cli("suggest", "-m", tiny, "-g", "a10g", "-b", "2", "--dataset", data, "--no-packing", "--no-save")
    assert r.code == 0, r  # was: "line 1 is not JSON" for a file every JSON reader with utf-8-sig reads
    assert "2 samples, 7 tokens" in r.out + r.err and "longest 5" in r.out + r.err, r


def test_a_nested_token_list_names_the_field_and_the_fix(cli, tiny, tmp_path):
    data = tmp_path / "nested.jsonl"
    data.write_text('{"input_ids": [[1, 2], [3]]}\n')
    assert_user_error(cli("suggest", "-m", tiny, "-g", "a10g", "-b", "2", "--dataset", data, "--no-save"),
                      "'input_ids'", "--dataset-field")


@pytest.mark.parametrize("make, fragments", [
    (lambda p: p.mkdir(), ["a folder, not a file"]),                                      # said "no such file"
    (lambda p: p.write_text('{"warp-drive": 1.0}'), ["prices.json: unknown GPU 'warp-drive'"]),  # named no file
    (lambda p: p.write_text('{"a10g": 1460}'), ["more than 1,000", "not a month's"]),      # a monthly price
])
def test_a_bad_prices_file_says_which_file_and_what_to_give(cli, tiny, tmp_path, make, fragments):
    path = tmp_path / "prices.json"
    make(path)
    assert_user_error(cli("suggest", "-m", tiny, "-b", "8", "-g", "a10g,l4", "--gpus-max", "1", "--prices", path),
                      *fragments)


@pytest.fixture
def plan_id(cli, tiny):
    import json

    r = cli("suggest", "-m", tiny, "-g", "a10g", "-b", "8", "--json")
    assert r.code == 0, r
    return json.loads(r.out)["plan_id"]


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux's /proc (no new folder there)")
def test_emit_into_a_place_no_folder_can_be_made_is_one_line(cli, plan_id):
    # was a FileNotFoundError traceback from Path.mkdir, after the plan was stored
    assert_user_error(cli("emit", plan_id, "/proc/no-folder-here/run"), "cannot write the plan's files there",
                      "give a directory you can write to")


def test_emit_that_fails_midway_leaves_nothing_half_written(cli, plan_id, tmp_path, monkeypatch):
    import errno
    import pathlib

    old = tmp_path / "old"
    assert cli("emit", plan_id, old).code == 0
    before = {p.name: p.read_text() for p in old.iterdir()}
    real, calls = pathlib.Path.write_text, []

    def disk_full_on_the_third(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", disk_full_on_the_third)
    assert_user_error(cli("emit", plan_id, old, "--force", "--rank", "2"), "No space left on device")
    assert {p.name: p.read_text() for p in old.iterdir()} == before  # --force's old files untouched, no .partial
    calls.clear()
    new = tmp_path / "a" / "b"
    assert_user_error(cli("emit", plan_id, new), "No space left on device")
    assert not (tmp_path / "a").exists()  # the folders it made are gone again


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux's /proc (no new file there)")
def test_a_timeline_that_cannot_be_written_is_one_line(cli, tiny):
    # was a FileNotFoundError traceback from matplotlib's savefig, after the estimate
    assert_user_error(cli("estimate", "-m", tiny, "-g", "a10g", "--timeline", "/proc/step.png"),
                      "--timeline /proc/step.png: cannot be written", "folder you can write to")


def test_a_broken_tokenizer_beside_the_model_is_named_as_found_not_as_an_option_never_given(cli, tmp_path):
    model = write_config(tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").write_text("garbage")
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello world"}\n')
    r = cli("suggest", "-m", model, "-g", "a10g", "-b", "2", "--dataset", data, "--no-save")
    assert_user_error(r, "the model's tokenizer", "give --tokenizer PATH")  # said "--tokenizer ...: not a tokenizer.json"
    assert "error: --tokenizer" not in r.err, r


@pytest.mark.parametrize("name", ["data.jsonl", "./train", "~/no/such/data.parquet"])
def test_a_dataset_path_that_is_not_there_is_refused_not_planned_as_a_datasets_name(cli, tiny, name):
    # planned for --seq-len with a note on stderr, exit 0; with --epochs: "add ... --dataset FILE"
    assert_user_error(cli("suggest", "-m", tiny, "-g", "a10g", "-b", "8", "--dataset", name, "--no-save"),
                      f"--dataset {name}: no such file or folder")
    assert_user_error(cli("suggest", "-m", tiny, "-g", "a10g,l4", "-b", "8", "--epochs", "1", "--dataset", name),
                      "no such file or folder")


def test_a_datasets_name_is_still_left_to_train_py(cli, tiny):
    r = cli("suggest", "-m", tiny, "-g", "a10g", "-b", "8", "--dataset", "tatsu-lab/alpaca", "--no-save")
    assert r.code == 0 and "no local file" in r.err, r


def test_epochs_over_a_datasets_name_asks_for_the_tokens_of_an_epoch(cli, tiny):
    # said "add --dataset-tokens N or --dataset FILE" to a user who had given --dataset
    assert_user_error(cli("suggest", "-m", tiny, "-g", "a10g,l4", "-b", "8", "--epochs", "1", "--dataset",
                          "tatsu-lab/alpaca"), "a datasets name is not read here", "--dataset-tokens N")


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_output_to_a_full_device_is_one_line_not_a_traceback(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "planner", "gpus"], stdout=full, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path, env=os.environ | {"PYTHONPATH": str(root)}, timeout=120)
    assert done.returncode == 1, done.stderr  # was an OSError traceback from rich's console
    assert done.stderr == "error: cannot write the output (No space left on device): free space, or send it to " \
                          "another file\n", done.stderr


@pytest.mark.parametrize("call, knobs", [
    ("suggest", {"target_batch": 4, "save": False, "gpu_mem": 10**30}),  # held the search 13 min of CPU
    ("suggest", {"target_batch": 4, "save": False, "cpu_mem": 10**30}),
    ("estimate", {"gpu_mem": 10**30}),
    ("suggest", {"target_batch": 4, "save": False, "gpu_mem": 0}),
])
def test_a_size_in_bytes_is_held_to_the_bounds_text_is(call, knobs, tiny):
    import oom_planner as op

    with pytest.raises(op.PlannerError, match="more than 1 PiB|larger than zero"):
        getattr(op, call)(model=str(tiny), gpu="a10g", **knobs)


@pytest.mark.parametrize("args, fragment", [
    (["--eval-seq-len", "500"], "--eval-seq-len 500 is longer than"),
    (["--seq-len", "100", "--generate-tokens", "50"], "(--seq-len 100) + --generate-tokens 50 = 150 tokens"),
])
@pytest.mark.parametrize("command", ["suggest", "estimate"])
def test_an_eval_sequence_past_the_models_maximum_is_refused_as_a_training_one_is(cli, tiny, command, args, fragment):
    # the tiny model allows 128 positions; an eval of 500 (or 100 + 50 generated) was planned, exit 0
    extra = ["-b", "4", "--no-save"] if command == "suggest" else []
    assert_user_error(cli(command, "-m", tiny, "-g", "a10g", "--eval-batch", "2", *args, *extra),
                      fragment, "allows (128)")


@pytest.mark.parametrize("call, knobs, fragment", [
    ("suggest", {"method": []}, "--method must be text"),             # TypeError: unhashable type: 'list'
    ("suggest", {"generate_tokens": [], "eval_batch": 2}, "--generate-tokens must be a whole number"),
    ("suggest", {"allow_offload": "no"}, "allow_offload must be True or False"),
    ("suggest", {"save": "no"}, "save must be True or False"),        # "no" is truthy: the plan was stored
    ("suggest", {"db": 1.5, "save": True}, "database URL must be text"),  # AttributeError in the lite store
    ("estimate", {"grad_ckpt": None}, "--grad-ckpt must be true or false"),  # TypeError in the kernels
    ("estimate", {"grad_ckpt": "x"}, "--grad-ckpt must be true or false"),   # ValueError
    ("estimate", {"zero": []}, "--zero must be a whole number"),
    ("estimate", {"alloc_conf": 1e308}, "--alloc-conf must be text"),
    ("estimate", {"seq_len": "x"}, "--seq-len must be a whole number"),
    ("estimate", {"lora_dropout": 0, "method": "lora"}, None),        # an int for a float is fine
    ("estimate", {"lora_targets": ["q_proj", "v_proj"], "method": "lora"}, None),  # so is a list of names
])
def test_the_python_apis_keywords_are_typed_as_the_cli_types_its_options(tiny, call, knobs, fragment):
    import oom_planner as op

    base = {"target_batch": 4, "save": False} if call == "suggest" else {}
    kwargs = {"model": str(tiny), "gpu": "a10g", **base, **knobs}
    if fragment is None:
        getattr(op, call)(**kwargs)
        return
    with pytest.raises(op.PlannerError, match=fragment.replace("(", r"\(")):
        getattr(op, call)(**kwargs)


@pytest.mark.parametrize("config, knobs, fragment", [
    ([1], {}, "a list of paths"),                       # TypeError from pathlib
    ({}, {"seq_len": "x"}, "--seq-len must be a whole number"),  # TypeError comparing with the model's maximum
    ({}, {"gpus": "2"}, "--gpus must be a whole number"),
])
def test_the_python_apis_check_is_typed_too(tiny, config, knobs, fragment):
    import oom_planner as op

    with pytest.raises(op.PlannerError, match=fragment):
        op.check(config, gpu="a10g", model=str(tiny), **knobs)


def test_a_run_that_measured_nothing_prints_the_prediction_not_an_empty_table():
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from planner.cli.plan import _print_measurement
    from planner.results import Measurement, RunOutcome

    out = Console(file=io.StringIO(), width=200)
    data = {"model": {"id": "m"}, "config": {"method": "full", "precision": "bf16-mixed", "optimizer": "adamw",
            "micro_batch": 1, "grad_accum": 1, "seq_len": 128, "grad_ckpt": False, "zero": 0, "offload": "none"},
            "throughput": {"tokens_per_s": 1000.0}, "error_pct": {}}
    predicted = SimpleNamespace(peak_allocated_bytes=5 << 20, peak_reserved_bytes=6 << 20, process_total_bytes=7 << 20)
    measured = Measurement(outcome=RunOutcome.OOM, device="cpu", error="OutOfMemoryError: CPU probe")
    _print_measurement(out, data, predicted, measured)
    text = out.file.getvalue()
    assert "predicted vs measured" not in text, text  # was a table with a header and no row
    assert "nothing was measured" in text and "peak allocated 5 MiB" in text, text


def test_one_sample_is_said_in_the_singular(cli, tiny, tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    r = cli("suggest", "-m", tiny, "-g", "a10g", "-b", "2", "--dataset", data, "--no-save")
    assert r.code == 0 and "dataset: 1 sample, 3 tokens" in r.err, r  # was "1 samples"


def test_an_eval_sequence_may_use_the_context_rope_scaling_gives(cli, tiny):
    # the tiny model's 128 positions, doubled: 200 + 50 generated fits, 300 does not
    ok = cli("estimate", "-m", tiny, "-g", "a10g", "--eval-batch", "2", "--seq-len", "200", "--generate-tokens", "50",
             "--rope-scaling", "2")
    assert ok.code == 0, ok
    assert_user_error(cli("estimate", "-m", tiny, "-g", "a10g", "--eval-batch", "2", "--eval-seq-len", "300",
                          "--rope-scaling", "2"), "allows (256)")
