"""PEFT / LoRA (lensadapters-peft): the contract suite on adapted models, plus PEFT's own behaviour.

The contract suite is the packaged ``lensadapters_peft.testing.LoraContract`` mixed in front of each
architecture's own contract (``lensadapters_<arch>.testing``), exactly what a third-party plugin writes:
``PeftModel``s over tiny GPT-2 (fused ``c_attn`` as ``Conv1D`` with ``fan_in_fan_out``), Llama (separate
q/k/v, GQA, gated MLP), GPT-NeoX (per-head interleaved fused ``query_key_value``, parallel residual) and
OPT (pre- and post-LN, MLP inside the decoder layer) models, with seed-chosen subsets of adapted
projections, one or two active adapters, rsLoRA and LoRA biases. Besides every generic property it checks
LoRA's own (the ``*_lora`` hook points, disabled / merged / switched adapters, effective weights and
factors). The single-model tests below cover what is PEFT-specific rather than a contract property:
dropout, DoRA, other PEFT tuners (IA³, LoHa), mixed-adapter batches, transformers' PEFT integration,
training (gradient checkpointing, gradients through edits, saved adapters). Architectures whose plugin is
not installed are skipped.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
from hypothesis import strategies as st

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

import lensadapters_peft as lp  # noqa: E402
from lensadapters import HookedModel, LensAdaptersError, UnsupportedModelError, WeightUnavailableError  # noqa: E402
from lensadapters.testing import AdapterContract, assert_close  # noqa: E402
from lensadapters_peft.testing import LoraContract, init_lora, lora_layers, split_like  # noqa: E402

warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")


from installed_plugins import lensadapters_gpt2, lensadapters_llama, lensadapters_gpt_neox, lensadapters_opt  # noqa: E402

# pattern/score hooks run the core's explicit attention (equal to SDPA within rounding, not bitwise)
NO_PATTERN = lambda name: not name.endswith(("hook_pattern", "hook_attn_scores"))  # noqa: E731


# --- the contract suite on LoRA-adapted models ----------------------------------------------------------
# Each class is LoraContract over the architecture's packaged contract, with the config sizes narrowed (every
# example builds two models and adapts one) and at least two query heads: with one head and two tokens a tiny
# random model can saturate the softmax. The architectures' config strata (llama3 rope, OPT-350m's shape) are
# covered by their float contracts; here they would only repeat the same LoRA layers.

if lensadapters_gpt2 is not None:
    from lensadapters_gpt2.testing import GPT2Contract

    class TestPeftGPT2(LoraContract, GPT2Contract):
        config_overrides = dict(n_layers=st.integers(1, 2), n_heads=st.integers(2, 4), d_head=st.sampled_from([4, 8]),
                                d_mlp=st.sampled_from([None, 24]), vocab=st.integers(16, 100))
        config_strata = {}

if lensadapters_llama is not None:
    from lensadapters_llama.testing import LlamaContract

    class TestPeftLlama(LoraContract, LlamaContract):
        config_overrides = dict(d_model=16, d_mlp=24, ratio=2, head_dim=st.sampled_from([4, 8]), vocab=64,
                                rope_types=("default",), theta=10000.0)
        config_strata = {}

if lensadapters_gpt_neox is not None:
    from lensadapters_gpt_neox.testing import GPTNeoXContract

    class TestPeftGPTNeoX(LoraContract, GPTNeoXContract):
        config_overrides = dict(n_heads=st.integers(2, 4), d_head=8, d_mlp=24, vocab=64,
                                rotary_pct=st.sampled_from([0.25, 1.0]))
        config_strata = {}

if lensadapters_opt is not None:
    from lensadapters_opt.testing import OPTContract

    class TestPeftOPT(LoraContract, OPTContract):
        config_overrides = dict(n_heads=st.integers(2, 4), d_head=8, n_layers=st.integers(1, 2), ffn_dim=24,
                                vocab=64, project=False)
        config_strata = {}


# --- building single adapted models ----------------------------------------------------------------------


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


def lora_model(base: torch.nn.Module, spec: Adapted, seed: int) -> PeftModel:
    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=spec.targets, init_lora_weights=False,
                     use_rslora=spec.rslora, lora_bias=spec.lora_bias, fan_in_fan_out=spec.fan_in_fan_out)
    pm = get_peft_model(base, cfg)
    if spec.second:
        pm.add_adapter("second", LoraConfig(r=2, lora_alpha=3, target_modules=spec.second, init_lora_weights=False,
                                            fan_in_fan_out=spec.fan_in_fan_out))
        pm.base_model.set_adapter(["default", "second"])
    init_lora(pm, seed)
    return pm.eval()


LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Kit:
    """Builds base and adapted twins of one spec and wraps them with a private registry."""

    def __init__(self, plugin: Any, spec: Adapted, seed: int) -> None:
        self.plugin, self.spec, self.seed = plugin, spec, seed
        self.contract = type("C", (AdapterContract,), {"plugin": plugin, "extra_plugins": (lp,)})()

    def base(self) -> torch.nn.Module:
        return self.contract.make_model(self.spec.config, self.seed)

    def adapted(self, spec: Optional[Adapted] = None) -> PeftModel:
        return lora_model(self.base(), spec or self.spec, self.seed)

    def wrap(self, model: Any) -> HookedModel:
        return self.contract.wrap(model)


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
    for site in hm.wiring.sites:
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
    init_lora(pm, 0)
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


def _dropout_llama(p: float = 0.5,
                   targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj")) -> tuple[Kit, PeftModel]:
    kit = _llama_kit()
    pm = get_peft_model(kit.base(), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=p,
                                               init_lora_weights=False))
    init_lora(pm, 0)
    return kit, pm


def test_lora_dropout_follows_peft_in_eval_and_train_mode() -> None:
    """Eval mode: LoRA dropout does not fire, each ``*_lora`` point is B·A·x·scaling computed here from the
    factors. Train mode: exactly PEFT's dropout: with the same RNG seed the wrapped run (every point cached)
    gives the unwrapped PeftModel's logits bit for bit, and each delta is B·A·dropout(x)·scaling for the mask
    PEFT drew, which differs from the no-dropout delta."""
    p = 0.5
    kit, pm = _dropout_llama(p)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(8))
    layers = [m for m in pm.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    seen: dict[int, torch.Tensor] = {}
    handles = [m.register_forward_pre_hook(lambda m, a: seen.__setitem__(id(m), a[0])) for m in layers]
    handles += [m.lora_dropout["default"].register_forward_hook(
        lambda d, a, o, m=m: seen.__setitem__(-id(m), o)) for m in layers]

    def delta_from_factors(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        A, B = module.lora_A["default"].weight, module.lora_B["default"].weight  # [r, d_in], [d_out, r]
        return torch.einsum("...i,ri,or->...o", x, A, B) * module.scaling["default"]

    # train mode: the reference is the PeftModel before wrapping
    pm.train()
    with torch.no_grad():
        torch.manual_seed(1234)
        reference = pm(ids).logits
    hm = kit.wrap(pm)
    delta_layers = lora_layers(hm)
    assert set(delta_layers.values()) == set(layers)
    with torch.no_grad():
        torch.manual_seed(1234)
        logits, cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
    assert torch.equal(logits, reference), "the wrapped run drew other dropout masks than PEFT"
    for name, module in delta_layers.items():
        x, dropped = seen[id(module)], seen[-id(module)]
        kept = dropped != 0
        assert 0 < kept.float().mean() < 1, f"{name}: dropout did not fire in train mode"
        assert torch.equal(dropped[kept], x[kept] / (1 - p))  # inverted dropout, as torch.nn.Dropout
        fired = module.lora_B["default"](module.lora_A["default"](dropped)) * module.scaling["default"]
        assert torch.equal(cache[name], split_like(hm, name, fired).reshape(cache[name].shape)), name
        no_dropout = split_like(hm, name, delta_from_factors(module, x)).reshape(cache[name].shape)
        assert (cache[name] - no_dropout).abs().max() > 1e-3, f"{name}: the train-mode delta ignored the dropout"

    # eval mode: no dropout, the delta is B·A·x·scaling
    pm.eval()
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
        assert torch.equal(hm(ids).logits, pm(ids).logits)
    for name, module in delta_layers.items():
        x = seen[id(module)]
        expected = split_like(hm, name, delta_from_factors(module, x)).reshape(cache[name].shape)
        assert_close(cache[name], expected, f"{name} == B·A·x·scaling in eval mode", atol=1e-5)
    for h in handles:
        h.remove()
    hm.unwrap()


def test_hook_result_with_train_mode_dropout_on_o_proj() -> None:
    """``attn.hook_result`` is ``z`` times the effective ``W_O`` (base + B·A·scaling), which has no dropout mask:
    in train mode with LoRA dropout on ``o_proj`` the heads' results do not sum to ``hook_attn_out - b_O``; the
    gap is exactly the dropout's effect on the delta. Edits stay exact (applied as differences)."""
    kit, pm = _dropout_llama(0.5, targets=("o_proj",))
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(9))
    hm = kit.wrap(pm)
    names = ["blocks.0.attn.hook_z", "blocks.0.attn.hook_result", "blocks.0.hook_attn_out", "blocks.0.attn.hook_o_lora"]
    bump = torch.randn(hm.cfg.d_model, generator=torch.Generator().manual_seed(10))

    def bump_head_1(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t = t.clone()
        t[:, :, 1] += bump
        return t

    for train in (False, True):
        pm.train(train)
        with torch.no_grad():
            torch.manual_seed(5)
            _, cache = hm.run_with_cache(ids, names_filter=names)
            torch.manual_seed(5)
            with hm.hooks([("blocks.0.attn.hook_result", bump_head_1)]):
                _, edited = hm.run_with_cache(ids, names_filter="blocks.0.hook_attn_out")
            W_O, b_O = hm.W_O[0], hm.b_O[0]
        z, result, attn_out = cache["z", 0], cache["result", 0], cache["attn_out", 0]
        assert_close(result, torch.einsum("bphd,hdm->bphm", z, W_O), "result == z @ effective W_O", atol=1e-5)
        f = lp.lora_factors(hm, 0, "o")
        no_dropout = torch.einsum("bphd,hdr,rm->bpm", z, f.A, f.B) * f.scaling
        gap = cache["blocks.0.attn.hook_o_lora"] - no_dropout  # zero in eval mode
        assert_close(attn_out - b_O - result.sum(-2), gap, "sum of heads misses the dropout's effect", atol=1e-5)
        assert (gap.abs().max() > 1e-3) == train
        # the edit moved hook_attn_out by exactly the edit (same dropout mask: same seed)
        assert_close(edited["attn_out", 0], attn_out + bump, "hook_result edit applied as a difference", atol=1e-5)
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


def _tuner_kit() -> tuple[Kit, torch.Tensor]:
    return _llama_kit(), torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(11))


def _record_outputs(modules: dict[str, torch.nn.Module]) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list]:
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = [m.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, (a[0], o))) for n, m in modules.items()]
    return seen, handles


def _check_non_lora_weights(hm: HookedModel, hb: HookedModel, method: str, refused: dict[str, str],
                            readable: tuple[str, ...]) -> None:
    """``refused``: weight -> module path that must be named; ``readable`` weights equal the base model's."""
    for w, path in refused.items():
        with pytest.raises(WeightUnavailableError) as info:
            getattr(hm, w)
        message = str(info.value)
        assert path in message, (w, message)
        assert f"PEFT method {method}" in message and "reads LoRA weights only" in message, message
        assert "Hook points still see the adapted computation" in message and "bnb" not in message, message
        others = set(LLAMA_TARGETS) - {path.rsplit(".", 1)[1]}
        assert not any(o in message for o in others), f"{w}: the error names another module: {message}"
    for w in readable:
        assert torch.equal(getattr(hm, w), getattr(hb, w)), w


def test_ia3_adapters_are_hooked_and_their_weights_refused() -> None:
    """IA³ (learned vectors scaling k, v and the down projection's input): every hook point sees the scaled
    computation, no-hook logits are PeftModel's bitwise, weights of IA³ layers raise a clear error that names
    the module asked for; other weights read."""
    from peft import IA3Config

    kit, ids = _tuner_kit()
    pm = get_peft_model(kit.base(), IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                               feedforward_modules=["down_proj"]))
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "ia3_l" in name:  # PEFT starts at ones (no change)
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    pm.eval()
    hm, hb = kit.wrap(pm), kit.wrap(kit.base())
    assert hm.hook_names == hb.hook_names and not lp.lora_hook_names(hm)
    cfg = hm.cfg
    inner = pm.base_model.model.model.layers
    modules = {f"{i}.{n}": getattr(inner[i].self_attn if n != "down_proj" else inner[i].mlp, n)
               for i in range(cfg.n_layers) for n in ("k_proj", "v_proj", "down_proj")}
    seen, handles = _record_outputs(modules)
    with torch.no_grad():
        reference = pm(ids).logits
        assert torch.equal(hm(ids).logits, reference)
        logits, cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
        assert torch.equal(logits, reference)
        for i in range(cfg.n_layers):
            for short, n in (("k", "k_proj"), ("v", "v_proj")):
                module = modules[f"{i}.{n}"]
                x, out = seen[f"{i}.{n}"]
                scaled = module.base_layer(x) * module.ia3_l["default"].flatten()  # IA³ scales the output
                assert torch.equal(out, scaled) and not torch.allclose(out, module.base_layer(x))
                assert torch.equal(cache[short, i], out.unflatten(-1, (cfg.n_key_value_heads, cfg.d_head)))
            down = modules[f"{i}.down_proj"]
            x, out = seen[f"{i}.down_proj"]
            assert torch.equal(x, cache["post", i])  # hook_post: the down projection's input, before IA³
            scaled = down.base_layer(cache["post", i] * down.ia3_l["default"].flatten())  # IA³ scales the input
            assert torch.equal(cache["mlp_out", i], scaled) and torch.equal(out, scaled)
            assert not torch.allclose(scaled, down.base_layer(cache["post", i]))
        # the base model through the helpers (they handle any PEFT tuner)
        base_logits, base_cache = hb.run_with_cache(ids, names_filter=NO_PATTERN)
        with lp.adapters_disabled(hm):
            off_logits, off_cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
        assert torch.equal(off_logits, base_logits) and not torch.equal(logits, base_logits)
        assert all(torch.equal(off_cache[k], base_cache[k]) for k in base_cache.keys())
    for h in handles:
        h.remove()
    # W_Q reads q_proj only: the IA³ k_proj next to it is not asked for
    _check_non_lora_weights(hm, hb, "IA3", {"W_K": "model.layers.0.self_attn.k_proj",
                                            "_b_K": "model.layers.0.self_attn.k_proj",
                                            "W_V": "model.layers.0.self_attn.v_proj",
                                            "W_out": "model.layers.0.mlp.down_proj"},
                            ("W_Q", "b_Q", "W_O", "W_in", "W_gate", "W_U"))
    assert hm.unwrap() is pm
    hb.unwrap()


def test_loha_adapters_are_hooked_and_their_weights_refused() -> None:
    """LoHa (Hadamard product of two low-rank factors) on q, o and up projections: the same guarantees."""
    from peft import LoHaConfig

    kit, ids = _tuner_kit()
    pm = get_peft_model(kit.base(), LoHaConfig(r=2, alpha=4, target_modules=["q_proj", "o_proj", "up_proj"],
                                               init_weights=False))
    pm.eval()
    hm, hb = kit.wrap(pm), kit.wrap(kit.base())
    assert hm.hook_names == hb.hook_names and not lp.lora_hook_names(hm)
    cfg = hm.cfg
    layer = pm.base_model.model.model.layers[1]
    modules = {"q": layer.self_attn.q_proj, "attn_out": layer.self_attn.o_proj, "pre_linear": layer.mlp.up_proj}
    seen, handles = _record_outputs(modules)
    with torch.no_grad():
        reference = pm(ids).logits
        assert torch.equal(hm(ids).logits, reference)
        logits, cache = hm.run_with_cache(ids, names_filter=lambda n: NO_PATTERN(n) and "hook_result" not in n)
        assert torch.equal(logits, reference)
        # hook_result is computed from W_O, which cannot be read here: the same clear error
        with pytest.raises(WeightUnavailableError, match=r"model\.layers\.1\.self_attn\.o_proj.*LoHa"):
            hm.run_with_cache(ids, names_filter="blocks.1.attn.hook_result")
        for name, module in modules.items():
            x, out = seen[name]
            assert not torch.allclose(out, module.base_layer(x)), f"{name}: LoHa changes nothing"
            value = cache[name, 1]
            assert torch.equal(value, out.reshape(value.shape)), name  # the adapted module's output
        with lp.adapters_disabled(hm):
            off_logits = hm(ids).logits
        assert torch.equal(off_logits, hb(ids).logits)
    for h in handles:
        h.remove()
    # W_K reads k_proj only: the LoHa q_proj next to it is not asked for
    _check_non_lora_weights(hm, hb, "LoHa", {"W_Q": "model.layers.0.self_attn.q_proj",
                                             "W_O": "model.layers.0.self_attn.o_proj",
                                             "W_in": "model.layers.0.mlp.up_proj"},
                            ("W_K", "b_K", "W_V", "b_V", "W_gate", "W_out"))
    assert hm.unwrap() is pm
    hb.unwrap()


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
    init_lora(pm, 0)
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
    init_lora(pm, 0)
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
    init_lora(model, 0)
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
