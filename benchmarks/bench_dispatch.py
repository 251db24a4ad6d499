"""lensadapters' own per-call cost, in microseconds, where the model's arithmetic is negligible.

``bench_peers.py`` measures ratios at GPT-2-small scale, where one forward takes about a second on two
CPU cores and a shared machine's noise (several percent between identical calls) is larger than the
targets being checked. This script measures the part of the cost that lensadapters adds -- Python work
per call and per installed hook -- on the same 12-layer shapes at width 64 (batch 1 x 16 tokens), where
a forward takes a few milliseconds and thousands of calls fit in a minute. The same scenarios as
``bench_peers.py``:

* ``forward``     -- the wrapped model, no hooks (against the raw HF sdpa forward)
* ``cache_resid`` -- ``run_with_cache`` of every ``hook_resid_post`` (against HF sdpa)
* ``cache_all``   -- ``run_with_cache`` of every hook point, patterns included (against HF **eager**)
* ``patch_head``  -- ``run_with_hooks`` overwriting one head of ``blocks.6.attn.hook_z`` (against HF sdpa)

Each round runs every variant ``--inner`` times in a rotated order; the median over rounds of the
per-call time is reported, with the difference to its reference in microseconds. That difference is
an upper bound of what the same scenario adds to a large forward (hooks cost the same Python work at
any width; the tensors they keep alive are what ``bench_peers.py --keep-freed-memory`` accounts for),
so dividing it by the large model's forward time (``--forward-ms``, default: read from
``results/bench_peers.json``) bounds the overhead ratio there without that benchmark's noise.

    python benchmarks/bench_dispatch.py [--rounds 30] [--inner 10] [--models gpt2,llama]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from bench_peers import build_hf, hf_config  # the same seeded construction as the large-model benchmark

HERE = Path(__file__).resolve().parent
LAYERS = 12
REFERENCE = {"forward": "hf_sdpa", "cache_resid": "hf_sdpa", "cache_all": "hf_eager", "patch_head": "hf_sdpa"}


#: the small models' sizes (as ``bench_peers.SIZES``)
SMALL = {"gpt2": (64, 4, 4, 0, 512, 64), "llama": (64, 4, 2, 128, 512, 64)}


def config(kind: str) -> Any:
    return hf_config(kind, LAYERS, SMALL.get(kind))


def build(kind: str, attn: str, state: Optional[dict] = None) -> Any:
    return build_hf(kind, LAYERS, attn, state, config=config(kind))


def variants(kind: str) -> dict[str, Callable[[], Any]]:
    from lensadapters import HookedModel

    sdpa = build(kind, "sdpa")
    eager = build(kind, "eager", sdpa.state_dict())
    hm = HookedModel.wrap(build(kind, "sdpa", sdpa.state_dict()))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (1, 16), generator=gen)
    source = torch.randn(1, 16, 4, 16, generator=gen)

    def patch(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z[:, :, 1] = source[:, :, 1]
        return z

    z_name = f"blocks.{LAYERS // 2}.attn.hook_z"
    return {
        "hf_sdpa": lambda: sdpa(ids),
        "hf_eager": lambda: eager(ids),
        "forward": lambda: hm(ids),
        "cache_resid": lambda: hm.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_resid_post")),
        "cache_all": lambda: hm.run_with_cache(ids),
        "patch_head": lambda: hm.run_with_hooks(ids, fwd_hooks=[(z_name, patch)]),
    }


def measure(fns: dict[str, Callable[[], Any]], rounds: int, inner: int) -> dict[str, list[float]]:
    keys = list(fns)
    per_call: dict[str, list[float]] = {k: [] for k in keys}
    with torch.no_grad():
        for k in keys:  # warm-up
            for _ in range(inner):
                fns[k]()
        for r in range(rounds):
            for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
                gc.collect()
                start = time.perf_counter()
                for _ in range(inner):
                    fns[k]()
                per_call[k].append((time.perf_counter() - start) / inner)
    return per_call


def forward_ms_from_peers(kind: str) -> Optional[float]:
    path = HERE / "results" / "bench_peers.json"
    if not path.exists():
        return None
    models = json.loads(path.read_text()).get("models", {})
    try:
        return models[kind]["time"]["forward"]["hf_sdpa"]["median_s"] * 1000
    except KeyError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument(
        "--forward-ms",
        type=float,
        default=None,
        help="the large model's HF sdpa forward time (default: from results/bench_peers.json)",
    )
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    lines = [
        f"Per-call cost at width 64 (12 layers, batch 1 x 16), {torch.get_num_threads()} torch threads, "
        f"median of {args.rounds} interleaved rounds of {args.inner} calls.",
        "",
        "| model | scenario | reference | reference (us) | lensadapters (us) | added (us) | added / large forward |",
        "|---|---|---|---|---|---|---|",
    ]
    results: dict[str, Any] = {"rounds": args.rounds, "inner": args.inner, "models": {}}
    for kind in args.models.split(","):
        times = measure(variants(kind), args.rounds, args.inner)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        large_ms = args.forward_ms or forward_ms_from_peers(kind)
        results["models"][kind] = {"median_us": med, "large_forward_ms": large_ms, "raw_s": times}
        for scenario, ref in REFERENCE.items():
            added = med[scenario] - med[ref]
            share = f"{added / (large_ms * 1000):+.4f}" if large_ms else "n/a"
            lines.append(
                f"| {kind} | {scenario} | {ref} | {med[ref]:.0f} | {med[scenario]:.0f} | {added:+.0f} | {share} |"
            )
    if any(r["large_forward_ms"] for r in results["models"].values()):
        lines += [
            "",
            "added / large forward: the added microseconds as a share of the GPT-2-small-sized model's HF sdpa "
            "forward from bench_peers.py (the ratio overhead those hooks' Python work implies there).",
        ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_dispatch.md").write_text(text + "\n")
    (out / "bench_dispatch.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
