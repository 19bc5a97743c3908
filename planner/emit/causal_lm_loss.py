"""transformers 4.46-4.48's causal-LM loss (``loss_returns_head``), one home for the worker and emit's train.py.

The worker imports these functions; emit writes their text into train.py (``inspect.getsource``,
as ``scale_rope``), so both run the same lines. torch is imported inside them (train.py's
functions are self-contained; the planner's core stays torch-free).
"""

from __future__ import annotations


def causal_lm_loss_448(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
    """transformers 4.48.1 loss/loss_utils.py ``ForCausalLMLoss`` (l.32-48) with ``fixed_cross_entropy``
    (l.24-29), line for line: the head's logits upcast, a contiguous copy of all but each sequence's
    last position and of the labels but the first, the cross-entropy on them. Set as the model's
    ``loss_function``, which its forward calls with the head's output and returns that output."""
    import torch

    logits = logits.float()
    labels = labels.to(logits.device)
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    shift_logits = shift_logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(shift_logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch
    return loss


def calls_loss_function(model):
    """Whether ``model``'s forward computes its loss with ``self.loss_function`` (transformers 5.24's
    decoder-only causal LMs: llama, mistral, qwen2/3, mixtral, gemma 1-3, phi3, gpt2, ...; not BART's,
    Whisper's or the other encoder-decoders' ForCausalLM, which run their own CrossEntropyLoss), so
    that setting ``loss_function`` changes the loss it runs."""
    import inspect

    return "self.loss_function(" in inspect.getsource(type(model).forward)
