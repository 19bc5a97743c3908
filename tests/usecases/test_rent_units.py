"""How ``planner.rent`` splits a comparison over processes (``_each_device``): one GPU count on every
device a unit where there are at least as many counts as processes (the searches of one count share
most of their terms), else one device at every count; the options come back in the catalog's order."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from planner.gpus import get_gpu
from planner.rent import RentOption, _each_device

DEVICES = [get_gpu(name) for name in ("t4", "a10g", "l4")]


#: Each forked process's first unit waits here until the other process has taken one too, so that both
#: take work whatever the machine's load (a sleep was not enough: under CI's load one child took every unit
#: before the other had started). Made before each call, inherited by the children.
_BOTH_STARTED = None
_waited = False  # (per process: False in each child as forked)


def _pid_options(device, sizes):
    """An option per count, whose reason names the process that planned it."""
    global _waited
    if not _waited:
        _waited = True
        _BOTH_STARTED.wait(timeout=60)  # (a broken barrier fails the test rather than hanging it)
    return [RentOption(gpu=device.name, gpus=n, price=None, plan=None, tokens=1, reason=str(os.getpid()))
            for n in sizes]


def _both_start() -> None:
    global _BOTH_STARTED
    _BOTH_STARTED = multiprocessing.get_context("fork").Barrier(2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the processes are forked")
def test_each_gpu_count_is_planned_on_every_device_by_one_process():
    _both_start()
    planned = _each_device(DEVICES, (1, 2, 4, 8), _pid_options, processes=2)
    assert [[(o.gpu, o.gpus) for o in options] for options in planned] == [
        [(d.name, n) for n in (1, 2, 4, 8)] for d in DEVICES]
    by_count = {n: {o.reason for options in planned for o in options if o.gpus == n} for n in (1, 2, 4, 8)}
    assert all(len(pids) == 1 for pids in by_count.values()), by_count
    # (both processes took a count: the child's answers came back)
    assert len(set().union(*by_count.values())) == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the processes are forked")
def test_fewer_counts_than_processes_split_by_device():
    _both_start()
    planned = _each_device(DEVICES, (1,), _pid_options, processes=2)
    assert [[(o.gpu, o.gpus) for o in options] for options in planned] == [[(d.name, 1)] for d in DEVICES]
    assert len({options[0].reason for options in planned}) == 2  # (three devices over two processes)
