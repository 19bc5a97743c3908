"""Verification on Ray: the accelerator mapping, the driver's failure paths, and real runs on an
embedded Ray, on a local two-node cluster with a fake A10G node, and through a killed run.

The slow tests start real Ray (a few seconds each) and train a tiny llama for a few steps per
candidate on the CPU.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from support.ray import TINY, _free_port, _wait_for_the_job_agent, ray_head, tiny_config  # noqa: F401

from planner.errors import InvalidConfigError


def _plans(cli):
    return json.loads(cli("history", "--json", "-n", "100").out)


# ---- the accelerator mapping -----------------------------------------------------------------
def test_every_catalog_gpu_has_its_ray_accelerator_type_and_the_constants_are_rays():
    pytest.importorskip("ray")
    import ray.util.accelerators.accelerators as constants
    from ray._private.accelerators.amd_gpu import amd_product_dict
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

    from planner.gpus import list_gpus
    from planner.verify.accelerators import ACCELERATORS, ray_accelerator

    ray_values = {getattr(constants, name) for name in dir(constants) if name.isupper()}
    for gpu in list_gpus():
        accelerator = ray_accelerator(gpu)
        if gpu.is_cpu:
            assert accelerator is None
            continue
        if accelerator.constant is not None:
            assert getattr(constants, accelerator.constant) == accelerator.accelerator_type, gpu.name
        else:  # said to have none: Ray indeed defines none for it
            assert accelerator.accelerator_type not in ray_values, gpu.name
        if gpu.kernels.rocm:  # Ray names AMD GPUs by PCI device id: the MI300X OAM module is 0x74a1
            assert amd_product_dict["0x74a1"] == accelerator.accelerator_type, gpu.name
            continue
        # what a node with this GPU advertises by itself (Ray's NVML name detection)
        detected = NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(gpu.display_name)
        assert detected == accelerator.accelerator_type, (gpu.name, gpu.display_name, detected)
    assert {g.name for g in list_gpus() if not g.is_cpu} == set(ACCELERATORS)
    assert sorted(n for n, a in ACCELERATORS.items() if a.constant is None) == [
        "a10", "a40", "gh200", "l40", "rtx-a6000", "rtx3090", "rtx4090", "rtx5090", "rtx6000-ada"]


def test_which_nodes_can_run_a_verification():
    from planner.gpus import get_gpu
    from planner.verify.accelerators import node_accelerator_types, node_can_run, run_resources

    a10g, cpu = get_gpu("a10g"), get_gpu("cpu")
    gpu_node = {"CPU": 8.0, "GPU": 4.0, "accelerator_type:A10G": 1.0}
    cpu_node = {"CPU": 2.0}
    assert node_can_run(gpu_node, gpu=a10g, gpus=4) and not node_can_run(gpu_node, gpu=a10g, gpus=5)
    assert not node_can_run(cpu_node, gpu=a10g, gpus=1)
    assert not node_can_run({"CPU": 8.0, "GPU": 4.0, "accelerator_type:T4": 1.0}, gpu=a10g, gpus=1)
    assert node_can_run(cpu_node, gpu=cpu, gpus=1) and not node_can_run({"CPU": 0.0}, gpu=cpu, gpus=1)
    # one CPU per rank, all on one node (the placement group's STRICT_PACK)
    assert node_can_run(cpu_node, gpu=cpu, gpus=2) and not node_can_run(cpu_node, gpu=cpu, gpus=3)
    assert not node_can_run({"CPU": 3.0, "GPU": 4.0, "accelerator_type:A10G": 1.0}, gpu=a10g, gpus=4)
    assert node_accelerator_types(gpu_node) == ["A10G"] and node_accelerator_types(cpu_node) == []
    assert run_resources(gpu=a10g, gpus=1) == {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "A10G"}
    assert run_resources(gpu=cpu, gpus=1) == {"num_cpus": 1}


@pytest.mark.parametrize("kwargs, message", [
    ({"top": 0}, "--verify-top must be a whole number from 1 to 50, got 0"),
    ({"steps": 1}, "--steps must be a whole number from 2 to 100, got 1"),
    ({"timeout_s": 0}, "--run-timeout must be between 0 and 86400 seconds"),
])
def test_verify_options_are_validated_where_they_are_made(kwargs, message):
    from planner.verify.driver import VerifyOptions

    with pytest.raises(InvalidConfigError, match=message):
        VerifyOptions(**kwargs)


def test_the_job_driver_finds_its_submission_id(monkeypatch):
    from planner.verify.driver import current_job_id

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert current_job_id() is None
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "raysubmit_x"}}))
    assert current_job_id() == "raysubmit_x"


# ---- failures before anything runs -----------------------------------------------------------
def test_an_unreachable_cluster_is_one_line_exit_4_and_nothing_is_stored(cli, tiny_config):
    pytest.importorskip("ray")
    r = cli("suggest", "-m", tiny_config, "-g", "cpu", "-b", "4", "--seq-len", "64", "--verify", "--ray-address",
            "127.0.0.1:1")
    assert r.code == 4, r
    assert r.err.startswith("error: cannot reach the Ray cluster at 127.0.0.1:1: Connection refused"), r
    assert len(r.err.strip().splitlines()) == 1 and r.out == ""
    assert _plans(cli) == []


@pytest.mark.parametrize("address, message", [
    ("http://127.0.0.1:8265", "is a dashboard (job API) address: use it with 'planner submit --address'"),
    ("nonsense", "is not a Ray address: give auto, HOST:6379"),
    (":6379", "is not a Ray address: give auto, HOST:6379"),
    ("ray://head:70000", "is not a Ray address: give auto, HOST:6379"),  # past the last TCP port, 65535
])
def test_a_malformed_ray_address_is_bad_input_exit_2_and_nothing_is_stored(cli, tiny_config, address, message):
    # exit 4 is a cluster that cannot be reached (README's exit codes); an address of no Ray form is a usage error
    pytest.importorskip("ray")
    r = cli("suggest", "-m", tiny_config, "-g", "cpu", "-b", "4", "--seq-len", "64", "--verify", "--ray-address", address)
    assert r.code == 2, r
    assert len(r.err.strip().splitlines()) == 1 and message in r.err and r.out == "", r
    assert _plans(cli) == []
    # a verification job's driver, on a stored plan: refused before anything is printed, the plan left as planned
    assert cli("suggest", "-m", tiny_config, "-g", "cpu", "-b", "4", "--seq-len", "64", "-k", "1").code == 0
    (row,) = _plans(cli)
    r = cli("jobs", "verify", row["id"], "--model", tiny_config, "--ray-address", address)
    assert r.code == 2, r
    assert len(r.err.strip().splitlines()) == 1 and message in r.err and r.out == "", r
    assert [p["status"] for p in _plans(cli)] == ["planned"]


@pytest.mark.parametrize("plan_id, message", [("BADID", "is not an id"), ("0" * 32, "")])
def test_jobs_verify_of_an_unknown_plan_prints_nothing_before_the_refusal(cli, plan_id, message):
    pytest.importorskip("ray")
    r = cli("jobs", "verify", plan_id)
    assert r.code == 2, r
    assert r.out == "", r  # the driver's "verifying plan ..." header only once the runs have started
    assert r.err.startswith("error: ") and message in r.err and len(r.err.strip().splitlines()) == 1, r


def test_an_unreachable_job_api_is_one_line_exit_4(cli, tiny_config):
    pytest.importorskip("ray")
    for args in (("jobs", "list"), ("jobs", "status", "x"), ("submit", "-m", str(tiny_config), "-g", "cpu", "-b", "4")):
        r = cli(*args, "--address", "http://127.0.0.1:1")
        assert r.code == 4, r
        assert r.err.startswith("error: cannot reach the Ray job API at http://127.0.0.1:1") and len(r.err.strip().splitlines()) == 1
    assert _plans(cli) == []  # submit refused before storing its plan


def test_without_ray_installed_verify_names_the_extra(cli, tiny_config, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    r = cli("suggest", "-m", tiny_config, "-g", "cpu", "-b", "4", "--seq-len", "64", "--verify")
    assert r.code == 2
    assert r.err.strip() == "error: verification runs on Ray, which is not installed: pip install 'oom-planner[ray]'"
    assert _plans(cli) == []


def test_verify_refuses_no_save(cli, tiny_config):
    r = cli("suggest", "-m", tiny_config, "-g", "cpu", "-b", "4", "--verify", "--no-save")
    assert r.code == 2 and "drop --no-save" in r.err


# ---- real runs -------------------------------------------------------------------------------
@pytest.mark.slow
def test_verify_the_top_two_on_an_embedded_ray_then_answer_from_the_store(cli, tiny_config, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = ["suggest", "-m", tiny_config, "-g", "cpu", "-b", "4", "--seq-len", "64", "--verify", "--verify-top", "2"]
    r = cli(*args)
    assert r.code == 0, r
    assert "verified: measured vs predicted" in r.out and "answer: #" in r.out
    assert "queued" in r.out and "running" in r.out and "fits" in r.out  # plain progress lines off a terminal

    [row] = _plans(cli)
    assert row["status"] == "verified" and row["measurements"] == 2
    plan = json.loads(cli("show", row["id"], "--json").out)
    runs = [(c["memory"]["peak_allocated_bytes"], m) for c in plan["candidates"] for m in c["measurements"]]
    assert len(runs) == 2
    for predicted, measured in runs:
        assert measured["outcome"] == "ok" and "ray node" in measured["node"]
        assert abs(predicted - measured["peak_allocated_bytes"]) / measured["peak_allocated_bytes"] < 0.04
    assert plan["status_reason"].startswith("2 of the top 2 verified fitting")
    assert "yes" in cli("history").out

    # the same request again: answered from the store, no Ray, no new plan
    again = cli(*args, "--json")
    assert again.code == 0, again
    data = json.loads(again.out)
    assert data["from_store"] is True and data["plan_id"] == row["id"]
    assert data["verification"]["status"] == "verified" and len(data["verification"]["runs"]) == 2
    assert "answered from the store" in cli(*args).out
    assert len(_plans(cli)) == 1
    # --fresh plans again
    assert cli(*args[:-3], "--fresh").code == 0
    assert len(_plans(cli)) == 2


def _node_prefix(measurement: dict) -> str:
    return measurement["node"].rsplit("ray node ", 1)[1].rstrip(")")


@pytest.mark.slow
def test_an_a10g_run_lands_only_on_the_node_that_advertises_a10g(cli, tiny_config, monkeypatch):
    """A local two-node Ray cluster: a CPU-only head and a node with fake resources
    (num_gpus=1, accelerator_type:A10G). The a10g verification runs there (and fails, having no
    CUDA: an error result, then the next candidate); T4, or two A10Gs, are refused at once."""
    pytest.importorskip("torch")
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        a10g_node = cluster.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:A10G": 1})
        cluster.wait_for_nodes()
        address = cluster.address
        head_id, a10g_id = cluster.head_node.node_id, a10g_node.node_id

        started = time.monotonic()
        r = cli("suggest", "-m", tiny_config, "-g", "t4", "-b", "2", "--seq-len", "64", "--verify", "--ray-address", address)
        assert r.code == 4, r
        assert time.monotonic() - started < 60  # at once, not waiting for a node that never comes
        assert "has 1 x T4 GPU for --gpu t4: it has 1 x A10G on 1 node; CPUs only (1) on 1 node" in r.err
        assert "--resources '{\"accelerator_type:T4\": 1}'" in r.err and len(r.err.strip().splitlines()) == 1
        r = cli("suggest", "-m", tiny_config, "-g", "a10g", "-b", "2", "--seq-len", "64", "--gpus", "2", "--verify",
                "--ray-address", address)
        assert r.code == 4 and "has 2 x A10G GPU for --gpu a10g" in r.err, r

        r = cli("suggest", "-m", tiny_config, "-g", "a10g", "-b", "2", "--seq-len", "64", "--top-k", "2", "--verify",
                "--verify-top", "1", "--ray-address", address, "--json")
        assert r.code == 1, r  # no candidate could run: this machine has no CUDA
        verification = json.loads(r.out)["verification"]
        assert verification["status"] == "failed" and verification["reason"].startswith("no candidate fit when run")
        runs = verification["runs"]
        assert len(runs) == 2 and all(run["outcome"] == "error" for run in runs)  # the second replaced the first
        assert {_node_prefix(run) for run in runs} == {a10g_id[:8]} and head_id[:8] != a10g_id[:8]
    finally:
        cluster.shutdown()


def _kill_when_it_runs(marker: str, found: dict, *, target: str, deadline_s: float = 300) -> None:
    """Kill -9, as soon as it exists, the measurement process whose environment carries ``marker``
    (``target="child"``) or the Ray worker process running it (``target="ray worker"``)."""
    import psutil

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if "workers.child" in " ".join(proc.info["cmdline"] or ()) and proc.environ().get("PLANNER_VERIFY_RUN") == marker:
                    victim = proc if target == "child" else proc.parent()
                    time.sleep(1.0)  # mid-run: it is importing torch or training
                    os.kill(victim.pid, signal.SIGKILL)
                    found[target] = victim.pid
                    return
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.2)


@pytest.mark.slow
def test_runs_killed_mid_way_are_errors_and_the_next_candidates_are_verified(tiny_config, monkeypatch):
    """The measurement process of #1 and the Ray worker process of #2 are killed with SIGKILL while
    they run: both are stored as ``error`` saying so, #3 and #4 take their places, the plan completes."""
    pytest.importorskip("torch")
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from planner.planning import SuggestRequest, make_plan
    from planner.store import PlanStatus, open_store
    from planner.verify.driver import RunState, VerifyOptions, verify_plan

    planned = make_plan(SuggestRequest(model=str(tiny_config), gpu="cpu", target_batch=4, seq_len=64))
    with open_store() as store:
        plan_id = store.save_plan(result=planned.result)
        first, second = store.get_plan(plan_id=plan_id).candidates[:2]
        found: dict = {}
        killers = [threading.Thread(target=_kill_when_it_runs, args=(f"{plan_id}:{c.id}", found), kwargs={"target": t},
                                    daemon=True) for c, t in ((first, "child"), (second, "ray worker"))]
        for killer in killers:
            killer.start()
        report = verify_plan(store=store, plan_id=plan_id, gpu=planned.device, model_config=planned.spec.config,
                             options=VerifyOptions(top=2, num_cpus=2))
        for killer in killers:
            killer.join(timeout=5)
        assert set(found) == {"child", "ray worker"}
        stored = store.get_plan(plan_id=plan_id)
    states = {r.position: r.state for r in report.runs}
    assert [states[p] for p in range(4)] == [RunState.ERROR, RunState.ERROR, RunState.FITS, RunState.FITS]
    killed_child = stored.candidates[0].latest.measurement
    assert str(killed_child.outcome) == "error" and "killed by SIGKILL" in killed_child.error
    killed_worker = stored.candidates[1].latest.measurement
    assert str(killed_worker.outcome) == "error" and "the Ray worker process running it died" in killed_worker.error
    assert stored.status is PlanStatus.VERIFIED and report.answer in (2, 3)
    assert "2 other runs did not: #1 error, #2 error" in stored.status_reason


# ---- job submission to a real head -----------------------------------------------------------






@pytest.mark.slow
def test_submit_a_planning_job_wait_for_it_and_find_the_verified_plan(cli, tiny_config, ray_head):
    pytest.importorskip("torch")
    r = cli("submit", "--address", ray_head, "-m", tiny_config, "-g", "cpu", "-b", "4", "--seq-len", "64", "--verify",
            "--verify-top", "1", "--json")
    assert r.code == 0, r
    sent = json.loads(r.out)
    job_id, plan_id = sent["job_id"], sent["plan_id"]
    # the job verifies the stored plan by its id (nothing is planned again on the cluster); the
    # model's config.json travels with it
    assert sent["entrypoint"].startswith(f"planner jobs verify {plan_id} --model config.json ")
    # the database is this test's SQLite file, a URL without a credential: the driver gets it on
    # its command line (tests/verify/test_verify_secrets.py: a password is given by a file instead)
    db = f"sqlite:///{os.environ['PLANNER_HOME']}/planner.db"
    assert sent["entrypoint"].endswith(f"--verify-top 1 --steps 3 --run-timeout 900 --db {db}")

    status = cli("jobs", "status", job_id, "--wait", "--timeout", "600", "--address", ray_head, "--json")
    logs = cli("jobs", "logs", job_id, "--address", ray_head)
    assert status.code == 0, (status, logs.out[-3000:])
    data = json.loads(status.out)
    assert data["status"] == "SUCCEEDED" and data["terminal"] is True and data["plan_id"] == plan_id
    assert data["plan_status"] == "verified"

    # the SQL store the job wrote (this test's database, handed to it on the entrypoint)
    plan = json.loads(cli("show", plan_id, "--json").out)
    assert plan["status"] == "verified" and plan["ray_job_id"] == job_id
    [run] = [m for c in plan["candidates"] for m in c["measurements"]]
    assert run["outcome"] == "ok" and run["peak_allocated_bytes"] > 0
    assert logs.code == 0 and "answer: #1" in logs.out and "verified: measured vs predicted" in logs.out
    human = cli("jobs", "status", job_id, "--address", ray_head)
    assert f"job {job_id}: SUCCEEDED" in human.out and f"plan {plan_id}: verified" in human.out
    listed = json.loads(cli("jobs", "list", "--address", ray_head, "--json").out)
    assert [j["plan_id"] for j in listed if j["job_id"] == job_id] == [plan_id]
    missing = cli("jobs", "status", "raysubmit_nothere", "--address", ray_head)
    assert missing.code == 2 and "no Ray job 'raysubmit_nothere'" in missing.err


@pytest.mark.slow
def test_runs_are_held_to_the_planned_memory_and_an_oom_makes_way_for_the_next(tiny_config, monkeypatch):
    """On the cpu profile the plan's memory is the runs' limit (the probe's): a plan made for
    4 MiB OOMs when run; each OOM is stored as a result and the next candidate is tried."""
    pytest.importorskip("torch")
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from dataclasses import replace

    from planner.planning import SuggestRequest, make_plan
    from planner.store import PlanStatus, open_store
    from planner.verify.driver import RunState, VerifyOptions, verify_plan

    planned = make_plan(SuggestRequest(model=str(tiny_config), gpu="cpu", target_batch=4, seq_len=64, top_k=2))
    tiny_device = replace(planned.result.request, gpu_memory_bytes=4 * 1024**2)
    with open_store() as store:
        plan_id = store.save_plan(result=replace(planned.result, request=tiny_device))
        report = verify_plan(store=store, plan_id=plan_id, gpu=planned.device, model_config=planned.spec.config,
                             options=VerifyOptions(top=1, num_cpus=2))
        stored = store.get_plan(plan_id=plan_id)
    assert [r.state for r in report.runs] == [RunState.OOM, RunState.OOM]
    assert all("memory limit" in c.latest.measurement.error for c in stored.candidates)
    assert stored.status is PlanStatus.FAILED and stored.status_reason.startswith("no candidate fit when run: #1 oom")
