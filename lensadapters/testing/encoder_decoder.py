"""The contract suite in an encoder-decoder's form: :class:`EncoderDecoderContract`.

An encoder-decoder (``Architecture.encoder_decoder``: two stacks, the decoder reading the encoder's output through
cross-attention) serves TransformerLens 2.18 ``HookedEncoderDecoder``'s names: ``encoder.{i}.*``, ``decoder.{i}.*``
(with ``cross_attn.*``), ``encoder_final_ln.*`` and ``decoder_final_ln.*`` (where the stacks end in a norm:
``final_norms``). The single-stack properties of
:class:`~lensadapters.testing.AdapterContract` (``blocks.{i}`` names, causal-LM calls with token ids alone) are
skipped by name (``not_served``); these properties hold instead, on models from the plugin's ``config_strategy``
built with ``AutoModelForSeq2SeqLM`` and called with ``input_ids``, ``attention_mask`` and ``decoder_input_ids``:

* without hooks the wrapped model computes Hugging Face's logits bitwise (also after a cached run), and ``unwrap``
  gives the model back with its modules and parameters as they were and no per-instance override left;
* every point fires once per forward, in ``hook_names``' order, with the batch in front and the residual points
  ``[batch, pos, d_model]`` (the encoder's positions or the decoder's); identity hooks everywhere keep the logits;
* attention patterns are distributions over the keys: padding keys of the encoder get none (self- and cross-
  attention), the decoder's self-attention is causal;
* patching the last encoder block's output (or the last decoder block's) from a clean run into a corrupted run gives
  the clean logits bitwise;
* ``hm.generate`` (Hugging Face's, with its key/value cache) with identity hooks generates what the model does, an
  ablation changes the run it is attached to, and an exception in a hook leaves no hook behind.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lensadapters.analysis.cache_analysis import DecompositionUndefinedError
from lensadapters.errors import NotCausalError, WeightUnavailableError
from lensadapters.testing.contract import AdapterContract, assert_close
from lensadapters.testing.contract_support import _SETTINGS
from lensadapters.testing.strategies import as_strategy, token_inputs

__all__ = [
    "SIZES",
    "EncoderDecoderContract",
    "ReferencePoints",
    "check_edits_against_reference",
    "check_edits_match_plain_hooks",
    "check_one_stack_refusals",
    "check_points_against_reference",
    "check_reference_patterns",
    "draw_sizes",
    "logits_of",
    "nudge",
    "tiny_batch",
]

_SINGLE_STACK = (
    "a single-stack property (blocks.{i} points, causal-LM calls with token ids alone); the encoder-decoder "
    "properties of EncoderDecoderContract hold instead"
)


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a forward's output (``run_with_hooks`` gives the logits tensor, a forward its output object)."""
    return output.logits if hasattr(output, "logits") else output


_logits = logits_of

#: the sizes an encoder-decoder's tiny config strategy draws (each a value or a strategy; ``draw_sizes``)
SIZES: dict[str, Any] = {
    "n_heads": st.integers(1, 3),
    "d_head": st.sampled_from([4, 8]),
    "n_layers": st.integers(1, 2),
    "d_mlp": st.sampled_from([16, 24]),
    "vocab": st.integers(16, 64),
}


def draw_sizes(draw: st.DrawFn, overrides: dict[str, Any]) -> dict[str, Any]:
    """``SIZES`` drawn (``overrides``, values or strategies, replace them; the keys they use are removed from
    ``overrides``), with ``d_model = n_heads * d_head``."""
    sizes = {name: draw(as_strategy(overrides.pop(name, default)), label=name) for name, default in SIZES.items()}
    return {**sizes, "d_model": sizes["n_heads"] * sizes["d_head"]}


def tiny_batch(seed: int, pad: int, start: int, low: int) -> dict[str, torch.Tensor]:
    """Two encoder rows of 7 tokens (ids from ``low`` to 39), the second right-padded by 3 (``pad``), and decoder
    rows of 5 tokens starting with ``start``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, 40, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    ids[1, 4:] = pad
    decoder = torch.randint(low, 40, (2, 5), generator=g)
    decoder[:, 0] = start
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}


class ReferencePoints(dict):
    """The points a reference computes (name -> value); ``at(name, value)`` records one, after the edit ``edits``
    gives it (point -> fn), and returns what the reference computes on with."""

    def __init__(self, edits: Any = None) -> None:
        super().__init__()
        self.edits = edits or {}

    def at(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if name in self.edits:
            value = self.edits[name](value)
        self[name] = value
        return value


def check_reference_patterns(cache: Any) -> None:
    """The patterns of a :func:`tiny_batch` run on a model with two decoder layers: padding keys get no attention
    (self- and cross-attention), the decoder attends causally, cross-attention is ``[batch, heads, 5, 7]``."""
    assert torch.all(cache["encoder.0.attn.hook_pattern"][1, :, :, 4:] == 0)
    assert torch.all(cache["decoder.1.attn.hook_pattern"].triu(1) == 0)
    assert torch.all(cache["decoder.0.cross_attn.hook_pattern"][1, :, :, 4:] == 0)
    assert cache["decoder.0.cross_attn.hook_pattern"].shape[2:] == (5, 7)


def check_edits_match_plain_hooks(hm: Any, batch: dict[str, Any], cases: list, post: Any = None) -> None:
    """An edit (:func:`nudge`) through each point of ``cases`` (``(point, module, "output" or "input")``) is the same
    edit made by a plain PyTorch hook on the module (``post``: the forward hook making it, default
    ``nudge(output)``), bit for bit."""
    model = hm.hf_model
    post = post or (lambda m, a, o: nudge(o))
    with torch.no_grad():
        for name, module, where in cases:
            ours = logits_of(hm.run_with_hooks(**batch, fwd_hooks=[(name, lambda t, hook: nudge(t))]))
            if where == "output":
                handle = module.register_forward_hook(post)
            else:
                handle = module.register_forward_pre_hook(lambda m, a: (nudge(a[0]), *a[1:]))
            try:
                theirs = model(**batch).logits
            finally:
                handle.remove()
            assert torch.equal(ours, theirs), name


def check_one_stack_refusals(hm: Any, batch: dict[str, Any], corrupted: dict[str, Any], name: str) -> None:
    """Patching ``name`` (an encoder point) from a cached run of ``batch`` into a run of ``corrupted`` (other encoder
    tokens) restores ``batch``'s logits bitwise; TransformerLens' one-stack methods, the stacked per-block weights,
    the causal LM's loss and TransformerLens' decoder-only generate are refused by name on an encoder-decoder."""
    with torch.no_grad():
        clean = hm.hf_model(**batch).logits
        _, cache = hm.run_with_cache(**batch)
        patched = hm.run_with_hooks(**corrupted, fwd_hooks=[(name, lambda t, hook: cache[name])])
        assert torch.equal(logits_of(patched), clean)
    for method in ("accumulated_resid", "decompose_resid", "stack_head_results", "get_full_resid_decomposition"):
        with pytest.raises(DecompositionUndefinedError, match="encoder-decoder"):
            getattr(cache, method)()
    with pytest.raises(WeightUnavailableError, match="encoder-decoder"):
        _ = hm.W_Q
    with pytest.raises(NotCausalError, match="encoder-decoder"):
        hm(batch["input_ids"], return_type="loss")
    with pytest.raises(NotCausalError, match="encoder-decoder"):
        hm.generate(batch["input_ids"], max_new_tokens=1, return_type="tokens")


class EncoderDecoderContract(AdapterContract):
    """The generic properties of an encoder-decoder adapter (see the module docstring)."""

    not_served = {name: _SINGLE_STACK for name in dir(AdapterContract) if name.startswith("test_")}
    learned_positions, rotary, parallel_blocks = False, False, False
    max_decoder_len: ClassVar[int] = 5
    #: whether each stack ends in a final norm (``encoder_final_ln``/``decoder_final_ln``; BART's stacks do not)
    final_norms: ClassVar[bool] = True

    def has_final_norms(self, model: Any) -> bool:
        """Whether ``model``'s stacks end in a final norm: ``final_norms`` (a suite over several families answers
        per model)."""
        return self.final_norms

    def draw_run(self, data: st.DataObject, attn_implementation: Any = None) -> tuple[Any, dict[str, Any]]:
        """A model and its inputs: encoder rows (some left-padded) and decoder rows."""
        model: Any
        model, inputs = self.draw(data, attn_implementation)
        vocab = model.get_input_embeddings().weight.shape[0]
        decoder = data.draw(token_inputs(vocab, inputs.input_ids.shape[0], 1, self.max_decoder_len, False))
        decoder_ids = decoder.input_ids[: inputs.input_ids.shape[0]]
        if decoder_ids.shape[0] < inputs.input_ids.shape[0]:
            decoder_ids = decoder_ids[:1].expand(inputs.input_ids.shape[0], -1)
        return model, {**inputs.kwargs(), "decoder_input_ids": decoder_ids.contiguous()}

    @_SETTINGS
    @given(data=st.data())
    def test_encoder_decoder_no_hooks_is_bitwise_and_unwrap_restores(self, data: st.DataObject) -> None:
        for implementation in self.attn_implementations:
            model, batch = self.draw_run(data, implementation)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            with torch.no_grad():
                expected = model(**batch).logits
                # after the model's own forward, which may replace its modules itself (BigBird's encoder switches
                # to full attention on a short input, handing 4.x's attention wrapper a new inner module)
                modules = dict(model.named_modules())
                hm = self.wrap(model)
                assert torch.equal(hm(**batch).logits, expected), "no hooks: Hugging Face's forward"
                hm.run_with_cache(**batch)  # hooks that come and go (patterns included) leave nothing behind
                assert torch.equal(hm(**batch).logits, expected)
            assert hm.unwrap() is model
            assert dict(model.named_modules()) == modules
            assert not any("forward" in vars(m) for m in modules.values()), "no per-instance forward is left"
            assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())

    @_SETTINGS
    @given(data=st.data())
    def test_encoder_decoder_every_point_fires_once_in_order(self, data: st.DataObject) -> None:
        model, batch = self.draw_run(data)
        hm: Any = self.wrap(model)
        n_layers, d_model = hm.cfg.n_layers, hm.cfg.d_model
        for stack in ("encoder", "decoder"):
            for i in range(n_layers):
                assert (
                    f"{stack}.{i}.hook_resid_pre" in hm.hook_names and f"{stack}.{i}.attn.hook_pattern" in hm.hook_names
                )
            assert (f"{stack}_final_ln.hook_normalized" in hm.hook_names) == self.has_final_norms(model)
        assert f"decoder.{n_layers - 1}.cross_attn.hook_pattern" in hm.hook_names
        fired: list[str] = []
        shapes: dict[str, tuple[int, ...]] = {}

        def record(t: torch.Tensor, hook: Any) -> torch.Tensor:
            fired.append(hook.name)
            shapes[hook.name] = tuple(t.shape)
            return t

        with torch.no_grad():
            expected = model(**batch).logits
            logits = _logits(hm.run_with_hooks(**batch, fwd_hooks=[(name, record) for name in hm.hook_names]))
        assert_close(logits, expected, "identity hooks at every point")
        assert fired == hm.hook_names, "every point fires once, in hook_names' order"
        b, p = batch["input_ids"].shape
        q = batch["decoder_input_ids"].shape[1]
        for name, shape in shapes.items():
            assert shape[0] == b, name
            if name.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out")):
                assert shape == (b, p if name.startswith("encoder") else q, d_model), (name, shape)
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_encoder_decoder_patterns(self, data: st.DataObject) -> None:
        model, batch = self.draw_run(data)
        hm: Any = self.wrap(model)
        with torch.no_grad():
            _, cache = hm.run_with_cache(**batch, names_filter=lambda n: n.endswith("hook_pattern"))
        keys = batch["attention_mask"].bool()[:, None, None, :]
        q = batch["decoder_input_ids"].shape[1]
        later = torch.ones(q, q, dtype=torch.bool).triu(1)
        for name in cache:
            pattern = cache[name]
            assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)), f"{name}: rows are distributions")
            if name.startswith("encoder") or ".cross_attn." in name:  # the encoder's padding keys get nothing
                assert torch.all(pattern.masked_select(~keys.expand_as(pattern)) == 0), name
            else:  # the decoder's self-attention is causal
                assert torch.all(pattern[..., later] == 0), name
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_encoder_decoder_patching_restores(self, data: st.DataObject) -> None:
        model, batch = self.draw_run(data)
        hm: Any = self.wrap(model)
        last = hm.cfg.n_layers - 1
        vocab = model.get_input_embeddings().weight.shape[0]
        corrupted = {**batch, "input_ids": (batch["input_ids"] + 1) % vocab}
        with torch.no_grad():
            clean = model(**batch).logits
            names = [f"{stack}.{last}.hook_resid_post" for stack in ("encoder", "decoder")]
            _, cache = hm.run_with_cache(**batch, names_filter=names)  # the run's own attention (no pattern read)
            for name in names:
                patched = hm.run_with_hooks(**corrupted, fwd_hooks=[(name, lambda t, hook: cache[hook.name])])
                assert torch.equal(_logits(patched), clean), name
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_encoder_decoder_generation_with_hooks(self, data: st.DataObject) -> None:
        model, batch = self.draw_run(data)
        kwargs = dict(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=3, do_sample=False
        )
        hm = self.wrap(model)
        with torch.no_grad():
            plain = model.generate(**kwargs)
            calls: list[str] = []
            hm.add_hook(
                lambda n: n.endswith(("hook_resid_post", "hook_pattern")), lambda t, hook: calls.append(hook.name)
            )
            assert torch.equal(hm.generate(**kwargs), plain), "identity hooks generate what the model does"
            assert calls, "the hooks run during generation"
            hm.reset_hooks()

            def fail(t: torch.Tensor, hook: Any) -> None:
                raise RuntimeError("a user hook fails")

            with pytest.raises(RuntimeError, match="a user hook fails"):
                hm.run_with_hooks(**batch, fwd_hooks=[(hm.hook_names[-1], fail)])
            assert not hm.has_hooks, "an exception in a hook leaves no hook behind"
            assert torch.equal(hm.generate(**kwargs), plain)
        hm.unwrap()


def check_generation_with_hooks(hm: Any, batch: dict[str, Any], ablated: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``generate`` with hooks attached (with its key/value cache), on a model with two decoder
    layers: reading ``decoder.1``'s self- and cross-attention patterns leaves what is generated as it was, and they
    are read at every step (the first reads the start token, every later one a new token against the cache); zeroing
    ``decoder.1.hook_mlp_out`` generates what zeroing the output of ``ablated`` (the module whose output that point
    is) by a plain PyTorch hook generates. Returns the ablated and the plain generations."""
    model = hm.hf_model
    kwargs = dict(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=4, do_sample=False
    )
    plain = model.generate(**kwargs)
    seen: list[tuple] = []
    hm.add_hook("decoder.1.attn.hook_pattern", lambda t, hook: seen.append(tuple(t.shape)))
    hm.add_hook("decoder.1.cross_attn.hook_pattern", lambda t, hook: seen.append(tuple(t.shape)))
    assert torch.equal(hm.generate(**kwargs), plain), "reading patterns leaves generation as it was"
    keys = batch["input_ids"].shape[1]
    assert seen[:2] == [(2, 2, 1, 1), (2, 2, 1, keys)] and seen[-2:] == [(2, 2, 1, 4), (2, 2, 1, keys)]
    hm.reset_hooks()
    hm.add_hook("decoder.1.hook_mlp_out", lambda t, hook: t * 0)
    ours = hm.generate(**kwargs)
    hm.reset_hooks()
    handle = ablated.register_forward_hook(lambda m, a, o: o * 0)
    try:
        theirs = model.generate(**kwargs)
    finally:
        handle.remove()
    assert torch.equal(ours, theirs)
    return ours, plain


def nudge(t: torch.Tensor) -> torch.Tensor:
    """A fixed edit that changes every entry differently (and leaves ``finfo.min`` scores masked)."""
    return t + 0.05 * torch.sin(torch.arange(t.numel(), dtype=t.dtype).view(t.shape))


def check_edits_against_reference(hm: Any, batch: dict[str, Any], reference: Any) -> tuple[float, float]:
    """Edits at every point at once (``nudge(t) + delta_j * t``) change the logits as the same edits made in
    ``reference(model, batch, edits)`` (a plugin's reference written from the Hugging Face modules, returning its
    points and ``"logits"``) do, and the gradient of the logits with respect to each point's ``delta_j`` is the
    reference's. Returns the largest logits difference and the largest relative gradient difference."""
    model, names = hm.hf_model, hm.hook_names
    results, grads = [], []
    for run in ("hooked", "reference"):
        deltas = torch.zeros(len(names), requires_grad=True)
        edits = {n: (lambda t, hook=None, j=j, d=deltas: nudge(t) + d[j] * t) for j, n in enumerate(names)}
        if run == "hooked":
            logits = _logits(hm.run_with_hooks(**batch, fwd_hooks=list(edits.items())))
        else:
            logits = reference(model, batch, edits)["logits"]
        (grad,) = torch.autograd.grad(logits.pow(2).sum(), deltas)
        results.append(logits.detach())
        grads.append(grad)
    with torch.no_grad():
        assert not torch.allclose(results[0], model(**batch).logits, atol=1e-3), "the edits change the logits"
    assert_close(results[0], results[1], "edited logits against the reference")
    for j, name in enumerate(names):
        assert_close(grads[0][j], grads[1][j], f"{name}: gradient through the edit", rtol=1e-4)
    assert (grads[1] != 0).sum() >= len(names) - 2, "(almost) every edit reaches the logits"
    worst = (results[0] - results[1]).abs().max().item()
    worst_grad = ((grads[0] - grads[1]).abs() / grads[1].abs().clamp_min(1)).max().item()
    return worst, worst_grad


def check_points_against_reference(hm: Any, batch: dict[str, Any], reference: Any, eager: bool) -> tuple[Any, float]:
    """Every point of a forward that caches them all against ``reference(model, batch)`` (a plugin's reference
    written from the Hugging Face modules, returning every point and ``"logits"``): same shapes, within 1e-4; the
    cached forward computes Hugging Face's logits (bitwise where ``eager``: caching patterns writes attention out as
    eager attention computes it), and so does the reference. Returns the cache and the largest difference."""
    model = hm.hf_model
    with torch.no_grad():
        expected = model(**batch).logits
        logits, cache = hm.run_with_cache(**batch, names_filter=hm.hook_names)
        ref = reference(model, batch)
    logits = _logits(logits)
    if eager:
        assert torch.equal(logits, expected), "a cached forward computes HF's eager logits bitwise"
    assert_close(logits, expected, "a cached forward computes HF's logits")
    assert set(ref) - {"logits"} == set(hm.hook_names), "the reference computes every point"
    worst = 0.0
    for name in hm.hook_names:
        got, value = cache[name], ref[name]
        assert got.shape == value.shape, f"{name}: {tuple(got.shape)} != {tuple(value.shape)}"
        worst = max(worst, (got - value).abs().max().item())
    assert worst < 1e-4, f"largest difference from the reference {worst:.3g}"
    assert_close(ref["logits"], expected, "the reference's logits are HF's")
    return cache, worst
