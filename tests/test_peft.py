"""PEFT / LoRA (lensadapters-peft): the contract suite on adapted models, plus LoRA's own properties.

The contract suite runs on ``PeftModel``s built over tiny GPT-2 (fused ``c_attn`` as ``Conv1D`` with
``fan_in_fan_out``), Llama (separate q/k/v, GQA, gated MLP), GPT-NeoX (per-head interleaved fused
``query_key_value``, parallel residual) and OPT (pre- and post-LN, MLP inside the decoder layer) models,
with random subsets of adapted projections, one or two active adapters, rsLoRA and LoRA biases. The
LoRA tests below check the ``*_lora`` hook points, disabled / merged / switched adapters, effective
weights and factors. Architectures whose plugin is not installed are skipped.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

import lensadapters_peft as lp  # noqa: E402
from lensadapters import HookedModel, LensAdaptersError, UnsupportedModelError  # noqa: E402
from lensadapters.testing import AdapterContract, assert_close  # noqa: E402

warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")

try:
    import lensadapters_gpt2
except ImportError:  # pragma: no cover
    lensadapters_gpt2 = None
try:
    import lensadapters_llama
except ImportError:  # pragma: no cover
    lensadapters_llama = None
try:
    import lensadapters_gpt_neox
except ImportError:  # pragma: no cover
    lensadapters_gpt_neox = None
try:
    import lensadapters_opt
except ImportError:  # pragma: no cover
    lensadapters_opt = None

SETTINGS = settings(deadline=None)  # example counts come from the profile (tests/conftest.py)
# pattern/score hooks run the core's explicit attention (equal to SDPA within rounding, not bitwise)
NO_PATTERN = lambda name: not name.endswith(("hook_pattern", "hook_attn_scores"))  # noqa: E731


# --- building adapted models -----------------------------------------------------------------------


@dataclass
class Adapted:
    """A tiny HF config plus the LoRA adapters to put on it."""

    config: Any
    targets: list[str]
    r: int = 4
    alpha: int = 8
    rslora: bool = False
    lora_bias: bool = False
    second: Optional[list[str]] = None  # targets of a second adapter, active together with the first
    fan_in_fan_out: bool = False
    extra: dict = field(default_factory=dict)


def _init_lora(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial LoRA factors (PEFT's default B = 0 would make every delta zero)."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(max(p.shape)))


def lora_model(base: torch.nn.Module, spec: Adapted, seed: int) -> PeftModel:
    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=spec.targets, init_lora_weights=False,
                     use_rslora=spec.rslora, lora_bias=spec.lora_bias, fan_in_fan_out=spec.fan_in_fan_out)
    pm = get_peft_model(base, cfg)
    if spec.second:
        pm.add_adapter("second", LoraConfig(r=2, lora_alpha=3, target_modules=spec.second, init_lora_weights=False,
                                            fan_in_fan_out=spec.fan_in_fan_out))
        pm.base_model.set_adapter(["default", "second"])
    _init_lora(pm, seed)
    return pm.eval()


def _subset(draw: Any, options: list[str]) -> list[str]:
    chosen = draw(st.lists(st.sampled_from(options), min_size=1, max_size=len(options), unique=True))
    return sorted(chosen)


# Strategies draw at least two query heads: with one head and two tokens, the contract's tiny random models can
# saturate the softmax so that a query edit changes the logits by < 1e-5 (the core's hook_q as much as hook_q_lora),
# which test_every_hook_point_edit_changes_logits would report.
GPT2_TARGETS = ["c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEOX_TARGETS = ["query_key_value", "attention.dense", "dense_h_to_4h", "dense_4h_to_h"]
OPT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


@st.composite
def gpt2_adapted(draw: Any) -> Adapted:
    from transformers import GPT2Config

    n_head = draw(st.integers(2, 4))
    config = GPT2Config(
        n_layer=draw(st.integers(1, 2)), n_head=n_head, n_embd=n_head * draw(st.sampled_from([4, 8])),
        n_inner=draw(st.sampled_from([None, 24])), vocab_size=draw(st.integers(16, 100)), n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    second = draw(st.one_of(st.none(), st.just(_subset(draw, GPT2_TARGETS))))
    return Adapted(config, _subset(draw, GPT2_TARGETS), r=draw(st.integers(1, 4)), alpha=draw(st.integers(1, 16)),
                   rslora=draw(st.booleans()), lora_bias=draw(st.booleans()), second=second, fan_in_fan_out=True)


@st.composite
def llama_adapted(draw: Any) -> Adapted:
    from transformers import LlamaConfig

    n_kv = draw(st.sampled_from([1, 2]))
    n_heads = n_kv * 2
    head_dim = draw(st.sampled_from([4, 8]))
    config = LlamaConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=draw(st.integers(1, 2)), num_attention_heads=n_heads,
        num_key_value_heads=n_kv, head_dim=head_dim, vocab_size=64, max_position_embeddings=32,
        attention_bias=draw(st.booleans()), tie_word_embeddings=False, attention_dropout=0.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    second = draw(st.one_of(st.none(), st.just(_subset(draw, LLAMA_TARGETS))))
    return Adapted(config, _subset(draw, LLAMA_TARGETS), r=draw(st.integers(1, 4)), alpha=draw(st.integers(1, 16)),
                   rslora=draw(st.booleans()), second=second)


@st.composite
def neox_adapted(draw: Any) -> Adapted:
    from transformers import GPTNeoXConfig

    n_heads = draw(st.integers(2, 4))
    config = GPTNeoXConfig(
        hidden_size=n_heads * 8, num_attention_heads=n_heads, num_hidden_layers=draw(st.integers(1, 2)),
        intermediate_size=24, vocab_size=64, max_position_embeddings=32, rotary_pct=draw(st.sampled_from([0.25, 1.0])),
        use_parallel_residual=draw(st.booleans()), hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    second = draw(st.one_of(st.none(), st.just(_subset(draw, NEOX_TARGETS))))
    return Adapted(config, _subset(draw, NEOX_TARGETS), r=draw(st.integers(1, 4)), alpha=draw(st.integers(1, 16)),
                   lora_bias=draw(st.booleans()), second=second)


@st.composite
def opt_adapted(draw: Any) -> Adapted:
    from transformers import OPTConfig

    n_heads = draw(st.integers(2, 4))
    hidden = n_heads * 8
    config = OPTConfig(
        vocab_size=64, hidden_size=hidden, num_hidden_layers=draw(st.integers(1, 2)), ffn_dim=24,
        num_attention_heads=n_heads, max_position_embeddings=32, word_embed_proj_dim=hidden,
        do_layer_norm_before=draw(st.booleans()), enable_bias=draw(st.booleans()), dropout=0.0,
        attention_dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    second = draw(st.one_of(st.none(), st.just(_subset(draw, OPT_TARGETS))))
    return Adapted(config, _subset(draw, OPT_TARGETS), r=draw(st.integers(1, 4)), alpha=draw(st.integers(1, 16)),
                   second=second)


class PeftContract(AdapterContract):
    """The contract suite, with every model a ``PeftModel`` (LoRA) over the drawn config."""

    extra_plugins = (lp,)
    adapted: Any = None

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        return cls.adapted()

    def make_model(self, spec: Adapted, seed: int, attn_implementation: str = "sdpa") -> torch.nn.Module:
        base = super().make_model(spec.config, seed, attn_implementation)
        return lora_model(base, spec, seed)


def _skip_without(plugin: Any, name: str) -> Any:
    return pytest.mark.skipif(plugin is None, reason=f"{name} is not installed")


@_skip_without(lensadapters_gpt2, "lensadapters-gpt2")
class TestPeftGPT2(PeftContract):
    plugin = lensadapters_gpt2
    adapted = staticmethod(gpt2_adapted)


@_skip_without(lensadapters_llama, "lensadapters-llama")
class TestPeftLlama(PeftContract):
    plugin = lensadapters_llama
    adapted = staticmethod(llama_adapted)


@_skip_without(lensadapters_gpt_neox, "lensadapters-gpt-neox")
class TestPeftGPTNeoX(PeftContract):
    plugin = lensadapters_gpt_neox
    adapted = staticmethod(neox_adapted)

    def pre_ln_residual(self, model: torch.nn.Module) -> bool:
        return True


@_skip_without(lensadapters_opt, "lensadapters-opt")
class TestPeftOPT(PeftContract):
    plugin = lensadapters_opt
    adapted = staticmethod(opt_adapted)

    def pre_ln_residual(self, model: torch.nn.Module) -> bool:
        return bool(model.config.do_layer_norm_before)


# --- LoRA-specific properties ------------------------------------------------------------------------

ARCHS = [
    pytest.param(lensadapters_gpt2, gpt2_adapted, id="gpt2", marks=_skip_without(lensadapters_gpt2, "gpt2")),
    pytest.param(lensadapters_llama, llama_adapted, id="llama", marks=_skip_without(lensadapters_llama, "llama")),
    pytest.param(lensadapters_gpt_neox, neox_adapted, id="gpt_neox",
                 marks=_skip_without(lensadapters_gpt_neox, "gpt_neox")),
    pytest.param(lensadapters_opt, opt_adapted, id="opt", marks=_skip_without(lensadapters_opt, "opt")),
]


class Kit:
    """Builds base and adapted twins of one drawn spec and wraps them with a private registry."""

    def __init__(self, plugin: Any, spec: Adapted, seed: int) -> None:
        self.plugin, self.spec, self.seed = plugin, spec, seed
        self.contract = type("C", (PeftContract,), {"plugin": plugin})()

    def base(self) -> torch.nn.Module:
        return AdapterContract.make_model(self.contract, self.spec.config, self.seed)

    def adapted(self, spec: Optional[Adapted] = None) -> PeftModel:
        return lora_model(self.base(), spec or self.spec, self.seed)

    def wrap(self, model: Any) -> HookedModel:
        return self.contract.wrap(model)


def draw_kit(data: Any, plugin: Any, strategy: Any, **overrides: Any) -> tuple[Kit, torch.Tensor]:
    spec = data.draw(strategy(), label="spec")
    for key, value in overrides.items():
        setattr(spec, key, value)
    seed = data.draw(st.integers(0, 2**16), label="seed")
    ids = torch.randint(0, spec.config.vocab_size, (2, data.draw(st.integers(2, 8), label="length")),
                        generator=torch.Generator().manual_seed(seed))
    return Kit(plugin, spec, seed), ids


def lora_layers(hm: HookedModel) -> dict[str, Any]:
    """``{lora hook name: the LoRA layer it belongs to}``."""
    out = {}
    for site in hm._sites:
        if isinstance(site, lp.LoraDeltaSite):
            for point in site.points:
                out[point.name] = site.module
    return out


def split_like(hm: HookedModel, name: str, t: torch.Tensor) -> torch.Tensor:
    """Split a projection-output tensor as the hook point ``name`` shows it."""
    layer = int(name.split(".")[1])
    short = name.rsplit(".", 1)[1]
    qkv = hm.qkv_layouts[layer]
    if short in ("hook_q_lora", "hook_k_lora", "hook_v_lora"):
        index = "qkv".index(short[5])
        if hasattr(qkv, "split"):
            return qkv.split(t)[index]
        return t.unflatten(-1, (-1, hm.cfg.d_head))
    return t


@pytest.mark.parametrize("plugin,strategy", ARCHS)
@SETTINGS
@given(data=st.data())
def test_lora_points_read_the_exact_delta(plugin: Any, strategy: Any, data: Any) -> None:
    """Each ``*_lora`` point reads exactly what PEFT adds (sum of B·A·x·scaling over active adapters)."""
    kit, ids = draw_kit(data, plugin, strategy)
    pm = kit.adapted()
    hm = kit.wrap(pm)
    layers = lora_layers(hm)
    assert layers and set(layers) == set(lp.lora_hook_names(hm))
    inputs: dict[int, torch.Tensor] = {}
    outs: dict[int, torch.Tensor] = {}
    handles = []
    def record(m: torch.nn.Module, a: tuple, o: torch.Tensor) -> None:
        inputs[id(m)] = a[0]
        outs[id(m)] = o

    for module in set(layers.values()):
        handles.append(module.register_forward_hook(record))
        handles.append(module.base_layer.register_forward_hook(
            lambda m, a, o: outs.__setitem__(("base", id(m)), o)))
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
        assert torch.equal(logits, pm(ids).logits)
        for name, module in layers.items():
            x = inputs[id(module)]
            expected = None
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    d = module.lora_B[adapter](module.lora_A[adapter](x)) * module.scaling[adapter]
                    expected = d if expected is None else expected + d
            # (a block that flattens tokens around its MLP, OPT, shows [b, p, ...]: compare in that shape)
            assert torch.equal(cache[name], split_like(hm, name, expected).reshape(cache[name].shape)), name
            # and the projection output is base + delta, as PEFT computed it
            if len([a for a in module.active_adapters if a in module.lora_A]) == 1:
                base_out = outs[("base", id(module.base_layer))]
                assert torch.equal(outs[id(module)], base_out + expected)
    for h in handles:
        h.remove()
    # the factors give the same delta in TransformerLens shapes
    with torch.no_grad():
        for name, module in layers.items():
            short = name.rsplit(".", 1)[1][len("hook_"):-len("_lora")]
            layer = int(name.split(".")[1])
            which = {"pre": "gate" if hm.cfg.gated_mlp else "in", "pre_linear": "in"}.get(short, short)
            active = [a for a in module.active_adapters if a in module.lora_A]
            total = 0
            for adapter in active:
                f = lp.lora_factors(hm, layer, which, adapter=adapter)
                x = inputs[id(module)]
                if which in "qkv":
                    total = total + torch.einsum("bpm,mr,hrd->bphd", x, f.A, f.B) * f.scaling
                    total = total + (f.b if f.b is not None else 0)
                elif which == "o":
                    total = total + torch.einsum("bphd,hdr,rm->bpm", x.unflatten(-1, (hm.cfg.n_heads, -1)), f.A,
                                                 f.B) * f.scaling + (f.b if f.b is not None else 0)
                else:
                    total = total + x @ f.A @ f.B * f.scaling + (f.b if f.b is not None else 0)
            assert_close(cache[name], total.reshape(cache[name].shape), f"{name} == x @ A @ B * scaling (lora_factors)")
    assert hm.unwrap() is pm


@pytest.mark.parametrize("plugin,strategy", ARCHS)
@SETTINGS
@given(data=st.data())
def test_zero_ablating_a_head_delta_is_disabling_it(plugin: Any, strategy: Any, data: Any) -> None:
    """Zeroing one head's q/k/v delta gives that head the base projection exactly, the others keep theirs."""
    kit, ids = draw_kit(data, plugin, strategy, second=None)
    pm = kit.adapted()
    hm = kit.wrap(pm)
    heads = [n for n in lp.lora_hook_names(hm) if n.endswith(("hook_q_lora", "hook_k_lora", "hook_v_lora"))]
    if not heads:
        return
    name = data.draw(st.sampled_from(heads), label="point")
    target = name.replace("_lora", "")
    layer = int(name.split(".")[1])
    n = hm.cfg.n_heads if name.endswith("q_lora") else hm.cfg.n_key_value_heads
    head = data.draw(st.integers(0, n - 1), label="head")

    def zero(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t = t.clone()
        t[:, :, head] = 0
        return t

    # the base layer's output in the edited forward pass: what the head must be without its delta
    module = lora_layers(hm)[name]
    base_out: list[torch.Tensor] = []
    handle = module.base_layer.register_forward_hook(lambda m, a, o: base_out.append(o))
    with torch.no_grad():
        _, adapted = hm.run_with_cache(ids, names_filter=[target])
        with hm.hooks([(name, zero)]):
            _, edited = hm.run_with_cache(ids, names_filter=[target])
    handle.remove()
    base_heads = split_like(hm, name, base_out[-1])
    a, e = adapted[target], edited[target]
    others = [h for h in range(n) if h != head]
    assert torch.equal(e[:, :, others], a[:, :, others])
    assert torch.equal(e[:, :, head], base_heads[:, :, head])
    # with the adapter disabled, this layer's head is the same function of its input
    if layer == 0:
        with lp.adapters_disabled(hm), torch.no_grad():
            _, disabled = hm.run_with_cache(ids, names_filter=[target])
        assert torch.equal(e[:, :, head], disabled[target][:, :, head])
    hm.unwrap()


@pytest.mark.parametrize("plugin,strategy", ARCHS)
@SETTINGS
@given(data=st.data())
def test_delta_edit_sets_output_to_base_plus_edit(plugin: Any, strategy: Any, data: Any) -> None:
    """An edit of a ``*_lora`` point makes the projection output exactly ``base_out + edited delta``, and the
    core's hook points on the same module, attached *before* the edit, see the edited output."""
    kit, ids = draw_kit(data, plugin, strategy)
    pm = kit.adapted()
    hm = kit.wrap(pm)
    layers = lora_layers(hm)
    name = data.draw(st.sampled_from(sorted(layers)), label="point")
    module = layers[name]
    layer = int(name.split(".")[1])
    siblings = [n for n in hm.hook_names if layers.get(n) is module]  # in the projection's order (q, k, v)
    seen: dict[str, torch.Tensor] = {}

    def read(t: torch.Tensor, hook: Any) -> None:
        seen[hook.name] = t.clone()

    def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
        seen["edited"] = t * -0.5 + torch.randn(t.shape, generator=torch.Generator().manual_seed(3)).to(t.dtype)
        return seen["edited"]

    core = [n for n in hm.hook_names if n.startswith(f"blocks.{layer}.") and not n.endswith("_lora")
            and "pattern" not in n and "scores" not in n]
    records: dict[str, torch.Tensor] = {}
    with torch.no_grad(), hm.hooks([(n, read) for n in core]):  # core sites installed first
        with hm.hooks([(n, read) for n in siblings] + [(name, edit)]):
            ha = module.base_layer.register_forward_hook(lambda m, a, o: records.__setitem__("base", o))
            hb = module.register_forward_hook(lambda m, a, o: records.__setitem__("out", o))
            edited_logits = hm(ids).logits
            ha.remove()
            hb.remove()
    assert not torch.equal(edited_logits, pm(ids).logits)
    parts = [seen[n] for n in siblings]
    parts[siblings.index(name)] = seen["edited"]
    short = name.rsplit(".", 1)[1]
    qkv = hm.qkv_layouts[layer]
    if short in ("hook_q_lora", "hook_k_lora", "hook_v_lora"):
        if hasattr(qkv, "split"):
            delta = qkv.merge(*parts)
        else:
            delta = parts[0].flatten(-2)
    else:
        delta = parts[0].reshape(records["base"].shape)  # OPT's MLP sees tokens flattened to [b*p, d]
    out = records["out"]
    assert torch.equal(out, (records["base"] + delta).to(out.dtype))
    # the core's point on this module saw the edited output
    target = {"hook_q_lora": "attn.hook_q", "hook_k_lora": "attn.hook_k", "hook_v_lora": "attn.hook_v",
              "hook_pre_lora": "mlp.hook_pre", "hook_pre_linear_lora": "mlp.hook_pre_linear"}.get(short)
    if target is not None:
        shown = seen[f"blocks.{layer}.{target}"]
        assert torch.equal(shown, split_like(hm, name, out).reshape(shown.shape))
    hm.unwrap()


@pytest.mark.parametrize("plugin,strategy", ARCHS)
@SETTINGS
@given(data=st.data())
def test_disabled_adapters_match_the_base_model(plugin: Any, strategy: Any, data: Any) -> None:
    """Inside ``adapters_disabled`` every shared hook point equals the base model's, bitwise; ``*_lora`` read 0."""
    kit, ids = draw_kit(data, plugin, strategy)
    pm = kit.adapted()
    hm = kit.wrap(pm)
    hb = kit.wrap(kit.base())
    flags = {n: p.requires_grad for n, p in pm.named_parameters()}
    with torch.no_grad():
        both = lp.run_with_cache_base_and_adapted(hm, ids, names_filter=NO_PATTERN)
        base_logits, base_cache = hb.run_with_cache(ids, names_filter=NO_PATTERN)
    assert {n: p.requires_grad for n, p in pm.named_parameters()} == flags
    assert torch.equal(both.base_logits, base_logits)
    assert torch.equal(both.logits, pm(ids).logits)
    assert set(both.cache.keys()) == set(both.base_cache.keys())
    assert set(both.base_cache.keys()) - set(base_cache.keys()) == set(lp.lora_hook_names(hm))
    for key in base_cache.keys():
        assert torch.equal(both.base_cache[key], base_cache[key]), key
    for key in lp.lora_hook_names(hm):
        assert not both.base_cache[key].any()
        assert both.cache[key].abs().max() > 0
    # same names as the bare model, plus the LoRA points
    assert [n for n in hm.hook_names if not n.endswith("_lora")] == hb.hook_names
    # weights with adapters disabled are the base weights
    with lp.adapters_disabled(hm):
        for w in ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "b_Q", "b_O", "b_in", "b_out"):
            assert torch.equal(getattr(hm, w), getattr(hb, w)), w
    assert pm.base_model.model is not None and hm.model is pm
    hm.unwrap()
    hb.unwrap()


@pytest.mark.parametrize("plugin,strategy", ARCHS)
@SETTINGS
@given(data=st.data())
def test_merged_adapters_give_the_same_hooks(plugin: Any, strategy: Any, data: Any) -> None:
    kit, ids = draw_kit(data, plugin, strategy, lora_bias=False)
    pm = kit.adapted()
    hm = kit.wrap(pm)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids)
        weights = {w: getattr(hm, w) for w in ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "b_Q", "b_in")}
        pm.merge_adapter()
        merged_logits, merged = hm.run_with_cache(ids)
        for w, value in weights.items():
            assert_close(getattr(hm, w), value, f"merged {w}", atol=1e-5)
        # an edit of a merged delta point still works: zeroing it removes the adapter's contribution there
        name = data.draw(st.sampled_from(lp.lora_hook_names(hm)), label="point")
        zero = [(name, lambda t, hook: torch.zeros_like(t))]
        merged_zeroed = hm.run_with_hooks(ids, fwd_hooks=zero)
        pm.unmerge_adapter()
        unmerged_zeroed = hm.run_with_hooks(ids, fwd_hooks=zero)
    assert set(merged.keys()) == set(cache.keys())
    def tol(reference: torch.Tensor) -> float:
        # merging moves B·A·s into the weight: float32 rounding relative to the activations' magnitude
        finite = reference[torch.isfinite(reference)]
        return 1e-4 * max(1.0, finite.abs().max().item() if finite.numel() else 1.0)

    for key in cache.keys():
        assert_close(merged[key], cache[key], f"merged {key}", atol=tol(cache[key]))
    assert_close(merged_logits, logits, "merged logits", atol=tol(logits))
    assert_close(merged_zeroed, unmerged_zeroed, "zeroed delta, merged vs unmerged", atol=tol(unmerged_zeroed))
    hm.unwrap()


@pytest.mark.parametrize("plugin,strategy", ARCHS)
@SETTINGS
@given(data=st.data())
def test_switching_adapters(plugin: Any, strategy: Any, data: Any) -> None:
    """Hook points follow the active adapter; ``using_adapter`` restores the previous one and grad flags."""
    kit, ids = draw_kit(data, plugin, strategy, second=None)
    pm = kit.adapted()
    other = sorted(data.draw(st.lists(st.sampled_from(kit.spec.targets), min_size=1, unique=True), label="other"))
    pm.add_adapter("other", LoraConfig(r=3, lora_alpha=5, target_modules=other, init_lora_weights=False,
                                       fan_in_fan_out=kit.spec.fan_in_fan_out))
    _init_lora(pm, kit.seed + 1)
    pm.eval()
    hm = kit.wrap(pm)
    flags = {n: p.requires_grad for n, p in pm.named_parameters()}
    with torch.no_grad():
        logits_default, cache_default = hm.run_with_cache(ids, names_filter=NO_PATTERN)
        with lp.using_adapter(hm, "other"):
            assert pm.active_adapters == ["other"]
            logits_other, cache_other = hm.run_with_cache(ids, names_filter=NO_PATTERN)
            assert torch.equal(logits_other, pm(ids).logits)
            for name, module in lora_layers(hm).items():
                layer = int(name.split(".")[1])
                short = name.rsplit(".", 1)[1][len("hook_"):-len("_lora")]
                which = {"pre": "gate" if hm.cfg.gated_mlp else "in", "pre_linear": "in"}.get(short, short)
                if "other" in module.lora_A:
                    assert lp.lora_factors(hm, layer, which).adapter == "other"
                else:  # not adapted by "other": no delta
                    assert not cache_other[name].any()
                    with pytest.raises(LensAdaptersError, match="0 active LoRA adapters"):
                        lp.lora_factors(hm, layer, which)
        assert pm.active_adapters == ["default"]
        assert torch.equal(hm(ids).logits, logits_default)
        with lp.using_adapter(hm, ["default", "other"]):
            _, cache_both = hm.run_with_cache(ids, names_filter=lp.lora_hook_names(hm))
    assert {n: p.requires_grad for n, p in pm.named_parameters()} == flags
    assert not torch.equal(logits_default, logits_other)
    # the first layer's q/k/v projections see the same input in every run: their deltas add up
    for name in lp.lora_hook_names(hm):
        if name.startswith("blocks.0.attn.") and name.endswith(("hook_q_lora", "hook_k_lora", "hook_v_lora")):
            assert_close(cache_both[name], cache_default[name] + cache_other[name], f"{name}: two adapters add up")
    # set_adapter outside a helper works too
    pm.set_adapter("other")
    with torch.no_grad():
        assert torch.equal(hm.run_with_cache(ids, names_filter=NO_PATTERN)[0], logits_other)
    hm.unwrap()


@pytest.mark.parametrize("plugin,strategy", ARCHS)
@SETTINGS
@given(data=st.data())
def test_effective_weights_are_base_plus_factors(plugin: Any, strategy: Any, data: Any) -> None:
    kit, ids = draw_kit(data, plugin, strategy, second=None, lora_bias=False)
    pm = kit.adapted()
    hm = kit.wrap(pm)
    hb = kit.wrap(kit.base())
    with torch.no_grad():
        for which, w in (("q", "W_Q"), ("k", "_W_K"), ("v", "_W_V"), ("o", "W_O"), ("in", "W_in"),
                         ("out", "W_out")) + ((("gate", "W_gate"),) if hm.cfg.gated_mlp else ()):
            for layer in range(hm.cfg.n_layers):
                try:
                    f = lp.lora_factors(hm, layer, which)
                except LensAdaptersError:
                    assert torch.equal(getattr(hm, w)[layer], getattr(hb, w)[layer]), (which, layer)
                    continue
                assert f.W.shape == getattr(hm, w)[layer].shape
                assert_close(getattr(hm, w)[layer], getattr(hb, w)[layer] + f.W, f"{w}[{layer}] == base + A @ B * s",
                             atol=1e-6)
    hm.unwrap()
    hb.unwrap()


# --- single-model checks -----------------------------------------------------------------------------


def _gpt2_kit(**kw: Any) -> Kit:
    from transformers import GPT2Config

    if lensadapters_gpt2 is None:
        pytest.skip("lensadapters-gpt2 is not installed")
    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    spec = Adapted(config, kw.pop("targets", ["c_attn", "c_proj", "c_fc"]), fan_in_fan_out=True, **kw)
    return Kit(lensadapters_gpt2, spec, 0)


def test_no_core_site_hooks_a_base_layer() -> None:
    kit = _gpt2_kit()
    pm = kit.adapted()
    hm = kit.wrap(pm)
    base_layers = {id(m.base_layer) for m in pm.modules() if hasattr(m, "lora_A")}
    hm.add_hook(lambda n: True, lambda t, hook: None)
    for site in hm._sites:
        if isinstance(site, lp.LoraDeltaSite):
            continue
        for attr in ("module", "block", "mlp_out_module", "ln2", "embed_module"):
            assert id(getattr(site, attr, None)) not in base_layers, (type(site).__name__, attr)
    hm.unwrap()


def test_dropout_in_training_mode_is_read_exactly() -> None:
    """With LoRA dropout active, the delta point reads what PEFT added in that very forward pass."""
    kit = _gpt2_kit()
    pm = get_peft_model(kit.base(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.5,
                                               init_lora_weights=False, fan_in_fan_out=True))
    _init_lora(pm, 0)
    pm.train()
    hm = kit.wrap(pm)
    module = pm.base_model.model.transformer.h[0].attn.c_attn
    seen: dict[str, torch.Tensor] = {}
    h1 = module.base_layer.register_forward_hook(lambda m, a, o: seen.__setitem__("base", o))
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0.attn.hook_"))
    h1.remove()
    delta = torch.cat([cache[f"blocks.0.attn.hook_{x}_lora"].flatten(-2) for x in "qkv"], -1)
    fused = torch.cat([cache[x, 0].flatten(-2) for x in "qkv"], -1)
    assert torch.equal(fused, seen["base"] + delta)
    hm.unwrap()


def test_backward_hooks_on_delta_points() -> None:
    kit = _gpt2_kit()
    pm = kit.adapted()
    hm = kit.wrap(pm)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    _, cache = hm.run_with_cache(ids, labels=ids, incl_bwd=True,
                                      names_filter=["blocks.1.attn.hook_q_lora", "blocks.1.attn.hook_q"])
    # dL/d(delta) == dL/d(q): the delta is added to the projection output
    assert_close(cache["blocks.1.attn.hook_q_lora_grad"], cache["blocks.1.attn.hook_q_grad"], "grad of q delta")
    hm.unwrap()


def test_modules_replaced_after_wrapping_are_refused() -> None:
    kit = _gpt2_kit(targets=["c_attn"])
    pm = kit.adapted()
    hm = kit.wrap(pm)
    ids = torch.randint(0, 64, (1, 5))
    pm.add_adapter("mlp", LoraConfig(r=2, target_modules=["c_fc"], init_lora_weights=False, fan_in_fan_out=True))
    hm(ids)  # without hooks: PEFT's forward, nothing checked
    with pytest.raises(LensAdaptersError, match="replaced after HookedModel.wrap"):
        hm.run_with_cache(ids)
    hm.unwrap()
    hm = kit.wrap(pm)
    assert "blocks.0.mlp.hook_pre_lora" in hm.hook_names
    hm.run_with_cache(ids)
    hm.unwrap()


def test_bare_model_peft_injected_after_wrapping_is_refused() -> None:
    kit = _gpt2_kit()
    model = kit.base()
    hm = kit.wrap(model)
    get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    with pytest.raises(LensAdaptersError, match="replaced after HookedModel.wrap"):
        hm.run_with_cache(torch.randint(0, 64, (1, 4)))
    hm.unwrap()


def test_lora_embedding_weight_is_effective() -> None:
    kit = _gpt2_kit(targets=["wte", "c_attn"])
    pm = kit.adapted()
    hm = kit.wrap(pm)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter="hook_embed")
        assert_close(cache["hook_embed"], hm.W_E[ids], "hook_embed == effective W_E[ids]")
        with lp.adapters_disabled(hm):
            assert torch.equal(hm.W_E, pm.base_model.model.transformer.wte.base_layer.weight)
    hm.unwrap()


def test_prompt_learning_is_refused() -> None:
    from peft import PromptTuningConfig

    kit = _gpt2_kit()
    pm = get_peft_model(kit.base(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(UnsupportedModelError, match="prompt-learning"):
        kit.wrap(pm)


def test_lora_factor_shapes_and_errors() -> None:
    kit = _gpt2_kit(targets=["c_attn", "mlp.c_proj"])
    pm = kit.adapted()
    hm = kit.wrap(pm)
    cfg = hm.cfg
    f = lp.lora_factors(hm, 0, "q")
    assert f.A.shape == (cfg.d_model, 4) and f.B.shape == (cfg.n_heads, 4, cfg.d_head) and f.scaling == 2.0
    assert lp.lora_factors(hm, 1, "v").W.shape == hm.W_V[1].shape
    assert lp.lora_factors(hm, 0, "out").B.shape == (4, cfg.d_model)
    with pytest.raises(LensAdaptersError, match="has no LoRA adapter"):
        lp.lora_factors(hm, 0, "o")
    with pytest.raises(ValueError):
        lp.lora_factors(hm, 0, "x")
    with pytest.raises(LensAdaptersError, match="no LoRA adapter 'nope'"):
        lp.lora_factors(hm, 0, "q", adapter="nope")
    hm.unwrap()


def test_half_precision_base_with_float32_adapters() -> None:
    """bf16 base, fp32 adapters (PEFT's autocast_adapter_dtype): the delta is read in fp32 exactly as PEFT adds it
    and a zeroed head delta gives the base projection exactly."""
    kit = _gpt2_kit(targets=["c_attn"])
    pm = get_peft_model(kit.base().to(torch.bfloat16),
                        LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False,
                                   fan_in_fan_out=True))
    _init_lora(pm, 0)
    pm.eval()
    module = pm.base_model.model.transformer.h[0].attn.c_attn
    assert module.lora_A["default"].weight.dtype == torch.float32
    hm = kit.wrap(pm)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    seen: dict[str, torch.Tensor] = {}
    h = module.base_layer.register_forward_hook(lambda m, a, o: seen.__setitem__("base", o))
    with torch.no_grad():
        reference = pm(ids).logits
        assert torch.equal(hm(ids).logits, reference)
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0.attn.hook_") and "pat" not in n)
        q_lora = cache["blocks.0.attn.hook_q_lora"]
        assert q_lora.dtype == torch.float32 and cache["q", 0].dtype == torch.bfloat16
        assert torch.equal(cache["q", 0], (seen["base"][..., :32].unflatten(-1, (4, 8)) + q_lora).to(torch.bfloat16))

        def zero_head(t: torch.Tensor, hook: Any) -> torch.Tensor:
            t = t.clone()
            t[:, :, 2] = 0
            return t

        with hm.hooks([("blocks.0.attn.hook_q_lora", zero_head)]):
            _, edited = hm.run_with_cache(ids, names_filter="blocks.0.attn.hook_q")
    h.remove()
    assert torch.equal(edited["q", 0][:, :, 2], seen["base"][..., :32].unflatten(-1, (4, 8))[:, :, 2])
    assert torch.equal(edited["q", 0][:, :, [0, 1, 3]], cache["q", 0][:, :, [0, 1, 3]])
    hm.unwrap()


def test_mixed_adapter_batches() -> None:
    """``adapter_names=`` (one adapter per row): the delta is output − base per row; ``__base__`` rows read zero."""
    kit = _gpt2_kit(targets=["c_attn", "mlp.c_fc"])
    pm = kit.adapted()
    hm = kit.wrap(pm)
    ids = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(5))
    rows = ["default", "__base__", "default"]
    with torch.no_grad():
        reference = pm(ids, adapter_names=rows).logits
        logits, mixed = hm.run_with_cache(ids, adapter_names=rows, names_filter=NO_PATTERN)
        _, plain = hm.run_with_cache(ids, names_filter=NO_PATTERN)
        with lp.adapters_disabled(hm):
            _, base = hm.run_with_cache(ids, names_filter=NO_PATTERN)
    assert torch.equal(logits, reference)
    for name in lp.lora_hook_names(hm):
        assert not mixed[name][1].any(), name
        assert_close(mixed[name][[0, 2]], plain[name][[0, 2]], name, atol=1e-5)
    for key in base.keys():
        if not key.endswith("_lora"):
            assert_close(mixed[key][1], base[key][1], key, atol=1e-5)
    hm.unwrap()


def test_dora_adapters_are_hooked_but_have_no_plain_weight() -> None:
    kit = _gpt2_kit()
    pm = get_peft_model(kit.base(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], use_dora=True,
                                               init_lora_weights=False, fan_in_fan_out=True))
    _init_lora(pm, 0)
    pm.eval()
    hm = kit.wrap(pm)
    module = pm.base_model.model.transformer.h[0].attn.c_attn
    seen: dict[str, torch.Tensor] = {}
    h = module.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o))
    hb = module.base_layer.register_forward_hook(lambda m, a, o: seen.__setitem__("base", o))
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        reference = pm(ids).logits
        assert torch.equal(hm(ids).logits, reference)
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0.attn.hook_") and "_lora" in n)
    h.remove()
    hb.remove()
    delta = torch.cat([cache[f"blocks.0.attn.hook_{x}_lora"].flatten(-2) for x in "qkv"], -1)
    assert_close(delta, seen["out"] - seen["base"], "DoRA delta = output - base", atol=1e-6)
    with pytest.raises(Exception, match="variant"):
        hm.W_Q
    hm.unwrap()


def test_adapters_loaded_through_transformers_integration() -> None:
    """``model.add_adapter(LoraConfig)`` (transformers' PEFT integration, no PeftModel): same LoRA points."""
    kit = _gpt2_kit()
    model = kit.base()
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], init_lora_weights=False,
                                 fan_in_fan_out=True))
    _init_lora(model, 0)
    model.eval()
    hm = kit.wrap(model)
    assert hm.model is model and "blocks.1.mlp.hook_pre_lora" in hm.hook_names
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, model(ids).logits)
        both = lp.run_with_cache_base_and_adapted(hm, ids, names_filter=NO_PATTERN)
        hb = kit.wrap(kit.base())
        base_logits = hb(ids).logits
    assert torch.equal(both.base_logits, base_logits)
    assert both.cache["blocks.0.attn.hook_q_lora"].abs().max() > 0
    assert not both.base_cache["blocks.0.attn.hook_q_lora"].any()
    assert not any(layer.disable_adapters for layer in lp._tuner_layers(hm))
    hm.unwrap()
    hb.unwrap()


def test_mixed_peft_model_is_opened() -> None:
    from peft import get_peft_model as gpm

    kit = _gpt2_kit()
    pm = gpm(kit.base(), LoraConfig(r=2, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True),
             mixed=True)
    hm = kit.wrap(pm)
    assert hm.model is pm and "blocks.0.attn.hook_q_lora" in hm.hook_names
    ids = torch.randint(0, 64, (1, 4))
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, pm(ids).logits)
    hm.unwrap()


# --- training: gradient checkpointing, gradients through edits, saving adapters ---------------------


def _llama_kit() -> Kit:
    from transformers import LlamaConfig

    if lensadapters_llama is None:
        pytest.skip("lensadapters-llama is not installed")
    config = LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=4, vocab_size=64, max_position_embeddings=32,
                         tie_word_embeddings=False, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    return Kit(lensadapters_llama, Adapted(config, LLAMA_TARGETS), 0)


TRAIN_KITS = {"gpt2": _gpt2_kit, "llama": _llama_kit}
# an edit inside a checkpointed layer (Llama's hook_rot_q also needs the rotary (cos, sin) when recomputed)
TRAIN_EDITS = {"gpt2": "blocks.1.attn.hook_z", "llama": "blocks.1.attn.hook_rot_q"}


def _training_model(kit: Kit, checkpointing: Optional[bool]) -> PeftModel:
    """The adapted twin in train mode; ``checkpointing`` is ``use_reentrant`` (``None``: no checkpointing)."""
    pm = kit.adapted()
    pm.train()
    if checkpointing is not None:
        pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    pm.enable_input_require_grads()  # the same in every run: the reentrant variant needs it
    return pm


def _lora_grads(pm: PeftModel) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in pm.named_parameters() if "lora_" in n and p.grad is not None}
    assert grads, "no LoRA parameter received a gradient"
    return grads


def _edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
    return t * 1.5 + 0.25


@pytest.mark.parametrize("edited", ["attention", "resid_mid"])
@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_gradient_checkpointing_records_each_point_once(arch: str, use_reentrant: bool, edited: str) -> None:
    """The cache and read-only hooks see each forward once; edits are re-applied; gradients are unchanged.

    ``hook_resid_mid`` edits are carried into the block's own residual add (inside the checkpointed forward),
    so even the reentrant variant, which re-runs the forward but not the block's own hooks, recomputes them."""
    import transformers

    transformers.logging.set_verbosity_error()  # "use_cache=True is incompatible with gradient checkpointing"
    kit = TRAIN_KITS[arch]()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    names = None
    results = []
    for checkpointing in (None, use_reentrant):
        pm = _training_model(kit, checkpointing)
        hm = kit.wrap(pm)
        calls: dict[str, list[bool]] = {}
        edits: list[bool] = []

        def count(t: torch.Tensor, hook: Any) -> None:
            calls.setdefault(hook.name, []).append(hook.recomputing)

        def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
            edits.append(hook.recomputing)
            return _edit(t, hook)

        point = TRAIN_EDITS[arch] if edited == "attention" else "blocks.1.hook_resid_mid"
        with hm.hooks([(point, edit), (lambda n: True, count)]):
            _, cache = hm.run_with_cache(ids, labels=ids, incl_bwd=True, names_filter=names)
        results.append((cache, _lora_grads(pm), calls, edits))
        hm.unwrap()
    (ref_cache, ref_grads, ref_calls, ref_edits), (cache, grads, calls, edits) = results
    assert not any(r for rs in ref_calls.values() for r in rs) and ref_edits == [False]
    # with checkpointing every point runs once in the real forward, at most once more when its layer is recomputed
    assert all(rs.count(False) == 1 and rs.count(True) <= 1 for rs in calls.values()), calls
    assert sum(rs.count(True) for rs in calls.values()) > 0, "no layer was recomputed"
    assert edits == [False, True], "the edit must be applied in the forward and again in the recomputation"
    # the cache: the same names (gradients included), each recorded once, equal to the run without checkpointing
    assert sorted(cache.keys()) == sorted(ref_cache.keys())
    for name in ref_cache.keys():
        assert_close(cache[name], ref_cache[name], name)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert_close(grads[name], grad, name, atol=1e-5)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_cache_keeps_the_value_of_the_real_forward(use_reentrant: bool) -> None:
    """A recomputation that differed would not overwrite the cached value (it is never recorded)."""
    import transformers

    transformers.logging.set_verbosity_error()
    kit = _gpt2_kit()
    pm = _training_model(kit, use_reentrant)
    hm = kit.wrap(pm)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(4))
    seen: list[torch.Tensor] = []

    def differ_when_recomputed(t: torch.Tensor, hook: Any) -> Optional[torch.Tensor]:
        if hook.recomputing:
            return t + 100.0
        seen.append(t.detach().clone())
        return None

    name = "blocks.0.hook_mlp_out"
    hm.add_hook(name, differ_when_recomputed)
    _, cache = hm.run_with_cache(ids, labels=ids, incl_bwd=True, names_filter=[name])
    assert len(seen) == 1 and torch.equal(cache[name], seen[0])
    assert cache[name + "_grad"].shape == seen[0].shape
    hm.unwrap()


def test_is_recomputing_outside_backward() -> None:
    from lensadapters import is_recomputing

    x = torch.ones(2, requires_grad=True)
    inside: list[bool] = []
    y = x * 2
    y.register_hook(lambda g: inside.append(is_recomputing()))
    assert not is_recomputing()
    y.sum().backward()
    assert inside == [False]  # a backward hook runs with gradients disabled: not a forward recomputation
    with torch.no_grad():
        assert not is_recomputing()


def _mlp_module(pm: PeftModel, arch: str, layer: int) -> torch.nn.Module:
    inner = pm.base_model.model
    return inner.transformer.h[layer].mlp if arch == "gpt2" else inner.model.layers[layer].mlp


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_training_step_through_an_edit_matches_a_plain_torch_hook(arch: str) -> None:
    """An SGD step with ``hook_mlp_out`` edited through the wrapper is the step with a plain PyTorch hook."""
    kit = TRAIN_KITS[arch]()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(5))
    vec = torch.randn(16 if arch == "llama" else 32, generator=torch.Generator().manual_seed(6))
    results = []
    for through_wrapper in (True, False):
        pm = _training_model(kit, None)
        opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
        if through_wrapper:
            hm = kit.wrap(pm)
            with hm.hooks([("blocks.0.hook_mlp_out", lambda t, hook: t + vec)]):
                hm(ids, labels=ids).loss.backward()
            hm.unwrap()
        else:
            handle = _mlp_module(pm, arch, 0).register_forward_hook(lambda m, a, o: o + vec)
            pm(ids, labels=ids).loss.backward()
            handle.remove()
        grads = _lora_grads(pm)
        opt.step()
        results.append((grads, {n: p.detach().clone() for n, p in pm.named_parameters() if "lora_" in n}))
    (grads, params), (ref_grads, ref_params) = results
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name
        assert torch.equal(params[name], ref_params[name]), name
    # the edit matters: without it the gradients differ
    pm = _training_model(kit, None)
    pm(ids, labels=ids).loss.backward()
    assert any(not torch.allclose(g, ref_grads[n]) for n, g in _lora_grads(pm).items())


# Backward hooks keep the gradients bit for bit here; at norm points (hook_scale, RMS hook_normalized/hook_mlp_in)
# the norm is recomputed from its input to carry the hook, and autograd then sums gradients in another order.
BITWISE_GRAD_POINTS = lambda name: name.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post",  # noqa: E731
                                                  "_lora"))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_saved_adapter_is_identical_after_training_through_the_wrapper(arch: str, tmp_path: Any) -> None:
    """Two SGD steps through ``HookedModel`` (caching, identity hooks) save the bare model's bytes.

    Pattern and score points are left out: hooking them runs the core's explicit attention, equal to SDPA
    within rounding but not bit for bit.
    """
    kit = TRAIN_KITS[arch]()
    batches = [torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    models = {}
    for wrapped in (True, False):
        pm = _training_model(kit, None)
        opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
        hm = kit.wrap(pm) if wrapped else None
        if hm is not None:
            hm.add_hook(NO_PATTERN, lambda t, hook: t, is_permanent=True)
        for ids in batches:
            opt.zero_grad()
            if hm is not None:
                # every point read (a forward-only cache), gradients of the residual stream and the LoRA deltas
                _, cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
                assert "blocks.1.hook_mlp_out" in cache.keys()
                _, cache = hm.run_with_cache(ids, labels=ids, incl_bwd=True, names_filter=BITWISE_GRAD_POINTS)
                assert "blocks.1.hook_resid_mid_grad" in cache.keys()
            else:
                pm(ids, labels=ids).loss.backward()
            opt.step()
        models[wrapped] = (pm, hm)
    files = ("adapter_model.safetensors", "adapter_config.json")

    def saved(pm: PeftModel, name: str) -> dict[str, bytes]:
        pm.save_pretrained(tmp_path / name)
        return {f: (tmp_path / name / f).read_bytes() for f in files}

    bare = saved(models[False][0], "bare")
    pm, hm = models[True]
    assert saved(pm, "wrapped") == bare
    assert hm.unwrap() is pm
    assert saved(pm, "unwrapped") == bare
    # training did change the adapter
    assert saved(kit.adapted(), "untrained")["adapter_model.safetensors"] != bare["adapter_model.safetensors"]
