"""The parts of a vision tower's blocks, found from the values of the tower's probe forward (no name is known).

In each block, among the block's direct children (each called once in the forward): ``attn`` and ``mlp``, whose
outputs added to the residual give the block's output, ``resid_mid == resid_pre + attn_out`` and
``resid_post == resid_mid + mlp_out`` exactly; ``ln2``, whose input is ``resid_mid`` and whose output is what
``mlp`` reads; ``ln1`` (optional), whose input is ``resid_pre`` and whose output is what ``attn`` reads. Edits of
each, by hooks placed as the sites' are, are then proven to reach what follows them and the tower's output.

Sandwich-normed blocks (Gemma 4's tower: a norm after the attention and after the MLP, before each residual add) are
found the same way, with one more child on each branch: ``ln1_post``, whose input is the attention's output and whose
output is what the block adds to ``resid_pre`` (TransformerLens' ``hook_attn_out``: what enters the residual), and
``ln2_post`` likewise after the MLP (``hook_mlp_out``). A post-attention norm is recognised only after a pre-attention
norm (``ln1 -> attn -> ln1_post``): values alone cannot tell a block without ``ln1`` whose attention is followed by a
norm from a block with ``ln1`` and no post norm.
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
    attention, and (if any) the norms after the attention and after the MLP (sandwich norms)."""

    attn: str
    mlp: str
    ln2: str
    ln1: Optional[str]
    ln1_post: Optional[str] = None
    ln2_post: Optional[str] = None

    @property
    def attn_out(self) -> str:
        """The child whose output the block adds to ``resid_pre``: ``hook_attn_out``."""
        return self.ln1_post if self.ln1_post is not None else self.attn

    @property
    def mlp_out(self) -> str:
        """The child whose output the block adds to ``resid_mid``: ``hook_mlp_out``."""
        return self.ln2_post if self.ln2_post is not None else self.mlp


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


def _sum(a: Any, b: Any) -> Optional[torch.Tensor]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype:
        return a + b
    return None


def _branch(
    start: Any, added: str, ins: dict, outs: dict, taken: tuple[str, ...]
) -> Optional[tuple[str, Optional[str]]]:
    """The branch ending in the child ``added`` (whose output the block adds to the residual) that reads ``start``
    (the output of the norm before it): ``(added, None)`` when ``added`` reads ``start`` itself, ``(child, added)``
    when ``added`` reads the output of another child ``child`` that reads ``start`` (a norm after the branch)."""
    if _same(ins.get(added), start):
        return added, None
    for child, out in outs.items():
        if child not in (added, *taken) and _same(ins.get(child), start) and _same(ins.get(added), out):
            return child, added
    return None


def _attention(pre: torch.Tensor, added: str, ins: dict, outs: dict) -> list[tuple[str, Optional[str], Optional[str]]]:
    """The attention branches ending in ``added``: ``(attn, ln1, ln1_post)``, a sandwich (``ln1 -> attn ->
    ln1_post``) first, then ``ln1 -> attn``, then ``attn`` alone (no ``ln1``)."""
    found: list[tuple[str, Optional[str], Optional[str]]] = []
    for ln1, ln1_out in outs.items():
        if ln1 == added or not _same(ins.get(ln1), pre):
            continue
        branch = _branch(ln1_out, added, ins, outs, (ln1,))
        if branch is not None and branch[1] is not None:
            found.append((branch[0], ln1, branch[1]))
    for ln1, ln1_out in outs.items():
        if ln1 != added and _same(ins.get(ln1), pre) and _same(ins.get(added), ln1_out):
            found.append((added, ln1, None))
    return [*found, (added, None, None)]


def find_parts(pre: torch.Tensor, post: torch.Tensor, ins: dict, outs: dict) -> Optional[BlockParts]:
    """The block's parts from its input ``pre``, its output ``post`` and its children's first inputs and outputs
    (by name; only the children called once), or ``None``."""
    for attn_add, attn_out in outs.items():
        mid = _sum(pre, attn_out)
        if mid is None:
            continue
        for ln2, ln2_in in ins.items():
            if ln2 == attn_add or ln2 not in outs or not _same(ln2_in, mid):
                continue
            for mlp_add, mlp_out in outs.items():
                if mlp_add in (attn_add, ln2) or not _same(post, _sum(mid, mlp_out)):
                    continue
                mlp_branch = _branch(outs[ln2], mlp_add, ins, outs, (attn_add, ln2))
                if mlp_branch is None:
                    continue
                mlp, ln2_post = mlp_branch
                for attn, ln1, ln1_post in _attention(pre, attn_add, ins, outs):
                    names = [n for n in (attn, ln1, ln1_post, ln2, mlp, ln2_post) if n is not None]
                    if len(set(names)) == len(names):
                        return BlockParts(attn, mlp, ln2, ln1, ln1_post, ln2_post)
    return None


def check_part_edits(base: dict, edited: dict, kind: str, parts: list[BlockParts], path: str) -> list[str]:
    """Why the probe's forward with every block's ``kind`` edit (see :data:`EDITS`) does not prove the edits
    (empty: proven): each edit is what the block's next step reads, and the tower's output changed."""
    for i, part in enumerate(parts):
        ins, outs = edited["child_in"][i], edited["child_out"][i]
        if kind == "attn" and not _same(ins[part.ln2], _sum(edited["in"][i], outs[part.attn_out])):
            return [f"{path}: block {i}'s residual after an edit of its attention's output is not resid_pre + attn_out"]
        if kind == "mlp" and not _same(edited["out"][i], _sum(ins[part.ln2], outs[part.mlp_out])):
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
