"""Multimodal Gemma 4 with an audio tower: the audio projector's points (``audio_projector.hook_in``/``hook_out``)
read and edit as plain hooks do, and skip a call that embeds token ids. The tiny model is
``lensadapters.testing.vlm.gemma4_audio``."""

from __future__ import annotations

from typing import Any

import torch

from lensadapters import HookedModel
from lensadapters.testing.vlm import (
    audio_inputs,
    gemma4_audio,
    gemma4_vlm,
    logits_of,
    logits_with,
)


def test_audio_projector_points_read_and_edit_as_plain_hooks_do() -> None:
    """``audio_projector.hook_in`` is the audio tower's output as ``embed_audio`` reads it and
    ``audio_projector.hook_out`` its output (the audio features that replace the audio tokens' embeddings): each
    reads what a plain PyTorch hook on the projector sees, an edit at each changes the logits exactly as the same
    edit by a plain hook, and neither fires without audio (nor exists in a model without an audio tower)."""
    from lensadapters.adapters.vlm import AUDIO_EMBEDS_POINT, AUDIO_FEATURES_POINT

    model = gemma4_audio()
    batch = audio_inputs()
    projector = model.model.embed_audio
    seen: dict[str, torch.Tensor] = {}

    def edit(x: torch.Tensor) -> torch.Tensor:
        return x * -2.0 + 0.5

    def read_in(module: Any, args: tuple, kwargs: dict) -> None:
        seen["in"] = (args[0] if args else kwargs["inputs_embeds"]).clone()

    def read_out(module: Any, args: tuple, output: torch.Tensor) -> None:
        seen["out"] = output.clone()

    def edit_in(module: Any, args: tuple, kwargs: dict) -> Any:
        if args:
            return (edit(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "inputs_embeds": edit(kwargs["inputs_embeds"])}

    def edit_out(module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return edit(output)

    expected = {}
    reading = projector.register_forward_pre_hook(read_in, with_kwargs=True), projector.register_forward_hook(read_out)
    clean = logits_with(model, batch, *reading)
    for point, register, hook in (
        (AUDIO_FEATURES_POINT, projector.register_forward_pre_hook, edit_in),
        (AUDIO_EMBEDS_POINT, projector.register_forward_hook, edit_out),
    ):
        handle = register(hook, **({"with_kwargs": True} if point == AUDIO_FEATURES_POINT else {}))
        expected[point] = logits_with(model, batch, handle)
    hm = HookedModel.wrap(model)
    assert {AUDIO_FEATURES_POINT, AUDIO_EMBEDS_POINT} <= set(hm.hook_names)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(**batch, names_filter=[AUDIO_FEATURES_POINT, AUDIO_EMBEDS_POINT])
        assert torch.equal(logits_of(logits), clean)
        assert torch.equal(cache[AUDIO_FEATURES_POINT], seen["in"])
        assert torch.equal(cache[AUDIO_EMBEDS_POINT], seen["out"])
        for point in (AUDIO_FEATURES_POINT, AUDIO_EMBEDS_POINT):
            got = hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda x, hook: edit(x))])
            assert torch.equal(logits_of(got), expected[point])
            assert not torch.equal(expected[point], clean)
        _, text_only = hm.run_with_cache(torch.tensor([[1, 5, 7, 8]]))
    assert AUDIO_FEATURES_POINT not in text_only and AUDIO_EMBEDS_POINT not in text_only
    hm.unwrap()
    without_audio = HookedModel.wrap(gemma4_vlm()[0])
    assert not {AUDIO_FEATURES_POINT, AUDIO_EMBEDS_POINT} & set(without_audio.hook_names)
    without_audio.unwrap()


def test_audio_projector_points_skip_a_call_that_embeds_token_ids() -> None:
    """A projector that also embeds token ids (Gemma 3n's ``embed_audio(input_ids=...)``, in every call) is not
    projecting features then: neither point fires, and the features call after it is read as usual."""
    from lensadapters.hooks.hook_point import HookPoint
    from lensadapters.wiring.vision import FeaturesSite

    class Embedder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding, self.projection = torch.nn.Embedding(4, 3), torch.nn.Linear(2, 3)

        def forward(self, input_ids: Any = None, inputs_embeds: Any = None) -> torch.Tensor:
            return self.embedding(input_ids) if input_ids is not None else self.projection(inputs_embeds)

    module = Embedder()
    hook_in, hook_out = (
        HookPoint("audio_projector.hook_in", lambda p: None),
        HookPoint("audio_projector.hook_out", lambda p: None),
    )
    fired: list[torch.Tensor] = []
    for point in (hook_in, hook_out):
        point.add_hook(lambda x, hook: fired.append(x))
    handles = FeaturesSite(module, hook_in, hook_out).install()
    features = torch.randn(2, 2)
    with torch.no_grad():
        module(input_ids=torch.tensor([1, 2]))
        assert fired == []
        out = module(inputs_embeds=features)
    for handle in handles:
        handle.remove()
    assert len(fired) == 2 and torch.equal(fired[0], features) and torch.equal(fired[1], out)
