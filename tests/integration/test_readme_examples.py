"""The README's example commands run as written (issue 20, item 4).

Every indented `planner ...` line of README.md is either run here, offline on the CPU, or named
below with the reason it cannot run in a test (it needs a Ray cluster, a running server or a
measurement placeholder to be filled in). None needs a GPU or the network. A new example the
test does not know fails it until it is run or given a reason."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

#: example lines that cannot run as a test, each with why (matched by their start)
NOT_RUN = {
    "planner measure --gpu cpu --model M": "M is a placeholder for the user's model (tests/verify/test_cli_measure.py runs measure)",
    "planner calibrate --gpu cpu": "needs stored measurements of the device (tests/verify/test_calibrate.py)",
    "planner estimate --gpu cpu --model M": "M is a placeholder; the line shows the output's calibration line",
    "planner suggest -m meta-llama/Llama-2-7b-hf -g a10g -b 32 --verify": "--verify trains on Ray workers with an A10G "
    "(tests/verify/test_verify.py runs --verify on --gpu cpu)",
    "planner submit --address http://HEAD:8265": "needs a Ray cluster's job API at HEAD",
    "planner jobs status <job id>": "needs a Ray cluster's job API and a job id",
    "planner serve": "starts the HTTP service (tests/service/test_api.py drives it in-process)",
    "planner history": "follows the curl example against a running service (tests/store/test_store_cli.py runs history)",
}


def example_lines() -> list[str]:
    """Each indented `planner ...` line of README.md (a trailing comment and `pip install ... &&`
    dropped)."""
    lines = []
    for raw in README.read_text().splitlines():
        m = re.match(r"^ {4}(?:pip install [^&]*&& )?(planner .*)$", raw)
        if m:
            lines.append(m.group(1).split("  #")[0].split(" # ")[0].rstrip(" \\").strip())
    return lines


def _reason(line: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if line.startswith(start)), None)


def test_every_example_is_run_or_has_a_reason():
    lines = example_lines()
    assert len(lines) >= 10
    run = [line for line in lines if _reason(line) is None]
    assert {line.split()[1] for line in run} <= {"suggest", "estimate", "emit"}, run


@pytest.mark.parametrize("line", [line for line in example_lines() if _reason(line) is None])
def test_the_example_runs_as_written(line, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = shlex.split(line)[1:]
    if args[0] == "emit":
        # the plan id of the suggest line before it, as the README's reader would paste it
        planned = cli("suggest", "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "a10g", "--target-batch", "32")
        assert planned.code == 0, planned
        plan_id = re.search(r"plan id: (\S+)", planned.out).group(1)
        args[1] = plan_id
        (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    if args[0] == "suggest" and "--dataset" in args:  # the reader's own data: a path that is not there is refused
        (tmp_path / args[args.index("--dataset") + 1]).write_text('{"text": "hello world"}\n{"input_ids": [1, 2, 3]}\n')
    r = cli(*args)
    assert r.code == 0, (line, r)
    if "--timeline" in args:
        assert (tmp_path / args[args.index("--timeline") + 1]).stat().st_size > 0
