"""Memory probes: one interface, a CPU and a CUDA implementation.

A probe is started before the model is built, its peak is reset right before the measured
optimizer step, and it is stopped after that step (see ``workers.train`` for the convention).

``CpuProbe`` counts live tensor *storage* bytes with a ``TorchDispatchMode``, the way torch's
``torch.distributed._tools.mem_tracker.MemTracker`` does (torch 2.13, mem_tracker.py
``_track`` / ``_WeakRefInfo.create_winfo`` / ``_delete_callback``): every op output's untyped
storages are looked up in a ``WeakIdKeyDictionary``; a storage seen for the first time is added
with ``nbytes()`` and a ``weakref`` whose callback subtracts it again when the storage is
garbage-collected. Views share their base's storage object, so a storage is counted once however
many tensors look at it. ``UntypedStorage.resize_`` is not a dispatched op, so (like MemTracker)
it is wrapped while the probe runs; DeepSpeed ZeRO-3 frees and re-gathers parameters that way.
Tensors made outside dispatch (safetensors loading, C++ extensions) are registered with
``track()`` (MemTracker's ``track_external``); the runner sweeps parameters, gradients and
optimizer states through it before the measured step.

``CudaProbe`` reads the caching allocator's own statistics. All torch imports are inside methods:
importing this module does not load torch.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Protocol, runtime_checkable

#: categories ``CpuProbe`` attributes live bytes to (anything not retagged stays ``other``)
CATEGORIES = ("parameters", "gradients", "optimizer_states", "other", "offloaded")

#: category of storages that stand for host memory (DeepSpeed's CPU-offloaded optimizer): on a GPU
#: they are not in the device allocator, so the CPU probe keeps them out of the peak too
OFFLOADED = "offloaded"


@runtime_checkable
class MemoryProbe(Protocol):
    """What the training loop needs from a memory probe."""

    def start(self) -> None:
        """Begin counting (CPU: enter the dispatch mode; CUDA: reset the allocator's peak)."""

    def reset_peak(self) -> None:
        """Forget the peak so far: the peak restarts at the bytes live now."""

    def stop(self) -> None:
        """Stop counting; the peak properties keep their values."""

    @property
    def peak_allocated_bytes(self) -> int | None: ...

    @property
    def peak_reserved_bytes(self) -> int | None: ...

    @property
    def process_total_bytes(self) -> int | None: ...


class ProbeMemoryLimitError(RuntimeError):
    """Live tracked bytes went over the probe's limit: the CPU stand-in for a CUDA OOM."""


def _raise_oom(message: str) -> None:
    """Raise torch's own OutOfMemoryError so the run classifies it exactly like a CUDA OOM."""
    import torch

    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None:
        try:
            raise oom(message)
        except TypeError:  # pragma: no cover - a torch whose OOM type cannot be built from Python
            pass
    raise ProbeMemoryLimitError(message)


class _StorageInfo:
    __slots__ = ("nbytes", "category", "made_by")

    def __init__(self, nbytes: int, category: str, made_by: str = "") -> None:
        self.nbytes = nbytes
        self.category = category
        self.made_by = made_by

#: With ``trace``, the live storages are listed again whenever the peak has grown by this much
#: since the last listing, so the listing is within this many bytes of the peak.
TRACE_RESOLUTION = 64 * 1024


class CpuProbe:
    """Peak of live tensor-storage bytes (all devices the ops touch, in practice the CPU).

    Storages tagged ``offloaded`` (with ``track(..., category="offloaded")``) are counted but
    kept out of the peak and the limit: they are the host side of a GPU run.

    ``limit_bytes``: when the live bytes after an op exceed it, the op's caller gets a
    ``torch.OutOfMemoryError`` (deterministic, unlike RLIMIT_AS, which also counts the
    interpreter, libraries and allocator slack). The op has already run, so the limit is
    enforced at op granularity: at most one op's output past the limit is ever allocated.
    """

    def __init__(self, *, limit_bytes: int | None = None, trace: bool = False) -> None:
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.trace = trace
        """Remember which op (and which library line) made each storage, and list the live ones
        near the peak (``peak_storages``): a debugging aid, many times slower."""
        self._making = ""
        self._traced: list[tuple[int, str, str]] = []
        self._traced_at = 0
        self.live_bytes = 0
        """Bytes of the storages alive now."""
        self.run_peak_bytes = 0
        """Peak since ``start()`` (not reset by ``reset_peak``)."""
        self._peak = 0
        self._live_by_cat = dict.fromkeys(CATEGORIES, 0)
        self.peak_breakdown: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        """Live bytes per category at the (reset) peak; all but ``offloaded`` sum to the peak."""
        self.phase = ""
        """Set by the runner (forward, backward, optimizer); recorded at the peak."""
        self.peak_phase = ""
        self._infos: Any = None  # WeakIdKeyDictionary storage -> (_StorageInfo, weakref)
        self._mode: Any = None
        self._orig_resize: Any = None
        self._lock = threading.RLock()  # re-entrant: a GC'd storage's callback may run inside

    # ---- protocol ----------------------------------------------------------------------
    def start(self) -> None:
        import torch
        from torch.utils.weak import WeakIdKeyDictionary

        assert self._mode is None, "CpuProbe.start() called twice"
        self._infos = WeakIdKeyDictionary()
        self._mode = _make_mode(self)
        self._orig_resize = torch.UntypedStorage.resize_
        probe, orig = self, self._orig_resize

        def resize_(st, size):  # same wrapper as MemTracker._track_resize
            result = orig(st, size)
            probe._on_resize(st)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._mode.__enter__()

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self.live_bytes - self._live_by_cat[OFFLOADED]
            self.peak_breakdown = dict(self._live_by_cat)
            self.peak_phase = self.phase
            if self.trace:
                self._list_live()

    def _list_live(self) -> None:
        self._traced = [(info.nbytes, info.category, info.made_by) for info, _ in list(self._infos.values())]
        self._traced_at = self._peak

    def peak_storages(self) -> list[tuple[int, int, str, str]]:
        """With ``trace``: (bytes, count, category, made by) of the storages live at the
        (reset) peak, within TRACE_RESOLUTION of it, largest first."""
        assert self.trace, "CpuProbe(trace=True) lists the storages at the peak"
        groups: dict[tuple[str, str], list[int]] = {}
        for nbytes, category, made_by in self._traced:
            group = groups.setdefault((category, made_by), [0, 0])
            group[0] += nbytes
            group[1] += 1
        return sorted(((n, c, cat, by) for (cat, by), (n, c) in groups.items()), reverse=True)

    def stop(self) -> None:
        import torch

        if self._mode is None:
            return
        self._mode.__exit__(None, None, None)
        torch.UntypedStorage.resize_ = self._orig_resize
        self._mode = None

    @property
    def peak_allocated_bytes(self) -> int:
        return self._peak

    @property
    def peak_reserved_bytes(self) -> None:
        return None  # no caching allocator to speak of on the CPU

    @property
    def process_total_bytes(self) -> None:
        return None

    # ---- counting ----------------------------------------------------------------------
    def track(self, tensors: Iterable[Any], *, category: str | None = None) -> None:
        """Count tensors made outside the mode and/or (re)tag their storages with ``category``."""
        import torch

        assert category is None or category in CATEGORIES, category
        for t in tensors:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._add_tensor(t, category or "other", retag=category is not None)
        self._update_peak()

    def _add_tensor(self, t: Any, category: str, *, retag: bool = False) -> None:
        from torch.distributed._tools.common_utils import get_untyped_storages

        for st in get_untyped_storages(t):
            found = self._infos.get(st)
            if found is not None:
                info = found[0]
                if retag and info.category != category:
                    with self._lock:
                        self._live_by_cat[info.category] -= info.nbytes
                        self._live_by_cat[category] += info.nbytes
                        info.category = category
                elif st.nbytes() != info.nbytes:  # resized outside our wrapper
                    self._on_resize(st)
                continue
            if st.device.type == "meta":
                continue
            import weakref

            info = _StorageInfo(st.nbytes(), category, self._making)
            ref = weakref.ref(st, lambda _ref, info=info: self._on_free(info))
            self._infos[st] = (info, ref)
            with self._lock:
                self.live_bytes += info.nbytes
                self._live_by_cat[category] += info.nbytes

    def _on_free(self, info: _StorageInfo) -> None:
        # weakref callbacks may run on any thread that drops the last reference
        with self._lock:
            self.live_bytes -= info.nbytes
            self._live_by_cat[info.category] -= info.nbytes

    def _on_resize(self, st: Any) -> None:
        found = self._infos.get(st) if self._infos is not None else None
        if found is None:
            return
        info = found[0]
        new = st.nbytes()
        with self._lock:
            delta = new - info.nbytes
            info.nbytes = new
            self.live_bytes += delta
            self._live_by_cat[info.category] += delta
        self._update_peak()

    def _update_peak(self) -> None:
        with self._lock:
            live = self.live_bytes - self._live_by_cat[OFFLOADED]
            if live > self.run_peak_bytes:
                self.run_peak_bytes = live
            if live > self._peak:
                self._peak = live
                self.peak_breakdown = dict(self._live_by_cat)
                self.peak_phase = self.phase
                if self.trace and live - self._traced_at > TRACE_RESOLUTION:
                    self._list_live()
        if self.limit_bytes is not None and live > self.limit_bytes:
            _raise_oom(
                f"CPU probe: {live} live tensor bytes (offloaded ones excluded) exceed the memory limit of "
                f"{self.limit_bytes} bytes"
            )


def _made_by(func: Any, out: Any) -> str:
    """``op (shape) dtype @ file:line`` of the innermost library frame outside torch."""
    import traceback

    import torch

    first = out[0] if isinstance(out, (tuple, list)) and out else out
    shape = f" {tuple(first.shape)} {str(first.dtype).removeprefix('torch.')}" if isinstance(first, torch.Tensor) else ""
    # the innermost frame of installed library code (transformers, peft, deepspeed, torch.nn and
    # torch.optim) that is not torch's own dispatch machinery
    frames = [
        f for f in traceback.extract_stack()[:-3]
        if "site-packages" in f.filename and "/torch/utils/" not in f.filename and "/torch/_" not in f.filename
    ]
    where = f" @ {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
    return f"{func.__name__}{shape}{where}"


def _make_mode(probe: CpuProbe):
    """The dispatch mode, defined here so that importing this module does not import torch."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map_only
    import torch

    class _CountingMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if probe.trace:
                probe._making = _made_by(func, out)
            tree_map_only(torch.Tensor, lambda t: probe._add_tensor(t, "other"), out)
            probe._update_peak()
            return out

    return _CountingMode()


class CudaProbe:
    """The CUDA caching allocator's peak statistics for one device.

    process total = peak reserved + what the process held outside the allocator at ``start()``
    (device total - free - reserved: the CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers),
    i.e. what nvidia-smi would show at the peak, assuming those outside bytes do not change
    during the run (the context is created before ``start()``; cuBLAS workspaces are made on the
    first matmul, so they are counted only when the run warmed up before the measured step,
    which it does: the measured step is the last of several).
    """

    def __init__(self, *, device: str = "cuda", limit_bytes: int | None = None) -> None:
        self.device = device
        self.limit_bytes = limit_bytes
        self._outside_bytes = 0
        self._peak_alloc: int | None = None
        self._peak_reserved: int | None = None
        self._total: int | None = None
        self._running = False
        self.phase = ""
        self.peak_phase = ""

    def start(self) -> None:
        import torch

        dev = torch.device(self.device)
        torch.cuda.init()
        if self.limit_bytes is not None:
            _, total = torch.cuda.mem_get_info(dev)
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.limit_bytes / total), dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self._running = True

    def reset_peak(self) -> None:
        import torch

        dev = torch.device(self.device)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        free, total = torch.cuda.mem_get_info(dev)
        self._outside_bytes = max(0, total - free - torch.cuda.memory_reserved(dev))
        self._total = total

    def stop(self) -> None:
        import torch

        if not self._running:
            return
        dev = torch.device(self.device)
        torch.cuda.synchronize(dev)
        self._peak_alloc = int(torch.cuda.max_memory_allocated(dev))
        self._peak_reserved = int(torch.cuda.max_memory_reserved(dev))
        self._running = False

    @property
    def peak_allocated_bytes(self) -> int | None:
        return self._peak_alloc

    @property
    def peak_reserved_bytes(self) -> int | None:
        return self._peak_reserved

    @property
    def process_total_bytes(self) -> int | None:
        if self._peak_reserved is None:
            return None
        return self._peak_reserved + self._outside_bytes

    @property
    def device_total_bytes(self) -> int | None:
        return self._total


def make_probe(*, device: str, limit_bytes: int | None = None, trace: bool = False) -> CpuProbe | CudaProbe:
    """The probe for ``device`` (``cpu`` or ``cuda[:N]``); everything else in a run is the same.
    ``trace`` (CPU only) lists what is live at the peak."""
    if device == "cpu":
        return CpuProbe(limit_bytes=limit_bytes, trace=trace)
    if trace:
        raise ValueError("trace lists live storages with the CPU probe: use device='cpu'")
    if device.startswith("cuda"):
        return CudaProbe(device=device, limit_bytes=limit_bytes)
    raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")


__all__ = ["CATEGORIES", "OFFLOADED", "CpuProbe", "CudaProbe", "MemoryProbe", "ProbeMemoryLimitError", "make_probe"]
