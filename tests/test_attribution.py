"""lensadapters.attribution: each score is the derivative of the patched metric (checked against a patch scaled by a
parameter and differentiated, on every installed architecture, float64 where the model runs in it); the QK fix's
pattern is the patched run's; GradDrop drops what it says; experts add up to their MLP. Agreement with activation
patching on a trained model is in test_induction_demo.py."""

from __future__ import annotations

import pytest
import torch

from lensadapters import attribution
from lensadapters.testing.tiny_models import ARCH_NAMES, first_causal, patching_pair


def setup(arch: str, seed: int = 0):
    """The arch's patching pair; a model attribution refuses (hybrid token mixers) skips, after checking that the
    refusal names the blocks (``test_attribution_refuses_blocks_without_softmax_attention``)."""
    hm, clean, corrupted, metric = patching_pair(arch, seed)
    try:
        attribution.require_softmax_attention(hm)
    except attribution.AttributionUnavailable as error:
        assert "blocks [" in str(error) and "activation patching" in str(error)
        hm.unwrap()
        pytest.skip(f"refused: {error}")
    return hm, clean, corrupted, metric


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_attribution_refuses_blocks_without_softmax_attention(arch: str) -> None:
    """A model with blocks whose token mixer is not softmax attention is refused by every gradient entry point,
    naming those blocks; other models are not."""
    hm, clean, corrupted, metric = patching_pair(arch)
    mixers = [i for i, (bl, qkv) in enumerate(zip(hm.block_layouts, hm.qkv_layouts)) if bl is not None and qkv is None]
    if not mixers:
        attribution.require_softmax_attention(hm)
        hm.unwrap()
        return
    with pytest.raises(attribution.AttributionUnavailable, match=rf"blocks \[{mixers[0]}"):
        attribution.attribute(hm, clean, corrupted, metric, ["resid_pre"], progress=False)
    hm.unwrap()


def tolerance(hm) -> float:
    return 1e-9 if hm.cfg.dtype == torch.float64 else 1e-4


def derivative(hm, tokens, metric, name: str, delta: torch.Tensor, where, extra=()) -> float:
    """d/da metric(run on tokens with ``delta * a`` added to ``name`` at ``where``), at a = 0."""
    a = torch.zeros((), dtype=torch.float64, requires_grad=True)

    def add(x: torch.Tensor, hook) -> torch.Tensor:
        x = x.clone()
        x[where] = x[where] + (a * delta).to(x.dtype)
        return x

    with torch.enable_grad():
        value = metric(hm.run_with_hooks(tokens, fwd_hooks=[(name, add), *extra], return_type="logits"))
        return float(torch.autograd.grad(value, a)[0])


@pytest.mark.parametrize(
    ("arch", "at"), [(a, "corrupted") for a in ARCH_NAMES] + [(a, "clean") for a in ARCH_NAMES[::5]]
)
def test_a_score_is_the_derivative_of_the_metric_along_the_patch(arch: str, at: str) -> None:
    hm, clean, corrupted, metric = setup(arch)
    # the dense MLPs' neurons (a mixture of experts has per-expert neurons; DeepSeek's first layers are dense)
    dense = [layer for layer in range(hm.cfg.n_layers) if f"blocks.{layer}.mlp.hook_post" in hm.hook_dict]
    names = ["z", "resid_pre", "mlp_out"] + (["post"] if dense else [])
    result = attribution.attribute(hm, clean, corrupted, metric, names, at=at, progress=False)
    base = corrupted if at == "corrupted" else clean
    heads = result.scores("z", ("layer", "head"))
    resid = result.scores("resid_pre", ("layer", "pos"))
    assert heads.shape == (hm.cfg.n_layers, hm.cfg.n_heads) and resid.shape == (hm.cfg.n_layers, 5)
    table = {"attn.hook_z": heads, "hook_resid_pre": resid, "hook_mlp_out": result.scores("mlp_out", ("layer", "pos"))}
    checks = [("attn.hook_z", (layer, h), (slice(None), slice(None), h)) for layer in range(2) for h in (0, 3)]
    checks += [("hook_resid_pre", (layer, 1), (slice(None), 1)) for layer in range(2)]
    checks += [("hook_mlp_out", (0, 4), (slice(None), 4))]
    rows = {point: list(range(hm.cfg.n_layers)) for point in table}  # the block of each row of a score table
    if dense:
        table["mlp.hook_post"] = result.scores("post", ("layer", "neuron"))  # one row per dense MLP
        rows["mlp.hook_post"] = dense
        assert table["mlp.hook_post"].shape[0] == len(dense)
        checks += [("mlp.hook_post", (dense[-1], 2), (slice(None), slice(None), 2))]
    for point, index, where in checks:
        name = f"blocks.{index[0]}.{point}"
        delta = (result.clean[name] - result.corrupted[name])[where].double()
        expected = derivative(hm, base, metric, name, delta, where)
        got = table[point][(rows[point].index(index[0]), *index[1:])].item()
        assert abs(got - expected) <= tolerance(hm) * max(1.0, abs(expected)), (name, index)
    assert resid[0, 0].abs() < 1e-12 and resid[0, 1].abs() > 0  # only the corrupted position differs at the input
    assert resid.abs().sum() > 0 and heads.abs().sum() > 0
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_the_qk_fix_takes_the_patched_runs_attention_pattern(arch: str) -> None:
    """Where the scores are scale * q.k the fixed estimate is sum (pattern of the patched run - pattern) . gradient,
    the patched run's pattern read from a real patched forward; elsewhere the fix is refused with the reason."""
    hm, clean, corrupted, metric = setup(arch)
    cfg = hm.cfg
    plain = getattr(cfg, "attn_scores_soft_cap", -1) in (None, -1) and cfg.positional_embedding_type != "alibi"
    shared_norm = (
        "blocks.0.attn.q_norm.hook_scale" in hm.hook_dict
        and hm.run_with_cache(clean, names_filter="blocks.0.attn.q_norm.hook_scale")[1][
            "blocks.0.attn.q_norm.hook_scale"
        ].dim()
        == 3
    )  # one norm over every head's queries
    sinks = not torch.allclose(  # attention sinks: a learned logit joins the softmax, pattern rows sum to < 1
        hm.run_with_cache(clean, names_filter="blocks.0.attn.hook_pattern")[1]["pattern", 0].sum(-1).double(),
        torch.ones((), dtype=torch.float64),
    )
    plain = plain and not shared_norm and not sinks
    sides = "qk"
    try:
        result = attribution.attribute(hm, clean, corrupted, metric, list(sides), qk_fix=True, progress=False)
        fixed = {w: result.scores(w, ("layer", "pos", "head"), qk_fix=True) for w in sides}
        whole = {w: result.scores(w, ("layer", "head"), qk_fix=True) for w in sides}
    except attribution.QKFixUnavailable as error:
        assert not plain, error
        assert "pass qk_fix=False" in str(error)
        hm.unwrap()
        return
    layer = cfg.n_layers - 1
    pattern_name = f"blocks.{layer}.attn.hook_pattern"
    gradient = result.grads[0][pattern_name].double()
    for which in sides:
        name = f"blocks.{layer}.attn.hook_{which}"
        for pos in (None, 1, 4):
            where = (slice(None), slice(None) if pos is None else pos, 0)
            seen = {}

            def patch(x: torch.Tensor, hook, where=where, name=name) -> torch.Tensor:
                x = x.clone()
                x[where] = result.clean[name][where]
                return x

            def read(x: torch.Tensor, hook, seen=seen) -> None:
                seen["pattern"] = x.detach().double()

            with torch.no_grad():
                hm.run_with_hooks(corrupted, fwd_hooks=[(name, patch), (pattern_name, read)], return_type="logits")
            expected = float(((seen["pattern"] - result.corrupted[pattern_name].double()) * gradient).sum())
            got = whole[which][layer, 0] if pos is None else fixed[which][layer, pos, 0]
            assert abs(float(got) - expected) <= 1e-5 * max(1.0, abs(expected)), (which, pos, float(got), expected)
    if "k" in fixed:
        assert fixed["k"].shape == (cfg.n_layers, 5, cfg.n_key_value_heads)  # keys: one score per key/value head
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES[:3])
def test_grad_drop_averages_the_magnitudes_with_each_blocks_gradient_dropped(arch: str) -> None:
    hm, clean, corrupted, metric = setup(arch)
    n = hm.cfg.n_layers
    plain = attribution.attribute(hm, clean, corrupted, metric, "z", progress=False).scores("z", ("layer", "head"))
    dropped = attribution.get_attr_patch_attn_head_out_all_pos(hm, clean, corrupted, metric, grad_drop=True)
    # a head of the last block: dropping an earlier block leaves its gradient, dropping its own zeroes it
    assert torch.allclose(dropped[-1], plain[-1].abs() * (n - 1) / (n - 1), atol=1e-12)
    # a head of the first block: its own block's drop gives 0, each later block's drop a gradient that does not flow
    # through that block (computed here by detaching the block's outputs in the forward instead)
    name = "blocks.0.attn.hook_z"
    result = attribution.attribute(hm, clean, corrupted, metric, "z", progress=False)
    delta = (result.clean[name] - result.corrupted[name])[:, :, 0].double()
    where = (slice(None), slice(None), 0)
    expected = 0.0
    for layer in range(1, n):
        detach = [(f"blocks.{layer}.hook_{w}", lambda x, hook: x.detach()) for w in ("attn_out", "mlp_out")]
        expected += abs(derivative(hm, corrupted, metric, name, delta, where, detach))
    assert abs(dropped[0, 0].item() - expected / (n - 1)) <= tolerance(hm) * max(1.0, expected)
    assert (dropped >= 0).all()
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_expert_scores_add_up_to_their_mlp(arch: str) -> None:
    hm, clean, corrupted, metric = setup(arch)
    if not hm.cfg.num_experts:
        with pytest.raises(ValueError, match="mixture-of-experts"):
            attribution.attribute(hm, clean, corrupted, metric, "experts", progress=False)
        hm.unwrap()
        return
    result = attribution.attribute(hm, clean, corrupted, metric, ["experts", "mlp_out"], progress=False)
    experts = result.scores("experts", ("layer", "expert"))
    # one row per mixture-of-experts layer (DeepSeek's first layers are dense)
    moe = [i for i in range(hm.cfg.n_layers) if f"blocks.{i}.mlp.hook_expert_indices" in hm.hook_dict]
    assert experts.shape == (len(moe), hm.cfg.num_experts)
    mlp = result.scores("mlp_out", ("layer",))[moe]
    # shared experts (always on: DeepSeek's) add to the MLP output but are no routed expert: their part, read here
    # from the shared module's output on both runs
    shared = torch.zeros(len(moe), dtype=torch.float64)
    for row, layer in enumerate(moe):
        path = hm.mlp_layouts[layer].shared
        if path is None:
            continue
        outputs = []
        for tokens in (clean, corrupted):
            seen: list = []
            handle = (
                hm.block_modules[layer]
                .get_submodule(path)
                .register_forward_hook(lambda module, args, out, seen=seen: seen.append(out.detach()))
            )
            with torch.no_grad():
                hm(tokens, return_type="logits")
            handle.remove()
            outputs.append(seen[0].double())
        grad = result.grads[0][f"blocks.{layer}.hook_mlp_out"].double()
        shared[row] = ((outputs[0] - outputs[1]).reshape(grad.shape) * grad).sum()
        assert shared[row] != 0
    total = experts.sum(-1) + shared
    assert torch.allclose(total, mlp, atol=1e-4, rtol=1e-4), (total, mlp)
    assert (experts != 0).sum() > len(moe)  # several experts per layer take part
    hm.unwrap()


def test_clear_errors() -> None:
    hm, clean, corrupted, metric = setup(first_causal())
    with pytest.raises(ValueError, match="one number"):
        attribution.attribute(hm, clean, corrupted, lambda logits: logits[:, -1, 0], "z", progress=False)
    with pytest.raises(ValueError, match="queries and keys"):
        attribution.get_attr_patch_attn_head_v_all_pos(hm, clean, corrupted, metric, qk_fix=True)
    with pytest.raises(ValueError, match="no such hook point"):
        attribution.attribute(hm, clean, corrupted, metric, "hook_nothing", progress=False)
    with pytest.raises(ValueError, match="at must be"):
        attribution.attribute(hm, clean, corrupted, metric, "z", at="middle", progress=False)
    hm.unwrap()


def test_parameters_get_no_gradient_and_the_sweep_shows_progress(capsys) -> None:
    hm, clean, corrupted, metric = setup(first_causal())
    attribution.get_attr_patch_attn_head_out_all_pos(hm, clean, corrupted, metric)
    assert "attribution patching" in capsys.readouterr().err
    assert all(p.grad is None for p in hm.hf_model.parameters())
    hm.unwrap()
