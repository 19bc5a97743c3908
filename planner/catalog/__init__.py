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

import dataclasses
import difflib
import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from planner.catalog.architectures import (
    ENCODER_MODEL_TYPES,
    REMOTE_CODE,
    SUPPORTED_MODEL_TYPES,
    public_config,
    spec_from_config,
)
from planner.errors import ModelConfigError, UnknownModelError, UnsupportedError
from planner.modelspec import ModelSpec

__all__ = [
    "ENCODER_MODEL_TYPES",
    "check_plannable",
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
    """Every catalog id the planner builds, sorted case-insensitively. The catalog also ships
    configs whose model_type needs the checkpoint's own code (``REMOTE_CODE``): resolving those
    ids gives the one-line ``ModelConfigError`` saying so, and they are listed nowhere."""
    return sorted((mid for mid, config in _catalog().items() if config.get("model_type") not in REMOTE_CODE),
                  key=str.lower)


def catalog_source(model_id: str) -> str:
    """Where the shipped config.json of a catalog model was copied from (its ``_source``)."""
    canonical = _find_catalog_id(model_id)
    if canonical is None:
        raise UnknownModelError(f"{model_id!r} is not a catalog id; see 'planner models'")
    return str(_catalog()[canonical].get("_source", ""))


def list_catalog(*, search: str | None = None) -> list[ModelSpec]:
    """Catalog models whose id or architecture contains ``search`` (any case), or whose id holds
    each of its words and versions in order (``llama 3`` finds ``Meta-Llama-3-8B`` and
    ``Llama-3.1-8B``, not ``Llama-2-13b``), sorted by id."""
    needle = (search or "").strip().lower()
    specs = [_catalog_spec(mid) for mid in catalog_ids()]
    if needle:
        specs = [s for s in specs if needle in s.id.lower() or needle in s.model_type.lower()
                 or needle in (s.wrapper_type or "") or _holds_in_order(_tokens(s.id), _tokens(needle))]
    return specs


def _holds_in_order(tokens: list[str], query: list[str]) -> bool:
    """Each query token starts a later token of ``tokens`` (a version ``3`` starts ``3.1`` but not
    ``32``)."""
    if not query:
        return False
    it = iter(tokens)
    return all(any(t == q or t.startswith(q + ".") or (q[0].isalpha() and t.startswith(q)) for t in it) for q in query)


def check_plannable(spec: ModelSpec) -> None:
    """``UnsupportedError`` (one line) when the memory model has no terms for a feature of this
    architecture (``ModelSpec.unmodelled``): a dense answer for an MoE, MLA or hybrid model would be
    silently wrong, so estimate and suggest refuse it; its parameter counts stay available."""
    if spec.unmodelled:
        features = "; ".join(spec.unmodelled)
        raise UnsupportedError(
            f"{spec.id} ({spec.model_type}) has what the memory model does not model yet: {features}; a dense "
            f"model's answer would be wrong, so it is not planned ('planner models --search {spec.model_type}' "
            "shows its parameter counts)"
        )


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


#: the suffix that names a fine-tuned (or base) release of one architecture: ``-Instruct``
#: (Llama 3.x, Qwen2.5, Mistral), ``-it``/``-pt`` (Gemma), ``-Chat``; also before a version
#: (``Mixtral-8x7B-Instruct-v0.1`` is ``Mixtral-8x7B-v0.1``)
_VARIANT = re.compile(r"-(?:instruct|it|pt|chat)(?=$|-v?[0-9])", re.IGNORECASE)
_VARIANT_SUFFIXES = ("-Instruct", "-it", "-pt", "-Chat")


def _variant_of(name: str) -> str | None:
    """The catalog id whose architecture a release variant of it shares: ``-Instruct``/``-it``/
    ``-Chat`` ids of a catalog base model, or a base id of a catalog ``-Instruct``/``-it`` model
    (chat and instruction tuning change the weights, not the config's sizes)."""
    key = name.strip()
    org, slash, bare = key.rpartition("/")
    stripped = _VARIANT.sub("", bare, count=1)
    candidates = ([stripped] if stripped != bare else []) + [stripped + suffix for suffix in _VARIANT_SUFFIXES]
    for candidate in candidates:
        found = _find_catalog_id(f"{org}{slash}{candidate}")
        if found is not None and found.lower() != key.lower():
            return found
    return None


#: The largest config.json we read. Real ones are a few KiB (the largest shipped: 3 KiB); a
#: file of megabytes is a weights or tokenizer file passed by mistake, and reading it whole
#: would cost its size in memory.
MAX_CONFIG_BYTES = 4 * 1024 * 1024


def load_config_file(path: Path) -> dict[str, Any]:
    """Read one config.json; ``ModelConfigError`` naming the file when it is not a JSON object."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ModelConfigError(
                f"{path}: {size:,} bytes is too large for a config.json (at most {MAX_CONFIG_BYTES:,}); "
                "pass the model's config.json"
            )
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
    except RecursionError:  # json's decoder recurses once per nested [ or {
        raise ModelConfigError(f"{path}: nested too deeply to be a config.json; pass the model's config.json") from None
    except ValueError as exc:  # e.g. an integer of more than sys.get_int_max_str_digits() digits
        raise ModelConfigError(f"{path}: not a usable config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path}: a config.json must be a JSON object, got {type(config).__name__}")
    return config


#: The longest model id we take from a config.json's ``_name_or_path`` (Hub ids are at most 96
#: characters, huggingface_hub's REPO_ID_REGEX; the store keeps 255).
MAX_ID_CHARS = 255


def usable_name_or_path(value: Any) -> str | None:
    """``_name_or_path`` of a config.json when it can be the model's id, else None.

    The id is kept as written, rich markup such as ``org/model[/bold]`` included: it is the
    user's name for the model (and the key its history is found by), and every printer escapes
    it (``planner.cli._common.user_text``). What is refused is what no escaping makes safe to
    print on one line: control characters (newlines, terminal escape sequences) and ids longer
    than the store keeps; then the file's path is the id, as for a config without the key.
    """
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_ID_CHARS:
        return None
    if any(not ch.isprintable() for ch in value):
        return None
    return value


def _spec_from_file(path: Path, *, model_id: str | None = None) -> ModelSpec:
    config = load_config_file(path)
    if model_id is None:
        model_id = usable_name_or_path(config.get("_name_or_path")) or str(path)
    return spec_from_config(config, model_id=model_id, source=str(path))


def hf_cache_dir() -> Path:
    """The local Hugging Face hub cache, as huggingface_hub finds it (constants.py)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def _path_kind(path: Path) -> str | None:
    """``"dir"``, ``"file"`` or None; None too for what cannot be a path on this system (a name
    longer than NAME_MAX, an embedded NUL byte, a directory we may not read)."""
    try:
        if path.is_dir():
            return "dir"
        if path.is_file():
            return "file"
    except (OSError, ValueError):
        return None
    return None


def _find_in_hf_cache(name: str) -> Path | None:
    """config.json of ``name`` in the local HF cache: the refs/main snapshot, else the newest."""
    try:
        return _find_in_hf_cache_unchecked(name)
    except (OSError, ValueError, UnicodeDecodeError):
        # a name no file system holds (too long, a NUL byte), an unreadable cache or ref file:
        # not in the cache
        return None


def _find_in_hf_cache_unchecked(name: str) -> Path | None:
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


_TOKEN_RE = re.compile(r"[a-z]+|[0-9]+(?:\.[0-9]+)*")


def _tokens(text: str) -> list[str]:
    """``Meta-Llama-3.1-8B`` -> ``["meta", "llama", "3.1", "8", "b"]``: words and version numbers."""
    return _TOKEN_RE.findall(text.lower())


def _match_score(query: str, candidate: str) -> tuple[float, float, float]:
    """(share of the query's tokens the candidate holds, token-sequence ratio, character ratio).

    Tokens first: ``Meta-Llama-3-8B`` holds every token of ``Llama-3-8B`` but ``Llama-3.1-8B``
    lacks its ``3`` (a version is one token), while a character ratio alone ranks that first.
    A word weighs twice a number: ``Llama-2-70b`` is nearer to ``Llama-2-7b`` than ``starcoder2-7b``."""
    q, c = set(_tokens(query)), set(_tokens(candidate))
    weight = {t: 1 if t[0].isdigit() or len(t) == 1 else 2 for t in q}
    recall = sum(weight[t] for t in q if t in c) / sum(weight.values()) if q else 0.0
    q_seq, c_seq = _tokens(query), _tokens(candidate)
    return (
        recall,
        difflib.SequenceMatcher(None, q_seq, c_seq, autojunk=False).ratio(),
        difflib.SequenceMatcher(None, query.lower(), candidate.lower(), autojunk=False).ratio(),
    )


def _closest_ids(name: str, n: int = 3) -> list[str]:
    """Catalog ids nearest to ``name``: the better of matching the whole id or its name part."""
    query = name.strip()[:200]  # the rest of a longer name changes no ranking, only the cost

    def score(mid: str) -> tuple[float, float, float]:
        return max(_match_score(query, mid), _match_score(query.rsplit("/", 1)[-1], mid.rsplit("/", 1)[-1]))

    scored = sorted(catalog_ids(), key=lambda mid: (tuple(-x for x in score(mid)), mid.lower()))
    return scored[:n]


def resolve_model(name: str) -> ModelSpec:
    """A catalog id, a config.json path or model directory, or an HF id in the local cache."""
    if not isinstance(name, str) or not name.strip():
        raise UnknownModelError(
            "no model given: pass a catalog id (see 'planner models') or a path to a config.json"
        )
    canonical = _find_catalog_id(name)
    if canonical is not None:
        return _catalog_spec(canonical)

    path = _expand(name)
    kind = _path_kind(path)
    if kind == "dir":
        config_path = path / "config.json"
        if _path_kind(config_path) != "file":
            raise ModelConfigError(
                f"{path}: directory has no config.json; pass the model folder that holds it"
            )
        return _spec_from_file(config_path)
    if kind == "file":
        return _spec_from_file(path)

    cached = _find_in_hf_cache(name)
    if cached is not None:
        return _spec_from_file(cached, model_id=name.strip())

    base = _variant_of(name)
    if base is not None:
        return dataclasses.replace(_catalog_spec(base), id=name.strip(), alias_of=base)

    shown = _shorten(name)
    if name.strip().endswith(".json") or name.strip().startswith((".", "/", "~")):
        # written as a path, not an id: say what is missing on disk
        raise UnknownModelError(f"{shown}: no such file or directory; check the path to the config.json or model folder")
    closest = ", ".join(_closest_ids(name))
    raise UnknownModelError(
        f"model {shown} not found in the catalog, on disk or in the local Hugging Face cache "
        f"({hf_cache_dir()}); closest catalog ids: {closest}; pass a path to a config.json to plan any model"
    )


def _expand(name: str) -> Path:
    try:
        return Path(name).expanduser()
    except RuntimeError:  # "~nosuchuser/...": no home to expand to; then it is the literal path
        return Path(name)


def _shorten(name: str, limit: int = 100) -> str:
    """``repr`` of what the user typed, cut so that an error stays one readable line."""
    text = repr(name)
    return text if len(text) <= limit else f"{text[: limit - 3]}...' ({len(name)} characters)"
