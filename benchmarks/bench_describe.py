"""What the automatic description costs at wrap time, with its verification batched and one point at a time.

A model no plugin claims is described from one probe pass and then every point of a representative layer of each
kind (and of the embedding and the final norm) is verified against plain PyTorch (README, "Any other decoder-only
model"). The verification checks ``lensadapters.adapters.generic.verify.POINTS_PER_PASS`` points per forward pass,
each edited in its own copy of the probe input; ``--per-pass 1`` is the one-at-a-time check it replaced (two
passes per point). This times ``HookedModel.wrap`` of a randomly initialised model of ``--model-type`` at the
given shape both ways, side by side in one process, with one plain forward pass of the probe's length for scale.

    python benchmarks/bench_describe.py [--model-type helium] [--layers 16] [--width 2048] [--device cpu|cuda]
                                        [--dtype float32|bfloat16] [--threads N] [--rounds 1]

Results: a table on stdout, ``benchmarks/results/bench_describe.{json,md}`` (the device in the file names when it
is not the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import torch
from results_files import device_name, save
from transformers import AutoConfig, AutoModelForCausalLM

from lensadapters import HookedModel
from lensadapters.adapters.generic import verify
from lensadapters.adapters.generic.probe import PROBE_LENGTH


def build(args: argparse.Namespace) -> Any:
    heads = max(args.width // 128, 1)
    config = AutoConfig.for_model(
        args.model_type,
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=args.width * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=args.width // heads,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).to(args.device).eval()


def seconds(fn: Any, rounds: int, device: str) -> float:
    def once() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return statistics.median(once() for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", default="helium")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    model = build(args)
    parameters = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, args.vocab, (1, PROBE_LENGTH), device=args.device)
    with torch.no_grad():
        forward = seconds(lambda: model(ids), max(args.rounds, 3), args.device)
    served: dict[int, int] = {}

    def wrap(per_pass: int) -> None:
        saved = verify.POINTS_PER_PASS
        verify.POINTS_PER_PASS = per_pass
        try:
            hm = HookedModel.wrap(model, adapter="generic")
            served[per_pass] = len(hm.hook_names)
            hm.unwrap()
        finally:
            verify.POINTS_PER_PASS = saved

    batched_per_pass = verify.POINTS_PER_PASS
    one = seconds(lambda: wrap(1), args.rounds, args.device)
    batched = seconds(lambda: wrap(batched_per_pass), args.rounds, args.device)
    assert served[1] == served[batched_per_pass], served
    device = device_name(args.device)
    row = {
        "model_type": args.model_type,
        "parameters": parameters,
        "layers": args.layers,
        "width": args.width,
        "dtype": args.dtype,
        "points_served": served[1],
        "forward_s": round(forward, 3),
        "wrap_one_at_a_time_s": round(one, 2),
        "wrap_batched_s": round(batched, 2),
        "points_per_pass": batched_per_pass,
        "speedup": round(one / batched, 2),
        "batched_in_forwards": round(batched / forward, 1),
    }
    lines = [
        f"Wrap of an automatically described {args.model_type} ({parameters / 1e9:.2f}B parameters, {args.layers} "
        f"layers, width {args.width}, {args.dtype}; {args.device}: {device}, torch {torch.__version__}, "
        f"{args.threads} thread(s))",
        "",
        "| points served | one forward (s) | wrap, one point a pass (s) | wrap, batched (s) | speedup | "
        "batched wrap in forwards |",
        "|---|---|---|---|---|---|",
        f"| {row['points_served']} | {row['forward_s']} | {row['wrap_one_at_a_time_s']} | {row['wrap_batched_s']} "
        f"| {row['speedup']}x | {row['batched_in_forwards']} |",
    ]
    save("bench_describe", args.device, args.threads, args.rounds, [row], lines)


if __name__ == "__main__":
    main()
