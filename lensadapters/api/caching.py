"""``run_with_hooks``, ``run_with_cache`` and ``cache_names``: running a :class:`~lensadapters.HookedModel` with
temporary hooks and caching what its hook points see (a mixin of ``HookedModel``, which supplies ``hooks``,
``hook_names``, ``wiring`` and the call itself)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterable, Sequence, Union

import torch

from lensadapters.analysis.cache import ActivationCache
from lensadapters.api import tl_call
from lensadapters.api.arguments import batch_of, check_cache_device, check_selector, selector
from lensadapters.errors import LensAdaptersError
from lensadapters.hooks.hook_point import HookFn, HookPoint, is_recomputing
from lensadapters.wiring.head_inputs import NAMES as _HEAD_INPUT_NAMES

Tensor = torch.Tensor
NameFilter = Union[None, str, Sequence[str], Callable[[str], bool]]
HookSpec = tuple[Union[str, Callable[[str], bool]], HookFn]
# hook points left out of run_with_cache's default (names_filter=None): costly and redundant
DEFAULT_CACHE_EXCLUDES = ("attn.hook_result",) + _HEAD_INPUT_NAMES


class CachingRuns:
    """The runs of a :class:`~lensadapters.HookedModel` with temporary hooks and caches."""

    wiring: Any
    _tl_semantics: bool
    hooks: Any
    hook_names: Any
    cfg: Any
    model: Any
    __call__: Callable[..., Any]

    def run_with_hooks(
        self,
        *args: Any,
        fwd_hooks: Iterable[HookSpec] = (),
        bwd_hooks: Iterable[HookSpec] = (),
        reset_hooks_end: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Run the model with temporary hooks; returns the logits (the full output if it has none).

        Backward hooks stay attached to this forward's graph, so ``logits.sum().backward()`` after
        the call still runs them.
        """
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end):
            return _logits(self(*args, **kwargs))

    def cache_names(self, names_filter: NameFilter = None) -> list[str]:
        """The hook names ``run_with_cache`` stores for ``names_filter``."""
        names_filter = selector(names_filter)  # a generator of names is read once
        if names_filter is not None:
            check_selector(names_filter, "names_filter")
        if names_filter is None:
            points = self.wiring.hook_dict
            switched = tuple(self.__dict__.get("_switched_cache_names", ()))  # TransformerLens' set_use_* (tl_api)
            excluded = tuple(s for s in DEFAULT_CACHE_EXCLUDES if s not in switched)
            return [n for n in self.hook_names if not (n.endswith(excluded) or points[n].costly)]
        if isinstance(names_filter, str):
            return [pt.name for pt in self.wiring.select(names_filter)]
        if callable(names_filter):
            return [n for n in self.hook_names if names_filter(n)]
        return [pt.name for pt in self.wiring.select(list(names_filter))]

    def run_with_cache(
        self,
        *args: Any,
        names_filter: NameFilter = None,
        device: Any = None,
        remove_batch_dim: bool = False,
        incl_bwd: bool = False,
        reset_hooks_end: bool = True,
        **kwargs: Any,
    ) -> tuple[Any, ActivationCache]:
        """Run the model and return ``(logits, cache)``.

        ``names_filter``: a name, a list of names or a predicate (default: every hook point but
        ``attn.hook_result`` and the per-expert points ``mlp.experts.{e}.*``, which are computed only when asked
        for). ``device`` moves cached tensors,
        ``remove_batch_dim`` drops a batch of one, ``incl_bwd`` backpropagates the model's loss (pass
        ``labels=``) and stores gradients as ``NAME_grad``. ``reset_hooks_end=False`` (TransformerLens): the caching
        hooks stay after the call, so every later forward writes its values into the returned cache, until
        ``hm.reset_hooks()``.

        Under gradient checkpointing (``model.train()`` after ``gradient_checkpointing_enable()``) the
        backward pass re-runs the forward of each checkpointed layer; the cache records each hook point
        once, from the real forward (see :func:`lensadapters.is_recomputing`), and each gradient once.
        """
        names = self.cache_names(names_filter)
        named = names_filter is not None  # a point asked for by name that cannot fire warns (see ``hooks``)
        device = check_cache_device(device)
        if incl_bwd:
            if torch.is_inference_mode_enabled():
                raise LensAdaptersError(
                    "run_with_cache(incl_bwd=True) backpropagates, which torch.inference_mode() "
                    "forbids: call it outside the inference_mode block (torch.no_grad() is fine)"
                )
            tl_style = self._tl_semantics or tl_call.wants_transformer_lens(args, kwargs)
            tl_loss = tl_style and kwargs.get("return_type") == "loss"
            if tl_style and not tl_loss:
                raise ValueError("run_with_cache(incl_bwd=True) backpropagates the loss: pass return_type='loss'")
            if not tl_style and "labels" not in kwargs and "labels" in _forward_parameters(self.model):
                raise ValueError("run_with_cache(incl_bwd=True) backpropagates the model's loss: pass labels=")
        if remove_batch_dim and batch_of(args, kwargs) not in (None, 1):
            raise ValueError(
                f"run_with_cache(remove_batch_dim=True) needs a batch of one; the input has a batch of "
                f"{batch_of(args, kwargs)}"
            )
        store: dict[str, Tensor] = {}

        def keep(key: str, tensor: Tensor) -> None:
            value = tensor.detach()
            if device is not None:
                value = value.to(device)
            if remove_batch_dim:
                if value.shape[0] != 1:
                    raise ValueError(
                        f"run_with_cache(remove_batch_dim=True) needs a batch of one; {key} has a batch "
                        f"of {value.shape[0]} (shape {tuple(value.shape)})"
                    )
                value = value[0]
            store[key] = value

        def save(tensor: Tensor, hook: HookPoint) -> None:
            if not is_recomputing():  # gradient checkpointing re-runs the forward during backward
                keep(hook.name, tensor)

        def save_grad(tensor: Tensor, hook: HookPoint) -> None:
            keep(hook.name + "_grad", tensor)

        wanted = frozenset(names).__contains__  # one selector for every name: not one attachment per name
        with self.hooks(
            [(wanted, save)] if names else [],
            [(wanted, save_grad)] if incl_bwd and names else [],
            reset_hooks_end,
            _readonly=True,
            _watch=named,
        ):
            with torch.enable_grad() if incl_bwd else contextlib.nullcontext():
                out = self(*args, **kwargs)
                if incl_bwd:
                    loss = out if isinstance(out, Tensor) else getattr(out, "loss", None)  # TL: the returned loss
                    if loss is None:
                        raise ValueError("run_with_cache(incl_bwd=True) backpropagates the model's loss: pass labels=")
                    loss.backward()
        return _logits(out), ActivationCache(store, self.cfg.n_layers, not remove_batch_dim, model=self)


def _forward_parameters(model: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError, AttributeError):  # pragma: no cover
        return ()


def _logits(out: Any) -> Any:
    if isinstance(out, tl_call.Output):  # analysis layer: a TransformerLens-style call's result, as it is
        return out
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out
