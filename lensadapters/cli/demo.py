"""``lensadapters demo``: tiny seeded models of every installed architecture, cached and patched.

Nothing is downloaded: each architecture plugin supplies a tiny config (``lensadapters_tiny_config``).
For each model the demo checks that wrapping changes nothing, caches every hook point, and runs a
small activation-patching experiment (restore the clean residual stream at the corrupted position,
layer by layer, and measure how much of the clean next-token logit comes back).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Optional

import torch

from lensadapters.adapters.registry import PluginInfo, Registry, get_registry
from lensadapters.api.hooked_model import HookedModel
from lensadapters.cli.extras import plugin_extras
from lensadapters.hooks.specs import Architecture
from lensadapters.testing.models import reinit, tiny_model  # noqa: F401  (reinit: the old lensadapters.demo.reinit)


@dataclass
class DemoResult:
    architecture: str
    plugin: str
    n_layers: int
    hook_points: int
    cached: int
    bitwise: bool
    patching: list[float] = field(default_factory=list)
    seconds: float = 0.0


def patching_experiment(hm: HookedModel, seed: int = 0, length: int = 8) -> list[float]:
    """Fraction of the clean answer logit restored by patching ``resid_pre`` at the corrupted position."""
    generator = torch.Generator().manual_seed(seed)
    vocab = hm.cfg.d_vocab
    clean = torch.randint(0, vocab, (1, length), generator=generator)
    corrupted = clean.clone()
    position = length // 2
    corrupted[0, position] = (clean[0, position] + 1 + torch.randint(0, vocab - 1, (1,), generator=generator)) % vocab
    with torch.no_grad():
        clean_logits, cache = hm.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_resid_pre"))
        answer = clean_logits[0, -1].argmax()
        corrupted_logits = hm(corrupted).logits
        clean_score, corrupted_score = clean_logits[0, -1, answer], corrupted_logits[0, -1, answer]
        restored = []
        for layer in range(hm.cfg.n_layers):

            def patch(resid: torch.Tensor, hook: Any, layer: int = layer) -> torch.Tensor:
                resid = resid.clone()
                resid[:, position] = cache["resid_pre", layer][:, position]
                return resid

            logits = hm.run_with_hooks(corrupted, fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", patch)])
            gap = (clean_score - corrupted_score).item()
            restored.append(((logits[0, -1, answer] - corrupted_score).item() / gap) if abs(gap) > 1e-9 else 1.0)
    return restored


def run_one(registry: Registry, info: PluginInfo, arch: Architecture, seed: int = 0) -> DemoResult:
    start = time.perf_counter()
    model = tiny_model(registry, info, arch, seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        reference = model(ids).logits
        hm = HookedModel.wrap(model, registry=registry)
        bitwise = torch.equal(hm(ids).logits, reference)
        _, cache = hm.run_with_cache(ids)
    restored = patching_experiment(hm, seed)
    hm.unwrap()
    return DemoResult(
        arch.name,
        info.distribution or info.name,
        hm.cfg.n_layers,
        len(hm.hook_names),
        len(cache),
        bitwise,
        restored,
        time.perf_counter() - start,
    )


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def run(
    registry: Optional[Registry] = None, echo: Callable[[str], None] = print, plot: Optional[str] = None
) -> list[DemoResult]:
    """The random-weight demo of every installed architecture, then the induction-head demo (``plot``: write its
    attention patterns to this PNG; needs matplotlib)."""
    from lensadapters.cli.induction_demo import require_matplotlib  # a trained model with a real finding
    from lensadapters.cli.induction_demo import run as induction_demo

    if plot is not None:
        require_matplotlib()
    from packaging.utils import canonicalize_name

    registry = registry or get_registry()
    results = []
    extras = plugin_extras()
    echo("lensadapters demo: tiny seeded models, no downloads\n")
    order = {dist: i for i, dist in enumerate(extras)}  # the built-in plugins first, as the core's extras list them

    def rank(pair: tuple[PluginInfo, Architecture]) -> tuple[int, str]:
        info, arch = pair
        return order.get(canonicalize_name(info.distribution or ""), len(order)), arch.name

    pairs = sorted(((info, arch) for info in registry.architecture_plugins() for arch in info.architectures), key=rank)
    for info, arch in pairs:
        try:
            result = run_one(registry, info, arch)
        except LookupError as exc:
            echo(f"- {arch.name}: skipped ({exc})")
            continue
        results.append(result)
        curve = " ".join(f"{x:+.2f}" for x in result.patching)
        echo(
            f"- {arch.name} ({result.plugin}): {result.n_layers} layers, {result.hook_points} hook points, "
            f"{result.cached} cached; no-hook output bitwise equal: {'yes' if result.bitwise else 'NO'}"
        )
        echo(
            f"    patching resid_pre at the corrupted token, fraction of the clean logit restored per layer: "
            f"{curve}  ({result.seconds:.2f}s)"
        )
    for dist, extra in extras.items():
        if not _installed(dist):
            echo(f"- {extra}: not installed (pip install lensadapters[{extra}])")
    if registry.failures:
        for message in registry.failures.values():
            echo(f"! {message}")
    if not results:
        echo("No architecture plugin is installed: pip install lensadapters[all]")
    else:
        echo(
            "\nLayer 0 restores everything (the corrupted token itself is patched); later layers restore what has"
            " not yet moved to other positions."
        )
        induction_demo(registry, echo, plot=plot)
    return results
