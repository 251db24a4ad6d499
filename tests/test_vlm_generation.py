"""Vision-language models (``*ForConditionalGeneration``), beyond one forward: generation with hooks, a plugin not
declaring vision-language models, LoRA and 8-bit language models, TransformerLens-style calls with image inputs, a
padded batch on multimodal RoPE refused. The tiny models are ``lensadapters.testing.vlm``'s."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.testing.models import int8_copy
from lensadapters.testing.tiny_models import needs
from lensadapters.testing.vlm import (
    BUILDERS,
    IMAGE_TOKEN,
    PROJECTOR_POINT,
    TEXT,
    TOWER,
    hm_projector_path,
    inputs,
    logits_of,
    logits_with,
    vlm,
)


@pytest.mark.parametrize("name", ["llava", "qwen3_5", "qwen3_vl"])
def test_generate_with_hooks(name: str) -> None:
    """``hm.generate`` with the processor's inputs runs the hooks: an ablation of the image features gives what the
    same ablation by a plain hook gives, and differs from the clean generation (Qwen 3.5: through its hybrid cache,
    the DeltaNet's recurrent states beside the attention's keys and values, with multimodal RoPE positions)."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)

    def ablate(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(output)

    handle = model.get_submodule(hm_projector_path(model)).register_forward_hook(ablate)
    try:
        expected = model.generate(**batch, **settings)
    finally:
        handle.remove()
    clean = model.generate(**batch, **settings)
    hm = HookedModel.wrap(model)
    calls = []

    def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
        calls.append(x.shape)
        return torch.zeros_like(x)

    with hm.hooks(fwd_hooks=[(PROJECTOR_POINT, hook)]):
        got = hm.generate(**batch, **settings)
    assert torch.equal(got, expected) and not torch.equal(got, clean)
    assert len(calls) == 1  # the image is read once, in the first forward; later steps reuse the cache
    hm.unwrap()


def test_a_plugin_that_does_not_declare_vision_language_models_is_not_used_for_one() -> None:
    """The language model's plugin describes a vision-language model only where its architecture declares
    ``vision_language`` (verified there): a LLaVA around an OLMo 2 language model is not given to the OLMo 2 plugin,
    whose description reads the outer config; it is refused by name, as before."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Olmo2Config

    from lensadapters import UnsupportedModelError, get_registry

    needs("olmo2")
    assert not any(arch.vision_language for _, arch in get_registry().claims("olmo2"))
    config = LlavaConfig(
        text_config=Olmo2Config(**TEXT),
        vision_config=CLIPVisionConfig(**TOWER, num_attention_heads=4, projection_dim=32),
        image_token_index=IMAGE_TOKEN,
    )
    with pytest.raises(UnsupportedModelError, match="llava"):
        HookedModel.wrap(LlavaForConditionalGeneration(config))


def test_lora_on_the_language_model() -> None:
    """A ``PeftModel`` with LoRA on the language model's projections: the LoRA points (``attn.hook_q_lora``...), the
    adapted forward, and the effective weights (those of the merged model)."""
    peft = pytest.importorskip("peft")
    model, n_image = vlm("llava")
    batch = inputs(model, n_image)
    config = peft.LoraConfig(r=2, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False)
    adapted = peft.get_peft_model(model, config).eval()
    with torch.no_grad():
        expected = adapted(**batch).logits
    hm = HookedModel.wrap(adapted)
    assert hm.plugin.name == "llama" and "blocks.1.attn.hook_v_lora" in hm.hook_names
    with torch.no_grad():
        logits, cache = hm.run_with_cache(**batch)
    assert torch.equal(logits_of(logits), expected)
    assert cache["blocks.0.attn.hook_q_lora"].abs().max() > 0
    w_q, w_v = hm.W_Q.detach().clone(), hm.W_V.detach().clone()
    hm.unwrap()
    merged = HookedModel.wrap(adapted.merge_and_unload())
    torch.testing.assert_close(merged.W_Q, w_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged.W_V, w_v, rtol=1e-5, atol=1e-6)
    merged.unwrap()


def test_8bit_language_model() -> None:
    """LLaVA loaded in 8-bit (bitsandbytes on the CPU): the points read what the quantized model computes (the
    query projection's output, the logits with an image) and the weights are the dequantized ones, within int8's
    rounding of the float model's."""
    pytest.importorskip("bitsandbytes")
    model, n_image = vlm("llava")
    batch = inputs(model, n_image)
    quantized = int8_copy(model)
    q_proj = quantized.get_decoder().layers[1].self_attn.q_proj
    assert type(q_proj).__name__ == "Linear8bitLt"
    seen = []
    handle = q_proj.register_forward_hook(lambda module, args, output: seen.append(output.detach().clone()))
    expected = logits_with(quantized, batch, handle)
    hm = HookedModel.wrap(quantized)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(**batch)
    assert torch.equal(logits_of(logits), expected)
    assert torch.equal(cache["blocks.1.attn.hook_q"].flatten(-2), seen[0])
    float_hm = HookedModel.wrap(model)
    error = (hm.W_Q - float_hm.W_Q).abs().max() / float_hm.W_Q.abs().max()
    assert 0 < error < 2 / 127
    hm.unwrap(), float_hm.unwrap()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_transformer_lens_style_calls_pass_the_image_inputs_on(name: str) -> None:
    """A TransformerLens-style call (``return_type=``...) passes the multimodal model's own inputs (``pixel_values``,
    Gemma 3's ``token_type_ids``) on to it; a keyword neither TransformerLens nor the model has is still refused."""
    from lensadapters import TransformerLensKeywordError

    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    with torch.no_grad():
        expected = model(**batch).logits
    hm = HookedModel.wrap(model)
    ids, rest = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids, return_type="logits", **rest)
        stopped = hm(ids, stop_at_layer=1, **rest)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)  # the call builds its own attention mask
    # the input of block 1 (Qwen3-VL's differs from block 0's output by the deepstack features it adds after it)
    torch.testing.assert_close(stopped, cache["blocks.1.hook_resid_pre"])
    with pytest.raises(TransformerLensKeywordError, match="image_size"):
        hm(ids, return_type="logits", image_size=3, **rest)
    hm.unwrap()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_transformer_lens_style_generate_with_an_image(name: str) -> None:
    """``hm.generate`` with TransformerLens' keywords takes the image inputs (to the first forward, with the key/value
    cache) and gives Hugging Face's greedy tokens, its hooks active; without the cache it refuses by name."""
    from lensadapters import TransformerLensKeywordError

    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    expected = model.generate(**batch, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    hm = HookedModel.wrap(model)
    ids, rest = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    calls = []
    with hm.hooks(fwd_hooks=[(PROJECTOR_POINT, lambda x, hook: calls.append(x.shape))]):
        got = hm.generate(ids, max_new_tokens=3, do_sample=False, stop_at_eos=False, return_type="tokens", **rest)
    assert torch.equal(got, expected) and len(calls) == 1
    with pytest.raises(TransformerLensKeywordError, match="use_past_kv_cache=True"):
        hm.generate(ids, max_new_tokens=2, use_past_kv_cache=False, stop_at_eos=False, return_type="tokens", **rest)
    with pytest.raises(TypeError, match="image_size"):
        hm.generate(ids, max_new_tokens=2, stop_at_eos=False, return_type="tokens", image_size=3)
    hm.unwrap()


def test_padded_batch_with_an_image_on_multimodal_rope_is_refused() -> None:
    """Qwen 3.5 gives its language model positions computed from the image grid: a TransformerLens-style call on a
    padded batch with an image (positions counted from the mask) is refused by name, not computed with the wrong
    positions; models whose positions are the tokens' indices (LLaVA) keep the padded call."""
    from lensadapters import TransformerLensKeywordError
    from lensadapters.adapters.vlm import computes_image_positions

    model, n_image = vlm("qwen3_5")
    batch = inputs(model, n_image)
    ids, rest = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    hm = HookedModel.wrap(model)
    with pytest.raises(TransformerLensKeywordError, match="multimodal RoPE"):
        hm(ids, return_type="logits", attention_mask=mask, **rest)
    with torch.no_grad():  # unpadded, or padded without an image: served
        assert hm(ids, return_type="logits", **rest).shape[:2] == ids.shape
        assert hm(ids, return_type="logits", attention_mask=mask).shape[:2] == ids.shape
    hm.unwrap()
    assert not computes_image_positions(vlm("llava")[0])
