"""The torchtitan adapter on blocks torchtitan wrapped for activation checkpointing
(``SelectiveAC``, ``FullAC`` applied with their own ``apply``): the slots recompute with
the wrapper's settings; parity with torchtitan's own forward and backward of the wrapped
model, the schedule bit-identical to the plain path (and to no checkpointing), the
load-balancing hook's expert biases equal to torchtitan's own steps, refusals."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")

from moe_overlap import ConfigError, combined_1f1b
from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter
from tests.adapters.test_torchtitan import (
    _optimizer,
    assert_bit_identical,
    assert_matches_torchtitan,
    grads,
    microbatches,
    model_of,
    moe_buffers,
    one_rank_group,
    plain_step,
    schedule,
    torchtitan_step,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:In CPU autocast, but the target dtype is not supported:UserWarning",
    "ignore:Casting complex values to real discards the imaginary part:UserWarning",
)

__all__ = ["one_rank_group"]  # the fixture, imported for the steps test


def _policy(name: str) -> Any:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    cls = {"selective": SelectiveAC, "full": FullAC}[name]
    return cls(cls.Config())


def wrapped(family: str, policy: str) -> nn.Module:
    """``family``'s test model with torchtitan's activation checkpointing applied by its
    own ``apply`` (every block in a ``CheckpointWrapper``)."""
    model = model_of(family)
    _policy(policy).apply(model)
    layers = model.get_submodule("layers")
    assert all(type(b).__name__ == "CheckpointWrapper" for b in layers.children())
    return model


def _count_calls(cls_name: str) -> Callable[[], int]:
    """How many times modules of class ``cls_name`` ran ``forward`` since the call (a global
    forward hook; removed by the returned function, which reports the count)."""
    calls = [0]

    def hook(module: nn.Module, args: object, out: object) -> None:
        if type(module).__name__ == cls_name:
            calls[0] += 1

    handle = nn.modules.module.register_module_forward_hook(hook)

    def done() -> int:
        handle.remove()
        return calls[0]

    return done


FAMILIES_AC = ["deepseek_v3", "qwen3"]
POLICIES = ["selective", "full"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", FAMILIES_AC)
def test_plain_path_matches_torchtitan_under_ac(family: str, policy: str) -> None:
    """The adapter on the wrapped model against torchtitan's own forward and backward of the
    same wrapped model, bit for bit: losses, gradients, and the token counts, which both
    count twice (forward and recompute) for the wrapped blocks."""
    model = wrapped(family, policy)
    mbs = microbatches(family)
    ours = TorchtitanMoEAdapter(copy.deepcopy(model), self_check=False)
    wrapper: Any = ours.model.get_submodule("layers.1")
    assert ours.decoder.layers[1].layer is wrapper._checkpoint_wrapped_module
    ref_losses = torchtitan_step(model, mbs)
    losses = plain_step(ours, mbs)
    assert_matches_torchtitan(family, ours.model, losses, model, ref_losses)


@pytest.mark.parametrize("delay", [False, True], ids=["wgrad", "delayed_wgrad"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", FAMILIES_AC)
def test_schedule_is_bit_identical_under_ac(family: str, policy: str, delay: bool) -> None:
    """Schedule and plain path bit-identical on the wrapped model; both bit-identical to the
    unwrapped model's (recomputing changes no value), with the counts doubled; the pre-
    dispatch region and the routed experts really run again in backward."""
    mbs = microbatches(family)
    plain = TorchtitanMoEAdapter(wrapped(family, policy), delay_wgrad_compute=delay)
    sched = TorchtitanMoEAdapter(
        wrapped(family, policy), delay_wgrad_compute=delay, self_check=False
    )
    stored = TorchtitanMoEAdapter(model_of(family), delay_wgrad_compute=delay, self_check=False)
    plain_losses = plain_step(plain, mbs, delay=delay)
    experts = _count_calls("GroupedExperts")
    losses = schedule(sched, mbs)
    n_moe = sum(layer.is_moe for layer in sched.decoder.layers)
    assert experts() == 2 * len(mbs) * n_moe, "the routed experts were not recomputed"
    stored_losses = plain_step(stored, mbs, delay=delay)
    assert sched.pending_wgrad == 0 and plain.pending_wgrad == 0
    where = f"{family} {policy} AC (delay_wgrad_compute={delay})"
    assert [float(x) for x in losses] == [float(x) for x in plain_losses], where
    assert [float(x) for x in losses] == [float(x) for x in stored_losses], where
    got = grads(sched.model)
    assert_bit_identical(got, grads(plain.model), "gradients", f"{where}: schedule vs plain")
    unwrapped = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in got.items()}
    assert_bit_identical(
        unwrapped, grads(stored.model), "gradients", f"{where}: vs no checkpointing"
    )
    counts = moe_buffers(sched.model, "tokens_per_expert_E")
    assert_bit_identical(
        counts, moe_buffers(plain.model, "tokens_per_expert_E"), "tokens_per_expert_E", where
    )
    once = moe_buffers(stored.model, "tokens_per_expert_E")
    doubled = {n.replace("._checkpoint_wrapped_module", ""): c / 2 for n, c in counts.items()}
    assert_bit_identical(doubled, once, "tokens_per_expert_E / 2", f"{where}: vs stored")


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("policy", POLICIES)
def test_load_balancing_steps_under_ac_equal_torchtitan(policy: str) -> None:
    """Three AdamW steps with torchtitan's load-balancing hook (which halves the counts of
    wrapped blocks), free-running: the schedule's counts, expert biases and parameters equal
    torchtitan's own steps on the same wrapped model, bit for bit, after every step (the
    gradients are torchtitan's own, so AdamW moves both models identically and no nearly
    tied top-k can route a token otherwise)."""
    family = "deepseek_v3"
    sched = TorchtitanMoEAdapter(wrapped(family, policy), self_check=False)
    ref = wrapped(family, policy)
    opt_sched, opt_ref = _optimizer(sched.model), _optimizer(ref)
    sched_params, ref_params = dict(sched.model.named_parameters()), dict(ref.named_parameters())
    assert_bit_identical(sched_params, ref_params, "parameters", "before step 0")
    bias0 = moe_buffers(ref, "expert_bias_E")
    bias = bias0
    for step in range(3):
        mbs = microbatches(family, seed=10 + step)
        where = f"{policy} AC, step {step}"
        schedule(sched, mbs)
        torchtitan_step(ref, mbs)
        assert_bit_identical(
            moe_buffers(sched.model, "tokens_per_expert_E"),
            moe_buffers(ref, "tokens_per_expert_E"),
            "tokens_per_expert_E",
            where,
        )
        for opt in (opt_sched, opt_ref):
            opt.step()
            opt.zero_grad()
        bias = moe_buffers(ref, "expert_bias_E")
        assert_bit_identical(moe_buffers(sched.model, "expert_bias_E"), bias, "bias", where)
        assert_bit_identical(
            {n: p.detach() for n, p in sched_params.items()},
            {n: p.detach() for n, p in ref_params.items()},
            "parameters",
            where,
        )
    assert any(not torch.equal(bias[n], bias0[n]) for n in bias0), "no expert bias moved"


# --- refusals -------------------------------------------------------------------------------
def _wrap_layer(model: nn.Module, name: str, wrap: Callable[[nn.Module], nn.Module]) -> None:
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleDict)
    layers[name] = wrap(layers[name])


def _reentrant(block: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT)


def _offload(block: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

    return offload_wrapper(block)


def _own_checkpoint_fn(block: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def my_checkpoint(fn: Callable[..., object], *args: object, **kwargs: object) -> object:
        return fn(*args, **kwargs)

    return checkpoint_wrapper(block, checkpoint_fn=my_checkpoint)


def _subclass(block: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    class MyCheckpointWrapper(CheckpointWrapper):
        pass

    return MyCheckpointWrapper(block)


def _other_arguments(block: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapper = checkpoint_wrapper(block)
    fn: Any = wrapper.checkpoint_fn
    wrapper.__dict__["checkpoint_fn"] = functools.partial(fn.func, **fn.keywords, foo=1)
    return wrapper


@pytest.mark.parametrize(
    ("wrap", "message"),
    [
        (_reentrant, r"layers\.1 \(CheckpointWrapper\): expected non-reentrant.*REENTRANT"),
        (_offload, r"layers\.1: expected the block itself or torch's CheckpointWrapper.*Offload"),
        (_subclass, r"layers\.1: expected the block itself.*received MyCheckpointWrapper"),
        (
            _own_checkpoint_fn,
            r"layers\.1 \(CheckpointWrapper\): expected its checkpoint_fn to be torch\.utils\.checkpoint",
        ),
        (
            _other_arguments,
            r"layers\.1 \(CheckpointWrapper\): expected checkpoint settings among.*received the arguments \['foo'\]",
        ),
    ],
    ids=["reentrant", "offload", "subclass", "own_checkpoint_fn", "other_arguments"],
)
def test_refuses_other_checkpoint_wrappers(
    wrap: Callable[[nn.Module], nn.Module], message: str
) -> None:
    model = model_of("deepseek_v3")
    _wrap_layer(model, "1", wrap)
    with pytest.raises(ConfigError, match=r"DeepSeekV3Model\." + message):
        TorchtitanMoEAdapter(model, self_check=False)


def test_refuses_a_hook_on_the_checkpoint_wrapper() -> None:
    model = wrapped("deepseek_v3", "full")
    model.get_submodule("layers.2").register_forward_hook(lambda *args: None)
    with pytest.raises(
        ConfigError, match=r"DeepSeekV3Model\.layers\.2: expected no forward or backward hooks"
    ):
        TorchtitanMoEAdapter(model, self_check=False)


def test_refuses_a_checkpoint_wrapper_added_or_changed_after_construction() -> None:
    """Wrapping a block after construction, or changing a wrapper's settings, is refused
    at the next plan build."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    mbs = microbatches("deepseek_v3")[:1]
    model = model_of("deepseek_v3")
    adapter = TorchtitanMoEAdapter(model, self_check=False)
    FullAC(FullAC.Config()).apply(model)
    with pytest.raises(
        ConfigError,
        match=r"DeepSeekV3Model\.layers\.0: expected the block the adapter was built on, "
        r"received CheckpointWrapper",
    ):
        combined_1f1b(adapter, mbs, options=adapter.schedule_options())

    model = wrapped("deepseek_v3", "selective")
    adapter = TorchtitanMoEAdapter(model, self_check=False)
    wrapper: Any = model.get_submodule("layers.1")
    wrapper.checkpoint_fn = functools.partial(wrapper.checkpoint_fn)
    with pytest.raises(
        ConfigError,
        match=r"DeepSeekV3Model\.layers\.1 \(CheckpointWrapper\): expected the checkpoint_fn "
        "the adapter was built with",
    ):
        combined_1f1b(adapter, mbs, options=adapter.schedule_options())
