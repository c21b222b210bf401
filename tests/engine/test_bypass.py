"""Torch wrappers, compilation and hooks the schedule would bypass: refused at every plan
build, naming the supported route; those on modules the slots call run as in plain training."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import HashStore  # type: ignore[attr-defined]  # pyright: ignore[reportPrivateImportUsage]
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)

from moe_overlap import ConfigError, ModelChunkSchedulePlan, combined_1f1b
from moe_overlap.blocks import recompute_module
from moe_overlap.models import GPTMoEConfig, GPTMoEModel
from moe_overlap.models._layers import DenseLayer, MoELayer, _AttentionBlock

from .test_parity import assert_same
from .toy_model import ToyConfig, ToyLayer, ToyModel, grads, make_microbatches, plain_step

CONFIG = ToyConfig()
LAYER = r"ToyModel\.decoder\.layers\[1\] \(ToyLayer\): "
NEVER_LAYER = r"the schedule never calls a decoder layer's forward"
HOOK_ROUTE = r"register them on the modules the slots call"
CHECKPOINT_ROUTE = r"GPTMoEConfig\.recompute.*recompute_module.*docs/recompute\.md"
COMPILE_ROUTE = r"compile the modules the slots call instead.*docs/compile\.md"


def compiled(module: nn.Module) -> nn.Module:
    """``torch.compile(module)``: an ``OptimizedModule`` (torch types it as a callable)."""
    return cast(nn.Module, torch.compile(module))


def _model() -> ToyModel:
    return ToyModel(CONFIG, "dm")


def _layer(model: ToyModel, i: int = 1) -> ToyLayer:
    layer = model.decoder.layers[i]
    assert isinstance(layer, ToyLayer)
    return layer


def _step(model: nn.Module) -> None:
    combined_1f1b(model, make_microbatches(2, CONFIG))  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def _noop(*args: object) -> None:
    del args


def _noop_kwargs(module: nn.Module, args: object, kwargs: object, *rest: object) -> None:
    del module, args, kwargs, rest


HOOKS: dict[str, Callable[[nn.Module], Any]] = {
    "forward": lambda m: m.register_forward_hook(_noop),
    "forward_with_kwargs": lambda m: m.register_forward_hook(_noop_kwargs, with_kwargs=True),
    "forward_always_call": lambda m: m.register_forward_hook(_noop, always_call=True),
    "forward_prepend": lambda m: m.register_forward_hook(_noop, prepend=True),
    "forward_pre": lambda m: m.register_forward_pre_hook(_noop),
    "forward_pre_with_kwargs": lambda m: m.register_forward_pre_hook(
        _noop_kwargs, with_kwargs=True
    ),
    "full_backward": lambda m: m.register_full_backward_hook(_noop),
    "full_backward_pre": lambda m: m.register_full_backward_pre_hook(_noop),
}
HOOK_NOUN = {
    "forward": "forward hook",
    "forward_with_kwargs": "forward hook",
    "forward_always_call": "forward hook",
    "forward_prepend": "forward hook",
    "forward_pre": "forward pre-hook",
    "forward_pre_with_kwargs": "forward pre-hook",
    "full_backward": "backward hook",
    "full_backward_pre": "backward pre-hook",
}


@pytest.mark.parametrize("kind", list(HOOKS))
def test_hooks_on_a_layer_the_model_or_the_decoder_are_refused(kind: str) -> None:
    model = _model()
    targets: list[tuple[nn.Module, str]] = [
        (_layer(model), LAYER + r"expected no forward or backward hooks on it, received 1 "),
        (model, r"^ToyModel: expected no forward or backward hooks.*never calls the model's"),
        (model.decoder, r"^ToyModel\.decoder: .*never calls the decoder's forward"),
    ]
    for target, match in targets:
        handle = HOOKS[kind](target)
        try:
            with pytest.raises(ConfigError, match=match) as info:
                _step(model)
            text = str(info.value)
            assert f"1 {HOOK_NOUN[kind]} (_noop" in text
            assert "so they would never run" in text and "register them on the modules" in text
        finally:
            handle.remove()
    _step(model)  # all removed: the model trains


def test_a_hook_added_after_a_step_is_found_at_the_next_plan_and_the_model_stays_exact() -> None:
    ref = _model()
    model = copy.deepcopy(ref)
    mbs = make_microbatches(3, CONFIG, seed=4)
    combined_1f1b(model, mbs)
    plain_step(ref, mbs)
    handle = _layer(model).register_forward_hook(_noop)
    with pytest.raises(ConfigError, match=LAYER + ".*" + HOOK_ROUTE):
        combined_1f1b(model, mbs)
    # A plan built directly is checked too.
    mb = mbs[0]
    with pytest.raises(ConfigError, match=LAYER):
        ModelChunkSchedulePlan(
            model,
            mb,
        )
    handle.remove()
    combined_1f1b(model, mbs)
    plain_step(ref, mbs)
    assert_same(grads(model), grads(ref))


def test_checkpoint_wrappers_are_refused_before_the_layer_protocol_check() -> None:
    model = _model()
    original = _layer(model)
    for wrap in (checkpoint_wrapper, offload_wrapper):
        model.decoder.layers[1] = wrap(original)
        name = type(model.decoder.layers[1]).__name__
        with pytest.raises(
            ConfigError,
            match=rf"ToyModel\.decoder\.layers\[1\] \({name}\): expected no activation "
            rf"checkpointing of it, received an? {name} around ToyLayer; {NEVER_LAYER}.*"
            rf"would never recompute anything; recompute inside the slots instead: {CHECKPOINT_ROUTE}",
        ):
            _step(model)
    model.decoder.layers[1] = original
    # apply_activation_checkpointing replacing the decoder layers.
    wrapped = _model()
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, ToyLayer))
    with pytest.raises(ConfigError, match=r"layers\[0\] \(CheckpointWrapper\).*around ToyLayer"):
        _step(wrapped)
    # Around the whole model.
    with pytest.raises(ConfigError, match=r"^CheckpointWrapper: .*around ToyModel.*the model's"):
        _step(checkpoint_wrapper(_model()))


def test_composable_checkpoint_and_recompute_module_on_a_layer_are_refused() -> None:
    from torch.distributed._composable.checkpoint_activation import checkpoint

    model = _model()
    checkpoint(_layer(model))
    with pytest.raises(
        ConfigError,
        match=LAYER.replace("ToyLayer", r"\w*ToyLayer")
        + r"expected no activation checkpointing of it, received "
        r"torch\.distributed\._composable\.checkpoint\(",
    ):
        _step(model)
    model = _model()
    recompute_module(_layer(model))  # sets the layer's forward: the slots never call it
    with pytest.raises(
        ConfigError,
        match=LAYER + r"expected the class's own forward, received a forward set on the "
        r"instance \(_recomputed_forward\).*recompute_module on a layer's attention",
    ):
        _step(model)


def test_compiled_models_and_layers_are_refused() -> None:
    model = _model()
    with pytest.raises(
        ConfigError,
        match=r"^OptimizedModule: expected no torch\.compile of it, received an OptimizedModule "
        r"around ToyModel; the schedule never calls the model's forward.*" + COMPILE_ROUTE,
    ):
        _step(compiled(model))
    original = _layer(model)
    model.decoder.layers[1] = compiled(original)
    with pytest.raises(ConfigError, match=r"layers\[1\] \(OptimizedModule\).*around ToyLayer"):
        _step(model)
    model.decoder.layers[1] = original
    original.compile()
    with pytest.raises(
        ConfigError,
        match=LAYER + r"expected no torch\.compile of it, received ToyLayer\.compile\(\) "
        r"\(compiled in place\)",
    ):
        _step(model)
    del original._compiled_call_impl
    model.compile()
    with pytest.raises(ConfigError, match=r"^ToyModel: .*ToyModel\.compile\(\)"):
        _step(model)


@contextmanager
def _one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_data_parallel_wrappers_and_fsdp1_are_refused() -> None:
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    with _one_rank_group():
        with pytest.raises(
            ConfigError,
            match=r"^DistributedDataParallel: expected no data-parallel wrapper around it, "
            r"received a DistributedDataParallel around ToyModel.*average the gradients.*"
            r"fully_shard_slots",
        ):
            _step(DistributedDataParallel(_model()))
        model = _model()
        replicate(_layer(model))
        with pytest.raises(ConfigError, match=r"composable\.replicate.*gradient synchronization"):
            _step(model)
        model = _model()
        model.decoder.layers[1] = FullyShardedDataParallel(
            _layer(model), device_id=torch.device("cpu")
        )
        with pytest.raises(
            ConfigError,
            match=r"layers\[1\] \(FullyShardedDataParallel\): expected a layer not wrapped by "
            r"FSDP, received a FullyShardedDataParallel \(FSDP1\) around ToyLayer.*"
            r"fully_shard_slots",
        ):
            _step(model)


# --- what the slots call: accepted, and run as in plain training ---------------------------


def test_hooks_on_modules_the_slots_call_run_as_in_plain_training() -> None:
    ref = _model()
    model = copy.deepcopy(ref)
    seen: dict[str, list[Tensor]] = {"ref": [], "model": []}

    def install(m: ToyModel, key: str) -> None:
        def record(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            del module, args
            seen[key].append(out.detach().clone())

        def halve(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            del module
            return (args[0] * 0.5,)

        _layer(m, 0).attn.register_forward_hook(record)
        _layer(m, 1).router.register_forward_pre_hook(halve)  # changes what is routed
        m.embedding.register_forward_hook(record)

    install(ref, "ref")
    install(model, "model")
    mbs = make_microbatches(3, CONFIG, seed=2)
    losses = combined_1f1b(model, mbs)
    assert losses == plain_step(ref, mbs)
    assert_same(grads(model), grads(ref))
    assert len(seen["model"]) == len(seen["ref"]) == 2 * len(mbs)
    for a, b in zip(
        sorted(seen["model"], key=Tensor.sum), sorted(seen["ref"], key=Tensor.sum), strict=True
    ):
        assert torch.equal(a, b)


def test_global_module_hooks_are_accepted_and_see_the_modules_the_slots_call() -> None:
    model = _model()
    called: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}

    def hook(module: nn.Module, args: object, out: object) -> None:
        del args, out
        called.append(names.get(id(module), "?"))

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        _step(model)
    finally:
        handle.remove()
    assert "decoder.layers.0.attn" in called and "embedding" in called
    assert "decoder.layers.0" not in called  # the layers' forward is not called


def test_reference_model_wrappers_are_refused() -> None:
    config = GPTMoEConfig(hidden_size=16, num_layers=2, num_experts=4, ffn_hidden_size=32)
    mbs = [make_microbatches(1, CONFIG)[0]]
    model = GPTMoEModel(config)
    with pytest.raises(ConfigError, match=r"^OptimizedModule: .*around GPTMoEModel"):
        combined_1f1b(compiled(model), mbs)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    handle = model.decoder.layers[1].register_forward_pre_hook(_noop)
    with pytest.raises(ConfigError, match=r"GPTMoEModel\.decoder\.layers\[1\] \(MoELayer\)"):
        combined_1f1b(model, mbs)
    handle.remove()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, (DenseLayer, MoELayer)))
    with pytest.raises(ConfigError, match=r"layers\[0\] \(CheckpointWrapper\).*DenseLayer"):
        combined_1f1b(model, mbs)


def test_checkpointing_the_modules_the_slots_call_is_exact() -> None:
    """apply_activation_checkpointing selecting the attention blocks (called by the slots)."""
    config = GPTMoEConfig(hidden_size=16, num_layers=2, num_experts=4, ffn_hidden_size=32)
    mbs = make_microbatches(3, ToyConfig(vocab=config.vocab_size), seed=3)
    scheduled, plain = GPTMoEModel(config), GPTMoEModel(config)
    for m in (scheduled, plain):
        apply_activation_checkpointing(m, check_fn=lambda m: isinstance(m, _AttentionBlock))
    losses = combined_1f1b(scheduled, mbs)
    want = []
    for mb in mbs:
        assert mb.input_ids is not None
        loss = plain(mb.input_ids, mb.position_ids, labels=mb.labels)
        loss.backward()
        want.append(loss.detach())
    assert losses == want
    assert_same(grads(scheduled), grads(plain))
