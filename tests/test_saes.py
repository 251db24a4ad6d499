"""SAEs spliced into a HookedModel: the reconstruction replaces the activation exactly as a hook returning it would,
the error term gives the model's output back while feature edits still reach it, the SAE's hook points are cached
and removed with it, on every installed architecture, LoRA and 8-bit included. SAELens itself (its
HookedSAETransformer, training runner and evals): ``test_saes_saelens.py``."""

from __future__ import annotations

import re

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.saes import SAE_POINTS
from lensadapters.testing.saes import (
    ARCH,
    BOS,
    KINDS,
    StandInSAE,
    build,
    ids,
    make_sae,
    models,
    reconstruct,
)
from lensadapters.testing.tiny_models import ARCH_NAMES, tiny, tokenizer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", models())
def test_the_reconstruction_replaces_the_activation_and_the_error_term_gives_it_back(which, kind) -> None:
    hm = build(which)
    name = "blocks.0.hook_resid_post"
    sae = make_sae(kind, name, hm.cfg.d_model)
    tokens = ids()
    names_before = hm.hook_names
    try:
        plain = hm.run_with_hooks(tokens)
        spliced = hm.run_with_saes(tokens, saes=[sae])
        assert torch.equal(spliced, hm.run_with_hooks(tokens, fwd_hooks=[(name, reconstruct(sae))]))
        assert not torch.allclose(spliced, plain)
        kept = hm.run_with_saes(tokens, saes=[sae], use_error_term=True)
        torch.testing.assert_close(kept, plain, atol=1e-4, rtol=1e-4)

        def ablate(features, hook):
            features[..., :5] = 0
            return features

        def expected(x, hook):  # the edited reconstruction plus the clean reconstruction's error
            features = sae.encode(x)
            clean = sae.decode(features)
            edited = sae.decode(ablate(features.clone(), None))
            return (edited + (x - clean.to(x.dtype))).to(x.dtype)

        with hm.saes([sae], use_error_term=True):
            edited = hm.run_with_hooks(tokens, fwd_hooks=[(f"{name}.hook_sae_acts_post", ablate)])
        torch.testing.assert_close(
            edited, hm.run_with_hooks(tokens, fwd_hooks=[(name, expected)]), atol=1e-5, rtol=1e-5
        )
        assert not torch.allclose(edited, plain, atol=1e-4)
    finally:
        assert hm.hook_names == names_before and not hm.acts_to_saes and not hm.has_hooks
        hm.unwrap()


@pytest.mark.parametrize("kind", KINDS)
def test_the_saes_hook_points_are_cached_and_go_with_it(kind) -> None:
    hm = build(ARCH)
    name = "blocks.0.hook_mlp_out"
    sae = make_sae(kind, name, hm.cfg.d_model)
    tokens = ids()
    try:
        _, plain = hm.run_with_cache(tokens)  # every point, as below (patterns: explicit attention)
        _, cache = hm.run_with_cache_with_saes(tokens, saes=[sae])
        sae_points = [f"{name}.{p}" for p in SAE_POINTS if p != "hook_sae_error"]
        assert [n for n in cache if n.startswith(name + ".")] == sae_points  # in the order they fire
        x = cache[f"{name}.hook_sae_input"]
        assert torch.equal(x, plain[name])
        assert torch.equal(cache[f"{name}.hook_sae_acts_post"], sae.encode(x).detach())
        assert torch.equal(cache[f"{name}.hook_sae_recons"], sae.decode(sae.encode(x)).detach())
        assert torch.equal(cache[name], cache[f"{name}.hook_sae_output"])  # the point shows what flows on
        _, with_error = hm.run_with_cache_with_saes(tokens, saes=[sae], use_error_term=True)
        torch.testing.assert_close(with_error[f"{name}.hook_sae_error"] + with_error[f"{name}.hook_sae_recons"], x)
        assert name + ".hook_sae_input" not in hm.hook_names
    finally:
        hm.unwrap()


@pytest.mark.parametrize("kind", KINDS)
def test_add_reset_nesting_special_tokens_and_unwrap(kind) -> None:
    model = tiny(ARCH)
    tokens = ids()
    with torch.no_grad():
        original = model(tokens).logits
    hm = HookedModel.wrap(model, tokenizer=tokenizer(48))
    name = "blocks.0.hook_resid_pre"
    first, second = make_sae(kind, name, hm.cfg.d_model, 0), make_sae(kind, name, hm.cfg.d_model, 1)
    hm.add_sae(first)
    assert hm.acts_to_saes == {name: first}
    with_first = hm.run_with_hooks(tokens)
    with hm.saes([second]):
        assert hm.acts_to_saes[name] is second
        assert not torch.equal(hm.run_with_hooks(tokens), with_first)
    assert hm.acts_to_saes[name] is first and torch.equal(hm.run_with_hooks(tokens), with_first)
    hm.reset_saes()
    assert not hm.acts_to_saes and not hm.has_hooks
    _, cache = hm.run_with_cache_with_saes(tokens, saes=[first], exclude_special_tokens=[BOS])
    assert torch.equal(cache[name][:, 0], cache[f"{name}.hook_sae_input"][:, 0])  # BOS: left as it was
    assert torch.equal(cache[name][:, 1:], cache[f"{name}.hook_sae_recons"][:, 1:])
    hm.add_sae(first, use_error_term=True)
    hm.unwrap()  # SAEs go with the hooks
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, original)


def test_a_transcoder_reads_at_its_input_point_and_writes_at_its_output_point() -> None:
    hm = build(ARCH)
    source, target = "blocks.0.ln2.hook_normalized", "blocks.0.hook_mlp_out"
    transcoder = StandInSAE(source, hm.cfg.d_model, hook_name_out=target)
    tokens = ids()
    seen = {}

    def read(x, hook):
        seen["x"] = x.clone()

    def write(x, hook):
        return transcoder.decode(transcoder.encode(seen["x"]))

    try:
        expected = hm.run_with_hooks(tokens, fwd_hooks=[(source, read), (target, write)])
        assert torch.equal(hm.run_with_saes(tokens, saes=[transcoder]), expected)
        _, cache = hm.run_with_cache_with_saes(tokens, saes=[transcoder])
        assert torch.equal(cache[f"{target}.hook_sae_input"], cache[source])
        assert torch.equal(cache[target], cache[f"{target}.hook_sae_recons"])
        assert hm.acts_to_saes == {} and not hm.has_hooks
    finally:
        hm.unwrap()


@pytest.mark.parametrize("kind", KINDS)
def test_the_error_term_gives_the_models_value_back_bit_for_bit_in_every_dtype(kind) -> None:
    """A bfloat16 model with a float32 SAE (and every other pairing): with the error term and the features left as
    they are, the spliced point holds the model's own value exactly, and so do the logits."""
    name = "blocks.0.hook_resid_post"
    tokens = ids()
    for model_dtype in (torch.bfloat16, torch.float16, torch.float32):
        hm = HookedModel.wrap(tiny(ARCH).to(model_dtype), tokenizer=tokenizer(48))
        try:
            plain, own = hm.run_with_cache(tokens, names_filter=[name])
            for sae_dtype in (torch.float32, torch.bfloat16, torch.float16):
                sae = make_sae(kind, name, hm.cfg.d_model).to(sae_dtype)
                logits, cache = hm.run_with_cache_with_saes(
                    tokens, saes=[sae], use_error_term=True, names_filter=[name, f"{name}.hook_sae_recons"]
                )
                what = f"{model_dtype} model, {sae_dtype} SAE"
                assert cache[name].dtype == model_dtype, what
                assert torch.equal(cache[name], own[name]), what
                assert torch.equal(logits, plain), what
                assert not torch.equal(cache[f"{name}.hook_sae_recons"].to(model_dtype), own[name]), what
        finally:
            hm.unwrap()


def test_an_edit_of_the_error_term_reaches_the_output_and_gradients_flow() -> None:
    hm = build(ARCH)
    name = "blocks.0.hook_resid_post"
    sae = make_sae("stand-in", name, hm.cfg.d_model)
    tokens = ids()
    try:
        _, plain = hm.run_with_cache(tokens, names_filter=[name])
        p = torch.zeros((), requires_grad=True)
        direction = torch.randn(hm.cfg.d_model, generator=torch.Generator().manual_seed(3))

        def push(error, hook):
            return error + p * direction

        with hm.saes([sae], use_error_term=True):
            _, cache = hm.run_with_cache(tokens, names_filter=[name])
            logits = hm.run_with_hooks(tokens, fwd_hooks=[(f"{name}.hook_sae_error", push)])
        assert torch.equal(cache[name], plain[name])
        (grad,) = torch.autograd.grad(logits[0, -1, 5], p)

        def plain_push(x, hook):
            return x + p * direction

        (expected,) = torch.autograd.grad(hm.run_with_hooks(tokens, fwd_hooks=[(name, plain_push)])[0, -1, 5], p)
        torch.testing.assert_close(grad, expected)
        assert grad != 0
    finally:
        hm.unwrap()


@pytest.mark.parametrize("kind", KINDS)
def test_each_forward_masks_its_own_special_tokens(kind) -> None:
    """A hook that calls the model again does not change which positions of the outer forward are special, and a
    forward given inputs_embeds (no token ids) is refused by name instead of using another forward's tokens."""
    from lensadapters.errors import LensAdaptersError

    hm = build(ARCH)
    name = "blocks.0.hook_resid_pre"
    sae = make_sae(kind, name, hm.cfg.d_model)
    tokens = ids()
    inner = ids(seed=5)
    inner[:, 0] = 7  # no BOS at all in the nested call
    inner[0, 3] = BOS
    try:
        with hm.saes([sae], exclude_special_tokens=[BOS]):
            expected = hm.run_with_hooks(tokens)
            inner_alone = hm.run_with_hooks(inner)
            seen = {}

            def call_again(x, hook):
                seen["inner"] = hm.run_with_hooks(inner)

            nested = hm.run_with_hooks(tokens, fwd_hooks=[("hook_embed", call_again)])
            assert torch.equal(nested, expected)  # the outer BOS positions were left as they were
            assert torch.equal(seen["inner"], inner_alone)  # and the nested forward masked its own
            embeds = hm.hf_model.get_input_embeddings()(tokens).detach()
            with pytest.raises(LensAdaptersError, match="exclude_special_tokens.*inputs_embeds"):
                hm.hf_model(inputs_embeds=embeds)
        assert not hm.has_hooks
        hm.run_with_saes(inputs_embeds=embeds, saes=[sae])  # without the mask, inputs_embeds work
    finally:
        hm.unwrap()


def test_the_special_token_mask_holds_when_gradient_checkpointing_recomputes_the_forward() -> None:
    """The recomputation in backward() runs the splice again after the saes() block ended: it masks the tokens of
    the forward it recomputes, so gradients equal those without checkpointing."""
    model = tiny("llama" if "llama" in ARCH_NAMES else ARCH)
    hm = HookedModel.wrap(model, tokenizer=tokenizer(48))
    name = "blocks.1.hook_resid_pre"
    sae = make_sae("stand-in", name, hm.cfg.d_model)
    tokens = ids()

    def gradient(checkpointing: bool) -> torch.Tensor:
        model.train(checkpointing)
        if checkpointing:
            model.gradient_checkpointing_enable()
        sae.zero_grad()
        hm.run_with_saes(tokens, saes=[sae], exclude_special_tokens=[BOS]).sum().backward()
        return sae.W_enc.grad.clone()

    try:
        torch.testing.assert_close(gradient(True), gradient(False))
        assert not hm.has_hooks
    finally:
        hm.unwrap()


@pytest.mark.parametrize("kind", KINDS)
def test_after_a_nested_block_the_outer_sae_is_back_exactly_where_it_was(kind) -> None:
    """A hook added after an SAE sees the SAE's output; a saes() block at the same point puts its SAE in that place
    and, when it ends, the outer SAE comes back there (with the hooks on its own points); add_sae replacing an SAE
    takes its place too."""
    hm = build(ARCH)
    name = "blocks.0.hook_resid_pre"
    outer, inner = make_sae(kind, name, hm.cfg.d_model, 0), make_sae(kind, name, hm.cfg.d_model, 1)
    tokens = ids()
    seen: list = []
    features: list = []
    try:
        _, plain = hm.run_with_cache(tokens, names_filter=[name])
        by_outer, by_inner = (reconstruct(sae)(plain[name], None).detach() for sae in (outer, inner))
        hm.add_sae(outer)
        hm.add_hook(name, lambda v, hook: seen.append(v.detach().clone()))
        hm.add_hook(f"{name}.hook_sae_acts_post", lambda v, hook: features.append(v.shape), is_permanent=True)
        hm.run_with_hooks(tokens)
        assert torch.equal(seen[-1], by_outer)
        with hm.saes([inner]):
            hm.run_with_hooks(tokens)
            assert torch.equal(seen[-1], by_inner)
            assert len(features) == 1  # the outer SAE's point is away with it
        hm.run_with_hooks(tokens)
        assert torch.equal(seen[-1], by_outer)
        assert len(features) == 2  # ... and back, with its hook
        hm.add_sae(inner)  # replacing: in the outer SAE's place
        hm.run_with_hooks(tokens)
        assert torch.equal(seen[-1], by_inner)
    finally:
        hm.unwrap()


@pytest.mark.parametrize("kind", KINDS)
def test_an_sae_of_the_wrong_size_is_refused_naming_the_point_and_both_sizes(kind) -> None:
    from lensadapters.errors import LensAdaptersError

    hm = build(ARCH)
    d = hm.cfg.d_model
    names = list(hm.hook_names)
    try:
        for name in ("blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.0.mlp.hook_post"):
            with pytest.raises(LensAdaptersError, match=rf"{re.escape(name)}.*d_in={d + 3}.*size"):
                hm.add_sae(make_sae(kind, name, d + 3))
            with pytest.raises(LensAdaptersError, match=rf"d_in={d + 3}"):
                hm.run_with_saes(ids(), saes=[make_sae(kind, name, d + 3)])
            assert hm.hook_names == names and not hm.acts_to_saes and not hm.has_hooks
        # a point whose size only the forward tells (queries: [batch, pos, head, d_head]): refused before the SAE runs
        name = "blocks.0.attn.hook_q"
        with pytest.raises(LensAdaptersError, match=rf"{re.escape(name)}.*d_in={d + 3}.*size {hm.cfg.d_head} or"):
            hm.run_with_saes(ids(), saes=[make_sae(kind, name, d + 3)])
        assert not hm.has_hooks
        hm.run_with_saes(ids(), saes=[make_sae(kind, name, hm.cfg.d_head)])  # per head: the right size
    finally:
        hm.unwrap()
