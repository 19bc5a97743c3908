"""Shared fixtures: every test runs against its own planner home and database."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def planner_home(tmp_path, monkeypatch):
    """Point the planner's data directory (and so its default SQLite file) at a temp folder."""
    home = tmp_path / "planner-home"
    monkeypatch.setenv("PLANNER_HOME", str(home))
    monkeypatch.delenv("PLANNER_DATABASE_URL", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


class CliResult:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def __repr__(self) -> str:
        return f"CliResult(code={self.code}, out={self.out[-2000:]!r}, err={self.err[-2000:]!r})"


@pytest.fixture
def cli(capsys):
    """Run ``planner ARGS...`` in-process; returns exit code, stdout and stderr."""
    from planner.cli import main

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
