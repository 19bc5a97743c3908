"""Shared fixtures: every test runs against its own planner home and database."""

from __future__ import annotations

import pytest

# anyio is a pytest plugin, so pytest rewrites its modules' asserts: a module anyio imports lazily
# (``anyio.open_file`` -> anyio._core._fileio, on the first static file a test server sends) is
# parsed with ``ast.parse`` in that server's worker thread. CPython 3.11 keeps the AST converter's
# recursion depth per interpreter, not per thread (python/cpython#106905), so a parse there beside a compile in another thread
# (the store opener importing alembic's migrations) raised "SystemError: AST constructor recursion
# depth mismatch" once in a whole-suite run. Imported here, in the main thread, before any server.
import anyio._core._fileio  # noqa: E402,F401

#: test files that start Ray (embedded ``ray.init()`` or a ``ray start --head`` of their own): run
#: in one pytest-xdist worker, one after the other, so that no two Ray clusters share the 2-core
#: machine and an embedded ``ray.init()`` never meets another test's head
RAY_FILES = frozenset({"test_verify.py", "test_api_verify.py", "test_verify_secrets.py", "test_verify_ranks.py"})
#: files whose test functions each run for minutes (real training runs in subprocesses) and share
#: nothing costly at module scope: a group per test function, so that the two workers split them
#: (test_emit_runs.py's two functions took 10.6 and 7.4 of a 33-minute whole-suite run's minutes,
#: --durations, both in one worker)
SPLIT_FILES = frozenset({"test_emit_runs.py"})


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (pyproject.toml), keep each file's tests in one
    worker (module-scoped fixtures, such as test_store_paging's 100,000 plans, are built once),
    each test function of SPLIT_FILES in one, and the Ray files in one worker together."""
    for item in items:
        name = item.path.name
        if name in SPLIT_FILES:
            name = f"{name}::{item.originalname}"
        item.add_marker(pytest.mark.xdist_group("ray" if name in RAY_FILES else name))


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
