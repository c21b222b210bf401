"""Each Protocol's contract, written once: a rule table per Protocol and one checker.

A :class:`Contract` lists a runtime Protocol's members, each with its kind (an attribute or
property whose value is checked, or a method: a callable) and, for an attribute, what its
value must be (a :class:`~moe_overlap.args.Spec`, or another contract for an
object the schedule reads members of). The same table serves

- the fast path, :meth:`Contract.conforms`: a boolean pass that formats no string, run
  once per plan (once per :func:`checks_memoized` block), and by debug mode's beartype for
  every Protocol-typed parameter (``docs/debug.md``);
- the message, :meth:`Contract.error`: it names the object, the member, what was expected,
  what was received and what to do.

Members are looked up with ``getattr``: ``isinstance`` against a runtime Protocol looks them
up statically on Python 3.12+, which misses ``torch.nn.Module`` submodules (kept in
``_modules`` and served by ``__getattr__``). A test keeps each table's member names equal to
``typing_extensions.get_protocol_members`` of its Protocol, for every runtime Protocol of
the package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar, cast

from moe_overlap.args import (
    ANY,
    BOOL,
    CALLABLE,
    TENSOR,
    Instance,
    Int,
    Mismatch,
    OneOf,
    Opt,
    Spec,
    refuse,
    shown,
)
from moe_overlap.errors import ConfigError, IntegrationError, MoeOverlapError
from moe_overlap.protocols import (
    DeclaresInputs,
    DecoderLike,
    FreeInputConfig,
    GraphedWgradLayer,
    HoldsDelayedModules,
    LayerListLike,
    ModelConfigLike,
    MtpSchedulableLayer,
    NodeTimer,
    PendingWgrad,
    PreprocessableModel,
    SchedulableLayer,
    SlotContext,
    SlotFn,
    StepObserver,
    StreamProvider,
    ValidatesInputs,
    WgradLayer,
)

from .core._state import ChunkState, LayerState

__all__ = [
    "DISPATCHER_BACKENDS",
    "DISPATCHER_TYPES",
    "FREE_INPUT_CONFIG",
    "HOLDS_DELAYED_MODULES",
    "LAYER",
    "MODEL",
    "MTP_LAYER",
    "OPT_STEP_OBSERVER",
    "PENDING_WGRAD",
    "STEP_OBSERVER",
    "WGRAD_LAYER",
    "Conforms",
    "Contract",
    "Kind",
    "Member",
    "already_checked",
    "attribute",
    "checks_memoized",
    "contract_of",
    "contracts",
    "method",
    "named",
    "remember",
]

T = TypeVar("T")

_MISSING: Any = object()
"""What ``getattr`` answers for an absent member (typed ``Any``: compared by identity)."""


def named(where: str | Callable[[], str]) -> str:
    """The name an error message gives: ``where`` itself, or what the callable formats."""
    return where if isinstance(where, str) else where()


# While a combined_1f1b call runs, an object that passed a contract's check is not checked
# against it again for the next microbatch's plan: {(id of the contract, id of the object):
# the object} (held, so its id cannot be reused). Per contract: passing one Protocol's check
# says nothing of another's (a layer listed as its own wgrad module is still checked as one).
_memo: dict[tuple[int, int], object] | None = None
_depth = 0


@contextlib.contextmanager
def checks_memoized() -> Generator[None, None, None]:
    """Check each model, layer and wgrad module once for all the plans built inside."""
    global _memo, _depth
    if _depth == 0:
        _memo = {}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _memo = None


def already_checked(obj: object, contract: object) -> bool:
    """Whether ``obj`` passed ``contract``'s check inside the current :func:`checks_memoized`
    block."""
    memo = _memo
    return memo is not None and memo.get((id(contract), id(obj))) is obj


def remember(obj: object, contract: object) -> None:
    """Record that ``obj`` passed ``contract``'s check (inside a :func:`checks_memoized`
    block)."""
    memo = _memo
    if memo is not None:
        memo[(id(contract), id(obj))] = obj


class Kind(Enum):
    """What a Protocol member is."""

    ATTRIBUTE = "attribute"
    """A data attribute or property: its value is read and checked."""
    METHOD = "method"
    """A method (or any callable member): it must be callable."""


class Member:
    """One row of a rule table: a member's name, kind, and what its value must be.

    ``when`` (a predicate on the holder, and its words) makes the value check conditional:
    the member must exist, and its value is checked only when the predicate holds (the
    dispatch slot of a dense layer is never called).
    """

    __slots__ = ("accepts", "hint", "kind", "name", "spec", "when", "when_words")

    def __init__(
        self,
        name: str,
        kind: Kind,
        spec: Spec[object] | Contract[Any],
        *,
        when: Callable[[object], bool] | None = None,
        when_words: str = "",
        hint: str = "",
    ) -> None:
        self.name = name
        self.kind = kind
        self.spec = spec
        self.when = when
        self.when_words = when_words
        self.hint = hint
        self.accepts: Callable[[object], bool] = (
            spec.conforms if isinstance(spec, Contract) else spec.accepts
        )
        """Whether a value is what the member must hold (no string formatted)."""

    @property
    def expects(self) -> str:
        """What the value must be, in words."""
        words = self.spec.noun if isinstance(self.spec, Contract) else self.spec.expects
        return f"{words} {self.when_words}" if self.when_words else words

    def __repr__(self) -> str:
        return f"Member({self.name!r}, {self.kind.name}, {self.expects!r})"


def attribute(
    name: str,
    spec: Spec[object] | Contract[Any],
    *,
    when: Callable[[object], bool] | None = None,
    when_words: str = "",
    hint: str = "",
) -> Member:
    """An attribute or property whose value ``spec`` (or a nested contract) accepts."""
    return Member(name, Kind.ATTRIBUTE, spec, when=when, when_words=when_words, hint=hint)


def method(
    name: str,
    *,
    when: Callable[[object], bool] | None = None,
    when_words: str = "",
    hint: str = "",
) -> Member:
    """A method: a callable member."""
    return Member(name, Kind.METHOD, CALLABLE, when=when, when_words=when_words, hint=hint)


@dataclass(frozen=True, slots=True)
class Problem:
    """The first thing an object gets wrong, found by :meth:`Contract.problem`.

    A dataclass, not a NamedTuple: debug mode's beartype resolves ``Contract`` in this
    module, which it cannot do for a NamedTuple's generated ``__new__``.
    """

    path: tuple[str, ...]
    """The member names from the checked object down to ``holder`` (empty: the object)."""
    holder: object
    contract: Contract[Any]
    """``holder``'s contract."""
    missing: tuple[str, ...]
    """The members ``holder`` lacks; empty when ``member``'s value is wrong."""
    member: Member | None
    value: object


class Contract(Generic[T]):
    """A runtime Protocol's rule table: its members, in declaration order, and the words.

    ``noun`` names what an object must be (``"a SchedulableLayer"``); ``help`` says what to
    do, appended to a missing-members message. ``fields``: the object is a configuration,
    and a missing member reads ``"<x> (<Class>): expected <noun>; missing: [...]"`` rather
    than ``"<x> is not <noun>; missing members: [...]"``. ``value_error``: the class raised
    for a member of the wrong value (a missing member is an
    :class:`~moe_overlap.IntegrationError`). Registers itself for :func:`contract_of`.
    """

    __slots__ = ("_rows", "fields", "help", "members", "noun", "protocol", "value_error")

    def __init__(
        self,
        protocol: object,
        noun: str,
        *members: Member,
        help: str = "",
        fields: bool = False,
        value_error: type[MoeOverlapError] = IntegrationError,
    ) -> None:
        self.protocol = protocol
        self.noun = noun
        self.members = members
        self.help = help
        self.fields = fields
        self.value_error = value_error
        self._rows = tuple((m.name, m.accepts, m.when) for m in members)
        _CONTRACTS[protocol] = self

    @property
    def names(self) -> tuple[str, ...]:
        """The members' names, in order."""
        return tuple(m.name for m in self.members)

    def conforms(self, obj: object) -> bool:
        """The fast path: whether ``obj`` has every member, each of the right value."""
        for name, accepts, when in self._rows:
            value: object = getattr(obj, name, _MISSING)
            if value is _MISSING:
                return False
            if not accepts(value) and (when is None or when(obj)):
                return False
        return True

    def missing(self, obj: object) -> list[str]:
        """The members ``obj`` lacks (their values unread)."""
        return [m.name for m in self.members if not hasattr(obj, m.name)]

    def member(self, name: str) -> Member:
        """The row of the member called ``name``."""
        return next(m for m in self.members if m.name == name)

    def problem(self, obj: object, path: tuple[str, ...] = ()) -> Problem | None:
        """The first thing ``obj`` gets wrong (missing members first), or ``None``."""
        missing = tuple(self.missing(obj))
        if missing:
            return Problem(path, obj, self, missing, None, None)
        for m in self.members:
            if m.when is not None and not m.when(obj):
                continue
            value: object = getattr(obj, m.name)
            if isinstance(m.spec, Contract):
                found = m.spec.problem(value, (*path, m.name))
                if found is not None:
                    return found
            elif not m.accepts(value):
                return Problem(path, obj, self, (), m, value)
        return None

    def error(self, obj: object, where: str = "") -> MoeOverlapError:
        """The error naming what ``obj`` gets wrong; ``where`` names it (else its class).

        A missing member: ``"<where>: <Class> is not <noun>; missing members: [...]; <help>"``
        (a nested object: ``"<where>: <Class>.<path> (<its class>) is not ..."``). A wrong
        value: ``"<where>: <Class>.<path>.<member>: expected <expects>, received <type>
        <value>; <hint>"``.
        """
        found = self.problem(obj)
        assert found is not None, f"{self.noun}: error() on a conforming object"
        root = type(obj).__name__
        if where:
            root = f"{where}: {root}"
        if found.missing:
            owner = found.contract
            head = root
            if found.path:
                head = f"{'.'.join((root, *found.path))} ({type(found.holder).__name__})"
            missing = list(found.missing)
            tail = f"; {owner.help}" if owner.help else ""
            if owner.fields:
                return IntegrationError(f"{head}: expected {owner.noun}; missing: {missing}{tail}")
            return IntegrationError(f"{head} is not {owner.noun}; missing members: {missing}{tail}")
        m = found.member
        assert m is not None
        return refuse(
            ".".join((root, *found.path, m.name)),
            m.expects,
            found.value,
            hint=m.hint,
            error=found.contract.value_error,
            field=True,
        )

    def detail(self, obj: object) -> str:
        """What ``obj`` gets wrong, in a few words (for an argument's message)."""
        found = self.problem(obj)
        if found is None:
            return ""
        where = ".".join(found.path)
        if found.missing:
            return f"{where + ' ' if where else ''}missing members: {list(found.missing)}"
        m = found.member
        assert m is not None
        name = ".".join((*found.path, m.name))
        return f"{name}: expected {m.expects}, received {shown(found.value)}"

    def check(self, obj: object, where: str | Callable[[], str] = "") -> T:
        """``obj`` as the Protocol, or raise :meth:`error`; ``where`` names it (a callable is
        called only then). Inside :func:`checks_memoized`, an object is checked once."""
        if not already_checked(obj, self):
            if not self.conforms(obj):
                raise self.error(obj, named(where))
            remember(obj, self)
        return cast(T, obj)

    def arg(self, *, error: type[MoeOverlapError] = ConfigError, hint: str = "") -> Conforms:
        """This contract as the spec of an argument (:func:`~moe_overlap.args.check_arg`)."""
        return Conforms(self, error=error, hint=hint)

    def __repr__(self) -> str:
        name = getattr(self.protocol, "__name__", repr(self.protocol))
        return f"Contract({name}, {list(self.names)})"


_CONTRACTS: dict[object, Contract[Any]] = {}
"""Every rule table, by Protocol (each :class:`Contract` registers itself)."""


class Conforms(Spec[object]):
    """An argument that must honour a contract: ``"<where>: <name> must be <noun>, received
    <value> (<what it gets wrong>)"``."""

    __slots__ = ("contract",)

    def __init__(
        self, contract: Contract[Any], *, error: type[MoeOverlapError] = ConfigError, hint: str = ""
    ) -> None:
        super().__init__(contract.noun, error=error, hint=hint)
        self.contract = contract

    def check(self, value: object) -> object:
        if not self.contract.conforms(value):
            raise Mismatch(self.contract.detail(value)) if value is not None else Mismatch
        return value


def contract_of(protocol: object) -> Contract[Any] | None:
    """The rule table of ``protocol`` (``None``: it has none, or its module is not loaded)."""
    return _CONTRACTS.get(protocol)


def contracts() -> Mapping[object, Contract[Any]]:
    """Every rule table loaded so far, by Protocol."""
    return dict(_CONTRACTS)


# --- the value specs the tables share --------------------------------------------------------


class _Collection(Spec[object]):
    """Any iterable but a string or bytes, left unread (a generator is not consumed)."""

    __slots__ = ()

    def check(self, value: object) -> object:
        if not isinstance(value, Iterable) or isinstance(value, (str, bytes)):
            raise Mismatch
        return cast(object, value)


def _is_moe(layer: object) -> bool:
    return getattr(layer, "is_moe", False) is True


def _is_flex(config: object) -> bool:
    return getattr(config, "moe_token_dispatcher_type", None) == "flex"


DISPATCHER_TYPES = ("alltoall", "allgather", "flex")
"""The token dispatchers whose free-input behaviour Megatron-Core 0.19 defines."""
DISPATCHER_BACKENDS = (None, "deepep", "hybridep", "ncclep")
"""The flex dispatcher backends whose free-input behaviour Megatron-Core 0.19 defines."""


# --- the rule tables ---------------------------------------------------------------------------

WGRAD_LAYER: Contract[WgradLayer] = Contract(
    WgradLayer,
    "a WgradLayer (a module whose weight gradients backward_dw() computes)",
    method("backward_dw"),
    method("parameters"),
    help="list only modules that delay their weight gradients (blocks.DelayedWgradModule is one)",
)

HOLDS_DELAYED_MODULES: Contract[HoldsDelayedModules] = Contract(
    HoldsDelayedModules,
    "a HoldsDelayedModules (delayed_modules() names the modules whose weight gradients it computes)",
    method("delayed_modules"),
)

PENDING_WGRAD: Contract[PendingWgrad] = Contract(
    PendingWgrad,
    "a PendingWgrad (a read-only int property pending_wgrad)",
    attribute(
        "pending_wgrad",
        Int(0, exact=True),
        hint="make it a property returning an int (@property def pending_wgrad(self) -> int)",
    ),
)

MODEL_CONFIG: Contract[ModelConfigLike] = Contract(
    ModelConfigLike,
    "a member mtp_num_layers (None or the number of MTP layers)",
    attribute("mtp_num_layers", Opt(Int(0, exact=True), expects="None or an int >= 0")),
    fields=True,
    help="give the config mtp_num_layers = None when the model has no MTP layers",
)

LAYER_LIST: Contract[LayerListLike] = Contract(
    LayerListLike,
    "a sized iterable of layers (e.g. an nn.ModuleList)",
    method("__len__"),
    method("__iter__"),
)

DECODER: Contract[DecoderLike] = Contract(
    DecoderLike,
    "a decoder",
    attribute("layers", LAYER_LIST),
    attribute(
        "input_tensor",
        Opt(TENSOR, expects="None or a Tensor (the previous stage's output)"),
    ),
    attribute("final_layernorm", Opt(CALLABLE, expects="None or a callable norm")),
    help="a decoder is an object with `layers` (the SchedulableLayers, e.g. an nn.ModuleList), "
    "`input_tensor` (the previous pipeline stage's output, None on the first stage) and "
    "`final_layernorm` (None, or the norm PostProcessNode applies when this rank's decoder "
    "has no layers)",
)

MODEL: Contract[PreprocessableModel] = Contract(
    PreprocessableModel,
    "a PreprocessableModel",
    attribute("pre_process", BOOL),
    attribute("post_process", BOOL),
    attribute("config", MODEL_CONFIG),
    attribute("decoder", DECODER),
    method("_preprocess"),
    method("_postprocess"),
    help="see the PreprocessableModel Protocol (docs/integrate.md)",
)

DECLARES_INPUTS: Contract[DeclaresInputs] = Contract(
    DeclaresInputs,
    "a model declaring the microbatch inputs it reads",
    attribute("microbatch_inputs", _Collection("a collection of input names")),
)

VALIDATES_INPUTS: Contract[ValidatesInputs] = Contract(
    ValidatesInputs, "a model validating its inputs", method("validate_inputs")
)

FREE_INPUT_CONFIG: Contract[FreeInputConfig] = Contract(
    FreeInputConfig,
    "the free-input fields ['moe_token_dispatcher_type', 'moe_flex_dispatcher_backend', "
    "'fp8', 'fp4', 'cuda_graph_modules']",
    attribute("moe_token_dispatcher_type", OneOf(DISPATCHER_TYPES)),
    attribute(
        "moe_flex_dispatcher_backend",
        OneOf(DISPATCHER_BACKENDS),
        when=_is_flex,
        when_words="with the flex dispatcher",
    ),
    attribute("fp8", ANY),
    attribute("fp4", ANY),
    attribute(
        "cuda_graph_modules",
        _Collection("a collection of scope names (CudaGraphModule members or strings)"),
    ),
    fields=True,
    value_error=ConfigError,
)

STREAM_PROVIDER: Contract[StreamProvider] = Contract(
    StreamProvider,
    "a StreamProvider (a zero-argument callable returning a stream)",
    method("__call__"),
)

SLOT_CONTEXT: Contract[SlotContext] = Contract(
    SlotContext,
    "a SlotContext (what a slot reads from its node)",
    attribute("layer_state", Instance(LayerState, "a LayerState")),
    attribute("chunk_state", Instance(ChunkState, "a ChunkState")),
    method("detach"),
    method("mark_non_differentiable"),
)

SLOT_FN: Contract[SlotFn] = Contract(
    SlotFn, "a slot function (called with its node and its inputs)", method("__call__")
)

LAYER: Contract[SchedulableLayer] = Contract(
    SchedulableLayer,
    "a SchedulableLayer",
    attribute("config", FREE_INPUT_CONFIG),
    attribute("is_moe", BOOL),
    attribute("num_local_experts", Opt(Int(1, exact=True), expects="None or an int >= 1")),
    method("slot_pre_dispatch"),
    method("slot_dispatch", when=_is_moe, when_words="(is_moe is true)"),
    method("slot_mlp"),
    method("slot_combine", when=_is_moe, when_words="(is_moe is true)"),
    method("pre_dispatch_wgrad"),
    method("mlp_wgrad"),
    help="see the SchedulableLayer Protocol (docs/integrate.md); a dense layer's dispatch "
    "and combine may be None",
)

MTP_LAYER: Contract[MtpSchedulableLayer] = Contract(
    MtpSchedulableLayer,
    "an MtpSchedulableLayer",
    *LAYER.members,
    method("slot_mtp_post_process"),
    help=LAYER.help,
)

GRAPHED_WGRAD_LAYER: Contract[GraphedWgradLayer] = Contract(
    GraphedWgradLayer,
    "a GraphedWgradLayer (its CUDA-graphed scopes replay their own delayed weight gradients)",
    method("graphed_backward_dw_callable"),
)

NODE_TIMER: Contract[NodeTimer] = Contract(
    NodeTimer, "a NodeTimer (with start(stream) and stop(stream))", method("start"), method("stop")
)

STEP_OBSERVER: Contract[StepObserver] = Contract(
    StepObserver, "a StepObserver (with timer(step, microbatch))", method("timer")
)

OPT_STEP_OBSERVER: Spec[object | None] = Opt(STEP_OBSERVER.arg())
"""An ``observer=`` argument: ``None`` or a :class:`~moe_overlap.steps.StepObserver` (a
:class:`~moe_overlap.ConfigError` otherwise)."""
