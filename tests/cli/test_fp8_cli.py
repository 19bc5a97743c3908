"""fp8 at the CLI: refused in one line where it cannot run (a GPU without FP8, the cpu profile, planner
measure's worker), and planned where it can."""

from __future__ import annotations

import json

import pytest
from support.cli import assert_user_error

from planner.gpus import fp8_gpus

MODEL = "meta-llama/Llama-3.2-1B"
HAVE = "use bf16-mixed, or a GPU with FP8: " + ", ".join(fp8_gpus())


@pytest.mark.parametrize("command", ["estimate", "suggest"])
def test_fp8_on_a_gpu_without_it_is_refused_naming_the_gpus_that_have_it(cli, command):
    size = ["--micro-batch", "1"] if command == "estimate" else ["--target-batch", "8", "--no-save"]
    r = cli(command, "--model", MODEL, "--gpu", "a100-80gb", "--precision", "fp8", *size)
    assert_user_error(r, "--precision fp8: NVIDIA A100-SXM4-80GB has no FP8 tensor cores", HAVE)


def test_measure_fp8_on_the_cpu_is_refused_before_anything_runs(cli):
    r = cli("measure", "--model", MODEL, "--gpu", "cpu", "--precision", "fp8", "--no-save")
    assert_user_error(r, "--precision fp8: the cpu profile has no FP8 tensor cores", HAVE)


def test_measure_fp8_on_an_fp8_gpu_is_refused_its_worker_runs_autocast(cli):
    r = cli("measure", "--model", MODEL, "--gpu", "h100-80gb", "--precision", "fp8", "--no-save")
    assert_user_error(r, "planner measure does not run fp8")


def test_estimate_fp8_on_an_h100_states_its_rate(cli):
    r = cli("estimate", "--model", MODEL, "--gpu", "h100-80gb", "--precision", "fp8", "--micro-batch", "2", "--json")
    assert r.code == 0, r
    data = json.loads(r.out)
    assert data["config"]["precision"] == "fp8"
    assert any("fp8: torchao's float8 linears" in line and "1978.8 TFLOP/s" in line
               for line in data["throughput"]["assumptions"])
    assert data["memory"]["breakdown"]["autocast/fp8_first_linear"] == 2 * 2048 * 2048
