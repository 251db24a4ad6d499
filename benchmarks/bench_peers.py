# Over 500 lines on purpose: one benchmark run end to end (build every library's model, time the interleaved
# rounds, measure memory, tabulate, chart); it re-runs itself (``__file__``) as its memory workers and as the
# HookedTransformer worker in the second (transformers 4.x) environment, so one file is what every process runs.
"""lensadapters against raw Hugging Face and the peers: time and memory, side by side in one run.

Models (random weights, float32, CPU, batch 4 x 128 tokens by default):

* ``gpt2``  -- GPT-2 small shape: 12 layers, d_model 768, 12 heads, vocab 50257 (124M parameters)
* ``llama`` -- Llama shape of similar size: 12 layers, hidden 768, 12 heads, 4 key/value heads,
  intermediate 2048, vocab 32000 (125M parameters)

Scenarios, each run by every library that has it:

* ``forward``     -- a plain forward pass (lensadapters: wrapped model, no hooks)
* ``cache_resid`` -- cache ``blocks.*.hook_resid_post`` (nnsight: ``.save()`` every block output)
* ``cache_all``   -- cache every hook point, attention scores and patterns included
* ``patch_head``  -- activation patching: overwrite one head of ``blocks.{L/2}.attn.hook_z``
  (nnsight: the same slice of the output projection's input)

Libraries: raw HF (``sdpa`` -- the limit -- and ``eager``), lensadapters, TransformerLens'
``HookedTransformer`` (weights converted from the same HF model, no weight processing) and
``TransformerBridge`` (booted on a copy of the same HF model), and nnsight (on a copy). Peers that
are not installed are skipped. TransformerLens 2.x (``HookedTransformer``) needs transformers 4.x while
TransformerLens 4 (``TransformerBridge``) has no ``HookedTransformer``: with ``--tl2-python`` (default
``.venv-bench-tl2/bin/python`` when it exists, see ``scripts/bench.sh``) the ``HookedTransformer`` column
is measured in that second environment during the same run -- interleaved there with its own raw HF
forwards and lensadapters, and reported as a ratio to that environment's HF sdpa forward. Every library
gets its own copy of the weights, so no library's hooks can slow down another's runs. Repetitions are
interleaved: each round runs every variant once (in a rotated order), and the median over rounds is
reported as a ratio to the raw HF sdpa forward of the same round set.

Memory (``--memory``): each measurement runs in a fresh subprocess with
``MALLOC_MMAP_THRESHOLD_=65536`` (so glibc returns freed tensor memory to the OS and the resident
set tracks live tensors). After building the model and one warm-up call, the worker resets the
kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs``), reads ``VmRSS``, runs the call once
more while keeping its result, and reports ``VmHWM - VmRSS_before`` (peak) and ``VmRSS_after -
VmRSS_before`` (what the returned logits and cache keep alive).

Allocator (``--keep-freed-memory``): caching every hook point keeps ~435 MB of activations alive, and
with glibc's defaults each call gets that memory as fresh pages from the kernel (~100k minor page faults,
which an uncached forward, reusing its freed buffers, does not pay). The flag re-runs the benchmark with
``MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=8589934592`` so freed memory stays in the process
for every library alike, and writes ``bench_peers_kept_memory.*``: what the libraries cost with the
kernel's part taken out.

    python benchmarks/bench_peers.py [--rounds 7] [--layers 12] [--models gpt2,llama] [--memory]
                                     [--keep-freed-memory]

Results: a table on stdout, ``benchmarks/results/bench_peers.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

# glibc settings under which freed memory stays in the process (--keep-freed-memory)
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": "268435456", "MALLOC_TRIM_THRESHOLD_": "8589934592"}
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SCENARIOS = ("forward", "cache_resid", "cache_all", "patch_head")
SCENARIO_LABELS = {
    "forward": "forward, no hooks",
    "cache_resid": "cache resid_post",
    "cache_all": "cache every hook point",
    "patch_head": "patch one head (hook_z)",
}
LIBS = ("lensadapters", "tl_hooked", "tl_bridge", "nnsight")
LIB_LABELS = {
    "hf_sdpa": "HF sdpa",
    "hf_eager": "HF eager",
    "lensadapters": "lensadapters",
    "tl_hooked": "TL HookedTransformer",
    "tl_bridge": "TL TransformerBridge",
    "nnsight": "nnsight",
}
# target ratio and what it is measured against
TARGETS = {
    "forward": (1.02, "hf_sdpa"),
    "cache_resid": (1.05, "hf_sdpa"),
    "cache_all": (1.15, "hf_eager"),
    "patch_head": (1.05, "hf_sdpa"),
}
PATCH_HEAD = 3


# --- models ------------------------------------------------------------------------------------------


#: the benchmark models' sizes (width, heads, key/value heads, Llama's MLP width, vocabulary, positions): GPT-2 small,
#: and a Llama of GPT-2 small's width
SIZES = {"gpt2": (768, 12, 12, 0, 50257, 1024), "llama": (768, 12, 4, 2048, 32000, 2048)}


def hf_config(kind: str, layers: int, sizes: Optional[tuple[int, ...]] = None) -> Any:
    """The benchmark model's config: ``layers`` layers of ``sizes`` (``SIZES[kind]`` by default)."""
    from transformers import GPT2Config, LlamaConfig

    from lensadapters import hf

    if kind not in SIZES:
        raise ValueError(f"unknown model {kind!r} (gpt2, llama)")
    hidden, heads, kv_heads, d_mlp, vocab, positions = sizes or SIZES[kind]
    if kind == "gpt2":
        return GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=positions)
    shape = dict(hidden=hidden, heads=heads, kv_heads=kv_heads, d_mlp=d_mlp, vocab=vocab, positions=positions)
    return LlamaConfig(**hf.size_fields(layers=layers, **shape))


def build_hf(kind: str, layers: int, attn: str = "sdpa", state: Optional[dict] = None, config: Any = None) -> Any:
    """The benchmark model (``config`` replaces ``hf_config(kind, layers)``), seeded, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config or hf_config(kind, layers), attn_implementation=attn).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def blocks_of(model: Any) -> Any:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def o_proj_of(block: Any) -> Any:
    return block.attn.c_proj if hasattr(block, "attn") else block.self_attn.o_proj


def tl_hooked_from(model: Any) -> Any:
    """TransformerLens ``HookedTransformer`` with the weights of ``model``, no weight processing, offline: the test
    kit's reference (:func:`lensadapters.testing.tl_reference.hooked_transformer`, TransformerLens' own weight
    conversion with every processing flag off, as ``from_pretrained_no_processing`` does)."""
    from lensadapters.testing.tl_reference import hooked_transformer

    return hooked_transformer(model)


def offline_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer saved to a temporary folder (TransformerBridge reloads it by path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0", pad_token="t2")
    folder = tempfile.mkdtemp(prefix="lensadapters-bench-tok-")
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def tl_bridge_from(model: Any) -> Any:
    """TransformerLens ``TransformerBridge`` on a copy of ``model`` (the bridge replaces modules inside it)."""
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(
        model.config.model_type,
        hf_model=copy.deepcopy(model),
        tokenizer=offline_tokenizer(model.config.vocab_size),
        device="cpu",
    )


def available(lib: str) -> Optional[str]:
    """The installed version of a peer, or None."""
    from importlib import metadata

    dist = {
        "tl_hooked": "transformer-lens",
        "tl_bridge": "transformer-lens",
        "nnsight": "nnsight",
        "lensadapters": "lensadapters",
    }[lib]
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
    if lib == "tl_hooked":
        try:
            from transformer_lens import HookedTransformer  # noqa: F401  (removed in TransformerLens 4)
        except ImportError:
            return None
    if lib == "tl_bridge":
        try:
            from transformer_lens.model_bridge import TransformerBridge  # noqa: F401
        except ImportError:
            return None
    return version


# --- the variants ------------------------------------------------------------------------------------


def is_resid_post(name: str) -> bool:
    return name.endswith("hook_resid_post")


def make_patch(source: torch.Tensor, head: int) -> Callable[..., torch.Tensor]:
    """The classic TransformerLens patching hook: overwrite one head of z in place."""

    def patch(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z[:, :, head] = source[:, :, head]
        return z

    return patch


def tl_style(lib: str, model: Any, ids: torch.Tensor, z_name: str, patch: Callable[..., Any]) -> dict:
    """The four scenarios of a library with TransformerLens' API (``model(ids)``, ``run_with_cache``,
    ``run_with_hooks``): ``{(lib, scenario): fn}``."""
    return {
        (lib, "forward"): lambda: model(ids),
        (lib, "cache_resid"): lambda: model.run_with_cache(ids, names_filter=is_resid_post),
        (lib, "cache_all"): lambda: model.run_with_cache(ids),
        (lib, "patch_head"): lambda: model.run_with_hooks(ids, fwd_hooks=[(z_name, patch)]),
    }


def variants_for(
    kind: str, layers: int, libs: list[str], batch: int, length: int, memory: bool = False
) -> tuple[dict, dict]:
    """Build every model once and return ``{(lib, scenario): fn}`` and some facts about the models.

    ``memory`` adds the variants measured only for memory (``cache_all_cpu``: storage on ``device="cpu"``).
    """
    sdpa = build_hf(kind, layers, "sdpa")
    state = sdpa.state_dict()
    eager = build_hf(kind, layers, "eager", state)
    cfg = sdpa.config
    n_heads = cfg.n_head if kind == "gpt2" else cfg.num_attention_heads
    d_head = (cfg.n_embd if kind == "gpt2" else cfg.hidden_size) // n_heads
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
    source = torch.randn(batch, length, n_heads, d_head, generator=gen)
    layer = layers // 2
    z_name = f"blocks.{layer}.attn.hook_z"
    patch = make_patch(source, PATCH_HEAD)
    v: dict[tuple[str, str], Callable[[], Any]] = {
        ("hf_sdpa", "forward"): lambda: sdpa(ids),
        ("hf_eager", "forward"): lambda: eager(ids),
    }
    facts: dict[str, Any] = {"parameters": sum(p.numel() for p in sdpa.parameters()), "hook_points": {}}

    if "lensadapters" in libs:
        from lensadapters import HookedModel

        hm = HookedModel.wrap(build_hf(kind, layers, "sdpa", state))
        v.update(tl_style("lensadapters", hm, ids, z_name, patch))
        facts["hook_points"]["lensadapters"] = len(hm.cache_names())
        if memory:
            v[("lensadapters", "cache_all_cpu")] = lambda: hm.run_with_cache(ids, device="cpu")
    if "tl_hooked" in libs:
        ht = tl_hooked_from(sdpa)
        v.update(tl_style("tl_hooked", ht, ids, z_name, patch))
        facts["hook_points"]["tl_hooked"] = len(ht.hook_dict)
    if "tl_bridge" in libs:
        br = tl_bridge_from(sdpa)
        v.update(tl_style("tl_bridge", br, ids, z_name, patch))
        facts["hook_points"]["tl_bridge"] = len(br.hook_dict)
    if "nnsight" in libs:
        import nnsight

        nm = nnsight.NNsight(build_hf(kind, layers, "sdpa", state))
        n_blocks = blocks_of(nm)
        o_proj = o_proj_of(n_blocks[layer])
        lo, hi = PATCH_HEAD * d_head, (PATCH_HEAD + 1) * d_head
        head_source = source[:, :, PATCH_HEAD]

        def nn_forward() -> Any:
            with nm.trace(ids):
                out = nnsight.save(nm.output)
            return out

        def nn_resid() -> Any:
            with nm.trace(ids):
                saved = nnsight.save([b.output.save() for b in n_blocks])
                out = nnsight.save(nm.output)
            return out, saved

        def nn_patch() -> Any:
            with nm.trace(ids):
                o_proj.input[:, :, lo:hi] = head_source
                out = nnsight.save(nm.output)
            return out

        v[("nnsight", "forward")] = nn_forward
        v[("nnsight", "cache_resid")] = nn_resid
        v[("nnsight", "patch_head")] = nn_patch
    return v, facts


def check_patch_agreement(variants: dict) -> dict[str, float]:
    """Every library's patched logits against lensadapters' (they must agree up to float rounding)."""

    def logits(x: Any) -> torch.Tensor:
        x = x[0] if isinstance(x, tuple) else x
        return getattr(x, "logits", x)

    ref = variants.get(("lensadapters", "patch_head"))
    if ref is None:
        return {}
    with torch.no_grad():
        base = logits(ref())
        return {
            lib: float((logits(fn()) - base).abs().max())
            for (lib, sc), fn in variants.items()
            if sc == "patch_head" and lib != "lensadapters"
        }


def time_variants(variants: dict, rounds: int, warmup: int) -> dict[tuple[str, str], list[float]]:
    keys = list(variants)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    with torch.no_grad():
        for _ in range(warmup):
            for k in keys:
                variants[k]()
        for r in range(rounds):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]
            for k in order:
                gc.collect()
                start = time.perf_counter()
                result = variants[k]()
                times[k].append(time.perf_counter() - start)
                del result
    return times


# --- the HookedTransformer column from a second environment ------------------------------------------


def tl2_worker(kind: str, layers: int, rounds: int, warmup: int, batch: int, length: int) -> dict:
    """Runs in the TransformerLens 2.x environment: raw HF, lensadapters and HookedTransformer, interleaved."""
    variants, facts = variants_for(kind, layers, ["lensadapters", "tl_hooked"], batch, length)
    agreement = check_patch_agreement(variants)
    times = time_variants(variants, rounds, warmup)
    return {
        "time": summarize(times),
        "facts": facts,
        "patch_agreement": agreement,
        "versions": versions(),
        "raw_times": {f"{k[0]}/{k[1]}": v for k, v in times.items()},
    }


def run_tl2(python: str, kind: str, args: Any) -> Optional[dict]:
    cmd = [
        python,
        __file__,
        "--_tl2-worker",
        json.dumps([kind, args.layers, args.rounds, args.warmup, args.batch, args.length]),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TL2 ")]
    if proc.returncode or not lines:
        print(f"  TransformerLens 2.x environment failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("TL2 ") :])


# --- memory ------------------------------------------------------------------------------------------

MEMORY_CASES = (
    ("hf_sdpa", "forward"),
    ("lensadapters", "forward"),
    ("lensadapters", "cache_resid"),
    ("lensadapters", "cache_all"),
    ("lensadapters", "cache_all_cpu"),
    ("tl_hooked", "cache_resid"),
    ("tl_hooked", "cache_all"),
    ("tl_bridge", "cache_resid"),
    ("tl_bridge", "cache_all"),
    ("nnsight", "cache_resid"),
)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_worker(kind: str, layers: int, lib: str, scenario: str, batch: int, length: int) -> dict:
    """Runs in a fresh subprocess: peak and retained RSS of one call."""
    libs = [lib] if lib in LIBS else []
    variants, _ = variants_for(kind, layers, libs, batch, length, memory=True)
    fn = variants[(lib, scenario)]

    with torch.no_grad():
        fn()  # warm-up: one-time allocations, lazily installed hooks
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
        result = fn()
        after = _status_kib("VmRSS")
        peak = _status_kib("VmHWM")
    cached = 0
    for item in result if isinstance(result, tuple) else (result,):
        if hasattr(item, "items"):
            cached += sum(t.numel() * t.element_size() for _, t in item.items() if isinstance(t, torch.Tensor))
        elif isinstance(item, list):
            cached += sum(t.numel() * t.element_size() for t in item if isinstance(t, torch.Tensor))
    return {
        "peak_mib": (peak - before) / 1024,
        "retained_mib": (after - before) / 1024,
        "cache_tensors_mib": cached / 2**20,
    }


def measure_memory(
    kind: str, layers: int, libs: list[str], batch: int, length: int, tl2_python: Optional[str] = None
) -> dict:
    results = {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    for lib, scenario in MEMORY_CASES:
        python = sys.executable
        if lib == "tl_hooked" and lib not in libs and tl2_python:
            python = tl2_python
        elif lib not in ("hf_sdpa",) and lib not in libs:
            continue
        cmd = [python, __file__, "--_memory-worker", json.dumps([kind, layers, lib, scenario, batch, length])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")]
        if proc.returncode or not lines:
            print(f"  memory {kind}/{lib}/{scenario} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        results[f"{lib}/{scenario}"] = json.loads(lines[-1][len("MEMORY ") :])
        r = results[f"{lib}/{scenario}"]
        print(
            f"  memory {kind:<6} {LIB_LABELS[lib]:<22} {scenario:<14} peak {r['peak_mib']:7.0f} MiB, "
            f"retained {r['retained_mib']:7.0f} MiB (cache tensors {r['cache_tensors_mib']:6.0f} MiB)",
            flush=True,
        )
    return results


# --- reporting ---------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("transformers", "lensadapters", "transformer-lens", "nnsight"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {platform.system()}"


def summarize(times: dict) -> dict[str, dict[str, dict[str, float]]]:
    med = {k: statistics.median(v) for k, v in times.items()}
    base, base_eager = med[("hf_sdpa", "forward")], med[("hf_eager", "forward")]
    table: dict[str, dict[str, dict[str, float]]] = {}
    for (lib, scenario), m in med.items():
        table.setdefault(scenario, {})[lib] = {
            "median_s": m,
            "min_s": min(times[(lib, scenario)]),
            "vs_sdpa": m / base,
            "vs_eager": m / base_eager,
        }
    return table


def format_table(kind: str, table: dict, libs: list[str]) -> str:
    cols = ["lensadapters"] + [lib for lib in libs if lib != "lensadapters"]
    elsewhere = {c for c in cols if any(table.get(s, {}).get(c, {}).get("environment") for s in SCENARIOS)}
    head = (
        f"| {kind}: scenario (ratio to HF sdpa) | target | "
        + " | ".join(LIB_LABELS[c] + (" †" if c in elsewhere else "") for c in cols)
        + " |"
    )
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    fwd = table["forward"]
    lines.append(
        f"| HF sdpa forward ({fwd['hf_sdpa']['median_s'] * 1000:.0f} ms) | limit | "
        + " | ".join("" for _ in cols)
        + " |"
    )
    lines.append(f"| HF eager forward | | {fwd['hf_eager']['vs_sdpa']:.3f} |" + " |" * (len(cols) - 1))
    for scenario in SCENARIOS:
        target, against = TARGETS[scenario]
        if against == "hf_eager":
            target_txt = f"<= {target * fwd['hf_eager']['vs_sdpa']:.2f} (eager x {target})"
        else:
            target_txt = f"<= {target}"
        cells = []
        for c in cols:
            r = table.get(scenario, {}).get(c)
            cells.append("n/a" if r is None else f"{r['vs_sdpa']:.3f}")
        lines.append(f"| {SCENARIO_LABELS[scenario]} | {target_txt} | " + " | ".join(cells) + " |")
    if elsewhere:
        lines.append("")
        lines.append(
            "† measured in the TransformerLens 2.x environment (transformers 4.x) during the same run, as a ratio "
            "to that environment's own HF sdpa forward"
        )
    return "\n".join(lines)


def check_targets(kind: str, table: dict) -> list[str]:
    notes = []
    for scenario in SCENARIOS:
        r = table.get(scenario, {}).get("lensadapters")
        if r is None:
            continue
        target, against = TARGETS[scenario]
        ratio = r["median_s"] / table["forward"][against]["median_s"]
        ok = ratio <= target
        notes.append(
            f"{kind} {scenario}: {ratio:.3f} vs {LIB_LABELS[against]} (target <= {target}) {'met' if ok else 'MISSED'}"
        )
    return notes


def format_memory(kind: str, mem: dict) -> str:
    lines = [
        f"| {kind}: one call | peak above idle (MiB) | kept alive after (MiB) | cached tensors (MiB) |",
        "|---|---|---|---|",
    ]
    for key, r in mem.items():
        lib, scenario = key.split("/")
        label = {"cache_all_cpu": 'cache every hook point, device="cpu"'}.get(
            scenario, SCENARIO_LABELS.get(scenario, scenario)
        )
        lines.append(
            f"| {LIB_LABELS[lib]}: {label} | {r['peak_mib']:.0f} | {r['retained_mib']:.0f} | "
            f"{r['cache_tensors_mib']:.0f} |"
        )
    return "\n".join(lines)


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(results["models"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.6), squeeze=False)
    colors = {"lensadapters": "#1f77b4", "tl_hooked": "#ff7f0e", "tl_bridge": "#d62728", "nnsight": "#2ca02c"}
    for ax, kind in zip(axes[0], kinds):
        table = results["models"][kind]["time"]
        libs = [lib for lib in LIBS if any(lib in table.get(s, {}) for s in SCENARIOS)]
        width = 0.8 / max(len(libs), 1)
        for j, lib in enumerate(libs):
            xs, ys = [], []
            for i, scenario in enumerate(SCENARIOS):
                r = table.get(scenario, {}).get(lib)
                if r is not None:
                    xs.append(i + (j - (len(libs) - 1) / 2) * width)
                    ys.append(r["vs_sdpa"])
            bars = ax.bar(xs, ys, width, label=LIB_LABELS[lib], color=colors[lib])
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6.5, rotation=90)
            del bars
        ax.axhline(1.0, color="black", linewidth=0.8)
        eager = table["forward"]["hf_eager"]["vs_sdpa"]
        ax.axhline(eager, color="gray", linewidth=0.8, linestyle=":", label=f"HF eager ({eager:.2f})")
        for i, scenario in enumerate(SCENARIOS):
            target, against = TARGETS[scenario]
            t = target * (eager if against == "hf_eager" else 1.0)
            ax.plot([i - 0.45, i + 0.45], [t, t], color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(SCENARIOS)), [SCENARIO_LABELS[s] for s in SCENARIOS], fontsize=8, rotation=12)
        ax.set_ylabel("time / raw HF sdpa forward")
        fwd_ms = table["forward"]["hf_sdpa"]["median_s"] * 1000
        ax.set_title(
            f"{kind} ({results['models'][kind]['parameters'] / 1e6:.0f}M params), HF sdpa = {fwd_ms:.0f} ms",
            fontsize=10,
        )
        ax.set_ylim(0, max(3.0, ax.get_ylim()[1]))
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(
        f"batch {results['batch']} x {results['length']}, CPU float32, median of {results['rounds']} "
        f"interleaved rounds (dashed: lensadapters targets); {results.get('allocator', 'glibc defaults')}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--libs", default=",".join(LIBS), help="subset of " + ",".join(LIBS))
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="rerun under glibc settings that keep freed memory in the process (see the docstring)",
    )
    default_tl2 = HERE.parent / ".venv-bench-tl2" / "bin" / "python"
    parser.add_argument(
        "--tl2-python",
        default=str(default_tl2) if default_tl2.exists() else None,
        help="python of an environment with TransformerLens 2.x (HookedTransformer); see scripts/bench.sh",
    )
    parser.add_argument("--_memory-worker", dest="memory_worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_tl2-worker", dest="tl2_worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        print("MEMORY " + json.dumps(memory_worker(*json.loads(args.memory_worker))))
        return
    if args.tl2_worker:
        print("TL2 " + json.dumps(tl2_worker(*json.loads(args.tl2_worker))))
        return
    if args.keep_freed_memory and os.environ.get("MALLOC_TRIM_THRESHOLD_") != KEEP_FREED["MALLOC_TRIM_THRESHOLD_"]:
        # glibc reads these at start-up: run again in a process that has them (the TL2 worker inherits them)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **KEEP_FREED})
    stem = "bench_peers_kept_memory" if args.keep_freed_memory else "bench_peers"

    libs = []
    tl2 = None
    for lib in args.libs.split(","):
        version = available(lib)
        if version is None and lib == "tl_hooked" and args.tl2_python:
            tl2 = args.tl2_python
            print(f"{LIB_LABELS[lib]}: measured with {tl2} (TransformerLens 2.x on transformers 4.x)")
        elif version is None:
            print(f"skipping {LIB_LABELS[lib]}: not installed (bash scripts/bench.sh sets up both environments)")
        else:
            libs.append(lib)
    results: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
        "versions": versions(),
        "machine": machine(),
        "load_average": os.getloadavg(),
        "rounds": args.rounds,
        "batch": args.batch,
        "length": args.length,
        "layers": args.layers,
        "models": {},
        "allocator": (
            "glibc keeps freed memory: " + " ".join(f"{k}={v}" for k, v in KEEP_FREED.items())
            if args.keep_freed_memory
            else "glibc defaults"
        ),
    }
    print(f"{results['date']} | {results['machine']} | load {results['load_average'][0]:.2f}")
    print(" | ".join(f"{k} {v}" for k, v in results["versions"].items()))
    report = []
    for kind in args.models.split(","):
        print(f"\n== {kind}: building models ...", flush=True)
        variants, facts = variants_for(kind, args.layers, libs, args.batch, args.length)
        agreement = check_patch_agreement(variants)
        print(
            "  patched logits, max |difference| to lensadapters: "
            + ", ".join(f"{LIB_LABELS[k]} {v:.1e}" for k, v in agreement.items())
        )
        print(f"  timing {len(variants)} variants x {args.rounds} rounds ...", flush=True)
        times = time_variants(variants, args.rounds, args.warmup)
        table = summarize(times)
        del variants
        gc.collect()
        results["models"][kind] = {
            **facts,
            "time": table,
            "patch_agreement": agreement,
            "raw_times": {f"{k[0]}/{k[1]}": v for k, v in times.items()},
        }
        shown = list(libs)
        if tl2:
            print(f"  TransformerLens 2.x environment: timing {kind} ...", flush=True)
            other = run_tl2(tl2, kind, args)
            if other is not None:
                for scenario, row in other["time"].items():
                    if "tl_hooked" in row:
                        table.setdefault(scenario, {})["tl_hooked"] = {**row["tl_hooked"], "environment": "tl2"}
                results["models"][kind]["tl2_environment"] = other
                results["models"][kind]["hook_points"]["tl_hooked"] = other["facts"]["hook_points"].get("tl_hooked")
                agreement.update(other["patch_agreement"])
                shown.insert(1, "tl_hooked")
                print(
                    f"  (that environment: {', '.join(f'{k} {v}' for k, v in other['versions'].items())}; "
                    f"HookedTransformer patched logits vs lensadapters there: {other['patch_agreement']})"
                )
        text = format_table(kind, table, shown)
        print(text)
        notes = check_targets(kind, table)
        print("\n".join("  " + n for n in notes))
        report += [text, "", *("- " + n for n in notes), ""]
        if args.memory:
            print("  memory (one subprocess per measurement) ...", flush=True)
            mem = measure_memory(kind, args.layers, libs, args.batch, args.length, tl2)
            results["models"][kind]["memory"] = mem
            report += [format_memory(kind, mem), ""]
    results["load_average_end"] = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    header = [
        f"Measured {results['date']} on {results['machine']}; load average {results['load_average'][0]:.2f} "
        f"at start, {results['load_average_end'][0]:.2f} at end.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".",
        f"Batch {args.batch} x {args.length} tokens, float32, {args.layers} layers, median of {args.rounds} "
        f"interleaved rounds, ratios to the raw HF sdpa forward. Allocator: {results['allocator']}.",
        "",
    ]
    (out / f"{stem}.md").write_text("\n".join(header + report) + "\n")
    chart(results, out / f"{stem}.png")
    print(f"\nwrote {out / f'{stem}.json'}, {out / f'{stem}.md'}, {out / f'{stem}.png'}")


if __name__ == "__main__":
    main()
