"""A step with nothing to differentiate: refused, as plain ``loss.backward()`` refuses it.

Plain per-microbatch ``loss.backward()`` raises when the loss does not require grad
(torch's "element 0 of tensors does not require grad"): a model whose every parameter is
frozen and whose inputs need no grad, or a loss cut from the graph. The schedule's nodes
detach their inputs keeping ``requires_grad``, so its loss requires grad exactly when the
plain loss does, and a node whose output needs no grad runs no backward: without these
checks such a step would complete, computing nothing.

:func:`check_trainable` refuses the frozen model before the step communicates (a
:class:`~moe_overlap.ConfigError`; the first trainable parameter found ends the look, and
is looked at first at the next step: while it still requires grad and nothing was
registered in the process since, the model trains); :func:`check_loss_grad` refuses any
other loss without grad when it comes out (an :class:`~moe_overlap.IntegrationError`).

A hand-driven run has no step the library knows, and a forward alone is what plain
``forward`` allows: :func:`check_backed_output` refuses the run that would back a plan
whose output needs no grad, before any of its steps, with the same two errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

from torch import Tensor, nn

from moe_overlap.errors import ConfigError, IntegrationError
from moe_overlap.microbatch import Microbatch

from ._registrations import registrations

__all__ = ["check_backed_output", "check_loss_grad", "check_trainable", "needs_grad"]

_EVALUATE = "to evaluate, run the model's own forward under torch.no_grad()"

_TRAINABLE: weakref.WeakKeyDictionary[nn.Module, tuple[Tensor, int]] = weakref.WeakKeyDictionary()
"""Per model: a parameter found to require grad, and :func:`registrations` then."""


def check_trainable(model: object, microbatches: Sequence[Microbatch], where: str) -> None:
    """Refuse a model (an ``nn.Module``) whose parameters are all frozen when no input of
    the step, nor a buffer, requires grad: its loss cannot require grad."""
    if not isinstance(model, nn.Module):
        return  # its parameters are not known: the loss check decides
    with contextlib.suppress(TypeError):  # not hashable: walked every step
        found = _TRAINABLE.get(model)
        if found is not None and found[0].requires_grad and found[1] == registrations():
            return
    trainable = next((p for p in model.parameters() if p.requires_grad), None)
    if trainable is not None:
        with contextlib.suppress(TypeError):
            _TRAINABLE[model] = (trainable, registrations())
        return
    decoder: object = getattr(model, "decoder", None)
    given: list[object] = [getattr(decoder, "input_tensor", None), *microbatches]
    if needs_grad(given, depth=3) or any(b.requires_grad for b in model.buffers()):
        return
    n = sum(1 for _ in model.parameters())
    raise ConfigError(
        f"{where}: {type(model).__name__}: expected a step with something to differentiate "
        f"(a parameter or an input that requires grad), received a model whose {n} "
        "parameters are all frozen (requires_grad=False) and inputs that need no grad: its "
        "loss would not require grad, and plain loss.backward() refuses such a loss (element "
        "0 of tensors does not require grad). To train, unfreeze the parameters to train "
        f"(model.requires_grad_(True), or the modules to train); {_EVALUATE}"
    )


def check_loss_grad(model: object, loss: Tensor, index: int, where: str) -> None:
    """Refuse microbatch ``index``'s loss when it does not require grad."""
    if loss.requires_grad:
        return
    raise _loss_without_grad(model, f"the loss of microbatches[{index}]", bool(index), where)


def check_backed_output(
    model: object,
    output: Tensor,
    microbatch: Microbatch,
    index: int | None,
    where: str,
    *,
    loss: bool,
) -> None:
    """Refuse to back a hand-driven plan (microbatch ``index`` of ``model``) whose
    ``output`` (``loss``: its post-process's loss) does not require grad, as plain
    ``backward()`` refuses it: a frozen model as :func:`check_trainable`, anything else
    as :func:`check_loss_grad`."""
    if output.requires_grad:
        return
    check_trainable(model, [microbatch], where)
    partial = bool(index)
    if loss:
        what = f"the loss of microbatch {index} (the backward plan's output)"
        raise _loss_without_grad(model, what, partial, where)
    raise IntegrationError(
        f"{where}: {type(model).__name__}: expected the output of microbatch {index} (the "
        "backward plan's, which b_grad is the gradient of) to require grad (plain "
        "output.backward(b_grad) refuses one that does not: element 0 of tensors does not "
        "require grad), received an output without grad: it is cut from the trainable "
        "parameters (a .detach() or torch.no_grad() in a slot, or no trainable parameter "
        "and no input that requires grad on its path). Return the output autograd recorded; "
        "a stage with nothing to differentiate has no backward to run: release its plan "
        f"(plan.release_state()) instead.{_partial(partial)}"
    )


def _loss_without_grad(model: object, what: str, partial: bool, where: str) -> IntegrationError:
    """A loss (``what``: which) that does not require grad; ``partial``: earlier
    microbatches' gradients were accumulated."""
    return IntegrationError(
        f"{where}: {type(model).__name__}._postprocess: expected {what} to require grad "
        "(plain loss.backward() refuses one that does not: element 0 of tensors does not "
        "require grad), received a loss without grad: it is cut from the trainable "
        "parameters (a .detach(), .item() or torch.no_grad() in _postprocess, or no "
        "trainable parameter on its path). Return the loss autograd recorded; "
        f"{_EVALUATE}.{_partial(partial)}"
    )


def _partial(partial: bool) -> str:
    return (
        " The gradients this step accumulated before are partial: zero them "
        "(model.zero_grad(set_to_none=True))."
        if partial
        else ""
    )


def needs_grad(value: object, *, depth: int = 3) -> bool:
    """Whether ``value`` is, or holds within ``depth`` levels (a mapping's values, a list's
    or tuple's items, a dataclass's fields), a tensor that requires grad."""
    if isinstance(value, Tensor):
        return value.requires_grad
    if depth == 0 or value is None or isinstance(value, (str, bytes)):
        return False
    items: Iterable[object]
    if isinstance(value, Mapping):
        items = cast("Mapping[object, object]", value).values()
    elif isinstance(value, (list, tuple)):
        items = cast("Sequence[object]", value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return False
    return any(needs_grad(item, depth=depth - 1) for item in items)
