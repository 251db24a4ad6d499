"""Qwen3-MoE (``model_type: "qwen3_moe"``: Qwen3-30B-A3B, Qwen3-235B-A22B and other sparse Qwen3 checkpoints) for
lensadapters.

Attention is Qwen3's: GQA, ``head_dim`` from the config, per-head RMSNorm on queries and keys between projection and
RoPE (``attn.q_norm.*``/``attn.k_norm.*``, ``[b, p, h, 1]``/``[b, p, h, d_head]``), rotate-half RoPE on
``model.rotary_emb``'s cos/sin, an optional sliding window on every layer (``use_sliding_window``). The MLP of a
layer is a sparse mixture of experts, described to the core as a :class:`lensadapters.moe.MoELayout`, unless the
config makes it dense (a layer in ``mlp_only_layers``, or one that ``decoder_sparse_step`` skips: layer ``i`` is
sparse when ``(i + 1) % decoder_sparse_step == 0``); a dense layer is an ordinary SwiGLU ``MLPLayout`` of width
``intermediate_size`` with the dense ``mlp.hook_pre``/``hook_pre_linear``/``hook_post``.

* transformers 5: ``mlp.gate`` (``Qwen3MoeTopKRouter``) returns ``(logits, top_k_weights, top_k_index)`` and
  ``mlp.experts`` (``Qwen3MoeExperts``) stores every expert in ``gate_up_proj`` ``[E, 2 * d_mlp, d_model]`` and
  ``down_proj`` ``[E, d_model, d_mlp]``.
* transformers 4.57: ``mlp.gate`` is a linear layer (logits only; the MoE block routes itself) and ``mlp.experts``
  a ``ModuleList`` of ``gate_proj``/``up_proj``/``down_proj`` MLPs.

Routing: softmax over all experts in float32, top-``num_experts_per_tok``, the selected probabilities renormalized
only when ``norm_topk_prob`` (otherwise the experts' outputs are weighted by the raw probabilities, which sum to
less than one), cast back to the router logits' dtype. Qwen3-MoE has no shared expert. ``W_in``/``W_gate``/
``W_out`` of a MoE layer are the up/gate/down rows of every expert (``d_mlp`` is ``moe_intermediate_size``);
a model that mixes dense and MoE layers is read layer by layer (``lensadapters.weights.mlp_weights``).

Refused at wrap time with an explanation: rope types whose rotation is not rotate-half, custom modeling code
registered as ``qwen3_moe``, a model without Qwen3-MoE's layout, attention implementations other than ``eager`` and
``sdpa`` (for hook points that need patterns).
"""

from __future__ import annotations

from typing import Any, Union

from torch import nn

from lensadapters import MLPLayout, UnsupportedModelError, hf
from lensadapters.moe import MoELayout, Routing, stored_moe_layout

__version__ = "0.1.0"
# attention and norms as Qwen3's: q_proj -> q_norm (per head) -> k_proj -> k_norm -> v_proj, then RoPE on the
# normed queries and keys; the MLP is read layer by layer (dense SwiGLU or a mixture of experts, see sparse_layers)
FAMILY = hf.DecoderFamily.named("Qwen3Moe", "qwen3_moe", qk_norms=hf.qk_norms("bphd"), mlp=None)
ARCH = FAMILY.architecture(
    "Qwen3-MoE (Qwen3MoeForCausalLM, Qwen3MoeModel): sparse mixture of experts (optionally with dense layers), "
    "per-head q/k norms before RoPE, GQA"
)
_DENSE = hf.SWIGLU_MLP


def sparse_layers(config: Any) -> list[bool]:
    """Which layers the config makes mixtures of experts (transformers' rule: not in ``mlp_only_layers``, at least
    one expert, and ``(i + 1) % decoder_sparse_step == 0``)."""
    only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [i not in only and config.num_experts > 0 and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]


def moe_layout(layer: nn.Module, config: Any) -> MoELayout:
    """The MoE description of one sparse decoder layer, for the transformers version that built it."""
    routing = Routing(
        config.num_experts, config.num_experts_per_tok, normalize=bool(config.norm_topk_prob), weights_dtype="logits"
    )
    return stored_moe_layout(layer, "mlp", routing, ("gate_proj", "up_proj", "down_proj"))


def _missing_mlp_paths(layer: nn.Module, sparse: bool) -> list[str]:
    if not sparse:
        return hf.missing_paths(layer, [p for p in (_DENSE.pre, _DENSE.pre_linear, _DENSE.out) if p is not None])
    return hf.missing_expert_paths(layer, "mlp", ("gate_proj", "up_proj", "down_proj"))


def check(model: Any) -> None:
    """After the family's checks: each layer's MLP is the one its config declares (dense or experts)."""
    config = model.config
    missing = [
        f"{hf.join(FAMILY.base(model), 'layers')}.{i}.{p}"
        for i, (layer, sparse) in enumerate(zip(FAMILY.layers(model), sparse_layers(config)))
        for p in _missing_mlp_paths(layer, sparse)
    ]
    if missing:
        family = FAMILY.family
        raise UnsupportedModelError(
            f"{type(model).__name__} has model_type 'qwen3_moe' but its MLPs are not the ones its config declares "
            f"(missing: {', '.join(missing[:6])}; sparse layers by mlp_only_layers={config.mlp_only_layers} and "
            f"decoder_sparse_step={config.decoder_sparse_step}); the {family} plugin supports transformers' "
            f"{family} classes"
        )


def config_fields(model: Any) -> dict[str, Any]:
    c, sparse = model.config, sparse_layers(model.config)
    window = getattr(c, "sliding_window", None)
    return dict(
        d_mlp=c.moe_intermediate_size if any(sparse) else c.intermediate_size,
        num_experts=c.num_experts,
        experts_per_token=c.num_experts_per_tok,
        window_size=window,
        attn_types=("local",) * c.num_hidden_layers if window else None,
        extra={
            "use_qk_norm": True,
            "norm_topk_prob": bool(c.norm_topk_prob),
            "moe_layers": [i for i, s in enumerate(sparse) if s],
            "dense_d_mlp": c.intermediate_size,
            "decoder_sparse_step": c.decoder_sparse_step,
            "attention_bias": bool(getattr(c, "attention_bias", False)),
        },
    )


def mlp(model: Any, layer: int) -> Union[MLPLayout, MoELayout]:
    if not sparse_layers(model.config)[layer]:
        return _DENSE
    return moe_layout(FAMILY.layers(model)[layer], model.config)


def tiny_config(seed: int) -> Any:
    """A Qwen3-MoE-like toy, width 64, vocabulary 512, head_dim 32, experts of width 48 (dense layers 96). Seed 0
    is the demo's model: 2 layers, both sparse, GQA (4 query heads, 2 kv heads), top-2 of 4 experts, no
    renormalization (Qwen3-30B-A3B renormalizes; the raw probabilities are the family's default). Other seeds vary
    the depth (1-3), the experts (2-8), top-k (1-3), ``norm_topk_prob`` and dense layers (``mlp_only_layers`` or
    ``decoder_sparse_step`` 2), always keeping one sparse layer."""
    import random

    from transformers import Qwen3MoeConfig

    rng = random.Random(seed)
    if seed == 0:
        only: list[int] = []
        layers, (heads, kv), experts, top_k, norm, step = 2, (4, 2), 4, 2, False, 1
    else:
        layers, (heads, kv) = rng.choice([1, 2, 3]), rng.choice([(4, 2), (4, 4), (4, 1)])
        experts = rng.choice([2, 4, 8])
        top_k, norm = rng.randint(1, min(3, experts)), rng.random() < 0.5
        dense = rng.choice(["none", "first", "step"]) if layers > 1 else "none"
        only, step = ([0], 1) if dense == "first" else ([], 2 if dense == "step" else 1)
    return hf.toy_config(
        Qwen3MoeConfig,
        layers,
        heads,
        kv,
        intermediate_size=96,
        moe_intermediate_size=48,
        head_dim=32,
        rms_norm_eps=1e-6,
        norm_topk_prob=norm,
        mlp_only_layers=only,
        **hf.router_fields(Qwen3MoeConfig, experts, top_k),
        decoder_sparse_step=step,
        use_sliding_window=False,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )


PLUGIN = hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=config_fields, check=check, mlp=mlp).export(globals())
