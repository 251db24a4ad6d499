"""The vision tower's attention points of Qwen's vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL on 4.57 and
5.x, Qwen 3.5 on 5.x), whose towers run the flattened patches of all images as one sequence (a batch of 1), project
queries, keys and values with one fused ``qkv``, rotate them by a 2-D rotary inside the attention (in float32) and
call the attention function once per image (``cu_seqlens``; per window in Qwen2.5-VL's windowed blocks):

- ``hook_q/k/v`` (``[1, pos, head, d_head]``) read and edit as a plain forward hook on ``qkv`` taking its thirds,
  ``hook_z`` as a pre-hook on ``proj``; ``hook_rot_q/k`` are HF's own ``apply_rotary_pos_emb_vision`` of them, and
  an edit there is the attention function getting the edited rotated query (key);
- ``hook_pattern`` (``[1, head, pos, pos]``) is block-diagonal: each block HF's eager attention weights of that
  image's (window's) call, zero elsewhere; ``hook_attn_scores`` ``-inf`` off the blocks, softmaxed into it, and
  ``q k^T * scaling`` of ``hook_rot_q/k`` on them (eager and sdpa); an edit of either changes the logits as the
  same edit in a hand-written attention over the whole sequence with the tower's block-diagonal mask;
- no hook means HF's logits bitwise, and the tower's own implementation back after hooks;
- a fused ``qkv`` followed by per-head norms (patched in: no Qwen tower has them) is refused by name."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable

import pytest
import torch

from lensadapters import HookedModel, UnsupportedModelError
from lensadapters.testing.vlm import inputs, logits_of, logits_with, tower_blocks_of, vlm
from lensadapters.wiring.vision_attention import ROTATE_HALF
from lensadapters.wiring.vision_tower import VisionTowerWarning, vision_tower
from tests.test_vision_tower_attention import _add_to_head_0, _roll
from tests.vision_tower_helpers import editing_inputs, logits_under_attention, scale_shift

#: the families, and Qwen2.5-VL with windows smaller than its images (4 patches each) in block 0, block 1 full
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen2_5_vl_windows")
#: a block's attention points, in the order they fire
POINTS = (
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_rot_q",
    "attn.hook_rot_k",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
)
#: the largest differences measured here (the report's numbers), by family and check
MEASURED: dict[str, float] = {}


def _model(name: str) -> tuple[Any, dict]:
    model, n_image = vlm(name.removesuffix("_windows"))
    if name.endswith("_windows"):  # windows of one merged token (2x2 patches) in block 0; block 1 attends per image
        tower = vision_tower(model)[1]  # type: ignore[index]
        for owner in (tower, tower.config):
            owner.window_size, owner.fullatt_block_indexes = 8, [1]
    return model, inputs(model, n_image)


def _measure(key: str, a: torch.Tensor, b: torch.Tensor) -> float:
    error = float((a.double() - b.double()).abs().max())
    MEASURED[key] = max(MEASURED.get(key, 0.0), error)
    return error


def _file(attention: Any) -> Any:
    return sys.modules[type(attention).__module__]


def _wrap(model: Any) -> HookedModel:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model)
    assert not [w for w in caught if issubclass(w.category, VisionTowerWarning)]
    return hm


def _qkv_hook(attention: Any, third: int, seen: list, edit: Any = None) -> Any:
    """A plain forward hook on the fused ``qkv``: its ``third``-th third as ``[1, pos, head, d_head]``."""
    heads = attention.num_heads

    def post(module: Any, args: tuple, output: torch.Tensor) -> Any:
        parts = list(output.chunk(3, dim=-1))
        seen.append(parts[third].unflatten(-1, (heads, -1)).unsqueeze(0).clone())
        if edit is None:
            return None
        parts[third] = edit(seen[-1]).squeeze(0).flatten(-2)
        return torch.cat(parts, dim=-1)

    return attention.qkv.register_forward_hook(post)


def _z_hook(attention: Any, seen: list, edit: Any = None) -> Any:
    heads = attention.num_heads

    def pre(module: Any, args: tuple) -> Any:
        seen.append(args[0].unflatten(-1, (heads, -1)).unsqueeze(0).clone())
        return None if edit is None else (edit(seen[-1]).squeeze(0).flatten(-2), *args[1:])

    return attention.proj.register_forward_pre_hook(pre)


def _angles_hook(attention: Any, seen: list) -> Any:
    def pre(module: Any, args: tuple, kwargs: dict) -> None:
        seen.append(kwargs["position_embeddings"])

    return attention.register_forward_pre_hook(pre, with_kwargs=True)


@pytest.mark.parametrize("name", QWEN)
def test_qkv_rotary_and_z_read_and_edit_as_plain_hooks_and_hf_rotary_do(name: str) -> None:
    model, batch = _model(name)
    blocks, config = tower_blocks_of(model), model.config.vision_config
    reads: dict[str, torch.Tensor] = {}
    edited: dict[str, torch.Tensor] = {}
    for i, block in enumerate(blocks):
        at, attention = f"vision.blocks.{i}.attn.", block.attn
        thirds: list[list] = [[], [], []]
        angles: list = []
        logits_with(
            model, batch, *(_qkv_hook(attention, j, thirds[j]) for j in range(3)), _angles_hook(attention, angles)
        )
        for j, x in enumerate("qkv"):
            reads[at + f"hook_{x}"] = thirds[j][0]
            edited[at + f"hook_{x}"] = logits_with(model, batch, _qkv_hook(attention, j, [], scale_shift))
        q, k = (t[0].squeeze(0) for t in thirds[:2])
        rot_q, rot_k = _file(attention).apply_rotary_pos_emb_vision(q, k, *angles[0])  # HF's own rotation
        reads[at + "hook_rot_q"], reads[at + "hook_rot_k"] = rot_q.unsqueeze(0), rot_k.unsqueeze(0)
        for x in "qk":
            function = editing_inputs(attention, x, scale_shift)  # elementwise: each image's call edited is the whole's
            edited[at + f"hook_rot_{x}"] = logits_under_attention(
                model, batch, f"lensadapters_test_qwen_rot_{x}_{i}", function
            )
        z: list = []
        logits_with(model, batch, _z_hook(attention, z))
        reads[at + "hook_z"], edited[at + "hook_z"] = (
            z[0],
            logits_with(model, batch, _z_hook(attention, [], scale_shift)),
        )
    hf = logits_with(model, batch)
    hm = _wrap(model)
    served = [p for p in hm.hook_dict if p.startswith("vision.blocks.") and ".attn." in p]
    assert served == [f"vision.blocks.{i}.{p}" for i in range(len(blocks)) for p in POINTS]
    heads = config.num_heads
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)  # no hooks: HF's forward
        logits, cache = hm.run_with_cache(**batch, names_filter=list(reads))
        assert torch.equal(logits_of(logits), hf)  # reading changes nothing
        for point, value in reads.items():
            patches = batch["pixel_values"].shape[0]  # all the images' patches, one sequence
            assert cache[point].shape == (1, patches, heads, value.shape[-1]), point
            assert torch.equal(cache[point], value), point
            got = logits_of(hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda x, hook: scale_shift(x))]))
            assert not torch.equal(got, hf), point
            if "rot_" in point:  # rotated back and added to qkv's output as a difference, rotated again by HF
                scale = float(edited[point].abs().max())
                assert _measure(f"{name} {point[-5:]} edit vs the attention function given it", got, edited[point]) <= (
                    1e-5 * scale
                ), point
            else:
                assert torch.equal(got, edited[point]), point
    assert torch.equal(logits_with(model, batch), hf)
    hm.unwrap()


def _eager_weights(model: Any, batch: dict) -> list[list[torch.Tensor]]:
    """Each block's attention weights as HF's eager attention function returns them, one per call (image,
    window)."""
    blocks = tower_blocks_of(model)
    modules = [block.attn for block in blocks]
    file = _file(modules[0])
    eager = file.eager_attention_forward
    weights: list[list[torch.Tensor]] = [[] for _ in blocks]

    def recording(module: Any, *args: Any, **kwargs: Any) -> Any:
        out = eager(module, *args, **kwargs)
        for i, m in enumerate(modules):
            if module is m:
                weights[i].append(out[1].clone())
        return out

    file.eager_attention_forward = recording
    try:
        logits_with(model, batch)
    finally:
        file.eager_attention_forward = eager
    return weights


def _block_diagonal(calls: list[torch.Tensor]) -> torch.Tensor:
    """``[1, h, pos, pos]`` with each call's ``[1, h, n, n]`` on the diagonal, zeros elsewhere."""
    n = sum(c.shape[-1] for c in calls)
    full = calls[0].new_zeros(*calls[0].shape[:2], n, n)
    start = 0
    for c in calls:
        end = start + c.shape[-1]
        full[..., start:end, start:end] = c
        start = end
    return full


@pytest.mark.parametrize("name", QWEN)
def test_patterns_are_block_diagonal_eager_weights_and_scores_are_softmaxed_into_them(name: str) -> None:
    model, batch = _model(name)
    n = len(tower_blocks_of(model))
    eager = _eager_weights(model, batch)
    images = batch["image_grid_thw"].shape[0]
    calls = [len(w) for w in eager]
    merged = int((batch["image_grid_thw"][:, 1:].prod(-1) // 4).sum())  # windows of one 2x2 merged token each
    assert calls == ([merged, images] if name.endswith("_windows") else [images] * n)  # per window, per image
    hm = _wrap(model)
    config = model.config.vision_config
    points = [f"vision.blocks.{i}.{p}" for i in range(n) for p in POINTS[3:7]]
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        hf = logits_with(model, batch)
        with torch.no_grad():
            assert torch.equal(logits_of(hm(**batch)), hf)
            logits, cache = hm.run_with_cache(**batch, names_filter=points)
            assert _measure(f"{name} logits with patterns hooked ({implementation})", logits_of(logits), hf) < 1e-4
            assert torch.equal(logits_of(hm(**batch)), hf)  # the hooks gone: the tower's own implementation again
        assert config._attn_implementation == implementation
        for i in range(n):
            at = f"vision.blocks.{i}.attn."
            pattern, scores = cache[at + "hook_pattern"], cache[at + "hook_attn_scores"]
            expected = _block_diagonal(eager[i])
            assert pattern.shape == scores.shape == expected.shape  # [1, head, pos, pos]: the whole sequence
            assert _measure(f"{name} pattern vs eager's blocks ({implementation})", pattern, expected) < 1e-6
            assert torch.equal(scores == float("-inf"), _block_diagonal([torch.ones_like(w) for w in eager[i]]) == 0)
            assert _measure(f"{name} softmax(scores) vs pattern", torch.softmax(scores, -1), pattern) < 1e-6
            q, k = cache[at + "hook_rot_q"], cache[at + "hook_rot_k"]
            by_hand = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
            inside = scores != float("-inf")
            assert _measure(f"{name} scores vs q k^T by hand", scores[inside], by_hand[inside]) < 1e-5
    hm.unwrap()


def _hand_written(attention: Any, edit: Callable[[torch.Tensor], torch.Tensor], where: str) -> Callable[..., Any]:
    """The attention module's forward written out over the whole sequence: ``qkv``, HF's rotation, ``q k^T *
    scaling`` with the block-diagonal mask of ``cu_seqlens``, ``edit`` of the scores (``where='scores'``) or of the
    pattern, the values, ``proj``."""
    file = _file(attention)

    def forward(hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        n = hidden_states.shape[0]
        qkv = attention.qkv(hidden_states).reshape(n, 3, attention.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = file.apply_rotary_pos_emb_vision(qkv[0], qkv[1], *kwargs["position_embeddings"])
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, qkv[2]))
        scores = torch.matmul(q, k.transpose(2, 3)) * attention.scaling
        image = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
        scores = scores.masked_fill(image[:, None] != image[None, :], float("-inf"))
        if where == "scores":
            scores = edit(scores)
        pattern = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if where == "pattern":
            pattern = edit(pattern)
        return attention.proj(torch.matmul(pattern, v).transpose(1, 2).reshape(n, -1))

    return forward


@pytest.mark.parametrize("name", QWEN)
@pytest.mark.parametrize("where", ["scores", "pattern"])
def test_an_edit_of_scores_or_pattern_is_the_edit_in_a_hand_written_attention_over_the_sequence(
    name: str, where: str
) -> None:
    """The pattern edit (a roll along the keys) moves weight onto other images' patches: the hand-written attention
    mixes them as the edited pattern says, over the whole sequence."""
    model, batch = _model(name)
    blocks = tower_blocks_of(model)
    edit = _roll if where == "pattern" else _add_to_head_0
    point = "hook_pattern" if where == "pattern" else "hook_attn_scores"
    hm = _wrap(model)
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        hf = logits_with(model, batch)
        for i, block in enumerate(blocks):
            block.attn.forward = _hand_written(block.attn, edit, where)
            try:
                reference = logits_with(model, batch)
            finally:
                del block.attn.forward
            with torch.no_grad():
                hooks = [(f"vision.blocks.{i}.attn.{point}", lambda x, hook: edit(x))]
                got = logits_of(hm.run_with_hooks(**batch, fwd_hooks=hooks))
            assert not torch.equal(got, hf)
            scale = float(reference.abs().max())
            error = _measure(f"{name} {where} edit vs hand-written attention ({implementation})", got, reference)
            assert error <= 1e-6 * scale
    hm.unwrap()


def test_an_unhooked_forward_after_hooks_is_hf_bitwise_and_gradients_reach_qkv() -> None:
    """With the patterns hooked the attention module gets zeros from each call and its output projection the
    explicit attention's output: the gradient of the logits reaches ``qkv`` through it, as through HF's own."""
    model, batch = _model("qwen2_5_vl")
    attention = tower_blocks_of(model)[0].attn
    hm = _wrap(model)

    def grad(run: Callable[[], Any]) -> torch.Tensor:
        model.zero_grad()
        logits_of(run()).sum().backward()
        assert attention.qkv.weight.grad is not None
        return attention.qkv.weight.grad.clone()

    own = grad(lambda: model(**batch))
    hooked = grad(
        lambda: hm.run_with_hooks(**batch, fwd_hooks=[("vision.blocks.0.attn.hook_pattern", lambda x, hook: x + 0)])
    )
    assert _measure("qwen2_5_vl qkv gradient, patterns hooked vs HF", hooked, own) <= 1e-5 * float(own.abs().max())
    hm.unwrap()


def test_in_bfloat16_the_rotary_points_rotate_in_float32_as_the_tower_does() -> None:
    """Qwen's tower rotates its queries and keys in float32 and casts them back: in bfloat16 ``hook_rot_q/k`` are
    HF's own rotation bit for bit, which the rotation in bfloat16 (Pixtral's) is not."""
    model, batch = _model("qwen2_vl")
    model.to(torch.bfloat16)
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    attention = tower_blocks_of(model)[0].attn
    thirds: list[list] = [[], []]
    angles: list = []
    logits_with(
        model,
        batch,
        _qkv_hook(attention, 0, thirds[0]),
        _qkv_hook(attention, 1, thirds[1]),
        _angles_hook(attention, angles),
    )
    q, k = (t[0].squeeze(0) for t in thirds)
    rot_q, rot_k = (t.unsqueeze(0) for t in _file(attention).apply_rotary_pos_emb_vision(q, k, *angles[0]))
    hf = logits_with(model, batch)
    hm = _wrap(model)
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)
        _, cache = hm.run_with_cache(
            **batch, names_filter=["vision.blocks.0.attn.hook_rot_q", "vision.blocks.0.attn.hook_rot_k"]
        )
    assert cache["vision.blocks.0.attn.hook_rot_q"].dtype == torch.bfloat16
    assert torch.equal(cache["vision.blocks.0.attn.hook_rot_q"], rot_q)
    assert torch.equal(cache["vision.blocks.0.attn.hook_rot_k"], rot_k)
    assert not torch.equal(ROTATE_HALF.apply(q.unsqueeze(0), *angles[0]), rot_q)  # in bfloat16: other numbers
    hm.unwrap()


def test_an_edit_of_the_rotated_queries_reaches_the_patterns_of_the_same_forward() -> None:
    """The gathered calls carry the edited queries: the pattern is the softmax of the edited ``hook_rot_q`` against
    ``hook_rot_k`` on each image's block."""
    model, batch = _model("qwen3_vl")
    hm = _wrap(model)
    at = "vision.blocks.1.attn."
    seen: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, hook: Any) -> None:
        seen[hook.name] = x.clone()

    hooks = [
        (at + "hook_rot_q", lambda x, hook: scale_shift(x)),
        *((at + p, keep) for p in ("hook_rot_q", "hook_rot_k")),
    ]
    hooks.append((at + "hook_pattern", keep))
    with torch.no_grad():
        hm.run_with_hooks(**batch, fwd_hooks=hooks)
    q, k, pattern = seen[at + "hook_rot_q"], seen[at + "hook_rot_k"], seen[at + "hook_pattern"]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    expected = torch.softmax(scores.masked_fill(pattern == 0, float("-inf")), -1)
    assert _measure("qwen3_vl pattern after a rot_q edit vs softmax of the edited q", pattern, expected) < 1e-5
    hm.unwrap()


def test_gathered_attention_is_the_calls_attention_and_refuses_masks_and_differing_arguments() -> None:
    """Explicit attention over the concatenated calls with their block-diagonal mask gives each call's eager
    attention; a call with a mask of its own, or arguments differing between the calls, is refused by name."""
    from lensadapters.hooks.attention import InterfacePatternBackend
    from lensadapters.wiring.vision_attention import _Pass, gathered_attention

    model, _ = _model("qwen2_vl")
    attention = tower_blocks_of(model)[0].attn
    backend = InterfacePatternBackend(model.config.vision_config, [attention], lambda *args: None)
    g = torch.Generator().manual_seed(0)
    calls = [tuple(torch.randn(1, 4, n, 8, generator=g) for _ in range(3)) for n in (3, 5)]
    chunks = [(q, k, v, None, {"scaling": 0.5, "is_causal": False}, attention) for q, k, v in calls]
    through = _Pass()
    out = gathered_attention(backend, chunks, through, through)  # type: ignore[arg-type]
    eager = torch.cat([_file(attention).eager_attention_forward(attention, *c, None, 0.5)[0] for c in calls], dim=1)
    assert out.shape == (1, 8, 4, 8) and _measure("gathered attention vs eager per call", out, eager) < 1e-6
    masked = [chunks[0], (*chunks[1][:3], torch.zeros(1, 1, 5, 5), *chunks[1][4:])]
    with pytest.raises(UnsupportedModelError, match="with a mask of each block's own"):
        gathered_attention(backend, masked, through, through)  # type: ignore[arg-type]
    differing = [chunks[0], (*chunks[1][:4], {"scaling": 0.25, "is_causal": False}, attention)]
    with pytest.raises(UnsupportedModelError, match="arguments that differ between the blocks"):
        gathered_attention(backend, differing, through, through)  # type: ignore[arg-type]


def _with_head_norms(attention: Any) -> None:
    """Qwen2-VL's attention with per-head norms (children ``q_norm``/``k_norm``, each called once) after its fused
    ``qkv``, before the rotation: the module's own forward, its ``apply_rotary_pos_emb_vision`` fed the normed
    thirds while it runs."""
    file, forward = _file(attention), attention.forward
    d_head = attention.qkv.out_features // 3 // attention.num_heads
    attention.q_norm, attention.k_norm = torch.nn.LayerNorm(d_head), torch.nn.LayerNorm(d_head)
    rotate = file.apply_rotary_pos_emb_vision

    def normed(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        return rotate(attention.q_norm(q), attention.k_norm(k), cos, sin)

    def patched(*args: Any, **kwargs: Any) -> Any:
        file.apply_rotary_pos_emb_vision = normed
        try:
            return forward(*args, **kwargs)
        finally:
            file.apply_rotary_pos_emb_vision = rotate

    attention.forward = patched


def test_a_fused_projection_followed_by_per_head_norms_is_refused_by_name_and_breaks_nothing() -> None:
    """A fused ``qkv`` whose query and key thirds are normed per head before the rotation: the probe finds the
    chain (the norms read the thirds) and refuses the tower's attention points by name, no site splits a fused
    projection's norms; the residual and sub-block points are served and the model's forward is its own."""
    model, batch = _model("qwen2_vl")
    for block in tower_blocks_of(model):
        _with_head_norms(block.attn)
    hf = logits_with(model, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model)
    messages = [str(w.message) for w in caught if issubclass(w.category, VisionTowerWarning)]
    assert len(messages) == 1 and "attention points are not served" in messages[0]
    assert "fused projection 'qkv' is followed by per-head norms ('q_norm', 'k_norm')" in messages[0]
    served = {p for p in hm.hook_dict if p.startswith("vision.blocks.0.")}
    assert not {p for p in served if ".attn." in p}
    assert {"vision.blocks.0.hook_resid_pre", "vision.blocks.0.hook_attn_out", "vision.blocks.0.hook_mlp_out"} <= served
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)
        _, cache = hm.run_with_cache(**batch, names_filter=["vision.blocks.0.hook_attn_out"])
    plain: list = []
    handle = tower_blocks_of(model)[0].attn.register_forward_hook(lambda m, a, out: plain.append(out.clone()))
    logits_with(model, batch, handle)
    assert torch.equal(cache["vision.blocks.0.hook_attn_out"], plain[0])
    hm.unwrap()
