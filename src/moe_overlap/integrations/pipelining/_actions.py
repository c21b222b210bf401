"""The custom functions a prepared schedule registers for torch's compute actions.

:class:`ActionHandlers` runs ``FORWARD``, ``FULL_BACKWARD``, ``BACKWARD_INPUT``,
``BACKWARD_WEIGHT`` and ``OVERLAP_F_B`` through a :class:`PlanRunner`, and names the
pipeline position in any failure.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from moe_overlap import MoeOverlapError, NodeStateError, ScheduleError
from moe_overlap.integrations.pipelining import _torch
from moe_overlap.integrations.pipelining._lowering import describe
from moe_overlap.integrations.pipelining._plan_runner import PlanRunner
from moe_overlap.integrations.pipelining._torch import Action, Context

__all__ = ["ActionHandlers"]


class ActionHandlers:
    """One prepared schedule's custom functions (``overlap=False``: an ``OVERLAP_F_B``'s
    forward and backward run one after the other)."""

    def __init__(self, runner: PlanRunner, *, overlap: bool) -> None:
        self._runner = runner
        self.overlap = overlap

    def register(self, schedule: Any) -> None:
        """Register a custom function for each compute action ``schedule`` runs."""
        kinds = _torch.kinds()
        for kind, fn in (
            (kinds.forward, self.on_forward),
            (kinds.full_backward, self.on_full_backward),
            (kinds.backward_input, self.on_backward_input),
            (kinds.backward_weight, self.on_backward_weight),
            (kinds.overlap_f_b, self.on_overlap),
        ):
            _torch.register_action(schedule, kind, fn)

    def on_forward(self, action: Action, ctx: Context) -> None:
        runner = self._runner
        with self._at(action, "forward"):
            call = runner.forward_begin(action, ctx)
            out = runner.run(call, None) if call.plan is not None else None
            runner.forward_end(call, out, ctx)

    def on_full_backward(self, action: Action, ctx: Context) -> None:
        del ctx
        runner = self._runner
        with self._at(action, "full backward"):
            call = runner.backward_begin(action, full=True)
            runner.run(None, call)
            runner.backward_end(call)

    def on_backward_input(self, action: Action, ctx: Context) -> None:
        del ctx
        runner = self._runner
        with self._at(action, "input backward"):
            call = runner.backward_begin(action, full=False)
            if call.forwarded is None:
                # The stage has no backward (schedule.eval(), a schedule without loss_fn):
                # nothing to compute or hold for the weight backward, as in torch's own runner.
                return
            params = list(call.stage.submod.parameters())
            aside = [p.grad for p in params]
            for p in params:
                p.grad = None
            try:
                runner.run(None, call)
            finally:
                runner.held[call.key] = [(p, p.grad) for p in params]
                for p, g in zip(params, aside, strict=True):
                    p.grad = g
            runner.backward_end(call)

    def on_backward_weight(self, action: Action, ctx: Context) -> None:
        del ctx
        runner = self._runner
        with self._at(action, "weight backward"):
            stage, key = runner.stage_of(action)
            _torch.assert_unsharded(runner.schedule, stage)
            _torch.count_backward(runner.schedule, key[0])
            if not stage.has_backward:
                return
            held = runner.held.pop(key, None)
            if held is None:
                raise NodeStateError(
                    f"pipeline rank {runner.rank}: {action} (weight backward of stage "
                    f"{key[0]}, microbatch {key[1]}) before its input backward"
                )
            for p, g in held:  # as torch's stage_backward_weight accumulates
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g

    def on_overlap(self, action: Action, ctx: Context) -> None:
        assert action.sub_actions is not None  # checked at prepare
        f_action, b_action = action.sub_actions
        if not self.overlap:
            self.on_forward(f_action, ctx)
            self.on_full_backward(b_action, ctx)
            return
        runner = self._runner
        with self._at(action, "overlapped forward and full backward"):
            f = runner.forward_begin(f_action, ctx)
            b = runner.backward_begin(b_action, full=True)
            out = runner.run(f, b)
            runner.forward_end(f, out, ctx)
            runner.backward_end(b)

    @contextmanager
    def _at(self, action: Action, what: str) -> Generator[None]:
        """Name the pipeline position in a failure: ScheduleError for a failed plan step
        and for anything not the library's own; the library's own errors as they are."""
        try:
            yield
        except ScheduleError as e:
            position = f"pipeline rank {self._runner.rank}, {describe(action)}"
            raise ScheduleError(f"{position}: {e}", position=f"{position}; {e.position}") from e
        except MoeOverlapError:
            raise
        except Exception as e:
            position = f"pipeline rank {self._runner.rank}, {describe(action)} ({what})"
            raise ScheduleError(f"{position}: {type(e).__name__}: {e}", position=position) from e
