"""``planner estimate`` and ``planner suggest`` through the real CLI (in-process and as a subprocess)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

LLAMA7B = "meta-llama/Llama-2-7b-hf"
HEAVY = ("torch", "transformers", "deepspeed", "ray")


def _python(code: str, env_home) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with a temporary planner home and no network."""
    env = {**os.environ, "PLANNER_HOME": str(env_home), "HF_HUB_OFFLINE": "1"}
    env.pop("PLANNER_DATABASE_URL", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def _run_in_subprocess(args: list[str], env_home) -> subprocess.CompletedProcess:
    """Call planner.cli.main(args) in a fresh interpreter, then print which heavy modules it loaded."""
    return _python(
        "import json, sys\n"
        "from planner.cli import main\n"
        f"code = main({args!r})\n"
        f"print('HEAVY=' + json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
        "print('CODE=' + str(code))\n",
        env_home,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["estimate", "--model", LLAMA7B, "--gpu", "a10g", "--method", "qlora", "--grad-ckpt", "--seq-len", "512"],
        ["suggest", "--model", LLAMA7B, "--gpu", "a10g", "--target-batch", "32"],
    ],
    ids=["help", "estimate", "suggest"],
)
def test_commands_do_not_import_heavy_libraries(args, planner_home):
    proc = _run_in_subprocess(args, planner_home)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "CODE=0" in lines
    assert "HEAVY=[]" in lines, [line for line in lines if line.startswith("HEAVY=")]
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("typer._click") is None, reason="typer < 0.29 runs on click itself")
def test_the_cli_runs_without_the_click_package(planner_home):
    """typer >= 0.29 vendors click and does not depend on it: a light install has no ``click``.
    Block the import and run help, a usage error, a planner error and a plan."""
    code = (
        "import sys\n"
        "sys.modules['click'] = None  # import click -> ImportError\n"
        "from planner.cli import main\n"
        "codes = [main(['--help']), main(['estimate', '--bogus']), main(['estimate', '--model', 'nope', '--gpu', 'a10g']),\n"
        f"         main(['suggest', '--model', {LLAMA7B!r}, '--gpu', 'a10g', '--target-batch', '32', '--no-save'])]\n"
        "print('CODES=' + ','.join(map(str, codes)))\n"
    )
    proc = _python(code, planner_home)
    assert "CODES=0,2,2,0" in proc.stdout.splitlines(), (proc.stdout[-1000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr


def test_the_command_table_is_what_the_modules_register():
    """``planner.cli.COMMANDS`` names each command's module: a run that names its command builds
    only that module (the others' options are not built), and every command is in it."""
    import importlib

    import typer

    from planner.cli import _COMMAND_MODULES, COMMANDS

    registered = {}
    for module in _COMMAND_MODULES:
        app = typer.Typer()
        importlib.import_module(module).register(app)
        names = [c.name for c in app.registered_commands] + [g.name for g in app.registered_groups]
        registered.update(dict.fromkeys(names, module))
    assert registered == COMMANDS


def test_a_named_command_is_the_same_command_alone(cli):
    import typer.main

    from planner.cli import COMMANDS, get_app

    whole = typer.main.get_command(get_app())
    for name in COMMANDS:
        alone = typer.main.get_command(get_app(name))
        assert [p.name for p in alone.commands[name].params] == [p.name for p in whole.commands[name].params]


def test_suggest_against_a_database_at_head_does_not_import_alembic(planner_home):
    """The first run creates the store through Alembic; later runs confirm the schema with one
    SELECT (planner.store.schema.HEAD_REVISION), keeping Alembic off the cold path."""
    code = (
        "import sys\n"
        "from planner.cli import main\n"
        f"code = main(['suggest', '--model', {LLAMA7B!r}, '--gpu', 'a10g', '--target-batch', '32'])\n"
        "print('ALEMBIC=' + str('alembic' in sys.modules))\n"
    )
    runs = [_python(code, planner_home) for _ in range(2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ALEMBIC=True" in runs[0].stdout.splitlines()  # created the database
    assert "ALEMBIC=False" in runs[1].stdout.splitlines()
    assert "a plan for this request exists" in runs[1].stdout


# ---- estimate ------------------------------------------------------------------------------------


def test_estimate_json_shape(cli):
    r = cli("estimate", "--model", LLAMA7B, "--gpu", "a10g", "--method", "lora", "--lora-r", "16", "--micro-batch", "2", "--json")
    data = json.loads(r.out)
    assert r.code == (0 if data["fits"] else 3), r  # exit 3: the configuration does not fit
    assert data["model"]["id"] == LLAMA7B
    assert data["model"]["params"] == 6_738_415_616
    assert data["model"]["trainable_params"] == 39_976_960  # r=16 all-linear (see test_memory)
    cfg = data["config"]
    assert (cfg["method"], cfg["lora_r"], cfg["lora_targets"], cfg["micro_batch"], cfg["seq_len"]) == ("lora", 16, "all-linear", 2, 2048)
    mem = data["memory"]
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "process_total_bytes", "cpu_bytes", "breakdown"):
        assert key in mem
    assert sum(mem["breakdown"].values()) == mem["peak_allocated_bytes"]
    assert mem["process_total_bytes"] >= mem["peak_reserved_bytes"] >= mem["peak_allocated_bytes"]
    dev = data["device"]
    assert dev["name"] == "a10g" and dev["capacity_bytes"] == 23028 * 1024**2
    assert isinstance(data["fits"], bool)
    assert data["fits"] == (mem["process_total_bytes"] <= dev["usable_bytes"])
    assert data["throughput"]["tokens_per_s"] > 0 and data["throughput"]["step_s"] > 0


def test_estimate_fits_flag_both_ways(cli):
    small, big = cli("estimate", "-m", "gpt2", "-g", "a10g", "--seq-len", "512", "--json"), cli("estimate", "-m", LLAMA7B, "-g", "a10g", "--json")
    assert json.loads(small.out)["fits"] is True and json.loads(big.out)["fits"] is False  # 7B full AdamW needs > 100 GiB
    # estimate's own exit code for a configuration that does not fit: the estimate is printed, then 3
    assert (small.code, big.code) == (0, 3)


def test_estimate_human_output_has_table_and_bar(cli):
    r = cli("estimate", "--model", LLAMA7B, "--gpu", "a10g")
    assert r.code == 3, r  # printed in full, then exit 3: it does not fit
    assert "peak allocated" in r.out and "process total" in r.out
    assert "optimizer_states" in r.out and "weights" in r.out
    bar_lines = [line for line in r.out.splitlines() if line.startswith("[") and "]" in line]
    assert bar_lines and "over capacity" in bar_lines[0]  # 7B full fine-tuning overflows an A10G
    assert "does NOT fit" in r.out


# ---- suggest -------------------------------------------------------------------------------------


def test_suggest_prints_plans_and_a_plan_id(cli):
    r = cli("suggest", "--model", LLAMA7B, "--gpu", "a10g", "--target-batch", "32")
    assert r.code == 0, r
    assert "top 5 plans" in r.out
    assert "configurations searched" in r.out
    assert "lora" in r.out
    assert "plan id: " in r.out
    plan_id = r.out.split("plan id: ")[1].split()[0]
    assert len(plan_id) >= 8
    assert "why the more faithful options do not fit" in r.out


def test_suggest_json_shape(cli):
    r = cli("suggest", "--model", LLAMA7B, "--gpu", "a10g", "--target-batch", "32", "--no-save", "--json")
    assert r.code == 0, r
    data = json.loads(r.out)  # stdout is one JSON document, nothing else
    assert data["request"]["model_id"] == LLAMA7B and data["request"]["target_batch"] == 32
    assert 1 <= len(data["plans"]) <= 5
    for i, plan in enumerate(data["plans"], start=1):
        assert plan["rank"] == i
        assert plan["fits"] is True
        cfg = plan["config"]
        assert cfg["micro_batch"] * cfg["grad_accum"] * cfg["gpus"] == 32
        assert plan["memory"]["process_total_bytes"] <= data["usable_bytes"]
        assert plan["throughput"]["tokens_per_s"] > 0
    assert data["rejected"]
    for rej in data["rejected"]:
        assert ("family" in rej or "config" in rej) and rej["reason"]
    assert data["plan_id"] is None


def test_suggest_exit_3_when_nothing_fits(cli):
    r = cli("suggest", "-m", "meta-llama/Llama-3.1-70B", "-g", "t4", "-b", "8", "--method", "full", "--no-offload", "--no-save")
    assert r.code == 3, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: nothing fits")
    assert "closest" in lines[0]


# ---- bad input: one line, `error:`, exit 2 ---------------------------------------------------------

EST = ["estimate", "-m", LLAMA7B, "-g", "a10g"]
SUG = ["suggest", "-m", LLAMA7B, "-g", "a10g", "--no-save"]

BAD = {
    "unknown model": (["estimate", "-m", "no-such/model-xyz", "-g", "a10g"], "no-such/model-xyz"),
    "unknown gpu": (["estimate", "-m", LLAMA7B, "-g", "gtx-9999"], "gtx-9999"),
    "micro-batch 0": (EST + ["--micro-batch", "0"], "--micro-batch"),
    "micro-batch -1": (EST + ["--micro-batch", "-1"], "--micro-batch"),
    "target-batch 0": (SUG + ["--target-batch", "0"], "--target-batch"),
    "seq too long (estimate)": (EST + ["--seq-len", "99999"], "4096"),
    "seq too long (suggest)": (SUG + ["-b", "8", "--seq-len", "99999"], "4096"),
    "lora-r with full": (EST + ["--lora-r", "8"], "--lora-r"),
    "unknown lora target": (EST + ["--method", "lora", "--lora-targets", "c_attn"], "q_proj"),
    "bf16 on t4 (estimate)": (["estimate", "-m", LLAMA7B, "-g", "t4", "--precision", "bf16"], "bf16"),
    "bf16 on t4 (suggest)": (["suggest", "-m", LLAMA7B, "-g", "t4", "-b", "8", "--precision", "bf16-mixed", "--no-save"], "bf16"),
    "batch not divisible by gpus": (SUG + ["-b", "7", "--gpus", "2"], "--target-batch 7"),
    "unknown option": (EST + ["--bogus"], "--bogus"),
    "non-integer value": (EST + ["--micro-batch", "abc"], "--micro-batch"),
    "non-integer target": (SUG + ["--target-batch", "1.5"], "--target-batch"),
    "unknown precision": (EST + ["--precision", "fp4"], "fp4"),
    "fp8 on an a10g": (EST + ["--precision", "fp8"], "NVIDIA A10G has no FP8 tensor cores"),
    "missing required option": (["estimate", "-g", "a10g"], "--model"),
    # found by a QA walkthrough: each used to traceback, hang, or be taken literally
    "target batch beyond any run": (SUG + ["-b", "99999999999999999999"], "--target-batch"),
    "micro-batch beyond any run": (EST + ["--micro-batch", "99999999999"], "--micro-batch"),
    "gpu-mem without a unit": (SUG + ["-b", "8", "--gpu-mem", "20"], "unit is required"),
    "gpu-mem beyond 1 PiB": (SUG + ["-b", "8", "--gpu-mem", "9000000TiB"], "1 PiB"),
    "lora rank wider than the layers": (EST + ["--method", "lora", "--lora-r", "5000"], "4096"),
    "flash attention on a t4": (["estimate", "-m", LLAMA7B, "-g", "t4", "--attention", "flash"], "Ampere"),
    "flash attention on the cpu": (["estimate", "-m", LLAMA7B, "-g", "cpu", "--attention", "flash"], "sdpa"),
    "config path that does not exist": (["estimate", "-m", "nonexist/config.json", "-g", "a10g"], "no such file"),
    "misspelt method": (SUG + ["-b", "8", "--method", "ful"], "--method must be one of auto|full|lora|qlora, got 'ful'"),
    "history since before year 1": (["history", "--since", "99999999999d"], "--since"),
    "measure on a gpu this machine lacks": (["measure", "-m", "gpt2", "-g", "a10g", "--seq-len", "32"], "no CUDA device"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_error_line_and_exit_2(cli, name):
    args, mention = BAD[name]
    r = cli(*args)
    assert r.code == 2, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("error: ")
    assert mention in lines[0]
    assert "Traceback" not in r.err + r.out


@pytest.mark.parametrize("content, mention", [("{not json", "not valid JSON"), ('{"hidden_size": 8}', "model_type"), ("[1, 2]", "config")])
def test_malformed_config_json_path(cli, tmp_path, content, mention):
    path = tmp_path / "config.json"
    path.write_text(content)
    for target in (path, tmp_path):  # the file itself or its model directory
        r = cli("estimate", "-m", str(target), "-g", "a10g")
        assert r.code == 2, r
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and mention in lines[0], r.err


def test_unknown_option_in_a_subprocess_has_no_traceback(planner_home):
    """typer 0.29 raises its vendored click's exceptions: the real process must still print one line."""
    env = {**os.environ, "PLANNER_HOME": str(planner_home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "estimate", "--bogus"], capture_output=True, text=True, env=env, timeout=60)
    if "No module named planner.cli.__main__" in proc.stderr:
        proc = subprocess.run([sys.executable, "-c", "from planner.cli import main; main()", "estimate", "--bogus"],
                              capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--bogus" in lines[0]


def test_estimate_defaults_to_the_mixed_precision_the_gpu_has(cli):
    """bf16 autocast where the device has bf16, fp16 autocast on a T4 (no bf16): the default
    works on every GPU of the catalog instead of failing on the older ones."""
    for gpu, expected in (("t4", "fp16-mixed"), ("v100-16gb", "fp16-mixed"), ("a10g", "bf16-mixed"), ("cpu", "bf16-mixed")):
        r = cli("estimate", "--model", "gpt2", "--gpu", gpu, "--json")
        assert r.code == 0, r
        assert json.loads(r.out)["config"]["precision"] == expected
        # LoRA: the 16-bit frozen base of the same type (planner.defaults)
        r = cli("estimate", "--model", "gpt2", "--gpu", gpu, "--method", "lora", "--json")
        assert r.code == 0, r
        assert json.loads(r.out)["config"]["precision"] == expected.removesuffix("-mixed")
    # asked for explicitly, bf16 on a T4 is still refused with the reason
    r = cli("estimate", "--model", "gpt2", "--gpu", "t4", "--precision", "bf16-mixed")
    assert r.code == 2 and "no bf16 support" in r.err


def test_version(cli):
    from planner import __version__

    r = cli("--version")
    assert r.code == 0 and r.out.strip() == f"planner {__version__}"


def test_nothing_fits_for_want_of_host_ram_says_so(cli):
    # one GPU: on two, ZeRO-3 splits the frozen 16-bit base (54 GB) and LoRA fits without offload
    r = cli("suggest", "-m", "google/gemma-2-27b", "-g", "rtx-a6000", "-b", "4", "--gpus", "1", "--method", "lora",
            "--cpu-mem", "16GiB", "--no-save")
    assert r.code == 3
    assert "host RAM" in r.err and "--cpu-mem" in r.err and "fits the device" in r.err


def test_top_plans_hold_no_deepspeed_variant_of_a_shown_plan_that_is_not_faster(cli):
    data = json.loads(cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "8", "--top-k", "20", "--no-save", "--json").out)
    shown = {}
    for plan in data["plans"]:
        c = plan["config"]
        knobs = (c["method"], c["precision"], c["optimizer"], c["lora_r"], c["lora_targets"], c["grad_ckpt"],
                 c["micro_batch"], c["grad_accum"])
        if knobs in shown:
            assert plan["throughput"]["tokens_per_s"] > shown[knobs] * 1.02, (knobs, c["zero"], c["offload"])
        shown[knobs] = max(shown.get(knobs, 0), plan["throughput"]["tokens_per_s"])


def test_suggest_json_when_nothing_fits_still_prints_the_request_and_the_closest_tries(cli):
    r = cli("suggest", "-m", LLAMA7B, "-g", "t4", "-b", "8", "--method", "full", "--no-offload", "--no-save", "--json")
    assert r.code == 3
    data = json.loads(r.out)
    assert data["plans"] == [] and data["plan_id"] is None
    assert data["request"]["model_id"] == LLAMA7B and data["error"].startswith("nothing fits")
    assert data["rejected"] and all(rej["reason"] for rej in data["rejected"])
    assert r.err.strip().splitlines() == [f"error: {data['error']}"]
