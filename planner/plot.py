"""The picture of one step: predicted live memory over an optimizer step, stacked by category.

``timeline_picture`` draws the timeline of ``planner.memory.timeline`` (weights, gradients,
optimizer states, activations, logits/loss, temporaries), the device's capacity and usable lines,
the caching allocator's replayed reserve over the allocated bytes, the peak labelled with its
largest terms and, when given, a measured curve over the predicted one. ``sparkline`` is the same
curve as one line of text for the terminal.

matplotlib is an optional extra (``pip install 'oom-planner[plot]'``), imported when a picture is
drawn: the planning path never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from planner.errors import InvalidConfigError, MissingDependencyError

#: the kinds of file ``--timeline`` writes
FORMATS = (".svg", ".png", ".html")
SPARK = "▁▂▃▄▅▆▇█"
_COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868", "activations": "#c44e52",
           "logits/loss": "#8172b3", "temporaries": "#937860"}


@dataclass(frozen=True, kw_only=True)
class StepCurves:
    """What the picture draws, computed without matplotlib."""

    x: list[float]
    """Progress through the step, 0..1, one point per event (and one before the first)."""
    stacks: dict[str, list[int]]
    """Live bytes by category at each point."""
    allocated: list[int]
    reserved: list[int] | None
    """The caching allocator's reserve at each point (None without one)."""
    marks: dict[str, float]
    """Moment -> its x."""
    peak_index: int
    step_start: float = 0.0
    """x where the step's first forward begins (the model states come before it)."""


def step_curves(timeline, *, reserved: Sequence[int] | None = None) -> StepCurves:
    """Per-category live bytes over the timeline's events."""
    from planner.memory.timeline import CATEGORIES, category

    n = len(timeline.events)
    live = {name: 0 for name in CATEGORIES}
    stacks = {name: [0] for name in CATEGORIES}
    for ev in timeline.events:
        live[category(ev.key)] += ev.nbytes if ev.op == "alloc" else -ev.nbytes
        for name in CATEGORIES:
            stacks[name].append(live[name])
    allocated = timeline.curve()
    return StepCurves(
        x=[i / max(n, 1) for i in range(n + 1)], stacks=stacks, allocated=allocated,
        reserved=list(reserved) if reserved is not None else None,
        marks={name: index / max(n, 1) for name, index in timeline.marks.items()},
        peak_index=timeline.marks[timeline.peak_phase],
        step_start=timeline.start / max(n, 1),
    )


def align_measured(curves: StepCurves, measured: Sequence[Sequence[float]],
                   phases: Sequence[Sequence[Any]] | None = None) -> list[float]:
    """The x of each measured point: the measured step's time mapped piecewise linearly so that
    its start, its last backward, its optimizer step and its end fall on the predicted step's
    first forward, the end of the last forward, the end of backward and the end."""
    end = max((t for t, _ in measured), default=0.0) or 1.0
    anchors = [(0.0, curves.step_start)]
    starts = {}
    for t, name in phases or ():
        if name == "backward":
            starts["backward"] = t  # the last micro-step's
        elif name == "optimizer" and "optimizer" not in starts:
            starts["optimizer"] = t
    if "backward" in starts:
        anchors.append((starts["backward"], curves.marks["forward"]))
    if "optimizer" in starts and starts["optimizer"] > anchors[-1][0]:
        anchors.append((starts["optimizer"], curves.marks["backward_end"]))
    anchors.append((end, 1.0))
    xs = []
    for t, _ in measured:
        for (t0, x0), (t1, x1) in zip(anchors, anchors[1:]):
            if t <= t1 or (t1, x1) == anchors[-1]:
                xs.append(x0 + (x1 - x0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0))
                break
    return xs


def sparkline(values: Sequence[int], *, width: int = 60) -> str:
    """The curve as one line of block characters, each the largest value of its stretch."""
    if not values:
        return ""
    top = max(max(values), 1)
    per = max(1, -(-len(values) // width))
    cells = [max(values[i:i + per]) for i in range(0, len(values), per)]
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in cells)


def _peak_label(estimate, *, terms: int = 3) -> str:
    from planner.units import format_bytes

    largest = sorted(estimate.breakdown.items(), key=lambda kv: -kv[1])[:terms]
    lines = [f"peak {format_bytes(estimate.peak_allocated_bytes)} at {estimate.peak_phase}"]
    lines += [f"{key} {format_bytes(value)}" for key, value in largest]
    return "\n".join(lines)


def timeline_picture(curves: StepCurves, *, estimate, capacity: int, usable: int, title: str,
                     measured: Sequence[Sequence[float]] | None = None,
                     measured_phases: Sequence[Sequence[Any]] | None = None) -> tuple[Any, dict[str, Any]]:
    """(figure, its named artists: ``capacity``, ``usable``, ``reserved``, ``peak_label``,
    ``measured``) of one step; ``measured``: [seconds, bytes] of a measured step, drawn over the
    predicted one (aligned on its ``measured_phases``, [seconds, phase])."""
    plt = _pyplot()
    gib = 1024**3
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=100)
    names = [name for name, ys in curves.stacks.items() if any(ys)]
    ax.stackplot(curves.x, *[[v / gib for v in curves.stacks[n]] for n in names], labels=names,
                 colors=[_COLORS[n] for n in names], alpha=0.85, step="post")
    artists: dict[str, Any] = {}
    artists["capacity"] = ax.axhline(capacity / gib, color="black", linewidth=1.5, label=f"capacity {capacity / gib:.1f} GiB")
    artists["usable"] = ax.axhline(usable / gib, color="black", linestyle="--", linewidth=1, label="usable (safety margin)")
    if curves.reserved is not None:
        (artists["reserved"],) = ax.step(curves.x, [v / gib for v in curves.reserved], where="post", color="#222222",
                                         linewidth=1, linestyle=":", label="reserved (caching allocator)")
    if measured:
        (artists["measured"],) = ax.plot(align_measured(curves, measured, measured_phases), [b / gib for _, b in measured],
                                         color="#e7298a", linewidth=1.5, label="measured")
    for name, x in curves.marks.items():
        ax.axvline(x, color="grey", linewidth=0.5, alpha=0.6)
        ax.text(x, 0, f" {name}", rotation=90, va="bottom", ha="right", fontsize=7, color="#444444")
    px, py = curves.x[curves.peak_index], curves.allocated[curves.peak_index] / gib
    artists["peak_label"] = ax.annotate(_peak_label(estimate), xy=(px, py), xytext=(0.02, 0.97), textcoords="axes fraction",
                                        va="top", fontsize=8, arrowprops={"arrowstyle": "->", "color": "#333333"},
                                        bbox={"boxstyle": "round", "fc": "white", "alpha": 0.9})
    ax.set_xlim(0, 1)
    top = max(max(curves.reserved or curves.allocated), max((b for _, b in measured or ()), default=0)) * 1.15
    if capacity <= 2 * top:
        top = max(top, capacity * 1.05)
    else:  # a host's RAM on the cpu profile: the lines are far above the curve
        ax.text(0.99, 0.97, f"capacity {capacity / gib:.1f} GiB, usable {usable / gib:.1f} GiB: above the scale",
                transform=ax.transAxes, ha="right", va="top", fontsize=8)
    ax.set_ylim(0, top / gib)
    ax.set_xlabel("progress through one optimizer step (events in order)")
    ax.set_ylabel("GiB per device")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=7, bbox_to_anchor=(1.0, 0.92))
    fig.tight_layout()
    return fig, artists


def write_picture(fig, path: str | Path) -> Path:
    """Save as .svg, .png or .html (an SVG inside a page)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise InvalidConfigError(f"--timeline {path}: write a .svg, .png or .html file")
    import io

    buffer = io.BytesIO()  # drawn in memory, then written: a file that cannot be written is one line
    fig.savefig(buffer, format="svg" if suffix == ".html" else suffix[1:])
    _pyplot().close(fig)
    data = buffer.getvalue()
    if suffix == ".html":
        page = f"<!doctype html><meta charset='utf-8'><title>{path.stem}</title>\n{data.decode('utf-8')}\n"
        data = page.encode("utf-8")
    from planner.files import discard, partial_of

    part = partial_of(path)
    try:  # beside it, then renamed: a full disk leaves no half picture (and an old one as it was)
        part.write_bytes(data)
        part.replace(path)
    except OSError as exc:  # no permission, a read-only or virtual file system, a full disk
        discard([part])
        raise InvalidConfigError(f"--timeline {path}: cannot be written ({exc.strerror or exc}): give a file in a "
                                 "folder you can write to") from None
    return path


def check_path(path: str | Path) -> None:
    """Refuse an unknown extension, a folder, or a file in a folder that does not exist, before
    anything is computed (a missing folder raised FileNotFoundError after the estimate)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise InvalidConfigError(f"--timeline {path}: write a .svg, .png or .html file")
    if path.is_dir():
        raise InvalidConfigError(f"--timeline {path} is a folder: give a file name, e.g. {path / 'step.svg'}")
    folder = path.absolute().parent
    if not folder.is_dir():
        raise InvalidConfigError(f"--timeline {path}: the folder {folder} does not exist (or is a file): create it "
                                 "or give a path in an existing folder")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("--timeline draws with matplotlib, which is not installed: pip install 'oom-planner[plot]'") from None
    return plt


__all__ = ["FORMATS", "StepCurves", "check_path", "sparkline", "step_curves", "timeline_picture", "write_picture"]
