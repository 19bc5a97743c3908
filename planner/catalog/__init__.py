"""The offline model catalog and model resolution.

``resolve_model(name)`` turns what a user types into a ``ModelSpec``, never touching the network:

1. a catalog id (``planner/data/model_catalog.json``: real config.json files of popular models),
   matched case-insensitively; ``<org>/<name>`` also finds an org-less catalog id ``<name>``
   because the Hub moved those legacy ids under orgs (``openai-community/gpt2`` is ``gpt2``);
2. a path to a config.json or to a model directory holding one;
3. a Hugging Face id in the local HF cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
   ``~/.cache/huggingface/hub``), snapshot named by ``refs/main`` or else the newest.

The catalog JSON is read on first use (never at import, so ``planner --help`` does not read it)
and cached for the process.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

from planner.catalog.architectures import (
    ENCODER_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    public_config,
    spec_from_config,
)
from planner.errors import ModelConfigError, UnknownModelError
from planner.modelspec import ModelSpec

__all__ = [
    "ENCODER_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "catalog_ids",
    "catalog_source",
    "fingerprint",
    "hf_cache_dir",
    "list_catalog",
    "load_config_file",
    "resolve_model",
    "spec_from_config",
]

#: ``ModelSpec.source`` of models that come from the shipped catalog
CATALOG_SOURCE = "catalog"


@functools.cache
def _catalog() -> dict[str, dict[str, Any]]:
    """id -> config.json as shipped (with ``_source`` provenance)."""
    from importlib import resources

    text = resources.files("planner").joinpath("data", "model_catalog.json").read_text(encoding="utf-8")
    return json.loads(text)


@functools.cache
def _lower_ids() -> dict[str, str]:
    return {mid.lower(): mid for mid in _catalog()}


@functools.cache
def _catalog_spec(model_id: str) -> ModelSpec:
    return spec_from_config(_catalog()[model_id], model_id=model_id, source=CATALOG_SOURCE)


def catalog_ids() -> list[str]:
    """Every catalog id, sorted case-insensitively."""
    return sorted(_catalog(), key=str.lower)


def catalog_source(model_id: str) -> str:
    """Where the shipped config.json of a catalog model was copied from (its ``_source``)."""
    canonical = _find_catalog_id(model_id)
    if canonical is None:
        raise UnknownModelError(f"{model_id!r} is not a catalog id; see 'planner models'")
    return str(_catalog()[canonical].get("_source", ""))


def list_catalog(*, search: str | None = None) -> list[ModelSpec]:
    """Catalog models whose id or architecture contains ``search`` (any case), sorted by id."""
    needle = (search or "").strip().lower()
    specs = [_catalog_spec(mid) for mid in catalog_ids()]
    if needle:
        specs = [s for s in specs if needle in s.id.lower() or needle in s.model_type.lower()]
    return specs


def fingerprint(spec_or_config: ModelSpec | Mapping[str, Any]) -> str:
    """sha256 hex of the canonical JSON (sorted keys, no private ``_`` keys) of a model's config."""
    config = spec_or_config.config if isinstance(spec_or_config, ModelSpec) else spec_or_config
    canonical = json.dumps(public_config(config), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# ---- resolution ------------------------------------------------------------------------------


def _find_catalog_id(name: str) -> str | None:
    lower = _lower_ids()
    key = name.strip().lower()
    if key in lower:
        return lower[key]
    if key.count("/") == 1:
        bare = key.split("/", 1)[1]
        if bare in lower and "/" not in lower[bare]:
            return lower[bare]
    return None


def load_config_file(path: Path) -> dict[str, Any]:
    """Read one config.json; ``ModelConfigError`` naming the file when it is not a JSON object."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ModelConfigError(f"{path}: not a text file; pass a config.json") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise ModelConfigError(f"{path}: not valid JSON ({exc.msg} at {where})") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path}: a config.json must be a JSON object, got {type(config).__name__}")
    return config


def _spec_from_file(path: Path, *, model_id: str | None = None) -> ModelSpec:
    config = load_config_file(path)
    if model_id is None:
        name_or_path = config.get("_name_or_path")
        model_id = name_or_path if isinstance(name_or_path, str) and name_or_path else str(path)
    return spec_from_config(config, model_id=model_id, source=str(path))


def hf_cache_dir() -> Path:
    """The local Hugging Face hub cache, as huggingface_hub finds it (constants.py)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def _find_in_hf_cache(name: str) -> Path | None:
    """config.json of ``name`` in the local HF cache: the refs/main snapshot, else the newest."""
    hub = hf_cache_dir()
    folder_name = "models--" + name.strip().replace("/", "--")
    repo = hub / folder_name
    if not repo.is_dir() and hub.is_dir():
        matches = [p for p in hub.iterdir() if p.name.lower() == folder_name.lower() and p.is_dir()]
        repo = matches[0] if matches else repo
    if not repo.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = repo / "snapshots" / ref.read_text(encoding="utf-8").strip() / "config.json"
        if candidate.is_file():
            return candidate
    configs = [p for p in (repo / "snapshots").glob("*/config.json") if p.is_file()]
    return max(configs, key=lambda p: p.stat().st_mtime) if configs else None


def _closest_ids(name: str, n: int = 3) -> list[str]:
    """Catalog ids nearest to ``name`` by difflib ratio against the whole id or its name part."""
    query = name.strip().lower()

    def score(mid: str) -> float:
        low = mid.lower()
        return max(
            difflib.SequenceMatcher(None, query, low).ratio(),
            difflib.SequenceMatcher(None, query.rsplit("/", 1)[-1], low.rsplit("/", 1)[-1]).ratio(),
        )

    return sorted(catalog_ids(), key=lambda mid: (-score(mid), mid.lower()))[:n]


def resolve_model(name: str) -> ModelSpec:
    """A catalog id, a config.json path or model directory, or an HF id in the local cache."""
    if not isinstance(name, str) or not name.strip():
        raise UnknownModelError(
            "no model given: pass a catalog id (see 'planner models') or a path to a config.json"
        )
    canonical = _find_catalog_id(name)
    if canonical is not None:
        return _catalog_spec(canonical)

    path = Path(name).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelConfigError(
                f"{path}: directory has no config.json; pass the model folder that holds it"
            )
        return _spec_from_file(config_path)
    if path.is_file():
        return _spec_from_file(path)

    cached = _find_in_hf_cache(name)
    if cached is not None:
        return _spec_from_file(cached, model_id=name.strip())

    if name.strip().endswith(".json") or name.strip().startswith((".", "/", "~")):
        # written as a path, not an id: say what is missing on disk
        raise UnknownModelError(f"{name!r}: no such file or directory; check the path to the config.json or model folder")
    closest = ", ".join(_closest_ids(name))
    raise UnknownModelError(
        f"model {name!r} not found in the catalog, on disk or in the local Hugging Face cache "
        f"({hf_cache_dir()}); closest catalog ids: {closest}; pass a path to a config.json to plan any model"
    )
