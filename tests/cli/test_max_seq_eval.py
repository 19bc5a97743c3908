"""``--max-seq`` (``planner.solve.longest_seq_len``) with an eval pass: where the eval prompt is the training
length (no ``--eval-seq-len``), the eval sequence is that length plus ``--generate-tokens``, which the model's
context must also hold, so the longest training sequence stops that many tokens short of the limit."""

from __future__ import annotations

import json

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.solve import longest_seq_len

# gpt2: n_positions 1024, learned positions; a small model on an 80 GiB device, so the context limit and not the
# memory decides the answer
GPT2, GPU = "gpt2", "a100-80gb"
BASE = dict(method="full", precision="bf16-mixed", micro_batch=1, seq_len=256, eval_batch=4)


def _solve(**extra):
    return longest_seq_len(spec=resolve_model(GPT2), gpu=get_gpu(GPU), config=TrainConfig(**BASE, **extra))


def test_generated_tokens_bound_the_longest_training_sequence():
    # the eval prompt is the training sequence: 512 + 512 generated = 1024, the model's context
    solved = _solve(generate_tokens=512)
    assert (solved.limit, solved.fits, solved.safe) == (512, 512, 512)  # 1024 - 512


def test_without_generation_or_with_a_fixed_prompt_the_limit_is_the_context():
    assert _solve().fits == 1024  # the eval forward reads seq_len tokens, no more
    # a fixed 256-token eval prompt + 512 generated = 768 <= 1024 whatever the training length
    assert _solve(eval_seq_len=256, generate_tokens=512).fits == 1024


def test_suggest_max_seq_says_the_bound(cli):
    result = cli("suggest", "-m", GPT2, "-g", GPU, "-b", "4", "--seq-len", "256", "--method", "full",
                 "--eval-batch", "4", "--generate-tokens", "512", "--max-seq", "-k", "1", "--no-save", "--json")
    assert result.code == 0, result
    (solved,) = json.loads(result.out)["max_seq"]
    assert (solved["limit"], solved["fits"]) == (512, 512)
    table = cli("suggest", "-m", GPT2, "-g", GPU, "-b", "4", "--seq-len", "256", "--method", "full",
                "--eval-batch", "4", "--generate-tokens", "512", "--max-seq", "-k", "1", "--no-save")
    assert "less the 512 tokens the eval pass generates" in table.out.replace("\n", " "), table


def test_estimate_solve_seq_len_says_the_bound(cli):
    result = cli("estimate", "-m", GPT2, "-g", GPU, "--seq-len", "256", "--method", "full", "--eval-batch", "4",
                 "--generate-tokens", "512", "--solve", "seq-len", "--json")
    assert result.code == 0, result
    assert (json.loads(result.out)["solved"]["fits"]) == 512
    text = cli("estimate", "-m", GPT2, "-g", GPU, "--seq-len", "256", "--method", "full", "--eval-batch", "4",
               "--generate-tokens", "512", "--solve", "seq-len")
    assert "beside the 512 tokens the eval pass generates" in text.out.replace("\n", " "), text
