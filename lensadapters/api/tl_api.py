"""The TransformerLens-facing surface of a HookedModel, as one mixin (``HookedModel`` inherits it):

* the tokenizer and its methods (:mod:`lensadapters.tokens`), ``HookedModel.from_pretrained``;
* weight-based circuits (:mod:`lensadapters.circuits`): ``OV``, ``QK``, composition scores...;
* SAELens SAEs spliced in (:mod:`lensadapters.saes`): ``run_with_saes``, ``run_with_cache_with_saes``...;
* attribute access to hook points (:mod:`lensadapters.hook_namespace`): ``hm.blocks[0].attn.hook_pattern``;
* ``torch.nn.Module`` conveniences that act on the wrapped model: ``to``, ``cpu``, ``cuda``, ``eval``,
  ``train``, ``parameters``, ``named_parameters``, ``state_dict``, ``requires_grad_``, ``dtype``;
  ``hm.cfg.device`` / ``hm.cfg.dtype`` follow the model.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Iterator, Optional

import torch

from lensadapters.analysis.circuits import CircuitsMixin
from lensadapters.api import hook_namespace
from lensadapters.api.saes import SAEMixin
from lensadapters.api.tokens import TokenizerMixin

_TOKENIZER_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "trust_remote_code", "subfolder")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


class TransformerLensAPI(TokenizerMixin, CircuitsMixin, SAEMixin):
    """TransformerLens' everyday methods on :class:`lensadapters.HookedModel`."""

    model: Any
    hf_model: Any

    def _init_tl_api(self, tokenizer: Any = None) -> None:
        """Called by ``wrap``: bind ``cfg.device``/``cfg.dtype`` to the model and keep the tokenizer."""
        object.__setattr__(self.cfg, "_live", weakref.ref(self))
        if tokenizer is not None:
            self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(
        cls, path: str, tokenizer: Any = None, *, adapter: Optional[str] = None, **hf_kwargs: Any
    ) -> Any:
        """``AutoModelForCausalLM.from_pretrained(path, **hf_kwargs)`` wrapped, with the tokenizer saved there
        (``AutoTokenizer``) unless one is given. The model is used as loaded: no weight processing."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, **hf_kwargs)
        if tokenizer is None:
            problem = None
            if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
                problem = "the folder has no tokenizer files"
            else:
                try:
                    tokenizer = AutoTokenizer.from_pretrained(
                        path, **{k: v for k, v in hf_kwargs.items() if k in _TOKENIZER_KWARGS}
                    )
                except (OSError, ValueError, TypeError, KeyError) as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                else:
                    if not len(tokenizer):  # transformers 5 builds an empty tokenizer where files are missing
                        tokenizer, problem = None, "the tokenizer found there is empty"
            if problem is not None:
                warnings.warn(
                    f"no tokenizer could be loaded from {path!r} ({problem}); text inputs need one: set hm.tokenizer",
                    stacklevel=2,
                )
        return cls.wrap(model, adapter=adapter, tokenizer=tokenizer)  # type: ignore[attr-defined]

    # --- hook points as attributes ----------------------------------------------------------------------

    @property
    def blocks(self) -> hook_namespace.BlockList:
        """The hook points of each block as attributes: ``hm.blocks[3].attn.hook_pattern`` (a HookPoint).
        The Hugging Face decoder layers are ``hm.block_modules``."""
        return hook_namespace.BlockList(self)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: hook points (hm.hook_embed) and namespaces (hm.ln_final)
        attr = getattr(type(self), name, None)
        if isinstance(attr, property):  # a property that raised AttributeError: raise its own message again
            return attr.fget(self)  # type: ignore[misc]
        wiring = self.__dict__.get("wiring")
        if name.startswith("_") or wiring is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        found = hook_namespace.lookup(self, "", name)  # type: ignore[arg-type]
        if found is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return found

    def __setattr__(self, name: str, value: Any) -> None:
        # hm.hook_embed = module: a client's module in a hook point's place (see hook_namespace.replace)
        wiring = self.__dict__.get("wiring")
        if wiring is not None and name in wiring.hook_dict:
            hook_namespace.replace(self, "", name, value)  # type: ignore[arg-type]
            return
        object.__setattr__(self, name, value)

    # --- TransformerLens' HookedRootModule surface ------------------------------------------------------

    @property
    def mod_dict(self) -> dict[str, Any]:
        """TransformerLens' ``mod_dict``, as far as a HookedModel has modules of its own: name -> hook point.

        As on TransformerLens (built once, at setup) it keeps the original points when a client replaces one.
        The Hugging Face modules are ``hm.hf_model.named_modules()``."""
        return self.hook_dict  # type: ignore[attr-defined,no-any-return]

    def hook_points(self) -> Any:
        """Every hook point (TransformerLens' ``hook_points()``: ``hook_dict.values()``)."""
        return self.hook_dict.values()  # type: ignore[attr-defined]

    def add_perma_hook(self, name: Any, hook: Any, dir: str = "fwd") -> None:
        """``add_hook(name, hook, dir, is_permanent=True)``, as TransformerLens."""
        self.add_hook(name, hook, dir=dir, is_permanent=True)  # type: ignore[attr-defined]

    def remove_all_hook_fns(
        self, direction: str = "both", including_permanent: bool = False, level: Optional[int] = None
    ) -> None:
        """Remove the hooks of every point in ``direction`` (``"fwd"``, ``"bwd"``, ``"both"``), permanent ones too
        when ``including_permanent``, as TransformerLens (``level``, its hook contexts, is not supported)."""
        if direction not in ("fwd", "bwd", "both"):
            raise ValueError(f"direction must be 'fwd', 'bwd' or 'both', not {direction!r}")
        if level is not None:
            raise ValueError("level (TransformerLens' hook contexts) is not supported by lensadapters")
        dirs = ("fwd", "bwd") if direction == "both" else (direction,)
        fwd_ids = {id(e) for p in self.hook_dict.values() for e in p.fwd_hooks} if "fwd" in dirs else set()  # type: ignore[attr-defined]
        bwd_ids = {id(e) for p in self.hook_dict.values() for e in p.bwd_hooks} if "bwd" in dirs else set()  # type: ignore[attr-defined]
        chosen = fwd_ids | bwd_ids
        self.wiring.remove_hooks(  # type: ignore[attr-defined]
            lambda e: id(e) in chosen and (including_permanent or not e.permanent)
        )

    def clear_contexts(self) -> None:
        """Empty every hook point's ``ctx`` (TransformerLens' ``clear_contexts``)."""
        for point in self.hook_dict.values():  # type: ignore[attr-defined]
            point.clear_context()

    # TransformerLens' set_use_* switches: its points behind them (hook_result, hook_q_input..., hook_attn_in,
    # hook_mlp_in) cost memory and time there; here every point is always served and costs nothing unhooked, so
    # the switches are accepted and change nothing (cfg.use_attn_result & co. report what is served)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Accepted for TransformerLens' code; ``hook_result`` is always served (computed only while hooked)."""

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Accepted for TransformerLens' code; ``hook_q_input``/``k``/``v`` are always served (computed only while
        hooked)."""

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Accepted for TransformerLens' code; ``hook_attn_in`` is always served (computed only while hooked)."""

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Accepted for TransformerLens' code; ``hook_mlp_in`` is always served (computed only while hooked)."""

    # --- nn.Module conveniences on the wrapped model ----------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's first floating-point parameter."""
        for param in self.hf_model.parameters():
            if param.is_floating_point():
                return param.dtype
        return torch.get_default_dtype()

    def to(self, *args: Any, print_details: bool = True, **kwargs: Any) -> Any:
        """``model.to(...)`` (device and/or dtype); returns this HookedModel."""
        self.model.to(*args, **kwargs)
        return self

    def cpu(self) -> Any:
        return self.to("cpu")

    def cuda(self, device: Any = None) -> Any:
        return self.to(f"cuda:{device}" if isinstance(device, int) else device or "cuda")

    def eval(self) -> Any:
        self.model.eval()
        return self

    def train(self, mode: bool = True) -> Any:
        self.model.train(mode)
        return self

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.model.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.model.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self.model.state_dict(*args, **kwargs)

    def requires_grad_(self, requires_grad: bool = True) -> Any:
        self.model.requires_grad_(requires_grad)
        return self
