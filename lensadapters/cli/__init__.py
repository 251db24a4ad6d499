"""The ``lensadapters`` command: ``plugins``, ``hooks``, ``demo``, ``check``, ``harvest``.

``--help`` texts are plain text (a terminal shows no reST markup)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import warnings
from typing import Any, Optional, Sequence

from lensadapters.adapters.registry import get_registry


def _plugins(args: argparse.Namespace) -> int:
    registry = get_registry()
    rows = []
    for info in sorted(registry.infos.values(), key=lambda info: info.name):
        rows.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "source": info.source,
                "architectures": [
                    {"name": a.name, "model_types": list(a.model_types), "transformers": a.transformers}
                    for a in info.architectures
                ],
                "kind": "architecture" if info.architectures else "cross-cutting",
            }
        )
    for key, message in sorted(registry.failures.items()):  # listed too, with why they are not used
        name, distribution, version = registry.failed.get(key, (key, None, None))
        rows.append(
            {
                "name": name,
                "distribution": distribution,
                "version": version,
                "source": "entry point",
                "architectures": [],
                "kind": "failed",
                "error": message,
            }
        )
    conflicts = registry.conflicts()
    if args.json:
        print(json.dumps({"plugins": rows, "failures": registry.failures, "conflicts": conflicts}, indent=2))
        return 0
    if not rows:
        print("No lensadapters plugins installed. Try: pip install lensadapters[all]")
    else:
        print(f"{'PLUGIN':<12} {'DISTRIBUTION':<24} {'VERSION':<8} {'KIND':<14} ARCHITECTURES (MODEL TYPES)")
    for row in rows:
        archs = ", ".join(f"{a['name']} ({'/'.join(a['model_types'])})" for a in row["architectures"]) or "-"
        if row["kind"] == "failed":
            archs = "not loaded (see below)"
        print(
            f"{row['name']:<12} {row['distribution'] or ('?' if row['kind'] == 'failed' else '(not installed)'):<24} "
            f"{row['version'] or '':<8} "
            f"{row['kind']:<14} {archs}"
        )
    for message in registry.failures.values():
        print(f"! {message}")
    for model_type, names in conflicts.items():
        print(
            f"! model_type {model_type!r} is claimed by {', '.join(names)}: choose with HookedModel.wrap(..., adapter=)"
        )
    return 0


def _from_checkpoint(directory: str) -> Any:
    """The checkpoint's causal LM; where its config has none, its sequence-to-sequence or masked LM (an encoder:
    ModernBERT); otherwise transformers' own error for the causal LM, which names the problem. An encoder-decoder's
    checkpoint (``is_encoder_decoder``) is its sequence-to-sequence LM first: BART's family also has a causal LM, the
    decoder alone, which would load without the encoder's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    first: Optional[ValueError] = None
    autos = [AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForMaskedLM]
    if getattr(AutoConfig.from_pretrained(directory, local_files_only=True), "is_encoder_decoder", False):
        autos.insert(0, autos.pop(1))
    for auto in autos:
        try:
            return auto.from_pretrained(directory, local_files_only=True)
        except ValueError as error:  # "Unrecognized configuration class": no such head for this config
            first = first or error
    assert first is not None
    raise first


def _load_for_hooks(target: str) -> tuple[Any, Any, Optional[str]]:
    """The model ``hooks`` shows, its registry and, for a built-in tiny model, the architecture's name."""
    registry = get_registry()
    if os.path.isdir(target):
        return _from_checkpoint(target).eval(), registry, None
    from lensadapters.testing.models import tiny_model

    for info in registry.architecture_plugins():
        for arch in info.architectures:
            if target in (arch.name, info.name) or target in arch.model_types:
                return tiny_model(registry, info, arch, encoder_decoder=True), registry, arch.name
    raise SystemExit(
        f"{target!r} is neither a checkpoint directory nor an installed architecture. {registry.describe_installed()}"
    )


def _hooks(args: argparse.Namespace) -> int:
    import torch

    from lensadapters.adapters.generic import GenericAdapterWarning, summary
    from lensadapters.api.hooked_model import HookedModel
    from lensadapters.errors import UnsupportedModelError

    model, registry, tiny = _load_for_hooks(args.target)
    source = f"a tiny built-in {tiny} model (random weights)" if tiny else f"the checkpoint {args.target}"
    with warnings.catch_warnings():  # the generic adapter's account is printed below instead
        warnings.simplefilter("ignore", GenericAdapterWarning)
        hm = HookedModel.wrap(model, adapter=args.adapter, registry=registry)
    note = summary(hm.wiring, fallback=args.adapter is None) if hm.plugin is registry.generic else None
    ids = torch.zeros(1, args.length, dtype=torch.long)
    # an encoder-decoder's decoder reads the same number of positions as its encoder here
    inputs: dict[str, Any] = {"decoder_input_ids": ids} if getattr(model.config, "is_encoder_decoder", False) else {}
    with torch.no_grad():
        try:
            _, cache = hm.run_with_cache(input_ids=ids, **inputs, names_filter=lambda n: True)
        except UnsupportedModelError as exc:  # patterns refused under this attention implementation: the rest
            print(f"note: {exc}", file=sys.stderr)
            _, cache = hm.run_with_cache(
                input_ids=ids, **inputs, names_filter=lambda n: not n.endswith(("hook_pattern", "hook_attn_scores"))
            )
    shapes = {name: list(cache[name].shape) if name in cache else None for name in hm.hook_names}
    accounts = _verified_against(hm) if note else {}
    hm.unwrap()
    if args.json:
        print(
            json.dumps(
                {
                    "adapter": hm.arch.name,
                    "model": "tiny built-in" if tiny else args.target,
                    "batch": 1,
                    "positions": args.length,
                    "hook_points": shapes,
                    **({"generic": note, "verified_against": accounts} if note else {}),
                },
                indent=2,
            )
        )
        return 0
    adapter = "generic adapter" if note else hm.arch.name
    print(f"{adapter}: {len(shapes)} hook points of {source}; shapes for batch 1, {args.length} positions")
    if any(accounts.values()):
        print(
            "  (after the shape: what the wrap-time probe verified the point's value and edit against; a layer of the "
            "same class and description as an earlier one shares that one's check, the last layer is checked itself)"
        )
    for name, shape in shapes.items():
        line = f"  {name:<40} {str(tuple(shape)) if shape is not None else '(not run)':<20}"
        account = accounts.get(name)
        print(f"{line} {account}".rstrip() if account else line.rstrip())
    if note:
        print(textwrap.fill(note[0].upper() + note[1:], width=100))
    return 0


def _verified_against(hm: Any) -> dict[str, Optional[str]]:
    """Per point of a generic wrap: the plain-PyTorch place its value and edit were verified against at wrap time
    (``None``: served by the probe's structural proof or a check of its own, with no single place to name)."""
    from lensadapters.adapters.generic.accounts import verified_against

    return {name: verified_against(hm.wiring, name) for name in hm.hook_names}


def _demo(args: argparse.Namespace) -> int:
    from lensadapters.cli.demo import run

    results = run(plot=args.plot)
    return 0 if results and all(r.bitwise for r in results) else 1


def _same_named(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The options ``names`` as keyword arguments of the same names."""
    return {name: getattr(args, name) for name in names}


def _check(args: argparse.Namespace) -> int:
    from lensadapters.testing.check import run

    variants = list(args.variant or []) + [v for v in args.variant_flags if getattr(args, f"variant_{v}")]
    same = _same_named(args, "examples", "keyword", "seed", "exitfirst", "verbose", "pytest_args")
    return run(args.plugin, shrink=not args.no_shrink, variants=variants, **same)


def _harvest(args: argparse.Namespace) -> int:
    import torch

    from lensadapters.api.hooked_model import HookedModel
    from lensadapters.errors import LensAdaptersError
    from lensadapters.hooks.distributed import launch_rank, local_device
    from lensadapters.integrations.harvest import harvest

    dtype = "auto" if args.model_dtype == "auto" else getattr(torch, args.model_dtype)
    rank, world_size = launch_rank()
    try:
        hm = HookedModel.from_pretrained(
            args.model_dir, adapter=args.adapter, dtype=dtype, local_files_only=True, _hf_defaults=True
        )
    except LensAdaptersError as exc:
        return _failed("harvest", exc)
    hm.hf_model.eval()
    hm.hf_model.to(torch.device(args.device) if args.device else local_device())
    try:
        same = _same_named(
            args, "context_size", "batch_size", "max_tokens", "dtype", "drop_bos", "flatten", "text_column", "split"
        )
        result = harvest(
            hm,
            args.data,
            args.hooks,
            args.out,
            prepend_bos=not args.no_prepend_bos,
            shard_contexts=args.shard_contexts,
            progress=not args.quiet and rank == 0,
            rank=rank,
            world_size=world_size,
            **same,
        )
    except LensAdaptersError as exc:  # a refusal that names the problem and the fix: no traceback
        return _failed("harvest", exc)
    finally:
        hm.unwrap()
    resumed = f", resumed after {result.resumed_from} contexts" if result.resumed_from else ""
    who = f"rank {rank} of {world_size}: " if world_size > 1 else ""
    read = f"read it with datasets.load_from_disk({result.out!r})"
    if world_size > 1 and not result.all_finished:
        read = "the dataset lists every rank's complete shards so far; it is whole once every rank has finished"
    print(
        f"{who}{result.out}: {result.contexts} contexts ({result.tokens} tokens) in {result.shards} shards{resumed}; "
        f"{read}"
    )
    return 0


def _failed(command: str, error: BaseException) -> int:
    """Print a refusal (a lensadapters error, whose message names the problem and the fix) and return exit status 2."""
    print(f"lensadapters {command}: error: {error}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lensadapters",
        description="Hook points of Hugging Face models: the installed plugins, a model's hook points, a demo, "
        "a plugin's contract suite, activation harvesting.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="installed plugins, their distributions and architectures")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_plugins)
    p = sub.add_parser(
        "hooks",
        help="hook names and shapes of a checkpoint directory, or of a tiny built-in model of an architecture",
        description="List every hook point with its shape for one input of batch 1. TARGET is a local checkpoint "
        "directory, or an installed architecture's name (gpt2, llama, ...): then the model shown is a tiny built-in "
        "one (the plugin's test config with random weights), so the names are those of any model of that "
        "architecture and the shapes follow the tiny config.",
    )
    p.add_argument(
        "target",
        help="a local checkpoint directory, or an architecture name (gpt2, llama, ...) for a tiny built-in model",
    )
    p.add_argument("--adapter", default=None, help="force a plugin by name ('generic': the generic adapter)")
    p.add_argument("--length", type=int, default=4, help="positions of the probe input")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_hooks)
    p = sub.add_parser(
        "demo",
        help="wrap tiny models of every installed architecture, cache and patch; train a tiny "
        "model until it forms induction heads, find and confirm them",
    )
    p.add_argument(
        "--plot",
        nargs="?",
        const="induction_heads.png",
        default=None,
        metavar="PNG",
        help="write the induction head's attention pattern to PNG (default induction_heads.png; needs "
        "matplotlib: pip install lensadapters[plot])",
    )
    p.set_defaults(func=_demo)
    p = sub.add_parser(
        "check",
        help="run the contract suite against a plugin (needs lensadapters[testing])",
        description="Run the adapter contract suite against a plugin through pytest: the AdapterContract "
        "subclass the plugin declares as LENSADAPTERS_CONTRACT, or one generated from its "
        "lensadapters_tiny_config. Exit status: pytest's (0 when every property holds).",
    )
    p.add_argument(
        "plugin",
        help="an installed plugin (entry-point name, architecture or model type), or an importable plugin module",
    )
    p.add_argument("--examples", type=int, default=10, help="Hypothesis examples per property (default 10)")
    p.add_argument("-k", dest="keyword", default=None, help="only properties matching this pytest -k expression")
    p.add_argument("--seed", type=int, default=None, help="Hypothesis seed, for a reproducible run")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing property")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per property")
    p.add_argument(
        "--no-shrink",
        action="store_true",
        help="report a failing example as found instead of shrinking it to a minimal one (faster)",
    )
    p.add_argument(
        "--variant",
        action="append",
        metavar="NAME",
        help="run a variant of the suite (declared by an installed plugin) instead; repeatable",
    )
    check = p
    p = sub.add_parser(
        "harvest",
        help="write hook points' activations over a text dataset to disk (resumable)",
        description="Run a local checkpoint over text packed into fixed-length contexts (as SAELens packs it) and "
        "write the activations of the named hook points in shards; datasets.load_from_disk(OUT) reads "
        "them, one row per context. Run the same command again to resume after an interruption. "
        "Under torchrun or accelerate launch each process harvests its own shards into OUT (resumable "
        "per process) and OUT lists the union: the single process's dataset.",
    )
    p.add_argument("model_dir", help="a local checkpoint folder (model and tokenizer)")
    p.add_argument(
        "--data",
        required=True,
        help="a text file (one row per line), a JSONL file or a dataset folder "
        "saved with datasets' save_to_disk (text, or token ids: "
        "input_ids/tokens, one context per row)",
    )
    p.add_argument("--hooks", nargs="+", required=True, metavar="NAME", help="hook points to store")
    p.add_argument("--out", required=True, help="output folder (new, or a harvest of the same command to resume)")
    p.add_argument("--context-size", type=int, default=128, help="tokens per context (default 128)")
    p.add_argument("--batch-size", type=int, default=8, help="contexts per forward (default 8)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens (whole contexts)")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="dtype of the stored activations (bfloat16 is stored exactly as float32)",
    )
    p.add_argument(
        "--model-dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="dtype to load the model in (default: as saved)",
    )
    p.add_argument("--drop-bos", action="store_true", help="leave out position 0 (each context's BOS token)")
    p.add_argument("--no-prepend-bos", action="store_true", help="do not start each context with BOS")
    p.add_argument(
        "--flatten",
        action="store_true",
        help="store every point as [context, d] (per-head points flattened: SAELens' 2-D layout)",
    )
    p.add_argument("--text-column", default="text", help="text field of JSONL rows / dataset column (default text)")
    p.add_argument("--split", default=None, help="split of a saved DatasetDict (default train)")
    p.add_argument(
        "--shard-contexts",
        type=int,
        default=None,
        help="contexts per shard, the unit of resumption (default: about 256 MiB per shard)",
    )
    p.add_argument("--adapter", default=None, help="force a plugin by name")
    p.add_argument(
        "--device",
        default=None,
        help="where the model runs (default: this process's GPU -- cuda:LOCAL_RANK under a launcher -- "
        "if there is one, else the CPU)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_harvest)
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # `lensadapters check PLUGIN ... -- PYTEST ARGS`
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    flags = _variant_flags(check) if "check" in argv else []
    check.set_defaults(func=_check, variant_flags=flags)
    check.epilog = "Arguments after -- go to pytest unchanged (e.g. -- --tb=short)."
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if args.command == "check" and all(u.startswith("--") for u in unknown):
            offered = ", ".join(f"--{name}" for name in flags) or "none"
            print(
                f"lensadapters check: no installed plugin declares the contract variant(s) "
                f"{', '.join(u[2:] for u in unknown)} (installed variants: {offered}). Variants come from "
                f"cross-cutting plugins: install the one that provides it."
            )
            return 4
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra and args.command != "check":
        parser.error(f"arguments after -- are only for `check`: {' '.join(extra)}")
    args.pytest_args = extra
    return args.func(args)


def _variant_flags(check: argparse.ArgumentParser) -> list[str]:
    """``--NAME`` for each contract variant an installed plugin declares (``lensadapters_contract_variants``)."""
    from lensadapters.adapters.variants import contract_variants

    names = []
    for name, variant in contract_variants().items():
        try:
            check.add_argument(
                f"--{name}",
                action="store_true",
                dest=f"variant_{name}",
                help=f"run the suite on {variant.runs_on} instead "
                f"(from {variant.distribution or 'an installed plugin'})",
            )
        except argparse.ArgumentError:  # a variant named like one of check's own options
            continue
        names.append(name)
    return names
