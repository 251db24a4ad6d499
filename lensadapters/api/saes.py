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
import re
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

import torch

from lensadapters.errors import LensAdaptersError, UnknownHookError
from lensadapters.hooks.frames import current_recompute_token
from lensadapters.hooks.hook_point import HookEntry, HookPoint, is_recomputing

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


def sae_width(sae: Any) -> Optional[int]:
    """The SAE's input size: ``cfg.d_in`` (SAELens), else the encoder's first dimension, else ``None``."""
    d_in = getattr(getattr(sae, "cfg", None), "d_in", None)
    if isinstance(d_in, int):
        return d_in
    w_enc = getattr(sae, "W_enc", None)
    return int(w_enc.shape[0]) if isinstance(w_enc, torch.Tensor) and w_enc.dim() == 2 else None


_D_MODEL_POINT = re.compile(
    r"^(hook_embed|hook_pos_embed|blocks\.\d+\.(hook_resid_pre|hook_resid_mid|hook_resid_post|hook_attn_out|"
    r"hook_mlp_in|hook_mlp_out|(ln1|ln2|ln1_post|ln2_post)\.hook_normalized)|ln_final\.hook_normalized)$"
)
_MLP_POINT = re.compile(r"^blocks\.\d+\.mlp\.(hook_pre|hook_pre_linear|hook_post)$")
_Z_POINT = re.compile(r"^blocks\.\d+\.attn\.hook_z$")


def point_widths(cfg: Any, name: str) -> Optional[tuple[int, ...]]:
    """The input sizes an SAE may have at ``name``, as TransformerLens defines the point's shape (``None``: not
    known before a forward). ``hook_z`` is ``[batch, pos, head, d_head]``: SAELens reads it flattened
    (``n_heads * d_head``, ``reshape_activations="hook_z"``) or per head (``d_head``)."""
    if _D_MODEL_POINT.match(name):
        return (cfg.d_model,)
    if _Z_POINT.match(name):
        return (cfg.n_heads * cfg.d_head, cfg.d_head)
    if _MLP_POINT.match(name) and not getattr(cfg, "num_experts", None):
        return (cfg.d_mlp,)
    return None


def _size_error(name: str, d_in: int, sizes: Sequence[int], shape: Optional[tuple[int, ...]] = None) -> Exception:
    has = " or ".join(map(str, dict.fromkeys(sizes)))
    seen = f" (activations of shape {shape})" if shape is not None else ""
    return LensAdaptersError(
        f"the SAE for {name!r} has d_in={d_in}, but {name} has size {has}{seen}: load the SAE trained on this "
        f"hook point of this model (its cfg.metadata.hook_name names the point it is attached at)"
    )


class _Splice:
    """One SAE attached to a HookedModel (its points, its hooks, and how to take them away again).

    ``replacing``: the splice attached at the same point before, whose place in the points' hook lists this one
    takes (its entries go right after that splice's, which is then removed or, in a ``saes()`` block, suspended)."""

    def __init__(
        self, hm: "HookedModelLike", sae: Any, use_error_term: bool, exclude: Any, replacing: Optional["_Splice"] = None
    ) -> None:
        self.hm, self.sae, self.use_error_term, self.exclude = hm, sae, use_error_term, exclude
        self.input_name, self.output_name = hook_names_of(sae)
        for name in dict.fromkeys((self.input_name, self.output_name)):
            if name not in hm.hook_names:
                raise UnknownHookError(name, hm.hook_names)
        self.d_in = sae_width(sae)
        sizes = point_widths(hm.cfg, self.input_name)
        if self.d_in is not None and sizes is not None and self.d_in not in sizes:
            raise _size_error(self.input_name, self.d_in, sizes)
        self.suspended = False
        self._captured: Optional[torch.Tensor] = None
        if replacing is not None and not replacing.suspended:
            replacing._take_points_out()
        self.points: dict[str, HookPoint] = {}
        previous = self.output_name
        for sub in SAE_POINTS:
            self.points[sub] = hm.wiring.new_point(f"{self.output_name}.{sub}", after=previous)
            previous = self.points[sub].name
        self._handles: list[Any] = []
        self._bridge_all()
        self._entries: list[tuple[HookPoint, HookEntry]] = []
        if self.input_name != self.output_name:
            self._attach(hm.point(self.input_name), self._capture, True, replacing)
        self._attach(hm.point(self.output_name), self._replace, False, replacing)

    def _attach(self, point: HookPoint, fn: Any, readonly: bool, replacing: Optional["_Splice"]) -> None:
        entry = point.add(fn, "fwd", permanent=True, readonly=readonly)
        before = next((e for p, e in replacing._entries if p is point), None) if replacing is not None else None
        if before is not None and before in point.fwd_hooks:  # the place of the SAE this one replaces
            point.fwd_hooks.remove(entry)
            point.fwd_hooks.insert(point.fwd_hooks.index(before) + 1, entry)
        self._entries.append((point, entry))

    def _bridge_all(self) -> None:
        own = getattr(self.sae, "hook_dict", {})
        self._handles = [
            own[sub].register_forward_hook(self._bridge(sub))
            for sub in SAE_POINTS
            if sub not in _SPLICE_FIRED and sub in own
        ]

    def _bridge(self, sub: str) -> Any:
        def fire(module: Any, args: Any, output: torch.Tensor) -> Optional[torch.Tensor]:
            value, changed = self.points[sub].apply(output)
            return value if changed else None

        return fire

    def _capture(self, value: torch.Tensor, hook: Any) -> None:
        if not self.suspended:
            self._captured = value

    def _replace(self, value: torch.Tensor, hook: Any) -> Optional[torch.Tensor]:
        if self.suspended:  # a saes() block attached another SAE here for now
            return None
        sae_in = self._captured if self._captured is not None else value
        self._captured = None
        self._check_width(sae_in)
        mask = self._mask_for(value)
        features = self.sae.encode(sae_in)
        out = self.sae.decode(features)
        if self.use_error_term:
            with torch.no_grad(), self._unhooked():
                clean = self.sae.decode(self.sae.encode(sae_in))
            dtype = torch.promote_types(value.dtype, clean.dtype)
            error = value.to(dtype) - clean.to(dtype)  # as SAELens: x - x_reconstruct_clean, in the wider dtype
            if mask is not None:
                error = torch.where(mask, torch.zeros_like(error), error)
            edited, error_changed = self.points["hook_sae_error"].apply(error)
            if error_changed:
                out = out.to(dtype) + edited
            else:
                # out + (x - clean) arranged as x + (out - clean): the same sum, and exactly the model's value
                # (bit for bit, in every dtype) while the SAE's features are left as they are (out == clean)
                out = value.to(dtype) + (out.to(dtype) - clean.to(dtype))
        if mask is not None:
            out = torch.where(mask, value, out.to(value.dtype))
        out, _ = self.points["hook_sae_output"].apply(out.to(value.dtype))
        return out

    def _check_width(self, sae_in: torch.Tensor) -> None:
        if self.d_in is None or sae_in.dim() == 0:
            return
        sizes = [sae_in.shape[-1]] + ([sae_in.shape[-2] * sae_in.shape[-1]] if sae_in.dim() >= 4 else [])
        if self.d_in not in sizes:
            raise _size_error(self.input_name, self.d_in, sizes, tuple(sae_in.shape))

    def _mask_for(self, value: torch.Tensor) -> Optional[torch.Tensor]:
        if self.exclude is None:
            return None
        ids = self.hm._forward_token_ids()  # type: ignore[attr-defined]
        if ids is None:
            raise LensAdaptersError(
                f"exclude_special_tokens: this forward was given no token ids (inputs_embeds, or a module of the "
                f"model called on its own), so which positions of {self.output_name} hold special tokens is "
                f"unknown: pass input_ids, or attach the SAE without exclude_special_tokens"
            )
        mask = torch.isin(ids, self.exclude.to(ids.device)).to(value.device)
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

    def _take_points_out(self) -> None:
        """Take the SAE's hook points (with their hooks) and its bridges out of the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for point in self.points.values():
            if self.hm.wiring.hook_dict.get(point.name) is point:
                self.hm.wiring.remove_point(point.name)

    def suspend(self) -> None:
        """Step aside for another SAE at the same point (a ``saes()`` block): pass values through, keeping the
        place of its hooks in the points' hook lists and its own points' hooks for :meth:`resume`."""
        self._take_points_out()
        self.suspended = True

    def resume(self) -> None:
        """Back after :meth:`suspend`: the same points (with the hooks they had), in the same places."""
        wiring = self.hm.wiring
        previous = self.output_name
        for point in self.points.values():
            wiring.new_point(point.name, after=previous)
            wiring._points[point.name] = point  # the point itself, with its hooks, where new_point placed it
            point._on_change(point)
            previous = point.name
        self._bridge_all()
        self.suspended = False

    def remove(self) -> None:
        self._take_points_out()
        for point, entry in self._entries:
            point.remove(entry)


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
        self._attach_sae(sae, use_error_term, exclude_special_tokens, suspend=False)

    def _attach_sae(
        self, sae: Any, use_error_term: Optional[bool], exclude_special_tokens: Union[bool, list[int]], suspend: bool
    ) -> Optional[_Splice]:
        """Attach ``sae`` in the place of the SAE attached at its point (removed, or with ``suspend`` kept aside
        for a ``saes()`` block to bring back); return that SAE's splice."""
        name, _ = hook_names_of(sae)
        error_term = bool(getattr(sae, "use_error_term", False)) if use_error_term is None else use_error_term
        exclude = self._special_tokens(exclude_special_tokens)
        old = self._splices().get(name)
        splice = _Splice(self, sae, error_term, exclude, replacing=old)  # type: ignore[arg-type]
        if old is not None:
            if suspend:
                old.suspend()
            else:
                old.remove()
        self._splices()[name] = splice
        self._update_token_watch()
        return old

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
        self._update_token_watch()

    def _update_token_watch(self) -> None:
        if any(s.exclude is not None for s in self._splices().values()):
            self._watch_tokens()
        else:
            self._unwatch_tokens()

    @contextlib.contextmanager
    def saes(
        self,
        saes: SAEs = (),
        reset_saes_end: bool = True,
        use_error_term: Optional[bool] = None,
        exclude_special_tokens: Union[bool, list[int]] = False,
    ) -> Iterator[Any]:
        """SAEs attached for the duration of the block; SAEs attached before at the same points come back after,
        exactly where they were (a hook added at the point after them sees their output again)."""
        saes = [saes] if not isinstance(saes, (list, tuple)) else list(saes)
        saes = [load_sae(sae, self.device) for sae in saes]  # type: ignore[attr-defined]
        previous: list[tuple[str, Optional[_Splice]]] = []
        try:
            for sae in saes:
                name, _ = hook_names_of(sae)
                previous.append((name, self._attach_sae(sae, use_error_term, exclude_special_tokens, suspend=True)))
            yield self
        finally:
            alive = self.__dict__.get("_alive", True)
            for name, old in reversed(previous):
                if reset_saes_end and alive and name in self._splices():
                    self._reset_sae(name)
                if old is None:
                    continue
                if reset_saes_end and alive:
                    old.resume()
                    self._splices()[name] = old
                    self._update_token_watch()
                else:
                    old.remove()

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
        """Record each forward's input ids (the embedding's input) in that forward's frame, to mask the special
        tokens of that forward (a hook calling the model again has its own), and for its recomputation under
        gradient checkpointing."""
        if self.__dict__.get("_sae_token_handle") is not None:
            return
        embed = self.hf_model.get_submodule(self.layout.embed)  # type: ignore[attr-defined]
        state = self.wiring.forward_state  # type: ignore[attr-defined]
        # kept after the SAEs go: a forward's recomputation in backward() (gradient checkpointing) runs their hooks
        by_token: "weakref.WeakKeyDictionary[Any, torch.Tensor]" = self.__dict__.setdefault(
            "_sae_token_ids", weakref.WeakKeyDictionary()
        )

        def record(module: Any, args: tuple) -> None:
            if state.depth is None:  # the embedding called on its own
                return
            ids = args[0] if args and isinstance(args[0], torch.Tensor) else None
            frame = state.frame
            frame.site_values(by_token)["ids"] = ids
            if frame.token is not None and ids is not None:
                by_token[frame.token] = ids

        self.__dict__["_sae_token_handle"] = embed.register_forward_pre_hook(record)

    def _forward_token_ids(self) -> Optional[torch.Tensor]:
        """The token ids of the forward running now (``None``: it was given none, e.g. ``inputs_embeds``)."""
        by_token = self.__dict__.get("_sae_token_ids")
        if by_token is None:
            return None
        if is_recomputing():
            token = current_recompute_token()
            return by_token.get(token) if token is not None else None
        state = self.wiring.forward_state  # type: ignore[attr-defined]
        if state.depth is None:
            return None
        ids: Optional[torch.Tensor] = state.frame.site_values(by_token).get("ids")
        return ids

    def _unwatch_tokens(self) -> None:
        handle = self.__dict__.pop("_sae_token_handle", None)
        if handle is not None:
            handle.remove()
