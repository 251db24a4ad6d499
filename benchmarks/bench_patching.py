"""Activation-patching sweeps: lensadapters' batched sweeps against TransformerLens 2.x's ``transformer_lens.patching``.

Both libraries get the same weights (a seeded random Hugging Face model; ``HookedTransformer`` converted from it
without weight processing, as in ``bench_peers.py``) and the same corrupted/clean tokens, and run
``get_act_patch_attn_head_out_all_pos`` and ``get_act_patch_resid_pre`` with a logit-difference metric.
lensadapters runs them at its default batch size (a memory budget, ``patching.MEMORY_BUDGET``) and one patch per
forward (``batch_size=1``, what TransformerLens does); the results of all three are compared (max |difference|).
Each sweep is timed ``--rounds`` times, the libraries interleaved; the median is reported.

Shapes: GPT-2-small (12 layers, d_model 768, 12 heads, d_mlp 3072, 50257 tokens) and a Llama of the same size with
grouped-query attention (12 heads, 4 key/value heads, d_mlp 2048, 32000 tokens), float32, ``--batch`` prompts of
``--length`` tokens, on the CPU. TransformerLens 2.x needs transformers 4.x: run this in that environment.

    python benchmarks/bench_patching.py [--models gpt2,llama] [--length 12] [--batch 1] [--rounds 3] [--threads 2]

Results: a table on stdout, ``benchmarks/results/bench_patching.{json,md}``.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import build_hf, hf_config, machine, tl_hooked_from  # noqa: E402
from model_sweeps import sweep_parser, write_results  # noqa: E402

SWEEPS = ("get_act_patch_attn_head_out_all_pos", "get_act_patch_resid_pre")


def inputs(vocab: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(0, vocab, (batch, length), generator=generator)
    corrupted = clean.clone()
    corrupted[:, length // 2] = (clean[:, length // 2] + 1) % vocab
    return clean, corrupted, 1, 2  # answer and wrong-answer token ids for the logit difference


def run(kind: str, layers: int, batch: int, length: int, rounds: int) -> dict:
    from transformer_lens import patching as tl_patching

    from lensadapters import HookedModel
    from lensadapters import patching as la_patching

    config = hf_config(kind, layers)
    hm = HookedModel.wrap(build_hf(kind, layers, attn="sdpa"))
    tl = tl_hooked_from(build_hf(kind, layers, attn="sdpa"))
    clean, corrupted, right, wrong = inputs(config.vocab_size, batch, length)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, right] - logits[:, -1, wrong]).mean()

    with torch.no_grad():
        _, la_cache = hm.run_with_cache(clean, return_type="logits")
        _, tl_cache = tl.run_with_cache(clean)
    budget = la_patching.default_batch_size(hm, corrupted)
    variants = {
        "TransformerLens": lambda name: getattr(tl_patching, name)(tl, corrupted, tl_cache, metric),
        "lensadapters batch_size=1": lambda name: getattr(la_patching, name)(
            hm, corrupted, la_cache, metric, batch_size=1
        ),
        f"lensadapters default ({budget} a forward)": lambda name: getattr(la_patching, name)(
            hm, corrupted, la_cache, metric
        ),
    }
    times: dict[str, dict[str, list[float]]] = {name: {v: [] for v in variants} for name in SWEEPS}
    results: dict[str, dict[str, torch.Tensor]] = {name: {} for name in SWEEPS}
    for _ in range(rounds):
        for name in SWEEPS:
            for label, fn in variants.items():
                start = time.perf_counter()
                results[name][label] = fn(name)
                times[name][label].append(time.perf_counter() - start)
    rows = []
    for name in SWEEPS:
        reference = results[name]["TransformerLens"]
        medians = {label: statistics.median(t) for label, t in times[name].items()}
        for label in variants:
            rows.append(
                {
                    "model": kind,
                    "sweep": name,
                    "variant": label,
                    "patches": reference.numel(),
                    "seconds": round(medians[label], 3),
                    "min_s": round(min(times[name][label]), 3),
                    "max_s": round(max(times[name][label]), 3),
                    "speedup_vs_tl": round(medians["TransformerLens"] / medians[label], 2),
                    "max_abs_diff_vs_tl": float((results[name][label] - reference).abs().max()),
                }
            )
    hm.unwrap()
    return {"rows": rows, "default_batch_size": budget}


def table(rows: list[dict]) -> str:
    lines = [
        "| model | sweep | patches | variant | seconds (median; min–max) | × TransformerLens | max abs diff vs TL |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | `{r['sweep']}` | {r['patches']} | {r['variant']} | {r['seconds']} "
            f"({r['min_s']}–{r['max_s']}) | {r['speedup_vs_tl']} | {r['max_abs_diff_vs_tl']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = sweep_parser(__doc__.split("\n\n")[0], length=12, batch=1).parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    batch_sizes = {}
    for kind in args.models.split(","):
        out = run(kind, args.layers, args.batch, args.length, args.rounds)
        rows.extend(out["rows"])
        batch_sizes[kind] = out["default_batch_size"]
        print(table(out["rows"]), flush=True)
    header = (
        f"Patching sweeps, lensadapters vs TransformerLens 2.x on the same weights ({machine()}; "
        f"{args.layers} layers, batch {args.batch} x {args.length} tokens, float32, median of {args.rounds} "
        f"interleaved rounds; {datetime.date.today()})"
    )
    write_results(args, "bench_patching", header, table(rows), rows, default_batch_size=batch_sizes)
    print(header)


if __name__ == "__main__":
    main()
