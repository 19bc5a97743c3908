"""``planner calibrate``: the pure fit on hand-made numbers, the command on stored runs (hand-made
and real CPU runs), plans that use and name a calibration, ``--reset``, refusals."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone

import pytest

from planner.calibration import (
    Calibration,
    CalibrationValues,
    MemoryRun,
    StepRun,
    apply_calibration,
    fit_calibration,
)
from planner.calibration.fit import bounded_least_squares
from planner.units import MiB

GPU_DEFAULTS = CalibrationValues(mfu={"fp32": 0.5, "fp16": 0.45, "bf16": 0.45}, bandwidth_efficiency=0.8,
                                 cuda_context_bytes=512 * MiB)
CPU_DEFAULTS = dataclasses.replace(GPU_DEFAULTS, cuda_context_bytes=None)


def step(i: int, *, matmul: float, memory: float = 0.0, fixed: float = 0.0, measured: float, dtype: str = "bf16") -> StepRun:
    return StepRun(id=f"run{i}", dtype=dtype, matmul_s=matmul, memory_s=memory, fixed_s=fixed, measured_s=measured)


def by_key(fit):
    return {c.key: c for c in fit.constants}


# ---- the fit on hand-made numbers ---------------------------------------------------------------
def test_bounded_least_squares_by_hand():
    # one unknown, rows [1], [1], targets 2 and 4: the mean, 3; capped at 2.5 by its bound
    assert bounded_least_squares([[1.0], [1.0]], [2.0, 4.0], bounds=[(0.0, 10.0)], prior=[3.0]) == pytest.approx([3.0])
    assert bounded_least_squares([[1.0], [1.0]], [2.0, 4.0], bounds=[(0.0, 2.5)], prior=[3.0]) == pytest.approx([2.5])
    # two unknowns, u1 + u2 = 3 and u1 - u2 = 1 exactly: (2, 1); with u2 >= 1.5 the best is the
    # projection along the face u2 = 1.5: minimise (u1 - 1.5)^2 + (u1 - 2.5)^2 -> u1 = 2
    assert bounded_least_squares([[1, 1], [1, -1]], [3, 1], bounds=[(0, 9), (0, 9)], prior=[1, 1]) == pytest.approx([2, 1], abs=1e-5)
    assert bounded_least_squares([[1, 1], [1, -1]], [3, 1], bounds=[(0, 9), (1.5, 9)], prior=[1, 1]) == pytest.approx([2, 1.5], abs=1e-5)


def test_one_mfu_is_recovered_exactly():
    # t = M / 0.3: the relative errors vanish at mfu = 0.3 (the pull toward 0.45 moves it < 1e-5)
    runs = [step(i, matmul=m, measured=m / 0.3) for i, m in enumerate([1.0, 2.0, 5.0])]
    fit = fit_calibration(steps=runs, memory=[], defaults=CPU_DEFAULTS)
    mfu = by_key(fit)["mfu.bf16"]
    assert mfu.value == pytest.approx(0.3, rel=1e-4) and mfu.default == 0.45 and mfu.runs == 3
    # before: predicted M / 0.45 against M / 0.3 -> 0.3 / 0.45 - 1 = -33.3% on every run
    assert mfu.before.median_abs_pct == pytest.approx(100 / 3) and mfu.before.mean_pct == pytest.approx(-100 / 3)
    assert mfu.after.max_abs_pct < 0.01
    assert fit.values() == CalibrationValues(mfu={"bf16": mfu.value})  # bandwidth: no run has a memory-bound part
    assert by_key(fit)["bandwidth_efficiency"].value is None
    assert fit.defaults() == CalibrationValues(mfu={"bf16": 0.45})


def test_mfu_and_bandwidth_are_fitted_jointly():
    # t = M / 0.3 + B / 0.6 for four runs with different M:B ratios: both are recovered
    pairs = [(1.0, 1.0), (2.0, 1.0), (1.0, 3.0), (4.0, 0.5)]
    runs = [step(i, matmul=m, memory=b, fixed=0.1, measured=m / 0.3 + b / 0.6 + 0.1) for i, (m, b) in enumerate(pairs)]
    fit = fit_calibration(steps=runs, memory=[], defaults=CPU_DEFAULTS)
    values = fit.values()
    assert values.mfu["bf16"] == pytest.approx(0.3, rel=1e-4)
    assert values.bandwidth_efficiency == pytest.approx(0.6, rel=1e-4)
    # run 0 before: 1/0.45 + 1/0.8 + 0.1 = 3.5722 against 1/0.3 + 1/0.6 + 0.1 = 5.1 -> -29.96%
    assert min(abs(e) for e in [fit.step_before.median_abs_pct, fit.step_before.max_abs_pct]) > 29
    assert fit.step_after.max_abs_pct < 0.01


def test_an_mfu_above_one_is_cut_at_its_bound():
    # measured 1.5x faster than the peak allows: the fit would say mfu 1.5, physics says <= 1
    runs = [step(i, matmul=m, measured=m / 1.5) for i, m in enumerate([1.0, 2.0, 3.0])]
    mfu = by_key(fit_calibration(steps=runs, memory=[], defaults=CPU_DEFAULTS))["mfu.bf16"]
    assert mfu.value == 1.0 and mfu.at_bound


def test_a_part_below_the_share_does_not_inform_its_constant():
    # memory part 0.04 s at 100% -> 0.05 s at the default 0.8, of a 1/0.45 + 0.05 = 2.27 s step: 2%
    runs = [step(i, matmul=1.0, memory=0.04, measured=1 / 0.3 + 0.04 / 0.8) for i in range(4)]
    fit = fit_calibration(steps=runs, memory=[], defaults=CPU_DEFAULTS)
    bw = by_key(fit)["bandwidth_efficiency"]
    assert bw.runs == 0 and bw.value is None and "needs 3 runs" in bw.note
    assert fit.values().mfu["bf16"] == pytest.approx(0.3, rel=1e-3)


def test_too_few_runs_fit_nothing():
    runs = [step(i, matmul=1.0, memory=1.0, measured=5.0) for i in range(2)]
    fit = fit_calibration(steps=runs, memory=[], defaults=CPU_DEFAULTS)
    assert fit.fitted == () and fit.values().empty
    assert {c.note for c in fit.constants} == {"needs 3 runs where it is >= 10% of the step, has 2"}


def test_the_cuda_context_is_the_median_outside_the_allocator():
    # outside = total - reserved - paged: 600, 610 and an odd 5000 MiB -> the median, 610 MiB
    runs = [MemoryRun(id=f"m{i}", predicted_allocated=900 * MiB, measured_allocated=900 * MiB,
                      predicted_reserved=1000 * MiB, measured_reserved=1000 * MiB, predicted_outside=50 * MiB,
                      measured_total=(1050 + extra) * MiB) for i, extra in enumerate([600, 610, 5000])]
    fit = fit_calibration(steps=[], memory=runs, defaults=GPU_DEFAULTS)
    context = by_key(fit)["cuda_context_bytes"]
    assert context.value == 610 * MiB and fit.values().cuda_context_bytes == 610 * MiB
    # before: 1050 + 512 = 1562 MiB against 1650 -> -5.33%, against 1660 -> -5.90%, against 6050 -> -74.2%
    assert context.before.median_abs_pct == pytest.approx(100 * (1660 - 1562) / 1660)
    # after: 1660 against 1650 (+0.61%), 1660 (0%), 6050 (-72.6%)
    assert context.after.median_abs_pct == pytest.approx(100 * 10 / 1650)
    assert fit.total_after.median_abs_pct < fit.total_before.median_abs_pct
    assert fit.reserved.max_abs_pct == 0 and fit.allocated.max_abs_pct == 0


def test_no_context_is_fitted_on_the_cpu():
    runs = [MemoryRun(id="m", predicted_allocated=100, measured_allocated=101)]
    fit = fit_calibration(steps=[], memory=runs, defaults=CPU_DEFAULTS)
    assert "cuda_context_bytes" not in by_key(fit)
    assert fit.allocated.max_abs_pct == pytest.approx(100 / 101)


@pytest.mark.parametrize("make, message", [
    (lambda: StepRun(id="x", dtype="fp8", matmul_s=1, memory_s=0, fixed_s=0, measured_s=1), "dtype 'fp8'"),
    (lambda: StepRun(id="x", dtype="bf16", matmul_s=1, memory_s=0, fixed_s=0, measured_s=0), "measured step > 0"),
    (lambda: CalibrationValues(mfu={"bf16": 1.2}), "MFU bf16 must be a fraction in (0, 1]"),
    (lambda: CalibrationValues(bandwidth_efficiency=0), "bandwidth efficiency must be a fraction"),
    (lambda: CalibrationValues(cuda_context_bytes=-1), "CUDA context bytes"),
    (lambda: fit_calibration(steps=[], memory=[], defaults=CalibrationValues()), "defaults must give"),
])
def test_bad_fit_inputs_are_value_errors(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def _calibration(**values) -> Calibration:
    return Calibration(id=3, gpu="a10g", created_at=datetime(2026, 11, 22, tzinfo=timezone.utc), measurements=12,
                       values=CalibrationValues(**values), defaults=CalibrationValues(mfu={"bf16": 0.45}, bandwidth_efficiency=0.8,
                                                                                   cuda_context_bytes=512 * MiB))


def test_a_calibration_describes_itself_and_scales_the_step_parts():
    from planner.catalog import resolve_model
    from planner.config import TrainConfig
    from planner.gpus import get_gpu
    from planner.throughput import default_utilization, estimate_throughput

    cal = _calibration(mfu={"bf16": 0.41})
    assert cal.describe() == "calibration #3 for a10g (12 measurements, 2026-11-22): mfu bf16 0.41 (default 0.45)"
    a10g = get_gpu("a10g")
    assert apply_calibration(get_gpu("t4"), cal) == get_gpu("t4")  # another device's calibration is ignored
    calibrated = apply_calibration(a10g, cal)
    spec, config = resolve_model("gpt2"), TrainConfig(seq_len=512)
    before = estimate_throughput(model=spec, config=config, gpu=a10g)
    after = estimate_throughput(model=spec, config=config, gpu=calibrated)
    # the FLOPs take default / 0.41 as long (SDPA's attention is FLOPs alone); the memory-bound
    # optimizer update is unchanged
    default = default_utilization(gpu=a10g, precision="bf16-mixed")
    assert after.breakdown_s["attention"] == pytest.approx(before.breakdown_s["attention"] * default / 0.41)
    assert after.breakdown_s["optimizer"] == before.breakdown_s["optimizer"]
    assert cal.describe() in after.assumptions and not any("calibration #" in a for a in before.assumptions)
    both = apply_calibration(a10g, _calibration(bandwidth_efficiency=0.4, cuda_context_bytes=600 * MiB))
    assert estimate_throughput(model=spec, config=config, gpu=both).breakdown_s["optimizer"] == pytest.approx(
        before.breakdown_s["optimizer"] * 0.8 / 0.4)
    assert both.cuda_context_bytes == 600 * MiB and "memory bandwidth efficiency 0.4 (default 0.8), CUDA context 600 MiB (default 512 MiB)" in both.calibration


# ---- the command on hand-made stored runs -------------------------------------------------------
def _store_run(*, gpu: str, micro_batch: int, seq_len: int, truth: dict, context_mib: int | None = None,
               precision: str = "bf16-mixed", model: str = "gpt2") -> None:
    """Store one ``ok`` run as ``planner measure`` does, its step and process total made from
    ``truth`` constants (a GPU this machine does not have)."""
    from planner.catalog import fingerprint, resolve_model
    from planner.estimation import build_config
    from planner.gpus import get_gpu
    from planner.memory import estimate_memory
    from planner.results import Candidate, Measurement, PlanRequest
    from planner.store import open_store
    from planner.throughput import estimate_throughput

    spec, device = resolve_model(model), get_gpu(gpu)
    # the fused AdamW (the searched one): the sizes below were chosen for its 7-pass update (A10G_SIZES)
    config = build_config(spec, device, seq_len=seq_len, micro_batch=micro_batch, precision=precision,
                          optimizer="adamw_fused")
    memory = estimate_memory(model=spec, config=config, gpu=device)
    true_device = dataclasses.replace(device, **truth)
    step_s = estimate_throughput(model=spec, config=config, gpu=true_device).step_s
    total = None
    if context_mib is not None:
        total = memory.process_total_bytes - device.cuda_context_bytes + context_mib * MiB
    measurement = Measurement(outcome="ok", device=device.display_name, peak_allocated_bytes=memory.peak_allocated_bytes,
                              peak_reserved_bytes=memory.peak_reserved_bytes if context_mib is not None else None,
                              process_total_bytes=total, step_s=step_s, tokens_per_s=micro_batch * seq_len / step_s)
    request = PlanRequest(model_id=spec.id, model_fingerprint=fingerprint(spec), gpu=device.name, gpu_count=1,
                          gpu_memory_bytes=device.memory_bytes, target_batch=micro_batch, seq_len=seq_len,
                          constraints={"measure": config.to_dict()})
    candidate = Candidate(config=config, memory=memory, throughput=estimate_throughput(model=spec, config=config, gpu=device),
                          fits=True, rank=1)
    with open_store() as store:
        store.record_single_measurement(request=request, candidate=candidate, measurement=measurement)


A10G_TRUTH = {"mfu": {"bf16": 0.3}, "bandwidth_efficiency": 0.5}
# sizes where gpt2's matmuls are >= 10% of the step (MIN_SHARE) in three runs: the FLOPs grow with
# the tokens, the weights' and the optimizer's traffic does not; none bound by the host's dispatch
# (at 1 x 128 and 1 x 256 it is: calibrate fits the device's rates only, planner.throughput.calibration_terms)
A10G_SIZES = [(2, 512), (4, 1024), (2, 1024), (4, 512)]


def test_calibrate_a_gpu_from_stored_runs_then_plans_use_and_name_it(cli):
    for micro, seq in A10G_SIZES:
        _store_run(gpu="a10g", micro_batch=micro, seq_len=seq, truth=A10G_TRUTH, context_mib=700)
    r = cli("calibrate", "--gpu", "A10G")
    assert r.code == 0, r
    assert "a10g: 4 measurements (4 with a step time, 4 with a memory peak)" in r.out
    assert "stored calibration #1 for a10g (4 measurements, " in r.out
    # the A10G's default large-GEMM fraction is its measured 1.0 of the 70 TFLOPS the catalog gives it (planner.kernels)
    assert "mfu bf16 0.3 (default 1), memory bandwidth efficiency 0.5 (default 0.8), CUDA context 700 MiB (default 512 MiB)" in r.out
    assert "step time over 4 runs: median |error| " in r.out and "-> 0.0%" in r.out
    assert "process total over 4 runs" in r.out

    est = json.loads(cli("estimate", "--model", "gpt2", "--gpu", "a10g", "--seq-len", "256", "--json").out)
    named = [a for a in est["throughput"]["assumptions"] if a.startswith("calibration #1 for a10g (4 measurements")]
    assert len(named) == 1 and "MFU calibrated" in est["throughput"]["assumptions"][0]
    assert est["memory"]["process_total_bytes"] - est["memory"]["peak_reserved_bytes"] == 700 * MiB

    plan = json.loads(cli("suggest", "--model", "gpt2", "--gpu", "a10g", "--target-batch", "8", "--seq-len", "256", "--json").out)
    assert all(named[0] in p["throughput"]["assumptions"] for p in plan["plans"])
    shown = " ".join(cli("show", plan["plan_id"][:8]).out.split())  # show wraps long lines
    assert f"#1 assumes: {named[0]}" in shown
    assert "uses calibration #1 for a10g" in cli("suggest", "--model", "gpt2", "--gpu", "a10g", "--target-batch", "8",
                                                 "--seq-len", "256", "--no-save").out

    # --reset: plans go back to the defaults; the calibration is kept, inactive
    reset = cli("calibrate", "--gpu", "a10g", "--reset")
    assert reset.code == 0 and "dropped calibration #1 for a10g" in reset.out
    est = json.loads(cli("estimate", "--model", "gpt2", "--gpu", "a10g", "--seq-len", "256", "--json").out)
    assert not any("calibration #" in a for a in est["throughput"]["assumptions"])
    assert est["memory"]["process_total_bytes"] - est["memory"]["peak_reserved_bytes"] == 512 * MiB
    assert "has no active calibration" in cli("calibrate", "--gpu", "a10g", "--reset").out
    from planner.store import open_store

    with open_store() as store:
        [kept] = store.calibrations(gpu="a10g")
    assert not kept.active and kept.dropped_at is not None and kept.values.cuda_context_bytes == 700 * MiB


def test_a_new_calibration_replaces_the_active_one_and_json(cli):
    for micro, seq in A10G_SIZES:
        _store_run(gpu="a10g", micro_batch=micro, seq_len=seq, truth=A10G_TRUTH)
    first = json.loads(cli("calibrate", "--json").out)  # no --gpu: every device with runs
    assert [c["gpu"] for c in first["calibrated"]] == ["a10g"] and first["refused"] == []
    assert first["calibrated"][0]["calibration"]["values"]["mfu"]["bf16"] == pytest.approx(0.3, rel=1e-3)
    context = {c["key"]: c for c in first["calibrated"][0]["fit"]["constants"]}["cuda_context_bytes"]
    assert context["value"] is None and "measured the process total, has 0" in context["note"]
    second = json.loads(cli("calibrate", "--gpu", "a10g", "--json").out)["calibrated"][0]["calibration"]
    from planner.store import open_store

    with open_store() as store:
        assert store.active_calibration(gpu="a10g").id == second["id"] == first["calibrated"][0]["calibration"]["id"] + 1
        assert [c.active for c in store.calibrations(gpu="a10g")] == [True, False]


def test_too_few_measurements_are_refused_with_how_many_and_how(cli):
    r = cli("calibrate", "--gpu", "cpu")
    assert r.code == 5 and r.out == ""
    assert r.err.startswith("error: no usable ok measurements of cpu in the store: calibrate needs at least 3; ")
    assert "planner measure --gpu cpu --model M" in r.err and len(r.err.strip().splitlines()) == 1
    for micro, seq in A10G_SIZES[:2]:
        _store_run(gpu="a10g", micro_batch=micro, seq_len=seq, truth=A10G_TRUTH)
    r = cli("calibrate", "--gpu", "a10g")
    assert r.code == 5
    assert r.err.startswith("error: too few measurements to calibrate a10g: a constant needs 3 ok runs")
    assert "has mfu bf16 2, memory bandwidth efficiency 2, CUDA context 0" in r.err and "planner measure --gpu a10g" in r.err
    assert cli("calibrate").code == 5  # every device refused
    from planner.store import open_store

    with open_store() as store:
        assert store.calibrations() == []


@pytest.mark.parametrize("args, message", [
    (["calibrate", "--gpu", "b200x"], "error: unknown GPU 'b200x'"),
    (["calibrate", "--reset"], "error: --reset drops one device's calibration: name it with --gpu"),
    (["calibrate", "--gpu"], "error: option '--gpu' requires an argument"),
    (["calibrate", "--bogus"], "error: no such option: --bogus"),
])
def test_bad_input_is_one_line_and_exit_2(cli, args, message):
    r = cli(*args)
    assert r.code == 2 and r.err.startswith(message) and len(r.err.strip().splitlines()) == 1, r


def test_a_run_whose_model_is_gone_is_left_out(cli, tmp_path):
    from planner.calibration.runs import fit_runs
    from planner.store import open_store

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000,
                                  "max_position_embeddings": 256}))
    _store_run(gpu="cpu", micro_batch=1, seq_len=64, truth={}, model=str(config))
    config.unlink()
    with open_store() as store:
        runs = fit_runs(store.measured_runs(gpu="cpu"))
    assert runs.ids == () and len(runs.left_out) == 1 and "its model no longer resolves" in runs.left_out[0].reason


# ---- real CPU runs ------------------------------------------------------------------------------
TINY = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000, "max_position_embeddings": 512}
FIT_SIZES = [(1, 32), (2, 128), (2, 256), (4, 64)]
HELD_BACK = [(1, 96), (2, 192), (4, 128)]


@pytest.mark.slow
def test_fitted_on_real_cpu_runs_it_predicts_held_back_runs_better(cli, tmp_path, capsys, monkeypatch):
    """Seven real ``planner measure --gpu cpu`` runs of a tiny llama (about 6 s each): fit on four,
    check on the three held back (another database) that the calibrated constants predict their
    step time better than the defaults. The runs use one thread: under the whole suite another
    process holds a core, and torch's two-thread parallel regions then wait for a descheduled thread
    (steps 10-20x slower, by how the scheduler falls, in CI's run of 2026-11-26: held-back error
    98.6 % -> 40.5 % median but 568 % max), a noise no constant fits; one thread is a steady machine
    (the calibration takes up its 1.5x as a lower rate)."""
    pytest.importorskip("torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from planner.calibration.fit import ErrorStats, predict_step
    from planner.calibration.runs import default_values, fit_runs
    from planner.gpus import get_gpu
    from planner.store import open_store

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    fit_db, held_db = f"sqlite:///{tmp_path / 'fit.db'}", f"sqlite:///{tmp_path / 'held.db'}"
    # fit and held-back runs alternate, so both see the same load of the (shared) machine
    order = [(db, size) for pair in zip(FIT_SIZES, [*HELD_BACK, None]) for db, size in zip((fit_db, held_db), pair) if size]
    for db, (micro, seq) in order:
        r = cli("measure", "--model", config, "--gpu", "cpu", "--micro-batch", micro, "--seq-len", seq, "--db", db, "--json")
        assert r.code == 0, r
    r = cli("calibrate", "--gpu", "cpu", "--db", fit_db)
    assert r.code == 0, r
    assert "stored calibration #1 for cpu (4 measurements" in r.out and "memory: nothing to fit on cpu" in r.out
    with open_store(url=fit_db) as store:
        calibration = store.active_calibration(gpu="cpu")
    with open_store(url=held_db) as store:
        held = fit_runs(store.measured_runs(gpu="cpu"))
    assert len(held.steps) == 3
    defaults = default_values(get_gpu("cpu"))
    fitted_mfu = {**defaults.mfu, **calibration.values.mfu}
    fitted_bw = calibration.values.bandwidth_efficiency or defaults.bandwidth_efficiency
    before = ErrorStats.of([(predict_step(s, mfu=defaults.mfu, bandwidth_efficiency=defaults.bandwidth_efficiency), s.measured_s)
                            for s in held.steps])
    after = ErrorStats.of([(predict_step(s, mfu=fitted_mfu, bandwidth_efficiency=fitted_bw), s.measured_s) for s in held.steps])
    with capsys.disabled():  # the numbers, for the record (pytest -s)
        print(f"\nheld back: median |error| {before.median_abs_pct:.1f}% -> {after.median_abs_pct:.1f}%, "
              f"max {before.max_abs_pct:.1f}% -> {after.max_abs_pct:.1f}%; {calibration.describe()}")
    assert after.median_abs_pct < before.median_abs_pct and after.max_abs_pct < before.max_abs_pct

    # a later plan uses it: estimate's step is the fit's prediction, and the calibration is named
    est = json.loads(cli("estimate", "--model", config, "--gpu", "cpu", "--micro-batch", 2, "--seq-len", 192,
                         "--db", fit_db, "--json").out)
    assert calibration.describe() in est["throughput"]["assumptions"]
    # the held-back runs come back in the order they ran: HELD_BACK[1] is micro-batch 2 x 192
    assert est["throughput"]["step_s"] == pytest.approx(predict_step(held.steps[1], mfu=fitted_mfu, bandwidth_efficiency=fitted_bw))


def test_looking_up_a_calibration_leaves_no_database_behind(cli, planner_home):
    """estimate reads the device's calibration from the store; with no database yet it plans
    with the defaults and does not create one (opening a missing SQLite file creates it)."""
    r = cli("estimate", "--model", "gpt2", "--gpu", "a10g", "--json")
    assert r.code == 0, r
    assert not any("calibration #" in a for a in json.loads(r.out)["throughput"]["assumptions"])
    assert not (planner_home / "planner.db").exists()
    from planner.errors import DatabaseMissingError
    from planner.store import open_store

    with pytest.raises(DatabaseMissingError, match="no database at"):
        open_store(create=False)
    assert not (planner_home / "planner.db").exists()
