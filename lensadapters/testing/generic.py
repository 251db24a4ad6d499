"""The generic adapter's contract: its properties on one architecture that no plugin describes.

Subclass :class:`GenericContract` per architecture with a strategy of tiny configs and the points the generic
adapter is expected to find there (declared, so that an identification that silently fails, and leaves a point out,
fails a test instead of shrinking what the other properties check)::

    class TestFalcon(GenericContract):
        branches, attention_function, patterns, final_norm = True, False, False, True

        @classmethod
        def configs(cls):
            return st.builds(FalconConfig, ...)

The models are wrapped through a registry without architecture plugins, so the generic adapter serves them
whatever is installed (``tests/`` check separately that a model type a plugin claims is never handled generically).
Each property runs ``examples`` examples (a quarter of the Hypothesis profile's, at least two): the suite runs on
many architectures and each of them costs one probe forward per wrap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lensadapters.adapters.generic import GenericAdapterWarning
from lensadapters.adapters.registry import Registry
from lensadapters.api.hooked_model import HookedModel
from lensadapters.errors import WeightUnavailableError
from lensadapters.hooks.specs import FusedGateUp, MLPLayout
from lensadapters.testing.contract_support import (
    _hook_counts,
    _instance_attributes,
    assert_close,
    assert_unchanged_by_caching,
    check_edited_generation,
    close,
    perturb,
    perturbed_logits,
)
from lensadapters.testing.gradients import GradientContract
from lensadapters.testing.models import reinit
from lensadapters.testing.strategies import Inputs, token_inputs
from lensadapters.wiring.weights import mlp_weights

BRANCHES = ("hook_attn_out", "hook_mlp_out")
PATTERNS = ("attn.hook_attn_scores", "attn.hook_pattern")
_EXAMPLES = max(2, (settings.default.max_examples or 4) // 4)
_SETTINGS = settings(
    max_examples=_EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.differing_executors,
        HealthCheck.filter_too_much,
    ],
)


#: points that only the queries read: a change at a row's first real token (which attends to itself alone) is unused
QUERY_SIDE = ("attn.hook_q", "attn.hook_rot_q", "hook_q_input")


def _real(t: torch.Tensor, name: str, valid: torch.Tensor) -> torch.Tensor:
    """A point's values at real tokens (query rows of scores and patterns)."""
    return t.transpose(1, 2)[valid] if name.endswith(PATTERNS) else t[valid]


@dataclass(frozen=True)
class GenericPoints:
    """Which points every block of a model gets from the generic adapter (``None``: not checked)."""

    branches: Optional[bool] = None  # hook_attn_out and hook_mlp_out
    attention_function: Optional[bool] = None  # attn.hook_z
    patterns: Optional[bool] = None  # attn.hook_attn_scores and attn.hook_pattern
    final_norm: Optional[bool] = None  # ln_final.hook_normalized


def check_described_weights(hm: HookedModel, inputs: Inputs) -> None:
    """A described model: the canonical points of every block, and the weights reproducing the projections' outputs
    (``hook_q == input @ W_Q + b_Q`` per head, ``W_K``/``W_V`` with their key/value heads, ``hook_z @ W_O + b_O`` the
    attention output, ``W_in``/``W_gate`` the MLP's pre-activations, ``hook_post @ W_out + b_out`` its output), the
    projections' inputs read by plain PyTorch hooks."""
    names = set(hm.hook_names)
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for i, (block, qkv, mlp) in enumerate(zip(hm.block_modules, hm.qkv_layouts, hm.mlp_layouts)):
        for n in ("hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z", "hook_resid_post"):
            assert f"blocks.{i}.{n}" in names, f"blocks.{i}.{n} not served: {sorted(names)}"
        module = block.get_submodule(getattr(qkv, "q", None) or qkv.module)
        handles.append(module.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(f"q{i}", a[0])))
        if isinstance(mlp, (MLPLayout, FusedGateUp)):  # a dense MLP (a mixture of experts has no mlp.hook_pre)
            first = block.get_submodule(mlp.pre if isinstance(mlp, MLPLayout) else mlp.module)
            handles.append(first.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(f"mlp{i}", a[0])))
    try:
        with torch.no_grad():
            _, cache = hm.run_with_cache(**inputs.kwargs())
    finally:
        for handle in handles:
            handle.remove()
    for i, bl in enumerate(hm.block_layouts):
        x, pre = seen[f"q{i}"], f"blocks.{i}."
        for w, b, point in (
            ("W_Q", "b_Q", "attn.hook_q"),
            ("_W_K", "_b_K", "attn.hook_k"),
            ("_W_V", "_b_V", "attn.hook_v"),
        ):
            got = torch.einsum("bpd,hde->bphe", x, getattr(hm, w)[i]) + getattr(hm, b)[i]
            assert_close(got, cache[pre + point], f"layer {i}: input @ {w} + {b} vs {point}")
        if bl.ln1_post is None:
            out = torch.einsum("bphe,hed->bpd", cache[pre + "attn.hook_z"], hm.W_O[i]) + hm.b_O[i]
            assert_close(out, cache[pre + "hook_attn_out"], f"layer {i}: hook_z @ W_O + b_O vs hook_attn_out")
        if pre + "mlp.hook_pre" in cache:
            m = seen[f"mlp{i}"]
            gated = pre + "mlp.hook_pre_linear" in cache
            # one layer's weights (a model mixing dense and MoE layers has no stacked W_in)
            (w_in, b_in), (w_out, b_out) = (mlp_weights(hm.wiring, i, role) for role in ("in", "out"))
            w_pre, b_pre = mlp_weights(hm.wiring, i, "gate") if gated else (w_in, b_in)
            assert_close(m @ w_pre + b_pre, cache[pre + "mlp.hook_pre"], f"layer {i}: W_gate/W_in")
            if gated:
                assert_close(m @ w_in + b_in, cache[pre + "mlp.hook_pre_linear"], f"layer {i}: W_in")
            if bl.ln2_post is None:
                out = cache[pre + "mlp.hook_post"] @ w_out + b_out
                assert_close(out, cache[pre + "hook_mlp_out"], f"layer {i}: hook_post @ W_out + b_out vs hook_mlp_out")


class GenericContract(GradientContract):
    """Properties of the generic adapter on one architecture (see the module docstring)."""

    attn_implementations: ClassVar[Sequence[str]] = ("sdpa", "eager")
    branches: ClassVar[Optional[bool]] = None
    attention_function: ClassVar[Optional[bool]] = None
    patterns: ClassVar[Optional[bool]] = None
    final_norm: ClassVar[Optional[bool]] = None
    #: whether the automatic description serves every block (its queries, keys, values, norm scales, MLP
    #: activations and weights, each verified at wrap time); ``None``: not checked
    described: ClassVar[Optional[bool]] = None
    max_batch: ClassVar[int] = 2
    max_len: ClassVar[int] = 7

    # --- what a test class provides ----------------------------------------------------------------

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        raise NotImplementedError("GenericContract subclasses return a strategy of tiny configs from configs()")

    def expected(self, config: Any) -> GenericPoints:
        """The points declared for ``config``: the class attributes (override when the config decides)."""
        return GenericPoints(self.branches, self.attention_function, self.patterns, self.final_norm)

    # --- machinery ---------------------------------------------------------------------------------

    def make_model(self, config: Any, seed: int, attn_implementation: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        reinit(model, seed)
        return model.eval()

    def wrap(self, model: torch.nn.Module) -> HookedModel:
        with pytest.warns(GenericAdapterWarning):
            return HookedModel.wrap(model, registry=Registry())

    def draw(
        self, data: st.DataObject, attn_implementation: Optional[str] = None, left_padding: bool = True
    ) -> tuple[Any, torch.nn.Module, Inputs]:
        config = data.draw(self.configs(), label="config")
        seed = data.draw(st.integers(0, 2**16), label="seed")
        model = self.make_model(config, seed, attn_implementation or self.attn_implementations[0])
        vocab = model.get_input_embeddings().weight.shape[0]
        inputs = data.draw(token_inputs(vocab, self.max_batch, 2, self.max_len, left_padding), label="inputs")
        return config, model, inputs

    @staticmethod
    def other_inputs(inputs: Inputs, vocab: int, seed: int) -> dict:
        """Other tokens with the same shape and mask (positions, padding, masks stay the same)."""
        ids = torch.randint(0, vocab, inputs.input_ids.shape, generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "attention_mask": inputs.attention_mask}

    @staticmethod
    def final_output(hm: HookedModel, normalized: torch.Tensor) -> torch.Tensor:
        """The final norm's output from ``ln_final.hook_normalized`` (an RMSNorm's weight applied)."""
        if hm.cfg.normalization_type != "RMS":
            return normalized
        spec = hm.norm_spec(hm.norm_module("ln_final"))
        return normalized * (spec.weight + spec.weight_offset) if spec.weight is not None else normalized

    # --- the points, the warning, the weights --------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_points_weights_and_warning_are_as_declared(self, data: st.DataObject) -> None:
        config, model, inputs = self.draw(data)
        expected = self.expected(config)
        with pytest.warns(GenericAdapterWarning) as warned:
            hm = HookedModel.wrap(model, registry=Registry())
        message = str(warned[0].message)
        assert repr(config.model_type) in message and "docs/writing-a-plugin.md" in message, message
        assert hm.arch.name == "generic" and hm.cfg.n_layers == config.num_hidden_layers
        names = hm.hook_names
        assert names[0] == "hook_embed" and len(set(names)) == len(names)
        for i in range(hm.cfg.n_layers):
            block = [n[len(f"blocks.{i}.") :] for n in names if n.startswith(f"blocks.{i}.")]
            assert block[0] == "hook_resid_pre" and block[-1] == "hook_resid_post", block
            for flag, points in (
                (expected.branches, BRANCHES),
                (expected.attention_function, ("attn.hook_z",)),
                (expected.patterns, PATTERNS),
            ):
                if flag is not None:
                    assert all((p in block) == flag for p in points), f"layer {i}: expected {points} {flag}: {block}"
        if expected.final_norm is not None:
            assert ("ln_final.hook_normalized" in names) == expected.final_norm
        described = all(layout is not None for layout in hm.block_layouts)
        if self.described is not None:
            assert described == self.described, f"described: {described}, declared {self.described}: {message}"
        if described:
            check_described_weights(hm, inputs)
            hm.unwrap()
            return
        assert not any(
            n.endswith(
                (
                    "hook_scale",
                    "hook_q",
                    "hook_k",
                    "hook_v",
                    "hook_result",
                    "hook_resid_mid",
                    "mlp.hook_pre",
                    "mlp.hook_post",
                )
            )
            for n in names
        )
        for absent in ("ln_final.hook_normalized", "attn.hook_z", "hook_attn_out"):
            if not any(n.endswith(absent) for n in names):
                assert absent.split(".")[-1] in message, f"the warning does not say why {absent} is absent"
        head = model.get_output_embeddings()
        final: list[torch.Tensor] = []
        handle = head.register_forward_pre_hook(lambda m, args: final.append(args[0])) if head is not None else None
        try:
            with torch.no_grad():
                logits, cache = hm.run_with_cache(**inputs.kwargs(), names_filter="hook_embed")
        finally:
            if handle is not None:
                handle.remove()
        # W_E's rows are hook_embed (the embeddings as the model uses them: Granite's multiplier included)
        assert torch.equal(hm.W_E[inputs.input_ids], cache["hook_embed"]), "W_E[ids] != hook_embed"
        if head is not None:  # final @ W_U is the logits (logit scaling included), up to the bias b_U (not served)
            h, out = final[0], logits.float()
            assert_close(
                (h[:, 1:] - h[:, :-1]).float() @ hm.W_U.float(), out[:, 1:] - out[:, :-1], "final @ W_U vs logits"
            )
        for name in ("W_Q", "W_K", "W_O", "W_in", "W_out", "W_pos", "b_U"):
            with pytest.raises(WeightUnavailableError, match="writing-a-plugin"):
                getattr(hm, name)
        hm.unwrap()

    # --- the model as it was ----------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_no_hooks_is_bitwise_and_wrapping_leaves_no_trace(self, data: st.DataObject) -> None:
        impl = data.draw(st.sampled_from(list(self.attn_implementations)), label="attn_implementation")
        _, model, inputs = self.draw(data, impl)
        impl = model.config._attn_implementation
        with torch.no_grad():
            reference = model(**inputs.kwargs()).logits
        model.train()  # the probe runs in eval mode and puts every module back as it was
        rng, hooks = torch.get_rng_state(), _hook_counts(model)
        hm = self.wrap(model)
        assert torch.equal(torch.get_rng_state(), rng), "wrapping changed the random state"
        assert all(m.training for m in model.modules()) and _hook_counts(model) == hooks
        assert model.config._attn_implementation == impl
        model.eval()
        assert_unchanged_by_caching(hm, inputs, reference)
        assert model.config._attn_implementation == impl
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_identity_hooks_fire_in_order_and_keep_logits(self, data: st.DataObject) -> None:
        _, model, inputs = self.draw(data)
        hm = self.wrap(model)
        calls: list[str] = []

        def copy(t: torch.Tensor, hook: Any) -> torch.Tensor:
            calls.append(hook.name)
            return t.clone()

        with torch.no_grad():
            reference = model(**inputs.kwargs()).logits
            logits = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(lambda n: True, copy)])
        assert calls == hm.hook_names, "hook points must fire once each, in the order of hook_names"
        assert_close(logits[inputs.valid], reference[inputs.valid], "identity hooks")
        hm.unwrap()

    # --- values ------------------------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_residual_points_are_the_hidden_states(self, data: st.DataObject) -> None:
        """``resid_pre``/``resid_post`` are HF's ``output_hidden_states``, the final norm's output is what the
        unembedding reads, and where attention and MLP outputs are served the residual stream is their sum."""
        _, model, inputs = self.draw(data)
        hm = self.wrap(model)
        v, n = inputs.valid, hm.cfg.n_layers
        unembedded: list[torch.Tensor] = []
        head = model.get_output_embeddings()
        with torch.no_grad():
            hidden = model(**inputs.kwargs(), output_hidden_states=True).hidden_states
            handle = head.register_forward_pre_hook(lambda m, args: unembedded.append(args[0])) if head else None
            try:
                _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=lambda name: not name.endswith(PATTERNS))
            finally:
                if handle is not None:
                    handle.remove()
        for i in range(n):
            assert_close(cache["resid_pre", i][v], hidden[i][v], f"blocks.{i}.hook_resid_pre == hidden_states[{i}]")
            if i + 1 < n:
                assert_close(cache["resid_post", i][v], hidden[i + 1][v], f"blocks.{i}.hook_resid_post")
            if f"blocks.{i}.hook_attn_out" in cache:
                assert_close(
                    cache["resid_post", i],
                    cache["resid_pre", i] + cache["attn_out", i] + cache["mlp_out", i],
                    f"layer {i}: resid_post == resid_pre + attn_out + mlp_out",
                )
        if "ln_final.hook_normalized" in cache and unembedded:
            final = self.final_output(hm, cache["ln_final.hook_normalized"])
            assert_close(final[v], unembedded[0][v], "the final norm's output is what the unembedding reads")
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_patterns_match_hf_eager(self, data: st.DataObject) -> None:
        if self.patterns is False:
            pytest.skip("this architecture gets no attention patterns")
        impl = data.draw(st.sampled_from(list(self.attn_implementations)), label="attn_implementation")
        _, model, inputs = self.draw(data, impl)
        hm = self.wrap(model)
        assume(any(n.endswith("attn.hook_pattern") for n in hm.hook_names))
        impl = model.config._attn_implementation
        with torch.no_grad():
            model.config._attn_implementation = "eager"
            reference = model(**inputs.kwargs(), output_attentions=True).attentions
            model.config._attn_implementation = impl
            _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=lambda n: n.endswith("hook_pattern"))
        rows = inputs.valid[:, None, :, None]
        for i in range(hm.cfg.n_layers):
            name = f"blocks.{i}.attn.hook_pattern"
            if name in cache:
                pattern = cache[name]
                keep = rows.expand_as(pattern)
                assert_close(pattern[keep], reference[i][keep], f"layer {i} pattern vs HF eager")
                # a padded query's row is what the implementation gives an empty row; a real query's ignores padding
                pad_keys = (rows & (~inputs.valid)[:, None, None, :]).expand_as(pattern)
                assert (pattern[pad_keys] == 0).all(), "pattern attends to padding"
        hm.unwrap()

    # --- edits -------------------------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_every_point_edit_changes_the_logits(self, data: st.DataObject) -> None:
        _, model, inputs = self.draw(data)
        hm = self.wrap(model)
        v = inputs.valid
        with torch.no_grad():
            reference = hm(**inputs.kwargs()).logits
            for name in hm.hook_names:
                logits = perturbed_logits(hm, inputs, name)
                if name.endswith("attn.hook_attn_scores") and close(logits[v], reference[v], atol=1e-5, rtol=0):
                    # a saturated softmax can absorb a rescaled score: the pattern must still show the edit
                    pattern = name.replace("hook_attn_scores", "hook_pattern")
                    _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=pattern)
                    with hm.hooks([(name, perturb)]):
                        _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=pattern)
                    assert not torch.equal(edited[pattern], base[pattern]), f"editing {name} changed no pattern"
                    continue
                assert not close(logits[v], reference[v], atol=1e-5, rtol=0), f"editing {name} left the logits alone"
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_patching_a_point_from_other_tokens_acts_as_computed(self, data: st.DataObject) -> None:
        """Replacing a point's value with its value on other tokens (activation patching) does what the model
        would do with that value: the residual points and the final norm then give the other tokens' logits; an
        attention or MLP output enters the residual stream as is; hook_z determines the attention output and the
        scores the pattern."""
        _, model, inputs = self.draw(data)
        hm = self.wrap(model)
        name = data.draw(st.sampled_from(hm.hook_names), label="point")
        v = inputs.valid
        other = self.other_inputs(inputs, hm.W_E.shape[0], data.draw(st.integers(0, 2**16), label="other"))
        block, short = (name.split(".", 2)[:2], name.split(".", 2)[2]) if name.startswith("blocks.") else (None, name)
        pre = ".".join(block) + "." if block else ""
        watch = [n for n in hm.hook_names if block and n.startswith(pre)] or [name]
        with torch.no_grad():
            reference, mine = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
            theirs, their_cache = hm.run_with_cache(**other, names_filter=watch)
            patched = their_cache[name]
            with hm.hooks([(name, lambda t, hook: patched)]):
                logits, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
        assert torch.equal(cache[name], patched)
        if short in ("hook_embed", "hook_resid_pre", "hook_resid_post", "ln_final.hook_normalized"):
            assert_close(logits[v], theirs[v], f"patching {name} gives the other tokens' logits")
        elif short in BRANCHES:
            assert_close(
                cache[pre + "hook_resid_post"],
                cache[pre + "hook_resid_pre"] + cache[pre + "hook_attn_out"] + cache[pre + "hook_mlp_out"],
                f"patched {name} enters the residual stream",
            )
        elif short == "attn.hook_z" and pre + "hook_attn_out" in watch:
            assert_close(
                cache[pre + "hook_attn_out"][v],
                their_cache[pre + "hook_attn_out"][v],
                f"patching {name} gives the other tokens' attention output",
            )
        elif short == "attn.hook_attn_scores":
            pattern = pre + "attn.hook_pattern"
            assert_close(
                _real(cache[pattern], pattern, v),
                _real(their_cache[pattern], pattern, v),
                f"patching {name} gives the other tokens' pattern",
            )
        # a row's first real token attends to itself alone: its query changes nothing (the other tokens may share
        # every later token with these, so only the first differs)
        moved = v & ~(v & (v.cumsum(1) == 1)) if short in QUERY_SIDE else v
        if not close(_real(patched, name, moved), _real(mine[name], name, moved), atol=1e-4, rtol=0):
            assert not close(logits[v], reference[v], atol=1e-6, rtol=0), f"patching {name} left the logits alone"
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_attention_edits_are_used(self, data: st.DataObject) -> None:
        """Uniform scores give a uniform pattern; a pattern that attends only to the first real token makes every
        position's ``hook_z`` that token's; zeroing ``hook_z`` leaves only the output projection's bias."""
        if self.attention_function is False:
            pytest.skip("this architecture does not call the attention interface")
        _, model, inputs = self.draw(data)
        hm = self.wrap(model)
        layers = [i for i in range(hm.cfg.n_layers) if f"blocks.{i}.attn.hook_z" in hm.hook_names]
        assume(layers)
        i = data.draw(st.sampled_from(layers), label="layer")
        pre, v = f"blocks.{i}.", inputs.valid
        names = [n for n in hm.hook_names if n.startswith(pre)]
        first = torch.tensor(inputs.pad)  # each row's first real token
        with torch.no_grad():
            reference = hm(**inputs.kwargs()).logits
            if pre + "attn.hook_pattern" in names:

                def uniform(s: torch.Tensor, hook: Any) -> torch.Tensor:
                    return torch.where(torch.isfinite(s), torch.zeros_like(s), s)

                with hm.hooks([(pre + "attn.hook_attn_scores", uniform)]):
                    _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
                pattern = cache[pre + "attn.hook_pattern"]
                allowed = (pattern > 0).sum(-1, keepdim=True)
                assert_close(
                    pattern[v[:, None, :, None].expand_as(pattern)],
                    (pattern > 0).float().div(allowed)[v[:, None, :, None].expand_as(pattern)],
                    "uniform scores give a uniform pattern",
                )

                def one_hot(p: torch.Tensor, hook: Any) -> torch.Tensor:
                    out = torch.zeros_like(p)
                    out[torch.arange(p.shape[0]), ..., first] = 1.0
                    return out

                with hm.hooks([(pre + "attn.hook_pattern", one_hot)]):
                    _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
                z = cache[pre + "attn.hook_z"]
                for b in range(z.shape[0]):
                    rows = z[b, inputs.valid[b]]
                    assert_close(rows, rows[:1].expand_as(rows), "every position mixes the first token's value")
            with hm.hooks([(pre + "attn.hook_z", lambda z, hook: torch.zeros_like(z))]):
                logits, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
            if pre + "hook_attn_out" in names:
                out = cache[pre + "hook_attn_out"][v]
                assert_close(out, out[:1].expand_as(out), "attn_out with zero z is the same at every position")
            assert not close(logits[v], reference[v], atol=1e-6, rtol=0), "zeroing hook_z left the logits alone"
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_in_place_edits_equal_returned_edits(self, data: st.DataObject) -> None:
        _, model, inputs = self.draw(data)
        hm = self.wrap(model)
        name = data.draw(st.sampled_from(hm.hook_names), label="point")

        def in_place(t: torch.Tensor, hook: Any) -> None:
            t.mul_(1.5)

        with torch.no_grad():
            returned = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(name, lambda t, hook: t * 1.5)])
            edited = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(name, in_place)])
        assert_close(edited[inputs.valid], returned[inputs.valid], f"{name}: an in-place edit is the returned edit")
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_edits_during_generation_match_one_pass(self, data: st.DataObject) -> None:
        config, model, inputs = self.draw(data, left_padding=False)
        hm = self.wrap(model)
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
        options = [
            n
            for n in hm.hook_names
            if n.startswith(f"blocks.{layer}.")
            and n.endswith(("hook_resid_post", "attn.hook_z", "attn.hook_pattern", "hook_mlp_out"))
        ]
        point = data.draw(st.sampled_from(options), label="point")
        check_edited_generation(hm, inputs, point, lambda t, hook: t * 1.5, lambda logits: 1e-3)
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_unwrap_and_exceptions_leave_nothing(self, data: st.DataObject) -> None:
        _, model, inputs = self.draw(data)
        state = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
        hooks, impl = _hook_counts(model), model.config._attn_implementation
        with torch.no_grad():
            reference = model(**inputs.kwargs()).logits
            attributes = _instance_attributes(model)
            hm = self.wrap(model)
            last = hm.hook_names[-2]  # inside the last block: every earlier site is installed when it raises

            def boom(t: torch.Tensor, hook: Any) -> None:
                raise RuntimeError("user hook failed")

            with pytest.raises(RuntimeError, match="user hook failed"):
                hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(lambda n: True, perturb), (last, boom)])
            assert _hook_counts(model) == hooks and _instance_attributes(model) == attributes
            assert model.config._attn_implementation == impl
            hm.add_hook(lambda n: True, lambda t, hook: t.clone(), is_permanent=True)
            hm(**inputs.kwargs())
            assert hm.unwrap() is model
            assert _hook_counts(model) == hooks and _instance_attributes(model) == attributes
            assert model.config._attn_implementation == impl
            assert torch.equal(model(**inputs.kwargs()).logits, reference)
        for k, value in model.state_dict().items():
            assert value.data_ptr() == state[k][0] and torch.equal(value, state[k][1]), k
