"""What the contract's properties share: tolerances, Hypothesis settings, comparisons, the declared
:class:`Capabilities` and the hook points every block has."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from hypothesis import HealthCheck, settings

from lensadapters.api.hooked_model import HookedModel

ATOL = 1e-4
RTOL = 1e-4
# each plugin subclass runs the inherited tests (differing executors by design)
_SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors],
)
#: the Hypothesis settings of every property: a contract variant that redefines one (an 8-bit model's identities
#: within a quantization bound) decorates it with ``@property_settings`` and ``@given(data=st.data())``
property_settings = _SETTINGS


def assert_unchanged_by_caching(hm: HookedModel, inputs: Any, reference: torch.Tensor) -> None:
    """The wrapped model's logits are ``reference`` bitwise, before and after a ``run_with_cache`` (hooks that came
    and went leave nothing behind)."""
    with torch.no_grad():
        assert torch.equal(hm(**inputs.kwargs()).logits, reference)
        hm.run_with_cache(**inputs.kwargs())
        assert torch.equal(hm(**inputs.kwargs()).logits, reference)


def perturbed_logits(hm: HookedModel, inputs: Any, name: str) -> torch.Tensor:
    """The logits of ``inputs`` with :func:`perturb` at the point ``name``, which must fire."""
    fired: list[str] = []

    def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
        fired.append(hook.name)
        return perturb(t, hook)

    logits = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(name, edit)])
    assert fired, f"{name} never fired"
    return logits


def greedy_kwargs(steps: int, pad_token_id: Optional[int] = 0, **fields: Any) -> dict[str, Any]:
    """``generate``'s keyword arguments for greedy decoding of exactly ``steps`` tokens that returns each step's
    logits (``pad_token_id`` ``None``: 0), then ``fields``."""
    return dict(
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=pad_token_id if pad_token_id is not None else 0,
        **fields,
    )


def check_edited_generation(
    hm: HookedModel,
    inputs: Any,
    point: str,
    edit: Any,
    atol: Any,
    pad_token_id: Optional[int] = 0,
    steps: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Generation with ``edit`` at ``point`` (the KV cache on) gives at each step the logits of one forward over the
    generated sequences with the same edit, within ``atol(one_pass_logits)``. Returns those one-pass logits, the
    logits of the same forward without the edit, and the prompt length."""
    prompt = inputs.input_ids.shape[1]
    with torch.no_grad():
        with hm.hooks([(point, edit)]):
            generated = hm.generate(**inputs.kwargs(), **greedy_kwargs(steps, pad_token_id))
            sequences = generated.sequences
            one_pass = hm(sequences, attention_mask=torch.ones_like(sequences)).logits
        unedited = hm(sequences, attention_mask=torch.ones_like(sequences)).logits
    assert len(generated.logits) == steps
    tolerance = atol(one_pass)
    for step, logits in enumerate(generated.logits):
        expected = one_pass[:, prompt - 1 + step]
        assert_close(logits, expected, f"{point} edit: step {step} vs one pass", atol=tolerance)
    return one_pass, unedited, prompt


def assert_wraps_transparently(model: torch.nn.Module, batch: Mapping[str, Any], registry: Any = None) -> None:
    """Wrapping ``model`` is transparent on ``batch``: with no hooks the wrapped model gives HF's logits bitwise;
    identity hooks at every point give them too (to the kit's tolerance), every point firing once in
    ``hook_names``' order; ``unwrap()`` gives the model back, its logits bitwise what they were."""
    with torch.no_grad():
        expected = model(**batch).logits
        hm = HookedModel.wrap(model, registry=registry)
        assert torch.equal(hm(**batch).logits, expected), "no hooks: HF's logits bitwise"
        fired: list[str] = []
        hooks = [(n, lambda t, hook: fired.append(hook.name)) for n in hm.hook_names]
        assert_close(hm.run_with_hooks(**batch, fwd_hooks=hooks), expected, "identity hooks everywhere")
    assert fired == hm.hook_names, "every point fires once, in hook_names' order"
    assert hm.unwrap() is model
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, expected), "unwrapped: the model's logits as they were"


def served_weights(hm: HookedModel, names: Any) -> dict[str, torch.Tensor]:
    """``hm``'s stacked weights of ``names`` (``"W_Q"``...) that it serves, by name: a model whose blocks are not all
    softmax attention (a hybrid's linear-attention layers) refuses the stacked attention weights by name
    (``WeightUnavailableError``), and a variant's weight properties compare what is served. Call it on both models
    compared and check that they serve the same names."""
    from lensadapters.errors import WeightUnavailableError

    served = {}
    for name in names:
        try:
            served[name] = getattr(hm, name)
        except WeightUnavailableError:
            continue
    return served


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> bool:
    return torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = ATOL, rtol: float = RTOL) -> None:
    if not close(a, b, atol, rtol):
        diff = (a.float() - b.float()).abs().max().item()
        raise AssertionError(f"{what}: max abs difference {diff:.3g} (atol {atol}, rtol {rtol})")


def perturb(t: torch.Tensor, hook: Any) -> torch.Tensor:
    """A generic edit that changes every element (deterministic)."""
    g = torch.Generator().manual_seed(len(hook.name))
    noise = torch.randn(t.shape, generator=g).to(t.dtype)
    return t * 1.5 + 0.3 * noise


def uncap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """The scores before a softcap ``cap * tanh(s / cap)`` (``-inf`` stays ``-inf``)."""
    return cap * torch.atanh((scores.double() / cap).clamp(-1 + 1e-15, 1 - 1e-15))


def _flatten_scores(scores: torch.Tensor, hook: Any) -> torch.Tensor:
    """Every unmasked score 0 (a uniform pattern over the allowed keys), masked ones kept at ``-inf``."""
    return torch.where(torch.isfinite(scores), torch.zeros_like(scores), scores)


def _attention_witness(hm: HookedModel, name: str) -> Optional[str]:
    """For a point upstream of a layer's attention scores (q, k, rotary, their LoRA deltas), the scores;
    for the scores, the pattern: where an edit that a saturated softmax hides from the logits must show."""
    match = re.match(r"^(blocks\.\d+\.)", name)
    if match is None:
        return None
    names = hm.hook_names
    scores, pattern = match.group(1) + "attn.hook_attn_scores", match.group(1) + "attn.hook_pattern"
    if name == scores:
        return pattern if pattern in names else None
    if scores in names and names.index(name) < names.index(scores):
        return scores
    return None


def attention_layers(hm: HookedModel) -> list[int]:
    """The layers with softmax attention points (``attn.hook_pattern``): all of them but the blocks a plugin
    describes with another token mixer (the linear-attention or state-space layers of hybrid models)."""
    return [i for i in range(hm.cfg.n_layers) if f"blocks.{i}.attn.hook_pattern" in hm.hook_names]


def is_causal(hm: HookedModel) -> bool:
    """Whether the wrapped model is a causal language model (``cfg.attention_dir == "causal"``): the next-token
    loss, generation and left padding counted from each row's first token are defined for it. An encoder
    (bidirectional attention) refuses the first two with ``NotCausalError``."""
    return bool(hm.cfg.attention_dir == "causal")


def assert_refuses_causal_operations(hm: HookedModel, input_ids: torch.Tensor) -> None:
    """What a model that is not a causal LM does instead of generating and computing the next-token loss: it
    refuses both with ``NotCausalError``, naming its bidirectional attention, with hooks attached or not, and
    leaves no hook behind."""
    import pytest

    from lensadapters.errors import NotCausalError

    calls = [
        lambda: hm.generate(input_ids, max_new_tokens=1, do_sample=False),
        lambda: hm(input_ids, return_type="loss"),
        lambda: hm(input_ids, return_type="both"),
    ]
    for hooked in (False, True):
        if hooked:
            hm.add_hook("blocks.0.hook_resid_pre", lambda t, hook: t)
        for call in calls:
            with pytest.raises(NotCausalError, match="bidirectional"):
                call()
    hm.reset_hooks()
    assert not hm.has_hooks


def _hook_counts(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def _instance_attributes(model: torch.nn.Module) -> dict[str, set[str]]:
    """Each module's instance attribute names (a plugin may override a method on one instance while hooked)."""
    return {name: set(vars(module)) for name, module in model.named_modules()}


@dataclass(frozen=True)
class Capabilities:
    """What a model has, as its plugin's contract declares it.

    Hook-point capabilities (``None``: not declared, not checked):

    * ``learned_positions``: a learned position table: ``hook_pos_embed``, ``W_pos``,
      ``cfg.positional_embedding_type == "standard"``.
    * ``rotary``: rotary embeddings: ``attn.hook_rot_q``/``hook_rot_k`` in every block,
      ``cfg.positional_embedding_type == "rotary"``, ``0 < cfg.rotary_dim <= cfg.d_head``.
    * ``gated_mlp``: ``mlp.hook_pre_linear`` in every block, ``cfg.gated_mlp``, ``W_gate``.
    * ``parallel_blocks``: attention and MLP read the same block input: no ``hook_resid_mid``,
      ``cfg.parallel_attn_mlp``; sequential blocks have ``hook_resid_mid`` in every block.

    What the properties may assume (the defaults hold for GPT-2, GPT-NeoX, OPT, Llama and GPT-J):

    * ``score_linear_points``: query points (relative to a block) whose doubling doubles every unmasked
      attention score (before a declared ``score_softcap``). Leave out a point behind which the queries are
      normalized (Qwen3's, Gemma 3's and OLMo 2's ``q_norm``: ``("attn.hook_rot_q",
      "attn.q_norm.hook_normalized")``). Points a model lacks are skipped.
    * ``score_invariant_points``: query points followed by a scale-invariant (RMS) query norm, whose doubling
      leaves the scores as they were up to the norm's eps (``("attn.hook_q",)`` for those three).
    * ``score_softcap``: the config attribute holding an attention-score softcap (Gemma 2:
      ``"attn_logit_softcapping"``); where the config sets it ``c``, doubling a linear point doubles
      ``c * atanh(score / c)`` (scores near the cap, where ``atanh`` is ill-conditioned, are left out).
    * ``post_norms``: block outputs taken after a norm that follows their projection, mapped to that norm
      (relative to the block): ``{"hook_attn_out": "ln1_post", "hook_mlp_out": "ln2_post"}`` for Gemma 2's
      sandwich norms. The weight identities then read ``hook_attn_out == norm(z @ W_O + b_O)``, and head
      ablation compares the ``hook_z`` and ``hook_result`` edits with each other instead of subtracting a
      head's contribution from ``hook_attn_out``. Each declared norm must have its ``hook_scale`` point in
      every block. A scale-invariant norm further on may then absorb a norm-scale edit (doubling ``ln1``'s
      scale halves the values that ``ln1_post`` scales back): the edit must change the logits or, failing
      that, the first hook point after the edited norm's (likewise with declared ``score_invariant_points``:
      a saturated softmax may hide a query norm's edit).
    * ``pre_norms``: ``False`` for blocks without norms before attention and MLP (OLMo 2): no ``ln1.*`` or
      ``ln2.*`` points; attention reads ``hook_resid_pre`` and the MLP ``hook_mlp_in``.
    * ``logit_softcap``: the config attribute holding a final-logit softcap (Gemma 2:
      ``"final_logit_softcapping"``); where the config sets it, ``logits == c * tanh((final @ W_U + b_U) / c)``.
    * ``attention_sinks``: a learned logit per head joins the softmax (transformers' ``s_aux``): pattern rows
      over the real keys sum to less than one.
    * ``mixed_values``: the point (relative to a block) whose values the pattern mixes into ``hook_z``:
      ``attn.hook_v``, or the output of a norm on the values (Gemma 4: ``attn.v_norm.hook_normalized``).
    * ``absorbed_points``: block points (relative to the block) whose edits scale-invariant norms further on undo up
      to their eps (Gemma 4's ``ln1.hook_scale``: queries, keys and values are all normalized per head): an edit
      there must change the next hook point rather than the logits.
    """

    learned_positions: Optional[bool] = None
    rotary: Optional[bool] = None
    gated_mlp: Optional[bool] = None
    parallel_blocks: Optional[bool] = None
    score_linear_points: tuple[str, ...] = ("attn.hook_q", "attn.hook_rot_q")
    score_invariant_points: tuple[str, ...] = ()
    score_softcap: Optional[str] = None
    post_norms: Mapping[str, str] = field(default_factory=dict)
    pre_norms: bool = True
    logit_softcap: Optional[str] = None
    attention_sinks: bool = False
    mixed_values: str = "attn.hook_v"
    absorbed_points: tuple[str, ...] = ()


#: hook points every block has, whatever the architecture (and ln1.*, unless the contract declares no pre-norms)
_BLOCK_POINTS = (
    "hook_resid_pre",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
    "attn.hook_result",
    "hook_attn_out",
    "mlp.hook_pre",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
)
