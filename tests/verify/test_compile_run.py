"""A verify run of a compiled plan (``TrainConfig.compile``) on the CPU: torch.compile for real, or one refusal."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from planner.config import TrainConfig  # noqa: E402
from planner.errors import InvalidConfigError  # noqa: E402
from planner.results import RunOutcome  # noqa: E402
from workers import run_in_process  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def test_a_compiled_run_without_a_cpp_compiler_is_refused_in_one_line(monkeypatch):
    # Inductor builds its CPU kernels with $CXX, else g++ (torch/_inductor/config.py cpp.cxx)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(InvalidConfigError, match=r"^compile: .* no C\+\+ compiler \(g\+\+\): install one, or verify "
                                                 r"without --compile$"):
        run_in_process(model_config=LLAMA, config=TrainConfig(micro_batch=1, seq_len=32, compile=True))


@pytest.mark.slow
def test_a_compiled_run_compiles_the_timed_step_after_the_probe():
    import torch

    torch._dynamo.reset()
    config = TrainConfig(micro_batch=1, seq_len=32, precision="fp32", compile=True)
    measurement, details = run_in_process(model_config=LLAMA, config=config)
    assert measurement.outcome is RunOutcome.OK, measurement.error
    # the probe's dispatch mode keeps Dynamo out of the probed steps; the model compiled once it stopped
    assert details["compiled"].startswith("the timed step") and details["compile_s"] > 0
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] >= 1
