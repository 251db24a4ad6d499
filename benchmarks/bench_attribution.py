"""What gradient-based circuit discovery costs: attribution patching and edge attribution patching against one forward
and backward of the same model on the same tokens, measured side by side.

For each model: the baseline is one forward of the corrupted batch and ``metric(logits).backward()`` (parameters'
gradients included, as in training), unhooked. Then, on the wrapped model: ``edge_attribution`` (EAP: a clean
forward without gradients, a corrupted forward with the graph's hook points, one backward, the edge scores' einsum),
``edge_attribution(steps=5)`` (EAP-IG), ``attribute`` of every head's ``hook_z``, and the exact activation-patching
sweep of every head (``get_act_patch_attn_head_out_all_pos`` at its default batch size) for scale. Each is timed
``--rounds`` times, interleaved; the median is reported, and each one's ratio to the baseline.

Shapes: GPT-2-small (12 layers, d_model 768, 12 heads) and a Llama of the same size with grouped-query attention
(12 heads, 4 key/value heads), the weights of ``bench_peers.py`` (seeded random), float32, ``--batch`` prompts of
``--length`` tokens, on the CPU.

    python benchmarks/bench_attribution.py [--models gpt2,llama] [--layers 12] [--batch 4] [--length 32] [--rounds 3]
        [--device cpu|cuda]

Results: a table on stdout, ``benchmarks/results/bench_attribution.{json,md}`` (``_cuda`` on a GPU).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import build_hf, hf_config, machine  # noqa: E402
from model_sweeps import sweep_parser, write_results  # noqa: E402


def run(kind: str, layers: int, batch: int, length: int, rounds: int, device: str = "cpu") -> list[dict]:
    from lensadapters import HookedModel, attribution, edge_attribution, patching

    config = hf_config(kind, layers)
    model = build_hf(kind, layers, attn="sdpa").to(device)
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(0, config.vocab_size, (batch, length), generator=generator).to(device)
    corrupted = clean.clone()
    corrupted[:, length // 2] = (clean[:, length // 2] + 1) % config.vocab_size

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, 1] - logits[:, -1, 2]).mean()

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        metric(model(corrupted, use_cache=False).logits).backward()
        model.zero_grad(set_to_none=True)

    hm = HookedModel.wrap(model)
    with torch.no_grad():
        _, cache = hm.run_with_cache(clean, names_filter=lambda n: n.endswith("attn.hook_z"), return_type="logits")
    edges = {"n": 0}

    def eap() -> None:
        edges["n"] = int(edge_attribution.edge_attribution(hm, clean, corrupted, metric, progress=False).valid.sum())

    variants = {
        "one forward + backward (unhooked)": forward_backward,
        "EAP, every edge": eap,
        "EAP-IG, steps=5": lambda: edge_attribution.edge_attribution(
            hm, clean, corrupted, metric, steps=5, progress=False
        ),
        "attribution patching, every head (hook_z)": lambda: attribution.get_attr_patch_attn_head_out_all_pos(
            hm, clean, corrupted, metric, progress=False
        ),
        "activation patching, every head (exact, batched)": lambda: patching.get_act_patch_attn_head_out_all_pos(
            hm, corrupted, cache, metric
        ),
    }
    times: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(rounds + 1):  # the first round warms up
        for label, fn in variants.items():
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()):
                fn()
            if device != "cpu":
                torch.cuda.synchronize()
            times[label].append(time.perf_counter() - start)
    hm.unwrap()
    base = statistics.median(times["one forward + backward (unhooked)"][1:])
    rows = []
    for label, values in times.items():
        median = statistics.median(values[1:])
        rows.append(
            {
                "model": kind,
                "device": device,
                "what": label,
                "seconds": round(median, 3),
                "min_s": round(min(values[1:]), 3),
                "max_s": round(max(values[1:]), 3),
                "x_forward_backward": round(median / base, 2),
                "edges": edges["n"] if label.startswith("EAP") else None,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | device | what | seconds (median; min–max) | × one forward + backward |"]
    lines.append("|---|---|---|---|---|")
    for r in rows:
        what = r["what"] + (f" ({r['edges']} edges)" if r["edges"] else "")
        lines.append(
            f"| {r['model']} | {r['device']} | {what} | {r['seconds']} ({r['min_s']}–{r['max_s']}) | "
            f"{r['x_forward_backward']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = sweep_parser(__doc__.split("\n\n")[0], length=32, batch=4)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the baseline runs on the same device)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    for kind in args.models.split(","):
        out = run(kind, args.layers, args.batch, args.length, args.rounds, args.device)
        rows.extend(out)
        print(table(out), flush=True)
    header = (
        f"Attribution and edge attribution patching vs one forward + backward ({machine()}; {args.layers} layers, "
        f"batch {args.batch} x {args.length} tokens, float32, median of {args.rounds} interleaved rounds after a "
        f"warm-up round; {datetime.date.today()})"
    )
    name = "bench_attribution" + ("" if args.device == "cpu" else f"_{args.device}")
    write_results(args, name, header, table(rows), rows)
    print(header)


if __name__ == "__main__":
    main()
