"""Tiny models of every causal-LM ``model_type`` transformers knows, built from its default config alone.

:func:`shrink_config` makes a default config tiny by the field names transformers' configs share (layers, widths,
heads, experts, vocabulary; lists with one entry per layer are cut to the new number of layers), in the config and
in each of its sub-configs; :func:`build` builds the model, or says why it cannot be built from a config alone.
Nothing here names an architecture: the census (``tests/test_every_model_type.py``) runs over whatever the installed
transformers lists in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

LAYERS = 4  # enough for hybrids to have a layer of each kind (three linear-attention layers, then attention)
WIDTH = 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
VOCAB = 128
EXPERTS, EXPERTS_PER_TOKEN = 4, 2
MAX_PARAMETERS = 12_000_000  # larger after shrinking: a field the rules do not know kept its full size

_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "decoder_layers")
_EXACT: dict[str, int] = {
    "hidden_size": WIDTH,
    "d_model": WIDTH,
    "n_embd": WIDTH,
    "n_embed": WIDTH,
    "embed_dim": WIDTH,
    "dim": WIDTH,
    "word_embed_proj_dim": WIDTH,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "n_heads": HEADS,
    "num_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "n_kv_heads": KV_HEADS,
    "num_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS,
    "head_dim": HEAD_DIM,
    "rotary_dim": HEAD_DIM // 2,
    "vocab_size": VOCAB,
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": EXPERTS_PER_TOKEN,
    "moe_topk": EXPERTS_PER_TOKEN,
    "moe_k": EXPERTS_PER_TOKEN,
    "num_experts_per_token": EXPERTS_PER_TOKEN,
    "top_k": EXPERTS_PER_TOKEN,
    "n_group": 1,
    "topk_group": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": HEAD_DIM,  # where a config derives head_dim from it (multi-head latent attention), equal
    "qk_nope_head_dim": 8,
    "v_head_dim": HEAD_DIM,
    "linear_num_heads": HEADS,
    "linear_head_dim": HEAD_DIM,
    "index_n_heads": HEADS,
    "index_head_dim": HEAD_DIM,
    "emb_dim": WIDTH,
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "mamba_d_head": HEAD_DIM,
    "mamba_head_dim": HEAD_DIM,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "state_size": 16,
    "d_state": 16,
    "chunk_size": 16,  # a state-space scan pads the sequence to a whole chunk: 256 makes each forward slow
    "mamba_chunk_size": 16,
}
_MAX_POSITIONS = 256
_WIDTHS = tuple(k for k, v in _EXACT.items() if v == WIDTH)
#: counts a default config may leave ``None`` that every released checkpoint of a mixture of experts states: the
#: experts chosen per token (never more than the experts), the expert groups, the routed and the shared experts
_MISSING_COUNTS: dict[str, int] = {
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"), EXPERTS_PER_TOKEN),
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": EXPERTS,
    "n_shared_experts": 1,
}
#: options a default config turns off with ``None`` that some model's code cannot turn off, as released checkpoints
#: set them (DBRX's and OLMo-1.7's query/key/value clipping): filled only where the model fails without them
_OPTIONS: dict[str, float] = {"clip_qkv": 8.0}
#: switches a default config turns on that ask for fused GPU kernels the model's code refuses to run without
#: (Jamba's ``use_mamba_kernels`` under transformers 4.x): turned off, with the options, only where the model fails
_KERNEL_SWITCHES: dict[str, bool] = {"use_mamba_kernels": False}


def _shrink_value(key: str, value: Any, layers_before: int, layers: int) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if key in _EXACT:
            return min(value, _EXACT[key]) if value > 0 else value
        if key.endswith("vocab_size") or key.endswith("vocab_size_per_layer_input"):
            return min(value, VOCAB)
        if key.endswith("hidden_size") or key.endswith("hidden_size_per_layer_input"):
            return min(value, WIDTH)
        if "intermediate_size" in key or key in ("ffn_dim", "n_inner", "ffn_hidden_size", "mlp_dim", "d_ff"):
            return min(value, 2 * WIDTH) if value > 0 else value
        if key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
            return min(value, _MAX_POSITIONS)
        if key.endswith("_token_id") and value >= VOCAB:
            return VOCAB - 1
        return value
    if isinstance(value, list) and layers_before > layers and len(value) == layers_before:
        return value[:layers]
    if isinstance(value, list) and key.endswith("intermediate_size") and all(isinstance(v, int) for v in value):
        return [min(v, 2 * WIDTH) for v in value]
    return value


def shrink_config(config: Any, layers: int = LAYERS, options: bool = False) -> Any:
    """``config`` (changed in place and returned) with few layers, small widths, few heads and a small vocabulary;
    the counts it leaves ``None`` filled (:func:`_fill_missing`), and with ``options`` the :data:`_OPTIONS` and
    :data:`_KERNEL_SWITCHES` too."""
    values = config.__dict__
    layers_before = next((values[k] for k in _LAYER_KEYS if isinstance(values.get(k), int)), 0)
    multi_head = values.get("num_key_value_heads") is not None and values.get("num_key_value_heads") == values.get(
        "num_attention_heads"
    )
    products = _head_products(values)
    for key in list(values):
        value = values[key]
        if hasattr(value, "to_dict") and hasattr(value, "__dict__") and not isinstance(value, type):
            shrink_config(value, layers, options)
        elif key in _LAYER_KEYS and isinstance(value, int):
            values[key] = min(value, layers)
        elif key.endswith("_token_id") and isinstance(value, list):
            values[key] = [min(v, VOCAB - 1) if isinstance(v, int) else v for v in value]
        else:
            try:
                values[key] = _shrink_value(key, value, layers_before, layers)
            except Exception:  # a property without a setter: keep it
                pass
    _keep_derived_fields(values, multi_head)
    _keep_head_products(values, products)
    _fill_missing(values)
    values.update({k: v for k, v in _OPTIONS.items() if options and k in values and values[k] is None})
    values.update({k: v for k, v in _KERNEL_SWITCHES.items() if options and k in values})
    if options:
        _attention_layer(values)
    return config


def _attention_layer(values: dict[str, Any]) -> None:
    """A per-layer ``layer_types`` list that names only ``linear_attention`` (a hybrid's default config, all
    state-space layers, which transformers' own mask code cannot run: it reads the sequence length from an
    attention layer's cache) gets ``full_attention`` as its last entry, as every released checkpoint of a hybrid has
    attention layers; filled only where the model fails without it (with the :data:`_OPTIONS`)."""
    types = values.get("layer_types")
    if isinstance(types, list) and len(types) > 1 and set(types) == {"linear_attention"}:
        values["layer_types"] = [*types[:-1], "full_attention"]


def _fill_missing(values: dict[str, Any]) -> None:
    """Fields the default config leaves ``None`` (or a sub-config lacks) that the model reads, filled as a released
    checkpoint of the type has them: a head size of ``hidden_size / num_attention_heads``, as many key/value heads
    as query heads (the convention of every config that defaults them), the mixture-of-experts counts of
    :data:`_MISSING_COUNTS`, one ``full_attention`` layer type per layer, and the rope theta of ``rope_parameters`` in
    a sub-config of part of a layer (no layers or width of its own) that states no rope of its own."""
    if "head_dim" in values and values["head_dim"] is None and _ints(values, ["hidden_size", "num_attention_heads"]):
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values.get("num_key_value_heads", 0) is None and _ints(values, ["num_attention_heads"]):
        values["num_key_value_heads"] = values["num_attention_heads"]
    for key, count in _MISSING_COUNTS.items():
        if key in values and values[key] is None:
            values[key] = count
    layers = next((values[k] for k in _LAYER_KEYS if _ints(values, [k])), 0)
    if "layer_types" in values and values["layer_types"] is None and layers:
        values["layer_types"] = ["full_attention"] * layers
    rope = values.get("rope_parameters")
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    for sub in (v for v in values.values() if hasattr(v, "to_dict") and not isinstance(v, type)):
        part = sub.__dict__
        if theta is not None and not any(k in part for k in (*_LAYER_KEYS, *_WIDTHS, "rope_theta", "rope_parameters")):
            part["rope_theta"] = theta


def _ints(values: dict[str, Any], keys: list[str]) -> bool:
    return all(isinstance(values.get(k), int) and not isinstance(values[k], bool) and values[k] > 0 for k in keys)


def _stem(key: str) -> str:
    for part in ("num_", "n_", "heads", "head_dim", "headdim", "d_head"):
        key = key.replace(part, "")
    return key.strip("_")


def _head_products(values: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...]]]:
    """The (heads, head size, what their product equals) relations of the full-size config, for a number of heads
    and a head size of the same name (``n_mamba_heads`` and ``mamba_headdim``): their product is an inner width,
    ``expand`` times the hidden size, or a width field of its own (``mamba_d_ssm``, ``attention_hidden_size``)."""
    heads = [k for k in values if k.endswith("heads") and "key_value" not in k and "kv" not in k]
    sizes = [k for k in values if k.endswith(("head_dim", "headdim", "d_head"))]
    expands = [k for k in values if k.endswith("expand")]
    widths = [k for k in values if k.endswith(("d_ssm", "hidden_size")) and k != "hidden_size"]
    relations: list[tuple[str, str, tuple[str, ...]]] = []
    for head, size in ((h, d) for h in heads for d in sizes if _stem(h) == _stem(d) and _ints(values, [h, d])):
        product = values[head] * values[size]
        for expand in (e for e in expands if _ints(values, [e, "hidden_size"])):
            if product == values[expand] * values["hidden_size"]:
                relations.append((head, size, (expand, "hidden_size")))
        relations += [(head, size, (w,)) for w in widths if _ints(values, [w]) and product == values[w]]
    return relations


def _keep_head_products(values: dict[str, Any], relations: list[tuple[str, str, tuple[str, ...]]]) -> None:
    """Keep each relation :func:`_head_products` found: the inner width follows the shrunk ``expand`` times hidden
    size (the head size is what gives), and an inner-width field of its own follows the shrunk heads and head size."""
    for head, size, (*factors,) in relations:
        if len(factors) == 2:
            width = values[factors[0]] * values[factors[1]]
            if width % values[head] == 0:
                values[size] = width // values[head]
        else:
            values[factors[0]] = values[head] * values[size]


def _keep_derived_fields(values: dict[str, Any], multi_head: bool) -> None:
    """Fields a config computes from others when it is made keep that relation after shrinking: a model whose
    key/value heads were its query heads (multi-head latent attention projects every head's keys) keeps them so,
    and a query/key head size that is the sum of its rotary and non-rotary parts stays their sum."""
    if multi_head:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if _ints(values, ["qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim"]):
        values["qk_head_dim"] = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]


class NotBuildable(Exception):
    """The model type cannot be built as a tiny model from its config alone (the message says why)."""


def build(model_type: str, seed: int = 0, layers: Optional[int] = None) -> torch.nn.Module:
    """A tiny eval-mode model of ``model_type`` with float32 weights; :class:`NotBuildable` says why not.

    Tried with :data:`LAYERS` layers, then twice as many (a hybrid whose first layers are all linear attention may
    need more to have an attention layer at all), then with the :data:`_OPTIONS` its config turns off (the
    :data:`_KERNEL_SWITCHES` it turns on, and an attention layer where its ``layer_types`` has none,
    :func:`_attention_layer`). With ``layers``, that count alone (without, then with the options): a caller
    needing a layer of each kind of a hybrid whose pattern the default count cuts short."""
    if layers is not None:  # a count the caller needs (a hybrid's layers of every kind), with the options if need be
        try:
            return _build(model_type, seed, layers)
        except NotBuildable:
            return _build(model_type, seed, layers, options=True)
    try:
        return _build(model_type, seed, LAYERS)
    except NotBuildable:
        pass
    try:
        return _build(model_type, seed, 2 * LAYERS)
    except NotBuildable as why:
        try:
            return _build(model_type, seed, LAYERS, options=True)
        except NotBuildable:
            raise why from None


def _build(model_type: str, seed: int, layers: int, options: bool = False) -> torch.nn.Module:
    from transformers import AutoConfig

    try:
        auto, config = causal_lm_class(shrink_config(AutoConfig.for_model(model_type), layers, options))
    except Exception as error:
        raise NotBuildable(f"no default config: {type(error).__name__}: {error}") from error
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with torch.device("meta"):  # the size first, without allocating
                    _check_size(auto.from_config(config))
            except NotImplementedError:  # a module reads a tensor's value when it is made (xIELU): once built
                pass
            torch.manual_seed(seed)
            model = _check_size(auto.from_config(config, torch_dtype=torch.float32))
    except NotBuildable:
        raise
    except Exception as error:
        raise NotBuildable(f"{type(error).__name__}: {str(error)[:300]}") from error
    model.eval()
    try:  # the shrunk config is consistent only if the model runs
        with torch.no_grad():
            model(input_ids())
    except Exception as error:
        raise NotBuildable(f"the tiny model's own forward fails: {type(error).__name__}: {str(error)[:300]}") from error
    return model


def causal_lm_class(config: Any) -> tuple[Any, Any]:
    """How ``AutoModelForCausalLM.from_pretrained`` builds ``config``'s causal LM (and transformers 5's
    ``from_config``): a composite config (``Llama4Config``) whose mapped class takes its text config
    (``Llama4ForCausalLM``: ``Llama4TextConfig``) builds that class from the text config, ``(class, text
    config)``; any other config ``(AutoModelForCausalLM, config)``. (Transformers 4's ``from_config`` builds the
    class from the composite config, whose top level lacks the text model's fields: ``vocab_size``...)"""
    from transformers import AutoModelForCausalLM

    mapping: Any = AutoModelForCausalLM._model_mapping
    text_config = getattr(config, "sub_configs", {}).get("text_config")
    if text_config is not None and type(config) in mapping:
        model_class = mapping[type(config)]
        if getattr(model_class, "config_class", None) is text_config:
            return _FromConfig(model_class), config.get_text_config()
    return AutoModelForCausalLM, config


class _FromConfig:
    """A model class's ``_from_config`` as ``from_config`` (what ``AutoModelForCausalLM.from_config`` calls)."""

    def __init__(self, model_class: Any) -> None:
        self.model_class = model_class

    def from_config(self, config: Any, **kwargs: Any) -> Any:
        return self.model_class._from_config(config, **kwargs)


def _check_size(model: torch.nn.Module) -> torch.nn.Module:
    size = sum(p.numel() for p in model.parameters())
    if size > MAX_PARAMETERS:
        raise NotBuildable(f"{size} parameters after shrinking the config: a field kept its full size")
    return model


def input_ids(seed: int = 0) -> torch.Tensor:
    """The token ids the census runs (batch 1, 6 tokens, none of them a special token of the tiny vocabulary)."""
    return torch.randint(3, VOCAB - 2, (1, 6), generator=torch.Generator().manual_seed(seed))
