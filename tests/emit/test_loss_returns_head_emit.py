"""emit's train.py for a plan with transformers 4.46-4.48's loss (``loss_shift`` with ``loss_returns_head``):
it sets the model's ``loss_function`` to 4.48.1's ForCausalLMLoss (planner/emit/causal_lm_loss.py, the
worker's own lines) and gives the Trainer no compute_loss_func, so the model's forward runs it on the
head's output, which it returns."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("torch")

from test_emit import emit_into, import_script  # noqa: E402

from planner.config import TrainConfig  # noqa: E402
from planner.emit.causal_lm_loss import calls_loss_function, causal_lm_loss_448  # noqa: E402

CONFIG = TrainConfig(method="lora", precision="bf16-mixed", loss_shift=True, loss_returns_head=True, seq_len=256)


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    folder = emit_into(tmp_path_factory.mktemp("loss448"), CONFIG)
    return folder, import_script(folder / "train.py")


def test_the_script_holds_the_workers_loss_and_says_so(script):
    folder, module = script
    assert module.LOSS_RETURNS_HEAD is True
    assert inspect.getsource(module.causal_lm_loss_448) == inspect.getsource(causal_lm_loss_448)
    assert inspect.getsource(module.calls_loss_function) == inspect.getsource(calls_loss_function)
    assert "transformers 4.46-4.48's loss" in (folder / "PLAN.md").read_text()
    assert "compute_loss_func=None if LOSS_RETURNS_HEAD" in (folder / "train.py").read_text()
    assert import_script(emit_into(folder / "no-head", CONFIG.replace(loss_returns_head=False)) / "train.py"
                         ).LOSS_RETURNS_HEAD is False


def test_a_16_bit_loss_runs_the_445_lines(tmp_path):
    """With --no-loss-upcast the head's output is the loss' logits: 4.48.1's upcast is what the plan
    leaves out, and 4.45's 16-bit lines (shifted_copy_loss) are the tensors it counts."""
    module = import_script(emit_into(tmp_path, CONFIG.replace(loss_upcast=False)) / "train.py")
    assert module.LOSS_RETURNS_HEAD is False and module.LOSS_SHIFT is True and module.LOSS_UPCAST is False


def _tiny_llama(folder):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=100)).save_pretrained(folder)
    return str(folder)


def test_the_loaded_model_runs_it_in_its_forward(script, tmp_path):
    """load_model on a tiny llama (CPU): the model's forward returns the head's logits as they are and
    4.48.1's loss on them, a shifted contiguous copy of the upcast logits (not 5.24's padded labels)."""
    import torch

    _, module = script
    model = module.load_model(_tiny_llama(tmp_path / "llama"))
    assert model.loss_function is module.causal_lm_loss_448
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :4] = -100
    out = model(input_ids=ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits.float()[:, :-1].reshape(-1, 100), labels[:, 1:].reshape(-1))
    assert torch.allclose(out.loss, expected)
    assert out.logits.dtype == model.lm_head.weight.dtype


def test_a_model_with_its_own_loss_stops_the_script(script, tmp_path, monkeypatch):
    """A causal LM whose forward runs its own CrossEntropyLoss (as 5.24's BartForCausalLM): train.py stops
    rather than train with another loss."""
    _, module = script
    monkeypatch.setattr(module, "calls_loss_function", lambda model: False)
    with pytest.raises(SystemExit, match="without --loss-returns-head"):
        module.load_model(_tiny_llama(tmp_path / "llama"))
