"""SAELens sparse autoencoders spliced into a HookedModel, with ``HookedSAETransformer``'s methods and semantics.

An SAE (SAELens' ``SAE``, or anything with ``encode``/``decode``, its ``hook_sae_*`` hook points and
``cfg.metadata.hook_name``) attached at its hook point replaces the activation there with its reconstruction;
with ``use_error_term`` the reconstruction error of the unhooked SAE is added back, so the model's output is
unchanged while edits of the SAE's features still reach it. The SAE's own hook points become hook points of
the HookedModel, named as in TransformerLens' SAE wrapper: ``<hook_name>.hook_sae_input``, ``.hook_sae_acts_pre``,
``.hook_sae_acts_post``, ``.hook_sae_recons``, ``.hook_sae_error`` and ``.hook_sae_output`` -- cached by
``run_with_cache_with_saes`` and editable with ``fwd_hooks``. A transcoder (``hook_name_out`` set) reads at
``hook_name`` and writes at ``hook_name_out`` (its points are named after the latter).

lensadapters keeps the point ``<hook_name>`` itself while an SAE is there (TransformerLens replaces it): a hook
added there later sees what flows on, the SAE's output (``hook_sae_input`` is the model's own value).
The model is never changed: the SAE runs inside a hook, and its points are removed with it.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

import torch

from lensadapters.errors import LensAdaptersError, UnknownHookError

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.analysis.model import HookedModelLike

#: the SAE's hook points, in the order they fire
SAE_POINTS = (
    "hook_sae_input",
    "hook_sae_acts_pre",
    "hook_sae_acts_post",
    "hook_sae_recons",
    "hook_sae_error",
    "hook_sae_output",
)
#: the points the splice fires itself (the SAE's own run inside ``encode``/``decode``)
_SPLICE_FIRED = ("hook_sae_error", "hook_sae_output")
SAEs = Union[Any, Sequence[Any]]


def load_sae(sae: Any, device: Any = "cpu") -> Any:
    """``sae`` itself, or the SAE saved in the folder ``sae`` (SAELens' weights and config, ``SAE.load_from_disk``)."""
    if not isinstance(sae, (str, os.PathLike)):
        return sae
    try:
        from sae_lens import SAE
    except ImportError:
        raise LensAdaptersError(
            f"loading the SAE saved in {os.fspath(sae)!r} needs SAELens: pip install lensadapters[saelens]"
        ) from None
    return SAE.load_from_disk(os.fspath(sae), device=str(device))


def hook_names_of(sae: Any) -> tuple[str, str]:
    """``(input, output)`` hook names of an SAE: ``cfg.metadata.hook_name`` (``cfg.hook_name`` in older
    SAELens) and ``hook_name_out`` (transcoders), or the input name again."""
    cfg = getattr(sae, "cfg", None)
    meta = getattr(cfg, "metadata", None) or cfg
    name = getattr(meta, "hook_name", None)
    if not isinstance(name, str):
        raise TypeError(f"{type(sae).__name__} has no cfg.metadata.hook_name: pass SAELens SAE objects")
    out = getattr(meta, "hook_name_out", None) or name
    return name, out


class _Splice:
    """One SAE attached to a HookedModel (its points, its hooks, and how to take them away again)."""

    def __init__(self, hm: "HookedModelLike", sae: Any, use_error_term: bool, exclude: Any) -> None:
        self.hm, self.sae, self.use_error_term, self.exclude = hm, sae, use_error_term, exclude
        self.input_name, self.output_name = hook_names_of(sae)
        for name in dict.fromkeys((self.input_name, self.output_name)):
            if name not in hm.hook_names:
                raise UnknownHookError(name, hm.hook_names)
        self.mask: Optional[torch.Tensor] = None
        self._captured: Optional[torch.Tensor] = None
        self.points = {}
        previous = self.output_name
        for sub in SAE_POINTS:
            self.points[sub] = hm.wiring.new_point(f"{self.output_name}.{sub}", after=previous)
            previous = self.points[sub].name
        own = getattr(sae, "hook_dict", {})
        self._handles = [
            own[sub].register_forward_hook(self._bridge(sub))
            for sub in SAE_POINTS
            if sub not in _SPLICE_FIRED and sub in own
        ]
        self._entries = []
        if self.input_name != self.output_name:
            self._entries.append(
                (
                    hm.point(self.input_name),
                    hm.point(self.input_name).add(self._capture, "fwd", permanent=True, readonly=True),
                )
            )
        self._entries.append(
            (hm.point(self.output_name), hm.point(self.output_name).add(self._replace, "fwd", permanent=True))
        )

    def _bridge(self, sub: str) -> Any:
        point = self.points[sub]

        def fire(module: Any, args: Any, output: torch.Tensor) -> Optional[torch.Tensor]:
            value, changed = point.apply(output)
            return value if changed else None

        return fire

    def _capture(self, value: torch.Tensor, hook: Any) -> None:
        self._captured = value

    def _replace(self, value: torch.Tensor, hook: Any) -> torch.Tensor:
        sae_in = self._captured if self._captured is not None else value
        self._captured = None
        features = self.sae.encode(sae_in)
        out = self.sae.decode(features)
        mask = self._mask_for(value)
        if self.use_error_term:
            with torch.no_grad(), self._unhooked():
                clean = self.sae.decode(self.sae.encode(sae_in))
            error = value - clean.to(value.dtype)
            if mask is not None:
                error = torch.where(mask, torch.zeros_like(error), error)
            error, _ = self.points["hook_sae_error"].apply(error)
            out = out + error
        if mask is not None:
            out = torch.where(mask, value, out.to(value.dtype))
        out, _ = self.points["hook_sae_output"].apply(out.to(value.dtype))
        return out

    def _mask_for(self, value: torch.Tensor) -> Optional[torch.Tensor]:
        if self.mask is None:
            return None
        mask = self.mask.to(value.device)
        if tuple(value.shape[: mask.dim()]) != tuple(mask.shape):
            raise LensAdaptersError(
                f"exclude_special_tokens: {self.output_name} has shape {tuple(value.shape)}, "
                f"not [batch, pos, ...] for the tokens {tuple(mask.shape)}"
            )
        return mask.reshape(*mask.shape, *([1] * (value.dim() - mask.dim())))

    @contextlib.contextmanager
    def _unhooked(self) -> Iterator[None]:
        """The SAE with its hook points swapped out (for the clean reconstruction of the error term, as SAELens)."""
        own = dict(getattr(self.sae, "hook_dict", {}))
        try:
            for name in own:
                setattr(self.sae, name, torch.nn.Identity())
            yield
        finally:
            for name, point in own.items():
                setattr(self.sae, name, point)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for point, entry in self._entries:
            point.remove(entry)
        for point in self.points.values():
            self.hm.wiring.remove_point(point.name)


class SAEMixin:
    """``HookedSAETransformer``'s methods on :class:`lensadapters.HookedModel`."""

    def _splices(self) -> dict[str, _Splice]:
        store = self.__dict__.get("_sae_splices")
        if store is None:
            store = self.__dict__["_sae_splices"] = {}
        return store

    @property
    def acts_to_saes(self) -> dict[str, Any]:
        """The attached SAEs by their (input) hook name."""
        return {name: splice.sae for name, splice in self._splices().items()}

    def add_sae(
        self, sae: Any, use_error_term: Optional[bool] = None, exclude_special_tokens: Union[bool, list[int]] = False
    ) -> None:
        """Attach ``sae`` (an SAELens SAE, or a folder it was saved to) at its hook point until :meth:`reset_saes`
        (replacing an SAE attached there).

        ``use_error_term``: add the reconstruction error back (default: the SAE's own ``use_error_term``).
        ``exclude_special_tokens``: leave the activation unchanged at special tokens (``True``: the
        tokenizer's BOS/EOS/PAD/...; or a list of token ids)."""
        sae = load_sae(sae, self.device)  # type: ignore[attr-defined]
        name, _ = hook_names_of(sae)
        if name in self._splices():
            self._reset_sae(name)
        error_term = bool(getattr(sae, "use_error_term", False)) if use_error_term is None else use_error_term
        exclude = self._special_tokens(exclude_special_tokens)
        self._splices()[name] = _Splice(self, sae, error_term, exclude)  # type: ignore[arg-type]
        if exclude is not None:
            self._watch_tokens()

    def reset_saes(self, act_names: Union[str, list[str], None] = None) -> None:
        """Remove the SAEs attached at ``act_names`` (default: every one)."""
        names = [act_names] if isinstance(act_names, str) else list(self._splices()) if act_names is None else act_names
        for name in names:
            self._reset_sae(name)

    def _reset_sae(self, name: str) -> None:
        splice = self._splices().pop(name, None)
        if splice is None:
            raise LensAdaptersError(f"no SAE is attached at {name!r} (attached: {sorted(self._splices())})")
        splice.remove()
        if not any(s.exclude is not None for s in self._splices().values()):
            self._unwatch_tokens()

    @contextlib.contextmanager
    def saes(
        self,
        saes: SAEs = (),
        reset_saes_end: bool = True,
        use_error_term: Optional[bool] = None,
        exclude_special_tokens: Union[bool, list[int]] = False,
    ) -> Iterator[Any]:
        """SAEs attached for the duration of the block; SAEs attached before at the same points come back after."""
        saes = [saes] if not isinstance(saes, (list, tuple)) else list(saes)
        saes = [load_sae(sae, self.device) for sae in saes]  # type: ignore[attr-defined]
        previous = []
        try:
            for sae in saes:
                name, _ = hook_names_of(sae)
                old = self._splices().get(name)
                previous.append((name, old))
                self.add_sae(sae, use_error_term, exclude_special_tokens)
            yield self
        finally:
            if reset_saes_end:
                for name, old in reversed(previous):
                    if name in self._splices():
                        self._reset_sae(name)
                    if old is not None:
                        self.add_sae(old.sae, old.use_error_term, old.exclude if old.exclude is not None else False)

    def run_with_saes(
        self,
        *model_args: Any,
        saes: SAEs = (),
        reset_saes_end: bool = True,
        use_error_term: Optional[bool] = None,
        exclude_special_tokens: Union[bool, list[int]] = False,
        **model_kwargs: Any,
    ) -> Any:
        """The model's output with ``saes`` attached (as ``HookedSAETransformer.run_with_saes``): what
        ``run_with_hooks`` returns for the same arguments (the logits, or TransformerLens' ``return_type``)."""
        with self.saes(saes, reset_saes_end, use_error_term, exclude_special_tokens):
            return self.run_with_hooks(*model_args, **model_kwargs)  # type: ignore[attr-defined]

    def run_with_cache_with_saes(
        self,
        *model_args: Any,
        saes: SAEs = (),
        reset_saes_end: bool = True,
        use_error_term: Optional[bool] = None,
        exclude_special_tokens: Union[bool, list[int]] = False,
        **kwargs: Any,
    ) -> Any:
        """``run_with_cache`` with ``saes`` attached; the SAEs' hook points are cached too."""
        with self.saes(saes, reset_saes_end, use_error_term, exclude_special_tokens):
            return self.run_with_cache(*model_args, **kwargs)  # type: ignore[attr-defined]

    def run_with_hooks_with_saes(
        self,
        *model_args: Any,
        saes: SAEs = (),
        reset_saes_end: bool = True,
        exclude_special_tokens: Union[bool, list[int]] = False,
        fwd_hooks: Sequence[Any] = (),
        bwd_hooks: Sequence[Any] = (),
        reset_hooks_end: bool = True,
        **model_kwargs: Any,
    ) -> Any:
        """``run_with_hooks`` with ``saes`` attached; hooks may name the SAEs' hook points."""
        with self.saes(saes, reset_saes_end, None, exclude_special_tokens):
            return self.run_with_hooks(
                *model_args,
                fwd_hooks=fwd_hooks,  # type: ignore[attr-defined]
                bwd_hooks=bwd_hooks,
                reset_hooks_end=reset_hooks_end,
                **model_kwargs,
            )

    # --- special-token masks ------------------------------------------------------------------------------------

    def _special_tokens(self, exclude: Union[bool, list[int]]) -> Optional[torch.Tensor]:
        if exclude is False or exclude is None:
            return None
        if exclude is True:
            tokenizer = getattr(self, "tokenizer", None)
            if tokenizer is None:
                raise LensAdaptersError(
                    "exclude_special_tokens=True needs a tokenizer (hm.tokenizer); or pass the "
                    "token ids to exclude as a list"
                )
            ids = set(getattr(tokenizer, "all_special_ids", []) or [])
            ids.update(
                i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None
            )
            return torch.tensor(sorted(ids), dtype=torch.long)
        return torch.tensor(list(exclude), dtype=torch.long)

    def _watch_tokens(self) -> None:
        """Record each forward's input ids (the embedding's input) to mask the special tokens of that forward."""
        if self.__dict__.get("_sae_token_handle") is not None:
            return
        embed = self.hf_model.get_submodule(self.layout.embed)  # type: ignore[attr-defined]

        def record(module: Any, args: tuple) -> None:
            ids = args[0] if args and isinstance(args[0], torch.Tensor) else None
            for splice in self._splices().values():
                if splice.exclude is not None:
                    splice.mask = None if ids is None else torch.isin(ids, splice.exclude.to(ids.device))

        self.__dict__["_sae_token_handle"] = embed.register_forward_pre_hook(record)

    def _unwatch_tokens(self) -> None:
        handle = self.__dict__.pop("_sae_token_handle", None)
        if handle is not None:
            handle.remove()
