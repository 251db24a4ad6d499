"""Scale: models split by accelerate's ``device_map`` (CPU + disk offload), cache storage devices,
and long-context memory (a ``names_filter`` never materialises attention patterns nobody asked for).

Only CPU is available here: the disk-offloaded layers are the "other device" (accelerate moves their
weights in for each forward and out again), which exercises the same hook paths as a multi-GPU
``device_map="auto"`` split.

The models are tiny Hugging Face GPT-2 (learned positions) and Llama (rotary) models, wrapped by whichever
installed plugin supports them (found through its entry point; skipped when none is installed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from lensadapters import HookedModel
from lensadapters.hf import tiny_config_of
from lensadapters.testing import architecture_plugin, assert_close

accelerate = pytest.importorskip("accelerate")

LAYERS = 3


def tiny_config(kind: str, layers: int = LAYERS, heads: int = 4) -> Any:
    shared = dict(layers=layers, heads=heads, vocab=96, positions=512, bos_token_id=1, eos_token_id=2)
    if kind == "gpt2":
        return tiny_config_of(GPT2Config, dropout_free=True, **shared)
    return tiny_config_of(LlamaConfig, tie_word_embeddings=False, pad_token_id=0, **shared)


def make_model(kind: str, **kw: Any) -> torch.nn.Module:
    if architecture_plugin(kind) is None:
        pytest.skip(f"no installed lensadapters plugin supports model_type {kind!r}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **kw), attn_implementation="sdpa").eval()
    with torch.no_grad():  # larger-than-default weights so that every edit visibly moves the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def offload_map(kind: str) -> dict[str, str]:
    """Layer 0 on CPU, layers 1.. on disk; everything else on CPU."""
    if kind == "gpt2":
        top = {
            "transformer.wte": "cpu",
            "transformer.wpe": "cpu",
            "transformer.drop": "cpu",
            "transformer.ln_f": "cpu",
            "lm_head": "cpu",
        }
        layer = "transformer.h.{}"
    else:
        top = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
        layer = "model.layers.{}"
    return {**top, **{layer.format(i): ("cpu" if i == 0 else "disk") for i in range(LAYERS)}}


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(params=["gpt2", "llama"])
def pair(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, torch.nn.Module, torch.nn.Module]:
    """(kind, normally loaded model, the same weights loaded with layers offloaded to disk)."""
    kind = request.param
    plain = make_model(kind)
    plain.save_pretrained(tmp_path / "model")
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model",
        device_map=offload_map(kind),
        offload_folder=str(tmp_path / "offload"),
        attn_implementation="sdpa",
        dtype=torch.float32,
    ).eval()
    return kind, plain, offloaded


def test_offloaded_model_hooks_caches_and_edits(pair: Any) -> None:
    kind, plain, offloaded = pair
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    assert any(hasattr(m, "_hf_hook") for m in offloaded.modules()), "accelerate did not dispatch the model"
    with torch.no_grad():
        raw = offloaded(ids).logits
    accel_hooks = hook_count(offloaded)

    hm, ref = HookedModel.wrap(offloaded), HookedModel.wrap(plain)
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, raw), "no hooks must be bitwise the unwrapped offloaded model"
        assert_close(raw, plain(ids).logits, "offloaded vs plain")

        # run_with_cache through offloaded layers, patterns included
        logits, cache = hm.run_with_cache(ids)
        _, ref_cache = ref.run_with_cache(ids)
        assert_close(logits, raw, "logits with every hook point cached")  # patterns: explicit attention
        last = LAYERS - 1
        for name in (
            f"blocks.{last}.hook_resid_post",
            f"blocks.{last}.attn.hook_pattern",
            f"blocks.{last}.attn.hook_z",
            f"blocks.{last}.mlp.hook_post",
        ):
            assert name in cache
            assert_close(cache[name], ref_cache[name], name)

        # an edit in an offloaded layer changes the output exactly as on the normally loaded model
        def ablate_head(z: torch.Tensor, hook: Any) -> torch.Tensor:
            z = z.clone()
            z[:, :, 1] = 0.0
            return z

        def scale_pattern(p: torch.Tensor, hook: Any) -> torch.Tensor:
            return p * 0.5

        bump = torch.randn(32, generator=torch.Generator().manual_seed(4))
        # points computed from an offloaded layer's weights after its forward (accelerate has put them back on
        # the meta device by then): per-head results, norm edits
        for name, fn in (
            (f"blocks.{last}.attn.hook_z", ablate_head),
            (f"blocks.{last}.attn.hook_result", lambda t, hook: t * 1.5),
            (f"blocks.{last}.ln1.hook_normalized", lambda t, hook: t * 1.5),
            (f"blocks.{last}.ln2.hook_scale", lambda t, hook: t * 2),
            ("blocks.1.attn.hook_pattern", scale_pattern),
            ("blocks.1.hook_resid_mid", lambda t, hook: t + bump),
        ):  # not a constant: LN removes those
            edited = hm.run_with_hooks(ids, fwd_hooks=[(name, fn)])
            expected = ref.run_with_hooks(ids, fwd_hooks=[(name, fn)])
            assert (edited - raw).abs().max() > 1e-3, f"edit of {name} had no effect"
            assert_close(edited, expected, f"edit of {name}: offloaded vs plain")
        assert torch.equal(hm(ids).logits, raw), "hooks left behind after run_with_hooks"

        # weights of offloaded layers are read from the offloaded copy, one module at a time
        for accessor in ("W_E", "W_Q", "_W_K", "W_O", "b_O", "W_in", "W_out", "W_U"):
            assert torch.equal(getattr(hm, accessor), getattr(ref, accessor)), accessor
        offloaded_weights = [p for n, p in offloaded.named_parameters() if p.device.type == "meta"]
        assert offloaded_weights, "the offloaded layers' parameters stay offloaded after weights were read"

    model = hm.unwrap()
    assert model is offloaded
    assert hook_count(offloaded) == accel_hooks, "unwrap must leave exactly accelerate's own hooks"
    assert any(hasattr(m, "_hf_hook") for m in offloaded.modules())
    with torch.no_grad():
        assert torch.equal(offloaded(ids).logits, raw)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_cache_device_moves_tensors_as_recorded(kind: str) -> None:
    """``device=`` is applied inside the hook, as each tensor is recorded (not after the forward).

    Only CPU exists here: every ``Tensor.to`` call asking for the cache's device is recorded with whether the
    model's forward had finished, which proves each move happened while the forward ran, and the logits still
    match because the live activations stay put. (``device="meta"``, which would keep no values, is refused.)
    """
    hm = HookedModel.wrap(make_model(kind))
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain_logits = hm(ids).logits
        name = "blocks.0.hook_resid_post"
        finished: list[bool] = [False]
        moves: list[bool] = []
        real_to = torch.Tensor.to

        def spying_to(self, *args, **kwargs):  # noqa: ANN001, ANN202
            if torch.device("cpu") in args or kwargs.get("device") == torch.device("cpu"):
                moves.append(finished[0])
            return real_to(self, *args, **kwargs)

        done = hm.hf_model.register_forward_hook(lambda module, args, out: finished.__setitem__(0, True))
        torch.Tensor.to = spying_to
        try:
            logits, cache = hm.run_with_cache(
                ids, names_filter=[name, "blocks.1.attn.hook_pattern"], device=torch.device("cpu")
            )
        finally:
            torch.Tensor.to = real_to
            done.remove()
        assert_close(logits, plain_logits, "logits")  # layer 1's pattern: explicit attention there
        assert len(moves) >= 2 and not any(moves), f"cached tensors were moved after the forward: {moves}"
        assert set(cache.keys()) == {name, "blocks.1.attn.hook_pattern"}

        _, cache = hm.run_with_cache(ids, names_filter=[name], device="cpu")
        live: list[torch.Tensor] = []
        hm.run_with_hooks(ids, fwd_hooks=[(name, lambda t, hook: live.append(t))])
        cpu_value = cache[name]
        assert cpu_value.device.type == "cpu" and not cpu_value.requires_grad
        assert torch.equal(cpu_value, live[0])
        # the stored tensor is detached storage-wise from nothing the model mutates later: editing the
        # next run's activation in place does not touch it
        before = cpu_value.clone()
        hm.run_with_hooks(ids, fwd_hooks=[(name, lambda t, hook: t.mul_(0.0))])
        assert torch.equal(cpu_value, before)


class AllocatedBytes(TorchDispatchMode):
    """Adds up the bytes of every tensor an aten op allocates (views excluded): what a forward materialises."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.seq = seq
        self.total = 0
        self.square = 0  # bytes of tensors whose last two dimensions are (seq, seq): scores, patterns, masks

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:  # no new storage
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                nbytes = t.numel() * t.element_size()
                self.total += nbytes
                if t.shape[-1] == self.seq and t.shape[-2] == self.seq:
                    self.square += nbytes
        return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_names_filter_never_materialises_unasked_patterns(kind: str) -> None:
    seq, batch, heads, layers = 384, 1, 4, 4
    hm = HookedModel.wrap(make_model(kind, layers=layers, heads=heads))
    ids = torch.randint(3, 96, (batch, seq), generator=torch.Generator().manual_seed(3))
    one_pattern = batch * heads * seq * seq * 4  # float32

    def measure(**kw: Any) -> AllocatedBytes:
        spy = AllocatedBytes(seq)
        with torch.no_grad(), spy:
            if kw:
                hm.run_with_cache(ids, **kw)
            else:
                hm(ids)
        return spy

    base = measure()
    resid = measure(names_filter="blocks.2.hook_resid_post")
    one = measure(names_filter="blocks.2.attn.hook_pattern")
    every = measure(names_filter=lambda n: n.endswith("hook_pattern"))

    # sanity: the measurement sees patterns when they are computed, at least one per hooked layer
    per_layer = (every.square - base.square) / layers
    assert per_layer >= one_pattern
    assert every.total - base.total >= layers * one_pattern
    # one hooked layer costs one layer's share of "every layer hooked" (plus at most a shared mask): the other
    # layers keep the model's own attention and materialise nothing of attention size
    mask_slack = batch * seq * seq * 8
    assert one_pattern <= one.square - base.square <= per_layer + mask_slack
    # caching one residual stream: not a single attention-sized tensor more than the plain forward
    assert resid.square == base.square
    assert resid.total - base.total < one_pattern
