"""Small helpers shared by the command modules: output and option parsing."""

from __future__ import annotations

import json
from typing import Any


def print_json(obj: Any) -> None:
    """Print one JSON document on stdout (sorted keys stay in the order we built them)."""
    from planner.cli._click import echo

    echo(json.dumps(obj, indent=2, default=str))


def console():
    """A rich console on stdout; wide enough that tables are not wrapped in pipes and tests."""
    from rich.console import Console

    return Console(soft_wrap=False, width=max(160, Console().width), highlight=False)


def console_to_stderr():
    """A rich console on stderr, for what --json output must not be mixed with."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)
