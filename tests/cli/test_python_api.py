"""``oom_planner``, the Python API: light to import, the CLI's use cases and answers, the README's
notebook example and its ``planner check`` lines run as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_importing_the_api_loads_neither_torch_nor_the_search():
    code = ("import sys, oom_planner; "
            "print(sorted(m for m in ('torch', 'transformers', 'planner.search', 'sqlalchemy') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_suggest_answers_as_planner_suggest_does_and_is_stored(cli):
    import json

    import oom_planner as op

    plan = op.suggest(model="Qwen/Qwen2.5-0.5B", gpu="a10g", target_batch=32)
    r = cli("suggest", "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "a10g", "--target-batch", "32", "--json", "--no-save")
    assert r.code == 0, r
    assert [p["config"] for p in plan.to_dict()["plans"]] == [p["config"] for p in json.loads(r.out)["plans"]]
    assert plan.plan_id and op.history(limit=5)[0].id == plan.plan_id
    assert "<table>" in plan._repr_html_() and "<table>" in op.history()._repr_html_()


def test_estimate_is_planner_estimates_json(cli):
    import json

    import oom_planner as op

    one = op.estimate(model="Qwen/Qwen2.5-0.5B", gpu="a10g", method="lora", micro_batch=4, seq_len=512)
    assert one.config.micro_batch == 4 and str(one.config.method) == "lora"
    r = cli("estimate", "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "a10g", "--method", "lora", "--micro-batch", "4",
            "--seq-len", "512", "--json")
    assert r.code == 0, r
    assert one.to_dict() == json.loads(r.out)
    assert "component" in one._repr_html_()


@pytest.mark.parametrize("call, kwargs, words", [
    ("suggest", {"model": "gpt2", "gpu": "a10g", "target_batch": 8, "micro_batch": 2}, "suggest() has no option 'micro_batch'"),
    ("estimate", {"model": "gpt2", "gpu": "a10g", "target_batch": 8}, "estimate() has no option 'target_batch'"),
    ("history", {"limit": 0}, "limit must be a whole number from 1"),
])
def test_unknown_or_bad_keywords_are_the_projects_error_with_the_fix(call, kwargs, words):
    import oom_planner as op

    with pytest.raises(op.InvalidConfigError, match=re.escape(words)):
        getattr(op, call)(**kwargs)


def _readme_section(title: str) -> str:
    text = README.read_text()
    start = text.index(title)
    return text[start:text.index("\n## ", start + 1)]


def test_the_readmes_notebook_example_runs(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(ROOT)
    code = re.search(r"```python\n(.*?)```", _readme_section("## Python API"), re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md (Python API)", "exec"), scope)
    assert scope["best"].rank == 1 and scope["checked"].change is not None


def test_the_readmes_check_examples_run(cli, monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.chdir(ROOT)
    lines = re.findall(r"^\$ planner (check .*)$", _readme_section("## Check a training config"), re.M)
    # a config of each format: TRL, axolotl, LLaMA-Factory, HF, accelerate, torchtune
    assert [line.split("/")[3] for line in lines] == ["trl", "axolotl", "llama_factory", "hf", "accelerate", "torchtune"]
    for line in lines:
        r = cli(*shlex.split(line))
        assert r.code in (0, 3) and "closest change" in r.out, (line, r)


def test_an_estimates_timeline_is_a_figure():
    pytest.importorskip("matplotlib")
    import oom_planner as op

    one = op.estimate(model="gpt2", gpu="a10g", micro_batch=2, seq_len=256)
    figure = one.figure()
    # the picture's axes carry the step's memory curve: one stacked area per category at least
    assert figure.axes and figure.axes[0].collections


def test_history_finds_plans_by_the_gpu_as_typed():
    import oom_planner as op

    plan = op.suggest(model="gpt2", gpu="A10G", target_batch=8, top_k=1)
    assert [row.id for row in op.history(gpu="A10G")] == [plan.plan_id]
    assert op.history(gpu="t4").to_dict() == []
