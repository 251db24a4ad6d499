"""How adapted models come and are hooked: PeftModel, mixed and transformers-integration adapters, modules
replaced after wrapping, mixed-adapter batches, adapted embeddings, LoRA factors, half-precision bases,
backward hooks on the LoRA-delta points.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

peft = pytest.importorskip("peft")
import lensadapters_peft as lp  # noqa: E402
from lensadapters_peft.testing import init_lora  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

from lensadapters import LensAdaptersError  # noqa: E402
from lensadapters.testing import assert_close  # noqa: E402

warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")

# pattern/score hooks run the core's explicit attention (equal to SDPA within rounding, not bitwise)
NO_PATTERN = lambda name: not name.endswith(("hook_pattern", "hook_attn_scores"))  # noqa: E731


def test_no_core_site_hooks_a_base_layer(kit_for: Any) -> None:
    kit = kit_for("gpt2")
    pm = kit.adapted()
    hm = kit.wrap(pm)
    base_layers = {id(m.base_layer) for m in pm.modules() if hasattr(m, "lora_A")}
    hm.add_hook(lambda n: True, lambda t, hook: None)
    for site in hm.wiring.sites:
        if isinstance(site, lp.LoraDeltaSite):
            continue
        for attr in ("module", "block", "mlp_out_module", "ln2", "embed_module"):
            assert id(getattr(site, attr, None)) not in base_layers, (type(site).__name__, attr)
    hm.unwrap()


def test_modules_replaced_after_wrapping_are_refused(kit_for: Any) -> None:
    kit = kit_for("gpt2", targets=["c_attn"])
    pm = kit.adapted()
    hm = kit.wrap(pm)
    ids = torch.randint(0, 64, (1, 5))
    pm.add_adapter("mlp", LoraConfig(r=2, target_modules=["c_fc"], init_lora_weights=False, fan_in_fan_out=True))
    hm(ids)  # without hooks: PEFT's forward, nothing checked
    with pytest.raises(LensAdaptersError, match="replaced after HookedModel.wrap"):
        hm.run_with_cache(ids)
    hm.unwrap()
    hm = kit.wrap(pm)
    assert "blocks.0.mlp.hook_pre_lora" in hm.hook_names
    hm.run_with_cache(ids)
    hm.unwrap()


def test_bare_model_peft_injected_after_wrapping_is_refused(kit_for: Any) -> None:
    kit = kit_for("gpt2")
    model = kit.base()
    hm = kit.wrap(model)
    get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    with pytest.raises(LensAdaptersError, match="replaced after HookedModel.wrap"):
        hm.run_with_cache(torch.randint(0, 64, (1, 4)))
    hm.unwrap()


def test_adapters_loaded_through_transformers_integration(kit_for: Any) -> None:
    """``model.add_adapter(LoraConfig)`` (transformers' PEFT integration, no PeftModel): same LoRA points."""
    import peft
    from packaging.version import Version
    from transformers.integrations import peft as hf_peft

    needed = getattr(hf_peft, "MIN_PEFT_VERSION", "0")
    if Version(peft.__version__) < Version(needed):  # transformers 5.24 asks for a PEFT not yet released (0.22)
        pytest.skip(f"transformers' PEFT integration needs peft >= {needed}; peft {peft.__version__} is installed")
    kit = kit_for("gpt2")
    model = kit.base()
    model.add_adapter(
        LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], init_lora_weights=False, fan_in_fan_out=True)
    )
    init_lora(model, 0)
    model.eval()
    hm = kit.wrap(model)
    assert hm.model is model and "blocks.1.mlp.hook_pre_lora" in hm.hook_names
    ids = kit.tokens(2, 5, seed=7)
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, model(ids).logits)
        both = lp.run_with_cache_base_and_adapted(hm, ids, names_filter=NO_PATTERN)
        hb = kit.wrap(kit.base())
        base_logits = hb(ids).logits
    assert torch.equal(both.base_logits, base_logits)
    assert both.cache["blocks.0.attn.hook_q_lora"].abs().max() > 0
    assert not both.base_cache["blocks.0.attn.hook_q_lora"].any()
    assert not any(layer.disable_adapters for layer in lp.helpers._tuner_layers(hm))
    hm.unwrap()
    hb.unwrap()


def test_mixed_peft_model_is_opened(kit_for: Any) -> None:
    from peft import get_peft_model as gpm

    kit = kit_for("gpt2")
    pm = gpm(
        kit.base(), LoraConfig(r=2, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True), mixed=True
    )
    hm = kit.wrap(pm)
    assert hm.model is pm and "blocks.0.attn.hook_q_lora" in hm.hook_names
    ids = torch.randint(0, 64, (1, 4))
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, pm(ids).logits)
    hm.unwrap()


def test_mixed_adapter_batches(kit_for: Any) -> None:
    """``adapter_names=`` (one adapter per row): the delta is output − base per row; ``__base__`` rows read zero."""
    kit = kit_for("gpt2", targets=["c_attn", "mlp.c_fc"])
    pm = kit.adapted()
    hm = kit.wrap(pm)
    ids = kit.tokens(3, 5, seed=5)
    rows = ["default", "__base__", "default"]
    with torch.no_grad():
        reference = pm(ids, adapter_names=rows).logits
        logits, mixed = hm.run_with_cache(ids, adapter_names=rows, names_filter=NO_PATTERN)
        _, plain = hm.run_with_cache(ids, names_filter=NO_PATTERN)
        with lp.adapters_disabled(hm):
            _, base = hm.run_with_cache(ids, names_filter=NO_PATTERN)
    assert torch.equal(logits, reference)
    for name in lp.lora_hook_names(hm):
        assert not mixed[name][1].any(), name
        assert_close(mixed[name][[0, 2]], plain[name][[0, 2]], name, atol=1e-5)
    for key in base.keys():
        if not key.endswith("_lora"):
            assert_close(mixed[key][1], base[key][1], key, atol=1e-5)
    hm.unwrap()


def test_lora_embedding_weight_is_effective(kit_for: Any) -> None:
    kit = kit_for("gpt2", targets=["wte", "c_attn"])
    pm = kit.adapted()
    hm = kit.wrap(pm)
    ids = kit.tokens(2, 5, seed=2)
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter="hook_embed")
        assert_close(cache["hook_embed"], hm.W_E[ids], "hook_embed == effective W_E[ids]")
        with lp.adapters_disabled(hm):
            assert torch.equal(hm.W_E, pm.base_model.model.transformer.wte.base_layer.weight)
    hm.unwrap()


def test_lora_factor_shapes_and_errors(kit_for: Any) -> None:
    kit = kit_for("gpt2", targets=["c_attn", "mlp.c_proj"])
    pm = kit.adapted()
    hm = kit.wrap(pm)
    cfg = hm.cfg
    f = lp.lora_factors(hm, 0, "q")
    assert f.A.shape == (cfg.d_model, 4) and f.B.shape == (cfg.n_heads, 4, cfg.d_head) and f.scaling == 2.0
    assert lp.lora_factors(hm, 1, "v").W.shape == hm.W_V[1].shape
    assert lp.lora_factors(hm, 0, "out").B.shape == (4, cfg.d_model)
    with pytest.raises(LensAdaptersError, match="has no LoRA adapter"):
        lp.lora_factors(hm, 0, "o")
    with pytest.raises(ValueError):
        lp.lora_factors(hm, 0, "x")
    with pytest.raises(LensAdaptersError, match="no LoRA adapter 'nope'"):
        lp.lora_factors(hm, 0, "q", adapter="nope")
    hm.unwrap()


def test_half_precision_base_with_float32_adapters(kit_for: Any) -> None:
    """bf16 base, fp32 adapters (PEFT's autocast_adapter_dtype): the delta is read in fp32 exactly as PEFT adds it
    and a zeroed head delta gives the base projection exactly."""
    kit = kit_for("gpt2", targets=["c_attn"])
    pm = get_peft_model(
        kit.base().to(torch.bfloat16),
        LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True),
    )
    init_lora(pm, 0)
    pm.eval()
    module = pm.base_model.model.transformer.h[0].attn.c_attn
    assert module.lora_A["default"].weight.dtype == torch.float32
    hm = kit.wrap(pm)
    ids = kit.tokens(2, 6, seed=4)
    seen: dict[str, torch.Tensor] = {}
    h = module.base_layer.register_forward_hook(lambda m, a, o: seen.__setitem__("base", o))
    with torch.no_grad():
        reference = pm(ids).logits
        assert torch.equal(hm(ids).logits, reference)
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0.attn.hook_") and "pat" not in n)
        q_lora = cache["blocks.0.attn.hook_q_lora"]
        assert q_lora.dtype == torch.float32 and cache["q", 0].dtype == torch.bfloat16
        assert torch.equal(cache["q", 0], (seen["base"][..., :32].unflatten(-1, (4, 8)) + q_lora).to(torch.bfloat16))

        def zero_head(t: torch.Tensor, hook: Any) -> torch.Tensor:
            t = t.clone()
            t[:, :, 2] = 0
            return t

        with hm.hooks([("blocks.0.attn.hook_q_lora", zero_head)]):
            _, edited = hm.run_with_cache(ids, names_filter="blocks.0.attn.hook_q")
    h.remove()
    assert torch.equal(edited["q", 0][:, :, 2], seen["base"][..., :32].unflatten(-1, (4, 8))[:, :, 2])
    assert torch.equal(edited["q", 0][:, :, [0, 1, 3]], cache["q", 0][:, :, [0, 1, 3]])
    hm.unwrap()


def test_backward_hooks_on_delta_points(kit_for: Any) -> None:
    kit = kit_for("gpt2")
    pm = kit.adapted()
    hm = kit.wrap(pm)
    ids = kit.tokens(1, 5, seed=1)
    _, cache = hm.run_with_cache(
        ids, labels=ids, incl_bwd=True, names_filter=["blocks.1.attn.hook_q_lora", "blocks.1.attn.hook_q"]
    )
    # dL/d(delta) == dL/d(q): the delta is added to the projection output
    assert_close(cache["blocks.1.attn.hook_q_lora_grad"], cache["blocks.1.attn.hook_q_grad"], "grad of q delta")
    hm.unwrap()
