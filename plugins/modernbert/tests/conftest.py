"""The Hypothesis profiles of every lensadapters suite (HYPOTHESIS_PROFILE=dev|ci|thorough), loaded before the
contract suite is defined (Hypothesis fixes a test's settings when the test is defined); and the head tests' check
of edits against plain PyTorch hooks (the ``edits_match_torch_hooks`` fixture: the suite imports test modules with
``--import-mode=importlib``, so a helper reaches them as a fixture)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import pytest
import torch

from lensadapters.testing.profiles import load_profile

load_profile()  # first: the test kit is imported below, in the helpers (see the docstring)

Edit = Callable[[torch.Tensor], torch.Tensor]


def torch_hook_logits(
    model: torch.nn.Module, batch: Mapping[str, Any], points: Mapping[str, tuple[str, str]], edit: Edit
) -> dict[str, torch.Tensor]:
    """For each point, the model's logits (``reference.logits_of``) with one plain PyTorch hook editing its HF
    module: ``points`` maps a point to ``(path, kind)``, the module's path relative to ``model`` and ``"pre"`` (a
    forward pre-hook editing the module's first input) or ``"post"`` (a forward hook editing its output)."""

    from lensadapters_modernbert.reference import logits_of

    def pre(module: Any, args: tuple) -> tuple:
        return (edit(args[0]), *args[1:])

    def post(module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return edit(output)

    logits = {}
    for point, (path, kind) in points.items():
        assert kind in ("pre", "post"), f"{point}: {kind!r} is neither 'pre' nor 'post'"
        module = model.get_submodule(path)
        handle = module.register_forward_pre_hook(pre) if kind == "pre" else module.register_forward_hook(post)
        try:
            with torch.no_grad():
                logits[point] = logits_of(model(**batch))
        finally:
            handle.remove()
    return logits


def check_edits_match_torch_hooks(
    model: torch.nn.Module, batch: Mapping[str, Any], points: Mapping[str, tuple[str, str]], edit: Edit
) -> tuple[Any, torch.Tensor]:
    """Each point's edit through ``run_with_hooks`` gives bitwise the logits of the same ``edit`` made with a plain
    PyTorch hook on its HF module (:func:`torch_hook_logits`), and changes them. Returns the wrapped model (still
    wrapped) and the model's logits with no hook, from before it was wrapped."""
    from lensadapters_modernbert.reference import logits_of
    from lensadapters_modernbert.reference import registry as plugin_registry

    from lensadapters import HookedModel

    with torch.no_grad():
        base = logits_of(model(**batch))
    plain = torch_hook_logits(model, batch, points, edit)
    hm = HookedModel.wrap(model, registry=plugin_registry())
    with torch.no_grad():
        for point, expected in plain.items():
            edited = logits_of(hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda t, hook: edit(t))]))
            assert not torch.allclose(expected, base, atol=1e-4), f"{point}: the edit changes the logits"
            assert torch.equal(edited, expected), f"an edit of {point} is the torch hook's edit"
    return hm, base


@pytest.fixture(scope="session")
def edits_match_torch_hooks() -> Callable[..., tuple[Any, torch.Tensor]]:
    """:func:`check_edits_match_torch_hooks`."""
    return check_edits_match_torch_hooks
