"""A block whose token mixer is not softmax attention (a plugin's ``lensadapters_attn_qkv`` returns ``None`` for
it, as for the linear-attention or state-space layers of hybrid models): the core serves its residual, norm and MLP
points and ``hook_attn_out`` (the mixer's output), no ``attn.*`` point, no head inputs and no attention weights,
while the other blocks keep every point."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lensadapters import Architecture, HookedModel, Registry, WeightUnavailableError, hf
from lensadapters.testing.families import decoder_config
from lensadapters.wiring import non_attention_blocks

ARCH = Architecture(name="mixer_blocks", model_types=("llama",), transformers=">=4.57,<6")
FAMILY = hf.DecoderFamily("Llama", model_type="llama", norms=("LlamaRMSNorm",))
MIXER_LAYER = 1  # described as a token mixer of another kind


def tiny(seed: int = 0) -> LlamaConfig:
    return decoder_config(LlamaConfig, n_heads=4, n_kv=2, hidden=32, layers=3, head_dim=8)


def wrapped() -> tuple[torch.nn.Module, HookedModel]:
    declared = hf.DecoderPlugin(
        ARCH, FAMILY, tiny, attn_qkv=lambda m, layer: None if layer == MIXER_LAYER else FAMILY.attn_qkv(m)
    )
    registry = Registry()
    registry.register(declared, "mixer_blocks")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny()).eval()
    return model, HookedModel.wrap(model, adapter=ARCH.name, registry=registry)


def test_a_block_without_softmax_attention_has_its_residual_points_only():
    model, hm = wrapped()
    mixer = [n[len(f"blocks.{MIXER_LAYER}.") :] for n in hm.hook_names if n.startswith(f"blocks.{MIXER_LAYER}.")]
    attention = [n[len("blocks.0.") :] for n in hm.hook_names if n.startswith("blocks.0.")]

    def attention_point(name: str) -> bool:
        return name.startswith("attn.") or name.endswith("_input") or name == "hook_attn_in"

    assert not [n for n in mixer if attention_point(n)]
    assert [n for n in attention if not attention_point(n)] == mixer
    assert "attn.hook_pattern" in attention and "hook_q_input" in attention
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    seen = {}
    handle = model.model.layers[MIXER_LAYER].self_attn.register_forward_hook(lambda m, a, out: seen.update(out=out[0]))
    with torch.no_grad():
        reference = model(ids).logits
        logits, cache = hm.run_with_cache(ids, names_filter=lambda n: True)
    handle.remove()
    torch.testing.assert_close(logits, reference)  # hooked patterns: explicit attention where the model ran sdpa
    torch.testing.assert_close(cache[f"blocks.{MIXER_LAYER}.hook_attn_out"], seen["out"])
    pre, mid = cache[f"blocks.{MIXER_LAYER}.hook_resid_pre"], cache[f"blocks.{MIXER_LAYER}.hook_resid_mid"]
    torch.testing.assert_close(mid, pre + seen["out"])


def test_an_edit_of_the_mixer_output_acts_downstream_and_its_weights_are_refused():
    model, hm = wrapped()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    mixer = model.model.layers[MIXER_LAYER].self_attn
    handle = mixer.register_forward_hook(lambda m, a, out: (out[0] * 2.0, *out[1:]))
    with torch.no_grad():
        expected = model(ids).logits
    handle.remove()
    with torch.no_grad():
        got = hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.{MIXER_LAYER}.hook_attn_out", lambda t, hook: t * 2.0)])
    assert torch.equal(got, expected)
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        with pytest.raises(WeightUnavailableError, match=f"layer {MIXER_LAYER} has no softmax attention"):
            getattr(hm, name)
    assert hm.W_in.shape[0] == 3  # the MLP weights of every block
    names = [n for n, _ in hm.tl_named_parameters()]  # TransformerLens' names: no attention weights in that block
    assert "blocks.0.attn.W_Q" in names and f"blocks.{MIXER_LAYER}.mlp.W_in" in names
    assert not [n for n in names if n.startswith(f"blocks.{MIXER_LAYER}.attn.")]
    assert non_attention_blocks(hm) == [MIXER_LAYER]
