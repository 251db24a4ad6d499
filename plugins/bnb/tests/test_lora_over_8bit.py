"""LoRA over 8-bit: PEFT adapters on bitsandbytes layers (the target stack: LoRA r=8, dropout 0.05 on
q_proj/v_proj of an 8-bit Llama, prepared for k-bit training).

Effective weights are the dequantized base plus the adapter's delta, split with the base's layout (fused
QKV included), and the identities hold within the int8 bound. The adapters are driven through PEFT's own API;
the plugins that open a ``PeftModel`` and support the model type are found through their entry points (a test
is skipped when none is installed).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Optional

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
import lensadapters_bnb as lb  # noqa: E402
from lensadapters_bnb.testing import (  # noqa: E402
    FLOAT_AGREEMENT_PER_BLOCK,
    RELOAD_SETTINGS,
    assert_within_bound,
    check_identities,
    quantize,
    wrap_quantized,
)

from lensadapters import FusedQKV, HookedModel  # noqa: E402
from lensadapters.testing import (  # noqa: E402
    assert_close,
    declared_contracts,
    model_openers,
    norm_out,
    registry_for,
    registry_with,
    seeded_model,
)

SETTINGS = RELOAD_SETTINGS


def wrap_adapted(model: Any, registry_of: Any) -> HookedModel:
    """``model`` (a ``PeftModel``) wrapped with ``registry_of(*plugins)`` given lensadapters-bnb and the installed
    plugins that open it; skips when none does."""
    openers = model_openers(model)
    if not openers:
        pytest.skip("no installed lensadapters plugin opens a PeftModel")
    return HookedModel.wrap(model, registry=registry_of(lb, *openers))


def lora_hook_names(hm: HookedModel) -> list[str]:
    return [n for n in hm.hook_names if n.endswith("_lora")]


def lora_delta(hm: HookedModel, layer: int, which: str, adapter: Optional[str] = None) -> torch.Tensor:
    """The LoRA delta weight ``(B @ A).T * scaling`` of ``adapter`` (default: the active one) on the ``which``
    (q, k or v) projection of block ``layer``, read from PEFT's layer, in ``W_Q``'s shape ``[h, d_model, d_head]``
    (split with the block's QKV layout)."""
    qkv = hm.qkv_layouts[layer]
    fused = isinstance(qkv, FusedQKV)
    module = hm.block_modules[layer].get_submodule(qkv.module if fused else getattr(qkv, which))
    (adapter,) = [adapter] if adapter is not None else module.active_adapters
    W = (module.lora_B[adapter].weight @ module.lora_A[adapter].weight).T * module.scaling[adapter]  # [d_in, d_out]
    W = qkv.split(W)["qkv".index(which)] if fused else W.unflatten(-1, (-1, hm.cfg.d_head))
    return W.permute(1, 0, 2)


def _nonzero_lora(model: nn.Module, seed: int) -> None:
    """PEFT starts with B = 0 (a zero delta); give the factors values so the adapter does something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(max(p.shape)))


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def _llama_config() -> Any:
    """The two-layer GQA Llama both LoRA-over-8-bit tests load (width 32, vocabulary 64)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def test_seed_stack_llama_8bit_lora_end_to_end() -> None:
    """Llama loaded in 8-bit, prepared for k-bit training, LoRA r=8, alpha 16, dropout 0.05 on q_proj/v_proj."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    config = _llama_config()
    base = quantize(seeded_model(config, 0, "eager"), "int8", torch.float16)
    # float16 -> float32 outside the int8 layers, reentrant gradient checkpointing (PEFT's default, said explicitly)
    base = prepare_model_for_kbit_training(base, gradient_checkpointing_kwargs={"use_reentrant": True})
    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=8,
            lora_alpha=16,
            lora_dropout=0.05,
            bias="none",
            target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM",
        ),
    )
    _nonzero_lora(peft_model, 0)
    peft_model.eval()
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert lb.is_quantized_linear(q_proj.base_layer) and not lb.is_quantized_linear(q_proj)
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(3, 64, (2, 8), generator=g)
    corrupt = clean.clone()
    corrupt[:, 3] = (clean[:, 3] + 7) % 61 + 3
    with torch.no_grad():
        reference = peft_model(clean).logits

    hooks_before = _hook_count(peft_model)
    hm = wrap_adapted(peft_model, lambda *plugins: registry_for("llama", *plugins))
    assert hm.model is peft_model
    lora_points = lora_hook_names(hm)
    assert lora_points == [f"blocks.{i}.attn.hook_{p}_lora" for i in range(2) for p in ("q", "v")]
    valid = torch.ones(clean.shape, dtype=torch.bool)
    with torch.no_grad():
        # no hooks: PEFT's own forward, bit for bit
        assert torch.equal(hm(clean).logits, reference)
        logits, cache = hm.run_with_cache(clean)
        assert torch.equal(logits, reference)
        assert set(cache.keys()) == set(hm.cache_names())

        # effective weights = dequantized 8-bit base + B·A·scaling, and the identities hold within the int8 bound
        for i in range(2):
            attn = hm.block_modules[i].self_attn
            base_q = lb.dequantized_weight(attn.q_proj.base_layer).W.unflatten(-1, (4, 8)).permute(1, 0, 2)
            assert_close(hm.W_Q[i], base_q + lora_delta(hm, i, "q"), "W_Q = dequantized base + LoRA", atol=1e-6)
            base_k = lb.dequantized_weight(attn.k_proj).W.unflatten(-1, (2, 8)).permute(1, 0, 2)
            assert torch.equal(hm._W_K[i], base_k)  # k_proj has no adapter
            x = norm_out(hm, cache, f"blocks.{i}.ln1")
            delta = torch.einsum("bpm,hmd->bphd", x, lora_delta(hm, i, "q"))
            assert_close(
                cache["blocks.{}.attn.hook_q_lora".format(i)], delta, "hook_q_lora == x @ A @ B * s", atol=1e-5
            )
        check_identities(hm, cache, valid)

        # activation patching: the clean residual stream patched into the corrupted run gives the clean logits
        _, clean_cache = hm.run_with_cache(clean, names_filter="blocks.1.hook_resid_pre")
        patched = hm.run_with_hooks(
            corrupt, fwd_hooks=[("blocks.1.hook_resid_pre", lambda t, hook: clean_cache[hook.name])]
        )
        assert torch.equal(patched, reference)
        corrupted = hm(corrupt).logits
        assert not torch.equal(corrupted, reference)

        def patch_z_head0(z: torch.Tensor, hook: Any) -> torch.Tensor:
            z = z.clone()
            z[:, :, 0] = clean_z[:, :, 0]
            return z

        _, z_cache = hm.run_with_cache(clean, names_filter="blocks.0.attn.hook_z")
        clean_z = z_cache["z", 0]
        assert not torch.equal(
            hm.run_with_hooks(corrupt, fwd_hooks=[("blocks.0.attn.hook_z", patch_z_head0)]), corrupted
        )

        # LoRA-delta hooks: zeroing every delta is running the 8-bit base model
        zeroed = hm.run_with_hooks(
            clean, fwd_hooks=[(lambda n: n.endswith("_lora"), lambda t, hook: torch.zeros_like(t))]
        )
        with peft_model.disable_adapter():
            base_logits = hm(clean).logits
        assert torch.equal(zeroed, base_logits) and not torch.equal(base_logits, reference)

    # one training step with hooks attached (dropout active, gradient checkpointing from
    # prepare_model_for_kbit_training)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.SGD(trainable, lr=0.05)
    steer = torch.randn(32, generator=torch.Generator().manual_seed(2)) * 0.1
    seen_grads: list[torch.Tensor] = []

    def steer_fn(t: torch.Tensor, hook: Any) -> torch.Tensor:
        return t + steer.to(t.dtype)

    def keep_grad(grad: torch.Tensor, hook: Any) -> None:
        seen_grads.append(grad)

    def eval_loss() -> float:
        peft_model.eval()
        with torch.no_grad(), hm.hooks([("blocks.0.hook_resid_pre", steer_fn)]):
            return hm(clean, labels=clean).loss.item()

    before = eval_loss()
    peft_model.train()
    with hm.hooks(
        fwd_hooks=[("blocks.0.hook_resid_pre", steer_fn)], bwd_hooks=[("blocks.1.attn.hook_q_lora", keep_grad)]
    ):
        loss = hm(clean, labels=clean, use_cache=False).loss
        loss.backward()
    assert seen_grads and seen_grads[-1].abs().sum() > 0
    grads = [p.grad for p in trainable]
    assert all(gr is not None for gr in grads) and sum(gr.abs().sum() for gr in grads) > 0
    assert all(p.grad is None for n, p in peft_model.named_parameters() if not p.requires_grad)
    optimizer.step()
    optimizer.zero_grad()
    after = eval_loss()
    assert after < before, (before, after)
    assert hm.unwrap() is peft_model
    assert _hook_count(peft_model) == hooks_before  # PEFT's own hooks (input require-grads) only


def test_lora_over_8bit_disable_switch_merge() -> None:
    """Two LoRA adapters over an 8-bit Llama: disabled is the 8-bit base bitwise, switching follows PEFT
    exactly, merged agrees with unmerged within the int8 requantization bound.

    Merging into 8-bit (PEFT's ``lora.Linear8bitLt.merge``) dequantizes the base, adds ``B·A·scaling`` in
    float32 and quantizes the sum again (``Int8Params``: cast to float16, each row rounded to steps of
    ``absmax_row / 127``). So the merged weight ``W_m`` read by ``hm.W_Q`` is within
    ``absmax_row(W) / 254 · (1 + 2^-10) + |W| · (2^-11 + 5e-5)`` of the unmerged effective weight ``W`` (half an
    int8 step, the float16 cast, the float32 dequantization). With the same input ``x`` the merged projection
    differs from the unmerged one by at most ``|x| @ that bound`` plus the two int8 matmul errors
    (``matmul_error_bound`` of ``W_m`` and of the base): checked on layer 0, whose input the merge does not
    change. Deeper layers see that difference propagated; there the TransformerLens identities are checked
    with the merged weights, which are exactly what the int8 kernel multiplies with.
    """
    from peft import LoraConfig, get_peft_model

    config = _llama_config()
    fp = seeded_model(config, 3, "eager")
    base8 = quantize(fp, "int8")
    pm = get_peft_model(
        quantize(fp, "int8"), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
    )
    pm.add_adapter("other", LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "o_proj"]))
    _nonzero_lora(pm, 3)
    pm.eval()
    hm = wrap_adapted(pm, lambda *plugins: registry_for("llama", *plugins))
    hb = HookedModel.wrap(base8, registry=registry_for("llama", lb))
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    valid = torch.ones(ids.shape, dtype=torch.bool)
    weights = ("W_Q", "_W_K", "_W_V", "W_O", "W_in", "W_out", "W_gate")
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids)
        assert torch.equal(logits, pm(ids).logits)
        base_logits, base_cache = hb.run_with_cache(ids)

        # disabled: the 8-bit base model, bit for bit (hooks, logits and weights)
        with pm.disable_adapter():
            off_logits, off_cache = hm.run_with_cache(ids)
            for w in weights:
                assert torch.equal(getattr(hm, w), getattr(hb, w)), f"disabled {w}"
        assert torch.equal(off_logits, base_logits) and not torch.equal(logits, base_logits)
        for name in base_cache.keys():
            assert torch.equal(off_cache[name], base_cache[name]), f"disabled {name}"
        for name in lora_hook_names(hm):
            assert not off_cache[name].any(), name
            # "default" adapts q_proj and v_proj; o_proj has only the inactive "other"
            assert (cache[name].abs().max() > 0) == (not name.endswith("hook_o_lora")), name

        # switched to "other" (q_proj, o_proj): PEFT's forward bitwise, the deltas and weights of "other"
        q0 = pm.base_model.model.model.layers[0].self_attn.q_proj
        seen: list[torch.Tensor] = []
        handle = q0.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        pm.set_adapter("other")  # PEFT's own switch
        try:
            other_logits, other = hm.run_with_cache(ids)
            handle.remove()
            assert torch.equal(other_logits, pm(ids).logits)
            delta = q0.lora_B["other"](q0.lora_A["other"](seen[0])) * q0.scaling["other"]
            assert torch.equal(other["blocks.0.attn.hook_q_lora"], delta.unflatten(-1, (4, 8)))
            assert not other["blocks.0.attn.hook_v_lora"].any() and other["blocks.0.attn.hook_o_lora"].abs().max() > 0
            for i in range(2):
                assert hm.block_modules[i].get_submodule(hm.qkv_layouts[i].q).active_adapters == ["other"]
                assert_close(
                    hm.W_Q[i], hb.W_Q[i] + lora_delta(hm, i, "q", "other"), f"W_Q[{i}] with 'other'", atol=1e-6
                )
            assert torch.equal(hm._W_V, hb._W_V)  # "other" does not adapt v_proj
            check_identities(hm, other, valid)
        finally:
            pm.set_adapter("default")
        assert pm.active_adapters == ["default"] and not torch.equal(other_logits, logits)
        assert torch.equal(hm(ids).logits, logits)

        # merged into the int8 weights
        unmerged = {w: getattr(hm, w) for w in ("W_Q", "_W_V")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Merge lora module to 8-bit linear may get different generations"
            pm.merge_adapter()
        merged_logits, merged = hm.run_with_cache(ids)
        assert torch.equal(merged_logits, pm(ids).logits)
        assert set(merged.keys()) == set(cache.keys())
        for w, W in unmerged.items():
            Wm = getattr(hm, w)
            step = W.abs().amax(dim=-2, keepdim=True) / 254  # per output feature: max over d_model
            bound = step * (1 + 2**-10) + W.abs() * (2**-11 + 5e-5) + 1e-7
            assert_within_bound(Wm, W, bound, f"merged {w} requantized")
            assert not torch.equal(Wm, W)  # the merge really requantized
        # layer 0: the same input before and after the merge
        assert torch.equal(merged["blocks.0.ln1.hook_normalized"], cache["blocks.0.ln1.hook_normalized"])
        x = norm_out(hm, cache, "blocks.0.ln1")
        attn = pm.base_model.model.model.layers[0].self_attn
        for short, w, module in (("q", "W_Q", attn.q_proj), ("v", "_W_V", attn.v_proj)):
            W, Wm = unmerged[w][0], getattr(hm, w)[0]  # [h, d_model, d_head]
            flat = lambda t: t.permute(1, 0, 2).flatten(-2)  # noqa: E731  [d_model, h * d_head]
            step = W.abs().amax(dim=-2, keepdim=True) / 254
            w_bound = flat(step * (1 + 2**-10) + W.abs() * (2**-11 + 5e-5) + 1e-7)
            base_W = lb.dequantized_weight(module.base_layer).W  # the unmerged run multiplied x with the base
            bound = (
                x.abs() @ w_bound
                + lb.matmul_error_bound(module, x, flat(Wm))
                + lb.matmul_error_bound(module.base_layer, x, base_W)
            )
            ratio = assert_within_bound(
                merged[short, 0].flatten(-2),
                cache[short, 0].flatten(-2),
                bound,
                f"layer 0 hook_{short}, merged vs unmerged",
            )
            assert ratio > 0  # (the values did change)
        check_identities(hm, merged, valid)
        # the merged delta points recompute B·A·x·scaling from the input
        assert_close(
            merged["blocks.0.attn.hook_q_lora"], cache["blocks.0.attn.hook_q_lora"], "merged q delta", atol=1e-5
        )
        rel = ((merged_logits - logits).norm() / logits.norm()).item()
        assert rel <= FLOAT_AGREEMENT_PER_BLOCK * 3, f"merged logits: relative difference {rel:.3g}"
    assert hm.unwrap() is pm
    hb.unwrap()


@functools.lru_cache(maxsize=None)
def fused_qkv_contracts() -> tuple[type, ...]:
    """The installed architectures' declared contracts whose models fuse q, k and v in one projection (a tiny
    model of each, from its plugin's ``lensadapters_tiny_config``, shows its layout)."""
    from lensadapters.demo import tiny_model

    found = []
    for contract in declared_contracts():
        registry = registry_with(contract.plugin)
        (info,) = registry.infos.values()
        try:
            model = tiny_model(registry, info, info.architectures[0])
        except LookupError:  # no tiny config
            continue
        hm = HookedModel.wrap(model, registry=registry)
        if isinstance(hm.qkv_layouts[0], FusedQKV):
            found.append(contract)
        hm.unwrap()
    return tuple(found)


@pytest.fixture(scope="module")
def fused_contracts() -> tuple[type, ...]:
    """:func:`fused_qkv_contracts`, found before the property runs: importing a plugin's contract module defines
    Hypothesis tests, which inside a running ``@given`` would be nested ones (a failed health check when this test
    is the first to import them)."""
    return fused_qkv_contracts()


@SETTINGS
@given(data=st.data())
def test_lora_on_fused_8bit_qkv(fused_contracts: tuple[type, ...], data: st.DataObject) -> None:
    """LoRA on an 8-bit fused projection (GPT-2 ``c_attn``, GPT-NeoX ``query_key_value``): the delta is split
    with the base weight's layout and the identities hold with base (dequantized) + delta."""
    from peft import LoraConfig, get_peft_model

    contracts = fused_contracts
    if not contracts:
        pytest.skip("no installed architecture plugin with a fused QKV projection declares a contract")
    contract = data.draw(st.sampled_from(contracts), label="contract")
    config = data.draw(
        contract.config_strategy(**{**contract.config_overrides, **contract.matrix_overrides}), label="config"
    )
    seed = data.draw(st.integers(0, 2**16), label="seed")
    base = quantize(seeded_model(config, seed, "eager"), "int8")
    hm = wrap_quantized(base, contract)
    target = hm.qkv_layouts[0].module.rsplit(".", 1)[-1]  # the fused projection, by its name in every block
    hm.unwrap()
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=[target], fan_in_fan_out=False))
    _nonzero_lora(peft_model, seed)
    peft_model.eval()
    ids = torch.randint(3, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(seed))
    hm = wrap_adapted(peft_model, lambda *plugins: registry_with(contract.plugin, *plugins))
    with torch.no_grad():
        reference = peft_model(ids).logits
        logits, cache = hm.run_with_cache(ids)
        assert torch.equal(logits, reference)
        check_identities(hm, cache, torch.ones(ids.shape, dtype=torch.bool))
        for i in range(hm.cfg.n_layers):
            for which in "qkv":
                delta = lora_delta(hm, i, which)
                with peft_model.disable_adapter():
                    base_W = getattr(hm, {"q": "W_Q", "k": "_W_K", "v": "_W_V"}[which])[i]
                full = getattr(hm, {"q": "W_Q", "k": "_W_K", "v": "_W_V"}[which])[i]
                assert_close(full, base_W + delta, f"layer {i} W_{which} = base + LoRA", atol=1e-6)
    hm.unwrap()
