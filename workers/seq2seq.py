"""Encoder-decoder (seq2seq) models in the measurement worker: which transformers class builds
them and which peft task type wraps them.

A T5 run is fed exactly what a causal LM run gets, ``input_ids`` [micro_batch, seq_len] and
``labels = input_ids``: ``T5ForConditionalGeneration.forward`` makes the decoder's input by
shifting the labels right (``_shift_right``, transformers 5.23 models/t5/modeling_t5.py l.1026-1028),
so the target is as long as the source. That is the planner's convention for encoder-decoders:
``seq_len`` is the source length and the target length equals it
(``planner.memory.encdec``).
"""

from __future__ import annotations

from typing import Any, Mapping

#: transformers model types trained as sequence-to-sequence LMs (AutoModelForSeq2SeqLM)
SEQ2SEQ_MODEL_TYPES = frozenset({"t5"})


def is_seq2seq(model_config: Mapping[str, Any]) -> bool:
    return str(model_config.get("model_type")) in SEQ2SEQ_MODEL_TYPES


def auto_class(model_config: Mapping[str, Any], *, encoder: bool):
    """The transformers auto class the worker builds the model with."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    if is_seq2seq(model_config):
        return AutoModelForSeq2SeqLM
    return AutoModelForMaskedLM if encoder else AutoModelForCausalLM


def config_kwargs(model_config: Mapping[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The config keys the model is built from; a seq2seq config without
    ``decoder_start_token_id`` (T5Config has no default) gets the pad token, as T5 does ("In T5
    it is usually set to the pad_token_id", modeling_t5.py ``_shift_right``, l.618-626)."""
    if is_seq2seq(model_config) and kwargs.get("decoder_start_token_id") is None:
        return {**kwargs, "decoder_start_token_id": kwargs.get("pad_token_id", 0)}
    return kwargs


def peft_task_type(model_config: Mapping[str, Any], *, encoder: bool) -> str | None:
    """peft's ``task_type``: SEQ_2_SEQ_LM wraps the model in PeftModelForSeq2SeqLM (peft
    peft_model.py), CAUSAL_LM in PeftModelForCausalLM, none for a masked-LM encoder."""
    if is_seq2seq(model_config):
        return "SEQ_2_SEQ_LM"
    return None if encoder else "CAUSAL_LM"


__all__ = ["SEQ2SEQ_MODEL_TYPES", "auto_class", "config_kwargs", "is_seq2seq", "peft_task_type"]
