"""The first user's findings whose causes are in the search's request checks (planner/search.py,
planner/planning.py) and suggest's options: one wording per mistake on every command, and a
recipe no searched method takes is the user's mistake (exit 2), not "nothing fits" (exit 3)."""

from __future__ import annotations

import pytest
from support.cli import assert_user_error

SUGGEST = ("suggest", "-m", "gpt2", "-g", "t4", "-b", "4", "--no-save")


@pytest.mark.parametrize(("estimate_args", "suggest_args", "line"), [
    (["--seq-len", "0"], ["--seq-len", "0"], "error: --seq-len must be a whole number >= 1, got 0"),
    (["--seq-len", "5000"], ["--seq-len", "5000"], "error: --seq-len 5000 is longer than gpt2 allows (1024): use at most 1024"),
    (["--loop", "x"], ["--loop", "x"], "error: --loop must be one of trainer|manual, got 'x'"),
    (["--method", "full", "--lora-dropout", "0.1"], ["--method", "full", "--lora-dropout", "0.1"],
     "error: --lora-dropout only applies to LoRA: use --method lora or qlora, or drop it"),
    (["--method", "full", "--fused-ce"], ["--method", "full", "--fused-ce"],
     "error: --fused-ce with --method full is not modelled"),
])
def test_the_same_mistake_reads_the_same_in_estimate_and_suggest(cli, estimate_args, suggest_args, line):
    assert_user_error(cli("estimate", "-m", "gpt2", "-g", "t4", *estimate_args), line)
    assert_user_error(cli(*SUGGEST, *suggest_args), line)


def test_a_bad_policy_reads_as_every_bad_choice(cli):
    assert_user_error(cli(*SUGGEST, "--prefer", "fidelty"), "error: --prefer must be one of fidelity|speed, got 'fidelty'")
    assert_user_error(cli(*SUGGEST, "--top-k", "0"), "error: --top-k must be a whole number >= 1, got 0")


def test_fused_ce_for_an_encoder_is_refused_by_suggest_as_by_estimate(cli):
    """suggest planned LoRA with a fused causal-LM loss for BERT, which estimate refuses."""
    line = "error: --fused-ce fuses a causal LM's head and loss; bert-base-uncased is a masked-LM encoder: drop --fused-ce"
    assert_user_error(cli("estimate", "-m", "bert-base-uncased", "-g", "t4", "--method", "lora", "--fused-ce"), line)
    assert_user_error(cli("suggest", "-m", "bert-base-uncased", "-g", "t4", "-b", "4", "--no-save", "--fused-ce"), line)


def test_fused_ce_under_auto_still_plans_the_methods_that_take_it(cli):
    result = cli(*SUGGEST, "--fused-ce")
    assert result.code == 0, result
    assert "lora" in result.out


@pytest.mark.parametrize(("args", "line"), [
    (["--verify-top", "0"], "error: --verify-top must be a whole number from 1 to 50, got 0"),
    (["--steps", "1"], "error: --steps must be a whole number from 2 to 100, got 1"),
    (["--run-timeout", "nan"], "error: --run-timeout must be between 0 and 86400 seconds, got nan"),
])
def test_verification_options_are_checked_without_verify_too(cli, args, line):
    """They were ignored without --verify (and refused with it)."""
    assert_user_error(cli(*SUGGEST, *args), line)
