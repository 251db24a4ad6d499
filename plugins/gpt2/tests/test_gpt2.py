"""GPT-2: the contract suite over random tiny configs, plus GPT-2's own quirks."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lensadapters_gpt2.testing import GPT2Contract, gpt2_configs
from transformers import GPT2Config

from lensadapters.testing import assert_close


class TestGPT2(GPT2Contract):
    """The plugin's contract suite (``lensadapters_gpt2.testing``, also run by ``lensadapters check gpt2``)."""


@settings(deadline=None)
@given(config=gpt2_configs(), seed=st.integers(0, 1000))
def test_fused_qkv_split_matches_c_attn_columns(config, seed):
    """hook_q/k/v are the [q | k | v] thirds of c_attn's output, head by head."""
    contract = TestGPT2()
    model = contract.make_model(config, seed)
    hm = contract.wrap(model)
    ids = torch.randint(0, config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(seed))
    fused = {}
    handle = model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, a, o: fused.setdefault("out", o))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0.attn.hook_"))
    handle.remove()
    d = config.n_embd
    for i, name in enumerate("qkv"):
        expected = fused["out"][..., i * d : (i + 1) * d].unflatten(-1, (config.n_head, -1))
        assert torch.equal(cache[name, 0], expected)
    hm.unwrap()


def test_live_weights_follow_parameter_changes():
    contract = TestGPT2()
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=16)
    model = contract.make_model(config, 0)
    hm = contract.wrap(model)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[:, :8].mul_(3)
    assert_close(
        hm.W_Q[0],
        model.transformer.h[0].attn.c_attn.weight[:, :8].unflatten(-1, (2, 4)).permute(1, 0, 2),
        "W_Q after an in-place update",
    )
    hm.unwrap()
