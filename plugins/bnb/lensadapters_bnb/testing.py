"""The contract suite on 8-bit models, for any architecture plugin (needs ``lensadapters[testing]``).

A plugin author opts in with one line, next to the plugin's own contract class::

    from lensadapters_bnb.testing import Int8Contract
    from lensadapters_myarch.contract import MyArchContract

    class TestMyArchInt8(Int8Contract, MyArchContract):
        '''Every contract property with the model loaded in 8-bit (LLM.int8) on the CPU.'''

Each drawn model is built in float32 from the plugin's ``configs()`` exactly as
:class:`~lensadapters.testing.AdapterContract` builds it, saved with ``save_pretrained`` and loaded back
with ``BitsAndBytesConfig(load_in_8bit=True)`` on the CPU; lensadapters-bnb is registered next to the
plugin. The TransformerLens identities and the head-ablation property are checked against
:func:`lensadapters_bnb.matmul_error_bound` (the elementwise error of the quantized matmul) instead of a
fixed float tolerance. ``lensadapters check PLUGIN --int8`` runs the same class.

Helpers for other tests: :func:`quantize`, :func:`quantized_twins`, :func:`check_identities`,
:func:`projection`, :func:`assert_within_bound`.
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any, Mapping, Optional

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import lensadapters_bnb as lb
from lensadapters import HookedModel
from lensadapters.specs import FusedGateUp, FusedQKV
from lensadapters.testing import (
    AdapterContract,
    assert_close,
    block_inputs,
    norm_out,
    registry_with,
    seeded_model,
    served_weights,
)
from lensadapters.testing.moe import MoEContract
from lensadapters.testing.strategies import Inputs
from lensadapters.weights import read_linear

__all__ = [
    "Int8Contract",
    "quantize",
    "quantized_twins",
    "quantized_linears",
    "wrap_quantized",
    "float_weight",
    "check_identities",
    "projection",
    "assert_within_bound",
    "FLOAT_AGREEMENT_PER_BLOCK",
    "RELOAD_SETTINGS",
]

#: the settings of the plugin's own tests, each of whose examples saves and reloads a model: few examples (each
#: contract subclass runs the inherited tests)
RELOAD_SETTINGS = settings(
    deadline=None, max_examples=3, suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors]
)

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to float16" on every call

# every example saves and reloads a model: at most 3 examples for the properties this module redefines
# (the profile's count when it asks for fewer, e.g. ``lensadapters check --examples 2``)
_SETTINGS = settings(
    deadline=None,
    max_examples=min(3, settings.default.max_examples),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors, HealthCheck.data_too_large],
)


def quantize(
    model: nn.Module, mode: str = "int8", dtype: torch.dtype = torch.float32, threshold: float = 6.0
) -> nn.Module:
    """Save ``model`` and load it back quantized on the CPU (``mode``: ``int8``, ``nf4`` or ``fp4``).

    ``threshold`` is LLM.int8's outlier threshold (``llm_int8_threshold``, 6.0 by default).
    """
    import transformers
    from transformers import BitsAndBytesConfig

    if mode == "int8":
        qc = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold)
    else:
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=mode, bnb_4bit_compute_dtype=dtype)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with tempfile.TemporaryDirectory() as directory:
            model.save_pretrained(directory)
            quantized = type(model).from_pretrained(  # its own class: a causal LM, or an encoder's masked LM
                directory,
                quantization_config=qc,
                device_map="cpu",
                dtype=dtype,
                attn_implementation=model.config._attn_implementation,
            )
    finally:
        transformers.logging.set_verbosity(verbosity)
    return quantized.eval()


#: normwise relative agreement per block of quantized projections between 8-bit and float hook values.
#: Empirical, not a bound: one int8 matmul moves its output by about 1 % of its norm (it rounds both its
#: weight rows and its input rows to 1/127 of their absmax), but a hook whose value is small next to its
#: inputs (cancellation, e.g. a tiny Llama's gate) moves more: over 100 random tiny models the largest
#: difference per block was 3.3 % (GPT-2, GPT-NeoX, OPT) and 12 % (Llama). A wrong layout, dtype or
#: split gives differences of order 100 %; the exact properties are checked against the int8 bound.
FLOAT_AGREEMENT_PER_BLOCK = 0.25


def quantized_twins(
    data: st.DataObject, contract: type, mode: str = "int8", dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A seeded float32 model of a config ``contract`` draws, its quantized twin (``mode``: int8, nf4, fp4) and
    unpadded token ids.

    The config comes from the contract's ``config_strategy`` with its ``matrix_overrides`` (every example builds
    two models) and, for the 4-bit modes, its ``aligned_overrides`` on top (bitsandbytes' CPU 4-bit kernel needs
    input widths divisible by its block size, 64, and output widths by 32).
    """
    overrides = {**contract.config_overrides, **contract.matrix_overrides}
    if mode != "int8":
        overrides.update(contract.aligned_overrides or {})
    config = data.draw(contract.config_strategy(**overrides), label="config")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    fp = seeded_model(config, seed, "eager")
    ids = torch.randint(
        3,
        config.vocab_size,
        (2, data.draw(st.integers(2, 8), label="length")),
        generator=torch.Generator().manual_seed(seed),
    )
    return fp, quantize(fp, mode, dtype), ids


def quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    """``{qualified name: layer}`` of the bitsandbytes linear layers of ``model``."""
    return {n: m for n, m in model.named_modules() if lb.is_quantized_linear(m)}


def wrap_quantized(model: nn.Module, contract: type) -> HookedModel:
    """``model`` (quantized or its float twin) wrapped with ``contract``'s plugin and lensadapters-bnb."""
    return HookedModel.wrap(model, registry=registry_with(contract.plugin, lb))


def float_weight(module: nn.Module) -> torch.Tensor:
    """``[d_in, d_out]`` of a float ``nn.Linear`` or transformers ``Conv1D`` (what a quantized twin rounds)."""
    return module.weight.T if isinstance(module, nn.Linear) else module.weight


def assert_within_bound(
    actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str, valid: Optional[torch.Tensor] = None
) -> float:
    """``|actual - expected| <= bound`` elementwise (at valid positions); returns the largest ratio."""
    diff = (actual.float() - expected.float()).abs()
    if valid is not None:
        diff, bound = diff[valid], bound[valid]
    ratio = (diff / bound.clamp_min(1e-30)).max().item() if diff.numel() else 0.0
    excess = (diff - bound).max().item() if diff.numel() else 0.0
    assert excess <= 1e-6, f"{what}: exceeds the quantization bound (max |diff| / bound = {ratio:.3g})"
    return ratio


def projection(hm: HookedModel, x: torch.Tensor, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ W + b, bound)`` for ``module`` as lensadapters reads it, both ``[..., d_out]`` in float32."""
    lw = read_linear(hm, module)
    expected = x.float() @ lw.W.float() + (lw.b.float() if lw.b is not None else 0.0)
    return expected, lb.matmul_error_bound(module, x, lw.W, lw.b)


def _attention_identities(hm: HookedModel, cache: Any, valid: torch.Tensor, inputs: Any, weights: dict) -> float:
    """``check_identities``' attention part for one block (``inputs``), with the stacked weights ``weights``."""
    cfg, i, attn_in, worst = hm.cfg, inputs.layer, inputs.attn_in, 0.0
    block, layout, qkv = hm.block_modules[i], hm.block_layouts[i], hm.qkv_layouts[i]
    W = {
        "q": (weights["W_Q"], weights["b_Q"]),
        "k": (weights["_W_K"], weights["_b_K"]),
        "v": (weights["_W_V"], weights["_b_V"]),
    }
    W_O, b_O = weights["W_O"], weights["b_O"]
    if isinstance(qkv, FusedQKV):
        _, fused_bound = projection(hm, attn_in, block.get_submodule(qkv.module))
        bounds = qkv.split(fused_bound)
    else:
        bounds = [
            projection(hm, attn_in, block.get_submodule(p))[1].unflatten(-1, (-1, cfg.d_head))
            for p in (qkv.q, qkv.k, qkv.v)
        ]
    for index, name in enumerate("qkv"):
        Wt, bt = W[name]
        expected = torch.einsum("bpm,hmd->bphd", attn_in.float(), Wt[i].float()) + bt[i].float()
        worst = max(
            worst,
            assert_within_bound(
                cache[name, i],
                expected,
                bounds[index],
                f"layer {i} hook_{name} == normalized @ W_{name.upper()}",
                valid,
            ),
        )
    z = cache["z", i]
    expected = torch.einsum("bphd,hdm->bpm", z.float(), W_O[i].float()) + b_O[i].float()
    _, bound = projection(hm, z.flatten(-2), block.get_submodule(layout.o_proj))
    attn_out = _before_post_norm(cache, f"blocks.{i}.ln1_post", "attn_out", i, layout.ln1_post)
    worst = max(worst, assert_within_bound(attn_out, expected, bound, f"layer {i} attn_out", valid))
    return worst


def check_identities(hm: HookedModel, cache: Any, valid: torch.Tensor, post_norms: Mapping[str, str] = {}) -> float:
    """``hook_q/k/v == normalized @ W + b``, ``attn_out == z @ W_O + b_O``, MLP ones, per quantized bound.

    The expected values use ``hm.W_Q``... (so the split of fused layouts is checked); the bound comes
    from the module's own read weight. Returns the largest ``|diff| / bound`` seen. Block outputs in
    ``post_norms`` (the contract's declaration: taken after a norm that follows their projection) are left
    out: the quantization bound holds for the projection's output, which no hook point shows there.
    """
    # a model with blocks other than softmax attention (a hybrid) refuses the stacked attention weights: its
    # attention identities are its plugin's own tests', the MLP ones are checked here
    attention = served_weights(hm, ("W_Q", "b_Q", "_W_K", "_b_K", "_W_V", "_b_V", "W_O", "b_O"))
    W_out, b_out, W_in, b_in = hm.W_out, hm.b_out, hm.W_in, hm.b_in
    worst = 0.0
    for inputs in block_inputs(hm, cache):
        i, mlp_in = inputs.layer, inputs.mlp_in
        block, layout, mlp = hm.block_modules[i], hm.block_layouts[i], hm.mlp_layouts[i]
        if len(attention) == 8:
            worst = max(worst, _attention_identities(hm, cache, valid, inputs, attention))
        if mlp_in is not None:
            gated = hm.cfg.gated_mlp
            if isinstance(mlp, FusedGateUp):  # one projection: its bound split like its output
                _, fused_bound = projection(hm, mlp_in, block.get_submodule(mlp.module))
                gate_bound, up_bound = mlp.split(fused_bound)
                pairs = [("pre", gate_bound, hm.W_gate, hm.b_gate), ("pre_linear", up_bound, W_in, b_in)]
            else:
                pairs = [
                    (
                        "pre",
                        projection(hm, mlp_in, block.get_submodule(mlp.pre))[1],
                        hm.W_gate if gated else W_in,
                        hm.b_gate if gated else b_in,
                    )
                ]
                if mlp.pre_linear:
                    pairs.append(
                        ("pre_linear", projection(hm, mlp_in, block.get_submodule(mlp.pre_linear))[1], W_in, b_in)
                    )
            for name, bound, Wt, bt in pairs:
                expected = mlp_in.float() @ Wt[i].float() + bt[i].float()
                worst = max(
                    worst, assert_within_bound(cache[name, i], expected, bound, f"layer {i} hook_{name}", valid)
                )
        post = cache["post", i]
        expected = post.float() @ W_out[i].float() + b_out[i].float()
        _, bound = projection(hm, post, block.get_submodule(mlp.out))
        mlp_out = _before_post_norm(cache, f"blocks.{i}.ln2_post", "mlp_out", i, layout.ln2_post)
        worst = max(worst, assert_within_bound(mlp_out, expected, bound, f"layer {i} mlp_out", valid))
    return worst


def _before_post_norm(cache: Any, prefix: str, short: str, layer: int, post_norm: Optional[str]) -> torch.Tensor:
    """The output projection's result: ``hook_attn_out``/``hook_mlp_out``, or, in a block with a norm after the
    projection (``ln1_post``/``ln2_post``), that norm's input (``hook_normalized * hook_scale``)."""
    if post_norm is None:
        return cache[short, layer]
    return cache[f"{prefix}.hook_normalized"].float() * cache[f"{prefix}.hook_scale"].float()


class Int8Contract(AdapterContract):
    """The contract suite with every model loaded in 8-bit (LLM.int8) on the CPU.

    Put it first among the bases (``class T(Int8Contract, MyArchContract)``): the plugin's contract
    supplies ``plugin`` and ``configs()``. Two choices keep its exact comparisons exact:

    * LLM.int8 picks its outlier columns (``|x| >= llm_int8_threshold``) over *all* rows of a batch, so
      the values at padded positions reach the real tokens' outputs (within the int8 bound). The
      core's explicit attention (run for pattern hooks) gives fully masked padding rows zero output,
      HF's eager attention a uniform mix: both are right for the real tokens of a float model, but
      an 8-bit model turns the difference into different rounding. Examples with the default
      threshold (6.0) therefore draw unpadded inputs; left padding runs with threshold 0 (no outlier
      columns, every row quantized on its own).
    * Eager attention only: the core's explicit attention equals it bit for bit, whereas against SDPA it
      differs by float rounding, which int8 activation rounding can turn into a whole quantization step.
    """

    extra_plugins = (lb,)
    attn_implementations = ("eager",)
    threshold = 6.0
    #: no gradient property: LLM.int8 quantizes activations (finite differences of a piecewise constant metric);
    #: gradients through 8-bit layers are checked by ``test_lora_over_8bit``'s training and the float contract
    gradient_dtype = None

    @classmethod
    def supports(cls, contract: type) -> Optional[str]:
        """Why this variant does not run over ``contract`` (``None``: it does). Its identities and bounds are those of
        dense MLPs: a mixture-of-experts architecture checks its 8-bit model in its own tests."""
        if issubclass(contract, MoEContract):
            return "8-bit mixture-of-experts models are checked by their architecture's own tests"
        return None

    def draw(
        self, data: st.DataObject, attn_implementation: Optional[str] = None, left_padding: bool = True
    ) -> tuple[nn.Module, Inputs]:
        self.threshold = data.draw(st.sampled_from([6.0, 0.0]), label="llm_int8_threshold")
        return super().draw(data, attn_implementation, left_padding and self.threshold == 0.0)

    def draw_for_generation(self, data: st.DataObject) -> tuple[nn.Module, Inputs]:
        """Threshold 0: with outlier columns (threshold 6) picked over each call's rows, a decoding step (one row)
        and a one-pass forward (all rows) round differently wherever a quantized projection reads activations of
        magnitude 6 or more, which the model does by itself, hooks or not: a projection of the unnormalized
        (``sqrt(d_model)``-scaled) embeddings, as Gemma 4's per-layer inputs, moved the unwrapped model's decoding
        logits by up to half the tolerance on random tiny models, and an edit further. With threshold 0 every row
        is quantized on its own and the unwrapped model's steps equal its one pass."""
        self.threshold = 0.0
        return super().draw(data, None, False)

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> nn.Module:
        return quantize(super().make_model(config, seed, attn_implementation), "int8", threshold=self.threshold)

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        # bitsandbytes writes a new ``weight_format`` tensor into every state_dict() call
        return {k: v for k, v in model.state_dict().items() if not k.endswith("weight_format")}

    @_SETTINGS
    @given(data=st.data())
    def test_every_hook_point_edit_changes_logits(self, data: st.DataObject) -> None:
        """Edits propagate through 8-bit layers: ``hook_resid_pre``, ``hook_pattern`` and ``hook_z`` of a drawn
        layer, plus a drawn sample of the other points (all of them run one 8-bit pass each: too slow here;
        every point is covered by the architecture's own float contract run), each checked as the float property
        checks it (``assert_edit_shows``: an edit a saturated softmax hides or a declared ``absorbed_points`` edit
        must show on its witness instead)."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
        required = [
            f"blocks.{layer}.hook_resid_pre",
            f"blocks.{layer}.attn.hook_pattern",
            f"blocks.{layer}.attn.hook_z",
        ]
        others = data.draw(st.lists(st.sampled_from(hm.hook_names), max_size=6, unique=True), label="points")
        with torch.no_grad():
            reference = hm(**inputs.kwargs()).logits
            for name in required + [n for n in others if n not in required]:
                self.assert_edit_shows(hm, model, inputs, name, reference)
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_hook_points_match_declared_capabilities(self, data: st.DataObject) -> None:
        """As in the float suite, the architecture's own form included (hook points are structural: fewer examples
        here, each reloads a model)."""
        super().test_hook_points_match_declared_capabilities.hypothesis.inner_test(self, data)

    def generation_atol(self, logits: torch.Tensor) -> float:
        """LLM.int8 quantizes each call's activations row by row and picks outlier columns over the rows of that
        call: a decoding step (one token) and a one-pass forward (all tokens) round differently, by a small
        fraction of the logits' scale (a missing edit moves them by much more: the test requires it)."""
        return 0.02 * logits.abs().max().item() + 1e-3

    # Two properties hold within the int8 bound rather than float rounding:

    @_SETTINGS
    @given(data=st.data())
    def test_weight_and_residual_identities(self, data: st.DataObject) -> None:
        """The float contract's weight and residual identities, each within ``matmul_error_bound`` of its quantized
        projection."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        with torch.no_grad():
            out = hm.model(**inputs.kwargs(), output_hidden_states=True)
            _, cache = hm.run_with_cache(**inputs.kwargs())
            check_identities(hm, cache, inputs.valid, self.capabilities(model).post_norms)
            if hm.layout.unembed is not None and self.final_hidden_is_ln_final and hm.layout.ln_final:
                final = norm_out(hm, cache, "ln_final")
                v = inputs.valid
                assert_close(
                    self.expected_logits(model, final @ hm.W_U + hm.b_U)[v],
                    out.logits[v],
                    "logits == final @ W_U + b_U (softcapped where declared)",
                )
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_zero_ablating_a_head_removes_its_output(self, data: st.DataObject) -> None:
        """Zeroing a head's ``hook_z`` removes ``z_h @ W_O[h]`` from ``hook_attn_out`` within the int8 bound.

        The 8-bit output projection re-quantizes its input row when ``z`` changes, so both runs carry
        their own activation rounding: the difference is at most the sum of the two bounds. Dropping
        the head at ``hook_result`` changes the projection's own output by exactly the contribution. In a block
        with a norm after attention (``ln1_post``) the projection's output is that norm's input
        (``hook_normalized * hook_scale``), where the contribution is removed.
        """
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
        head = data.draw(st.integers(0, hm.cfg.n_heads - 1), label="head")
        pre = f"blocks.{layer}."
        post_norm = hm.block_layouts[layer].ln1_post
        names = [pre + "attn.hook_z", pre + "hook_attn_out"]
        if post_norm is not None:
            names += [pre + "ln1_post.hook_normalized", pre + "ln1_post.hook_scale"]
        o_proj = hm.block_modules[layer].get_submodule(hm.block_layouts[layer].o_proj)
        with torch.no_grad():
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
            z = base["z", layer]
            contribution = torch.einsum("bpd,dm->bpm", z[:, :, head].float(), hm.W_O[layer, head].float())

            def ablate(t: torch.Tensor, hook: Any) -> torch.Tensor:
                t = t.clone()
                t[:, :, head] = 0
                return t

            def drop(result: torch.Tensor, hook: Any) -> torch.Tensor:
                result = result.clone()
                result[:, :, head] = 0
                return result

            with hm.hooks([(pre + "attn.hook_z", ablate)]):
                _, ablated = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
            with hm.hooks([(pre + "attn.hook_result", drop)]):
                _, dropped = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
            _, bound_base = projection(hm, z.flatten(-2), o_proj)
            _, bound_ablated = projection(hm, ablated["z", layer].flatten(-2), o_proj)

        def projected(cache: Any) -> torch.Tensor:  # the output projection's output
            return _before_post_norm(cache, pre + "ln1_post", "attn_out", layer, post_norm).float()

        expected = projected(base) - contribution
        v = inputs.valid
        assert_within_bound(
            projected(ablated),
            expected,
            bound_base + bound_ablated,
            "z ablation == removing the head's W_O contribution",
            v,
        )
        scale = 1 + expected.abs()
        assert_close(projected(dropped)[v], expected[v], "hook_result ablation", atol=1e-4 * scale.max().item())
        hm.unwrap()
