"""The wrap-time check of the generic adapter's points on a second wiring of the same model (built, checked on the
probe's tokens and uninstalled), shared by the automatic description (:mod:`.plugin`) and the mixer form
(:mod:`.mixer`)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

Tensor = torch.Tensor


def check_second_wiring(
    hooked: Any,
    verifying: Any,
    names: Union[list[str], Callable[[Any], list[str]]],
    points_per_pass: Optional[int] = None,
) -> tuple[dict[str, Optional[str]], list[str]]:
    """``(verdicts, the second wiring's hook_names)``: :func:`.verify.check_points` of ``names`` (or of what
    ``names(second_wiring)`` lists) on a second wiring of ``hooked``'s model, built while the model is in
    ``verifying`` (whose plugin hooks then check nothing again), on random tokens of the probe's length."""
    from lensadapters.adapters.generic.probe import PROBE_LENGTH
    from lensadapters.adapters.generic.verify import check_points

    model = hooked.hf_model
    verifying.add(model)
    try:
        probe = type(hooked)(hooked.model, model, hooked.arch, hooked.plugin, hooked.plugin_hooks)
    finally:
        verifying.discard(model)
    embed = model.get_input_embeddings()
    vocab = int(getattr(embed, "num_embeddings", None) or model.config.vocab_size)
    weight = getattr(embed, "weight", None)
    device = weight.device if isinstance(weight, Tensor) else torch.device("cpu")
    ids = torch.randint(0, vocab, (1, PROBE_LENGTH), generator=torch.Generator().manual_seed(2)).to(device)
    try:
        checked = names(probe) if callable(names) else names
        return check_points(probe, ids, checked, points_per_pass), list(probe.hook_names)
    finally:
        probe.uninstall()
