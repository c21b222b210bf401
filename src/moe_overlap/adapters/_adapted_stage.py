"""What the torchtitan and Megatron-Core pipeline stage modules share: the adapter they
wrap (held outside the module tree: it holds no weights) and what they hand on to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar, cast, runtime_checkable

from torch import Tensor, nn

from moe_overlap import ConfigError, ScheduleOptions
from moe_overlap.args import BOOL, NON_NEGATIVE
from moe_overlap.engine import BypassedModule
from moe_overlap.engine.contracts import Contract, attribute, method

__all__ = ["STAGE_ADAPTER", "AdaptedStage", "StageAdapter", "refuse_own_tensors"]


@runtime_checkable
class StageAdapter(Protocol):
    """What a stage hands on to its adapter."""

    @property
    def pre_process(self) -> bool: ...

    @property
    def post_process(self) -> bool: ...

    @property
    def pending_wgrad(self) -> int: ...

    def discard_wgrad(self) -> None: ...

    def schedule_options(
        self, *, free_input: bool = ..., ep_overlap_early_attn_memory_release: bool = ...
    ) -> ScheduleOptions: ...

    def bypassed_modules(self) -> Iterator[BypassedModule]: ...

    def on_microbatch(self, decoder_input: Tensor) -> None: ...

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor: ...


STAGE_ADAPTER: Contract[StageAdapter] = Contract(
    StageAdapter,
    "a stage's adapter (a TorchtitanMoEAdapter or a MegatronMoEAdapter of the stage's chunk)",
    attribute("pre_process", BOOL),
    attribute("post_process", BOOL),
    attribute("pending_wgrad", NON_NEGATIVE),
    method("discard_wgrad"),
    method("schedule_options"),
    method("bypassed_modules"),
    method("on_microbatch"),
    method("output"),
)
"""Its rule table."""

AdapterT = TypeVar("AdapterT", bound=StageAdapter)


class AdaptedStage(Generic[AdapterT]):
    """Mixin, before :class:`~moe_overlap.blocks.MegatronHooks` and ``nn.Module``: a stage
    whose constructor sets ``_adapter`` with ``object.__setattr__``; what the adapter
    answers for the stage."""

    @property
    def adapter(self) -> AdapterT:
        return cast("AdapterT", object.__getattribute__(self, "_adapter"))

    @property
    def pre_process(self) -> bool:
        return self.adapter.pre_process

    @property
    def post_process(self) -> bool:
        return self.adapter.post_process

    def schedule_options(
        self, *, free_input: bool = False, ep_overlap_early_attn_memory_release: bool = False
    ) -> ScheduleOptions:
        return self.adapter.schedule_options(
            free_input=free_input,
            ep_overlap_early_attn_memory_release=ep_overlap_early_attn_memory_release,
        )

    def bypassed_modules(self) -> Iterator[BypassedModule]:
        """The modules of this stage whose ``forward`` the adapter skips or splits."""
        return self.adapter.bypassed_modules()

    def on_microbatch(self, decoder_input: Tensor) -> None:
        self.adapter.on_microbatch(decoder_input)

    def output(
        self, hidden_states: Tensor, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor:
        return self.adapter.output(hidden_states, labels, loss_mask)

    @property
    def pending_wgrad(self) -> int:
        """Delayed weight gradients of this stage waiting for ``backward_dw``."""
        return self.adapter.pending_wgrad

    def discard_wgrad(self) -> None:
        """Drop this stage's pending delayed weight gradients (after a failed step)."""
        self.adapter.discard_wgrad()


def refuse_own_tensors(stage: str, model: nn.Module, part: str, holder: str) -> None:
    """A :class:`~moe_overlap.ConfigError` when ``model`` (the ``part``: model, chunk)
    holds parameters or buffers itself rather than in its child modules (``holder``: who
    holds them so, "GPTModel holds them")."""
    own = [n for n, _ in model.named_parameters(recurse=False)]
    own += [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        raise ConfigError(
            f"{stage}({type(model).__name__}): expected the {part}'s parameters and buffers "
            f"in its child modules (as {holder}), received {own} on the {part} "
            "itself"
        )
