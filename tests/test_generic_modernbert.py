"""ModernBERT (a pre-LN, rotary, bidirectional encoder with alternating global and sliding-window attention and a
masked-LM prediction head) under the generic adapter: wrapped with an empty ``Registry``, so that the generic adapter
describes it even where the ``modernbert`` plugin is installed.

Under transformers 5.x its attention goes through transformers' attention interface, passing flash attention's
``deterministic`` flag to every implementation: the patterns are served, and a local layer's show its window. Under
transformers 4.x it looks its attention function up in a table of its own by the implementation's name (the probe's
entry is not there): the probe runs it as it is, and the residual points are served.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from lensadapters import HookedModel, Registry
from lensadapters.hf import tiny_config_of

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
WINDOW = 2  # local_attention=4: a local layer's query at i sees the keys j with |i - j| <= 2


def _model(implementation: str = "eager"):
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    config = tiny_config_of(
        ModernBertConfig,
        layers=3,
        local_attention=2 * WINDOW,
        global_attn_every_n_layers=2,  # layers 0 and 2 global, layer 1 local
        attn_implementation=implementation,
        **special,
    )
    torch.manual_seed(0)
    return ModernBertForMaskedLM(config).eval()


def _batch():
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # the second row is padded on the right
    return ids, mask


def _wrap(model):
    """The generic adapter's wrap: no plugin registered (the modernbert plugin claims the model type)."""
    with pytest.warns(Warning, match="generic adapter"):
        return HookedModel.wrap(model, registry=Registry())


def test_residual_points_are_the_layers_inputs_and_outputs_with_padding():
    model = _model()
    ids, mask = _batch()
    seen: dict = {}
    handles = [
        layer.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, (args[0], out)))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
    finally:
        for handle in handles:
            handle.remove()
    hm = _wrap(model)
    served = set(hm.hook_names)
    assert {"hook_embed", "blocks.1.hook_attn_out", "blocks.1.hook_mlp_out", "blocks.2.hook_resid_post"} <= served
    logits, cache = hm.run_with_cache(input_ids=ids, attention_mask=mask)
    assert torch.equal(logits, expected)
    for i in range(3):
        layer_in, layer_out = seen[i]
        layer_out = layer_out[0] if isinstance(layer_out, tuple) else layer_out
        assert torch.equal(cache[f"blocks.{i}.hook_resid_pre"], layer_in)
        assert torch.equal(cache[f"blocks.{i}.hook_resid_post"], layer_out)
    hm.unwrap()


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x's ModernBERT computes attention in its own code")
def test_patterns_are_the_models_and_show_the_local_window():
    model = _model()
    ids, mask = _batch()
    with torch.no_grad():
        attentions = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    hm = _wrap(model)
    _, cache = hm.run_with_cache(input_ids=ids, attention_mask=mask)
    position = torch.arange(9)
    near = (position[:, None] - position[None, :]).abs() <= WINDOW
    real_keys = mask.bool()[:, None, None, :]
    for i in range(3):
        pattern = cache[f"blocks.{i}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, attentions[i], rtol=0, atol=1e-6)
        allowed = (real_keys & (near if i == 1 else torch.ones_like(near))).expand_as(pattern)
        real_queries = mask.bool()  # (a padding query whose window holds no real key attends everywhere, as in HF)
        assert ((pattern > 0) == allowed).all(-1)[real_queries[:, None, :].expand(-1, 4, -1)].all()
    # the same weights under sdpa: the same patterns for the real queries (a padding query whose window holds no
    # real key gets no attention there, as sdpa gives it), and the logits of sdpa with the patterns hooked
    sdpa = _model("sdpa")
    with torch.no_grad():
        expected = sdpa(input_ids=ids, attention_mask=mask).logits
    hm_sdpa = _wrap(sdpa)
    logits, cache_sdpa = hm_sdpa.run_with_cache(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    for i in range(3):
        name = f"blocks.{i}.attn.hook_pattern"
        torch.testing.assert_close(cache_sdpa[name][0], cache[name][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(cache_sdpa[name][1, :, :6], cache[name][1, :, :6], rtol=0, atol=1e-6)


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x's ModernBERT computes attention in its own code")
def test_a_pattern_edit_is_the_models_attention_edited():
    """Zeroing a head's pattern on the local layer changes the logits as the same edit of the attention weights in
    the model's own eager attention does."""
    model = _model()
    ids, mask = _batch()
    attention = model.model.layers[1].attn
    hm = _wrap(model)

    def zero_head(pattern, hook):
        pattern = pattern.clone()
        pattern[:, 1] = 0
        return pattern

    hooks = [("blocks.1.attn.hook_pattern", zero_head)]
    edited = hm.run_with_hooks(input_ids=ids, attention_mask=mask, fwd_hooks=hooks)
    hm.unwrap()

    # reference: the head's share of the attention output zeroed before Wo (its z is pattern @ v)
    def drop_head(module, args):
        z = args[0].clone()
        d = z.shape[-1] // 4
        z[..., d : 2 * d] = 0
        return (z,)

    handle = attention.Wo.register_forward_pre_hook(drop_head)
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
    finally:
        handle.remove()
    torch.testing.assert_close(edited, expected, rtol=0, atol=1e-5)


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x's ModernBERT is not described automatically")
def test_block_points_are_the_hugging_face_modules_values():
    """hook_q/k/v are the fused ``Wqkv``'s thirds per head, hook_rot_q/k those rotated with the layer's (cos, sin),
    mlp.hook_pre/pre_linear the fused ``Wi``'s halves (activation input, gate) and mlp.hook_post ``Wo``'s input."""
    from transformers.models.modernbert.modeling_modernbert import apply_rotary_pos_emb

    model = _model()
    ids, mask = _batch()
    seen: dict = {}

    def keep(key):
        return lambda module, args, kwargs, out: seen.__setitem__(key, (args, kwargs, out))

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles += [
            layer.attn.Wqkv.register_forward_hook(keep((i, "qkv")), with_kwargs=True),
            layer.attn.register_forward_hook(keep((i, "attn")), with_kwargs=True),
            layer.mlp.Wi.register_forward_hook(keep((i, "wi")), with_kwargs=True),
            layer.mlp.Wo.register_forward_hook(keep((i, "wo")), with_kwargs=True),
        ]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    hm = _wrap(model)
    _, cache = hm.run_with_cache(input_ids=ids, attention_mask=mask)
    hm.unwrap()
    for i in range(3):
        q, k, v = seen[(i, "qkv")][2].view(2, 9, 3, 4, 8).unbind(2)
        for name, expected in (("q", q), ("k", k), ("v", v)):
            assert torch.equal(cache[f"blocks.{i}.attn.hook_{name}"], expected)
        cos, sin = seen[(i, "attn")][1]["position_embeddings"]
        rot_q, rot_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        torch.testing.assert_close(cache[f"blocks.{i}.attn.hook_rot_q"], rot_q.transpose(1, 2), rtol=0, atol=1e-6)
        torch.testing.assert_close(cache[f"blocks.{i}.attn.hook_rot_k"], rot_k.transpose(1, 2), rtol=0, atol=1e-6)
        pre, gate = seen[(i, "wi")][2].chunk(2, dim=-1)
        assert torch.equal(cache[f"blocks.{i}.mlp.hook_pre"], pre)
        assert torch.equal(cache[f"blocks.{i}.mlp.hook_pre_linear"], gate)
        assert torch.equal(cache[f"blocks.{i}.mlp.hook_post"], seen[(i, "wo")][0][0])
