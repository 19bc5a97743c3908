"""The picture of one step and the terminal's sparkline; ``--alloc-conf`` on ``planner estimate``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.plot import sparkline

LLAMA = "meta-llama/Llama-2-7b-hf"
GiB = 1024**3


def test_sparkline_maps_the_curve_to_eight_levels():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], width=8) == "▁▂▃▄▅▆▇█"
    assert sparkline(list(range(100)), width=10)[-1] == "█" and len(sparkline(list(range(100)), width=10)) == 10
    assert sparkline([]) == ""


def test_the_estimate_picture_is_a_png_with_the_capacity_line_and_the_peak_label(cli, tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    path = tmp_path / "t.png"
    result = cli("estimate", "--model", LLAMA, "--gpu", "a10g", "--method", "lora", "--timeline", path)
    # fp32 weights under autocast and no checkpointing do not fit an A10G (exit 3): the picture is
    # drawn all the same, it shows by how much
    assert result.code == 3 and "does NOT fit" in result.out, result.err
    assert f"timeline: {path}" in result.out
    assert "one step: " in result.out and "peak" in result.out
    with Image.open(path) as image:
        assert image.size == (1100, 550)


def test_the_picture_draws_capacity_usable_reserved_and_labels_the_peak():
    pytest.importorskip("matplotlib")
    from planner.estimation import step_curves
    from planner.plot import timeline_picture

    model, gpu = resolve_model(LLAMA), get_gpu("a10g")
    config = TrainConfig(method="qlora", micro_batch=4, seq_len=2048, grad_ckpt=True)
    estimate = estimate_memory(model=model, config=config, gpu=gpu)
    curves = step_curves(spec=model, gpu=gpu, config=config)
    fig, artists = timeline_picture(curves, estimate=estimate, capacity=gpu.memory_bytes, usable=20 * GiB, title="t")
    assert artists["capacity"].get_ydata()[0] == pytest.approx(gpu.memory_bytes / GiB)
    assert artists["usable"].get_ydata()[0] == pytest.approx(20)
    label = artists["peak_label"].get_text()
    from planner.units import format_bytes

    assert label.startswith(f"peak {format_bytes(estimate.peak_allocated_bytes)} at {estimate.peak_phase}")
    largest = max(estimate.breakdown, key=estimate.breakdown.get)
    assert largest in label
    # the reserve drawn is the replay's, never below the allocated bytes
    assert max(curves.reserved) == estimate.peak_reserved_bytes
    assert all(r >= a for r, a in zip(curves.reserved, curves.allocated))
    assert max(curves.allocated) == estimate.peak_allocated_bytes


def test_svg_and_html_pictures_carry_their_labels(cli, tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("t.svg", "t.html"):
        path = tmp_path / name
        assert cli("estimate", "--model", LLAMA, "--gpu", "a10g", "--method", "qlora", "--timeline", path).code == 3
        text = path.read_text()
        assert "capacity 22.5 GiB" in text and "peak " in text and "backward_start" in text
    bad = cli("estimate", "--model", LLAMA, "--gpu", "a10g", "--timeline", tmp_path / "t.jpg")
    assert bad.code != 0 and ".svg, .png or .html" in bad.err


def test_alloc_conf_changes_the_reserve_and_is_kept_with_the_config(cli):
    args = ("estimate", "--model", LLAMA, "--gpu", "a10g", "--method", "qlora", "--grad-ckpt", "--micro-batch", "4", "--json")
    default = json.loads(cli(*args).out)
    tuned = json.loads(cli(*args, "--alloc-conf", "max_split_size_mb:128,expandable_segments:True").out)
    assert tuned["memory"]["peak_allocated_bytes"] == default["memory"]["peak_allocated_bytes"]
    assert tuned["allocator"]["peak_reserved_bytes"] < default["allocator"]["peak_reserved_bytes"]
    assert tuned["memory"]["fragmentation_bytes"] < default["memory"]["fragmentation_bytes"]
    assert tuned["config"]["alloc_conf"] == "max_split_size_mb:128,expandable_segments:True"
    assert default["memory"]["peak_reserved_bytes"] >= default["memory"]["peak_allocated_bytes"]
    bad = cli(*args, "--alloc-conf", "max_split_size_mb:10")
    assert bad.code != 0 and "more than 20" in bad.err


def test_cpu_profile_has_no_caching_allocator_reserved_equals_allocated(cli):
    data = json.loads(cli("estimate", "--model", "gpt2", "--gpu", "cpu", "--seq-len", "128", "--json").out)
    memory = data["memory"]
    assert memory["peak_reserved_bytes"] == memory["peak_allocated_bytes"] == memory["process_total_bytes"]
    assert memory["fragmentation_bytes"] == 0 and data["allocator"]["replayed"] is False


def test_planning_imports_neither_torch_nor_matplotlib():
    code = ("import sys; from planner.cli import main; main(['estimate', '--model', 'gpt2', '--gpu', 'a10g', '--json']); "
            "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("[]")


def test_measured_points_are_aligned_on_the_predicted_moments():
    from planner.plot import StepCurves, align_measured

    curves = StepCurves(x=[0.0, 1.0], stacks={}, allocated=[0, 0], reserved=None,
                        marks={"forward": 0.5, "backward_end": 0.8}, peak_index=0, step_start=0.1)
    measured = [[0.0, 1], [1.0, 2], [2.0, 3], [3.0, 4], [4.0, 5]]
    phases = [[0.0, "forward"], [2.0, "backward"], [3.0, "optimizer"]]
    # 0 s -> the first forward (0.1), 2 s (backward starts) -> end of forward (0.5), 3 s (optimizer)
    # -> end of backward (0.8), the end -> 1; linear between
    assert align_measured(curves, measured, phases) == pytest.approx([0.1, 0.3, 0.5, 0.8, 1.0])
    assert align_measured(curves, measured) == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0])


TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}


def test_measure_draws_the_measured_step_over_the_predicted_one(cli, tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    path = tmp_path / "m.svg"
    result = cli("measure", "--model", config, "--gpu", "cpu", "--micro-batch", "2", "--seq-len", "32", "--no-save",
                 "--timeline", path)
    assert result.code == 0, result.err + result.out
    assert "measured over predicted" in result.out
    text = path.read_text()
    assert "measured" in text and "peak " in text and "above the scale" in text
