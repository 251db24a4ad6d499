"""The automatic description: for a model no plugin claims, the declarative description a plugin would write
(``ModelLayout`` with rotary and final norm, and per layer ``BlockLayout``, ``SeparateQKV``/``FusedQKV`` and
``MLPLayout``/``FusedGateUp``), read from the probe forward pass (:mod:`.probe`) and the config, never from a table
of names. Every claim is checked on the probe's values, against what the model's own modules computed:

* **pre-norms** (``ln1``/``ln2``): a direct child of the layer that computes LayerNorm or RMSNorm of its input with
  its own weight (offset ``0`` or ``1``, ``eps`` read from the module), whose output is exactly the input of the
  attention module (``ln1``) or of the MLP module (``ln2``); the block is *parallel* when the MLP reads ``ln1``'s
  output or ``ln2`` reads the layer's input, *sequential* when ``ln2`` (or the MLP) reads ``resid_pre + attn_out``;
* **branch constants**: a layer adding its attention and MLP outputs multiplied by constants of its config
  (:mod:`.parallel`'s split of two branches: ``mid = x + attn_out * c0`` bit for bit what ``ln2`` reads, ``out = mid +
  mlp_out * c1`` bit for bit its output) is described with them (``BlockLayout.attn_scale``/``mlp_scale``), and so
  is one running a token mixer beside its attention module, each output times its constant (its branch points are
  then the layer's own sums: :mod:`.described_sums`), and so is one whose MLP is two modules it adds as one sum
  (a mixture of experts and a module the dense description reads, its shared MLP: the experts are the block's MLP,
  the other module its shared expert, ``mlp.shared_expert.*``, and ``hook_mlp_out`` the sum, times its constant);
  other layers of three branch children added times constants are not;
* **attention input constant**: a layer multiplying its pre-norm's output by a constant of its config before its
  attention module reads it (``attn(ln1(x) * c)``, bit for bit on the probe; a module beside the attention reads the
  norm's output as it is) is described with it (``BlockLayout.attn_in_scale``, in ``W_Q``/``W_K``/``W_V``);
* **constants inside**: keys or queries the attention module multiplies by a constant of the config before rotary
  (``SeparateQKV.k_scale``/``q_scale``), and an MLP multiplying its activation's input or its output projection's
  output by one (``MLPLayout.pre_scale``/``out_scale``), each found where the product matches on the probe;
* **output projection**: the linear module inside the attention module whose input is the attention function's
  output (heads merged) and whose output is the attention module's output;
* **values**: the linear module (or the values' part of one fused projection, laid out ``[q | k | v]`` or per head
  ``[heads, (q | k | v), d]``) whose output, split into heads, is the value tensor the model passes to the attention
  function (a module wrapping a linear one is not a candidate: its child is);
* **queries and keys**: the two other projections whose outputs, through the q/k norms found between them and the
  attention function (a norm module inside the attention module reading the projection's output per head or over
  the whole width) and then rotary (rotate-half or interleaved pairs on the first ``partial_rotary_factor`` of each
  head, with the ``(cos, sin)`` the model's rotary module returned, or the real and imaginary parts of the complex
  table it returned; or none, layer by layer), and then a norm the attention module applies after rotary
  (:mod:`.rotated_norm`), are the query and key tensors the model passes to the attention function;
* **multi-head latent attention** where no projection gives the values (:mod:`.latent`): the down- and
  up-projections, the latents' norms, the rope columns and their rotary;
* **MLP**: the linear module whose output is the MLP module's output (``W_out``), and the one or two (or one fused
  gate-up) projections reading the MLP's input, such that the activation named by the config (or the module's
  ``act_fn``, or else SiLU or ReLU, which no other activation passes for) reproduces the down projection's input:
  ``act(gate) * up`` (gated) or ``act(pre)`` (plain).

What fails is not described (the layer stays opaque, served by the generic adapter's own points) and the reason
is kept for the warning. A description is then *verified* at wrap time point by point (:mod:`.verify`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lensadapters.adapters.generic.describe_mlp import _describe_mlp
from lensadapters.adapters.generic.description_types import (  # noqa: F401  (their old import path)
    MLP,
    QKV,
    Description,
    LayerDescription,
    NotDescribed,
    _is_linear,
)
from lensadapters.adapters.generic.moe import describe_other_mlp
from lensadapters.adapters.generic.norms import NormBehaviour, norm_behaviour
from lensadapters.adapters.generic.probe import InterfaceCall, Recording, _close
from lensadapters.adapters.generic.qkv_layouts import grouped_qkv_splits
from lensadapters.adapters.generic.rotary_forms import (  # noqa: F401  (their old import path)
    _rotary_candidates,
    _rotary_inside_attention,
    _rotary_module,
    interleaved_spec,
)
from lensadapters.adapters.generic.rotated_norm import RotatedNorm, norm_after_rotary
from lensadapters.adapters.generic.shared_expert import describe_shared_expert, describe_sibling_expert
from lensadapters.adapters.vlm import text_config
from lensadapters.hooks.specs import (
    BlockLayout,
    FusedQKV,
    OpaqueMLP,
    ProjectionNorm,
    RotarySpec,
    SeparateQKV,
)

Tensor = torch.Tensor


def fused_qkv_split(heads: int, kv: int, d: int) -> tuple[Callable[..., Any], Callable[..., Tensor]]:
    """``(split, merge)`` of one projection's ``[q | k | v]`` output, each part as ``[..., heads, d]``."""
    widths = [heads * d, kv * d, kv * d]

    def split(t: Tensor) -> tuple[Tensor, ...]:
        return tuple(part.unflatten(-1, (part.shape[-1] // d, d)) for part in t.split(widths, dim=-1))

    def merge(*parts: Tensor) -> Tensor:
        return torch.cat([part.flatten(-2) for part in parts], dim=-1)

    return split, merge


def per_head_qkv_split(heads: int, d: int) -> tuple[Callable[..., Any], Callable[..., Tensor]]:
    """``(split, merge)`` of one projection's output laid out per head, ``[heads, (q | k | v), d]``."""

    def split(t: Tensor) -> tuple[Tensor, ...]:
        parts = t.unflatten(-1, (heads, 3, d))
        return parts[..., 0, :], parts[..., 1, :], parts[..., 2, :]

    def merge(*parts: Tensor) -> Tensor:
        return torch.stack(parts, dim=-2).flatten(-3)

    return split, merge


def _heads(t: Tensor, heads: int) -> Tensor:
    """``[b, p, heads * d]`` as ``[b, p, heads, d]``."""
    return t.unflatten(-1, (heads, t.shape[-1] // heads))


def _norm_between(
    rec: Recording, i: int, attn: str, proj_out: Tensor, heads: int
) -> list[tuple[Optional[ProjectionNorm], Optional[str], Tensor]]:
    """``(norm, path, per-head output)``: no norm, or each norm module inside the attention module reading
    ``proj_out`` (whole width, per head, or per head after the transpose)."""
    options: list[tuple[Optional[ProjectionNorm], Optional[str], Tensor]] = [(None, None, _heads(proj_out, heads))]
    prefix = attn + "."
    per_head = _heads(proj_out, heads)
    for (layer, path), (x, y) in rec.inner.items():
        if layer != i or not path.startswith(prefix) or x is None or y is None:
            continue
        if _close(x, proj_out):
            options.append((ProjectionNorm(path, "bpf"), path, _heads(y, heads)))
        elif _close(x, per_head):
            options.append((ProjectionNorm(path, "bphd"), path, y))
        elif _close(x, per_head.transpose(1, 2)):
            options.append((ProjectionNorm(path, "bhpd"), path, y.transpose(1, 2)))
    return options


def _match_rotated(
    options: list[tuple[Optional[ProjectionNorm], Optional[str], Tensor]],
    target: Tensor,
    rotaries: list[Optional[RotarySpec]],
    cos_sin: Optional[tuple[Tensor, Tensor]],
    after: Optional[Callable[[Tensor, Tensor], Optional[RotatedNorm]]] = None,
) -> Optional[tuple[Optional[ProjectionNorm], Optional[str], Optional[RotarySpec], Optional[RotatedNorm]]]:
    """The (norm, rotary, norm after rotary) under which a projection's output is ``target`` (``[b, heads, p, d]``);
    ``after`` finds a norm the attention module applies to the rotated values (:mod:`.rotated_norm`)."""
    want = target.transpose(1, 2)
    rotated: list[tuple[Optional[RotarySpec], Tensor]] = []  # with no norm before rotary: for a norm after it
    for norm, path, value in options:
        for spec in rotaries:
            if spec is None:
                got = value
            elif cos_sin is None:
                continue
            else:
                try:
                    got = spec.apply(value, *cos_sin)
                except RuntimeError:
                    continue
            if _close(got, want):
                return norm, path, spec, None
            if norm is None:
                rotated.append((spec, got))
    # a norm after rotary only where none before it fits (a norm of each head with unit weights commutes with
    # rotary on the probe: it is the one the model calls before, where the model calls one before)
    if after is None:
        return None
    for spec, got in rotated:
        post = after(got, want)
        if post is not None:
            return None, None, spec, post
    return None


def _keep_rotated_norms(
    into: Optional[dict[str, RotatedNorm]], q: Optional[RotatedNorm], k: Optional[RotatedNorm]
) -> None:
    """The queries' and keys' norms after rotary into ``into``; one module read at the same call by both is not
    what the model does (the claim is wrong), and so is one role's norm being another's first call."""
    if into is None:
        return
    if q is not None and k is not None and q.module == k.module and q.call == k.call:
        raise NotDescribed(f"the norm after rotary {q.module} reads the queries and the keys in the same call")
    for norm in (q, k):  # a later call only of a module whose first call (recorded) read the other's rotated values
        if (
            norm is not None
            and norm.call
            and not any(o is not None and o.module == norm.module for o in (q, k) if o is not norm)
        ):
            raise NotDescribed(f"the probe did not see {norm.module} read rotated queries or keys")
    into.update({role: norm for role, norm in (("q", q), ("k", k)) if norm is not None})


def _qk_norm_behaviours(
    layer: nn.Module, rec: Recording, i: int, paths: tuple[Optional[str], ...], norms: dict[str, NormBehaviour]
) -> None:
    """Each q/k norm's behaviour into ``norms``; one that is not LayerNorm or RMSNorm is not described."""
    for path in paths:
        if path is not None:
            x, y = rec.inner[(i, path)]
            behaviour = norm_behaviour(layer.get_submodule(path), x, y) if x is not None and y is not None else None
            if behaviour is None or behaviour.eps is None:
                raise NotDescribed(f"the q/k norm {path} is not LayerNorm or RMSNorm of its input with a readable eps")
            norms[path] = behaviour


def _describe_attention(
    layer: nn.Module,
    i: int,
    attn: str,
    call: InterfaceCall,
    rec: Recording,
    rotary: list[Optional[RotarySpec]],
    cos_sin: Optional[tuple[Tensor, Tensor]],
    attn_in: Tensor,
    attn_out: Tensor,
    rotated_norms: Optional[dict[str, RotatedNorm]] = None,
    changed_z: Optional[list[str]] = None,
) -> tuple[QKV, str, dict[str, NormBehaviour]]:
    """The layer's queries, keys and values, output projection and q/k norms; ``rotated_norms`` (where given) gets
    the norms the attention module applies after rotary (:mod:`.rotated_norm`), which are tried only then;
    ``changed_z`` (where given) gets the output projection when the attention module changes the attention
    function's output before it (an output gate or a norm), which is then accepted."""
    prefix = attn + "."
    post_norm = norm_after_rotary(layer, rec, i, attn) if rotated_norms is not None else None
    heads, kv, d = call.heads, call.kv_heads, call.d_head
    assert call.query is not None and call.key is not None and call.value is not None
    linears: dict[str, Any] = {  # the linear modules (not a wrapper around one, whose output is its child's)
        path[len(prefix) :]: io
        for (layer_i, path), io in rec.inner.items()
        if layer_i == i
        and path.startswith(prefix)
        and io[0] is not None
        and io[1] is not None
        and _is_linear(layer.get_submodule(path))
    }
    z = call.output.value.flatten(-2)  # [b, p, heads * d]
    o_proj = [p for p, (x, y) in linears.items() if _close(x, z) and _close(y, attn_out)]
    if len(o_proj) != 1:
        # the attention output changed before the output projection (an output gate, a norm): the one linear module
        # giving the attention output is the projection, and hook_z the attention function's output (.gated_z)
        o_proj = [p for p, (x, y) in linears.items() if _close(y, attn_out) and x is not None and x.shape == z.shape]
        if len(o_proj) != 1 or changed_z is None:
            raise NotDescribed("no single linear module maps the attention function's output to the attention output")
        changed_z.append(f"{attn}.{o_proj[0]}")
    readers: dict[str, Any] = {p: y for p, (x, y) in linears.items() if _close(x, attn_in) and p != o_proj[0]}
    norms: dict[str, NormBehaviour] = {}
    value_t = call.value.transpose(1, 2)  # [b, p, kv, d]
    fused = [p for p, y in readers.items() if y.shape[-1] == (heads + 2 * kv) * d]
    if fused and len(readers) == 1:
        layouts = [fused_qkv_split(heads, kv, d)] + ([per_head_qkv_split(heads, d)] if heads == kv else [])
        layouts += grouped_qkv_splits(heads, kv, d)  # heads in groups, each [q | k | v] in some order
        fitting = [(s, m) for s, m in layouts if _close(s(readers[fused[0]])[2], value_t)]
        if not fitting:
            raise NotDescribed(
                "neither the fused projection's last part, nor its third part of each head, nor a part of each group "
                "of heads is the values the attention function gets"
            )
        for split, merge in fitting:  # noqa: B007  (the first layout whose queries and keys fit too: merge used below)
            q, k, v = split(readers[fused[0]])
            q_options, k_options = (_norm_between(rec, i, attn, t.flatten(-2), n) for t, n in ((q, heads), (k, kv)))
            q_match = _match_rotated(q_options, call.query, rotary, cos_sin, post_norm)
            k_match = _match_rotated(k_options, call.key, rotary, cos_sin, post_norm)
            if q_match is not None and k_match is not None and q_match[2] is k_match[2]:
                break
        else:
            raise NotDescribed(
                "the fused projection's queries and keys, through a q/k norm and rotated, are not what attention gets"
            )
        _qk_norm_behaviours(layer, rec, i, (q_match[1], k_match[1]), norms)
        _keep_rotated_norms(rotated_norms, q_match[3], k_match[3])
        fused_qkv = FusedQKV(
            f"{attn}.{fused[0]}", split, merge, rotary=q_match[2], q_norm=q_match[0], k_norm=k_match[0]
        )
        return fused_qkv, f"{attn}.{o_proj[0]}", norms
    values = [p for p, y in readers.items() if y.shape[-1] == kv * d and _close(_heads(y, kv), value_t)]
    if len(values) != 1:
        raise NotDescribed("no single projection of the attention input is the values the attention function gets")
    rest = [p for p in readers if p != values[0]]
    found: dict[str, tuple[str, Optional[ProjectionNorm], Optional[str], Optional[RotarySpec], Optional[RotatedNorm]]]
    found = {}
    scales = {"q": 1.0, "k": 1.0}
    for role, target, n in (("q", call.query, heads), ("k", call.key, kv)):
        for p in rest:
            if readers[p].shape[-1] != n * d or p in [f[0] for f in found.values()]:
                continue
            match = _match_rotated(_norm_between(rec, i, attn, readers[p], n), target, rotary, cos_sin, post_norm)
            if match is None:  # the output times a constant of the config, then rotary (a key multiplier)
                match, scales[role] = _scaled_match(readers[p], n, target, rotary, cos_sin, rec.config)
            if match is not None:
                found[role] = (p, *match)
                break
        if role not in found:
            raise NotDescribed(
                f"no projection of the attention input gives the {'queries' if role == 'q' else 'keys'} the attention "
                f"function gets, through a q/k norm, a rotary embedding (rotate-half or interleaved pairs) and a norm "
                f"after it"
            )
    (qp, qn, qpath, qrot, qpost), (kp, kn, kpath, krot, kpost) = found["q"], found["k"]
    if qrot is not krot:
        raise NotDescribed("queries and keys rotate differently")
    _qk_norm_behaviours(layer, rec, i, (qpath, kpath), norms)
    _keep_rotated_norms(rotated_norms, qpost, kpost)
    # the order the model runs them: the norms right after their projection, or after all three projections
    order = [p for (layer_i, p) in rec.inner if layer_i == i]
    after = qn is not None and order.index(f"{attn}.{values[0]}") < order.index(qn.module)
    qkv = SeparateQKV(
        f"{attn}.{qp}",
        f"{attn}.{kp}",
        f"{attn}.{values[0]}",
        rotary=qrot,
        q_norm=qn,
        k_norm=kn,
        norms_after_projections=after,
        q_scale=scales["q"],
        k_scale=scales["k"],
    )
    return qkv, f"{attn}.{o_proj[0]}", norms


def _scaled_match(
    proj_out: Tensor,
    heads: int,
    target: Tensor,
    rotary: list[Optional[RotarySpec]],
    cos_sin: Optional[tuple[Tensor, Tensor]],
    config: Any,
) -> tuple[Optional[tuple[Any, ...]], float]:
    """``(match, c)``: the rotary under which ``proj_out * c`` (a constant of the config other than 1, no q/k norm)
    is ``target``, the attention function's queries or keys (rotary is linear and keeps each head's norm: ``c`` is
    estimated as the ratio of their norms, then the config's numbers are tried nearest first); ``(None, 1.0)``
    where none fits."""
    from lensadapters.adapters.generic.parallel import _by_distance, _constants

    value = _heads(proj_out, heads)
    size = float(value.double().norm())
    if size == 0.0 or config is None:
        return None, 1.0
    estimate = float(target.double().norm()) / size
    for c in _by_distance(estimate, _constants(config), proj_out.dtype)[:8]:
        if c == 1.0:
            continue
        match = _match_rotated([(None, None, value * c)], target, rotary, cos_sin)
        if match is not None:
            return match, c
    return None, 1.0


def _input_constant(normalized: Tensor, attn_in: Tensor, config: Any) -> Optional[float]:
    """The constant of the config (other than 1) the layer multiplies a norm's output by before its attention module
    reads it: ``normalized * c`` bit for bit ``attn_in`` (estimated as the ratio of their norms, then the config's
    numbers tried nearest first); ``None`` where none is."""
    from lensadapters.adapters.generic.parallel import _by_distance, _constants

    if config is None or not isinstance(normalized, Tensor) or not isinstance(attn_in, Tensor):
        return None
    if normalized.shape != attn_in.shape or normalized.dtype != attn_in.dtype:
        return None
    size = float(normalized.double().norm())
    if size == 0.0:
        return None
    estimate = float(attn_in.double().norm()) / size
    for c in _by_distance(estimate, _constants(config), normalized.dtype)[:8]:
        if c != 1.0 and torch.equal(normalized * c, attn_in):
            return c
    return None


def describe_layer(
    model: nn.Module,
    layer: nn.Module,
    i: int,
    found: Any,
    rec: Recording,
    rotary: list[Optional[RotarySpec]],
    cos_sin: Optional[tuple[Tensor, Tensor]],
) -> LayerDescription:
    if "hook_resid_pre" not in found.points:
        raise NotDescribed("the layer's input and output are not the residual stream (see hook_resid_pre)")
    calls = [c for c in rec.calls if c.layer == i] or [c for c in rec.own_calls if c.layer == i]
    if len(calls) != 1 or calls[0].query is None:
        raise NotDescribed(
            "the layer does not call transformers' attention interface exactly once"
            + (f", and {rec.own_why[i]}" if i in rec.own_why else "")
        )
    attn = found.attn or next(
        (n for n, c in layer.named_children() if any(m is calls[0].module for m in c.modules())), None
    )
    if attn is None:
        raise NotDescribed("the attention function is called with no module of the layer")
    others = [n for n, c in layer.named_children() if n != attn and any(p.dim() >= 2 for p in c.parameters())]
    mlp = found.mlp or (others[0] if len(others) == 1 else None)
    sibling = three = None
    if found.mlp is None and len(others) == 2:
        from lensadapters.adapters.generic.parallel import layer_split

        three = layer_split(i, layer, rec)
        if three is not None and _beside_split(three, attn):
            mlp = three.after[0]  # a token mixer beside the attention (.parallel), added as it is or times constants
        pair = _routed_and_shared(model, layer, i, three, attn, rec)
        if pair is not None:  # an MLP of two modules the layer adds as one sum: routed experts and a shared MLP
            mlp, sibling = pair
    if mlp is None and found.mlp is None and not others:  # one branch, its attention (BlockLayout.no_mlp)
        return _describe_attention_only(layer, i, attn, calls[0], rec, rotary, cos_sin)
    if mlp is None:
        raise NotDescribed("the layer has not exactly one MLP module beside its attention module")
    attn_scale, mlp_scale = _branch_constants(i, layer, rec, attn, mlp)
    resid_pre, resid_post = rec.layer_in[i].value, rec.layer_out[i].value
    attn_in, attn_out = rec.inner.get((i, attn), (None, None))
    mlp_in, mlp_out = rec.inner.get((i, mlp), (None, None))
    if attn_in is None or attn_out is None or mlp_in is None or mlp_out is None:
        raise NotDescribed("the probe did not see the attention and MLP modules' inputs and outputs")
    norms: dict[str, NormBehaviour] = {}
    roles: dict[str, Optional[str]] = dict.fromkeys(("ln1", "ln2", "ln1_post", "ln2_post"))
    attn_in_scale = 1.0
    for name, child in layer.named_children():
        if name in (attn, mlp):
            continue
        x, y = rec.inner.get((i, name), (None, None))
        if x is None or y is None:
            continue
        behaviour = norm_behaviour(child, x, y)
        if behaviour is None or behaviour.eps is None:  # a scale is served only with the module's own eps
            continue
        reads = _close(y, attn_in)
        if not reads and roles["ln1"] is None and _close(x, resid_pre):  # the norm's output times a constant?
            c = _input_constant(y, attn_in, rec.config)
            reads, attn_in_scale = c is not None, attn_in_scale if c is None else c
        for role, fits in (
            ("ln1", _close(x, resid_pre) and reads),
            ("ln1_post", _close(x, attn_out)),
            ("ln2_post", _close(x, mlp_out)),
            ("ln2", _close(y, mlp_in)),
        ):
            if fits and roles[role] is None:
                roles[role], norms[name] = name, behaviour
                break
    ln1, ln2, ln1_post, ln2_post = roles["ln1"], roles["ln2"], roles["ln1_post"], roles["ln2_post"]
    if ln1 is None and not _close(attn_in, resid_pre):
        raise NotDescribed(
            "the attention module reads neither the layer's input nor a pre-norm of it (nor one times a constant of "
            "the config)"
        )
    ln1_out = rec.inner[(i, ln1)][1] if ln1 is not None else attn_in  # what a module beside the attention reads
    attn_branch: Any = rec.inner[(i, ln1_post)][1] if ln1_post is not None else attn_out
    mlp_branch: Any = rec.inner[(i, ln2_post)][1] if ln2_post is not None else mlp_out
    if attn_scale != 1.0 or mlp_scale != 1.0:  # what the layer adds (checked bit for bit by the split)
        if ln1_post is not None or ln2_post is not None:
            raise NotDescribed("a layer adding its branches times constants with norms after its branches")
        attn_branch, mlp_branch = _times(attn_out, attn_scale), _times(mlp_out, mlp_scale)
    if sibling is not None and three is not None:  # the two MLP modules' outputs summed as the layer adds them
        from lensadapters.adapters.generic.parallel import after_contribution

        if ln2_post is not None:
            raise NotDescribed("an MLP of two modules with a norm after it")
        mlp_branch = after_contribution([rec.children[(i, n)].value for n in three.after], three)
    mid = _parallel_mid(layer, i, rec, attn)
    mid = resid_pre + attn_branch if mid is None else mid
    mlp_reads = rec.inner[(i, ln2)][0] if ln2 is not None else mlp_in
    if ln2 is None and ln1 is not None and _close(mlp_in, ln1_out):
        parallel = True  # both branches read ln1's output (one shared pre-norm)
    elif _close(mlp_reads, mid):
        parallel = False
    elif _close(mlp_reads, resid_pre):
        parallel = True
    else:
        raise NotDescribed("the MLP reads neither a pre-norm of resid_pre + attn_out nor of resid_pre")
    if parallel and (ln1_post is not None or ln2_post is not None):
        raise NotDescribed("a parallel block with norms after its branches")
    if parallel and attn_in_scale != 1.0:
        raise NotDescribed("a parallel block multiplying its attention's input by a constant")
    if not _close(resid_post, (resid_pre if parallel else mid) + mlp_branch + (attn_branch if parallel else 0)):
        raise NotDescribed("the layer's output is not its input plus its attention and MLP branches")
    rotated_norms: dict[str, RotatedNorm] = {}
    changed_z: list[str] = []
    try:
        qkv, o_proj, qk_norms = _describe_attention(
            layer, i, attn, calls[0], rec, rotary, cos_sin, attn_in, attn_out, rotated_norms, changed_z
        )
    except NotDescribed:  # multi-head latent attention? (.latent)
        from lensadapters.adapters.generic.latent import describe_latent_attention

        latent = describe_latent_attention(layer, i, attn, calls[0], rec, cos_sin, attn_in, attn_out)
        if latent is None:
            raise
        (qkv, o_proj), qk_norms = latent, {}
    norms.update(qk_norms)
    mlp_layout: Any
    try:
        mlp_layout, gated, act_fn = _describe_mlp(model, layer, i, mlp, rec)
    except NotDescribed:  # a mixture of experts: the rest of the layer is described all the same (see .moe)
        mlp_layout, gated, act_fn = describe_other_mlp(model, layer, i, mlp, rec, ln2_post is not None), True, None
        if mlp_layout is None:
            raise
    if parallel and (attn_scale != 1.0 or mlp_scale != 1.0):
        raise NotDescribed("a parallel block adding its branches times constants")
    block = BlockLayout(
        ln1=ln1,
        attn=attn,
        o_proj=o_proj,
        ln2=ln2,
        mlp=mlp,
        parallel=parallel,
        ln1_post=ln1_post,
        ln2_post=ln2_post,
        ln2_before_attn=parallel and ln2 is not None and _ran_before(rec, i, ln2, attn),
        attn_scale=attn_scale,
        mlp_scale=mlp_scale,
        attn_in_scale=attn_in_scale,
    )
    return LayerDescription(
        block,
        qkv,
        mlp_layout,
        norms,
        gated,
        act_fn,
        rotated_norms=rotated_norms,
        z_changed=bool(changed_z),
        shared_expert=(
            describe_sibling_expert(model, layer, i, sibling, mlp, rec)
            if sibling is not None
            else describe_shared_expert(model, layer, i, mlp_layout, rec)
        ),
    )


def _routed_and_shared(
    model: nn.Module, layer: nn.Module, i: int, three: Any, attn: str, rec: Recording
) -> Optional[tuple[str, str]]:
    """``(routed, shared)``: the two MLP modules of a layer whose split (:mod:`.parallel`) has the attention module
    alone before its middle and two modules after it, added as one sum (times one constant, or none): the mixture of
    experts and the one other module, which the dense description reads as a gated MLP (its points are a shared
    expert's, :func:`.shared_expert.describe_sibling_expert`); ``None`` for any other layer."""
    if three is None or three.scaled or three.before != (attn,) or len(three.after) != 2 or not three.after_grouped:
        return None
    from lensadapters.adapters.generic.moe import is_mixture

    routed = [n for n in three.after if is_mixture(layer.get_submodule(n))]
    if len(routed) != 1:
        return None
    shared = next(n for n in three.after if n != routed[0])
    try:
        _describe_mlp(model, layer, i, shared, rec)
    except NotDescribed:
        return None
    return routed[0], shared


def _describe_attention_only(
    layer: nn.Module,
    i: int,
    attn: str,
    call: InterfaceCall,
    rec: Recording,
    rotary: list[Optional[RotarySpec]],
    cos_sin: Optional[tuple[Tensor, Tensor]],
) -> LayerDescription:
    """A layer of one branch, its attention module (no other child with a weight matrix): ``out = x + attn(ln1 x)``
    on the probe, ``ln1`` a pre-norm as in :func:`describe_layer` (or none: the attention reads the layer's input).
    Its description is ``BlockLayout.no_mlp``, the MLP layout an ``OpaqueMLP`` saying there is none."""
    resid_pre, resid_post = rec.layer_in[i].value, rec.layer_out[i].value
    attn_in, attn_out = rec.inner.get((i, attn), (None, None))
    if attn_in is None or attn_out is None:
        raise NotDescribed("the probe did not see the attention module's input and output")
    norms: dict[str, NormBehaviour] = {}
    ln1 = None
    for name, child in layer.named_children():
        x, y = rec.inner.get((i, name), (None, None))
        if name == attn or x is None or y is None or not (_close(x, resid_pre) and _close(y, attn_in)):
            continue
        behaviour = norm_behaviour(child, x, y)
        if behaviour is not None and behaviour.eps is not None:  # a scale is served only with the module's own eps
            ln1, norms[name] = name, behaviour
            break
    if ln1 is None and not _close(attn_in, resid_pre):
        raise NotDescribed("the attention module reads neither the layer's input nor a pre-norm of it")
    if not _close(resid_post, resid_pre + attn_out):
        raise NotDescribed("the layer (one attention branch, no MLP) does not output its input plus the attention's")
    rotated_norms: dict[str, RotatedNorm] = {}
    changed_z: list[str] = []
    qkv, o_proj, qk_norms = _describe_attention(
        layer, i, attn, call, rec, rotary, cos_sin, attn_in, attn_out, rotated_norms, changed_z
    )
    norms.update(qk_norms)
    block = BlockLayout(ln1=ln1, attn=attn, o_proj=o_proj, ln2=None, no_mlp=True)
    none = OpaqueMLP("the block has no MLP (one branch, its attention)")
    return LayerDescription(
        block, qkv, none, norms, False, None, rotated_norms=rotated_norms, z_changed=bool(changed_z)
    )


def _ran_before(rec: Recording, i: int, first: str, then: str) -> bool:
    """Whether layer ``i``'s child ``first`` returned before its child ``then`` in the probe."""
    order = [e[2] for e in rec.events if e[:2] == ("child", i)]
    return first in order and then in order and order.index(first) < order.index(then)


def _branch_constants(i: int, layer: nn.Module, rec: Recording, attn: str, mlp: str) -> tuple[float, float]:
    """``(attn_scale, mlp_scale)``: the constants of its config the layer multiplies its attention and MLP outputs by
    before adding them (:mod:`.parallel`: ``mid = x + attn_out * c0`` exactly what its norm reads, ``out = mid +
    mlp_out * c1`` exactly its output), ``(1.0, 1.0)`` for a layer adding them as they are; a layer running a token
    mixer beside its attention module gives the attention's constant (the mixer's is its own sums',
    :mod:`.described_sums`), and so does one whose MLP is two modules summed, then times one constant (experts and
    a shared MLP, :func:`_routed_and_shared`). Another layer of three branch children added times constants is not
    described: a block has one attention and one MLP branch, each with one constant."""
    from lensadapters.adapters.generic.parallel import layer_split

    three = layer_split(i, layer, rec)
    if three is None or three.plain:
        return 1.0, 1.0
    if _beside_split(three, attn) and three.after == (mlp,) and three.summed:  # a mixer beside it (.parallel)
        return three.before_scales[three.before.index(attn)], three.after_scale
    if three.before == (attn,) and mlp in three.after and len(three.after) == 2 and three.summed:
        return three.before_scales[0], three.after_scale  # an MLP of two modules, their sum times one constant
    constants = ", ".join(f"{c:g}" for c in (*three.before_scales, three.after_scale))
    if three.scaled or three.before != (attn,) or three.after != (mlp,):
        raise NotDescribed(
            f"the layer adds its branches multiplied by constants of its config ({constants or 'none found'}), "
            "and a block description has one constant for its attention branch and one for its MLP, each one module"
        )
    return three.before_scales[0], three.after_scale


def _times(t: Tensor, c: float) -> Tensor:
    return t if c == 1.0 else t * c


def _parallel_mid(layer: nn.Module, i: int, rec: Recording, attn: str) -> Optional[Tensor]:
    """``resid_pre + attn_out +`` the output of the token mixer the layer runs beside its attention module before its
    middle, whose output it adds as it is (:mod:`.parallel`), in the order the layer adds them; ``None`` where there
    is no such mixer."""
    from lensadapters.adapters.generic.parallel import layer_split, mid_value

    three = layer_split(i, layer, rec)
    if three is None or not _beside_split(three, attn):
        return None
    return mid_value(rec.layer_in[i].value, i, rec, three)


def _beside_split(three: Any, attn: str) -> bool:
    """Whether a layer's :class:`.parallel.Split` runs one token mixer beside the attention module ``attn`` before
    its middle and one MLP module after it, adding their outputs as they are or each times a constant of its config
    (its own sum: :class:`.mixer_sites.SumSite` serves the branch points, :func:`.plugin.lensadapters_extra_sites`)."""
    return (
        not three.scaled
        and len(three.before) == 2
        and attn in three.before
        and len(three.after) == 1
        and three.after_grouped
    )


class NotThisShape(NotDescribed):
    """A layer is not of the shape a further describer reads (the first describer's reason is the layer's)."""


#: a further describer of a layer, tried where :func:`describe_layer` fails: ``(model, layer, i, recording, (rotary
#: candidates, (cos, sin)))`` to its description, :class:`NotThisShape` where the layer is not of its shape
LayerDescriber = Callable[[nn.Module, nn.Module, int, Recording, tuple[Any, Any]], LayerDescription]


def _describe_any(others: Sequence[LayerDescriber], *args: Any) -> LayerDescription:
    """A layer's description (:func:`describe_layer`'s arguments): one attention and one MLP child, else the first of
    ``others`` that describes it; the first reason where none does."""
    try:
        return describe_layer(*args)
    except NotDescribed as why:
        model, layer, i, found, rec, rotary, cos_sin = args
        if "hook_resid_pre" not in found.points:
            raise
        for other in others:
            try:
                return other(model, layer, i, rec, (rotary, cos_sin))
            except NotThisShape:
                continue
        raise why from None


def describe(
    model: nn.Module,
    layers: list[nn.Module],
    blocks: tuple[Any, ...],
    rec: Recording,
    others: Sequence[LayerDescriber] = (),
) -> Description:
    """Each layer's description (``others``: further describers, tried in turn where :func:`describe_layer` fails)."""
    first = next((c for c in rec.calls + rec.own_calls if c.layer is not None), None)
    d_head = first.d_head if first is not None else 0
    rotary_path, cos_sin = _rotary_module(model, rec, d_head)
    rotaries: list[Optional[RotarySpec]] = [None]
    if cos_sin is not None:
        rotaries = [*_rotary_candidates(d_head, text_config(model), cos_sin[0]), None]
    out = Description([None] * len(layers), rotary=rotary_path)
    complex_table = next(
        (
            f"the rotary module {name} returns a complex table (rotary as complex multiplication), not the (cos, sin) "
            f"the description reads"
            for name, record in rec.outside_out.items()
            if cos_sin is None and record.value.is_complex()
        ),
        None,
    )
    inside = _rotary_inside_attention(model, layers, rec) if rotary_path is None else None
    if inside is not None:  # a rotary module inside each attention module, the same angles in every layer
        out.rotary, out.rotary_from_inputs, cos_sin = inside
        rotaries = [*_rotary_candidates(d_head, text_config(model), cos_sin[0]), None]
    elif rotary_path is None:  # the layers' (cos, sin) differ: read where each attention module is given them
        out.rotary_input = "position_embeddings"
    for i, (layer, found) in enumerate(zip(layers, blocks)):
        try:
            layer_rotaries, layer_cos_sin = rotaries, cos_sin
            if rotary_path is None and inside is None:
                given = [v for (j, path), v in rec.position_embeddings.items() if j == i and "." not in path]
                if given:
                    layer_cos_sin = given[0]
                    layer_rotaries = [*_rotary_candidates(d_head, text_config(model), given[0][0]), None]
            out.layers[i] = _describe_any(others, model, layer, i, found, rec, layer_rotaries, layer_cos_sin)
        except NotDescribed as why:
            out.why[i] = str(why) + (f"; {complex_table}" if complex_table and "rotary" in str(why) else "")
        except Exception as exc:  # anything unexpected: the layer is not described
            out.why[i] = f"describing it raised {type(exc).__name__}: {exc}"
    if not any(layer is not None and layer.qkv.rotary is not None for layer in out.layers):
        out.rotary = out.rotary_input = out.rotary_from_inputs = None
    else:
        spec = next(layer.qkv.rotary for layer in out.layers if layer is not None and layer.qkv.rotary is not None)
        out.rotary_dim = spec.rotary_dim if spec is not None else None
    return out
