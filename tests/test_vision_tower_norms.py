"""The vision tower blocks' norms before the attention and the MLP: ``vision.blocks.{i}.ln1``/``ln2.hook_scale`` and
``hook_normalized`` are TransformerLens' for the norm's kind (issue #30). A LayerNorm's ``hook_normalized`` is its
output (after the weight and bias); an RMSNorm's is ``x / scale``, before its weight (Pixtral's, Qwen2.5-VL's and
Gemma 4's towers), not the module's output. Each read is checked against a value written out here from the norm's
input and eps (and, where TransformerLens 2.x is installed, against its own ``RMSNorm``/``LayerNorm`` component's
hooks), each edit changes the logits as the same edit by a plain hook on the norm does, bitwise, and a norm
whose normalization is not known serves ``hook_normalized`` only where it is a plain ``nn.LayerNorm``, else is refused
by name."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.errors import UnsupportedModelError
from lensadapters.testing.vlm import inputs, logits_of, logits_with, tower_blocks_of, vlm
from lensadapters.wiring.core_sites import CoreSites
from lensadapters.wiring.vision_tower import VisionTowerWarning
from tests.vision_tower_helpers import (
    assert_reads_and_edits,
    norm_eps,
    norm_hook,
    per_block,
    plain_hook,
    plain_reads_and_edits,
)

#: each tower's ``ln1`` and ``ln2`` (the norms before its attention and its MLP), by their HF names
RMS_TOWERS = {
    "mistral3": ("attention_norm", "ffn_norm"),
    "qwen2_5_vl": ("norm1", "norm2"),
    "gemma4": ("input_layernorm", "pre_feedforward_layernorm"),
}
#: (the other LayerNorm towers' ln1/ln2 points: tests/test_vision_tower_parts.py, tests/test_vision_tower_qwen.py)
LN_TOWERS = {"llava": ("layer_norm1", "layer_norm2")}
WHICH = ("hook_scale", "hook_normalized")


def _norm_io(blocks: Any, children: tuple[str, str]) -> tuple[dict[str, list], list]:
    """Plain hooks recording each block's ``ln1``/``ln2`` inputs and outputs (every call): ``{i}.{norm}.in``/``out``."""
    seen: dict[str, list] = {}
    handles = []
    for i, block in enumerate(blocks):
        for norm, child in zip(("ln1", "ln2"), children):
            ins, outs = seen.setdefault(f"{i}.{norm}.in", []), seen.setdefault(f"{i}.{norm}.out", [])
            module = block.get_submodule(child)
            handles += [plain_hook(module, "pre", ins), plain_hook(module, "post", outs)]
    return seen, handles


def _references(block: Any, children: tuple[str, str]) -> dict[str, Any]:
    return {
        f"{norm}.{which}": lambda seen, edit, child=child, which=which: [
            norm_hook(block.get_submodule(child), which, seen, edit)
        ]
        for norm, child in zip(("ln1", "ln2"), children)
        for which in WHICH
    }


@pytest.mark.parametrize("name", [*RMS_TOWERS, *LN_TOWERS])
def test_ln_points_are_transformerlens_values_for_the_norms_kind_and_edit_as_plain_hooks_do(name: str) -> None:
    """``hook_scale`` is ``sqrt(mean(x^2) + eps)`` (RMSNorm) or ``sqrt(var(x) + eps)`` (LayerNorm) of the norm's
    input, in float64 here; ``hook_normalized`` is ``x / scale`` for an RMSNorm (not its output: the weights are not
    ones) and the output for a LayerNorm; edits change the logits as plain hooks on the norm do, bitwise."""
    rms = name in RMS_TOWERS
    children = (RMS_TOWERS if rms else LN_TOWERS)[name]
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    blocks = tower_blocks_of(model)
    plain = plain_reads_and_edits(model, batch, per_block(blocks, lambda i, block: _references(block, children)))
    hf = logits_with(model, batch)
    io, handles = _norm_io(blocks, children)
    with torch.no_grad():
        model(**batch)
    for handle in handles:
        handle.remove()
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)  # no hooks: HF's forward
        _, cache = hm.run_with_cache(**batch, names_filter=lambda p: ".ln1." in p or ".ln2." in p)
        for i, block in enumerate(blocks):
            for norm, child in zip(("ln1", "ln2"), children):
                at, module = f"vision.blocks.{i}.{norm}.", block.get_submodule(child)
                x, out = torch.cat(io[f"{i}.{norm}.in"]).double(), torch.cat(io[f"{i}.{norm}.out"])
                assert not torch.all(module.weight == 1)  # a weight that makes the output differ from x / scale
                eps = norm_eps(module)
                if rms:
                    scale = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
                    normalized = x / scale
                else:
                    scale = (x.var(-1, correction=0, keepdim=True) + eps).sqrt()
                    normalized = out.double()
                # the module's output is TransformerLens' hook_normalized for a LayerNorm only
                assert torch.equal(cache[at + "hook_normalized"], out) != rms, at
                torch.testing.assert_close(cache[at + "hook_normalized"].double(), normalized, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(cache[at + "hook_scale"].double(), scale, atol=1e-5, rtol=1e-5)
                tl = _transformer_lens_norm(module, torch.cat(io[f"{i}.{norm}.in"]), rms)
                for which in WHICH if tl is not None else ():  # TransformerLens' own values, where installed
                    torch.testing.assert_close(cache[at + which].float(), tl[which], atol=1e-5, rtol=1e-5)
        # LLaVA's projector reads block 0's output: an edit in block 1 changes nothing there
        assert_reads_and_edits(hm, batch, plain, cache, changed_from=None if name == "llava" else hf)
    assert torch.equal(logits_with(model, batch), hf)
    hm.unwrap()


def _transformer_lens_norm(module: Any, x: torch.Tensor, rms: bool) -> Optional[dict[str, torch.Tensor]]:
    """TransformerLens 2.x's own ``RMSNorm``/``LayerNorm`` component (with the module's weight and bias) run on
    ``x``: its ``hook_scale`` and ``hook_normalized``, or ``None`` where TransformerLens is not installed."""
    try:
        from transformer_lens.components import LayerNorm, RMSNorm
        from transformer_lens.HookedTransformerConfig import HookedTransformerConfig
    except ImportError:
        return None
    d = x.shape[-1]
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=d, n_ctx=x.shape[-2], d_head=d, act_fn="relu", eps=norm_eps(module)
    )
    norm = RMSNorm(cfg) if rms else LayerNorm(cfg)
    seen: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        norm.w.copy_(module.weight)
        if not rms:
            norm.b.copy_(module.bias)
        for which in WHICH:
            getattr(norm, which).add_hook(lambda t, hook, which=which: seen.setdefault(which, t.clone()))
        norm(x.float())
    return seen


def _refusing(monkeypatch: pytest.MonkeyPatch, refused: Any) -> None:
    """The wiring's ``NormSpec`` look-up refuses the modules ``refused(module)`` says (no plugin knows them)."""
    looked_up = CoreSites._norm_spec

    def refuse() -> Any:
        raise UnsupportedModelError("no plugin knows how this norm normalizes (the test's)")

    def norm_spec(self: Any, module: Any) -> Any:
        return refuse if refused(module) else looked_up(self, module)

    monkeypatch.setattr(CoreSites, "_norm_spec", norm_spec)


def _wrap(model: Any) -> tuple[HookedModel, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model)
    return hm, [str(w.message) for w in caught if issubclass(w.category, VisionTowerWarning)]


def test_an_rmsnorm_whose_normalization_is_unknown_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where how block 1's ``ln1`` (an RMSNorm) normalizes is not known, its ``hook_scale`` and ``hook_normalized``
    are not served (its output is not TransformerLens' value) and the warning names the block and why; the other
    norms' points and the block's other points are served."""
    model, _ = vlm("mistral3")
    norm = tower_blocks_of(model)[1].attention_norm
    _refusing(monkeypatch, lambda module: module is norm)
    hm, messages = _wrap(model)
    assert messages == [
        "the vision tower's ln1/ln2.hook_scale and hook_normalized are not served where how the norm normalizes is "
        "not known (hook_normalized is an RMSNorm's input divided by its scale, before the weight, not its output): "
        "block 1 ln1: no plugin knows how this norm normalizes (the test's)"
    ]
    served = set(hm.hook_dict)
    assert not {"vision.blocks.1.ln1.hook_scale", "vision.blocks.1.ln1.hook_normalized"} & served
    for point in ("0.ln1.hook_scale", "0.ln1.hook_normalized", "1.ln2.hook_normalized", "1.hook_attn_out"):
        assert f"vision.blocks.{point}" in served
    hm.unwrap()


def test_a_plain_layer_norm_whose_normalization_is_unknown_keeps_its_output_as_hook_normalized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tower's ``nn.LayerNorm`` whose ``NormSpec`` is not known (the look-up refuses it) is still provably a
    LayerNorm: its ``hook_normalized`` (its output) is served and edits as a plain hook does, without ``hook_scale``
    and without a warning about it."""
    model, n_image = vlm("llava")
    batch = inputs(model, n_image)
    blocks = tower_blocks_of(model)
    tower_norms = {id(m) for block in blocks for m in (block.layer_norm1, block.layer_norm2)}
    _refusing(monkeypatch, lambda module: id(module) in tower_norms)
    references = per_block(
        blocks,
        lambda i, block: {
            "ln1.hook_normalized": lambda seen, edit: [plain_hook(block.layer_norm1, "post", seen, edit)]
        },
    )
    plain = plain_reads_and_edits(model, batch, references)
    hm, messages = _wrap(model)
    assert not [m for m in messages if "ln1/ln2" in m]
    assert not [p for p in hm.hook_dict if p.startswith("vision.") and p.endswith(("ln1.hook_scale", "ln2.hook_scale"))]
    assert "vision.blocks.0.ln2.hook_normalized" in hm.hook_dict
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch, names_filter=list(plain))
        assert_reads_and_edits(hm, batch, plain, cache)
    hm.unwrap()
