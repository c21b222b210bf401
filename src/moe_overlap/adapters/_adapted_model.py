"""What the torchtitan and Megatron-Core adapters share around their adapted layers.

:class:`AdaptedDecoder` is ``decoder`` as the schedule sees it. :class:`AdaptedModel` holds
what both adapters do the same way: the model's parameters, the layers' delayed weight
gradients, the start-of-microbatch check, the bypassed-module check at construction, and
``_postprocess`` finding the microbatch's tied-parameter :class:`Stash` (made by
:meth:`AdaptedModel._stash_for` in pre-process).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from torch import Tensor, nn

from moe_overlap.adapters._tied_stash import Stash
from moe_overlap.adapters._wrapped_layer import WrappedLayer
from moe_overlap.engine import BypassedModule, check_wgrad_done

__all__ = ["AdaptedDecoder", "AdaptedModel"]

LayerT = TypeVar("LayerT", bound=WrappedLayer)


class AdaptedDecoder(Generic[LayerT]):
    """``decoder`` as the schedule sees it: the adapted layers; the model's final norm runs
    in post-process."""

    def __init__(self, layers: tuple[LayerT, ...]) -> None:
        self.layers = layers
        self.input_tensor: Tensor | None = None
        self.final_layernorm: Callable[[Tensor], Tensor] | None = None


class AdaptedModel(Generic[LayerT]):
    """Mixin, before :class:`~moe_overlap.blocks.MegatronHooks`: an adapter of ``model``
    whose ``decoder`` holds the adapted layers. A subclass defines
    :meth:`bypassed_modules` and :meth:`_output`, and :meth:`_post` where its
    post-process takes more than :meth:`_output`."""

    model: nn.Module
    decoder: AdaptedDecoder[LayerT]
    _stashes: dict[int, Stash]

    def bypassed_modules(self) -> Iterator[BypassedModule]:
        """The model's modules whose ``forward`` the adapter does not call as it is."""
        raise NotImplementedError

    def _check_bypassed(self) -> None:
        from moe_overlap.engine import check_module

        for item in self.bypassed_modules():
            check_module(item.module, item.name, item.reason, item.bypass, item.honoured)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The model's parameters (what the optimizer takes)."""
        return self.model.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters with their names in the model."""
        return self.model.named_parameters()

    @property
    def pending_wgrad(self) -> int:
        """Delayed weight gradients waiting for ``backward_dw`` (0 after a schedule)."""
        return sum(layer.pending_wgrad for layer in self.decoder.layers)

    def discard_wgrad(self) -> None:
        """Drop every pending delayed weight gradient (after a failed step; zero the
        gradients too)."""
        for layer in self.decoder.layers:
            layer.discard_wgrad()

    def on_microbatch(self, decoder_input: Tensor) -> None:
        """Refuse pending weight gradients at the start of a microbatch."""
        del decoder_input
        check_wgrad_done(self, when="at the start of a microbatch")

    def _stash_for(self, input_ids: Tensor) -> Stash:
        """A new :class:`Stash` for the microbatch of ``input_ids`` (found again by
        post-process, which gets the same tensor; dropped with it)."""
        key = id(input_ids)
        stash = self._stashes[key] = Stash()
        weakref.finalize(input_ids, self._stashes.pop, key, None)
        return stash

    def _postprocess(
        self,
        hidden_states: Tensor,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        *args: object,
        loss_mask: Tensor | None = None,
        **kwargs: object,
    ) -> Tensor:
        """:meth:`_post` with the microbatch's stash (found by its ``input_ids``), where
        the post-process uses of the parameters pre-process uses too send their gradient."""
        del args, kwargs  # Megatron's other arguments: the rotary tables, unused here
        stash = self._stashes.get(id(input_ids)) if input_ids is not None else None
        return self._post(hidden_states, input_ids, position_ids, labels, loss_mask, stash)

    def _post(
        self,
        hidden_states: Tensor,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        loss_mask: Tensor | None,
        stash: Stash | None,
    ) -> Tensor:
        """The microbatch's post-process: :meth:`_output`."""
        del input_ids, position_ids
        return self._output(hidden_states, labels, loss_mask, stash)

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        """The model's own steps after its layers on ``hidden_states``: the loss with
        ``labels``, else the logits."""
        return self._output(hidden_states, labels, loss_mask, None)

    def _output(
        self,
        hidden_states: Tensor,
        labels: Tensor | None,
        loss_mask: Tensor | None,
        stash: Stash | None,
    ) -> Tensor:
        raise NotImplementedError
