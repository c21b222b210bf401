"""A torchtitan decoder model as a :class:`~moe_overlap.PreprocessableModel`.

Legend: ``B`` batch, ``L`` sequence, ``D`` hidden, ``V`` vocabulary.
"""

from __future__ import annotations

import copy
import importlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from moe_overlap import ConfigError, IntegrationError, Microbatch, ScheduleOptions
from moe_overlap.adapters._adapted_model import AdaptedDecoder, AdaptedModel
from moe_overlap.adapters._built_on import BuiltOn
from moe_overlap.adapters._hf_experts import DelayedLinear
from moe_overlap.adapters._hf_model import AdapterConfig
from moe_overlap.adapters._hf_probe import Mismatch, failing_module
from moe_overlap.adapters._layer_probe import (
    compare_backward,
    first_of_each,
    probe_tolerance,
    tolerance_text,
)
from moe_overlap.adapters._tied_stash import Stash, hand, take
from moe_overlap.adapters._torch_private import version
from moe_overlap.adapters._tt_imports import titan
from moe_overlap.adapters._tt_layers import (
    BlockCall,
    TitanDenseLayer,
    TitanLayer,
    TitanMoELayer,
    delay_titan_linears,
    swap,
)
from moe_overlap.adapters._tt_names import NOT_GIVEN, TitanHooks, refuse_titan_names
from moe_overlap.adapters._tt_parallel import honoured_forward
from moe_overlap.adapters._tt_recompute import unwrap_blocks
from moe_overlap.args import BOOL, MODULE, check_arg
from moe_overlap.engine import Bypass, BypassedModule, ChunkState

__all__ = ["LossFn", "SelfCheckReport", "TitanDecoder", "TorchtitanMoEAdapter"]

LossFn = Callable[[Tensor, Tensor], object]
"""``loss_fn(logits, labels)``: a scalar tensor, or a tuple whose first item is one (what
a torchtitan ``BaseLoss`` returns)."""

PROBE_TOKENS = 8
"""The self-check's probe: two sequences of this many tokens."""

IGNORE_INDEX = -100
"""torchtitan's (and torch's) ignored label."""


class TitanDecoder(AdaptedDecoder[TitanLayer]):
    """``decoder`` as the schedule sees it: the adapted blocks; final norm in post-process."""


@dataclass(slots=True)
class SelfCheckReport:
    """What the construction-time self-check did: per structure, the blocks it stands for
    and the largest difference found (relative; :func:`probe_tolerance`: none on CPU). The probe runs
    in float32; a block whose own forward fails in float32 (gpt-oss's experts return
    ``bfloat16``) is probed in the model's dtype instead."""

    enabled: bool
    seconds: float = 0.0
    structures: list[tuple[str, list[str], float, str]] = field(
        default_factory=list[tuple[str, list[str], float, str]]
    )
    """``(block class, block names, largest relative difference, probe dtype)``."""


class _Stop(Exception):
    def __init__(self, value: Tensor) -> None:
        super().__init__("stand-in reached")
        self.value = value


class _Inject(nn.Module):
    """Stands in for the blocks: hands on the hidden states the schedule computed, whatever
    the model's own embedding gave it."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, h: Tensor, *args: object) -> Tensor:
        del h, args
        return self.hidden


class _StopHere(nn.Module):
    """Stands in for the final norm: ends the model's forward, handing on its input."""

    def forward(self, h: Tensor) -> Tensor:
        raise _Stop(h)


_OUTSIDE = (
    "the adapter runs its forward only around stand-ins for its blocks (the embedding; the "
    "final norm and LM head), twice per microbatch and never as a whole"
)
_MOE_BLOCK = (
    "the adapter's slots call its forward with its moe stood in for, and the MoE's pieces after it"
)
_MOE = "the adapter's slots call its forward with its routed_experts stood in for"
_ROUTED = "the adapter's slots call its token dispatcher and inner experts, never its forward"
_DENSE = "the adapter calls the block it was built on, not a wrapper around it"


def _uses_masks(model: nn.Module) -> bool:
    """Whether torchtitan's trainer builds attention masks for this model (its first
    attention's inner attention is flex or varlen)."""
    config: object = getattr(model, "config", None)
    first: object = getattr(config, "first_attention", None)
    inner: object = getattr(first, "inner_attention", None)
    return isinstance(inner, titan().masked_attention)


def _check_arguments(
    model: nn.Module, loss_fn: LossFn | None, delay_wgrad_compute: bool, self_check: bool
) -> None:
    w = "TorchtitanMoEAdapter"
    check_arg(w, "model", model, MODULE)
    check_arg(w, "delay_wgrad_compute", delay_wgrad_compute, BOOL)
    check_arg(w, "self_check", self_check, BOOL)
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(
            f"{w}: loss_fn: expected a callable loss_fn(logits, labels) or None (torchtitan's "
            f"cross-entropy, mean over the microbatch's labelled tokens), received "
            f"{type(loss_fn).__name__}"
        )
    if not isinstance(model, titan().decoder):
        raise ConfigError(
            f"{w}: model: expected a torchtitan decoder model (a "
            f"torchtitan.models.common.decoder.Decoder, as its model registries build), "
            f"received {type(model).__name__}"
        )
    _check_stage_layout(model)
    whole = _has(model, "tok_embeddings") and _has(model, "lm_head")
    if _mtp_depth(model) is not None and not whole:
        raise ConfigError(
            f"{w}: {type(model).__name__}.mtp_layers: expected multi-token-prediction layers "
            "only in a whole model (they read the token ids and end in the LM head; torchtitan "
            "refuses them under pipeline parallelism too), received them in a pipeline stage"
        )


def _mtp_depth(model: nn.Module) -> int | None:
    """How many multi-token-prediction layers the model runs after its blocks (DeepSeek-V3's
    ``MTPDecoder``: a module list, possibly empty); ``None`` when it has none."""
    mtp: object = getattr(model, "mtp_layers", None)
    return len(mtp) if isinstance(mtp, nn.ModuleList) else None


def _has(model: nn.Module, name: str) -> bool:
    """Whether ``model.name`` is a module (torchtitan's stage split sets the ones a stage
    does not hold to ``None``)."""
    return isinstance(getattr(model, name, None), nn.Module)


def _check_stage_layout(model: nn.Module) -> None:
    """A whole model or a stage of torchtitan's pipeline split whose output the adapter
    can name: hidden states (no final norm, no LM head) or logits (both)."""
    cls = type(model).__name__
    norm, head = _has(model, "norm"), _has(model, "lm_head")
    if norm != head:
        held, missing = ("norm", "lm_head") if norm else ("lm_head", "norm")
        raise ConfigError(
            f"TorchtitanMoEAdapter: {cls}: expected the final norm and the LM head on the same "
            f"stage (its output is then the logits, else hidden states), received {held} "
            f"without {missing}; put 'norm' and 'lm_head' in one stage's module names"
        )
    if bool(getattr(model, "_skip_lm_head", False)):
        raise ConfigError(
            f"TorchtitanMoEAdapter: {cls}._skip_lm_head: expected False (the adapter's last "
            "stage returns the logits, which the loss takes), received True"
        )


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks by name; a pipeline stage may hold none (torchtitan's split can
    give a stage only the final norm and the LM head)."""
    layers: object = getattr(model, "layers", None)
    whole = _has(model, "tok_embeddings") and _has(model, "lm_head")
    if not isinstance(layers, nn.ModuleDict) or (whole and len(layers) == 0):
        got = "an empty ModuleDict" if isinstance(layers, nn.ModuleDict) else type(layers).__name__
        raise ConfigError(
            f"TorchtitanMoEAdapter: {type(model).__name__}.layers: expected a ModuleDict of "
            f"transformer blocks (non-empty in a whole model), received {got}"
        )
    return list(cast("Iterator[tuple[str, nn.Module]]", layers.items()))


def _is_moe(block: nn.Module, moe_cls: type[nn.Module]) -> bool:
    moe: object = getattr(block, "moe", None)
    return bool(getattr(block, "moe_enabled", False)) and isinstance(moe, moe_cls)


def _structure(block: nn.Module) -> tuple[object, ...]:
    """Blocks of one structure: the same module classes at the same places."""
    named = cast("Iterator[tuple[str, nn.Module]]", block.named_modules())
    mods = tuple((n, type(m).__qualname__) for n, m in named)
    dispatcher: object = getattr(getattr(block, "moe", None), "routed_experts", None)
    kind = type(getattr(dispatcher, "token_dispatcher", None)).__qualname__
    return (type(block).__qualname__, mods, kind)


class TorchtitanMoEAdapter(AdaptedModel[TitanLayer], TitanHooks):
    """A torchtitan MoE decoder model for :func:`~moe_overlap.combined_1f1b`.

    The adapter holds no weights: it runs and trains ``model``'s own modules, so the
    optimizer (and torchtitan's load-balancing hook) takes the model as it is, and
    checkpoints stay torchtitan's. The embedding, final norm and LM head run as the model's
    own ``forward`` with its blocks stood in for; each MoE block is split into the
    schedule's four slots by running its own code (see
    :mod:`moe_overlap.adapters.torchtitan`); dense blocks run whole.

    Args:
        model: a model built by a torchtitan model registry
            (``model_registry(flavor).model.build()``, states initialised), on its device,
            optionally with torchtitan's expert parallelism applied (its forward wrappers
            on the MoE modules honoured where they do nothing) and with torchtitan's
            ``SelectiveAC`` / ``FullAC`` applied (each wrapped block's slots recomputed
            with the wrapper's settings: pre-dispatch and the routed experts, a dense
            block whole; the wrapper stays in the model for torchtitan's
            load-balancing hook).
        loss_fn: ``loss_fn(logits, labels)``; ``None``: torchtitan's cross-entropy (sum
            reduction) over the microbatch's labelled tokens, divided by their number.
        delay_wgrad_compute: delay the weight gradients of the blocks' linears (attention
            and shared experts; swapped in place for delayable linears sharing their
            parameters and ``state_dict`` keys) to the schedule's ``backward_dw``. The
            routed experts' and the router's weight gradients stay in backward.
        self_check: compare the split of each distinct block structure with the block's
            own forward and backward on a float32 probe and refuse a mismatch with
            :class:`~moe_overlap.ConfigError` (see :attr:`self_check_report`).

    Raises :class:`~moe_overlap.ConfigError` at construction for a model it cannot train
    exactly, naming the member and the reason.
    """

    microbatch_inputs = frozenset({"position_ids", "labels"})
    """What the adapter reads (:class:`~moe_overlap.inputs.DeclaresInputs`): ``position_ids``
    (torchtitan's ``positions``: RoPE and, for flex/varlen attention, the per-document
    masks the model builds from them) and ``labels`` (``-100`` ignored)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn | None = None,
        delay_wgrad_compute: bool = False,
        self_check: bool = True,
    ) -> None:
        _check_arguments(model, loss_fn, delay_wgrad_compute, self_check)
        moe_cls = titan().moe
        self.model = model
        self.loss_fn = loss_fn
        self.config = AdapterConfig(delay_wgrad_compute=delay_wgrad_compute)
        self._built_on: BuiltOn | None = None  # what it was built on, once built
        # The blocks inside torchtitan's activation-checkpoint wrappers (kept in the model:
        # its load-balancing hook looks for them), and the wrappers by name.
        self._blocks, self._checkpoints = unwrap_blocks(_blocks(model), type(model).__name__)
        self._moe = [name for name, b in self._blocks if _is_moe(b, moe_cls)]
        if not self._moe and self.pre_process and self.post_process:
            raise ConfigError(
                f"TorchtitanMoEAdapter: {type(model).__name__}: expected MoE blocks (a "
                "'moe' child that is torchtitan's MoE, with moe_enabled), received none"
            )
        self._masks = _uses_masks(model)
        self._shared = _shared_with_embedding(model)
        self._stashes: dict[int, Stash] = {}
        self._calls: dict[int, BlockCall] = {}
        self._check_bypassed()
        self.self_check_report = SelfCheckReport(enabled=self_check)
        if self_check:
            self._self_check()
        self.decoder = TitanDecoder(self._adapt(delay_wgrad_compute))
        self._label_delayed_modules()
        self._built_on = BuiltOn("TorchtitanMoEAdapter", _blocks(model), self._watched())

    def _watched(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules whose children the slots call: every block, each MoE and its
        routed experts; every module holding a linear swapped for a :class:`DelayedLinear`
        (the adapter's wgrad groups hold it)."""
        moe = set(self._moe)
        for name, block in self._blocks:
            yield f"layers.{name}", block
            for sub, module in cast("Iterator[tuple[str, nn.Module]]", block.named_modules()):
                if sub and any(isinstance(c, DelayedLinear) for c in module.children()):
                    yield f"layers.{name}.{sub}", module
            if name in moe:
                m = block.get_submodule("moe")
                yield f"layers.{name}.moe", m
                yield f"layers.{name}.moe.routed_experts", m.get_submodule("routed_experts")

    # --- construction --------------------------------------------------------------------
    def _adapt(self, delay: bool) -> tuple[TitanLayer, ...]:
        moe = set(self._moe)
        adapted: list[TitanLayer] = []
        for i, (name, block) in enumerate(self._blocks):
            label = f"layers.{name}"
            if name not in moe:
                delayed = delay_titan_linears(block) if delay else []
                adapted.append(
                    TitanDenseLayer(
                        block,
                        i,
                        label,
                        self.block_call,
                        self.config,
                        delayed=delayed,
                        checkpoint=self._checkpoints.get(name),
                    )
                )
                continue
            m = block.get_submodule("moe")
            attention = [c for n, c in block.named_children() if n != "moe"]
            attn_delayed = [d for c in attention for d in delay_titan_linears(c)] if delay else []
            shared: object = getattr(m, "shared_experts", None)
            moe_delayed = (
                delay_titan_linears(shared) if delay and isinstance(shared, nn.Module) else []
            )
            adapted.append(
                TitanMoELayer(
                    block,
                    i,
                    label,
                    self.block_call,
                    self.config,
                    attention_delayed=attn_delayed,
                    moe_delayed=moe_delayed,
                    checkpoint=self._checkpoints.get(name),
                )
            )
        return tuple(adapted)

    def _label_delayed_modules(self) -> None:
        named = cast("Iterator[tuple[str, nn.Module]]", self.model.named_modules())
        names = {id(m): n for n, m in named}
        for layer in self.decoder.layers:
            for module in layer.delayed_modules():
                module.label = names.get(id(module), module.label)

    def _probe(self, device: torch.device) -> tuple[Tensor, BlockCall]:
        """Two sequences of random hidden states (a private generator) and the block
        arguments the model builds for them."""
        dim: object = getattr(getattr(self.model, "config", None), "dim", None)
        if not isinstance(dim, int):
            raise ConfigError(
                f"TorchtitanMoEAdapter: {type(self.model).__name__}.config.dim: expected an "
                f"int (the hidden size), received {dim!r}"
            )
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, PROBE_TOKENS, dim, generator=g).to(device)
        positions = torch.arange(PROBE_TOKENS, device=device).expand(2, PROBE_TOKENS)
        return x, self._block_call(positions)

    def _self_check(self) -> None:
        """Each distinct block structure's split against the block's own forward/backward."""
        start = time.perf_counter()
        report = self.self_check_report
        p0 = next(self.model.parameters())
        x, call = self._probe(p0.device)
        moe = set(self._moe)
        firsts = first_of_each(((n, m) for n, m in self._blocks if n in moe), _structure)
        for name, block, names in firsts:
            before = _state_of(block)
            try:
                worst, dtype = _compare_in_float32_or(block, name, x, call, p0.dtype)
            except (ConfigError, IntegrationError):
                raise
            except Exception as exc:  # torchtitan's own code, run as the adapter runs it
                raise ConfigError(
                    f"TorchtitanMoEAdapter: layers.{name}: {failing_module(exc, block)} raised "
                    f"{type(exc).__name__}: {exc}, when the self-check ran the block's own "
                    "forward and backward and the adapter's split of it on a probe; "
                    "expected both to run (or pass self_check=False)"
                ) from exc
            if _state_of(block) != before:
                raise IntegrationError(
                    f"TorchtitanMoEAdapter: layers.{name}: the self-check's copy of the block "
                    "changed the model's own gradients or buffers (a module of the copy still "
                    "runs the original); expected the probe to touch the copy only"
                )
            tolerance = probe_tolerance(dtype, p0.device)
            if worst.difference > tolerance:
                bound = tolerance_text(tolerance, dtype)
                raise ConfigError(
                    f"TorchtitanMoEAdapter: layers.{name} ({type(block).__name__}): the "
                    f"adapter's split of the block differs from its own forward: {worst} "
                    f"(relative; {bound}); expected the block's output to be "
                    "h + moe(u) and the MoE's to be routed_experts(...) + the rest, computed "
                    "in that order, as torchtitan's blocks compute them. This block cannot be "
                    "scheduled exactly (self_check=False trains it anyway, unverified)"
                )
            report.structures.append(
                (
                    type(block).__name__,
                    names,
                    worst.difference,
                    str(dtype).removeprefix("torch."),
                )
            )
        report.seconds = time.perf_counter() - start

    # --- the blocks' arguments, per microbatch -------------------------------------------
    def _block_call(self, positions: Tensor | None) -> BlockCall:
        masks: object = None
        if self._masks and positions is not None:
            get = cast("Callable[[Tensor], object]", self.model.get_attention_masks)
            masks = get(positions)
        return BlockCall(masks, positions)

    def block_call(self, chunk_state: ChunkState) -> BlockCall:
        """What torchtitan's decoder hands every block for this microbatch: the attention
        masks it builds from the positions (as its trainer does) and the positions."""
        key = id(chunk_state)
        call = self._calls.get(key)
        if call is None:
            with torch.no_grad():
                call = self._block_call(chunk_state.position_ids)
            self._calls[key] = call
            weakref.finalize(chunk_state, self._calls.pop, key, None)
        return call

    # --- public helpers -------------------------------------------------------------------
    def bypassed_modules(self) -> Iterator[BypassedModule]:
        """The torchtitan modules whose ``forward`` the slots skip or split (checked at
        every plan build: wrappers, ``compile`` and hooks on them are refused), and
        torchtitan's activation-checkpoint wrappers around blocks (the slots recompute
        with their settings: checked unchanged; hooks on them are refused)."""
        cls = type(self.model).__name__
        if self._built_on is not None:  # a changed model is refused (not while building)
            self._built_on.check_blocks(_blocks(self.model), cls)
        # A forward torchtitan's parallelize set is honoured where it does nothing.
        noop = honoured_forward
        yield BypassedModule(cls, self.model, Bypass.CALLS, _OUTSIDE, noop(self.model, cls))
        moe = set(self._moe)
        current = dict(_blocks(self.model))
        for name, block in self._blocks:
            where = f"{cls}.layers.{name}"
            checkpoint = self._checkpoints.get(name)
            if current.get(name) is not (block if checkpoint is None else checkpoint.wrapper):
                found = current.get(name)
                raise ConfigError(
                    f"{where}: expected the block the adapter was built on, received "
                    f"{type(found).__name__} in its place (a wrapper put around it after "
                    "construction, e.g. activation checkpointing, would never run); apply "
                    "wrappers before building the adapter, or rebuild it"
                )
            if checkpoint is not None:
                yield from checkpoint.bypassed(where)
            if name not in moe:
                yield BypassedModule(where, block, Bypass.WRAPPER, _DENSE)
                continue
            m = block.get_submodule("moe")
            routed = m.get_submodule("routed_experts")
            yield BypassedModule(where, block, Bypass.OUTPUT, _MOE_BLOCK, noop(block, where))
            w = f"{where}.moe"
            yield BypassedModule(w, m, Bypass.OUTPUT, _MOE, noop(m, w))
            w = f"{where}.moe.routed_experts"
            yield BypassedModule(w, routed, Bypass.FORWARD, _ROUTED, noop(routed, w))
        if self._built_on is not None:
            self._built_on.check_children(cls)
            # Tied or untied since construction: the stash follows the model as it is now.
            self._shared = _shared_with_embedding(self.model)

    @property
    def pre_process(self) -> bool:
        """Whether the model embeds token ids: a whole model, or the first stage of
        torchtitan's pipeline split (its ``tok_embeddings`` kept)."""
        return _has(self.model, "tok_embeddings")

    @property
    def post_process(self) -> bool:
        """Whether the model ends in its final norm and LM head (a whole model or the last
        stage); otherwise it hands hidden states on."""
        return _has(self.model, "lm_head")

    def schedule_options(
        self, *, free_input: bool = False, ep_overlap_early_attn_memory_release: bool = False
    ) -> ScheduleOptions:
        """Schedule options matching this adapter. ``free_input`` is off: torchtitan's
        dispatcher and experts may keep their inputs for backward (a ``bfloat16`` cast of
        a ``bfloat16`` tensor is the tensor itself), so no slot input is released early."""
        return ScheduleOptions(
            delay_wgrad_compute=self.config.delay_wgrad_compute,
            free_input=free_input,
            ep_overlap_early_attn_memory_release=ep_overlap_early_attn_memory_release,
        )

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        positions: object = NOT_GIVEN,
        attention_masks: object = NOT_GIVEN,
    ) -> Tensor:
        """The plain path: the adapter's blocks without a schedule (each one's
        ``run_plain``) between the model's own embedding and head; the loss with
        ``labels``, else the logits. Bit-identical to :func:`~moe_overlap.combined_1f1b`.

        torchtitan's names are refused with a :class:`~moe_overlap.ConfigError` naming what
        to pass: ``positions`` is ``position_ids`` here, and the adapter builds the
        ``attention_masks`` itself from ``position_ids``."""
        refuse_titan_names(
            "TorchtitanMoEAdapter.forward", positions=positions, attention_masks=attention_masks
        )
        return self.plain_forward(input_ids, position_ids, labels=labels)

    # --- MegatronHooks: what _preprocess / _postprocess are built on ----------------------
    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_at(input_ids, None)

    def embed_at(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        """The first block's input, by the model's own ``forward`` (blocks stood in for by
        none, the final norm by a stop)."""
        model = self.model
        if not self.pre_process:
            raise IntegrationError(
                f"TorchtitanMoEAdapter: {type(model).__name__}: only the first pipeline stage "
                "(the one holding tok_embeddings) embeds token ids; this stage takes the "
                "previous stage's hidden states"
            )
        try:
            stash = self._stash_for(input_ids) if self._shared else None
            with swap(model, "layers", nn.ModuleDict()), swap(model, "norm", _StopHere()):
                _call_with(model, self._shared, take, stash, input_ids, positions=position_ids)
        except _Stop as stop:
            return stop.value
        raise IntegrationError(
            f"TorchtitanMoEAdapter: {type(model).__name__}.forward: expected it to call its "
            "final norm after its blocks, received a forward that returned without it"
        )

    def _post(
        self,
        hidden_states: Tensor,
        input_ids: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        loss_mask: Tensor | None,
        stash: Stash | None,
    ) -> Tensor:
        """:meth:`output`, or with multi-token-prediction layers :meth:`_mtp_output`; the
        embedding's parameters they use send their gradient to the microbatch's stash."""
        if not _mtp_depth(self.model):
            return self._output(hidden_states, labels, loss_mask, stash)
        _refuse_loss_mask(loss_mask)
        if input_ids is None:
            raise IntegrationError(
                f"TorchtitanMoEAdapter: {type(self.model).__name__}.mtp_layers: expected the "
                "microbatch's token ids (the MTP layers embed them shifted), received None"
            )
        return self._mtp_output(hidden_states, input_ids, position_ids, labels, stash)

    def _mtp_output(
        self,
        hidden_states: Tensor,
        input_ids: Tensor,
        position_ids: Tensor | None,
        labels: Tensor | None,
        stash: Stash | None,
    ) -> Tensor:
        """The model's own forward after its blocks (final norm, each MTP layer on the
        shifted token embeddings, the LM head on every depth), its blocks stood in for by
        the schedule's hidden states; the loss with ``labels`` (``loss_fn(predictions,
        labels, positions=...)``, by default torchtitan's ``MTPLoss`` divided by the
        labelled-token count), else the main logits."""
        model = self.model
        call = self._block_call(position_ids)
        stand_in = nn.ModuleDict({"0": _Inject(hidden_states)})
        with swap(model, "layers", stand_in):
            out = _call_with(
                model,
                self._shared,
                hand,
                stash,
                input_ids,
                position_ids,
                call.attention_masks,
            )
        items = cast("list[object]", out) if isinstance(out, list) else []
        predictions = [t for t in items if isinstance(t, Tensor)]
        if not predictions or len(predictions) != len(items):
            got = f"a list of {len(items)}" if isinstance(out, list) else type(out).__name__
            raise IntegrationError(
                f"TorchtitanMoEAdapter: {type(model).__name__}.forward: expected a list of "
                f"logits (the main ones, then one per MTP depth), received {got}"
            )
        if labels is None:
            return predictions[0]
        positions = position_ids
        if positions is None:  # one document per row, as the model's own roll assumes
            length = input_ids.shape[1]
            positions = torch.arange(length, device=input_ids.device).expand_as(input_ids)
        if self.loss_fn is not None:
            loss_fn = cast("Callable[..., object]", self.loss_fn)
            return _loss_tensor(loss_fn(predictions, labels, positions=positions))
        loss = titan_mtp_loss()(predictions, labels, None, positions=positions)
        return _loss_tensor(loss) / (labels != IGNORE_INDEX).sum()

    def _output(
        self,
        hidden_states: Tensor,
        labels: Tensor | None,
        loss_mask: Tensor | None,
        stash: Stash | None,
    ) -> Tensor:
        """The model's own final norm and LM head (its ``forward`` with no embedding and no
        blocks); the loss with ``labels``, else the logits."""
        if not self.post_process:
            raise IntegrationError(
                f"TorchtitanMoEAdapter: {type(self.model).__name__}: only the last pipeline "
                "stage (the one holding norm and lm_head) has an output; this stage hands its "
                "hidden states on"
            )
        _refuse_loss_mask(loss_mask)
        model = self.model
        with swap(model, "tok_embeddings", None), swap(model, "layers", nn.ModuleDict()):
            logits = _call_with(model, self._shared, hand, stash, hidden_states)
        if not isinstance(logits, Tensor):
            raise IntegrationError(
                f"TorchtitanMoEAdapter: {type(model).__name__}.forward: expected the logits, "
                f"received {type(logits).__name__}"
            )
        if labels is None:
            return logits
        if self.loss_fn is not None:
            return _loss_tensor(self.loss_fn(logits, labels))
        total = titan().cross_entropy_loss(logits, labels)
        return total / (labels != IGNORE_INDEX).sum()


def _call_with(
    model: nn.Module,
    shared: frozenset[int],
    through: Callable[[Tensor, Stash], Tensor],
    stash: Stash | None,
    *args: object,
    **kwargs: object,
) -> object:
    """``model(*args, **kwargs)`` with its parameters in ``shared`` (ids) used ``through``
    :func:`hand` or :func:`take` (none: as they are)."""
    swapped = (
        {
            n: through(p, stash)
            for n, p in model.named_parameters()
            if id(p) in shared and p.requires_grad
        }
        if stash is not None and torch.is_grad_enabled()
        else {}
    )
    if not swapped:
        return model(*args, **kwargs)
    return torch.func.functional_call(model, swapped, args, kwargs)


def _shared_with_embedding(model: nn.Module) -> frozenset[int]:
    """The ids of the embedding's parameters that post-process uses too: all of them with
    MTP layers (they embed the shifted tokens), a tied LM head's otherwise."""
    embedding: object = getattr(model, "tok_embeddings", None)
    if not isinstance(embedding, nn.Module):
        return frozenset()
    ids = {id(p) for p in embedding.parameters()}
    if _mtp_depth(model):
        return frozenset(ids)
    post = [getattr(model, n, None) for n in ("norm", "lm_head")]
    return frozenset(
        id(p) for m in post if isinstance(m, nn.Module) for p in m.parameters() if id(p) in ids
    )


def _refuse_loss_mask(loss_mask: Tensor | None) -> None:
    if loss_mask is not None:
        raise ConfigError(
            "TorchtitanMoEAdapter: torchtitan models take no loss_mask; expected None "
            "(set ignored label positions to -100), received a tensor"
        )


def _loss_tensor(out: object) -> Tensor:
    """A loss function's result as a tensor (a torchtitan ``BaseLoss`` returns a tuple)."""
    if isinstance(out, tuple):
        out = cast("tuple[object, ...]", out)[0]
    if not isinstance(out, Tensor):
        raise IntegrationError(
            f"TorchtitanMoEAdapter: loss_fn: expected a tensor (or a tuple starting with one), "
            f"received {type(out).__name__}"
        )
    return out


def titan_mtp_loss() -> Callable[..., object]:
    """torchtitan's DeepSeek-V3 ``MTPLoss`` with its default configuration (``mtp_scale``
    0.3; sum reduction)."""
    mtp: Any = importlib.import_module("torchtitan.models.deepseek_v3.mtp")
    return cast("Callable[..., object]", mtp.MTPLoss(mtp.MTPLoss.Config()))


def _state_of(block: nn.Module) -> list[tuple[str, int, int]]:
    """Which gradients exist and the buffers' versions: what a probe must not change."""
    grads = [(n, id(p.grad), -1) for n, p in block.named_parameters()]
    buffers = [(n, id(b), version(b)) for n, b in block.named_buffers()]
    return grads + buffers


class _ReferenceFailed(Exception):
    pass


def _compare_in_float32_or(
    block: nn.Module, name: str, x: Tensor, call: BlockCall, dtype: torch.dtype
) -> tuple[Mismatch, torch.dtype]:
    """:func:`_compare` in float32, or in ``dtype`` when the block's own forward and
    backward fail in float32."""
    try:
        return _compare(block, name, x, call, torch.float32), torch.float32
    except _ReferenceFailed as failed:
        if dtype == torch.float32:
            raise cast("Exception", failed.__cause__) from None
    return _compare(block, name, x, call, dtype), dtype


def _float32_copy(block: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A training-mode copy in ``dtype`` sharing the token dispatcher (it holds the
    expert-parallel mesh, which is not copied)."""
    memo: dict[int, object] = {}
    for m in block.modules():
        d: object = getattr(m, "token_dispatcher", None)
        if d is not None:
            memo[id(d)] = d
    dup = copy.deepcopy(block, memo)
    for m in dup.modules():
        # A forward set on the instance (torchtitan's parallelize wraps forwards so) is
        # copied as a closure over the original module: the copy would run the model.
        if "forward" in vars(m):
            delattr(m, "forward")
    # Floating-point tensors only: a complex RoPE cache keeps its imaginary part.
    with torch.no_grad():
        for p in dup.parameters():
            p.data = p.data.to(dtype)
        for m in dup.modules():
            for key, b in list(m.named_buffers(recurse=False)):
                if b.is_floating_point():
                    setattr(m, key, b.to(dtype))
    dup.train()
    return dup


def _compare(
    block: nn.Module, name: str, x: Tensor, call: BlockCall, dtype: torch.dtype
) -> Mismatch:
    """The split (on one copy in ``dtype``) against the block's own forward and backward
    (on another): output, input gradient, parameter gradients. Raises
    :class:`_ReferenceFailed` (from the error) when the block's own code fails."""
    ref, cand = _float32_copy(block, dtype), _float32_copy(block, dtype)
    layer = TitanMoELayer(cand, 0, f"layers.{name}", lambda cs: call, AdapterConfig())
    x_ref = x.detach().to(dtype).requires_grad_()
    x_cand = x.detach().to(dtype).requires_grad_()
    g = torch.Generator().manual_seed(1)
    try:
        out_r = cast("Tensor", ref(x_ref, call.attention_masks, call.positions))
        grad_out = torch.randn(out_r.shape, generator=g).to(out_r.device, out_r.dtype)
        torch.autograd.backward(out_r, grad_out)
    except Exception as exc:
        raise _ReferenceFailed from exc
    out_c = layer.run_plain(x_cand, ChunkState(Microbatch()))
    return compare_backward(out_c, out_r, grad_out, (x_cand, x_ref), (cand, ref))
