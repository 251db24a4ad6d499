"""A HookedModel seen as a TransformerLens ``HookedTransformer``, for tools that check ``isinstance``.

Some tools built on TransformerLens refuse any model that is not a ``HookedTransformer`` (sae-dashboard's prompt
view, auto-circuit's dispatch, sae-bench's type-checked ``activation_collection``) although they only use its hook
API. :func:`as_hooked_transformer` hands them a view of a HookedModel that passes ``isinstance(x,
HookedTransformer)`` and ``isinstance(x, HookedRootModule)``, and delegates every attribute to the HookedModel::

    from lensadapters.integrations.transformer_lens import as_hooked_transformer

    tl_model = as_hooked_transformer(hm)          # needs transformer_lens installed
    isinstance(tl_model, HookedTransformer)       # True
    tl_model.run_with_cache(tokens)               # hm.run_with_cache(tokens)
    tl_model.blocks[0].hook_resid_pre             # hm's hook point
    tl_model(tokens)                              # TransformerLens' forward: the logits

Nothing is copied or converted: ``HookedTransformer.__init__`` never runs, the view holds no weights (its
``parameters()`` are the Hugging Face model's), and hooks, hook-point replacements and attributes set on it
(``tl_model.tokenizer = ...``) act on the HookedModel. Calling the view is TransformerLens' forward
(``tl_call.forward``: logits by default, ``return_type=``, ``stop_at_layer=``...), whatever the input.

Limits: a method of ``HookedTransformer`` that the HookedModel does not have raises ``AttributeError`` (the view
never falls back to TransformerLens' own code, which would need its modules); ``cfg`` is lensadapters'
``HookedConfig``, not a ``HookedTransformerConfig``; as a submodule of a client's ``nn.Module`` the view moves and
lists no parameters of its own (use ``hm.to(...)``).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lensadapters.api import tl_call

_VIEWS: dict[type, type] = {}
# attributes the view answers itself; everything else goes to the HookedModel
_OWN = frozenset({"_hooked_model", "forward", "__class__", "__dict__", "__module__", "__doc__"})


def as_hooked_transformer(hm: Any, base: Optional[type] = None) -> Any:
    """A view of ``hm`` that passes ``isinstance(view, base)`` (default ``transformer_lens.HookedTransformer``; any
    subclass of it, such as sae-lens' ``HookedSAETransformer``) and delegates to ``hm``. See the module docstring."""
    try:
        from transformer_lens import HookedTransformer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "as_hooked_transformer needs TransformerLens (pip install transformer_lens); without it, pass the "
            "HookedModel itself to tools that do not check isinstance(model, HookedTransformer)"
        ) from exc
    base = HookedTransformer if base is None else base
    if not (isinstance(base, type) and issubclass(base, HookedTransformer)):
        raise TypeError(f"base must be HookedTransformer or a subclass of it, not {base!r}")
    if not hasattr(hm, "wiring") or not hasattr(hm, "run_with_cache"):
        raise TypeError(f"as_hooked_transformer takes a lensadapters HookedModel, not {type(hm).__name__}")
    view_class = _VIEWS.get(base)
    if view_class is None:
        view_class = _VIEWS[base] = _view_class(base)
    view: Any = object.__new__(view_class)
    object.__setattr__(view, "_hooked_model", hm)
    nn.Module.__init__(view)  # the module bookkeeping only (no submodules, no parameters): base.__init__ never runs
    return view


def hooked_model_of(view: Any) -> Any:
    """The HookedModel behind a view from :func:`as_hooked_transformer` (``view`` itself if it is none)."""
    return view.__dict__.get("_hooked_model", view) if isinstance(view, nn.Module) else view


def _view_class(base: type) -> type:
    def __getattribute__(self: Any, name: str) -> Any:
        if name in _OWN or (name.startswith("__") and name.endswith("__")):
            return object.__getattribute__(self, name)
        own = object.__getattribute__(self, "__dict__")
        try:
            return getattr(own["_hooked_model"], name)
        except (AttributeError, KeyError):
            if name in own or hasattr(nn.Module, name):  # nn.Module's machinery, for a parent module that holds it
                return object.__getattribute__(self, name)
            raise

    def __getattr__(self: Any, name: str) -> Any:
        hm = object.__getattribute__(self, "__dict__")["_hooked_model"]
        raise AttributeError(
            f"{type(hm).__name__} (behind this {base.__name__} view) has no attribute {name!r}: the view delegates "
            f"to the HookedModel and runs none of TransformerLens' own code"
        )

    def __setattr__(self: Any, name: str, value: Any) -> None:
        own = object.__getattribute__(self, "__dict__")
        if name in own or hasattr(nn.Module, name) and not hasattr(own["_hooked_model"], name):
            object.__setattr__(self, name, value)
        else:
            setattr(own["_hooked_model"], name, value)

    def __delattr__(self: Any, name: str) -> None:
        delattr(object.__getattribute__(self, "__dict__")["_hooked_model"], name)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        """TransformerLens' forward (logits by default) on the HookedModel."""
        hm = object.__getattribute__(self, "__dict__")["_hooked_model"]
        hm._check_alive()
        hm.wiring.sync()
        return tl_call.forward(hm, *args, **kwargs)

    def __repr__(self: Any) -> str:
        return f"{base.__name__} view of {object.__getattribute__(self, '__dict__')['_hooked_model']!r}"

    def __dir__(self: Any) -> list[str]:
        return dir(object.__getattribute__(self, "__dict__")["_hooked_model"])

    namespace = {
        "__getattribute__": __getattribute__,
        "__getattr__": __getattr__,
        "__setattr__": __setattr__,
        "__delattr__": __delattr__,
        "forward": forward,
        "__call__": forward,
        "__repr__": __repr__,
        "__dir__": __dir__,
        "__module__": __name__,
        "__doc__": f"A {base.__name__} that delegates to a lensadapters HookedModel (see as_hooked_transformer).",
    }
    return type(f"HookedModelAs{base.__name__}", (base,), namespace)
