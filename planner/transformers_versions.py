"""What a transformers version does that the memory model has a knob for: the one home of the version table.

A user knows the transformers their run uses, not the planner's knobs (``TrainConfig.loss_shift``,
``loss_returns_head``, ``reentrant_ckpt``, ``experts_loop``, ``experts_list_index``, ``rope_caches``; each
field's docstring gives its source). ``knobs_for`` turns a version and a model into those knobs; the request's
``transformers`` option (``planner.request``) names the version and ``planner.estimation.versioned`` applies it
before the model is built as run. Every line below was read in the released wheels.

Pure: no torch, no transformers (the installed one is 5.x and says nothing of 4.x).
"""

from __future__ import annotations

import re

#: the knobs a version sets, in ``planner.request``'s order
KNOBS = ("loss_shift", "loss_returns_head", "reentrant_ckpt", "experts_loop", "experts_list_index", "rope_caches")

#: the oldest version the table covers: 4.36 is the first with the Mixtral and Qwen2 families' code read here
#: (4.36.0 added Mixtral's per-expert loop); older runs are not modelled
OLDEST = (4, 36)

#: rotary tables as per-layer buffers (``rope_caches``): each attention's own cos_cached/sin_cached of
#: max_position_embeddings x head_dim, built at init, up to (not including) the version named: 4.39.3
#: models/mistral/modeling_mistral.py l.93-116 (one per attention l.232); checked in the 4.39.3..4.48.1 wheels
#: (Llama made cos/sin per forward from 4.41, Mistral from 4.42, Qwen2 from 4.45, Mixtral from 4.48). The table
#: covers these four families; another model type keeps no such buffers here (False).
_ROPE_CACHES_UNTIL = {"llama": (4, 41), "mistral": (4, 42), "qwen2": (4, 45), "mixtral": (4, 48)}

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.\-+]?[A-Za-z0-9.+\-]*)?\s*$")


def parse(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a release name such as "4.39.3", "4.46" or "4.48.0.dev0"; one line with the
    fix for anything else or older than the table."""
    from planner.errors import InvalidConfigError

    match = _VERSION.match(str(version)) if isinstance(version, str) else None
    if match is None:
        raise InvalidConfigError(f"--transformers must be a release such as 4.39.3 or 5.0, got {version!r}: "
                                 "give the version your run uses (python -c 'import transformers; "
                                 "print(transformers.__version__)')")
    major, minor, patch = int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)
    if (major, minor) < OLDEST:
        raise InvalidConfigError(f"--transformers {version} is older than {OLDEST[0]}.{OLDEST[1]}, the oldest release "
                                 f"the version table covers: give a release from {OLDEST[0]}.{OLDEST[1]} on, or drop "
                                 "--transformers")
    return major, minor, patch


def knobs_for(version: str, model_type: str, *, is_moe: bool, causal_lm: bool = True,
              encoder_decoder: bool = False, model_id: str = "", experts_stated: bool = False) -> dict[str, bool]:
    """The knobs (``KNOBS``) of a run on transformers ``version`` of a model of ``model_type``: every one False
    from 5.0 on (the planner's defaults are transformers 5's). ``causal_lm``: the loss knobs are a causal LM's
    (an encoder's or an encoder-decoder's loss is its own); ``encoder_decoder``: its reentrant checkpoint is not
    modelled (``planner.request.check_for_model`` refuses it), so it is left off. An MoE model on 4.x other than
    Mixtral is refused: its per-expert modules are not built here (unless ``experts_stated``: the user gave
    experts_loop, whose value stands)."""
    major, minor, _ = parse(version)
    v = (major, minor)
    knobs = dict.fromkeys(KNOBS, False)
    if major >= 5:
        return knobs
    if causal_lm:
        # < 4.46: each causal LM's forward upcasts the logits and computes CrossEntropyLoss on a shifted contiguous
        # copy (4.45.2 models/mistral/modeling_mistral.py l.1059-1074); 4.46-4.48: the model returns the head's
        # logits and loss/loss_utils.py ForCausalLMLoss upcasts and makes the shifted copy (4.46.3 and 4.48.1
        # l.36-40); 4.49.0 shifts the labels instead, no copy (the planner's default loss)
        knobs["loss_shift"] = v < (4, 49)
        knobs["loss_returns_head"] = (4, 46) <= v < (4, 49)
    # every 4.x: modeling_utils gradient_checkpointing_enable defaults use_reentrant=True and the model's loop
    # calls each decoder layer inside the checkpoint (4.45.2 models/mistral/modeling_mistral.py l.805-806);
    # it matters under --grad-ckpt only (the memory terms read it with grad_ckpt), so the search's candidates
    # without checkpointing take it unchanged
    knobs["reentrant_ckpt"] = not encoder_decoder
    # the per-expert MoE layout is built for these model types only (one home: planner.catalog.modern)
    from planner.catalog.modern import PER_EXPERT_TYPES

    if is_moe and model_type not in PER_EXPERT_TYPES and not experts_stated:  # (--no-experts-loop: fused, said)
        from planner.errors import UnsupportedError

        raise UnsupportedError(f"transformers {version}'s per-expert MoE modules are modelled for Mixtral only, "
                               f"not {model_id or model_type} (model type {model_type}): --transformers 5 (or no "
                               "--transformers) plans its fused experts")
    if is_moe and model_type in PER_EXPERT_TYPES:
        knobs["experts_loop"] = True
        # 4.36-4.39 copy each expert's routed indices to the host and index with Python lists (4.39.3
        # models/mixtral/modeling_mixtral.py l.866-877, ``top_x.tolist()``); 4.40.2 l.874 indexes with tensors
        knobs["experts_list_index"] = v < (4, 40)
    until = _ROPE_CACHES_UNTIL.get(model_type)
    knobs["rope_caches"] = until is not None and v < until
    return knobs


__all__ = ["KNOBS", "OLDEST", "knobs_for", "parse"]
