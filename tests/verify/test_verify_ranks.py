"""Multi-rank verification on Ray (``planner.verify.ranks``): how ranks meet and what a run of N
ranks reports, then real 2-rank runs of a tiny llama on an embedded Ray on the CPU (gloo): an
FSDP2 and a ZeRO-2 candidate verified with both ranks' peaks stored and shown, and a rank killed
mid-run failing the run with that rank named and nothing left behind.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import replace

import pytest
from support.ray import TINY, tiny_config  # noqa: F401 - fixture

from planner.results import Measurement
from planner.verify.ranks import RankedRun, rank_bundles, rendezvous


# ---- without Ray ---------------------------------------------------------------------------
def test_ranks_meet_at_rank_0_and_on_gpus_see_the_groups_gpus():
    cpu = [{"node_id": "n1", "address": "10.0.0.5", "gpu_ids": [], "port": 29123},
           {"node_id": "n1", "address": "10.0.0.5", "gpu_ids": [], "port": None}]
    env, device, visible = rendezvous(cpu, rank=1)
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29123"}
    assert (device, visible) == ("cpu", None)
    # Ray gave ranks 0..2 the node's GPUs 3, 1 and 10: each sees all three, trains on its own
    gpus = [{"node_id": "n1", "address": "10.0.0.5", "gpu_ids": [g], "port": 29123 if g == "3" else None}
            for g in ("3", "1", "10")]
    seen = [rendezvous(gpus, rank=k) for k in range(3)]
    assert [s[2] for s in seen] == ["1,3,10"] * 3
    assert [(s[0]["RANK"], s[0]["LOCAL_RANK"], s[1]) for s in seen] == [("0", "1", "cuda:1"), ("1", "0", "cuda:0"),
                                                                        ("2", "2", "cuda:2")]


def test_a_run_of_n_ranks_asks_for_n_bundles():
    from planner.gpus import get_gpu

    assert rank_bundles(gpu=get_gpu("cpu"), gpus=2) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert rank_bundles(gpu=get_gpu("a10g"), gpus=2) == [{"CPU": 1.0, "GPU": 1.0, "accelerator_type:A10G": 0.001}] * 2


def _ranked(results: dict[int, Measurement], *, failed: int | None = None) -> RankedRun:
    from planner.config import TrainConfig
    from planner.verify.runs import RunSpec

    spec = RunSpec(key="p:c", model_config=TINY, config=TrainConfig(gpus=2, micro_batch=2, seq_len=64), device="cpu")
    return RankedRun(run=spec, tokens_per_step=4 * 64, group=None, actors=[], refs=["r0", "r1"], results=results,
                     failed=failed)


def test_the_run_is_its_worst_rank_and_its_slowest_step():
    a = Measurement(outcome="ok", device="cpu", peak_allocated_bytes=900, peak_reserved_bytes=900,
                    process_total_bytes=5000, step_s=0.5, node="h (ray node 1)", started_at="2026-11-26T09:00:01+00:00",
                    finished_at="2026-11-26T09:00:09+00:00")
    b = replace(a, peak_allocated_bytes=1000, process_total_bytes=4000, step_s=0.25, started_at="2026-11-26T09:00:00+00:00")
    run, ranks = _ranked({0: a, 1: b}).outcome()
    assert ranks == (a, b)
    assert (run.peak_allocated_bytes, run.process_total_bytes, run.step_s) == (1000, 5000, 0.5)
    assert run.tokens_per_s == 4 * 64 / 0.5 and run.node == "h (ray node 1)"
    assert (run.started_at, run.finished_at) == ("2026-11-26T09:00:00+00:00", "2026-11-26T09:00:09+00:00")


def test_a_failed_run_names_its_rank_and_the_ranks_it_stopped():
    oom = Measurement(outcome="oom", device="cpu", error="OutOfMemoryError: memory limit of 4.0 MiB")
    run, ranks = _ranked({1: oom}, failed=1).outcome()
    assert str(run.outcome) == "oom" and run.error == "rank 1 of 2: OutOfMemoryError: memory limit of 4.0 MiB"
    assert ranks[1] == oom
    assert str(ranks[0].outcome) == "error" and ranks[0].error == "stopped: rank 1 failed the run first"


def test_the_tables_show_each_ranks_peak_against_the_prediction(tiny_config):
    """``planner show``'s comparison and ``suggest --verify``'s table: one row per rank, the worst
    marked, each against the per-device prediction; a failed rank shows its cause."""
    from rich.console import Console

    from planner.cli.store import comparison_table
    from planner.cli.verify_view import verification_table
    from planner.store import open_store

    planned, result = _two_rank_plan(tiny_config, "fsdp2")
    predicted = result.plans[0].memory.peak_allocated_bytes
    low = Measurement(outcome="ok", device="cpu", peak_allocated_bytes=predicted // 2, step_s=0.1)
    high = replace(low, peak_allocated_bytes=predicted * 2)
    with open_store() as store:
        plan_id = store.save_plan(result=result)
        [stored] = store.get_plan(plan_id=plan_id).candidates
        store.record_measurement(candidate_id=stored.id, measurement=high, ranks=(low, high))
        plan = store.get_plan(plan_id=plan_id)
    console = Console(record=True, width=250)
    console.print(verification_table(plan, answer=0, reserved=False))
    console.print(comparison_table([(1, plan.candidates[0])], title="t"))
    text = console.export_text()
    assert "rank 0 " in text and "rank 1 (worst)" in text and "rank 1 peak allocated (worst)" in text
    assert text.count("+100.0%") == 2 and text.count("-50.0%") == 4  # rank 0 twice; rank 1 and the run twice


# ---- real ranks on an embedded Ray ---------------------------------------------------------
@pytest.fixture
def ray_here(monkeypatch):
    """An embedded Ray of 2 CPUs that the test owns (the driver uses the running session), shut
    down after it."""
    pytest.importorskip("torch")
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    import logging

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _two_rank_plan(tiny_config, *schemes: str):
    """A stored-to-be plan of the tiny llama on 2 CPU ranks: per scheme its fp32 SGD candidate
    (DDP's, which the search ranks below 8-bit AdamW, estimated from FSDP2's configuration)."""
    from planner.memory import estimate_memory
    from planner.planning import SuggestRequest, make_plan
    from planner.results import Candidate
    from planner.throughput import estimate_throughput

    picked = []
    for scheme in schemes:
        planned = make_plan(SuggestRequest(model=str(tiny_config), gpu="cpu", gpus=2, target_batch=4, seq_len=64,
                                           schemes=("fsdp2" if scheme == "ddp" else scheme,), method="full",
                                           precision="fp32", allow_offload=False, top_k=20))
        [one] = [c for c in planned.result.plans if str(c.config.optimizer) == "sgd"][:1]
        if scheme == "ddp":
            config = one.config.replace(zero=0)
            one = Candidate(config=config, memory=estimate_memory(model=planned.spec, config=config, gpu=planned.device),
                            throughput=estimate_throughput(model=planned.spec, config=config, gpu=planned.device),
                            fits=True)
        picked.append(replace(one, rank=len(picked) + 1))
    return planned, replace(planned.result, plans=tuple(picked))


def _leftovers(marker_prefix: str) -> list[str]:
    """Measurement processes of this plan's runs, and this test's rank actors, still alive. An
    actor counts only under this process (the embedded Ray's raylet is its child): another suite's
    or another Ray's ``RankWorker`` on the same machine is not this test's leftover (a newcomer's
    suite beside CI's clean clone failed here on the other's actors)."""
    import psutil

    ours = {child.pid for child in psutil.Process().children(recursive=True)}
    left = []
    for proc in psutil.process_iter(["cmdline", "pid"]):
        try:
            line = " ".join(proc.info["cmdline"] or ())
            if "workers.child" in line and proc.environ().get("PLANNER_VERIFY_RUN", "").startswith(marker_prefix):
                left.append(f"{proc.pid} {line}")
            elif "RankWorker" in line and proc.pid in ours:
                left.append(f"{proc.pid} {line}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


def _nothing_left(ray, plan_id: str, *, within_s: float = 30) -> None:
    from ray.util.placement_group import placement_group_table

    end = time.monotonic() + within_s
    while (left := _leftovers(plan_id)) and time.monotonic() < end:
        time.sleep(0.5)
    assert left == []
    assert {g["state"] for g in placement_group_table().values()} <= {"REMOVED"}


@pytest.mark.slow
def test_fsdp2_zero2_and_ddp_candidates_are_verified_by_two_ranks_each(ray_here, cli, tiny_config):
    pytest.importorskip("deepspeed")
    from fastapi.testclient import TestClient

    from planner.answers import verification_dict
    from planner.service import create_app
    from planner.service.settings import ServiceSettings
    from planner.store import PlanStatus, default_database_url, open_store
    from planner.verify.driver import RunState, VerifyOptions, verify_plan

    planned, result = _two_rank_plan(tiny_config, "fsdp2", "zero2", "ddp")
    assert [c.config.sharding.scheme for c in result.plans] == ["fsdp2", "zero2", "ddp"]
    started = time.monotonic()
    with open_store() as store:
        plan_id = store.save_plan(result=result)
        report = verify_plan(store=store, plan_id=plan_id, gpu=planned.device, model_config=planned.spec.config,
                             options=VerifyOptions(top=3, steps=2))
        plan = store.get_plan(plan_id=plan_id)
    took = time.monotonic() - started
    assert [r.state for r in report.runs] == [RunState.FITS] * 3, [r.note for r in report.runs]
    assert plan.status is PlanStatus.VERIFIED
    for stored in plan.candidates:
        run = stored.latest
        print(stored.candidate.config.label(), stored.candidate.memory.peak_allocated_bytes,
              [r.peak_allocated_bytes for r in run.ranks], [r.step_s for r in run.ranks])
        assert len(run.ranks) == 2 and all(str(r.outcome) == "ok" and r.peak_allocated_bytes > 0 for r in run.ranks)
        assert run.measurement.peak_allocated_bytes == max(r.peak_allocated_bytes for r in run.ranks)
        assert run.worst_rank in (0, 1) and "ray node" in run.ranks[0].node
        predicted = stored.candidate.memory.peak_allocated_bytes
        for r in run.ranks:  # each rank against the per-device prediction (the 2-rank CPU rows' bounds are bench/accuracy's)
            assert abs(predicted - r.peak_allocated_bytes) / r.peak_allocated_bytes < 0.5, (stored.candidate.config.label(),
                                                                                          predicted, r)
    _nothing_left(ray_here, plan_id)

    # planner show: text and --json; the verification's JSON; the HTTP answer
    text = cli("show", plan_id).out
    assert text.count("rank 0 peak allocated") == 3 and text.count("rank 1 peak allocated") == 3 and "(worst)" in text
    shown = json.loads(cli("show", plan_id, "--json").out)
    for candidate, stored in zip(shown["candidates"], plan.candidates):
        [run] = candidate["measurements"]
        assert [r["rank"] for r in run["ranks"]] == [0, 1] and run["worst_rank"] == stored.latest.worst_rank
        for r, kept in zip(run["ranks"], stored.latest.ranks):
            assert r["peak_allocated_bytes"] == kept.peak_allocated_bytes
            assert r["predicted_peak_allocated_bytes"] == candidate["memory"]["peak_allocated_bytes"]
            p, m = r["predicted_peak_allocated_bytes"], r["peak_allocated_bytes"]
            assert r["peak_error_pct"] == round(100 * (p - m) / m, 2)
    runs = verification_dict(plan)["runs"]
    assert [len(r["ranks"]) for r in runs] == [2, 2, 2] and all("peak_error_pct" in k for r in runs for k in r["ranks"])
    with TestClient(create_app(ServiceSettings(database_url=default_database_url()))) as api:
        answered = api.get(f"/v1/plans/{plan_id}").json()
    assert answered["candidates"] == shown["candidates"]
    print(f"3 candidates x 2 ranks verified in {took:.1f} s")


def _kill_rank(marker: str, rank: str, found: dict, *, deadline_s: float = 300) -> None:
    """SIGKILL, a second after it exists, the measurement process of ``rank`` of the run ``marker``."""
    import psutil

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for proc in psutil.process_iter(["cmdline"]):
            try:
                env = proc.environ() if "workers.child" in " ".join(proc.info["cmdline"] or ()) else {}
                if env.get("PLANNER_VERIFY_RUN") == marker and env.get("RANK") == rank:
                    time.sleep(1.0)  # mid-run: importing torch, joining the group or training
                    os.kill(proc.pid, signal.SIGKILL)
                    found["pid"] = proc.pid
                    return
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.2)


@pytest.mark.slow
def test_a_rank_killed_mid_run_fails_the_run_naming_it_and_leaves_nothing(ray_here, tiny_config):
    from planner.store import PlanStatus, open_store
    from planner.verify.driver import RunState, VerifyOptions, verify_plan

    planned, result = _two_rank_plan(tiny_config, "fsdp2")
    with open_store() as store:
        plan_id = store.save_plan(result=result)
        [stored] = store.get_plan(plan_id=plan_id).candidates
        found: dict = {}
        killer = threading.Thread(target=_kill_rank, args=(f"{plan_id}:{stored.id}", "1", found), daemon=True)
        killer.start()
        report = verify_plan(store=store, plan_id=plan_id, gpu=planned.device, model_config=planned.spec.config,
                             options=VerifyOptions(top=1, steps=2))
        killer.join(timeout=5)
        plan = store.get_plan(plan_id=plan_id)
    assert "pid" in found
    assert [r.state for r in report.runs] == [RunState.ERROR]
    run = plan.candidates[0].latest
    assert str(run.measurement.outcome) == "error"
    assert run.measurement.error.startswith("rank 1 of 2: measurement process killed by SIGKILL"), run.measurement.error
    assert run.worst_rank == 1 and "killed by SIGKILL" in run.ranks[1].error
    # rank 0 waited on rank 1 in a collective (or was still starting): stopped, not waited for
    assert run.ranks[0].error == "stopped: rank 1 failed the run first" or str(run.ranks[0].outcome) == "ok"
    assert plan.status is PlanStatus.FAILED and "#1 error (rank 1 of 2: measurement process killed by SIGKILL" in plan.status_reason
    _nothing_left(ray_here, plan_id)


@pytest.mark.slow
def test_more_ranks_than_a_node_has_cpus_is_refused_at_once(ray_here, tiny_config):
    """3 ranks of one CPU each on a 2-CPU Ray: the placement group could never be placed, so the
    verification is refused before anything runs, naming what the cluster has."""
    from planner.errors import NoMatchingNodeError
    from planner.planning import SuggestRequest, make_plan
    from planner.store import PlanStatus, open_store
    from planner.verify.driver import VerifyOptions, verify_plan

    planned = make_plan(SuggestRequest(model=str(tiny_config), gpu="cpu", gpus=3, target_batch=3, seq_len=64, top_k=1))
    with open_store() as store:
        plan_id = store.save_plan(result=planned.result)
        with pytest.raises(NoMatchingNodeError, match=r"has 3 CPUs \(one per rank\) for --gpu cpu: it has CPUs only \(2\)"):
            verify_plan(store=store, plan_id=plan_id, gpu=planned.device, model_config=planned.spec.config,
                        options=VerifyOptions(top=1, steps=2))
        assert store.get_plan(plan_id=plan_id).status is PlanStatus.PLANNED


@pytest.mark.slow
def test_a_rank_that_ooms_fails_the_run_naming_it_and_leaves_nothing(ray_here, tiny_config):
    """Held to 4 MiB (the plan's memory, the CPU probe's limit on each rank), a rank OOMs: the run
    is stored ``oom`` naming that rank and its cause, the other rank is stopped or ended so."""
    from planner.store import PlanStatus, open_store
    from planner.verify.driver import RunState, VerifyOptions, verify_plan

    planned, result = _two_rank_plan(tiny_config, "fsdp2")
    tiny_device = replace(result, request=replace(result.request, gpu_memory_bytes=4 * 1024**2))
    with open_store() as store:
        plan_id = store.save_plan(result=tiny_device)
        report = verify_plan(store=store, plan_id=plan_id, gpu=planned.device, model_config=planned.spec.config,
                             options=VerifyOptions(top=1, steps=2))
        plan = store.get_plan(plan_id=plan_id)
    assert [r.state for r in report.runs] == [RunState.OOM]
    run = plan.candidates[0].latest
    failed = run.worst_rank
    assert str(run.measurement.outcome) == "oom" and run.measurement.error.startswith(f"rank {failed} of 2: ")
    assert "memory limit" in run.measurement.error and "memory limit" in run.ranks[failed].error
    other = run.ranks[1 - failed]
    assert other.error == f"stopped: rank {failed} failed the run first" or str(other.outcome) == "oom"
    assert plan.status is PlanStatus.FAILED and plan.status_reason.startswith("no candidate fit when run: #1 oom")
    _nothing_left(ray_here, plan_id)
