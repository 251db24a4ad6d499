"""The generic contract's support: the points it expects (:class:`GenericPoints`), the check of a described
model's weights (:func:`check_described_weights`, also run by the generic mixture-of-experts tests) and
:class:`GenericBase`, what a test class provides and how models are drawn and wrapped. The properties are
:mod:`.generic` and :mod:`.generic_edits`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional, Sequence

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from lensadapters.adapters.generic import GenericAdapterWarning
from lensadapters.adapters.registry import Registry
from lensadapters.api.hooked_model import HookedModel
from lensadapters.hooks.specs import FusedGateUp, MLPLayout
from lensadapters.testing.contract_support import assert_close
from lensadapters.testing.every_model_type import build
from lensadapters.testing.gradients import GradientContract
from lensadapters.testing.models import reinit
from lensadapters.testing.strategies import Inputs, token_inputs
from lensadapters.wiring.weights import mlp_weights

BRANCHES = ("hook_attn_out", "hook_mlp_out")


def wrap_generic(model: torch.nn.Module, **kwargs: Any) -> HookedModel:
    """``model`` wrapped by the generic adapter (``kwargs``: the wrap's others), its findings' warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericAdapterWarning)
        return HookedModel.wrap(model, adapter="generic", **kwargs)


def built_and_wrapped(model_type: str) -> Iterator[tuple[torch.nn.Module, HookedModel]]:
    """A module fixture's body: the census's tiny model of ``model_type`` (built with warnings silenced) and its
    :func:`wrap_generic`, unwrapped after."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(model_type)
    hm = wrap_generic(model)
    yield model, hm
    hm.unwrap()


def sample_ids(model: Any) -> torch.Tensor:
    """Two sequences of 7 tokens from 3 to the vocabulary's third-last (seeded)."""
    return torch.randint(3, model.config.vocab_size - 2, (2, 7), generator=torch.Generator().manual_seed(3))


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


class GenericBase(GradientContract):
    """What a :class:`~lensadapters.testing.generic.GenericContract` test class provides and the machinery its
    properties share: drawing a tiny model and inputs, wrapping it with the generic adapter."""

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

    def draw_wrapped(
        self, data: st.DataObject, attn_implementation: Optional[str] = None, left_padding: bool = True
    ) -> tuple[Any, torch.nn.Module, Inputs, HookedModel]:
        """:meth:`draw`, and the model wrapped (:meth:`wrap`)."""
        config, model, inputs = self.draw(data, attn_implementation, left_padding)
        return config, model, inputs, self.wrap(model)

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
