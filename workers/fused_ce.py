"""A fused linear cross-entropy in plain torch, for the CPU worker (liger-kernel needs Triton).

It follows Liger's ``fused_linear_cross_entropy_forward`` (linkedin/Liger-Kernel,
src/liger_kernel/ops/fused_linear_cross_entropy.py) allocation for allocation, which is what
``planner.memory.activations.fused_ce_transient`` models:

* the tokens are cut into chunks of ``chunk_size = next_power_of_2(ceil(BT / ceil(V / H)))``
  rows (at most BT), so one chunk's logits are about as large as the input (BT x H);
* ``grad_input = zeros_like(_input)`` and an fp32 ``loss_1d`` of BT are made before the loop;
* per chunk the logits ``chunk x V`` are computed in the matmul dtype (the autocast dtype, else
  the weight's), the cross-entropy and its gradient are computed in place in them (Liger's Triton
  kernel writes the gradient over the logits), ``grad_input[chunk] = grad_logits @ weight`` makes
  one ``chunk x H`` product that is copied into ``grad_input``;
* only ``grad_input`` is saved for backward, which scales it in place by the incoming gradient.

Under autocast Liger's matmuls cast the fp32 weight to the autocast dtype per call; here it is
cast once before the loop (the same bytes are alive at the loop's peak). A frozen weight only:
the head's gradient (Liger's ``grad_weight``) is not computed.
"""

from __future__ import annotations

IGNORE_INDEX = -100


def chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's chunk size: next_power_of_2(cdiv(BT, cdiv(V, H))), at most BT."""
    inc = -(-vocab // hidden)
    rows = -(-tokens // inc)
    return min(1 << (rows - 1).bit_length(), tokens)


def fused_linear_cross_entropy(hidden, weight, labels):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` shifted by one (a causal LM's
    loss, transformers' ForCausalLMLoss), without materialising the logits."""
    import torch.nn.functional as F

    # shift so that token < n predicts n, as Liger's LigerForCausalLMLoss pads and slices
    target = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous().view(-1)
    return _function().apply(hidden, weight, target)


_FUNCTION = None


def _function():
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _make_function()
    return _FUNCTION


def _make_function():
    import torch

    class ChunkedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, target):
            assert not weight.requires_grad, "the worker's fused CE covers frozen heads only"
            device = x.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
            with torch.autocast(device, enabled=False):
                grad_input = torch.zeros_like(x)
                loss_1d = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
                n = int((target != IGNORE_INDEX).sum().item())
                w = weight if weight.dtype == dtype else weight.to(dtype)
                rows = chunk_rows(x.shape[0], x.shape[1], weight.shape[0])
                for start in range(0, x.shape[0], rows):
                    end = min(start + rows, x.shape[0])
                    xc = x[start:end]
                    logits = (xc if xc.dtype == dtype else xc.to(dtype)) @ w.t()
                    _ce_in_place(logits, target[start:end], loss_1d[start:end], n)
                    grad_input[start:end] = logits @ w
                    del logits
                loss = loss_1d.sum()
            ctx.save_for_backward(grad_input)
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            (grad_input,) = ctx.saved_tensors
            grad_input.mul_(grad_output.to(grad_input.dtype))
            return grad_input, None, None

    return ChunkedLinearCrossEntropy


def _ce_in_place(logits, target, loss_out, n: int) -> None:
    """Write each row's loss / n to ``loss_out`` and overwrite ``logits`` with d(loss)/d(logits)
    (softmax - one-hot) / n, zero on ignored rows: in place, row vectors only besides."""
    import torch

    valid = target != IGNORE_INDEX
    t = target.clamp(min=0)[:, None]
    top = logits.amax(dim=-1, keepdim=True)
    picked = logits.gather(1, t).float() - top.float()
    logits.sub_(top).exp_()
    # sum(dtype=float32) of a 16-bit tensor would upcast the whole chunk first; the CPU's 16-bit sum
    # accumulates in fp32 internally and returns the row sums only
    total = logits.sum(dim=-1, keepdim=True).float()
    loss_out.copy_(((total.log() - picked).squeeze(1) * valid) / max(n, 1))
    logits.div_(total.to(logits.dtype))
    # minus one at each row's target (advanced indexing: row-sized temporaries only; scatter_add_
    # on a 16-bit tensor would accumulate through an fp32 copy of the chunk on the CPU)
    rows = torch.arange(logits.shape[0], device=logits.device)
    logits[rows, t[:, 0]] -= valid.to(logits.dtype)
    logits.mul_((valid[:, None].to(logits.dtype)) / max(n, 1))
