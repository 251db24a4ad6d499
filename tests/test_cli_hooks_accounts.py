"""``lensadapters hooks`` says, per point of an automatically described model, where the wrap-time probe verified
its value and edit: and that place holds the point's value (a plain PyTorch hook on the named module reads it)."""

from __future__ import annotations

import contextlib
import io
import json
import re

import torch

from lensadapters import HookedModel
from lensadapters.cli import _load_for_hooks as load_for_hooks
from lensadapters.cli import main


def _hooks_json(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["hooks", *args, "--json"]) == 0
    return json.loads(out.getvalue())


def test_hooks_names_where_each_point_of_an_automatic_description_was_verified() -> None:
    shown = _hooks_json("--adapter", "generic", "llama")
    accounts = shown["verified_against"]
    assert set(accounts) == set(shown["hook_points"])
    assert accounts["blocks.0.mlp.hook_post"] == "the input of model.layers.0.mlp.down_proj"
    assert accounts["blocks.1.attn.hook_pattern"] == "the attention weights of layer 1's attention function"
    module_accounts = {n: a for n, a in accounts.items() if a and re.fullmatch(r"the (input|output) of [\w.]+", a)}
    assert len(module_accounts) >= 20, module_accounts
    # each named module's input or output, read with a plain PyTorch hook, is the point's value
    model, registry, _ = load_for_hooks("llama")
    hm = HookedModel.wrap(model, adapter="generic", registry=registry)
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    plain: dict[str, torch.Tensor] = {}
    handles = []
    for name, account in module_accounts.items():
        side, path = account.split(" of ")[0].removeprefix("the "), account.split(" of ")[1]
        module = model.get_submodule(path)

        def read(mod, args, kwargs, output=None, name=name, side=side):  # noqa: ANN001, ANN202
            value = output if side == "output" else (args[0] if args else kwargs["hidden_states"])
            plain[name] = (value[0] if isinstance(value, tuple) else value).detach().clone()

        if side == "input":
            handles.append(module.register_forward_pre_hook(read, with_kwargs=True))
        else:
            handles.append(
                module.register_forward_hook(lambda m, a, k, o, read=read: read(m, a, k, o), with_kwargs=True)
            )
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=list(module_accounts))
    for handle in handles:
        handle.remove()
    hm.unwrap()
    for name in module_accounts:
        ours, theirs = cache[name], plain[name]
        assert torch.equal(ours.reshape(theirs.shape), theirs), f"{name}: {accounts[name]} is not its value"


def test_hooks_gives_no_account_for_a_plugin_served_model() -> None:
    shown = _hooks_json("llama")
    assert "verified_against" not in shown and shown["adapter"] == "llama"
