"""What HF Trainer's memory tracker costs the training thread's host work, measured on this machine.

fms-acceleration's benchmark harness runs its rows with ``--skip_memory_metrics False`` (for its memory
columns), so HF Trainer's ``TrainerMemoryTracker`` runs a thread beside the whole ``train()`` stage whose
``peak_monitor_func`` reads the process's RSS in a loop that does not sleep (transformers
trainer_utils.py ``peak_monitor_func``: "can't sleep or will not catch the peak right"). Both threads
need the GIL: each time the training thread gives it up (a ctypes call such as bitsandbytes'
``lib.cdequantize_blockwise_*``, a c10d collective, an event's ``synchronize()``) it must take it
back from the monitor, and while the training thread runs Python the monitor asks for it every
switch interval (``sys.getswitchinterval()``, 5 ms).

This script times, on one thread, per call:

* ``ctypes``: a foreign call through ``ctypes.CDLL`` (which releases the GIL around the call, as for
  bitsandbytes 0.43's ``lib`` calls: bitsandbytes/cextension.py loads it with ``ct.cdll.LoadLibrary``);
* ``torch``: a small aten op (``torch.add`` of two 64-element tensors: dispatch only, the GIL held);
* ``python``: a pure-Python function call;

without and with a thread running HF's ``peak_monitor_func`` (the same loop: psutil's
``memory_info().rss``), and prints the added seconds per call.

    python bench/gil_monitor.py [--calls 20000] [--repeats 5]

The monitor thread is started and joined here.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from typing import Any, Callable


class _PeakMonitor:
    """transformers trainer_utils.py ``TrainerMemoryTracker.peak_monitor_func``, as written there."""

    def __init__(self) -> None:
        import os

        import psutil

        self.process = psutil.Process(os.getpid())
        self.peak_monitoring = False
        self.cpu_mem_used_peak = -1
        self.thread: threading.Thread | None = None

    def cpu_mem_used(self) -> int:
        return self.process.memory_info().rss

    def peak_monitor_func(self) -> None:
        self.cpu_mem_used_peak = -1
        while True:
            self.cpu_mem_used_peak = max(self.cpu_mem_used(), self.cpu_mem_used_peak)
            if not self.peak_monitoring:
                break

    def __enter__(self) -> _PeakMonitor:
        self.peak_monitoring = True
        self.thread = threading.Thread(target=self.peak_monitor_func, daemon=True)
        self.thread.start()
        time.sleep(0.05)  # the monitor is looping before the timing starts
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak_monitoring = False
        assert self.thread is not None
        self.thread.join()


def _workloads() -> dict[str, Callable[[], Any]]:
    import torch

    libc = ctypes.CDLL(None)  # CDLL: the GIL is released around each foreign call
    a, b = torch.zeros(64), torch.ones(64)

    def python_call() -> int:
        return len("x")

    return {"ctypes": libc.getpid, "torch": lambda: torch.add(a, b), "python": python_call}


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(calls: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median wall seconds per call of each workload, alone and beside the monitor thread."""
    out: dict[str, dict[str, float]] = {}
    for name, fn in _workloads().items():
        alone, beside = [], []
        for _ in range(repeats):
            alone.append(_per_call(fn, calls))
            with _PeakMonitor():
                beside.append(_per_call(fn, calls))
        out[name] = {"alone_s": statistics.median(alone), "beside_monitor_s": statistics.median(beside)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"switch interval {sys.getswitchinterval() * 1e3:g} ms")
    for name, r in measure(args.calls, args.repeats).items():
        print(f"{name:7s} alone {r['alone_s'] * 1e6:8.2f} us/call, beside HF's peak monitor "
              f"{r['beside_monitor_s'] * 1e6:8.2f} us/call (+{(r['beside_monitor_s'] - r['alone_s']) * 1e6:.2f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
