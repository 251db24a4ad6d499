"""What the ``lensadapters`` command prints for a newcomer: a header and a stable order for ``plugins``, the model
``hooks`` shows, ``--help`` texts without reST markup."""

from __future__ import annotations

import json
import re

import pytest

from lensadapters import registry as registry_module
from lensadapters.cli import main
from lensadapters.testing import architecture_plugins, registry_with

REST_MARKUP = re.compile(r"``|:(class|func|meth|mod|data|attr|exc):`")


def test_plugins_prints_a_header_then_the_plugins_sorted_by_name(capsys, monkeypatch):
    infos = architecture_plugins()
    if len(infos) < 2:
        pytest.skip("needs two installed architecture plugins")
    # registered in reverse order: the listing must not follow the registration (entry-point) order
    monkeypatch.setattr(registry_module, "_DEFAULT", registry_with(*reversed(infos)))
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["PLUGIN", "DISTRIBUTION", "VERSION", "KIND"]
    expected = sorted(info.name for info in infos)
    assert [line.split()[0] for line in lines[1:]] == expected
    assert main(["plugins", "--json"]) == 0
    assert [row["name"] for row in json.loads(capsys.readouterr().out)["plugins"]] == expected


def test_hooks_says_which_model_it_shows(capsys, monkeypatch, tmp_path):
    infos = architecture_plugins()
    if not infos:
        pytest.skip("no architecture plugin installed")
    info = infos[0]
    arch = info.architectures[0]
    monkeypatch.setattr(registry_module, "_DEFAULT", registry_with(info))
    assert main(["hooks", arch.name]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"tiny built-in {arch.name} model" in first, first
    assert main(["hooks", arch.name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny built-in"

    from lensadapters.demo import tiny_model

    tiny_model(registry_with(info), info, arch).save_pretrained(tmp_path)
    assert main(["hooks", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"the checkpoint {tmp_path}" in first and "tiny" not in first, first


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_texts_have_no_rest_markup(capsys):
    top = _help(capsys, ["--help"])
    commands = re.search(r"\{([\w,-]+)\}", top).group(1).split(",")
    assert {"plugins", "hooks", "demo", "check", "harvest"} <= set(commands)
    for argv in [["--help"]] + [[command, "--help"] for command in commands]:
        text = _help(capsys, argv)
        assert not REST_MARKUP.search(text), f"`lensadapters {' '.join(argv)}` shows reST markup:\n{text}"
    assert "tiny built-in" in _help(capsys, ["hooks", "--help"])


def _encoder_decoders() -> list[tuple[str, str]]:
    from lensadapters.testing.plugins import installed_plugins

    return sorted(
        (info.name, arch.name)
        for info in installed_plugins()
        for arch in info.architectures
        if arch.encoder_decoder and arch.declared_for_installed_transformers()
    )


@pytest.mark.parametrize("plugin,arch", _encoder_decoders() or [pytest.param("", "", marks=pytest.mark.skip)])
def test_hooks_shows_an_encoder_decoder_both_stacks(capsys, tmp_path, plugin, arch):
    """``lensadapters hooks t5`` (or a saved T5 checkpoint) lists both stacks' points with the shapes of one call
    with ``decoder_input_ids`` (it refused encoder-decoders, or called them without decoder inputs)."""
    from lensadapters.registry import get_registry
    from lensadapters.testing.models import tiny_model

    assert main(["hooks", arch, "--json", "--length", "3"]) == 0
    shapes = json.loads(capsys.readouterr().out)["hook_points"]
    assert any(n.startswith("encoder.") for n in shapes) and any(n.startswith("decoder.") for n in shapes)
    assert all(shape is not None and shape[:2] == [1, 3] for n, shape in shapes.items() if n.endswith("resid_pre"))
    registry = get_registry()
    info = registry.infos[plugin]
    tiny_model(
        registry, info, next(a for a in info.architectures if a.name == arch), encoder_decoder=True
    ).save_pretrained(tmp_path)
    assert main(["hooks", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hook_points"].keys() == shapes.keys()
