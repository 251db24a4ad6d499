"""The parts of a vision tower's blocks, found from the values of the tower's probe forward (no name is known).

In each block, among the block's direct children (each called once in the forward): ``attn`` and ``mlp``, whose
outputs added to the residual give the block's output, ``resid_mid == resid_pre + attn_out`` and
``resid_post == resid_mid + mlp_out`` exactly; ``ln2``, whose input is ``resid_mid`` and whose output is what
``mlp`` reads; ``ln1`` (optional), whose input is ``resid_pre`` and whose output is what ``attn`` reads. Edits of
each, by hooks placed as the sites' are, are then proven to reach what follows them and the tower's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

#: the edit kinds of the probe's forwards: the attention's outputs, the MLP's outputs, ``ln2``'s inputs (as an
#: edit of ``hook_resid_mid`` or ``hook_mlp_in`` reaches the MLP), the norms' outputs
EDITS = ("attn", "mlp", "mid", "norms")


@dataclass(frozen=True)
class BlockParts:
    """The names of a block's children: its attention, its MLP, the norm before the MLP and (if any) before the
    attention."""

    attn: str
    mlp: str
    ln2: str
    ln1: Optional[str]


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


def _sum(a: Any, b: Any) -> Optional[torch.Tensor]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype:
        return a + b
    return None


def find_parts(pre: torch.Tensor, post: torch.Tensor, ins: dict, outs: dict) -> Optional[BlockParts]:
    """The block's parts from its input ``pre``, its output ``post`` and its children's first inputs and outputs
    (by name; only the children called once), or ``None``."""
    for attn, attn_out in outs.items():
        mid = _sum(pre, attn_out)
        if mid is None:
            continue
        for ln2, ln2_in in ins.items():
            if ln2 == attn or ln2 not in outs or not _same(ln2_in, mid):
                continue
            for mlp, mlp_out in outs.items():
                if mlp in (attn, ln2) or not _same(ins.get(mlp), outs[ln2]) or not _same(post, _sum(mid, mlp_out)):
                    continue
                others = (n for n in outs if n not in (attn, mlp, ln2))
                ln1 = next((n for n in others if _same(ins.get(n), pre) and _same(outs[n], ins.get(attn))), None)
                return BlockParts(attn, mlp, ln2, ln1)
    return None


def check_part_edits(base: dict, edited: dict, kind: str, parts: list[BlockParts], path: str) -> list[str]:
    """Why the probe's forward with every block's ``kind`` edit (see :data:`EDITS`) does not prove the edits
    (empty: proven): each edit is what the block's next step reads, and the tower's output changed."""
    for i, part in enumerate(parts):
        ins, outs = edited["child_in"][i], edited["child_out"][i]
        if kind == "attn" and not _same(ins[part.ln2], _sum(edited["in"][i], outs[part.attn])):
            return [f"{path}: block {i}'s residual after an edit of its attention's output is not resid_pre + attn_out"]
        if kind == "mlp" and not _same(edited["out"][i], _sum(ins[part.ln2], outs[part.mlp])):
            return [f"{path}: block {i}'s output after an edit of its MLP's output is not resid_mid + mlp_out"]
        if kind == "mid" and (
            not _same(ins[part.mlp], outs[part.ln2]) or _same(ins[part.mlp], base["child_in"][i][part.mlp])
        ):
            return [f"{path}: an edit of block {i}'s resid_mid does not reach its MLP"]
        if kind == "norms" and not (
            _same(ins[part.mlp], outs[part.ln2]) and (part.ln1 is None or _same(ins[part.attn], outs[part.ln1]))
        ):
            return [f"{path}: an edit of block {i}'s norms' outputs does not reach its attention and MLP"]
    if torch.equal(edited["last"], base["last"]):
        return [f"{path}: an edit of the blocks' {kind} does not change the tower's output"]
    return []
