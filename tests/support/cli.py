"""Shared pieces of the CLI tests: a tiny config, the one-line error check, the documented exit codes."""

from __future__ import annotations

import json
import re

TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128,
}


ONE_ERROR_LINE = re.compile(r"^error: [^\n]+\n$")


def write_config(folder, **overrides):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**TINY, **overrides}))
    return path


def assert_user_error(result, *fragments):
    assert result.code == 2, result
    assert ONE_ERROR_LINE.match(result.err), result
    assert "Traceback" not in result.out + result.err
    for fragment in fragments:
        assert fragment in result.err, result


def exit_codes() -> set[int]:
    """0 (done), 1 (a run that failed), and the exit code of every ``PlannerError`` class
    (2 a user mistake, 3 nothing fits, ...): the codes the README documents."""
    from planner.errors import PlannerError

    classes, seen = [PlannerError], set()
    while classes:
        cls = classes.pop()
        seen.add(cls.exit_code)
        classes.extend(cls.__subclasses__())
    return {0, 1} | seen
