"""GPT-J for lensadapters: an example *third-party* plugin (its own distribution, found by entry point).

Quirks handled:

* Separate ``q_proj``/``k_proj``/``v_proj`` and ``out_proj`` without bias (``b_Q``... are zeros).
* Rotary embeddings on **interleaved pairs** of dimensions (``rotate_every_two``: dims ``2i`` and
  ``2i + 1`` rotate together) on the first ``rotary_dim`` dimensions of each head (all of them when
  ``rotary_dim`` is ``None``). Two layouts of the sin/cos table (``embed_positions``), both served: up to
  transformers 5.23 each attention module keeps one and indexes it with ``position_ids``; from 5.24 the
  model's rotary module (``transformer.rotary_emb``) keeps it and passes each attention module
  ``position_embeddings=(sin, cos)``. The plugin reads them from the first attention module's inputs
  (``ModelLayout.rotary_from_inputs``), so ``hook_rot_q``/``hook_rot_k`` are
  bitwise the rotated queries/keys and their edits are inverted into the projection outputs (the KV
  cache stores edited keys).
* Parallel attention and MLP reading **one** norm: ``x + attn(ln_1 x) + mlp(ln_1 x)``. There is no
  ``ln_2``, so the blocks have no ``ln2.*`` points, no ``hook_resid_mid`` and no ``hook_mlp_in`` (as in
  TransformerLens' default ``use_hook_mlp_in=False``); ``ln1.*`` is the shared norm, so an edit there
  reaches both branches.
* Up to transformers 5.23 GPT-J computes attention in its own ``GPTJAttention._attn`` method instead of
  transformers' attention interface, so the core's pattern backend cannot see it (from 5.24 it calls the
  interface, scores in float32, and the core's backend serves it). :class:`GPTJPatternBackend` exposes and edits
  ``hook_attn_scores``/``hook_pattern`` by giving the attention modules of hooked layers an instance
  attribute ``_attn`` (never the class), only while a score/pattern hook exists on that layer; see the
  README for why this and not something else.

Pattern hooks need eager attention up to transformers 5.23 (GPT-J's only implementation there besides
flash-attention 2); from 5.24, eager or sdpa (5.24's default for GPT-J). Every other hook point works with any
implementation.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lensadapters import (
    Architecture,
    BlockLayout,
    LensAdaptersError,
    MLPLayout,
    RotarySpec,
    SeparateQKV,
    UnsupportedModelError,
    hf,
    hookimpl,
)
from lensadapters.plugin_api import override_instance_method, site_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
LENSADAPTERS_HOOKSPEC = "1"
# the contract-suite class that `lensadapters check gptj` runs (imported only by the check command)
LENSADAPTERS_CONTRACT = "lensadapters_gptj.contract:GPTJContract"

ARCH = Architecture(
    name="gptj",
    model_types=("gptj",),
    description="GPT-J (GPTJForCausalLM, GPTJModel)",
    transformers=">=4.57,<6",
    # up to 5.23 GPT-J computes attention in its own _attn (eager only: it has no sdpa); from 5.24 through the
    # attention interface, eager or sdpa
    attn_implementations=("eager", "sdpa"),
)

Tensor = torch.Tensor


def _d_head(config: Any) -> int:
    return config.n_embd // config.n_head


def _rotary_dim(config: Any) -> int:
    return config.rotary_dim if config.rotary_dim is not None else _d_head(config)


# --- interleaved ("rotate every two") RoPE ---------------------------------------------------------------


def rotate_every_two(x: Tensor) -> Tensor:
    """``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``: each adjacent pair turned by 90 degrees."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _pairs(t: Tensor, like: Tensor) -> Tensor:
    """``[b, p, r/2]`` sin or cos → ``[b, p, 1, r]`` (each frequency repeated for its pair), in ``like``'s dtype."""
    return torch.repeat_interleave(t.to(like.dtype)[:, :, None, :], 2, 3)


def _check(x: Tensor, cos: Tensor, rotary_dim: int) -> int:
    r = 2 * cos.shape[-1]
    if r != rotary_dim or r > x.shape[-1]:
        raise RuntimeError(
            f"GPT-J's sin/cos table covers {r} dimensions, but the plugin expected rotary_dim={rotary_dim} "
            f"(heads of size {x.shape[-1]}); the model's layout differs from its config"
        )
    return r


def apply_rotate_every_two(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """GPT-J's rotation of the first ``rotary_dim`` dims of ``x`` (``[b, p, h, d_head]``), op for op."""
    r = _check(x, cos, rotary_dim)
    x_rot, x_pass = x[..., :r], x[..., r:]
    rotated = (x_rot * _pairs(cos, x_rot)) + (rotate_every_two(x_rot) * _pairs(sin, x_rot))
    return torch.cat([rotated, x_pass], dim=-1)


def invert_rotate_every_two(y: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """The ``x`` with ``apply_rotate_every_two(x) == y`` (float32): ``(y c - rot(y) s) / (c² + s²)`` per pair."""
    r = _check(y, cos, rotary_dim)
    y_rot, y_pass = y[..., :r].float(), y[..., r:]
    c, s = _pairs(cos, y_rot), _pairs(sin, y_rot)
    x_rot = (y_rot * c - rotate_every_two(y_rot) * s) / (c * c + s * s)
    return torch.cat([x_rot.to(y.dtype), y_pass], dim=-1)


def rotate_every_two_spec(rotary_dim: int) -> RotarySpec:
    return RotarySpec(
        rotary_dim,
        lambda x, cos, sin: apply_rotate_every_two(x, cos, sin, rotary_dim),
        lambda y, cos, sin: invert_rotate_every_two(y, cos, sin, rotary_dim),
    )


def rotary_from_attention_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` as ``[b, p, rotary_dim / 2]``: what ``GPTJAttention.forward`` rotates with (from 5.24 its
    ``position_embeddings=(sin, cos)`` argument; before, what it gathers from its own ``embed_positions``)."""
    position_embeddings = kwargs.get("position_embeddings")
    if position_embeddings is not None:
        sin, cos = position_embeddings
        return cos, sin
    position_ids = kwargs.get("position_ids")
    if position_ids is None and len(args) > 3:
        position_ids = args[3]
    if position_ids is None:
        raise RuntimeError("GPT-J attention was called without position_ids; hook_rot_q/hook_rot_k need them")
    table = module.embed_positions.to(position_ids.device)  # [n_positions, rotary_dim]: sin | cos
    sincos = table[position_ids]
    sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
    return cos, sin


# --- attention patterns: GPT-J's own ``_attn`` ------------------------------------------------------------


def _gptj_scores(module: nn.Module, query: Tensor, key: Tensor, scaling: Optional[float]) -> Tensor:
    """Pre-mask scores as ``GPTJAttention._attn`` computes them: in float32, divided by ``scale_attn``."""
    return torch.matmul(query.to(torch.float32), key.to(torch.float32).transpose(-1, -2)) / module.scale_attn


class GPTJPatternBackend:
    """Serves ``hook_attn_scores``/``hook_pattern`` for models that compute attention in ``GPTJAttention._attn``.

    ``activate(layer, site)`` stores a function under the name ``_attn`` in *that attention module
    instance's* ``__dict__``. Python finds instance attributes before class attributes, so that module's
    ``forward`` calls it with exactly the arguments it would pass to ``GPTJAttention._attn`` (queries and
    keys after rotary and the KV-cache update, values, the additive mask); it returns what ``_attn``
    returns, computed with the core's explicit attention (scores → ``hook_attn_scores`` → softmax →
    ``hook_pattern`` → values). The returned handle's ``remove()`` deletes the instance attribute
    again; the core calls it when the layer's last score/pattern hook goes, when a hook raises, and on
    ``unwrap()``. The class, other instances and other layers are never touched.
    """

    def __init__(self, hooked: Any) -> None:
        self.modules: list[nn.Module] = list(hooked.attention_modules)

    def activate(self, layer: int, site: Any) -> Any:
        from transformers.models.gptj.modeling_gptj import GPTJAttention

        module = self.modules[layer]
        if type(module).forward is not GPTJAttention.forward:
            raise UnsupportedModelError(
                f"layer {layer}: hook_attn_scores/hook_pattern need GPT-J's eager attention, which computes "
                f"patterns in GPTJAttention._attn; this model's attention is {type(module).__name__} (attention "
                f"implementation {getattr(module.config, '_attn_implementation', '?')!r}). Load the model with "
                f"attn_implementation='eager' to hook patterns; every other hook point works as it is."
            )
        if "_attn" in vars(module):
            raise LensAdaptersError(
                f"layer {layer}: the attention module already has an instance attribute '_attn' (another tool "
                f"replaced its attention for this instance); lensadapters will not override it"
            )
        attend = site_attention(site, module, _gptj_scores)

        def _attn(
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask: Optional[Tensor] = None,
            head_mask: Optional[Tensor] = None,
        ) -> tuple[Tensor, Tensor]:
            out, pattern = attend(query, key, value, attention_mask, dropout=module.attn_dropout.p, head_mask=head_mask)
            return out.transpose(1, 2), pattern  # GPT-J's _attn returns [b, h, q, d]

        return override_instance_method(module, "_attn", _attn)  # a copy of the model gets GPT-J's own _attn back


# --- the adapter hooks ------------------------------------------------------------------------------------


@hookimpl
def lensadapters_architectures() -> list[Architecture]:
    return [ARCH]


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    from transformers.models.gptj import modeling_gptj

    c = model.config
    if c.n_embd % c.n_head:
        raise UnsupportedModelError(f"GPT-J with n_embd={c.n_embd} not divisible by n_head={c.n_head}")
    d_head, r = _d_head(c), _rotary_dim(c)
    if r % 2 or r > d_head:
        raise UnsupportedModelError(f"GPT-J with rotary_dim={c.rotary_dim}: must be even and at most d_head={d_head}")
    base = hf.base_model(model)
    for attr in ("wte", "h", "ln_f"):
        if not hasattr(base, attr):
            raise UnsupportedModelError(
                f"this GPT-J model has no {attr!r} module: its layout differs from transformers' GPTJModel"
            )
    for i, block in enumerate(base.h):
        m = modeling_gptj
        for name, cls in (("", m.GPTJBlock), ("attn", m.GPTJAttention), ("mlp", m.GPTJMLP)):
            module = block.get_submodule(name) if name else block
            if not isinstance(module, cls):
                raise UnsupportedModelError(
                    f"layer {i}: expected a transformers {cls.__name__}, found {type(module).__name__}"
                )
        if not isinstance(block.ln_1, nn.LayerNorm) or hasattr(block, "ln_2"):
            raise UnsupportedModelError(f"layer {i}: expected one shared nn.LayerNorm ln_1 and no ln_2")
        forwards = (modeling_gptj.GPTJBlock.forward, modeling_gptj.GPTJMLP.forward)
        if (type(block).forward, type(block.mlp).forward) != forwards:
            warnings.warn(
                f"layer {i}: {type(block).__name__} overrides transformers' GPT-J forward; hook points "
                f"may not mean what their names say",
                stacklevel=2,
            )
        # the table: the attention module's own (transformers < 5.24) or the model's rotary module's (>= 5.24)
        table = getattr(block.attn, "embed_positions", None)
        if table is None:
            table = getattr(getattr(base, "rotary_emb", None), "embed_positions", None)
        if table is None or table.shape[-1] != r:
            raise UnsupportedModelError(
                f"layer {i}: the attention's sin/cos table has {None if table is None else table.shape[-1]} "
                f"columns, not rotary_dim={r}"
                + (
                    " (transformers builds it n_embd wide when rotary_dim is None, "
                    "which works only with one head; set rotary_dim=d_head)"
                    if c.rotary_dim is None
                    else ""
                )
            )


def _config_fields(model: PreTrainedModel) -> dict[str, Any]:
    """GPT-J's ``hm.cfg`` fields beyond the shared ones (``hf.hooked_config``): rotary on interleaved pairs of
    ``rotary_dim`` dimensions, attention and MLP in parallel on one norm."""
    c = model.config
    return dict(
        d_head=_d_head(c),
        d_mlp=c.n_inner if c.n_inner is not None else 4 * c.n_embd,
        act_fn=c.activation_function,
        normalization_type="LN",
        positional_embedding_type="rotary",
        rotary_dim=_rotary_dim(c),
        parallel_attn_mlp=True,
        eps=c.layer_norm_epsilon,
        extra={"rotary_adjacent_pairs": True},
    )


lensadapters_config = hf.hooked_config(_config_fields)
lensadapters_embed = hf.model_layout(
    blocks="h", embed="wte", ln_final="ln_f", rotary="h.0.attn", rotary_from_inputs=rotary_from_attention_inputs
)


@hookimpl
def lensadapters_block(arch: Architecture, model: PreTrainedModel, layer: int) -> BlockLayout:
    return BlockLayout(ln1="ln_1", attn="attn", o_proj="attn.out_proj", ln2=None, mlp="mlp", parallel=True)


@hookimpl
def lensadapters_attn_qkv(arch: Architecture, model: PreTrainedModel, layer: int) -> SeparateQKV:
    return SeparateQKV(
        "attn.q_proj", "attn.k_proj", "attn.v_proj", rotary=rotate_every_two_spec(_rotary_dim(model.config))
    )


@hookimpl
def lensadapters_mlp_act(arch: Architecture, model: PreTrainedModel, layer: int) -> MLPLayout:
    return MLPLayout(pre="mlp.fc_in", out="mlp.fc_out")


def _own_attention() -> bool:
    """Whether GPT-J computes attention in its own ``GPTJAttention._attn`` (transformers < 5.24); from 5.24 it calls
    transformers' attention interface, which the core's pattern backend serves."""
    from transformers.models.gptj.modeling_gptj import GPTJAttention

    return hasattr(GPTJAttention, "_attn")


@hookimpl
def lensadapters_attn_pattern(arch: Architecture, hooked: Any) -> Optional[GPTJPatternBackend]:
    return GPTJPatternBackend(hooked) if _own_attention() else None  # None: the core's interface backend


@hookimpl
def lensadapters_attn_scores(
    arch: Architecture, module: nn.Module, query: Tensor, key: Tensor, scaling: Optional[float], implementation: str
) -> Optional[Tensor]:
    """Pre-mask scores as the configured implementation computes them: transformers 5.24's GPT-J
    ``eager_attention_forward`` in float32; sdpa in the queries' dtype (the core's default)."""
    if scaling is None or implementation != "eager":
        return None
    return torch.matmul(query.to(torch.float32), key.to(torch.float32).transpose(-1, -2)) * scaling


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    from transformers import GPTJConfig

    sizes = hf.size_fields(hidden=64, layers=2, heads=4, positions=128, vocab=512)
    return hf.without_dropout(GPTJConfig, **sizes, rotary_dim=8, bos_token_id=0, eos_token_id=0)
