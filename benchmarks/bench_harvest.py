"""Harvesting throughput against a bare Hugging Face forward of the same layers on the same batches.

The model is the Llama shape of ``bench_peers.py`` (12 layers, hidden 768, 12 heads, 4 key/value heads,
intermediate 2048, vocab 32000; random weights, float32, CPU). Text of random words (a local word-level
tokenizer) is harvested at the points of each scenario, all in block 5, so the harvest runs 6 of the 12 blocks:

* ``resid``  -- ``blocks.5.hook_resid_post``
* ``three``  -- ``blocks.5.attn.hook_z``, ``blocks.5.mlp.hook_post`` and ``blocks.5.hook_resid_post``

``harvest`` is the whole of ``lensadapters.harvest`` into an empty folder: reading and tokenizing the text,
packing, the forward, converting and writing the shards, the manifest and the dataset files. ``bare`` is
the same token batches (the harvest's own ``token_ids``, ``--batch-size`` contexts of ``--context-size``
tokens) through a Hugging Face model built with those 6 blocks and the same weights -- the forward alone:
no tokenizing, no copy, nothing written. Each round runs both (in alternating order); the ratio of the
medians over rounds is reported, with each round's ratio for the spread.

Both are timed twice: wall-clock, and the CPU time of this process (``time.process_time``). On a shared
machine other processes stretch the wall-clock of whichever variant they overlap (rounds scatter by tens of
percent), while the CPU time the process itself spends is what it costs; torch runs one thread
(``--threads``) so that no time is spent spinning on a core another process holds.

    python benchmarks/bench_harvest.py [--rounds 7] [--contexts 64] [--batch-size 8] [--context-size 128]

Results: a table on stdout, ``benchmarks/results/bench_harvest.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from bench_peers import build_hf, hf_config

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LAYER = 5
SCENARIOS = {
    "resid": [f"blocks.{LAYER}.hook_resid_post"],
    "three": [f"blocks.{LAYER}.attn.hook_z", f"blocks.{LAYER}.mlp.hook_post", f"blocks.{LAYER}.hook_resid_post"],
}


def truncated(model: Any, layers: int) -> Any:
    """A model of the same class with the first ``layers`` blocks and the same weights."""
    from transformers import AutoModelForCausalLM

    config = type(model.config).from_dict(model.config.to_dict())
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    small = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    missing, unexpected = small.load_state_dict(model.state_dict(), strict=False)
    assert not missing, missing
    return small


def write_text(path: Path, contexts: int, context_size: int, vocab: int) -> None:
    rng = random.Random(0)
    words = 0
    with open(path, "w") as handle:
        while words < contexts * context_size * 1.1:
            n = rng.randrange(20, 400)
            handle.write(" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(n)) + "\n")
            words += n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--contexts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context-size", type=int, default=128)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--no-save", action="store_true", help="print only; do not write benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import datasets
    import transformers

    from lensadapters import HookedModel, harvest
    from lensadapters.testing.tl_reference import word_tokenizer

    config = hf_config("llama", 12)
    model = build_hf("llama", 12, "sdpa", config=config)
    bare_model = truncated(model, LAYER + 1)
    tok = word_tokenizer(config.vocab_size)
    hm = HookedModel.wrap(model, tokenizer=tok)
    work = Path(tempfile.mkdtemp(prefix="bench-harvest-"))
    write_text(work / "data.txt", args.contexts, args.context_size, config.vocab_size)
    max_tokens = args.contexts * args.context_size
    results: dict[str, Any] = {}
    try:
        for scenario in args.scenarios.split(","):
            hooks = SCENARIOS[scenario]

            def run_harvest(hooks: list[str] = hooks) -> None:
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                harvest(
                    hm,
                    str(work / "data.txt"),
                    hooks,
                    str(out),
                    context_size=args.context_size,
                    batch_size=args.batch_size,
                    max_tokens=max_tokens,
                    progress=False,
                )

            run_harvest()  # warm-up; its token ids are the bare forward's batches
            ids = datasets.load_from_disk(str(work / "out")).with_format("torch")[:]["token_ids"].long()
            batches = list(ids.split(args.batch_size))

            @torch.no_grad()
            def run_bare(batches: list[torch.Tensor] = batches) -> None:
                for batch in batches:
                    bare_model.model(input_ids=batch)

            run_bare()
            times: dict[str, dict[str, list[float]]] = {c: {"harvest": [], "bare": []} for c in ("cpu", "wall")}
            for round_ in range(args.rounds):
                order = [("harvest", run_harvest), ("bare", run_bare)]
                for name, fn in order if round_ % 2 == 0 else order[::-1]:
                    wall, cpu = time.perf_counter(), time.process_time()
                    fn()
                    times["cpu"][name].append(time.process_time() - cpu)
                    times["wall"][name].append(time.perf_counter() - wall)
            results[scenario] = {"hooks": hooks, "tokens": max_tokens}
            for clock, t in times.items():
                harvest_s, bare_s = statistics.median(t["harvest"]), statistics.median(t["bare"])
                per_round = sorted(h / b for h, b in zip(t["harvest"], t["bare"]))
                results[scenario][clock] = {
                    "harvest_s": harvest_s,
                    "bare_s": bare_s,
                    "ratio": harvest_s / bare_s,
                    "round_ratios": per_round,
                    "tokens_per_s": max_tokens / harvest_s,
                    "times": t,
                }
                print(
                    f"{scenario:<6} {clock:<4} harvest {harvest_s:7.3f} s  bare {bare_s:7.3f} s  "
                    f"ratio {harvest_s / bare_s:.3f}  (rounds {per_round[0]:.3f}..{per_round[-1]:.3f})  "
                    f"{max_tokens / harvest_s:,.0f} tok/s"
                )
    finally:
        hm.unwrap()
        shutil.rmtree(work, ignore_errors=True)
    if args.no_save:
        return
    meta = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "datasets": datasets.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "rounds": args.rounds,
        "contexts": args.contexts,
        "batch_size": args.batch_size,
        "context_size": args.context_size,
        "model": "llama 12 layers, hidden 768",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_harvest.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        "| scenario | hooks | clock | harvest (s) | bare HF forward of blocks 0-5 (s) | ratio | rounds | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario, r in results.items():
        for clock in ("cpu", "wall"):
            c = r[clock]
            lines.append(
                f"| {scenario} | {', '.join(f'`{h}`' for h in r['hooks'])} | {clock} | {c['harvest_s']:.3f} | "
                f"{c['bare_s']:.3f} | **{c['ratio']:.3f}** | {c['round_ratios'][0]:.3f}–"
                f"{c['round_ratios'][-1]:.3f} | {c['tokens_per_s']:,.0f} |"
            )
    (RESULTS / "bench_harvest.md").write_text(json.dumps(meta) + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
