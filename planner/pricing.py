"""What a GPU-hour costs: the shipped table of on-demand prices (``planner/data/gpu_prices.json``,
each row with its provider, offer, source and date) or the user's own file (``--prices``).

A user's file is JSON or YAML, either the shipped shape (``{"prices": [{"gpu": ..., "usd_per_gpu_hour":
..., "provider": ..., "date": ...}, ...]}``) or a plain mapping of catalog GPU name to dollars per
GPU-hour (``{"a100-80gb": 1.10, "h100-80gb": 2.10}``). Every GPU name must be in the catalog
(``planner gpus``), every price a positive number.

Pure module apart from reading the one file it is given (or the shipped one); no torch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import InvalidConfigError, MissingDependencyError, UnknownGPUError

#: where a row of the shipped table is said to come from when a user's plain mapping gives none
YOUR_FILE = "your prices"
_DATE = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")
#: a price file is a few KiB; anything far larger is the wrong file
MAX_PRICE_FILE_BYTES = 1 << 20
#: dollars per GPU-hour past which a price is a mistake, not an offer: the shipped table's dearest
#: GPU-hour is a few dollars, and a month of a $2/h GPU (a monthly price given by mistake) is $1,460;
#: far past it, the dollars of a long job overflow to inf and the option's cost reads as unknown
MAX_USD_PER_GPU_HOUR = 1000.0


@dataclass(frozen=True, kw_only=True)
class GpuPrice:
    """One offer: a GPU-hour of ``gpu`` at ``provider``, on demand."""

    gpu: str
    """Catalog name (``planner gpus``)."""
    usd_per_gpu_hour: float
    provider: str
    offer: str = ""
    """The instance, tier or listing the price is for."""
    date: str = ""
    """When the source stated it (YYYY-MM or YYYY-MM-DD); empty for a user's price without one."""
    source: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.usd_per_gpu_hour, (int, float)) and not isinstance(self.usd_per_gpu_hour, bool)
                and math.isfinite(self.usd_per_gpu_hour) and self.usd_per_gpu_hour > 0):
            raise InvalidConfigError(f"the price of {self.gpu} must be a positive number of dollars per GPU-hour, "
                                     f"got {self.usd_per_gpu_hour!r}")
        if self.usd_per_gpu_hour > MAX_USD_PER_GPU_HOUR:
            raise InvalidConfigError(f"the price of {self.gpu}, {self.usd_per_gpu_hour:,g} dollars per GPU-hour, is "
                                     f"more than {MAX_USD_PER_GPU_HOUR:,.0f}: give the price of one GPU for one hour "
                                     "(not a month's or a node's)")
        if self.date and not _DATE.match(self.date):
            raise InvalidConfigError(f"the date of {self.gpu}'s price at {self.provider} must read YYYY-MM or "
                                     f"YYYY-MM-DD, got {self.date!r}")

    def describe(self) -> str:
        """``$2.79/GPU-h at RunPod (2026-04)``."""
        when = f" ({self.date})" if self.date else ""
        return f"${self.usd_per_gpu_hour:.2f}/GPU-h at {self.provider}{when}"

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "usd_per_gpu_hour": self.usd_per_gpu_hour, "provider": self.provider,
                "offer": self.offer, "date": self.date, "source": self.source}


@dataclass(frozen=True, kw_only=True)
class PriceTable:
    prices: tuple[GpuPrice, ...]
    origin: str
    """``shipped table`` or the user's file path."""

    def cheapest(self, gpu: str) -> GpuPrice | None:
        """The lowest on-demand price of ``gpu`` in the table (None: not priced)."""
        offers = [p for p in self.prices if p.gpu == gpu]
        return min(offers, key=lambda p: p.usd_per_gpu_hour) if offers else None


def load_prices(path: str | Path | None = None) -> PriceTable:
    """The shipped table, or the user's file at ``path`` (replacing it: a GPU the file does not
    price is not priced)."""
    if path is None:
        from importlib import resources

        text = resources.files("planner").joinpath("data", "gpu_prices.json").read_text(encoding="utf-8")
        return PriceTable(prices=price_rows(json.loads(text), where="the shipped price table"), origin="shipped table")
    data = _read(Path(path))
    return PriceTable(prices=price_rows(data, where=str(path)), origin=str(path))


def _read(file: Path) -> Any:
    if not file.is_file():
        what = "a folder, not a file" if file.is_dir() else "no such file"
        raise InvalidConfigError(f"--prices {file}: {what}: give a JSON or YAML file of dollars per GPU-hour, "
                                 'e.g. {"a100-80gb": 1.10}')
    if file.stat().st_size > MAX_PRICE_FILE_BYTES:
        raise InvalidConfigError(f"--prices {file} is larger than 1 MiB: a price file maps GPU names to dollars")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InvalidConfigError(f"--prices {file} is not UTF-8 text: give a JSON or YAML file") from None
    except OSError as exc:  # unreadable (permissions, a file that vanished)
        raise InvalidConfigError(f"--prices {file}: cannot be read ({exc.strerror or exc}): give a file "
                                 "this user can read") from None
    if file.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:  # pragma: no cover - PyYAML comes with transformers and accelerate
            raise MissingDependencyError("reading YAML needs PyYAML: pip install pyyaml, or give --prices a .json file") from None
        try:
            return yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError):
            raise InvalidConfigError(f"--prices {file} is not valid YAML: fix the file") from None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise InvalidConfigError(f"--prices {file} is not valid JSON (a .yaml/.yml name reads YAML): fix the file") from None


def price_rows(data: Any, *, where: str) -> tuple[GpuPrice, ...]:
    """The offers of a price file's parsed content, with every GPU name checked against the catalog."""
    if isinstance(data, Mapping) and isinstance(data.get("prices"), list):
        rows = [_row(item, where=where) for item in data["prices"]]
    elif isinstance(data, Mapping) and data and "prices" not in data:
        rows = [_row({"gpu": gpu, "usd_per_gpu_hour": price, "provider": YOUR_FILE}, where=where)
                for gpu, price in data.items()]
    else:
        raise InvalidConfigError(f"{where} holds no prices: write a mapping of GPU name to dollars per GPU-hour "
                                 '({"a100-80gb": 1.10}) or a "prices" list of {gpu, usd_per_gpu_hour, provider, date}')
    return tuple(rows)


def _row(item: Any, *, where: str) -> GpuPrice:
    from planner.gpus import get_gpu

    if not isinstance(item, Mapping) or "gpu" not in item or "usd_per_gpu_hour" not in item:
        raise InvalidConfigError(f"{where}: every price needs a gpu and a usd_per_gpu_hour, got {item!r}")
    known = {"gpu", "usd_per_gpu_hour", "provider", "offer", "date", "source"}
    unknown = sorted(set(item) - known)
    if unknown:
        raise InvalidConfigError(f"{where}: unknown key {unknown[0]!r} in a price (known: {', '.join(sorted(known))})")
    try:
        name = get_gpu(str(item["gpu"])).name
    except UnknownGPUError as exc:  # the catalog's names, and where the name came from
        raise InvalidConfigError(f"{where}: {exc}") from None
    if name == "cpu":
        raise InvalidConfigError(f"{where}: cpu is this machine, not a GPU to rent: remove its price")
    return GpuPrice(gpu=name, usd_per_gpu_hour=item["usd_per_gpu_hour"], provider=str(item.get("provider", YOUR_FILE)),
                    offer=str(item.get("offer", "")), date=str(item.get("date", "")), source=str(item.get("source", "")))


__all__ = ["GpuPrice", "PriceTable", "YOUR_FILE", "load_prices", "price_rows"]
