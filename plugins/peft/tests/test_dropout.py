"""LoRA dropout: hook points read exactly what PEFT computed, in training and evaluation mode.

The models are tiny GPT-2 and Llama models (``kit_for`` in ``conftest.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

peft = pytest.importorskip("peft")
import lensadapters_peft as lp  # noqa: E402
from lensadapters_peft.testing import init_lora, lora_layers, split_like  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from lensadapters.testing import assert_close  # noqa: E402

warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")

# pattern/score hooks run the core's explicit attention (equal to SDPA within rounding, not bitwise)
NO_PATTERN = lambda name: not name.endswith(("hook_pattern", "hook_attn_scores"))  # noqa: E731


def test_dropout_in_training_mode_is_read_exactly(kit_for: Any) -> None:
    """With LoRA dropout active, the delta point reads what PEFT added in that very forward pass."""
    kit = kit_for("gpt2")
    pm = get_peft_model(
        kit.base(),
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.5, init_lora_weights=False, fan_in_fan_out=True
        ),
    )
    init_lora(pm, 0)
    pm.train()
    hm = kit.wrap(pm)
    module = pm.base_model.model.transformer.h[0].attn.c_attn
    seen: dict[str, torch.Tensor] = {}
    h1 = module.base_layer.register_forward_hook(lambda m, a, o: seen.__setitem__("base", o))
    ids = kit.tokens(2, 6, seed=0)
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0.attn.hook_"))
    h1.remove()
    delta = torch.cat([cache[f"blocks.0.attn.hook_{x}_lora"].flatten(-2) for x in "qkv"], -1)
    fused = torch.cat([cache[x, 0].flatten(-2) for x in "qkv"], -1)
    assert torch.equal(fused, seen["base"] + delta)
    hm.unwrap()


def _dropout_llama(
    kit: Any, p: float = 0.5, targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj")
) -> tuple[Any, PeftModel]:
    pm = get_peft_model(
        kit.base(), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=p, init_lora_weights=False)
    )
    init_lora(pm, 0)
    return kit, pm


def test_lora_dropout_follows_peft_in_eval_and_train_mode(kit_for: Any) -> None:
    """Eval mode: LoRA dropout does not fire, each ``*_lora`` point is B·A·x·scaling computed here from the
    factors. Train mode: exactly PEFT's dropout: with the same RNG seed the wrapped run (every point cached)
    gives the unwrapped PeftModel's logits bit for bit, and each delta is B·A·dropout(x)·scaling for the mask
    PEFT drew, which differs from the no-dropout delta."""
    p = 0.5
    kit, pm = _dropout_llama(kit_for("llama"), p)
    ids = kit.tokens(2, 6, seed=8)
    layers = [m for m in pm.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    seen: dict[int, torch.Tensor] = {}
    handles = [m.register_forward_pre_hook(lambda m, a: seen.__setitem__(id(m), a[0])) for m in layers]
    handles += [
        m.lora_dropout["default"].register_forward_hook(lambda d, a, o, m=m: seen.__setitem__(-id(m), o))
        for m in layers
    ]

    def delta_from_factors(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        A, B = module.lora_A["default"].weight, module.lora_B["default"].weight  # [r, d_in], [d_out, r]
        return torch.einsum("...i,ri,or->...o", x, A, B) * module.scaling["default"]

    # train mode: the reference is the PeftModel before wrapping
    pm.train()
    with torch.no_grad():
        torch.manual_seed(1234)
        reference = pm(ids).logits
    hm = kit.wrap(pm)
    delta_layers = lora_layers(hm)
    assert set(delta_layers.values()) == set(layers)
    with torch.no_grad():
        torch.manual_seed(1234)
        logits, cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
    assert torch.equal(logits, reference), "the wrapped run drew other dropout masks than PEFT"
    for name, module in delta_layers.items():
        x, dropped = seen[id(module)], seen[-id(module)]
        kept = dropped != 0
        assert 0 < kept.float().mean() < 1, f"{name}: dropout did not fire in train mode"
        assert torch.equal(dropped[kept], x[kept] / (1 - p))  # inverted dropout, as torch.nn.Dropout
        fired = module.lora_B["default"](module.lora_A["default"](dropped)) * module.scaling["default"]
        assert torch.equal(cache[name], split_like(hm, name, fired).reshape(cache[name].shape)), name
        no_dropout = split_like(hm, name, delta_from_factors(module, x)).reshape(cache[name].shape)
        assert (cache[name] - no_dropout).abs().max() > 1e-3, f"{name}: the train-mode delta ignored the dropout"

    # eval mode: no dropout, the delta is B·A·x·scaling
    pm.eval()
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
        assert torch.equal(hm(ids).logits, pm(ids).logits)
    for name, module in delta_layers.items():
        x = seen[id(module)]
        expected = split_like(hm, name, delta_from_factors(module, x)).reshape(cache[name].shape)
        assert_close(cache[name], expected, f"{name} == B·A·x·scaling in eval mode", atol=1e-5)
    for h in handles:
        h.remove()
    hm.unwrap()


def test_hook_result_with_train_mode_dropout_on_o_proj(kit_for: Any) -> None:
    """``attn.hook_result`` is ``z`` times the effective ``W_O`` (base + B·A·scaling), which has no dropout mask:
    in train mode with LoRA dropout on ``o_proj`` the heads' results do not sum to ``hook_attn_out - b_O``; the
    gap is exactly the dropout's effect on the delta. Edits stay exact (applied as differences)."""
    kit, pm = _dropout_llama(kit_for("llama"), 0.5, targets=("o_proj",))
    ids = kit.tokens(2, 6, seed=9)
    hm = kit.wrap(pm)
    names = ["blocks.0.attn.hook_z", "blocks.0.attn.hook_result", "blocks.0.hook_attn_out", "blocks.0.attn.hook_o_lora"]
    bump = torch.randn(hm.cfg.d_model, generator=torch.Generator().manual_seed(10))

    def bump_head_1(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t = t.clone()
        t[:, :, 1] += bump
        return t

    for train in (False, True):
        pm.train(train)
        with torch.no_grad():
            torch.manual_seed(5)
            _, cache = hm.run_with_cache(ids, names_filter=names)
            torch.manual_seed(5)
            with hm.hooks([("blocks.0.attn.hook_result", bump_head_1)]):
                _, edited = hm.run_with_cache(ids, names_filter="blocks.0.hook_attn_out")
            W_O, b_O = hm.W_O[0], hm.b_O[0]
        z, result, attn_out = cache["z", 0], cache["result", 0], cache["attn_out", 0]
        assert_close(result, torch.einsum("bphd,hdm->bphm", z, W_O), "result == z @ effective W_O", atol=1e-5)
        f = lp.lora_factors(hm, 0, "o")
        no_dropout = torch.einsum("bphd,hdr,rm->bpm", z, f.A, f.B) * f.scaling
        gap = cache["blocks.0.attn.hook_o_lora"] - no_dropout  # zero in eval mode
        assert_close(attn_out - b_O - result.sum(-2), gap, "sum of heads misses the dropout's effect", atol=1e-5)
        assert (gap.abs().max() > 1e-3) == train
        # the edit moved hook_attn_out by exactly the edit (same dropout mask: same seed)
        assert_close(edited["attn_out", 0], attn_out + bump, "hook_result edit applied as a difference", atol=1e-5)
    hm.unwrap()
