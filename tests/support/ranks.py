"""The sharding tests' 2-rank truth: a small llama trained by real ranks over gloo, each rank's peak
against the estimate for one rank (FSDP1's and FSDP2's tests share it)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from planner.config import TrainConfig

#: a small llama (2 decoder layers, vocabulary 8000, untied head) whose 2-rank run takes about 90 s
#: on the 2-core CI machine: its root unit (4.1 M parameters) is most of the model, as Llama-3's
#: embeddings and head are a large part of an 8B (1.05 B of 8.03 B)
RANK_LLAMA = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=8000, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)


def rank_errors(config: TrainConfig) -> list[tuple[dict[str, Any], int, int, float]]:
    """Each rank's (details, predicted, measured, signed error) of a 2-step run of ``config``: the
    peak c10's CPU allocator saw on the rank against ``estimate_memory``'s for one rank."""
    from planner.catalog import spec_from_config
    from planner.gpus import get_gpu
    from planner.memory import estimate_memory
    from workers.ranks import measure_ranks

    results = measure_ranks(model_config=RANK_LLAMA, config=config, timeout_s=1800, steps=2)
    spec = spec_from_config(RANK_LLAMA, model_id="tiny-llama", source="test")
    predicted = estimate_memory(model=spec, config=config, gpu=get_gpu("cpu")).peak_allocated_bytes
    assert len(results) == config.gpus
    out = []
    for measurement, details in results:
        assert measurement.outcome == "ok", measurement.error
        measured = measurement.peak_allocated_bytes
        out.append((details, predicted, measured, (predicted - measured) / measured))
    return out


@contextmanager
def one_rank_group(monkeypatch: Any) -> Iterator[None]:
    """A gloo process group of one rank on this process for the block (FSDP1 on the CPU wants one), made and
    destroyed here; one an earlier in-process test left is used as it is and left alone."""
    import torch.distributed as dist

    from planner.sharding.spec import free_port

    owned = not dist.is_initialized()
    if owned:
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                            ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()
