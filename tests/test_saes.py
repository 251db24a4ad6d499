"""SAEs spliced into a HookedModel: the reconstruction replaces the activation exactly as a hook returning it would,
the error term gives the model's output back while feature edits still reach it, the SAE's hook points are cached
and removed with it, on every installed architecture, LoRA and 8-bit included. Where SAELens is installed (the
transformers-4.57 environment): its SAEs, the same numbers as its HookedSAETransformer, and its training runner
and evals on a HookedModel (from text, and from a harvest as cached activations)."""

from __future__ import annotations

import os
import random
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lensadapters import HookedModel, contract_variants
from lensadapters.saes import SAE_POINTS
from lensadapters.testing.models import int8_copy
from lensadapters.testing.tiny_models import ARCH_NAMES, tiny, tokenizer

try:
    import sae_lens
except ImportError:  # the transformers-5 environment: SAELens needs transformers 4.x
    sae_lens = None

BOS = 1
ARCH = "gpt2" if "gpt2" in ARCH_NAMES else ARCH_NAMES[0]


class StandInSAE(nn.Module):
    """A ReLU SAE with SAELens' interface (``cfg.metadata.hook_name``, ``encode``/``decode``, ``hook_sae_*``
    points, ``use_error_term``), for the environments without SAELens."""

    def __init__(self, hook_name: str, d_in: int, d_sae: int = 24, seed: int = 0, hook_name_out=None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.cfg = SimpleNamespace(metadata=SimpleNamespace(hook_name=hook_name, hook_name_out=hook_name_out))
        self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=g) / d_in**0.5)
        self.b_enc = nn.Parameter(0.1 * torch.randn(d_sae, generator=g))
        self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=g) / d_sae**0.5)
        self.b_dec = nn.Parameter(0.1 * torch.randn(d_in, generator=g))
        for name in SAE_POINTS:
            setattr(self, name, nn.Identity())
        self.use_error_term = False

    @property
    def hook_dict(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in SAE_POINTS}

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.W_enc.dtype)  # as SAELens' process_sae_in
        pre = self.hook_sae_acts_pre(self.hook_sae_input(x) @ self.W_enc + self.b_enc)
        return self.hook_sae_acts_post(torch.relu(pre))

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        return self.hook_sae_recons(features @ self.W_dec + self.b_dec)


def make_sae(kind: str, hook_name: str, d_in: int, seed: int = 0, **cfg) -> nn.Module:
    if kind == "stand-in":
        return StandInSAE(hook_name, d_in, seed=seed)
    if sae_lens is None:
        pytest.skip("sae-lens is not installed (it needs transformers 4.x)")
    from sae_lens.saes.sae import SAEMetadata

    sae = sae_lens.StandardSAE(
        sae_lens.StandardSAEConfig(d_in=d_in, d_sae=24, metadata=SAEMetadata(hook_name=hook_name), **cfg)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return sae


KINDS = ["stand-in", pytest.param("saelens", marks=pytest.mark.skipif(sae_lens is None, reason="no sae-lens"))]


def models() -> list:
    """The architectures, and a LoRA-adapted and an 8-bit model where installed plugins declare those contract
    variants (plugins are discovered, never named)."""
    variants = contract_variants()
    params = list(ARCH_NAMES)
    params.append(pytest.param("lora", marks=pytest.mark.skipif("lora" not in variants, reason="no LoRA plugin")))
    params.append(pytest.param("int8", marks=pytest.mark.skipif("int8" not in variants, reason="no 8-bit plugin")))
    return params


def build(which: str) -> HookedModel:
    if which == "lora":
        from peft import LoraConfig, get_peft_model

        base = tiny("llama" if "llama" in ARCH_NAMES else ARCH)
        torch.manual_seed(1)
        model = get_peft_model(
            base,
            LoraConfig(
                r=4, target_modules=["q_proj", "v_proj"] if "llama" in ARCH_NAMES else None, init_lora_weights=False
            ),
        )
        model.eval()
    elif which == "int8":
        model = int8_copy(tiny("llama" if "llama" in ARCH_NAMES else ARCH))
    else:
        model = tiny(which)
    hm = HookedModel.wrap(model, tokenizer=tokenizer(48))
    return hm


def ids(batch: int = 2, pos: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 48, (batch, pos), generator=g)
    tokens[:, 0] = BOS
    return tokens


def reconstruct(sae: nn.Module):
    return lambda x, hook: sae.decode(sae.encode(x)).to(x.dtype)


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


# --- SAELens itself (the transformers-4.57 environment) ------------------------------------------------------------

needs_saelens = pytest.mark.skipif(sae_lens is None, reason="sae-lens is not installed (it needs transformers 4.x)")


@needs_saelens
@pytest.mark.parametrize("use_error_term", [False, True])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_spliced_saes_match_hooked_sae_transformer(arch, use_error_term, tmp_path) -> None:

    from lensadapters.testing.tiny_models import CLIENT_LLAMA, from_config, gqa_llama, installed
    from lensadapters.testing.tl_reference import ReferenceUnavailable, hooked_transformer, word_tokenizer

    if not installed(arch):
        pytest.skip(f"no plugin for {arch}")
    if arch == "llama":  # grouped-query attention, plain RoPE (what TransformerLens 2.x rotates with)
        model = from_config(gqa_llama(**CLIENT_LLAMA))
    else:
        model = tiny(arch)
    tok = word_tokenizer(model.config.vocab_size)
    try:
        reference = hooked_transformer(model, tokenizer=tok)
    except ReferenceUnavailable as exc:
        pytest.skip(str(exc))
    hst = sae_lens.HookedSAETransformer(reference.cfg, tokenizer=tok, move_to_device=False)
    hst.load_state_dict(reference.state_dict())
    hst.eval()
    hm = HookedModel.wrap(model, tokenizer=tok)
    d_z = hm.cfg.n_heads * hm.cfg.d_head
    saes = [
        make_sae("saelens", "blocks.0.hook_resid_post", hm.cfg.d_model, 0),
        make_sae("saelens", "blocks.1.attn.hook_z", d_z, 1, reshape_activations="hook_z"),
    ]
    tokens = ids()
    try:
        ours = hm.run_with_saes(tokens, saes=saes, use_error_term=use_error_term)
        theirs = hst.run_with_saes(tokens, saes=saes, use_error_term=use_error_term)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        _, cache = hm.run_with_cache_with_saes(tokens, saes=saes, use_error_term=use_error_term)
        _, ref = hst.run_with_cache_with_saes(tokens, saes=saes, use_error_term=use_error_term)
        sae_keys = sorted(k for k in ref.keys() if ".hook_sae_" in k)
        assert sae_keys == sorted(k for k in cache if ".hook_sae_" in k)
        for key in sae_keys:
            torch.testing.assert_close(cache[key], ref[key], atol=1e-4, rtol=1e-4)
        saes[0].save_model(str(tmp_path / "sae"))  # SAELens' saved weights and config load by path
        assert torch.equal(
            hm.run_with_saes(tokens, saes=[str(tmp_path / "sae")]), hm.run_with_saes(tokens, saes=saes[:1])
        )
        torch.testing.assert_close(
            hm.run_with_saes("w3 w4 w5", saes=saes[:1], exclude_special_tokens=True),
            hst.run_with_saes("w3 w4 w5", saes=saes[:1], exclude_special_tokens=True),
            atol=1e-4,
            rtol=1e-4,
        )
    finally:
        hm.unwrap()


def _runner_config(hm: HookedModel, **overrides):
    cfg = dict(
        sae=sae_lens.StandardTrainingSAEConfig(d_in=hm.cfg.d_model, d_sae=32, l1_coefficient=1.0),
        model_name="lensadapters-tiny",
        hook_name="blocks.0.hook_resid_post",
        dataset_path="",
        context_size=12,
        is_dataset_tokenized=False,
        streaming=False,
        training_tokens=12 * 8 * 6,
        store_batch_size_prompts=8,
        n_batches_in_buffer=4,
        train_batch_size_tokens=48,
        device="cpu",
        n_checkpoints=0,
        checkpoint_path=None,
        output_path=None,
        logger=sae_lens.LoggingConfig(log_to_wandb=False),
        verbose=False,
        lr=1e-2,
        n_batches_for_norm_estimate=2,
        n_eval_batches=2,
        eval_batch_size_prompts=4,
    )
    cfg.update(overrides)
    return sae_lens.LanguageModelSAERunnerConfig(**cfg)


def _texts(n: int = 120) -> list[str]:
    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(3, 48)}" for _ in range(rng.randrange(4, 40))) for _ in range(n)]


@needs_saelens
def test_saelens_trains_and_evaluates_an_sae_on_a_hooked_model(monkeypatch) -> None:
    import datasets
    from sae_lens.evals import EvalConfig, run_evals
    from sae_lens.training.activation_scaler import ActivationScaler

    monkeypatch.setenv("WANDB_MODE", "disabled")
    hm = build(ARCH)
    stops = []
    run_with_cache = hm.run_with_cache

    def recording(*args, **kwargs):
        stops.append(kwargs.get("stop_at_layer"))
        return run_with_cache(*args, **kwargs)

    monkeypatch.setattr(hm, "run_with_cache", recording)
    try:
        runner = sae_lens.LanguageModelSAETrainingRunner(
            _runner_config(hm), override_dataset=datasets.Dataset.from_dict({"text": _texts()}), override_model=hm
        )
        before = {k: v.clone() for k, v in runner.sae.state_dict().items()}
        sae = runner.run()
        assert all(not torch.equal(v, before[k]) for k, v in sae.state_dict().items())  # every parameter trained
        assert stops and set(stops) == {1}  # activations from block 0 only
        metrics, _ = run_evals(
            sae,
            runner.activations_store,
            hm,
            ActivationScaler(),
            EvalConfig(
                batch_size_prompts=4,
                n_eval_reconstruction_batches=2,
                compute_kl=True,
                compute_ce_loss=True,
                n_eval_sparsity_variance_batches=2,
                compute_variance_metrics=True,
                compute_sparsity_metrics=True,
            ),
        )
        ce = metrics["model_performance_preservation"]
        assert all(torch.isfinite(torch.tensor(float(v))) for v in ce.values())
        assert ce["ce_loss_with_sae"] != ce["ce_loss_without_sae"] != ce["ce_loss_with_ablation"]
        assert 0 < metrics["sparsity"]["l0"] <= 32
    finally:
        hm.unwrap()


@needs_saelens
def test_saelens_trains_from_a_harvest_as_cached_activations(tmp_path, monkeypatch) -> None:
    import datasets

    from lensadapters import harvest

    monkeypatch.setenv("WANDB_MODE", "disabled")
    hm = build(ARCH)
    (tmp_path / "data.txt").write_text("\n".join(_texts()) + "\n")
    try:
        harvest(
            hm,
            str(tmp_path / "data.txt"),
            ["blocks.0.hook_resid_post"],
            str(tmp_path / "acts"),
            context_size=12,
            batch_size=4,
            progress=False,
        )
        n_rows = len(datasets.load_from_disk(str(tmp_path / "acts")))
        cfg = _runner_config(
            hm,
            use_cached_activations=True,
            cached_activations_path=str(tmp_path / "acts"),
            training_tokens=12 * n_rows // 2,
        )
        runner = sae_lens.LanguageModelSAETrainingRunner(
            cfg, override_dataset=datasets.Dataset.from_dict({"text": _texts()}), override_model=hm
        )
        before = {k: v.clone() for k, v in runner.sae.state_dict().items()}
        cached = runner.activations_store.cached_activation_dataset
        assert cached is not None and len(cached) == n_rows
        sae = runner.run()
        assert all(not torch.equal(v, before[k]) for k, v in sae.state_dict().items())
    finally:
        hm.unwrap()
    assert os.path.exists(tmp_path / "acts" / "manifest.json")


@needs_saelens
def test_a_harvest_holds_what_saelens_activation_store_computes(tmp_path) -> None:
    import datasets

    from lensadapters import harvest
    from lensadapters.testing.sae_clients import small_activations_store

    hm = build(ARCH)
    texts = _texts()
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "texts"))
    name = "blocks.1.hook_resid_pre"
    try:
        harvest(
            hm, str(tmp_path / "texts"), [name], str(tmp_path / "acts"), context_size=12, batch_size=4, progress=False
        )
        store = small_activations_store(hm, datasets.load_from_disk(str(tmp_path / "texts")), name, hm.cfg.d_model)
        ours = datasets.load_from_disk(str(tmp_path / "acts")).with_format("torch")[:]
        for first in range(0, len(ours["token_ids"]) - 3, 4):
            tokens = store.get_batch_tokens(4)
            assert torch.equal(tokens, ours["token_ids"][first : first + 4].long())
            assert torch.equal(store.get_activations(tokens), ours[name][first : first + 4])
    finally:
        hm.unwrap()
