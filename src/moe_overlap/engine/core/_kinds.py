"""The kinds a schedule step is made of: role, direction, slot, stream."""

import enum

__all__ = ["Direction", "Role", "Slot", "StreamKind"]


class Role(str, enum.Enum):
    """Which microbatch of an overlapped pair a step belongs to."""

    F = "f"
    """The microbatch running forward."""
    B = "b"
    """The microbatch running backward."""
    F2 = "g"
    """The second microbatch running forward, in a pair of forwards (the fill)."""
    B2 = "c"
    """The second microbatch running backward, in a pair of backwards (the drain)."""


class Direction(str, enum.Enum):
    """Forward, backward (activation grads) or delayed weight-gradient work."""

    FORWARD = "F"
    BACKWARD = "B"
    WGRAD = "W"
    HOOK = "H"


class Slot(str, enum.Enum):
    """The pieces a chunk is cut into."""

    PRE_PROCESS = "pre_process"
    PRE_DISPATCH = "pre_dispatch"
    DISPATCH = "dispatch"
    MLP = "mlp"
    COMBINE = "combine"
    MTP_POST = "mtp_post"
    POST_PROCESS = "post_process"
    PRE_FORWARD = "pre_forward"
    PRE_BACKWARD = "pre_backward"
    POST_FORWARD = "post_forward"
    POST_BACKWARD = "post_backward"

    @property
    def node_name(self) -> str:
        """The Megatron-Core node name (what :func:`~moe_overlap.should_free_input` takes)."""
        return _NODE_NAMES.get(self, self.value)


_NODE_NAMES = {
    Slot.PRE_DISPATCH: "pre_dispatch_computation",
    Slot.DISPATCH: "moe_dispatch",
    Slot.COMBINE: "moe_combine",
    Slot.MTP_POST: "mtp_post_process",
}


class StreamKind(str, enum.Enum):
    """The stream a step runs on."""

    COMP = "comp"
    COMM = "comm"
    HOST = "host"
    """Hooks: host code between nodes, on no particular stream."""
