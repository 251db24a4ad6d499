"""PEFT methods other than plain LoRA: IA³, LoHa and DoRA are hooked and their weights refused by name;
prompt learning is refused at wrap time.
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

from lensadapters import HookedModel, UnsupportedModelError, WeightUnavailableError  # noqa: E402
from lensadapters.testing import assert_close  # noqa: E402

warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")

# pattern/score hooks run the core's explicit attention (equal to SDPA within rounding, not bitwise)
NO_PATTERN = lambda name: not name.endswith(("hook_pattern", "hook_attn_scores"))  # noqa: E731


def test_prompt_learning_is_refused(kit_for: Any) -> None:
    from peft import PromptTuningConfig

    kit = kit_for("gpt2")
    pm = get_peft_model(kit.base(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(UnsupportedModelError, match="prompt-learning"):
        kit.wrap(pm)


def _tuner_kit(kit_for: Any) -> tuple[Any, torch.Tensor]:
    kit = kit_for("llama")
    return kit, kit.tokens(2, 6, seed=11)


def _record_outputs(modules: dict[str, torch.nn.Module]) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list]:
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = [m.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, (a[0], o))) for n, m in modules.items()]
    return seen, handles


def _check_non_lora_weights(
    hm: HookedModel,
    hb: HookedModel,
    method: str,
    refused: dict[str, str],
    readable: tuple[str, ...],
    targets: list[str],
) -> None:
    """``refused``: weight -> module path that must be named; ``readable`` weights equal the base model's."""
    for w, path in refused.items():
        with pytest.raises(WeightUnavailableError) as info:
            getattr(hm, w)
        message = str(info.value)
        assert path in message, (w, message)
        assert f"PEFT method {method}" in message and "reads LoRA weights only" in message, message
        assert "Hook points still see the adapted computation" in message and "bnb" not in message, message
        others = set(targets) - {path.rsplit(".", 1)[1]}
        assert not any(o in message for o in others), f"{w}: the error names another module: {message}"
    for w in readable:
        assert torch.equal(getattr(hm, w), getattr(hb, w)), w


def test_ia3_adapters_are_hooked_and_their_weights_refused(kit_for: Any) -> None:
    """IA³ (learned vectors scaling k, v and the down projection's input): every hook point sees the scaled
    computation, no-hook logits are PeftModel's bitwise, weights of IA³ layers raise a clear error that names
    the module asked for; other weights read."""
    from peft import IA3Config

    kit, ids = _tuner_kit(kit_for)
    pm = get_peft_model(
        kit.base(), IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    )
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "ia3_l" in name:  # PEFT starts at ones (no change)
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    pm.eval()
    hm, hb = kit.wrap(pm), kit.wrap(kit.base())
    assert hm.hook_names == hb.hook_names and not lp.lora_hook_names(hm)
    cfg = hm.cfg
    inner = pm.base_model.model.model.layers
    modules = {
        f"{i}.{n}": getattr(inner[i].self_attn if n != "down_proj" else inner[i].mlp, n)
        for i in range(cfg.n_layers)
        for n in ("k_proj", "v_proj", "down_proj")
    }
    seen, handles = _record_outputs(modules)
    with torch.no_grad():
        reference = pm(ids).logits
        assert torch.equal(hm(ids).logits, reference)
        logits, cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
        assert torch.equal(logits, reference)
        for i in range(cfg.n_layers):
            for short, n in (("k", "k_proj"), ("v", "v_proj")):
                module = modules[f"{i}.{n}"]
                x, out = seen[f"{i}.{n}"]
                scaled = module.base_layer(x) * module.ia3_l["default"].flatten()  # IA³ scales the output
                assert torch.equal(out, scaled) and not torch.allclose(out, module.base_layer(x))
                assert torch.equal(cache[short, i], out.unflatten(-1, (cfg.n_key_value_heads, cfg.d_head)))
            down = modules[f"{i}.down_proj"]
            x, out = seen[f"{i}.down_proj"]
            assert torch.equal(x, cache["post", i])  # hook_post: the down projection's input, before IA³
            scaled = down.base_layer(cache["post", i] * down.ia3_l["default"].flatten())  # IA³ scales the input
            assert torch.equal(cache["mlp_out", i], scaled) and torch.equal(out, scaled)
            assert not torch.allclose(scaled, down.base_layer(cache["post", i]))
        # the base model through the helpers (they handle any PEFT tuner)
        base_logits, base_cache = hb.run_with_cache(ids, names_filter=NO_PATTERN)
        with lp.adapters_disabled(hm):
            off_logits, off_cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
        assert torch.equal(off_logits, base_logits) and not torch.equal(logits, base_logits)
        assert all(torch.equal(off_cache[k], base_cache[k]) for k in base_cache.keys())
    for h in handles:
        h.remove()
    # W_Q reads q_proj only: the IA³ k_proj next to it is not asked for
    _check_non_lora_weights(
        hm,
        hb,
        "IA3",
        {
            "W_K": "model.layers.0.self_attn.k_proj",
            "_b_K": "model.layers.0.self_attn.k_proj",
            "W_V": "model.layers.0.self_attn.v_proj",
            "W_out": "model.layers.0.mlp.down_proj",
        },
        ("W_Q", "b_Q", "W_O", "W_in", "W_gate", "W_U"),
        kit.spec.targets,
    )
    assert hm.unwrap() is pm
    hb.unwrap()


def test_loha_adapters_are_hooked_and_their_weights_refused(kit_for: Any) -> None:
    """LoHa (Hadamard product of two low-rank factors) on q, o and up projections: the same guarantees."""
    from peft import LoHaConfig

    kit, ids = _tuner_kit(kit_for)
    pm = get_peft_model(
        kit.base(), LoHaConfig(r=2, alpha=4, target_modules=["q_proj", "o_proj", "up_proj"], init_weights=False)
    )
    pm.eval()
    hm, hb = kit.wrap(pm), kit.wrap(kit.base())
    assert hm.hook_names == hb.hook_names and not lp.lora_hook_names(hm)
    layer = pm.base_model.model.model.layers[1]
    modules = {"q": layer.self_attn.q_proj, "attn_out": layer.self_attn.o_proj, "pre_linear": layer.mlp.up_proj}
    seen, handles = _record_outputs(modules)
    with torch.no_grad():
        reference = pm(ids).logits
        assert torch.equal(hm(ids).logits, reference)
        logits, cache = hm.run_with_cache(ids, names_filter=lambda n: NO_PATTERN(n) and "hook_result" not in n)
        assert torch.equal(logits, reference)
        # hook_result is computed from W_O, which cannot be read here: the same clear error
        with pytest.raises(WeightUnavailableError, match=r"model\.layers\.1\.self_attn\.o_proj.*LoHa"):
            hm.run_with_cache(ids, names_filter="blocks.1.attn.hook_result")
        for name, module in modules.items():
            x, out = seen[name]
            assert not torch.allclose(out, module.base_layer(x)), f"{name}: LoHa changes nothing"
            value = cache[name, 1]
            assert torch.equal(value, out.reshape(value.shape)), name  # the adapted module's output
        with lp.adapters_disabled(hm):
            off_logits = hm(ids).logits
        assert torch.equal(off_logits, hb(ids).logits)
    for h in handles:
        h.remove()
    # W_K reads k_proj only: the LoHa q_proj next to it is not asked for
    _check_non_lora_weights(
        hm,
        hb,
        "LoHa",
        {
            "W_Q": "model.layers.0.self_attn.q_proj",
            "W_O": "model.layers.0.self_attn.o_proj",
            "W_in": "model.layers.0.mlp.up_proj",
        },
        ("W_K", "b_K", "W_V", "b_V", "W_gate", "W_out"),
        kit.spec.targets,
    )
    assert hm.unwrap() is pm
    hb.unwrap()


def test_dora_adapters_are_hooked_but_have_no_plain_weight(kit_for: Any) -> None:
    kit = kit_for("gpt2")
    pm = get_peft_model(
        kit.base(),
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], use_dora=True, init_lora_weights=False, fan_in_fan_out=True
        ),
    )
    init_lora(pm, 0)
    pm.eval()
    hm = kit.wrap(pm)
    module = pm.base_model.model.transformer.h[0].attn.c_attn
    seen: dict[str, torch.Tensor] = {}
    h = module.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o))
    hb = module.base_layer.register_forward_hook(lambda m, a, o: seen.__setitem__("base", o))
    ids = kit.tokens(2, 5, seed=6)
    with torch.no_grad():
        reference = pm(ids).logits
        assert torch.equal(hm(ids).logits, reference)
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0.attn.hook_") and "_lora" in n)
    h.remove()
    hb.remove()
    delta = torch.cat([cache[f"blocks.0.attn.hook_{x}_lora"].flatten(-2) for x in "qkv"], -1)
    assert_close(delta, seen["out"] - seen["base"], "DoRA delta = output - base", atol=1e-6)
    with pytest.raises(Exception, match="variant"):
        _ = hm.W_Q
    hm.unwrap()
