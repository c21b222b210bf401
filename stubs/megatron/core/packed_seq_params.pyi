"""Parameters for packed (THD) sequences."""

from dataclasses import dataclass

from torch import Tensor

@dataclass
class PackedSeqParams:
    """Cumulative sequence lengths of a packed batch; attention reads them."""

    qkv_format: str | None = None
    cu_seqlens_q: Tensor | None = None
    cu_seqlens_kv: Tensor | None = None
    cu_seqlens_q_padded: Tensor | None = None
    cu_seqlens_kv_padded: Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
