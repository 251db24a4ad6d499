"""Activations during training: hook points cached on a fixed probe batch every N steps, written to disk by step.

:func:`record_probe` (for a custom loop) and :class:`ProbeCallback` (a Hugging Face ``TrainerCallback``) run the
model on the same probe inputs in eval mode without gradients, cache the chosen hook points -- for a model with
adapters that can be switched off (a ``PeftModel``), also with the adapters disabled, as ``base/NAME`` -- and write
``OUT/step-NNNNNNNNN.safetensors``. :func:`load_probes` stacks them into ``[steps, ...]`` trajectories; steps that
recorded different hooks or shapes are refused by name (``partial=True``: each hook over the steps that recorded it),
never dropped.

Under DDP or FSDP every rank runs the probe (their forwards may be collectives) and rank 0 writes.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
from transformers import TrainerCallback

from lensadapters.errors import LensAdaptersError
from lensadapters.hooks.distributed import is_main_process

Tensor = torch.Tensor
Probe = Union[Tensor, Mapping[str, Tensor]]
FORMAT = "lensadapters-probe/1"
_STEP_FILE = re.compile(r"step-(\d+)\.safetensors$")
BASE_PREFIX = "base/"


def probe_file(out: str, step: int) -> str:
    return os.path.join(out, f"step-{step:09d}.safetensors")


def record_probe(
    model: Any,
    probe: Probe,
    hooks: Sequence[str],
    out: str,
    step: int,
    *,
    base: Union[bool, str] = "auto",
    write: Optional[bool] = None,
) -> Optional[str]:
    """Cache ``hooks`` on ``probe`` (token ids ``[batch, pos]`` or a dict of model inputs) and write them for
    ``step``; returns the file written (``None`` on the ranks that do not write).

    ``model``: a :class:`~lensadapters.HookedModel` or a model ``HookedModel.wrap`` accepts (a ``PeftModel``, a
    model under ``DistributedDataParallel``...; wrapped for the call). ``base``: also cache with the adapters
    disabled (``"auto"``: when the model has a ``disable_adapter()`` context, as a ``PeftModel`` has). ``write``:
    whether this process writes (default: rank 0 only). The model's train/eval mode and ``requires_grad`` flags
    are as before afterwards.
    """
    from lensadapters.api.hooked_model import HookedModel, _wrapper_of

    hm = model if isinstance(model, HookedModel) else _wrapper_of(model)
    owned = hm is None
    if hm is None:
        hm = HookedModel.wrap(model)
    try:
        inputs = _inputs(probe, hm.device)
        switch_off = _adapter_switch(hm)
        if base is True and switch_off is None:
            raise ValueError("record_probe(base=True): this model has no adapters to disable (no disable_adapter())")
        values = _cache(hm, inputs, hooks, contextlib.nullcontext)
        if base and switch_off is not None:
            values.update({BASE_PREFIX + k: v for k, v in _cache(hm, inputs, hooks, switch_off).items()})
    finally:
        if owned:
            hm.unwrap()
    if not (is_main_process() if write is None else write):
        return None
    values.update({f"inputs/{k}": v.detach().cpu().contiguous() for k, v in inputs.items()})
    return _write(out, step, values, list(hooks))


class ProbeCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that records ``hooks`` on ``probe`` (:func:`record_probe`) before the
    first step and every ``every`` optimizer steps into ``out`` (``step-NNNNNNNNN.safetensors``; rank 0 writes)."""

    def __init__(
        self, probe: Probe, hooks: Sequence[str], out: str, every: int = 100, base: Union[bool, str] = "auto"
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, not {every}")
        self.probe, self.hooks, self.out, self.every, self.base = probe, list(hooks), out, every, base

    def _record(self, state: Any, model: Any) -> None:
        record_probe(
            model,
            self.probe,
            self.hooks,
            self.out,
            state.global_step,
            base=self.base,
            write=state.is_world_process_zero,
        )

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._record(state, model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step % self.every == 0:
            self._record(state, model)


class ProbeMismatchError(LensAdaptersError, ValueError):
    """Recorded steps that do not stack: a hook recorded with different shapes or dtypes, or (without
    ``partial=True``) recorded by some steps and not by others."""


@dataclass(frozen=True)
class ProbeRecord:
    """Recorded probes: ``steps`` and, per name (``NAME``, ``base/NAME``, ``inputs/input_ids``), the values stacked
    over the steps that recorded it ``[steps, ...]`` (every step, unless ``load_probes(..., partial=True)`` let steps
    record different names: then :meth:`steps_of` says which)."""

    steps: list[int]
    values: dict[str, Tensor]
    recorded: dict[str, list[int]] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Tensor:
        return self.values[name]

    def steps_of(self, name: str) -> list[int]:
        """The steps ``self[name]`` holds, in order (row ``i`` is step ``steps_of(name)[i]``)."""
        if name not in self.values:
            raise KeyError(f"no recorded probe is named {name!r}; recorded: {sorted(self.values)}")
        return self.recorded.get(name, self.steps)


def load_probes(out: str, partial: bool = False) -> ProbeRecord:
    """Every step recorded in ``out``, in step order, each name stacked over steps ``[steps, ...]``.

    Nothing is dropped: when steps recorded different names (hooks added or removed between steps), this refuses
    with :class:`ProbeMismatchError` naming the step, its file and the name, unless ``partial=True``: then each
    name is stacked over the steps that recorded it and ``record.steps_of(name)`` lists them. A name recorded with
    different shapes or dtypes at different steps cannot be stacked and is always refused, naming both steps' files.
    """
    from safetensors.torch import load_file

    files = sorted(
        (int(m.group(1)), path)
        for path in glob.glob(os.path.join(out, "step-*.safetensors"))
        if (m := _STEP_FILE.search(path))
    )
    if not files:
        raise FileNotFoundError(f"{out} holds no recorded probe (step-*.safetensors)")
    loaded = [load_file(path) for _, path in files]
    steps = [step for step, _ in files]
    first_seen: dict[str, tuple[int, str, Tensor]] = {}
    recorded: dict[str, list[int]] = {}
    for (step, path), values in zip(files, loaded):
        for name, value in sorted(values.items()):
            if name not in first_seen:
                first_seen[name] = (step, path, value)
            seen_step, seen_path, seen = first_seen[name]
            if (value.shape, value.dtype) != (seen.shape, seen.dtype):
                raise ProbeMismatchError(
                    f"{path} (step {step}) recorded {name!r} as {_described(value)}, {seen_path} (step {seen_step}) "
                    f"as {_described(seen)}: a name's values must have one shape and dtype to stack over steps "
                    f"(record each probe batch into its own folder)"
                )
            recorded.setdefault(name, []).append(step)
    incomplete = {name: got for name, got in recorded.items() if len(got) != len(steps)}
    if incomplete and not partial:
        name, got = min(incomplete.items(), key=lambda item: (steps.index(_first_missing(steps, item[1])), item[0]))
        missing = _first_missing(steps, got)
        path = files[steps.index(missing)][1]
        raise ProbeMismatchError(
            f"{path} (step {missing}) did not record {name!r}, which {len(got)} of the {len(steps)} steps recorded "
            f"(first at step {got[0]}, {first_seen[name][1]}); {len(incomplete)} name(s) are recorded by only some "
            f"steps: {sorted(incomplete)}. Pass partial=True to stack each name over the steps that recorded it "
            f"(record.steps_of(name) lists them)"
        )
    values = {name: torch.stack([d[name] for d in loaded if name in d]) for name in recorded}
    return ProbeRecord(steps, values, {name: got for name, got in recorded.items()})


def _first_missing(steps: list[int], got: list[int]) -> int:
    present = set(got)
    return next(step for step in steps if step not in present)


def _described(value: Tensor) -> str:
    return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"


# --- helpers ----------------------------------------------------------------------------------------------------


def _inputs(probe: Probe, device: torch.device) -> dict[str, Tensor]:
    items = {"input_ids": probe} if isinstance(probe, Tensor) else dict(probe)
    return {k: v.to(device) for k, v in items.items() if isinstance(v, Tensor) and k != "labels"}


def _adapter_switch(hm: Any) -> Optional[Any]:
    """A context that disables the model's adapters (``disable_adapter()`` of the model, or of the module inside a
    data-parallel wrapper), or ``None``."""
    for candidate in (hm.model, getattr(hm.model, "module", None)):
        switch = getattr(candidate, "disable_adapter", None)
        if callable(switch):
            return switch
    return None


@contextlib.contextmanager
def _probing(hm: Any) -> Iterator[None]:
    """Eval mode and no gradients for the probe; the model's modes and ``requires_grad`` flags restored after."""
    modes = [(m, m.training) for m in hm.hf_model.modules()]
    flags = [(p, p.requires_grad) for p in hm.hf_model.parameters()]
    hm.hf_model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training
        for parameter, flag in flags:
            if parameter.requires_grad != flag:
                parameter.requires_grad_(flag)


def _cache(hm: Any, inputs: dict[str, Tensor], hooks: Sequence[str], context: Any) -> dict[str, Tensor]:
    with _probing(hm), context():
        _, cache = hm.run_with_cache(**inputs, names_filter=list(hooks))
    return {name: cache[name].detach().cpu().contiguous() for name in hooks}


def _write(out: str, step: int, values: dict[str, Tensor], hooks: list[str]) -> str:
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    path = probe_file(out, step)
    temporary = f"{path}.tmp"
    metadata = {"format": FORMAT, "step": str(step), "hooks": json.dumps(hooks), "rank": str(_rank())}
    save_file(values, temporary, metadata=metadata)
    os.replace(temporary, path)
    return path


def _rank() -> int:
    from lensadapters.hooks.distributed import launch_rank

    return launch_rank()[0]
