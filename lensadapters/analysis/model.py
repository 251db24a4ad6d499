"""What the analysis layer and the user API's helper modules use of a :class:`~lensadapters.HookedModel`.

:class:`HookedModelLike` is the structural type those modules are written against (``ActivationCache.model``,
the call conventions of :mod:`lensadapters.api.tl_call`, the SAE splices, the hook namespace), so they sit below
``HookedModel`` in the layers instead of importing it: ``HookedModel`` satisfies it, and so would any object
with these members.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

__all__ = ["HookedModelLike"]


class HookedModelLike(Protocol):
    """The members of ``HookedModel`` that the code below it in the layers reads or calls."""

    @property
    def wiring(self) -> Any:
        """The model's :class:`lensadapters.wiring.Wiring` (points, sites, descriptions)."""

    @property
    def model(self) -> Any: ...

    @property
    def hf_model(self) -> Any: ...

    @property
    def cfg(self) -> Any: ...

    @property
    def layout(self) -> Any: ...

    @property
    def block_modules(self) -> Any: ...

    @property
    def block_layouts(self) -> Any: ...

    @property
    def hook_names(self) -> list[str]: ...

    @property
    def device(self) -> Any: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def default_prepend_bos(self) -> bool: ...

    @property
    def default_padding_side(self) -> Any: ...

    @property
    def blocks(self) -> Any: ...

    @property
    def W_U(self) -> Any: ...

    @property
    def W_Q(self) -> Any: ...

    @property
    def W_O(self) -> Any: ...

    @property
    def W_in(self) -> Any: ...

    @property
    def W_out(self) -> Any: ...

    def point(self, name: str) -> Any: ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...

    def add_hook(self, *args: Any, **kwargs: Any) -> Any: ...

    def hooks(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any: ...

    def norm_spec(self, module: nn.Module) -> Any: ...

    def norm_module(self, prefix: str) -> nn.Module: ...

    def tokens_to_residual_directions(self, tokens: Any) -> Any: ...

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Any: ...
