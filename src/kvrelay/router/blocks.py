"""D's KV block size, which a capped pull needs (``RemoteBlocks.capped``, ``partial_reuse_unsafe``).

vLLM's reader pairs its local blocks with the *last* ids of ``remote_block_ids``, assuming the
list covers exactly ``remote_num_tokens`` tokens; so a pull of fewer tokens than D holds must
also cut the list, which needs D's block size. D's params do not carry it. The router takes
it from the node's config (``block_size``; ``kvrelay up`` passes vLLM's default for the
device) or infers it from the params: the power of two ``bs`` with
``ceil(remote_num_tokens / bs) == len(group)`` (unique whenever it matters: with one block
every candidate keeps that block). Models with non-power-of-two block sizes (some hybrid
models) must configure it: an inferred power of two could be wrong for them.

``retained_layout`` runs when an entry is committed: it trims groups longer than the tokens
need (blocks past ``remote_num_tokens`` hold nothing P may read) and returns the block size
for ``entry_from_decode``; ``None`` as the size means the entry may only be reused whole.
"""

from __future__ import annotations

from msgspec.structs import replace

from kvrelay.core.params import RemoteBlocks

_CANDIDATES: tuple[int, ...] = tuple(1 << k for k in range(17))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def infer_block_size(blocks: RemoteBlocks) -> int | None:
    """The smallest power of two consistent with every group's length, or ``None``."""
    if blocks.num_tokens <= 0 or not blocks.block_ids:
        return None
    for bs in _CANDIDATES:
        need = _cdiv(blocks.num_tokens, bs)
        if all(len(group) == need for group in blocks.block_ids):
            return bs
    return None


class LayoutError(ValueError):
    """D's block list cannot hold the tokens its params claim at the configured size."""


def retained_layout(
    blocks: RemoteBlocks, configured: int | None
) -> tuple[RemoteBlocks, int | None]:
    """``(blocks, block_size)`` for a new entry (see the module docstring).

    Raises ``LayoutError`` when a group is shorter than ``ceil(num_tokens / configured)``.
    """
    if configured is None:
        return blocks, infer_block_size(blocks)
    need = _cdiv(blocks.num_tokens, configured)
    if any(len(group) < need for group in blocks.block_ids):
        raise LayoutError(
            f"{blocks.num_tokens} tokens need {need} blocks of {configured}; D listed fewer"
        )
    return replace(blocks, block_ids=tuple(g[:need] for g in blocks.block_ids)), configured
