"""Small texts (a directory name, a rank's file hashes) shared between ranks as bytes in tensors:
torch's object collectives pickle, and nothing in the checkpoint path may."""

from __future__ import annotations

import torch

from tp_ext.distributed import comm

__all__ = ["gather_texts", "share_text"]


def gather_texts(group, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (a collective of the group)."""
    g = comm.resolve_group(group)
    if g.group is None or g.size == 1:
        return [text]
    data = text.encode() + b"\0"  # never empty: every rank sends at least one byte
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = comm.all_gather(length, group=g).tolist()
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = comm.all_gather(mine, sizes=lengths, group=g)
    out, start = [], 0
    for n in lengths:
        out.append(bytes(everyone[start : start + n - 1].tolist()).decode())
        start += n
    return out


def share_text(group, text: str) -> str:
    """Rank 0's ``text`` on every rank (the others pass anything, e.g. "")."""
    return gather_texts(group, text)[0]
