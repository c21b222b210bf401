"""Debug mode (``MOE_OVERLAP_DEBUG=1``): beartype on every call; off: beartype never imported.

The switch is read at import time: the check without it runs in a fresh interpreter, those
with it in the session's interpreter in debug mode (``debug_python``, tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import DebugPython

ROOT = Path(__file__).resolve().parents[2]


def run(code: str, *, debug: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MOE_OVERLAP_DEBUG"}
    if debug:
        env["MOE_OVERLAP_DEBUG"] = "1"
    # Keep the caller's path after ours (where beartype may be installed aside, on a GPU box).
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


def test_off_by_default_imports_no_beartype_and_wraps_nothing() -> None:
    out = run(
        """
        import sys, moe_overlap as m
        assert "beartype" not in sys.modules, "beartype imported"
        for name in m.__all__:
            assert not hasattr(getattr(m, name), "__wrapped__"), name
        print("ok")
        """,
        debug=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_debug_mode_checks_calls(debug_python: DebugPython) -> None:
    out = debug_python(
        """
        import sys, moe_overlap as m
        assert "beartype" in sys.modules
        assert hasattr(m.combined_1f1b, "__wrapped__")
        try:
            m.should_free_input(1, True, object(), 4)
        except m.TypeHintError as e:  # the library's own error (an IntegrationError)
            assert isinstance(e, m.IntegrationError) and isinstance(e, TypeError)
            assert "should_free_input" in str(e)
            print("ok")
        """,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_an_argument_whose_check_raises_is_a_type_hint_error(debug_python: DebugPython) -> None:
    """A check that raises (``len()`` of a 0-d tensor against ``Iterable[str]``), or whose
    report of a violation raises (a broken ``__repr__``), is the library's ``TypeHintError``
    naming the parameter, in beartype's format, the bare exception its cause; functions and
    methods alike."""
    out = debug_python(
        r"""
        import re, torch
        from torch import nn
        import moe_overlap as m
        from moe_overlap import blocks
        from moe_overlap.integrations import checkpoint

        class BrokenRepr:
            def __repr__(self) -> str:
                raise RuntimeError("no repr")

        calls = [
            (
                lambda: checkpoint.register_expert_shards(
                    nn.Linear(2, 2), torch.tensor(1), num_experts=2, group=None
                ),
                r"^Function \S*\.register_expert_shards\(\) parameter names=tensor\(1\) violates "
                r"type hint collections\.abc\.Iterable\[str\], as checking it raised TypeError: "
                r"len\(\) of a 0-d tensor; pass a value its annotation allows$",
                TypeError,
            ),
            (
                lambda: blocks.TokenDispatcher(4, 2, kind=BrokenRepr()),
                r"^Method \S*\.TokenDispatcher\.__init__\(\) parameter kind=<BrokenRepr object> "
                r"violates type hint .*Literal\['alltoall', 'loopback'\], and beartype's report "
                r"of it raised RuntimeError: no repr",
                RuntimeError,
            ),
        ]
        for call, pattern, cause in calls:
            try:
                call()
            except m.TypeHintError as e:
                assert re.search(pattern, str(e)), str(e)
                assert type(e.__cause__) is cause, repr(e.__cause__)
            else:
                raise AssertionError("accepted")
        print("ok")
        """,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"


def test_an_error_of_the_call_itself_passes_unchanged(debug_python: DebugPython) -> None:
    """An exception raised past the argument checks, by the call (or what it calls), is not
    made a ``TypeHintError``: the very exception object propagates."""
    out = debug_python(
        """
        from moe_overlap import args

        mine = ValueError("the spec's own")

        class Raising(args.Spec[int]):
            def check(self, value: object) -> int:
                raise mine

        for call, expected in (
            (lambda: args.check_arg("here", "n", 1, Raising("an int")), ValueError),
            (lambda: args.Int(1).check(0), args.Mismatch),  # a method of the package
        ):
            try:
                call()
            except Exception as e:
                assert type(e) is expected, repr(e)
                assert e.__cause__ is None, repr(e.__cause__)
                assert expected is not ValueError or e is mine
            else:
                raise AssertionError("accepted")
        print("ok")
        """,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"


def test_debug_mode_decorates_every_module_without_a_warning() -> None:
    """beartype can check every annotation of the package: a hint it cannot check (a
    Protocol that is not runtime-checkable, a class that cannot be subscripted at run time)
    would leave that function unchecked, with a warning at import."""
    out = run(
        """
        import importlib, pkgutil, moe_overlap
        optional = ("moe_overlap.adapters", "moe_overlap.timeline")  # need extras
        for info in pkgutil.walk_packages(moe_overlap.__path__, "moe_overlap."):
            try:
                importlib.import_module(info.name)
            except ImportError:
                if not info.name.startswith(optional):
                    raise
        print("ok")
        """,
        debug=True,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"


def test_first_step_check_keeps_the_schedule_s_stream_order(debug_python: DebugPython) -> None:
    """The first-step check runs where the schedule runs the model (its compute stream,
    after the caller's stream and before it): a step called on another stream than the one
    that made the model stays clean under the stream-order checker."""
    out = debug_python(
        """
        import torch
        from moe_overlap import Microbatch, combined_1f1b
        from moe_overlap.engine import stream_context
        from moe_overlap.engine._plain_check import first_step_outcome
        from moe_overlap.models import GPTMoEModel
        from moe_overlap.streams import CpuStream, stream_order_check
        from tests.models._helpers import SMALL
        with stream_order_check() as checker:
            model = GPTMoEModel(SMALL)  # made on the default stream, the compute stream
            with stream_context(CpuStream("user")):
                g = torch.Generator().manual_seed(0)
                ids = [torch.randint(0, SMALL.vocab_size, (2, 8), generator=g) for _ in range(2)]
                mbs = [Microbatch(input_ids=x.clone(), labels=x.roll(-1, 1)) for x in ids]
                combined_1f1b(model, mbs, options=model.schedule_options())
        assert first_step_outcome(model) == "compared", first_step_outcome(model)
        assert checker.cross_stream_storages > 0
        print("ok")
        """,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"


@pytest.mark.slow
def test_debug_mode_step_is_still_exact(debug_python: DebugPython) -> None:
    """A whole overlapped step under beartype: Protocol checks happen once per plan."""
    out = debug_python(
        """
        import copy, torch
        from moe_overlap import ScheduleOptions, combined_1f1b
        from tests.engine.toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step
        config = ToyConfig(shared_expert=True)
        ref = ToyModel(config, "dmt")
        model = copy.deepcopy(ref)
        model.set_delay(True)
        mbs = make_microbatches(3, config)
        plain_step(ref, mbs)
        combined_1f1b(model, mbs, options=ScheduleOptions(delay_wgrad_compute=True))
        g, r = grads(model), grads(ref)
        assert all(torch.equal(g[k], r[k]) for k in g if g[k] is not None)
        print("ok")
        """,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --- issue 24, part wgrad: the first-step comparison with the plain forward ------------------


@pytest.mark.slow
def test_first_step_check_raises_no_false_alarm_and_leaves_no_trace(
    debug_python: DebugPython,
) -> None:
    """The toy model, the reference model and a transformers model through the adapter, with
    delayed wgrad on and off: compared on their first step, no alarm, the step exact (also
    over gradients accumulated before it); buffers and the RNG state as without the check."""
    out = debug_python(
        """
        import copy, dataclasses, torch
        import moe_overlap as mo
        from moe_overlap.engine._plain_check import first_step_outcome
        from tests.engine.toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step
        from tests.engine.test_parity import assert_same

        # The toy model (forward takes the Microbatch), delayed wgrad, MTP and shared expert.
        for kinds, delay, fill in [("dm", False, False), ("dmt", True, True)]:
            config = ToyConfig(shared_expert=True)
            ref = ToyModel(config, kinds)
            model = copy.deepcopy(ref)
            model.set_delay(delay)
            before, mbs = make_microbatches(2, config, seed=7), make_microbatches(3, config)
            plain_step(ref, before)  # gradients accumulated before the first step ...
            plain_step(model, before) if not delay else None
            if delay:  # ... which a delayed plain backward leaves pending: compute them
                for mb in before:
                    model(mb).backward()
                    for layer in model.decoder.layers:
                        for part in layer.pre_dispatch_wgrad():
                            part.module.backward_dw()
                        for part in layer.mlp_wgrad():
                            part.backward_dw()
            plain_step(ref, mbs)
            rng = torch.get_rng_state()
            mo.combined_1f1b(model, mbs, fill_drain=fill)
            assert torch.equal(torch.get_rng_state(), rng), "the check moved the RNG"
            assert first_step_outcome(model) == "compared", first_step_outcome(model)
            assert_same(grads(model), grads(ref))

        # A model whose preprocess draws random numbers and counts microbatches in a buffer.
        class Noisy(ToyModel):
            def __init__(self):
                super().__init__(ToyConfig(), "dm")
                self.register_buffer("seen", torch.zeros(()))

            def _preprocess(self, input_ids, position_ids, **kwargs):
                out = super()._preprocess(input_ids, position_ids, **kwargs)
                self.seen += 1
                noisy = out.decoder_input + 0.1 * torch.randn_like(out.decoder_input)
                return out._replace(decoder_input=noisy)

        torch.manual_seed(11)
        ref = Noisy()
        model = copy.deepcopy(ref)
        mbs = make_microbatches(3, ToyConfig())
        torch.manual_seed(5)
        plain_step(ref, mbs)
        torch.manual_seed(5)
        mo.combined_1f1b(model, mbs)
        assert first_step_outcome(model) == "compared"
        assert_same(grads(model), grads(ref))
        assert float(model.seen) == float(ref.seen) == 3, (float(model.seen), float(ref.seen))

        # The reference model, delayed wgrad on and off, padded microbatches.
        from moe_overlap.models import GPTMoEModel
        from tests.models._helpers import SMALL, microbatches
        for delay in (False, True):
            config = dataclasses.replace(SMALL, delay_wgrad_compute=delay, moe_aux_loss_coeff=0.01)
            model = GPTMoEModel(config)
            ref = GPTMoEModel(dataclasses.replace(config, delay_wgrad_compute=False))
            ref.load_state_dict(model.state_dict())
            data = microbatches(3, vocab=SMALL.vocab_size, padded=True)
            for mb in data:
                ref(mb.input_ids, mb.position_ids, mb.labels, mb.loss_mask,
                    attention_mask=mb.attention_mask, padding_mask=mb.padding_mask).backward()
            mo.combined_1f1b(model, data, options=model.schedule_options())
            assert first_step_outcome(model) == "compared", first_step_outcome(model)
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad), n

        # A transformers model through the adapter (its forward: the adapter's plain path).
        from moe_overlap.adapters.transformers import TransformersMoEAdapter
        from tests.adapters._hf import qwen2_moe, microbatches as hf_microbatches
        for delay in (False, True):
            hf = qwen2_moe(aux=True)
            hf_ref = copy.deepcopy(hf)
            adapter = TransformersMoEAdapter(hf, delay_wgrad_compute=delay)
            reference = TransformersMoEAdapter(hf_ref, delay_wgrad_compute=delay)
            data = hf_microbatches(3, padded=True)
            for mb in data:  # its plain path: unclaimed, weight gradients computed at once
                reference.forward(mb.input_ids, attention_mask=mb.attention_mask,
                                  labels=mb.labels).backward()
            assert reference.pending_wgrad == 0
            mo.combined_1f1b(adapter, data, options=adapter.schedule_options())
            assert first_step_outcome(adapter) == "compared", first_step_outcome(adapter)
            for (n, p), q in zip(hf.named_parameters(), hf_ref.parameters()):
                assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), n
        print("ok")
        """,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"


def test_first_step_check_compares_a_torchtitan_model(debug_python: DebugPython) -> None:
    """The torchtitan adapter builds and trains under beartype; the first-step check calls
    its ``forward`` with the microbatch's fields (torchtitan's names there are keyword-only
    parameters it never passes) and compares; the step equals torchtitan's own model's
    forward and backward bit for bit."""
    pytest.importorskip("torchtitan")
    out = debug_python(
        """
        import copy, warnings, torch
        import moe_overlap as mo
        from moe_overlap.engine._plain_check import first_step_outcome
        from moe_overlap.adapters.torchtitan import TorchtitanMoEAdapter
        from tests.adapters._titan import build, causal_stand_in
        from tests.adapters.test_torchtitan import grads, microbatches, torchtitan_step

        warnings.filterwarnings("ignore", message="In CPU autocast")  # torchtitan's router
        model = causal_stand_in(build("deepseek_v3", layers=2))
        own = copy.deepcopy(model)
        adapter = TorchtitanMoEAdapter(model)
        mbs = microbatches("deepseek_v3")[:2]
        losses = mo.combined_1f1b(adapter, mbs, options=adapter.schedule_options())
        assert first_step_outcome(adapter) == "compared", first_step_outcome(adapter)
        own_losses = torchtitan_step(own, mbs)
        assert all(torch.equal(a.detach(), b) for a, b in zip(losses, own_losses))
        g, w = grads(model), grads(own)
        assert all((g[k] is None and w[k] is None) or torch.equal(g[k], w[k]) for k in w)
        print("ok")
        """,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"


@pytest.mark.slow
def test_first_step_check_skips_what_it_cannot_compare(debug_python: DebugPython) -> None:
    """No plain forward that takes the microbatch, or not a whole model: skipped, the step
    runs as without debug mode."""
    out = debug_python(
        """
        import copy, torch
        import moe_overlap as mo
        from moe_overlap.engine._plain_check import first_step_outcome
        from tests.engine.toy_model import ToyConfig, ToyModel, grads, make_microbatches, plain_step
        from tests.engine.test_parity import assert_same

        class LogitsOnly(ToyModel):  # a forward that takes no labels
            def forward(self, input_ids):
                return self._postprocess(self.embedding(input_ids), None, None, None,
                                         None, None, None)

        model = LogitsOnly(ToyConfig(), "dm")
        ref = copy.deepcopy(model)
        mbs = make_microbatches(2, ToyConfig())
        mo.combined_1f1b(model, mbs)
        outcome = first_step_outcome(model)
        assert outcome.startswith("skipped: no forward that takes"), outcome
        for mb in mbs:  # the reference: the toy's own plain path
            ToyModel.forward(ref, mb).backward()
        assert_same(grads(model), grads(ref))

        class Logits(ToyModel):  # takes the fields, returns the logits
            def forward(self, input_ids, position_ids, labels):
                return super()._postprocess(self.embedding(input_ids), None, None, None,
                                            None, None, None)

        model = Logits(ToyConfig(), "dm")
        mo.combined_1f1b(model, mbs)
        outcome = first_step_outcome(model)
        assert outcome.startswith("skipped: Logits.forward(input_ids=..., position_ids=..., "
                                  "labels=...) returned other than a scalar loss"), outcome
        assert all(p.grad is not None for p in model.parameters())
        print("ok")
        """,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"


def test_debug_mode_runs_the_pipelining_integration_and_protocol_errors(
    debug_python: DebugPython,
) -> None:
    """Beartype resolves every annotation of the pipelining package (its private torch types
    are opaque at run time) and of the rule tables' error path (a refused stage module is the
    library's own error, not a beartype forward-reference failure)."""
    out = debug_python(
        """
        from torch import nn
        from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
        import moe_overlap as m
        from moe_overlap.integrations.pipelining import pair_overlap_f_b
        from moe_overlap.protocols import contract_of

        class Stage:
            def __init__(self, index, n):
                self.stage_index, self.num_stages = index, n
                self.group_size, self.group_rank = 2, 0
                self.is_first, self.is_last = index == 0, index == n - 1
                self.submod = nn.Identity()

        schedule = ScheduleInterleaved1F1B(
            [Stage(0, 4), Stage(2, 4)], n_microbatches=4, loss_fn=lambda a, b: a
        )
        order = {r: list(a) for r, a in schedule.pipeline_order.items()}
        lowered = pair_overlap_f_b(order, num_stages=4, stage_to_rank=lambda s: s % 2)
        assert any(a is not None and a.sub_actions for a in lowered[0])
        error = contract_of(m.PreprocessableModel).error(nn.Linear(2, 2), "stage module")
        assert isinstance(error, m.IntegrationError), error
        print("ok")
        """,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_beartype_without_the_hook_s_decorator_warns_and_checks_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The argument-check translation leans on a private beartype name (the import hook's
    decorator); a beartype that moved it gets a warning naming it, and nothing is wrapped."""
    pytest.importorskip("beartype")
    from moe_overlap.engine import _hint_errors

    monkeypatch.setattr(_hint_errors, "CLAW_DECORATOR", ("beartype", "no_such_decorator"))
    with pytest.warns(UserWarning, match=r"beartype has no beartype\.no_such_decorator"):
        _hint_errors.install("moe_overlap")
