"""The probe: one short forward pass at wrap time that shows what the model does, so nothing is guessed.

The generic adapter cannot read a model's code, so it watches one forward pass over a few tokens (batch 1, no
cache, gradients off, every module in eval mode and put back as it was, the random state restored) with
PyTorch hooks on the decoder layers, their direct children and the modules outside the layers, and with
transformers' attention interface pointed at a recording function (registered under its own key, with the eager
mask; the configuration is restored afterwards). It records:

* the order in which each layer and each of its children run, with copies of their inputs and outputs;
* every call of the attention interface: the module it is called with, the arguments it gets, and whether the
  core's explicit attention (``q·kᵀ·scaling``, masked, softmax, ``·v``) reproduces the weights and the output of
  the model's own eager attention function on exactly those arguments;
* which tensors the model writes into in place after they were produced (a cached value must not change later);
* the model's last hidden state: the input of the unembedding (``last_hidden_state`` of a model without one), and
  its logits. The probe does not ask for ``output_hidden_states``, which would make transformers install hooks of
  its own.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.hooks.explicit_attention import default_scores, explicit_attention
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import first_input, first_output

Tensor = torch.Tensor
PROBE_KEY = "lensadapters-probe:eager"
PROBE_LENGTH = 6
_current = threading.local()
_registered: list[bool] = []

#: arguments of the attention interface that do not change the computation the explicit attention reproduces
#: (masks carry the sliding window; the rest are bookkeeping or kernel hints)
NEUTRAL_ATTENTION_KWARGS = frozenset(
    {
        "dropout",
        "scaling",
        "sliding_window",
        "position_ids",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "use_cache",
        "cache_position",
        "layer_idx",
        "past_key_value",
        "past_key_values",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "num_items_in_batch",
        "head_mask",
    }
)
#: arguments the core's explicit attention reproduces as eager attention applies them (an attention-score softcap;
#: a learned per-head sink logit joining the softmax): patterns are served where the probe finds its numbers equal
SCORE_ARGUMENTS = frozenset({"softcap", "s_aux"})


def _unusual_arguments(module: nn.Module, kwargs: dict, mask: Optional[Tensor]) -> list[str]:
    """The arguments of an attention-interface call that plain masked softmax attention does not account for."""
    unusual = []
    for name, value in kwargs.items():
        if name == "is_causal":  # without a mask, explicit attention is causal as the module says; a mask decides
            if mask is None and value is not None and bool(value) != bool(getattr(module, "is_causal", True)):
                unusual.append(name)
        elif name not in NEUTRAL_ATTENTION_KWARGS | SCORE_ARGUMENTS and value is not None and value is not False:
            unusual.append(name)
    return sorted(unusual)


@dataclass
class Record:
    """A tensor the model computed: a copy of its value, and whether the model wrote into it afterwards."""

    value: Tensor
    tensor: Tensor
    version: int
    calls: int = 1

    @classmethod
    def of(cls, tensor: Tensor) -> "Record":
        return cls(tensor.detach().clone(), tensor, _version(tensor))

    @property
    def written_later(self) -> bool:
        return _version(self.tensor) != self.version


@dataclass
class InterfaceCall:
    """One call of transformers' attention interface during the probe."""

    module: nn.Module
    layer: Optional[int]
    heads: int
    kv_heads: int
    d_head: int
    output: Record
    pattern_problem: Optional[str]  # None: the explicit attention reproduces this call exactly
    query: Optional[Tensor] = None  # the arguments it got ``[b, heads, p, d_head]`` (copies)
    key: Optional[Tensor] = None
    value: Optional[Tensor] = None
    weights: Optional[Tensor] = None  # the model's own eager attention weights on them


@dataclass
class Recording:
    events: list[tuple[Any, ...]] = field(default_factory=list)
    layer_in: dict[int, Record] = field(default_factory=dict)
    layer_out: dict[int, Record] = field(default_factory=dict)
    layer_calls: dict[int, int] = field(default_factory=dict)
    children: dict[tuple[int, str], Record] = field(default_factory=dict)
    outside_in: dict[str, Optional[Tensor]] = field(default_factory=dict)
    outside_out: dict[str, Record] = field(default_factory=dict)
    calls: list[InterfaceCall] = field(default_factory=list)
    last_hidden: Optional[Tensor] = None
    input_ids: Optional[Tensor] = None  # the probe's tokens
    first_layer_in: Optional[Tensor] = None  # the first layer's input, the first time it runs
    logits: Optional[Tensor] = None  # the model's output logits (``None`` for a model without a head)
    owner: dict[int, int] = field(default_factory=dict)  # id(module) -> index of the layer holding it
    #: every module inside the layers, by (layer, path relative to the layer): its first input and first output
    #: (copies, the first call), in the order they returned
    inner: dict[tuple[int, str], tuple[Optional[Tensor], Optional[Tensor]]] = field(default_factory=dict)
    outside_raw: dict[str, Any] = field(default_factory=dict)  # a module outside the layers: its whole output
    #: a module inside the layers given ``position_embeddings`` (a layer's ``(cos, sin)``): those, by (layer, path)
    position_embeddings: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(default_factory=dict)
    #: a module inside the layers that returned two tensors of one shape (a rotary module's ``(cos, sin)``): those
    pairs: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(default_factory=dict)
    #: attention a layer computes in the model's own code, where it calls no attention interface (:mod:`.own_attention`)
    own_calls: list[InterfaceCall] = field(default_factory=list)
    own_why: dict[int, str] = field(default_factory=dict)  # a layer without either: why not
    #: whether the probe ran its attention through its entry of transformers' attention interface; not where the
    #: model looks its attention function up in a table of its own (transformers 4.x's ModernBERT)
    interface: bool = True
    config: Any = None  # the model's config (its numbers: the candidate branch multipliers of .parallel)
    splits: dict[int, Any] = field(default_factory=dict)  # each layer's .parallel.Split, once found


def flattened(part: Tensor, like: Tensor) -> bool:
    """Whether ``part`` is ``like``'s shape with the leading (batch and position) dimensions merged: a branch module
    that returns ``[b * p, d]``, which the layer views as ``[b, p, d]`` before adding it."""
    return part.dim() == 2 < like.dim() and part.shape[-1] == like.shape[-1] and part.numel() == like.numel()


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _eager_function(module: nn.Module) -> Optional[Callable[..., Any]]:
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _tolerances(dtype: torch.dtype) -> tuple[float, float]:
    return (1e-5, 1e-4) if dtype in (torch.float32, torch.float64) else (1e-2, 1e-2)


def _close(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are tensors of one shape, equal up to ``b``'s dtype's rounding (the tolerance of every
    claim the automatic description checks on the probe)."""
    if not isinstance(a, Tensor) or not isinstance(b, Tensor) or a.shape != b.shape:
        return False
    atol, rtol = _tolerances(b.dtype)
    return bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol))


def _pattern_problem(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Optional[Tensor],
    args: tuple,
    kwargs: dict,
    output: Tensor,
    weights: Optional[Tensor],
    eager: bool,
) -> Optional[str]:
    """Why the explicit attention would not give this call's patterns (``None``: it gives them exactly)."""
    name = type(module).__name__
    unusual = _unusual_arguments(module, kwargs, mask)
    if args or unusual:
        passed = ", ".join(repr(k) for k in unusual) or f"{len(args)} extra positional argument(s)"
        return (
            f"{name} passes {passed} to its attention function, which plain softmax(q·kᵀ·scaling) attention "
            f"does not reproduce"
        )
    if not eager or weights is None:
        return f"{name}'s modeling file has no eager attention function to check patterns against"
    stand_in = HookPoint("probe", lambda point: None)
    try:
        ours, pattern = explicit_attention(
            module,
            query,
            key,
            value,
            mask,
            scores_fn=default_scores,
            scores_point=stand_in,
            pattern_point=stand_in,
            implementation="eager",  # compared with the model's eager function, which applies a softcap
            **kwargs,
        )
    except Exception as exc:  # whatever it is, patterns are not served for this module
        return f"explicit attention failed on {name}'s arguments ({type(exc).__name__}: {exc})"
    # with sinks, an eager function may return the softmax before its sinks rescale the output (Granite-SWA's): the
    # pattern must then give the function's output (the verification checks it against the weights that do)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if not ((_close(pattern, weights) or sinks is not None) and _close(ours, output)):
        return (
            f"{name}'s attention weights are not softmax(q·kᵀ·scaling + mask) of the queries and keys it "
            f"passes to the attention function"
        )
    return None


def _probe_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    *args: Any,
    **kwargs: Any,
) -> tuple[Tensor, Any]:
    """The attention function while probing: the model's eager attention (sdpa if it has none), recorded."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = _eager_function(module)
    fn = eager or ALL_ATTENTION_FUNCTIONS["sdpa"]
    output, weights = fn(module, query, key, value, attention_mask, *args, **kwargs)
    recording: Optional[Recording] = getattr(_current, "recording", None)
    if recording is not None and isinstance(output, Tensor):
        problem = _pattern_problem(
            module, query, key, value, attention_mask, args, kwargs, output, weights, eager is not None
        )
        layer = recording.owner.get(id(module))
        recording.events.append(("attention", layer))
        recording.calls.append(
            InterfaceCall(
                module,
                layer,
                query.shape[1],
                key.shape[1],
                query.shape[-1],
                Record.of(output),
                problem,
                query.detach().clone(),
                key.detach().clone(),
                value.detach().clone(),
                weights.detach().clone() if isinstance(weights, Tensor) else None,
            )
        )
    return output, weights


def _probe_key() -> str:
    if not _registered:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(PROBE_KEY, _probe_attention)
        AttentionMaskInterface.register(PROBE_KEY, AttentionMaskInterface._global_mapping["eager"])
        _registered.append(True)
    return PROBE_KEY


@contextlib.contextmanager
def _probing(model: nn.Module, recording: Recording):
    """Eval mode, no gradients, the random state and the attention implementation restored afterwards; attention
    through the probe's own entry of transformers' attention interface where ``recording.interface``."""
    modes = {m: m.training for m in model.modules()}
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            model.eval()
            if recording.interface:
                config._attn_implementation = _probe_key()
            _current.recording = recording
            yield
        finally:
            _current.recording = None
            config._attn_implementation = implementation
            for module, training in modes.items():
                module.training = training


def _input_device(embed: nn.Module) -> torch.device:
    weight = getattr(embed, "weight", None)
    if isinstance(weight, Tensor) and weight.device.type != "meta":
        return weight.device
    return torch.device("cpu")


def run_probe(model: nn.Module, embed: nn.Module, layers: list[nn.Module], unembed: Optional[str]) -> Recording:
    """Run the probe forward (see the module docstring); exceptions of the model's forward propagate."""
    recording = Recording(config=getattr(model, "config", None))
    for i, layer in enumerate(layers):
        for m in layer.modules():
            recording.owner[id(m)] = i
    inside = {id(m) for layer in layers for m in layer.modules()}
    handles: list[Any] = []

    def on_layer_in(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            recording.events.append(("enter", i))
            recording.layer_calls[i] = recording.layer_calls.get(i, 0) + 1
            value = first_input(args, kwargs)
            if isinstance(value, Tensor):
                recording.layer_in[i] = Record.of(value)
                if i == 0 and recording.first_layer_in is None:
                    recording.first_layer_in = recording.layer_in[i].value

        return hook

    def on_layer_out(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            recording.events.append(("exit", i))
            value = first_output(output)
            if isinstance(value, Tensor):
                recording.layer_out[i] = Record.of(value)

        return hook

    def on_child(i: int, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            recording.events.append(("child", i, name))
            value = first_output(output)
            if not isinstance(value, Tensor):
                return
            seen = recording.children.get((i, name))
            recording.children[(i, name)] = Record.of(value)
            if seen is not None:
                recording.children[(i, name)].calls = seen.calls + 1

        return hook

    def on_inner(i: int, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if (i, path) in recording.inner:
                return
            given = kwargs.get("position_embeddings")
            if isinstance(given, tuple) and len(given) == 2 and all(isinstance(t, Tensor) for t in given):
                recording.position_embeddings[(i, path)] = (given[0].detach().clone(), given[1].detach().clone())
            if isinstance(output, tuple) and len(output) == 2 and all(isinstance(t, Tensor) for t in output):
                if output[0].shape == output[1].shape:
                    recording.pairs[(i, path)] = (output[0].detach().clone(), output[1].detach().clone())
            try:
                x = first_input(args, kwargs)
            except (RuntimeError, IndexError):
                x = None
            try:
                y = first_output(output) if output is not None else None
            except IndexError:
                y = None
            recording.inner[(i, path)] = (
                x.detach().clone() if isinstance(x, Tensor) else None,
                y.detach().clone() if isinstance(y, Tensor) else None,
            )

        return hook

    def on_outside(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if isinstance(output, tuple) and all(isinstance(t, Tensor) for t in output):
                recording.outside_raw.setdefault(name, tuple(t.detach().clone() for t in output))
            value = first_output(output)
            if not isinstance(value, Tensor):
                return
            seen = recording.outside_out.get(name)
            recording.events.append(("outside", name))
            recording.outside_out[name] = Record.of(value)
            if seen is not None:
                recording.outside_out[name].calls = seen.calls + 1
            try:
                x = first_input(args, kwargs)
            except RuntimeError:
                x = None
            recording.outside_in[name] = x.detach().clone() if isinstance(x, Tensor) else None

        return hook

    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(on_layer_in(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(on_layer_out(i)))
            for name, child in layer.named_children():
                handles.append(child.register_forward_hook(on_child(i, name)))
            for name, inner in layer.named_modules():
                if name and not isinstance(inner, (nn.ModuleList, nn.ModuleDict)):
                    handles.append(inner.register_forward_hook(on_inner(i, name), with_kwargs=True))
        for name, module in model.named_modules():
            if name and id(module) not in inside and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                handles.append(module.register_forward_hook(on_outside(name), with_kwargs=True))
        vocab = getattr(embed, "num_embeddings", None) or getattr(model.config, "vocab_size", None) or 2
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, int(vocab), (1, PROBE_LENGTH), generator=generator).to(_input_device(embed))
        recording.input_ids = ids
        from lensadapters.adapters.generic.own_attention import recording as own_code

        try:
            with _probing(model, recording), own_code(layers) as recorder:
                output = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, return_dict=True)
        except KeyError as exc:
            if PROBE_KEY not in str(exc):
                raise
            # the model looks its attention function up in a table of its own, by the implementation's name
            # (transformers 4.x's ModernBERT): probe it as it runs (the hooks above record into the new recording);
            # its attention is then the model's own code's
            recording = Recording(owner=recording.owner, input_ids=ids, interface=False, config=recording.config)
            with _probing(model, recording), own_code(layers) as recorder:
                output = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, return_dict=True)
        _own_calls(recording, layers, recorder.ops, ids.shape[0])
        recording.last_hidden = (
            recording.outside_in.get(unembed) if unembed is not None else getattr(output, "last_hidden_state", None)
        )
        logits = getattr(output, "logits", None)
        recording.logits = logits.detach().clone() if isinstance(logits, Tensor) else None
        if any(r.value.device.type == "meta" for r in recording.layer_in.values()):
            raise RuntimeError("the model's parameters are on the meta device (not loaded), so it computes no values")
    finally:
        for handle in handles:
            handle.remove()
    return recording


def _own_calls(recording: Recording, layers: list[nn.Module], ops: dict[int, list[Any]], batch: int) -> None:
    """The layers that call no attention interface: their attention computed in the model's own code, if any."""
    from lensadapters.adapters.generic.own_attention import own_call, unscaled_query

    interface = {c.layer for c in recording.calls}
    for i, layer in enumerate(layers):
        if i in interface:
            continue
        try:
            parts, why = own_call(layer, i, ops.get(i, []), batch)
            if parts is not None:
                outputs = [y for (j, _), (_, y) in recording.inner.items() if j == i and y is not None]
                parts["query"] = unscaled_query(parts["query"], outputs)
        except Exception as exc:  # what cannot be read is not described; the probe's other findings stand
            parts, why = None, f"reading their attention raised {type(exc).__name__}: {exc}"
        if parts is None:
            recording.own_why[i] = why
            continue
        output = parts.pop("output")
        recording.own_calls.append(InterfaceCall(layer=i, output=Record.of(output), pattern_problem=None, **parts))


def run_embedding_edit(
    model: nn.Module, embed: nn.Module, first_layer: nn.Module, ids: Tensor, delta: Tensor, interface: bool = True
) -> Optional[Tensor]:
    """The first layer's input (the first time it runs) in a probe forward where a plain PyTorch hook adds ``delta``
    to the embedding module's output: how an edit of the embeddings reaches the layers (``interface``: as
    :class:`Recording`'s)."""
    seen: list[Tensor] = []

    def add(module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        return output + delta if isinstance(output, Tensor) and value.shape == delta.shape else None

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        value = first_input(args, kwargs)
        if not seen and isinstance(value, Tensor):
            seen.append(value.detach().clone())

    handles = [embed.register_forward_hook(add), first_layer.register_forward_pre_hook(record, with_kwargs=True)]
    try:
        with _probing(model, Recording(interface=interface)):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, return_dict=True)
    finally:
        for handle in handles:
            handle.remove()
    return seen[0] if seen else None
