"""A demo with a real finding: train a tiny attention-only model until it forms induction heads, find them with
``detect_head``, and confirm them by activation patching.

Everything runs on the CPU in about half a minute, seeded, with no download. The model is the tiny config of an
installed architecture plugin (preferably one with rotary positions on the whole head and sequential blocks: Llama
when installed), cut to two layers and a small vocabulary, with its MLPs' output projections zeroed and frozen, so
only attention writes to the residual stream. Training sequences are random tokens in which a random segment occurs
twice, at distances that vary: the second copy is predictable only by finding the earlier occurrence of the current
token and reading what followed it, which is what an induction head does (with a previous-token head before it).

The check, on a start token and a random segment twice (as TransformerLens measures induction):
``detect_head(hm, tokens, "induction_head")`` scores how much each head attends to "the token after the earlier
copy"; then, on a batch whose first copy was replaced by other random tokens (so nothing can be copied), restoring
a head's output (``hook_z``) from the clean run must bring back the second copy's log-probabilities
(``lensadapters.patching.get_act_patch_attn_head_out_all_pos``). The induction heads are the heads that do both.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from lensadapters.adapters.registry import Registry, get_registry
from lensadapters.analysis.attribution import get_attr_patch_attn_head_out_all_pos
from lensadapters.analysis.edge_attribution import EdgeScores, edge_attribution, smallest_circuit
from lensadapters.analysis.head_detector import detect_head
from lensadapters.analysis.patching import get_act_patch_attn_head_out_all_pos
from lensadapters.analysis.threads import single_thread
from lensadapters.api.hooked_model import HookedModel
from lensadapters.cli.extras import plugin_extras

START = 0  # the start-of-sequence token; random tokens are drawn from 1 .. vocab - 1
INDUCTION_SCORE = 0.3  # detect_head score from which a head counts as an induction head
CIRCUIT_SHARE = 0.8  # the share of the clean-minus-corrupted gap the circuit EAP extracts must keep


@dataclass
class InductionResult:
    architecture: str
    n_layers: int
    n_heads: int
    steps: int
    seconds: float
    loss_copy: float  # next-token loss on the repeated segment (after its first token)
    chance: float  # the loss of a uniform guess, log(vocab - 1)
    induction_scores: torch.Tensor  # [n_layers, n_heads]
    previous_token_scores: torch.Tensor
    restored: torch.Tensor  # [n_layers, n_heads]: share of the copy's log-probability one head's output restores
    restored_together: float  # restoring every induction head's output at once
    heads: list[tuple[int, int]] = field(default_factory=list)  # the induction heads: detected by their pattern
    previous_head: tuple[int, int] = (0, 0)
    confirmed: bool = False
    plot: Optional[str] = None
    # attribution patching (one backward) of the same heads, as a share of the gap like `restored`
    attributed: Optional[torch.Tensor] = None
    # edge attribution patching: every edge's score, each head's outgoing edges summed (a share of the gap), and the
    # fewest top edges that keep CIRCUIT_SHARE of the gap with every other edge patched from the corrupted run
    edges: Optional[EdgeScores] = None
    eap_heads: Optional[torch.Tensor] = None
    circuit: Optional[torch.Tensor] = None  # bool [upstream, downstream] (edges.upstream / edges.downstream)
    circuit_edges: int = 0
    circuit_recovered: float = float("nan")


def repeated_sequences(
    batch: int,
    length: int,
    vocab: int,
    generator: torch.Generator,
    period: Optional[int] = None,
    gap: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)``, ``[batch, length]`` and ``[batch, length - 1]``: a start token, random tokens, a
    random segment of ``period`` tokens, ``gap`` random tokens, the segment again, random tokens up to
    ``length``. Unless given, ``period`` (3 .. length // 4) and ``gap`` vary per row, so neither position nor the
    sequence's structure tells where the earlier copy is: only finding the earlier occurrence of the current
    token does. ``targets`` marks the predictions that copying makes possible (the copy after its first token)."""
    rows, targets = [], torch.zeros(batch, length - 1, dtype=torch.bool)
    for row in range(batch):
        n = period or int(torch.randint(3, length // 4 + 1, (1,), generator=generator))
        room = length - 1 - 2 * n
        between = gap if gap is not None else int(torch.randint(0, room + 1, (1,), generator=generator))
        before = int(torch.randint(0, room - between + 1, (1,), generator=generator)) if gap is None else 0
        tokens = torch.randint(1, vocab, (length,), generator=generator)
        tokens[0] = START
        body = torch.randint(1, vocab, (n,), generator=generator)
        first = 1 + before
        second = first + n + between
        tokens[first : first + n] = body
        tokens[second : second + n] = body
        targets[row, second : second + n - 1] = True  # position t predicts token t + 1
        rows.append(tokens)
    return torch.stack(rows), targets


def _choose_architecture(registry: Registry) -> tuple[Any, Any]:
    """The installed architecture whose tiny model learns induction fastest: rotary positions on the whole head
    (a previous-token head is then one relative offset), sequential blocks; learned positions invite positional
    shortcuts. Any installed architecture otherwise (the demo then reports whatever it finds)."""
    from packaging.utils import canonicalize_name

    order = {dist: i for i, dist in enumerate(plugin_extras())}  # the built-in plugins in the core's extras order
    candidates = []
    for info in registry.architecture_plugins():
        for arch in info.architectures:
            if not arch.declared_for_installed_transformers() or arch.encoder_decoder:
                continue
            config = registry.hooks_for(info).lensadapters_tiny_config(arch=arch, seed=0)
            if config is None:
                continue
            try:
                cfg = _hooked_config(registry, config)
            except ValueError:  # no causal LM for this config (an encoder such as ModernBERT): no induction demo
                continue
            fit = (
                cfg.positional_embedding_type == "rotary"
                and cfg.rotary_dim == cfg.d_head
                and not cfg.parallel_attn_mlp
                and not cfg.num_experts
            )
            rank = order.get(canonicalize_name(info.distribution or ""), len(order))
            candidates.append((not fit, rank, arch.name, info, arch))
    if not candidates:
        raise LookupError("no installed architecture plugin provides a tiny config: pip install lensadapters[llama]")
    return min(candidates, key=lambda c: c[:3])[3:]


def _hooked_config(registry: Registry, config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    # the tiny config as it is: some families' configs tie their layer count to per-layer fields (Gemma 4's key/value
    # sharing), so a shortened copy may not build
    hm = HookedModel.wrap(AutoModelForCausalLM.from_config(config), registry=registry)
    cfg = hm.cfg
    hm.unwrap()
    return cfg


def build_model(registry: Registry, vocab: int, seed: int) -> tuple[torch.nn.Module, str]:
    """Two layers of the chosen architecture's tiny config, ``vocab`` tokens, MLPs silenced."""
    from transformers import AutoModelForCausalLM

    info, arch = _choose_architecture(registry)
    config = registry.hooks_for(info).lensadapters_tiny_config(arch=arch, seed=0)
    config.num_hidden_layers = 2  # (transformers maps the standard names onto each config's own fields)
    config.vocab_size = vocab
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    hm = HookedModel.wrap(model, registry=registry)
    with torch.no_grad():  # attention-only: every MLP's output projection is zero, and stays so
        for layer, block in enumerate(hm.block_modules):
            out = block.get_submodule(hm.mlp_layouts[layer].out)
            for param in out.parameters():
                param.zero_()
                param.requires_grad_(False)
    hm.unwrap()
    return model, arch.name


def train(model: torch.nn.Module, vocab: int, length: int, steps: int, batch: int, seed: int) -> None:
    """AdamW on the next-token loss of the tokens a copy makes predictable (random tokens only add noise).

    One CPU thread: for a model this small, more threads only add synchronization (and contend with anything
    else running); the setting is restored afterwards."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    model.train()
    try:
        with single_thread():
            for _ in range(steps):
                tokens, targets = repeated_sequences(batch, length, vocab, generator)
                logits = model(tokens, use_cache=False).logits[:, :-1]
                loss = torch.nn.functional.cross_entropy(logits[targets], tokens[:, 1:][targets])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    finally:
        model.eval()


def run(
    registry: Optional[Registry] = None,
    echo: Callable[[str], None] = print,
    plot: Optional[str] = None,
    seed: int = 0,
    steps: int = 800,
    length: int = 24,
    vocab: int = 100,
    batch: int = 64,
) -> InductionResult:
    """Train, detect, patch, report (and with ``plot``, write the induction head's attention pattern there)."""
    if plot is not None:
        require_matplotlib()
    registry = registry or get_registry()
    start = time.perf_counter()
    model, arch_name = build_model(registry, vocab, seed)
    train(model, vocab, length, steps, batch, seed)
    hm = HookedModel.wrap(model, registry=registry)
    try:
        # evaluation: a start token and one random segment twice ([start, r, r], as TransformerLens measures it)
        generator = torch.Generator().manual_seed(seed + 1)
        half = (length - 2) // 2
        clean, _ = repeated_sequences(8, 1 + 2 * half, vocab, generator, period=half, gap=0)
        with torch.no_grad():  # per_token[:, t] predicts token t + 1
            per_token = hm(clean, return_type="loss", loss_per_token=True)
        copy_loss = per_token[:, half + 1 :].mean().item()  # the copy after its first token
        probe = clean[:1]
        induction = detect_head(hm, probe, "induction_head", exclude_bos=True)
        previous = detect_head(hm, probe, "previous_token_head", exclude_bos=True)
        heads = [(int(layer), int(h)) for layer, h in (induction >= INDUCTION_SCORE).nonzero()]
        corrupted = clean.clone()
        corrupted[:, 1 : half + 1] = torch.randint(1, vocab, (clean.shape[0], half), generator=generator)
        targets = clean[:, half + 2 :]

        def metric(logits: torch.Tensor) -> torch.Tensor:
            """Mean log-probability of the copy's tokens (after its first, a guess either way)."""
            log_probs = logits[:, half + 1 : -1].log_softmax(-1)
            return log_probs.gather(-1, targets[..., None]).mean()

        with torch.no_grad():
            clean_logits, clean_cache = hm.run_with_cache(
                clean, names_filter=lambda n: n.endswith("attn.hook_z"), return_type="logits"
            )
            clean_score, corrupted_score = metric(clean_logits), metric(hm(corrupted, return_type="logits"))
            with contextlib.redirect_stderr(io.StringIO()):  # the sweep's progress bar
                patched = get_act_patch_attn_head_out_all_pos(hm, corrupted, clean_cache, metric)
            together = metric(
                hm.run_with_hooks(corrupted, return_type="logits", fwd_hooks=_restore_heads(heads, clean_cache))
            )
        gap = clean_score - corrupted_score
        restored = (patched - corrupted_score) / gap
        # the same question by gradients: attribution patching (each head's hook_z) and EAP (every edge)
        attributed = get_attr_patch_attn_head_out_all_pos(hm, clean, corrupted, metric, progress=False) / gap
        edges = edge_attribution(hm, clean, corrupted, metric, progress=False)
        eap_heads = torch.zeros_like(restored)
        for node, score in edges.node_scores().items():
            if node.startswith("A") and "." in node:
                layer, head = (int(x) for x in node[1:].split("."))
                eap_heads[layer, head] = score / float(gap)
        circuit, kept = smallest_circuit(hm, clean, corrupted, metric, edges, CIRCUIT_SHARE, progress=False)
        others = [
            restored[layer, h].item()
            for layer in range(hm.cfg.n_layers)
            for h in range(hm.cfg.n_heads)
            if (layer, h) not in heads
        ]
        joint = ((together - corrupted_score) / gap).item()
        confirmed = bool(heads) and joint > 0.8 and min(restored[h].item() for h in heads) > max(others, default=0)
        result = InductionResult(
            arch_name,
            hm.cfg.n_layers,
            hm.cfg.n_heads,
            steps,
            time.perf_counter() - start,
            copy_loss,
            math.log(vocab - 1),
            induction,
            previous,
            restored,
            joint,
            heads,
            _argmax(previous),
            confirmed,
            attributed=attributed.float(),
            edges=edges,
            eap_heads=eap_heads.float(),
            circuit=circuit,
            circuit_edges=kept.edges,
            circuit_recovered=kept.recovered,
        )
        if plot is not None:
            result.plot = write_plot(hm, probe, result, plot)
    finally:
        hm.unwrap()
    report(result, echo)
    return result


def _restore_heads(heads: list[tuple[int, int]], clean_cache: Any) -> list[tuple[str, Callable[..., torch.Tensor]]]:
    """Hooks that put the clean run's ``hook_z`` of ``heads`` into the run (every position)."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)

    def hook_for(layer: int, chosen: list[int]) -> Callable[..., torch.Tensor]:
        def restore(z: torch.Tensor, hook: Any) -> torch.Tensor:
            z = z.clone()
            z[:, :, chosen] = clean_cache["z", layer][:, :, chosen]
            return z

        return restore

    return [(f"blocks.{layer}.attn.hook_z", hook_for(layer, chosen)) for layer, chosen in by_layer.items()]


def _argmax(scores: torch.Tensor) -> tuple[int, int]:
    flat = int(scores.argmax())
    return divmod(flat, scores.shape[1])


def _label(head: tuple[int, int]) -> str:
    return f"L{head[0]}H{head[1]}"


def _best_other(scores: torch.Tensor, heads: list[tuple[int, int]], percent: bool = False) -> str:
    others = scores.clone()
    for head in heads:
        others[head] = -math.inf
    best = _argmax(others)
    value = scores[best].item()
    return f"{_label(best)} {100 * value:.0f}%" if percent else f"{_label(best)} {value:.2f}"


def report(result: InductionResult, echo: Callable[[str], None] = print) -> None:
    heads, prev = result.heads, result.previous_head
    echo(
        f"\nInduction heads: a {result.n_layers}-layer attention-only {result.architecture} model "
        f"({result.n_heads} heads per layer) trained {result.steps} steps on random tokens with a repeated segment "
        f"(CPU, seeded, {result.seconds:.0f}s)"
    )
    echo(
        f"  loss on a repeated segment: {result.loss_copy:.2f} nats (a guess: {result.chance:.2f}): it copies in "
        f"context"
    )
    scores = ", ".join(f"{_label(h)} {result.induction_scores[h].item():.2f}" for h in heads) or "none"
    echo(
        f"  detect_head 'induction_head' (score >= {INDUCTION_SCORE}): {scores}; best other head "
        f"{_best_other(result.induction_scores, heads)}"
    )
    echo(
        f"  detect_head 'previous_token_head': {_label(prev)} {result.previous_token_scores[prev].item():.2f}; "
        f"best other head {_best_other(result.previous_token_scores, [prev])}"
    )
    shares = ", ".join(f"{_label(h)} {100 * result.restored[h].item():.0f}%" for h in heads)
    echo(
        f"  activation patching (first copy replaced by other tokens, a head's hook_z restored from the clean run): "
        f"{shares or '-'} of the copy's log-probability; best other head "
        f"{_best_other(result.restored, heads, percent=True)}; the induction heads together "
        f"{100 * result.restored_together:.0f}%"
    )
    if result.attributed is not None and result.eap_heads is not None and result.edges is not None:
        attributed = ", ".join(f"{_label(h)} {100 * result.attributed[h].item():.0f}%" for h in heads)
        error = (result.attributed - result.restored).abs().max().item()
        corr = torch.corrcoef(torch.stack([result.attributed.flatten(), result.restored.flatten()]))[0, 1].item()
        echo(
            f"  attribution patching (one backward): {attributed or '-'}; best other head "
            f"{_best_other(result.attributed, heads, percent=True)}; against activation patching: correlation "
            f"{corr:.2f}, largest difference {100 * error:.0f} points"
        )
        eap = ", ".join(f"{_label(h)} {100 * result.eap_heads[h].item():.0f}%" for h in heads)
        top = "; ".join(f"{u} -> {d}" for u, d, _ in result.edges.edges()[:3])
        echo(
            f"  edge attribution patching (EAP, one backward, {int(result.edges.valid.sum())} edges): heads' outgoing "
            f"edges {eap or '-'}; best other head {_best_other(result.eap_heads, heads, percent=True)}; top edges "
            f"{top}; a circuit of the top {result.circuit_edges} edges (every other edge patched from the corrupted "
            f"run) keeps {100 * result.circuit_recovered:.0f}%"
        )
    if result.confirmed:
        names = ", ".join(_label(h) for h in heads)
        echo(
            f"  => {names}: induction heads by their attention pattern and by what they carry"
            + (f"; they read the previous-token head {_label(prev)}" if heads and prev[0] < heads[0][0] else "")
        )
    else:
        echo(
            "  => not confirmed: no set of heads both attends like an induction head and carries the copying "
            "(train longer: lensadapters.induction_demo.run(steps=...))"
        )
    if result.plot:
        echo(f"  attention patterns written to {result.plot}")


def require_matplotlib() -> None:
    """Refuse ``--plot`` up front, with the fix, when matplotlib (an optional dependency) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "lensadapters demo --plot needs matplotlib: pip install lensadapters[plot] (or pip install matplotlib)"
        ) from None


def write_plot(hm: HookedModel, tokens: torch.Tensor, result: InductionResult, path: str) -> str:
    """The induction head's and the previous-token head's attention patterns on one sequence and, where measured,
    every head's share of the behaviour by activation patching, attribution patching and EAP, as a PNG."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = (
        max(result.heads, key=lambda h: result.induction_scores[h].item())
        if result.heads
        else (_argmax(result.induction_scores))
    )
    heads = [("induction head", top), ("previous-token head", result.previous_head)]
    names = sorted({f"blocks.{layer}.attn.hook_pattern" for _, (layer, _) in heads})
    with torch.no_grad():
        _, cache = hm.run_with_cache(tokens, names_filter=names, return_type=None)
    measured = [
        ("activation patching", result.restored),
        ("attribution patching", result.attributed),
        ("EAP (outgoing edges)", result.eap_heads),
    ]
    methods = [(name, scores) for name, scores in measured if scores is not None]
    fig, axes = plt.subplots(1, 3 if len(methods) > 1 else 2, figsize=(15 if len(methods) > 1 else 10, 4.6))
    if len(methods) > 1:
        ax = axes[2]
        labels = [_label((layer, h)) for layer in range(result.n_layers) for h in range(result.n_heads)]
        width = 0.8 / len(methods)
        for i, (name, scores) in enumerate(methods):
            x = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(x, (100 * scores.flatten()).tolist(), width, label=name)
        ax.set_xticks(range(len(labels)), labels, rotation=90)
        ax.set_ylabel("% of the copy's log-probability restored")
        ax.set_title("each head's share, three ways")
        ax.legend(fontsize=8)
    for ax, (title, (layer, head)) in zip(axes, heads):
        pattern = cache["pattern", layer][0, head].float().numpy()
        ax.imshow(pattern, cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"{title} {_label((layer, head))}")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    fig.suptitle(
        "A start token and random tokens, repeated: the induction head looks at what followed the earlier copy",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
