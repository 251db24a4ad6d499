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
from lensadapters.api import hook_namespace, tl_components
from lensadapters.api.saes import SAEMixin
from lensadapters.api.tokens import TokenizerMixin

_TOKENIZER_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "trust_remote_code", "subfolder")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


class ProcessingWarning(UserWarning):
    """TransformerLens' weight-processing flags were set: lensadapters never processes weights."""

    def __init__(self, flags: list[str]) -> None:
        super().__init__(
            f"{', '.join(f'{f}=True' for f in flags)}: lensadapters never processes weights (the model is used as "
            f"loaded, as TransformerLens' from_pretrained_no_processing). Activations are the model's own, not "
            f"TransformerLens' processed ones (norm weights are not folded into the next matrices, writing weights "
            f"and the unembedding are not centered, value biases not folded); logits, losses and cache.logit_attrs "
            f"are unchanged (logit_attrs applies the norm weight itself)"
        )


#: TransformerLens from_pretrained keywords with no lensadapters equivalent, and what to use instead
_TL_ONLY_KEYWORDS = {
    "checkpoint_index": "load a training checkpoint with revision= (Pythia: revision='step1000')",
    "checkpoint_value": "load a training checkpoint with revision= (Pythia: revision='step1000')",
    "first_n_layers": "load the config, set its number of layers, and pass config=",
}


def _refuse_tl_only_keywords(kwargs: dict) -> None:
    for key, hint in _TL_ONLY_KEYWORDS.items():
        if kwargs.get(key) is not None:
            raise TypeError(f"HookedModel.from_pretrained does not support TransformerLens' {key}=: {hint}")
        kwargs.pop(key, None)


def _dtype(dtype: Any) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype != "auto" and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise TypeError(f"dtype must be a torch.dtype or its name ('float32', 'bfloat16'...), not {dtype!r}")


def _first_gpus(n: int) -> dict:
    available = torch.cuda.device_count()
    if available < n:
        raise ValueError(f"n_devices={n}, but {available} CUDA device(s) are visible")
    return {i: torch.cuda.get_device_properties(i).total_memory for i in range(n)}


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
        cls,
        path: str,
        tokenizer: Any = None,
        *,
        adapter: Optional[str] = None,
        hf_model: Any = None,
        device: Any = None,
        dtype: Any = None,
        n_devices: int = 1,
        move_to_device: bool = True,
        default_prepend_bos: Optional[bool] = None,
        default_padding_side: Optional[str] = None,
        fold_ln: Optional[bool] = None,
        center_writing_weights: Optional[bool] = None,
        center_unembed: Optional[bool] = None,
        fold_value_biases: Optional[bool] = None,
        refactor_factored_attn_matrices: Optional[bool] = None,
        _hf_defaults: bool = False,
        **hf_kwargs: Any,
    ) -> Any:
        """``AutoModelForCausalLM.from_pretrained(path, **hf_kwargs)`` wrapped, with the tokenizer saved there
        (``AutoTokenizer``) unless one is given: TransformerLens' ``HookedTransformer.from_pretrained``, so the
        model follows TransformerLens' call conventions (``call_semantics = "transformer_lens"``: ``hm(tokens)``
        returns the logits). The model is used as loaded: no weight processing.

        ``path``: a Hugging Face name, a local folder or one of TransformerLens' aliases (``"gpt2-small"``,
        ``"pythia-70m"``: :func:`lensadapters.api.tl_models.resolve_model_name`). TransformerLens' keywords:
        ``hf_model`` (an already loaded model: wrapped instead of loading one), ``device`` (default: as
        TransformerLens, ``utils.get_device()``; ``move_to_device=False`` leaves the model where it loads),
        ``dtype`` (default float32, as TransformerLens; a string such as ``"bfloat16"``, a ``torch.dtype``, or
        ``"auto"`` for the checkpoint's own),
        ``n_devices`` (more than one: ``device_map="auto"`` over the first ``n_devices`` GPUs),
        ``default_prepend_bos``, ``default_padding_side``. The weight-processing flags (``fold_ln``,
        ``center_writing_weights``, ``center_unembed``, ``fold_value_biases``, ``refactor_factored_attn_matrices``)
        are accepted; set to ``True`` they warn once that nothing is processed. ``_hf_defaults`` (lensadapters'
        own loaders): Hugging Face's dtype and placement and ``call_semantics = "hf"``.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lensadapters.api.tl_models import resolve_model_name

        _refuse_tl_only_keywords(hf_kwargs)
        flags = dict(
            fold_ln=fold_ln,
            center_writing_weights=center_writing_weights,
            center_unembed=center_unembed,
            fold_value_biases=fold_value_biases,
            refactor_factored_attn_matrices=refactor_factored_attn_matrices,
        )
        asked = [name for name, value in flags.items() if value]
        if asked:
            warnings.warn(ProcessingWarning(asked), stacklevel=2)
        path = resolve_model_name(path)
        if dtype is None:
            dtype = hf_kwargs.pop("torch_dtype", None)
        torch_dtype = "auto" if dtype == "auto" else _dtype(dtype)  # "auto": the checkpoint's own dtype
        if hf_model is not None:
            model = hf_model
            if isinstance(torch_dtype, torch.dtype):
                model.to(torch_dtype)
        else:
            if torch_dtype is not None or not _hf_defaults:
                hf_kwargs["dtype"] = torch_dtype if torch_dtype is not None else torch.float32
            if n_devices > 1:
                hf_kwargs.setdefault("device_map", "auto")
                hf_kwargs.setdefault("max_memory", _first_gpus(n_devices))
            model = AutoModelForCausalLM.from_pretrained(path, **hf_kwargs)
        if move_to_device and not _hf_defaults and n_devices == 1 and "device_map" not in hf_kwargs:
            from lensadapters.analysis.utils import get_device

            model.to(device if device is not None else get_device())
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
        hm = cls.wrap(model, adapter=adapter, tokenizer=tokenizer)  # type: ignore[attr-defined]
        hm.call_semantics = "hf" if _hf_defaults else "transformer_lens"
        if default_prepend_bos is not None:
            hm.default_prepend_bos = bool(default_prepend_bos)
        if default_padding_side is not None:
            if default_padding_side not in ("left", "right"):
                raise ValueError(f"default_padding_side must be 'left' or 'right', not {default_padding_side!r}")
            hm.default_padding_side = default_padding_side
        return hm

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
    # hook_mlp_in) cost memory and time there; here every point is always served and costs nothing unhooked. A
    # switch turned on adds its points to run_with_cache's default names, as in TransformerLens, whose cache then
    # holds them (hook_mlp_in is in the default already)

    def _switch_cached(self, suffixes: tuple[str, ...], on: bool) -> None:
        cached = self.__dict__.setdefault("_switched_cache_names", set())
        if on:
            cached.update(suffixes)
        else:
            cached.difference_update(suffixes)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """``hook_result`` is always served (computed only while hooked); ``True`` also caches it by default."""
        self._switch_cached(("attn.hook_result",), use_attn_result)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """``hook_q_input``/``k``/``v`` are always served (computed only while hooked); ``True`` also caches them by
        default."""
        self._switch_cached(("hook_q_input", "hook_k_input", "hook_v_input"), use_split_qkv_input)

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """``hook_attn_in`` is always served (computed only while hooked); ``True`` also caches it by default."""
        self._switch_cached(("hook_attn_in",), use_attn_in)

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Accepted for TransformerLens' code; ``hook_mlp_in`` is always served and cached by default."""

    # --- TransformerLens' components, computed by the Hugging Face modules (lensadapters.api.tl_components) ---

    @property
    def embed(self) -> tl_components.Embed:
        """``hm.embed(tokens)`` -> ``[batch, pos, d_model]`` (fires ``hook_embed``); ``hm.embed.W_E``."""
        return tl_components.Embed(self, hook_namespace.attribute)  # type: ignore[arg-type]

    @property
    def pos_embed(self) -> tl_components.PosEmbed:
        """``hm.pos_embed(tokens, past_kv_pos_offset=0, attention_mask=None)`` (fires ``hook_pos_embed``)."""
        return tl_components.PosEmbed(self, hook_namespace.attribute)  # type: ignore[arg-type]

    @property
    def unembed(self) -> tl_components.Unembed:
        """``hm.unembed(resid)`` -> logits, by the model's language-model head (and final-logit softcap)."""
        return tl_components.Unembed(self, hook_namespace.attribute)  # type: ignore[arg-type]

    def loss_fn(
        self, logits: torch.Tensor, tokens: torch.Tensor, attention_mask: Any = None, per_token: bool = False
    ) -> torch.Tensor:
        """TransformerLens' ``loss_fn``: the next-token cross-entropy of ``logits`` on ``tokens`` (mean, or
        ``[batch, pos - 1]`` with ``per_token``; positions where ``attention_mask`` is 0 left out)."""
        from lensadapters.analysis.utils import lm_cross_entropy_loss

        if tokens.device != logits.device:
            tokens = tokens.to(logits.device)
        return lm_cross_entropy_loss(logits, tokens, attention_mask, per_token)

    def tl_named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(TransformerLens name, tensor)`` for each weight TransformerLens' ``named_parameters()`` lists
        (``embed.W_E``, ``blocks.0.attn.W_Q``, ``blocks.0.ln1.w``, ``unembed.W_U``...), read from the live
        parameters on each call (gradients flow to them). ``named_parameters()`` keeps Hugging Face's names: the
        model itself is never renamed."""
        return tl_components.tl_named_parameters(self)  # type: ignore[arg-type]

    def tl_state_dict(self) -> dict[str, torch.Tensor]:
        """``dict(hm.tl_named_parameters())``, detached: TransformerLens' ``state_dict()`` keys for the weights."""
        return {name: value.detach() for name, value in self.tl_named_parameters()}

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
