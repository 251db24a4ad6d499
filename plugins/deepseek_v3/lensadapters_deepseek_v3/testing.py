"""Test kit of lensadapters-deepseek-v3 (needs ``lensadapters[testing]``): ``DeepseekV3Contract``
(``LENSADAPTERS_CONTRACT``, run by ``lensadapters check deepseek_v3``; the plugin's tests subclass it),
``deepseek_v3_config(...)`` (one tiny config) and ``deepseek_v3_configs(**overrides)`` (their strategy). Importing
``lensadapters_deepseek_v3`` never imports it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Optional

import torch
import transformers
from hypothesis import strategies as st
from transformers import DeepseekV2Config, DeepseekV3Config

import lensadapters_deepseek_v3
from lensadapters import hf
from lensadapters.testing.families import MoEDecoderContract, config_strategy, declared_config

#: transformers 5 caches MLA's latents (and decompresses them at every step); transformers 4 the per-head keys
CACHES_LATENTS = int(transformers.__version__.split(".")[0]) >= 5
REFUSES = "multi-head latent attention refuses what this property does: it "

__all__ = ["DeepseekV3Contract", "deepseek_v3_config", "deepseek_v3_configs"]


def _deepseek_fields(given: dict[str, Any]) -> dict[str, Any]:
    """The fields a DeepSeek-V3 (or V2) config derives from its keywords: as many key/value heads as query heads,
    the routing groups, and the router's fields of its version."""
    derived = {"n_kv": given["n_heads"], "n_group": given["groups"][0], "topk_group": given["groups"][1]}
    if given["v2"]:
        return {**derived, "topk_method": given["topk_method"]}
    return {**derived, "norm_topk_prob": given["norm_topk_prob"], "rope_interleave": given["interleave"]}


deepseek_v3_config = declared_config(
    "deepseek_v3_config",
    lambda given: DeepseekV2Config if given["v2"] else DeepseekV3Config,
    """A tiny DeepSeek-V3 config (``moe_decoder_config``'s shared fields; as many key/value heads as query heads):
    ``experts`` routed experts of width ``d_mlp`` in ``groups = (n_group, topk_group)``, one shared expert, the first
    ``dense_layers`` layers dense of width ``dense_d_mlp``. ``v2``: a DeepSeek-V2 config instead (complex rotary, a
    softmax router with ``topk_method``; ``interleave`` and ``norm_topk_prob`` do not apply).""",
    keywords={
        **dict(n_heads=4, q_lora_rank=8, kv_lora_rank=12, nope=4, rope=4, v_head_dim=6, d_mlp=8, dense_d_mlp=24),
        **dict(experts=4, top_k=2, groups=(2, 1), dense_layers=0, norm_topk_prob=True, scale=2.5, interleave=True),
        **dict(max_pos=32, v2=False, topk_method="group_limited_greedy", n_shared_experts=1),
    },
    fields={
        **dict(nope="qk_nope_head_dim", rope="qk_rope_head_dim", d_mlp="moe_intermediate_size", dense_d_mlp="d_mlp"),
        **dict(dense_layers="first_k_dense_replace", scale="routed_scaling_factor", groups=None, v2=None),
        **dict(norm_topk_prob=None, interleave=None, topk_method=None),
    },
    derive=lambda given: {"head_dim": given["rope"], **_deepseek_fields(given)},
    build=hf.moe_decoder_config,
)


def _groups(drawn: dict[str, Any]) -> st.SearchStrategy:
    """``(n_group, topk_group)`` dividing the experts, enough kept experts for the top-k (each kept group contributes
    its experts; groups are scored by their two best, so groups of at least two experts)."""
    e, k = drawn["experts"], drawn["top_k"]
    options = [
        (g, t) for g in range(1, e + 1) if e % g == 0 and e // g >= 2 for t in range(1, g + 1) if t * e // g >= k
    ]
    return st.sampled_from(options)


deepseek_v3_configs = config_strategy(
    deepseek_v3_config,
    """Tiny DeepSeek-V3 configs: 4 or 6 routed experts in groups (1, 2 or 3 groups, some dropped before the top-k),
    top-k from 1 to 3, renormalized or raw sigmoid weights scaled by 1 or 2.5, dense first layers, with and without a
    query latent, interleaved or rotate-half rope, different no-rope, rope and value head sizes; and as many
    DeepSeek-V2 configs (complex rotary, a softmax router, greedy or group-limited greedy).""",
    experts=st.sampled_from([4, 6]),
    top_k=st.integers(1, 3),
    groups=_groups,
    n_kv=st.sampled_from([2, 4]),
    ratio=1,
    n_layers=st.integers(1, 3),
    dense_layers=lambda drawn: st.integers(0, drawn["layers"] - 1),
    q_lora_rank=st.sampled_from([None, 8]),
    kv_lora_rank=st.sampled_from([6, 12]),
    nope=st.sampled_from([2, 4]),
    rope=st.sampled_from([2, 4]),
    v_head_dim=st.sampled_from([4, 6]),
    norm_topk_prob=st.booleans(),
    scale=st.sampled_from([1.0, 2.5]),
    interleave=st.booleans(),
    vocab=st.integers(16, 96),
    theta=st.sampled_from([100.0, 10000.0]),
    tied=st.booleans(),
    v2=st.booleans(),
    topk_method=st.sampled_from(["greedy", "group_limited_greedy"]),
)
# properties that must see DeepSeek-V2 on every run (its rotary and its router)
V2_PROPERTIES = (
    "test_pattern_and_query_edits_are_used",
    "test_routing_points_are_the_routing",
    "test_routing_edits_equal_running_with_that_routing",
)


class DeepseekV3Contract(MoEDecoderContract):
    """Every generic adapter property (in its MoE form) and the MoE properties on tiny DeepSeek-V3 models: multi-head
    latent attention, grouped sigmoid routing with a random correction bias, shared experts, dense first layers."""

    plugin: ClassVar[Any] = lensadapters_deepseek_v3
    config_strategy = deepseek_v3_configs
    matrix_overrides = dict(experts=st.just(4), n_layers=st.integers(1, 2))

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> torch.nn.Module:
        model = super().make_model(config, seed, attn_implementation)
        generator = torch.Generator().manual_seed(seed)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.randn(bias.shape, generator=generator) * 0.3)
        return model

    # generic properties that do what MLA refuses by name (tests/test_deepseek_v3.py checks each refusal and the
    # exact edits of every point against the float64 reference instead): W_K/W_V (an RMS norm inside the projection),
    # and, under transformers 5, edits of hook_k/hook_rot_k/hook_v during cached generation (the cache keeps the
    # latents, decompressed again at every step); under transformers 4 the float64 gradient check, which the model
    # itself cannot run
    not_served: ClassVar[Mapping[str, str]] = {
        "test_weight_and_residual_identities": REFUSES + "reads W_K/W_V, which MLA has not (latent_weights instead)",
        **(
            {"test_edits_during_generation_match_one_pass": REFUSES + "edits hook_rot_k during cached generation"}
            if CACHES_LATENTS
            else {
                "test_gradients_through_edits_match_finite_differences": "transformers 4's DeepSeek-V3 does not run "
                "in float64 (its MoE adds float64 expert outputs into a float32 sum: index_add_ refuses)"
            }
        ),
    }

    config_strata = {"deepseek_v2": V2_PROPERTIES}
    stratum_overrides = {"deepseek_v2": {"v2": True}}

    def assert_moe_edit_shows(self, hm: Any, inputs: Any, name: str, reference: torch.Tensor) -> None:
        """As the MoE contract's, but an edit of ``hook_router_logits`` that keeps every token's one expert under
        renormalized top-1 routing changes nothing (the correction bias, which only chooses, can keep the choice
        where the rolled scores alone would move it; the one weight is 1 either way)."""
        config = hm.hf_model.config
        if name.endswith("mlp.hook_router_logits") and config.num_experts_per_tok == 1 and config.norm_topk_prob:
            indices = name.replace("hook_router_logits", "hook_expert_indices")
            _, before = hm.run_with_cache(**inputs.kwargs(), names_filter=[indices])
            with hm.hooks(fwd_hooks=[(name, self._edit_for(name, hm))]):
                _, after = hm.run_with_cache(**inputs.kwargs(), names_filter=[indices])
            if torch.equal(before[indices][inputs.valid], after[indices][inputs.valid]):
                return
        super().assert_moe_edit_shows(hm, inputs, name, reference)

    def config_label(self, config: Any) -> Optional[str]:
        latent = "q latent" if config.q_lora_rank else "q_proj"
        if config.model_type == "deepseek_v2":
            return f"V2 {config.topk_method}, {latent}, top-{config.num_experts_per_tok} of {config.n_routed_experts}"
        return f"{latent}, top-{config.num_experts_per_tok} of {config.n_routed_experts} in {config.n_group} groups"
