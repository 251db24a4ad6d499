"""What the vision tower's tests (tests/test_vision_tower*.py) share: plain PyTorch hooks on the Hugging Face modules
(:func:`plain_hook`, :func:`projection_hook`, :func:`z_hook`, :func:`block_references`,
:func:`post_norm_hook`, :func:`norm_hook`), the values they read and
the logits their edits give (:func:`plain_reads_and_edits`), the check that the wrapped model's points read and edit
as they do (:func:`assert_reads_and_edits`), attention functions registered for the tower's config
(:func:`tower_attention`, :func:`logits_under_attention`, :func:`written_out_attention`, :func:`editing_inputs`) and
the wrapped model's caches under the tower's eager and sdpa implementations
(:func:`caches_under_each_implementation`)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from transformers import AttentionInterface

from lensadapters.testing.vlm import logits_of, logits_with

Tensor = torch.Tensor
#: a point's plain hooks: ``hooks(seen, edit)`` registers them (appending what they read to ``seen``, editing it by
#: ``edit`` unless ``None``) and returns their handles
References = Callable[[list, Any], list]


def scale_shift(x: Tensor) -> Tensor:
    """The edit every read-and-edit test makes: ``-2 x + 0.5``."""
    return x * -2.0 + 0.5


def plain_hook(block: Any, kind: str, seen: list, edit: Any = None) -> Any:
    """A plain PyTorch hook on ``block``'s first input (``kind='pre'``) or output (``'post'``, before the module's
    other forward hooks)."""
    if kind == "pre":

        def pre(module: Any, args: tuple, kwargs: dict) -> Any:
            if args:
                seen.append(args[0].clone())
                return None if edit is None else ((edit(args[0]), *args[1:]), kwargs)
            key = next(iter(kwargs))
            seen.append(kwargs[key].clone())
            return None if edit is None else (args, {**kwargs, key: edit(kwargs[key])})

        return block.register_forward_pre_hook(pre, with_kwargs=True)

    def post(module: Any, args: tuple, output: Any) -> Any:
        value = output[0] if isinstance(output, tuple) else output
        seen.append(value.clone())
        if edit is None:
            return None
        return (edit(value), *output[1:]) if isinstance(output, tuple) else edit(value)

    return block.register_forward_hook(post, prepend=True)


def projection_hook(module: Any, heads: int, seen: list, edit: Any) -> Any:
    """A plain forward hook on a projection: its output as ``[..., head, d_head]``."""

    def post(mod: Any, args: tuple, output: Tensor) -> Any:
        split = output.unflatten(-1, (heads, -1))
        seen.append(split.clone())
        return None if edit is None else edit(split).flatten(-2)

    return module.register_forward_hook(post)


def z_hook(module: Any, heads: int, seen: list, edit: Any) -> Any:
    """A plain pre-hook on an output projection: its input as ``[..., head, d_head]``."""

    def pre(mod: Any, args: tuple) -> Any:
        split = args[0].unflatten(-1, (heads, -1))
        seen.append(split.clone())
        return None if edit is None else (edit(split).flatten(-2), *args[1:])

    return module.register_forward_pre_hook(pre)


#: Gemma 4's sandwich norms: each point's prefix (relative to the block) and the HF module
GEMMA4_POST_NORMS = {"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"}


def post_norm_hook(norm: Any, which: str, seen: list, edit: Any, recompute: bool = False) -> Any:
    """A plain forward hook on the RMSNorm ``norm`` reading ``which`` of its input ``x``, written out here from the
    input alone, in float32 as Hugging Face's RMSNorms compute (then in ``x``'s dtype): ``hook_scale`` is
    ``sqrt(mean(x^2) + eps)``, ``hook_normalized`` ``x / scale`` (before the weight, as TransformerLens' RMSNorm and
    the language model's norms have them). ``edit`` of either changes the norm's output by ``weight * (edited
    normalized - normalized)`` in float32 (a norm without a weight, Gemma 4's ``with_scale=False``, by a weight of
    1; the edit entering as the difference it makes, the rest of the output HF's
    own numbers), or, ``recompute``, replaces it by ``weight * edited normalized``."""

    def post(module: Any, args: tuple, output: Tensor) -> Any:
        x = args[0]
        scale = (x.float().pow(2).mean(-1, keepdim=True) + norm_eps(module)).sqrt().to(x.dtype)
        normalized = (x.float() / scale.float()).to(x.dtype)
        seen.append((scale if which == "hook_scale" else normalized).clone())
        if edit is None:
            return None
        edited = (x.float() / edit(scale).float()).to(x.dtype) if which == "hook_scale" else edit(normalized)
        weight = module.weight.float() if getattr(module, "with_scale", True) else torch.ones((), device=x.device)
        if recompute:
            return (edited.float() * weight).to(output.dtype)
        wide = torch.promote_types(output.dtype, torch.float32)
        return (output.to(wide) + ((edited.float() - normalized.float()) * weight).to(wide)).to(output.dtype)

    return norm.register_forward_hook(post)


def norm_eps(norm: Any) -> float:
    """The ``eps`` of a Hugging Face norm (``variance_epsilon`` for the Qwen and Pixtral RMSNorms)."""
    eps = getattr(norm, "eps", None)
    return float(norm.variance_epsilon if eps is None else eps)


def layer_norm_hook(norm: Any, which: str, seen: list, edit: Any) -> Any:
    """A plain forward hook on the ``nn.LayerNorm`` ``norm`` reading ``which`` of its input ``x``: ``hook_scale``
    ``sqrt(var(x) + eps)`` (in float32, then ``x``'s dtype), ``hook_normalized`` the module's output (after the weight
    and bias, TransformerLens' LayerNorm's). An edit of ``hook_normalized`` replaces the output; one of the scale
    changes it by ``((x - mean) / edited - (x - mean) / scale) * weight`` in float32."""

    def post(module: Any, args: tuple, output: Tensor) -> Any:
        x = args[0]
        xf = x.float()
        scale = (torch.var_mean(xf, -1, correction=0, keepdim=True)[0] + module.eps).sqrt().to(x.dtype)
        seen.append((scale if which == "hook_scale" else output).clone())
        if edit is None:
            return None
        if which == "hook_normalized":
            return edit(output)

        def normed(s: Tensor) -> Tensor:
            return (((xf - xf.mean(-1, keepdim=True)) / s.float()) * module.weight.float() + module.bias.float()).to(
                x.dtype
            )

        wide = torch.promote_types(output.dtype, torch.float32)
        delta = normed(edit(scale)).float() - normed(scale).float()
        return (output.to(wide) + delta.to(wide)).to(output.dtype)

    return norm.register_forward_hook(post)


def norm_hook(norm: Any, which: str, seen: list, edit: Any) -> Any:
    """``which`` of a tower block's ``ln1``/``ln2`` by a plain hook, as TransformerLens defines it for the norm's
    kind: :func:`layer_norm_hook` for an ``nn.LayerNorm``, :func:`post_norm_hook` (before the weight) for an
    RMSNorm."""
    if isinstance(norm, torch.nn.LayerNorm):
        return layer_norm_hook(norm, which, seen, edit)
    return post_norm_hook(norm, which, seen, edit)


def _resid_mid_reference(block: Any, ln2: Any, mlp: Any, seen: list, edit: Any = None) -> list:
    """Plain hooks doing what TransformerLens' ``hook_resid_mid`` edit means: the MLP's norm reads the edited
    stream, and the block's output is the edited stream plus the MLP's output."""
    stash: dict[str, Tensor] = {}
    handles = [plain_hook(ln2, "pre", seen, None if edit is None else lambda x: stash.setdefault("mid", edit(x)))]
    if edit is None:
        return handles

    def mlp_out(module: Any, args: tuple, output: Any) -> None:
        stash["mlp"] = output[0] if isinstance(output, tuple) else output

    def block_out(module: Any, args: tuple, output: Any) -> Any:
        value = stash.pop("mid") + stash.pop("mlp")
        return (value, *output[1:]) if isinstance(output, tuple) else value

    return handles + [mlp.register_forward_hook(mlp_out), block.register_forward_hook(block_out, prepend=True)]


def block_references(block: Any, names: tuple[str, str, str, str]) -> dict[str, References]:
    """For each sub-block point (relative to the block): the plain hooks on the block's children ``names``
    (attention, MLP, the norm before each; the attention's and MLP's the children whose outputs the block adds to
    its residual) reading it and editing it."""
    attn, mlp, ln1, ln2 = (block.get_submodule(n) for n in names)
    return {
        "ln1.hook_scale": lambda seen, edit: [norm_hook(ln1, "hook_scale", seen, edit)],
        "ln1.hook_normalized": lambda seen, edit: [norm_hook(ln1, "hook_normalized", seen, edit)],
        "hook_attn_out": lambda seen, edit: [plain_hook(attn, "post", seen, edit)],
        "hook_resid_mid": lambda seen, edit: _resid_mid_reference(block, ln2, mlp, seen, edit),
        "hook_mlp_in": lambda seen, edit: [plain_hook(ln2, "pre", seen, edit)],
        "ln2.hook_scale": lambda seen, edit: [norm_hook(ln2, "hook_scale", seen, edit)],
        "ln2.hook_normalized": lambda seen, edit: [norm_hook(ln2, "hook_normalized", seen, edit)],
        "hook_mlp_out": lambda seen, edit: [plain_hook(mlp, "post", seen, edit)],
    }


def per_block(blocks: Any, references: Callable[[int, Any], Mapping[str, References]]) -> dict[str, References]:
    """``references(i, block)`` (by point relative to the block) of every block, by their full names."""
    return {
        f"vision.blocks.{i}.{point}": hooks
        for i, block in enumerate(blocks)
        for point, hooks in references(i, block).items()
    }


def plain_reads_and_edits(
    model: Any, batch: dict, references: Mapping[str, References], edit: Callable[[Tensor], Tensor] = scale_shift
) -> dict[str, tuple[list, Tensor]]:
    """For each point: what its plain hooks read in one forward (every call's value) and the logits with ``edit``
    made by them, each forward's hooks removed after it."""
    plain: dict[str, tuple[list, Tensor]] = {}
    for point, hooks in references.items():
        seen: list = []
        logits_with(model, batch, *hooks(seen, None))
        plain[point] = (seen, logits_with(model, batch, *hooks([], edit)))
    return plain


def assert_reads_and_edits(
    hm: Any,
    batch: dict,
    plain: Mapping[str, tuple[list, Tensor]],
    cache: Any,
    once: bool = False,
    changed_from: Optional[Tensor] = None,
    edit: Callable[[Tensor], Tensor] = scale_shift,
) -> None:
    """Each point of ``plain`` (:func:`plain_reads_and_edits`) is cached as its plain hooks read it (every call's
    value, in order; one call where ``once``), and ``edit`` there by ``run_with_hooks`` gives the logits their edit
    gave, bitwise (and not ``changed_from``, where given)."""
    for point, (seen, edited) in plain.items():
        assert (len(seen) == 1 if once else len(seen) >= 1) and torch.equal(cache[point], torch.cat(seen)), point
        got = logits_of(hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda x, hook: edit(x))]))
        assert torch.equal(got, edited), point
        if changed_from is not None:
            assert not torch.equal(got, changed_from), point


def resid_mid_and_attn_out_edits(hm: Any, batch: dict) -> dict[str, Tensor]:
    """The logits with ``d`` added at block 0's ``hook_resid_mid`` and at its ``hook_attn_out``, asserted the same
    edit of the residual stream (up to the rounding of the sum's order) and a change of the logits."""
    d = torch.linspace(-1, 1, 32)
    logits = {}
    with torch.no_grad():
        base = logits_of(hm(**batch))
        for point in ("hook_resid_mid", "hook_attn_out"):
            hooks = [(f"vision.blocks.0.{point}", lambda x, hook: x + d.to(x.dtype))]
            logits[point] = logits_of(hm.run_with_hooks(**batch, fwd_hooks=hooks))
    assert not torch.allclose(logits["hook_resid_mid"], base, atol=1e-4)
    torch.testing.assert_close(logits["hook_resid_mid"], logits["hook_attn_out"], atol=1e-5, rtol=1e-5)
    return logits


@contextlib.contextmanager
def tower_attention(model: Any, key: str, function: Callable[..., Any]) -> Iterator[None]:
    """``function`` registered as the attention implementation ``key`` and the tower's (``vision_config``'s) while
    the context runs; the tower's implementation back as it was after."""
    config = model.config.vision_config
    implementation = config._attn_implementation
    AttentionInterface.register(key, function)
    config._attn_implementation = key
    try:
        yield
    finally:
        config._attn_implementation = implementation


def logits_under_attention(model: Any, batch: dict, key: str, function: Callable[..., Any]) -> Tensor:
    """The logits with the tower's attention run by ``function`` (:func:`tower_attention`)."""
    with tower_attention(model, key, function):
        return logits_with(model, batch)


def written_out_attention(target: Any, edits: Mapping[str, Callable[[Tensor], Tensor]]) -> Callable[..., Any]:
    """Eager attention written out that, in the module ``target``, edits its scores (``edits['scores']``: masked,
    before the softmax) and pattern (``edits['pattern']``)."""

    def attention(
        module: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        scaling: Optional[float] = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        scores = torch.matmul(query, key.transpose(2, 3)) * (scaling or query.shape[-1] ** -0.5)
        if attention_mask is not None:
            scores = scores + attention_mask
        if module is target and "scores" in edits:
            scores = edits["scores"](scores)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        if module is target and "pattern" in edits:
            weights = edits["pattern"](weights)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    return attention


def editing_inputs(
    target: Any, which: str, edit: Callable[[Tensor], Tensor], seen: Optional[list] = None
) -> Callable[..., Any]:
    """The tower's model file's eager attention, handed ``edit`` of the ``query`` (``which='q'``) or ``key`` it
    gets from ``target`` (as ``[b, p, h, d]``; recorded in ``seen`` before the edit, where given): what an edit of
    the rotated query or key is."""

    def attention(module: Any, query: Tensor, key: Tensor, *args: Any, **kwargs: Any) -> Any:
        if module is target:
            x = (query if which == "q" else key).transpose(1, 2)
            if seen is not None:
                seen.append(x.clone())
            x = edit(x).transpose(1, 2)
            query, key = (x, key) if which == "q" else (query, x)
        return sys.modules[type(module).__module__].eager_attention_forward(module, query, key, *args, **kwargs)

    return attention


def caches_under_each_implementation(
    model: Any, hm: Any, batch: dict, points: list[str], checked: bool = True
) -> Iterator[tuple[str, Any]]:
    """Under eager, then sdpa: ``(implementation, cache of points)``; where ``checked``, the wrapped model's output
    HF's bitwise before and after the caching forward (the hooks gone: the tower's own implementation again)."""
    config = model.config.vision_config
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        hf = logits_with(model, batch) if checked else None
        with torch.no_grad():
            if checked:
                assert torch.equal(logits_of(hm(**batch)), hf)
            _, cache = hm.run_with_cache(**batch, names_filter=points)
            if checked:
                assert torch.equal(logits_of(hm(**batch)), hf)
        if checked:
            assert config._attn_implementation == implementation
        yield implementation, cache
