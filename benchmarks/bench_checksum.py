"""What a harvest's resume check costs: the checksum of a model's weights (``lensadapters.harvest.checksum``).

A harvest records a checksum of every byte of every parameter and buffer when it starts, and recomputes them when
it is resumed (see the README's Harvesting section). This times ``tensor_checksum`` over a set of random tensors of
the shapes of a 7B Llama layer (4096 x 4096 attention projections, 11008 x 4096 MLP projections), in bfloat16 and in
float32, on the chosen device, and extrapolates to the 6.74e9 parameters of Llama-2-7B (bytes / measured rate: the
checksum streams the bytes once, so its time is proportional to their number). Each set is timed ``--rounds`` times
after one warm-up round; the median is reported.

    python benchmarks/bench_checksum.py [--gigabytes 1.5] [--device cpu|cuda] [--threads N] [--rounds 3]

Results: a table on stdout, ``benchmarks/results/bench_checksum.{json,md}`` (the device in the file names when it is
not the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results_files import device_name, save

from lensadapters.harvest.checksum import tensor_checksum

PARAMETERS_7B = 6.74e9
SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 3  # one Llama-2-7B layer's projections


def tensors(gigabytes: float, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    out, total, size = [], 0, torch.empty((), dtype=dtype).element_size()
    while total < gigabytes * 1e9:
        for shape in SHAPES:
            out.append(torch.randn(shape, generator=generator).to(dtype).to(device))
            total += out[-1].numel() * size
            if total >= gigabytes * 1e9:
                break
    return out


def timed(values: list[torch.Tensor], rounds: int) -> float:
    def once() -> float:
        if values[0].is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for value in values:
            tensor_checksum(value)  # returns a string: the device has finished
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        values = tensors(args.gigabytes, dtype, args.device)
        size = sum(v.numel() * v.element_size() for v in values)
        seconds = timed(values, args.rounds)
        rate = size / seconds
        bytes_7b = PARAMETERS_7B * values[0].element_size()
        rows.append(
            {
                "dtype": str(dtype).replace("torch.", ""),
                "gigabytes": round(size / 1e9, 3),
                "seconds": round(seconds, 3),
                "gb_per_s": round(rate / 1e9, 2),
                "seconds_7b": round(bytes_7b / rate, 1),
            }
        )
        del values
    device = device_name(args.device)
    lines = [
        f"Checksum of random tensors ({args.device}: {device}, torch {torch.__version__}, {args.threads} thread(s), "
        f"median of {args.rounds} rounds)",
        "",
        "| dtype | GB | seconds | GB/s | 7B parameters (s, extrapolated) |",
        "|---|---|---|---|---|",
        *(f"| {r['dtype']} | {r['gigabytes']} | {r['seconds']} | {r['gb_per_s']} | {r['seconds_7b']} |" for r in rows),
    ]
    save("bench_checksum", args.device, args.threads, args.rounds, rows, lines)


if __name__ == "__main__":
    main()
