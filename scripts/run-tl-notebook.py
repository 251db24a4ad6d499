#!/usr/bin/env python
# Over 500 lines on purpose: one command whose parts (the notebook's rewrite, the per-cell recorder, the value
# comparison, the report) make one pipeline and have no other user; the script re-runs itself (``__file__``) as
# the two per-variant worker processes, so one file is what each process runs and what a reader follows.
"""Run a TransformerLens notebook on TransformerLens and on lensadapters, and compare every value it computes.

    python scripts/run-tl-notebook.py Main_Demo.ipynb [more.ipynb ...] [--json results.json] [--cell-timeout 600]

Needs TransformerLens 2.x and lensadapters in one environment (the transformers 4.57 one). No network: every model
the notebook loads is a seeded random checkpoint of the same architecture (same layers and heads, d_head 4), saved
to a temporary folder with a byte-level BPE tokenizer trained on the notebook's own text (so its words are single
tokens, as in GPT-2's vocabulary).

The code cells run twice, each run in its own process and each cell seeded alike (``torch``, ``numpy``,
``random``):

* ``tl``: as written. ``HookedTransformer.from_pretrained(name, ...)`` builds TransformerLens' model from the local
  checkpoint without weight processing (``fold_ln=False, center_writing_weights=False, center_unembed=False``,
  whatever the cell asks).
* ``la``: with only the construction line changed: ``HookedTransformer.from_pretrained(`` (or ``..._no_processing(``)
  becomes ``HookedModel.from_pretrained(``, keywords unchanged; ``HookedModel`` is imported, and ``from_pretrained``
  is given the local checkpoint (``hf_model=``, ``tokenizer=``) in place of the hub.

After each cell the runner records what the cell computed: the variables it bound or changed in place (tensors,
arrays, numbers, strings, lists of them, activation caches entry by entry), its last expression's value, its
printed output (numbers compared within tolerance, text exactly) and every figure it shows (plotly traces'
``x``/``y``/``z`` arrays, circuitsvis calls' arguments). A cell is *equal* when the two runs agree on all of it
within ``atol = rtol = 1e-4``. Cells are *skipped*, with the reason, when they need the network (datasets,
downloads, training checkpoints), are notebook magics or shell commands only, or fail under TransformerLens itself
(usually because an earlier skipped cell defined what they use).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import tokenize
import traceback
import types
from typing import Any, Optional

ATOL = RTOL = 1e-4
MAX_ELEMENTS = 4_000_000

# --- the notebook ----------------------------------------------------------------------------------------------

NETWORK = [
    (r"\bload_dataset\(|\bget_dataset\(", "loads a dataset from the Hugging Face hub"),
    (r"requests\.|urllib|urlopen|wget|hf_hub_download|download_file", "downloads a file"),
    (r"checkpoint_index|checkpoint_value|get_checkpoint_labels", "loads training checkpoints from the hub"),
    (r"\bgradio\b|\bstreamlit\b", "starts a web app"),
]


def code_cells(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    return [
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb["cells"]
        if c["cell_type"] == "code"
    ]


def notebook_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    return "\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in nb["cells"])


def strip_magics(src: str) -> str:
    """Magics and shell lines become ``pass`` (indentation kept, so an ``if IN_COLAB:`` block stays valid)."""
    out = []
    for line in src.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            out.append(line[: len(line) - len(stripped)] + "pass")
        else:
            out.append(line)
    return "\n".join(out)


def static_skip(src: str) -> Optional[str]:
    body = [ln for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not body:
        return "empty"
    if all(ln.lstrip().startswith(("%", "!")) for ln in body):
        return "notebook magics / shell commands only"
    for pattern, reason in NETWORK:
        if re.search(pattern, src, re.MULTILINE):
            return f"needs the network: {reason}"
    try:
        ast.parse(strip_magics(src))
    except SyntaxError as e:
        return f"not Python ({e.msg})"
    return None


def port(src: str) -> str:
    """The one-line change of a port: ``HookedTransformer.from_pretrained(`` in code (not in strings or comments)
    becomes ``HookedModel.from_pretrained(``."""
    lines = src.splitlines(keepends=True)
    tokens = list(tokenize.generate_tokens(io.StringIO(src).readline))
    edits = []
    for k in range(len(tokens) - 3):
        a, dot, method, paren = tokens[k : k + 4]
        if (a.string, dot.string, paren.string) == ("HookedTransformer", ".", "(") and method.string in (
            "from_pretrained",
            "from_pretrained_no_processing",
        ):
            edits.append((a.start, method.end))
    for (row, col), (_, end_col) in reversed(edits):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + "HookedModel.from_pretrained" + line[end_col:]
    return "".join(lines)


# --- local checkpoints -----------------------------------------------------------------------------------------

# name -> (model_type, layers, heads); TransformerLens' aliases and Hugging Face names alike.
GPT2 = {"gpt2": 12, "gpt2-small": 12, "gpt2-medium": 24, "gpt2-large": 36, "gpt2-xl": 48, "distilgpt2": 6}
GPT2_HEADS = {12: 12, 24: 16, 36: 20, 48: 25, 6: 12}
PYTHIA = {"70m": (6, 8), "160m": (12, 12), "410m": (24, 16), "1b": (16, 8), "1.4b": (24, 16), "14m": (6, 4)}
VOCAB = 50257  # GPT-2's; the notebooks draw random token ids up to 10000 and more
NO_HF = re.compile(r"^(attn-only|solu|gelu|attn_only)-|^(othello|tiny-stories|redwood|stanford)")


class Unavailable(Exception):
    """A model the runner has no local stand-in for (the cell is skipped)."""


def architecture(name: str) -> tuple[str, int, int]:
    short = name.split("/")[-1].lower()
    if short in GPT2:
        layers = GPT2[short]
        return "gpt2", layers, GPT2_HEADS[layers]
    m = re.match(r"pythia-([\d.]+[mb])", short)
    if m and m.group(1) in PYTHIA:
        return ("gpt_neox", *PYTHIA[m.group(1)])
    if NO_HF.match(short):
        raise Unavailable(
            f"{name}: TransformerLens converts it from its own checkpoint; there is no Hugging Face"
            " model of its architecture to wrap"
        )
    raise Unavailable(f"{name}: the runner has no local stand-in for this model")


def model_names(notebook: str) -> list[str]:
    """The models a notebook's construction lines name literally."""
    found = re.findall(r"from_pretrained(?:_no_processing)?\(\s*[\"']([^\"']+)[\"']", "\n".join(code_cells(notebook)))
    return sorted(set(found))


def tokenizer_folder(root: str, text: str) -> str:
    folder = os.path.join(root, "tokenizer")
    if os.path.isdir(folder):
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 1,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = " ".join(re.findall(r"[A-Za-z]+", text))
    trained.train_from_iterator([text, words, words.lower()], trainer=trainer)
    spec = json.loads(trained.to_str())["model"]
    # GPT-2's id space: the learned tokens first, unused fillers up to 50255, <|endoftext|> at 50256.
    vocab = {t: i for i, t in enumerate(sorted(spec["vocab"], key=spec["vocab"].get))}
    fillers = (f"<unused{i}>" for i in range(VOCAB))
    while len(vocab) < VOCAB - 1:
        vocab.setdefault(next(fillers), len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    fast = GPT2TokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.save_pretrained(folder)
    return folder


def checkpoint(root: str, name: str) -> tuple[Any, Any]:
    """The seeded random Hugging Face model standing in for ``name`` (saved once under ``root``) and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPTNeoXConfig

    from lensadapters.testing.models import reinit

    model_type, layers, heads = architecture(name)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(root, "tokenizer"))
    folder = os.path.join(root, f"{model_type}-{layers}-{heads}")
    if not os.path.isdir(folder):
        d_model, vocab = 4 * heads, VOCAB
        if model_type == "gpt2":
            config: Any = GPT2Config(
                n_layer=layers,
                n_head=heads,
                n_embd=d_model,
                n_positions=1024,
                vocab_size=vocab,
                bos_token_id=0,
                eos_token_id=0,
            )
        else:
            config = GPTNeoXConfig(
                num_hidden_layers=layers,
                num_attention_heads=heads,
                hidden_size=d_model,
                intermediate_size=4 * d_model,
                max_position_embeddings=2048,
                vocab_size=vocab,
                rotary_pct=0.25,
                bos_token_id=0,
                eos_token_id=0,
            )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        reinit(model, sum(map(ord, os.path.basename(folder))))  # the same weights on every run
        model.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return model, tokenizer


# --- one run (a child process) ---------------------------------------------------------------------------------

FIGURES: list[Any] = []
# Plotting packages the notebooks import; where one is not installed, a stand-in records each call's arguments.
PLOTTING_PACKAGES = {
    "circuitsvis": ["attention", "tokens", "activations", "topk_tokens", "logits", "utils"],
    "pysvelte": [],
    "neel_plotly": [],
    "neel": ["plot"],
}


def _record_figure(kind: str, payload: Any) -> None:
    FIGURES.append((kind, payload))


def install_display_stubs() -> None:
    """No browser, no notebook front end: figures are recorded instead of shown."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        import plotly.basedatatypes as bdt

        def show(fig: Any, *args: Any, **kwargs: Any) -> None:
            traces = []
            for trace in fig.data:
                traces.append(
                    {k: _plain(getattr(trace, k, None)) for k in ("x", "y", "z") if getattr(trace, k, None) is not None}
                )
            _record_figure("plotly", traces)

        bdt.BaseFigure.show = show
    except ImportError:
        pass

    class Displayed:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def show_code(self) -> str:
            return ""

        def _repr_html_(self) -> str:
            return ""

    class Call:
        """A function of a plotting package that is not installed: a call records its arguments as a figure."""

        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            _record_figure(self.name, {"args": [_plain(a) for a in args], **{k: _plain(v) for k, v in kwargs.items()}})
            return Displayed()

        def __getattr__(self, attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Call(f"{self.name}.{attr}")

    class Recorder(types.ModuleType):
        def __getattr__(self, attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return sys.modules.get(f"{self.__name__}.{attr}") or Call(f"{self.__name__}.{attr}")

    for package, submodules in PLOTTING_PACKAGES.items():
        try:
            __import__(package)
        except ImportError:
            for mod in [package] + [f"{package}.{s}" for s in submodules]:
                sys.modules[mod] = Recorder(mod)
            for s in submodules:
                setattr(sys.modules[package], s, sys.modules[f"{package}.{s}"])
    try:
        import torchtyping  # noqa: F401
    except ImportError:
        torchtyping = types.ModuleType("torchtyping")

        class TensorType:
            def __class_getitem__(cls, item: Any) -> Any:
                return cls

        torchtyping.TensorType = TensorType  # type: ignore[attr-defined]
        sys.modules["torchtyping"] = torchtyping
    try:
        import IPython  # noqa: F401
    except ImportError:
        ipython = types.ModuleType("IPython")
        display = types.ModuleType("IPython.display")

        class _Shell:
            """``get_ipython()``: every attribute and call is a no-op (``ip.extension_manager.loaded``...)."""

            def __getattr__(self, attr: str) -> Any:
                return _Shell()

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                return _Shell()

            def __iter__(self) -> Any:
                return iter(())

            def __contains__(self, item: Any) -> bool:
                return False

        display.display = lambda *a, **k: _record_figure("display", [_plain(x) for x in a])  # type: ignore

        def any_display(attr: str) -> Any:  # HTML, IFrame, Markdown...
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Displayed

        display.__dict__["__getattr__"] = any_display
        ipython.display = display  # type: ignore
        ipython.get_ipython = lambda: _Shell()  # type: ignore
        sys.modules["IPython"] = ipython
        sys.modules["IPython.display"] = display


def _plain(value: Any, depth: int = 0) -> Any:
    """A picklable copy of what a value holds: tensors and arrays as CPU float64/int tensors, containers of them,
    numbers, strings; anything else as None (not compared)."""
    import numpy as np
    import torch

    if depth > 4:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() > MAX_ELEMENTS:  # a deterministic sample of the largest tensors (logits of long batches)
            flat = value.detach().reshape(-1)
            return {
                "<sample of a tensor of shape>": list(value.shape),
                "values": flat[:: flat.numel() // MAX_ELEMENTS + 1].cpu().clone(),
            }
        return value.detach().cpu().clone()
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "fiubc":
            return torch.from_numpy(value.copy())
        if value.dtype.kind in "UO":
            return [_plain(v, depth + 1) for v in value.tolist()]
        return None
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, (list, tuple)):
        if len(value) > 100_000:
            return None
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if type(value).__name__ == "ActivationCache" and hasattr(value, "keys"):
        return {"<cache>": {k: _plain(value[k], depth + 1) for k in value.keys()}}
    if type(value).__name__ == "FactoredMatrix" and hasattr(value, "A"):
        # Its product applied to a fixed random probe (AB can have billions of entries: W_E @ OV @ W_U).
        probe = torch.randn(value.B.shape[-1], 3, generator=torch.Generator().manual_seed(0), dtype=value.B.dtype)
        return {"<FactoredMatrix @ probe>": _plain(value.A @ (value.B @ probe.to(value.B.device)), depth + 1)}
    return None


def _fingerprint(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return (id(value), value._version)
    if isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    return id(value)


def _seed(i: int) -> None:
    import numpy as np
    import torch

    random.seed(i)
    np.random.seed(i)
    torch.manual_seed(i)


class CellTimeout(Exception):
    pass


def processed_transformer(model: Any, tokenizer: Any, prepend_bos: bool, kwargs: dict) -> Any:
    """TransformerLens' model of ``model`` with the weight processing ``from_pretrained`` would apply for
    ``kwargs`` (``fold_ln``, ``center_writing_weights``, ``center_unembed``, ``fold_value_biases``,
    ``refactor_factored_attn_matrices``; TransformerLens' defaults where absent)."""
    import torch
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from lensadapters.testing import tl_reference

    flags = {
        "fold_ln": kwargs.get("fold_ln", True),
        "center_writing_weights": kwargs.get("center_writing_weights", True),
        "center_unembed": kwargs.get("center_unembed", True),
        "fold_value_biases": kwargs.get("fold_value_biases", True),
        "refactor_factored_attn_matrices": kwargs.get("refactor_factored_attn_matrices", False),
    }
    fields = tl_reference._CONFIGS[model.config.model_type](model)
    if flags["fold_ln"]:
        fields["normalization_type"] += "Pre"
    fields.update(default_prepend_bos=prepend_bos, device="cpu", dtype=torch.float32)
    hooked = HookedTransformer(HookedTransformerConfig(**fields), tokenizer=tokenizer, move_to_device=False)
    hooked.load_and_process_state_dict(tl_reference._converter(model.config.model_type)(model, hooked.cfg), **flags)
    return hooked.eval()


def run_variant(notebook: str, variant: str, root: str, out: str, cell_timeout: int, reference: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(notebook)))
    install_display_stubs()
    import torch

    torch.set_num_threads(1)
    import transformer_lens

    from lensadapters import HookedModel
    from lensadapters.testing.tl_reference import hooked_transformer

    if variant == "tl":

        def tl_from_pretrained(cls: Any, model_name: str, *args: Any, **kwargs: Any) -> Any:
            model, tokenizer = checkpoint(root, model_name)
            prepend_bos = kwargs.get("default_prepend_bos", True)
            if reference == "as-written":  # the processing the call asks for (TransformerLens' defaults: all on)
                return processed_transformer(model, tokenizer, prepend_bos, kwargs)
            return hooked_transformer(model, tokenizer=tokenizer, default_prepend_bos=prepend_bos)

        transformer_lens.HookedTransformer.from_pretrained = classmethod(tl_from_pretrained)
        transformer_lens.HookedTransformer.from_pretrained_no_processing = classmethod(tl_from_pretrained)
    else:
        original = HookedModel.from_pretrained.__func__  # type: ignore[attr-defined]

        def la_from_pretrained(cls: Any, model_name: str, *args: Any, **kwargs: Any) -> Any:
            model, tokenizer = checkpoint(root, model_name)
            kwargs.setdefault("hf_model", model)
            kwargs.setdefault("tokenizer", tokenizer)
            return original(cls, model_name, *args, **kwargs)

        HookedModel.from_pretrained = classmethod(la_from_pretrained)  # type: ignore[method-assign,assignment]

    namespace: dict[str, Any] = {
        "__name__": "__main__",
        "HookedModel": HookedModel,
        "display": lambda *a, **k: _record_figure("display", [_plain(x) for x in a]),
    }
    seen: dict[str, Any] = {}
    results = []

    def on_alarm(signum: int, frame: Any) -> None:
        raise CellTimeout(f"cell ran over {cell_timeout} s")

    signal.signal(signal.SIGALRM, on_alarm)
    for i, src in enumerate(code_cells(notebook)):
        skip = static_skip(src)
        if skip:
            results.append({"skip": skip})
            continue
        code = strip_magics(src)
        code = port(code) if variant == "la" else code
        FIGURES.clear()
        buffer = io.StringIO()
        record: dict[str, Any] = {}
        _seed(1000 + i)
        tree = ast.parse(code)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        signal.alarm(cell_timeout)
        try:
            with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
                exec(compile(tree, f"<cell {i}>", "exec"), namespace)
                value = eval(compile(ast.Expression(last.value), f"<cell {i}>", "eval"), namespace) if last else None
            record["_out"] = _plain(value)
            del value
        except Unavailable as e:
            record["error"] = f"Unavailable: {e}"
        except BaseException as e:  # noqa: BLE001 - a cell may raise anything, the run goes on
            if isinstance(e, KeyboardInterrupt):
                raise
            tb = traceback.extract_tb(e.__traceback__)
            where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb)), "")
            record["error"] = f"{type(e).__name__}: {str(e)[:400]} ({where})"
        finally:
            signal.alarm(0)
        record["stdout"] = buffer.getvalue()
        record["figures"] = [(k, p) for k, p in FIGURES]
        changed = {}
        for name, value in list(namespace.items()):
            if name.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, type)):
                continue
            fp = _fingerprint(value)
            if seen.get(name) != fp:
                seen[name] = fp
                try:
                    plain = _plain(value)
                except Exception as e:  # noqa: BLE001 - a value the runner cannot read is reported, not fatal
                    plain = f"<unreadable: {type(e).__name__}>"
                if plain is not None:
                    changed[name] = plain
        record["vars"] = changed
        results.append(record)
        torch.save(results, out)
    torch.save(results, out)


# --- comparison ------------------------------------------------------------------------------------------------

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _text_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    if NUMBER.sub("#", a) != NUMBER.sub("#", b):
        return False
    for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)):
        decimals = len(x.split(".")[1].split("e")[0].split("E")[0]) if "." in x else 0
        unit = 10.0**-decimals if "e" not in x.lower() else abs(float(x)) * 1e-3
        if abs(float(x) - float(y)) > ATOL + RTOL * abs(float(y)) + unit:
            return False
    return True


def differences(a: Any, b: Any, where: str) -> list[str]:
    """Where ``a`` (TransformerLens) and ``b`` (lensadapters) differ; [] when equal within tolerance."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            if isinstance(a, (int, float)) and isinstance(b, torch.Tensor) and b.numel() == 1:
                b = b.item()
            elif isinstance(b, (int, float)) and isinstance(a, torch.Tensor) and a.numel() == 1:
                a = a.item()
            else:
                return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
            return differences(a, b, where)
        if a.shape != b.shape:
            return [f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"]
        if a.is_complex() or b.is_complex():
            a, b = a.to(torch.complex128), b.to(torch.complex128)
            if not torch.allclose(a, b, atol=ATOL, rtol=RTOL, equal_nan=True):
                return [f"{where}: max abs difference {(a - b).abs().nan_to_num().max().item():.3g}"]
            return []
        if a.is_floating_point() or b.is_floating_point():
            a, b = a.double(), b.double()
            if not torch.allclose(a, b, atol=ATOL, rtol=RTOL, equal_nan=True):
                return [
                    f"{where}: max abs difference {(a - b).abs().nan_to_num().max().item():.3g}"
                    f" (values up to {a.abs().nan_to_num().max().item():.3g})"
                ]
            return []
        return [] if torch.equal(a, b) else [f"{where}: integer values differ"]
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            if math.isnan(a) and math.isnan(b):
                return []
            return [] if abs(a - b) <= ATOL + RTOL * abs(a) else [f"{where}: {a!r} vs {b!r}"]
        return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, str) and isinstance(b, str):
        if _text_equal(a, b):
            return []
        la, lb = a.splitlines(), b.splitlines()
        k = next((k for k, (x, y) in enumerate(zip(la, lb)) if not _text_equal(x, y)), min(len(la), len(lb)))
        x, y = (la[k] if k < len(la) else "<end>"), (lb[k] if k < len(lb) else "<end>")
        return [f"{where}: text differs at line {k}: {x[:90]!r} vs {y[:90]!r}"]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        out: list[str] = []
        for k, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{where}[{k}]")
            if len(out) > 3:
                break
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        if "<cache>" in a and "<cache>" in b:
            a, b = a["<cache>"], b["<cache>"]
            missing = sorted(set(a) - set(b))
            if missing:
                out.append(f"{where}: cache lacks {len(missing)} of TransformerLens' keys ({missing[0]}...)")
        elif set(a) != set(b):
            return [f"{where}: keys differ ({sorted(set(a) ^ set(b))[:3]})"]
        for k in a:
            if k in b:
                out += differences(a[k], b[k], f"{where}[{k!r}]")
                if len(out) > 3:
                    break
        return out
    if a is None or b is None:
        return [] if a is b else [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"[:200]]


def compare(notebook: str, tl: list[dict], la: list[dict]) -> dict[str, Any]:
    cells = code_cells(notebook)
    report: dict[str, Any] = {
        "notebook": os.path.basename(notebook),
        "cells": len(cells),
        "run": 0,
        "equal": 0,
        "values": 0,
        "skipped": [],
        "failed": [],
        "differ": [],
    }
    for i, (src, a, b) in enumerate(zip(cells, tl, la)):
        first = src.strip().splitlines()[0][:70] if src.strip() else ""
        if "skip" in a:
            report["skipped"].append({"cell": i, "line": first, "why": a["skip"]})
            continue
        if "error" in a:
            report["skipped"].append({"cell": i, "line": first, "why": f"fails under TransformerLens: {a['error']}"})
            continue
        report["run"] += 1
        if "error" in b:
            report["failed"].append({"cell": i, "line": first, "error": b["error"]})
            continue
        report["values"] += len(a["vars"]) + len(a["figures"]) + bool(a["stdout"]) + (a["_out"] is not None)
        diffs = differences(a["stdout"], b["stdout"], "printed")
        diffs += differences(a["_out"], b["_out"], "output")
        diffs += differences([p for _, p in a["figures"]], [p for _, p in b["figures"]], "figures")
        for name, value in a["vars"].items():
            if name not in b["vars"]:
                diffs.append(f"{name}: not set or changed by the port")
            else:
                diffs += differences(value, b["vars"][name], name)
        if diffs:
            report["differ"].append({"cell": i, "line": first, "diffs": diffs[:8]})
        else:
            report["equal"] += 1
    return report


def print_report(report: dict[str, Any]) -> None:
    print(
        f"\n== {report['notebook']}: {report['cells']} code cells, {report['run']} run, {report['equal']} equal, "
        f"{len(report['differ'])} differ, {len(report['failed'])} fail on lensadapters, "
        f"{len(report['skipped'])} skipped; {report['values']} values compared (variables, figures, outputs)"
    )
    for item in report["skipped"]:
        print(f"  skipped cell {item['cell']} ({item['line']!r}): {item['why']}")
    for item in report["failed"]:
        print(f"  FAILS   cell {item['cell']} ({item['line']!r}): {item['error']}")
    for item in report["differ"]:
        print(f"  DIFFERS cell {item['cell']} ({item['line']!r}):")
        for d in item["diffs"]:
            print(f"      {d}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--json", help="write the reports here")
    parser.add_argument("--cell-timeout", type=int, default=600)
    parser.add_argument(
        "--reference",
        choices=["no-processing", "as-written"],
        default="no-processing",
        help="TransformerLens' model without weight processing (default), or with the processing the construction"
        " call asks for (its fold_ln, center_writing_weights... keywords, TransformerLens' defaults elsewhere)",
    )
    parser.add_argument("--variant", choices=["tl", "la"], help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        run_variant(args.notebooks[0], args.variant, args.root, args.out, args.cell_timeout, args.reference)
        return 0
    import torch

    reports = []
    for notebook in args.notebooks:
        with tempfile.TemporaryDirectory(prefix="tl-notebook-") as root:
            tokenizer_folder(root, notebook_text(notebook))
            for name in model_names(notebook):  # saved before the two runs start side by side
                with contextlib.suppress(Unavailable):
                    checkpoint(root, name)
            children = {
                variant: subprocess.Popen(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        notebook,
                        "--variant",
                        variant,
                        "--root",
                        root,
                        "--out",
                        os.path.join(root, f"{variant}.pt"),
                        "--cell-timeout",
                        str(args.cell_timeout),
                        "--reference",
                        args.reference,
                    ]
                )
                for variant in ("tl", "la")
            }
            runs = {}
            for variant, child in children.items():
                child.wait()
                out = os.path.join(root, f"{variant}.pt")
                runs[variant] = torch.load(out, weights_only=False) if os.path.exists(out) else []
            n = len(code_cells(notebook))
            for results in runs.values():
                results += [{"error": "the run stopped before this cell"}] * (n - len(results))
            report = compare(notebook, runs["tl"], runs["la"])
        print_report(report)
        reports.append(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0 if all(not r["failed"] and not r["differ"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
