"""Shared by the tests of TransformerLens code ported by changing the model-construction line: the tiny GPT-2 and
Llama models (``tiny_model``), the model a port builds (``ported``), and TransformerLens-idiom analysis code
(``analysis``, one function run unchanged on both libraries) with the comparison of its values (``compare``)."""

from __future__ import annotations

import contextlib
import functools
import io
from typing import Any, Iterator

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.adapters.toy_configs import tiny_config_of
from lensadapters.testing.models import reinit
from lensadapters.testing.tl_reference import transformer_lens_available, word_tokenizer

VOCAB = 32
TOL = 1e-4
needs_tl = pytest.mark.skipif(
    not transformer_lens_available(),
    reason="TransformerLens 2.x is not installed (CI's transformers-4.57 environment has it)",
)


def tiny_config(model_type: str) -> Any:
    from transformers import GPT2Config, LlamaConfig

    if model_type == "gpt2":
        return tiny_config_of(GPT2Config, hidden=8, heads=2, vocab=VOCAB, positions=32)
    return tiny_config_of(LlamaConfig, hidden=16, d_mlp=24, vocab=VOCAB, positions=32)


@functools.lru_cache(maxsize=None)
def port_tokenizer() -> Any:
    return word_tokenizer(VOCAB)


def tiny_model(model_type: str = "gpt2", seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="eager").eval()
    reinit(model, seed)
    return model


@contextlib.contextmanager
def ported(model_type: str = "gpt2", seed: int = 0) -> Iterator[HookedModel]:
    """The model a port builds: ``HookedModel.from_pretrained`` (here with TransformerLens' ``hf_model=``)."""
    hm = HookedModel.from_pretrained(
        model_type, hf_model=tiny_model(model_type, seed), tokenizer=port_tokenizer(), device="cpu"
    )
    try:
        yield hm
    finally:
        hm.unwrap()


TOKENS = torch.tensor([[1, 5, 6, 7, 8, 9, 5, 6]])


def analysis(model: Any, utils: Any, ActivationCache: Any, detect_head: Any) -> dict[str, Any]:
    """Analysis code as written for TransformerLens 2.x (only the objects passed in differ)."""
    results: dict[str, Any] = {}
    clean = model.to_tokens(["w5 w6 w7 w8 w9 w5 w6 w7", "w10 w11 w12 w13 w14 w10 w11 w12"])
    corrupted = model.to_tokens(["w5 w6 w7 w8 w9 w5 w6 w9", "w10 w11 w12 w13 w14 w10 w11 w14"])
    answers = torch.tensor([[model.to_single_token("w8"), model.to_single_token("w9")], [13, 14]])

    def logit_diff(logits: torch.Tensor) -> torch.Tensor:
        final = logits[:, -1, :]
        return (final.gather(-1, answers[:, :1]) - final.gather(-1, answers[:, 1:])).mean()

    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean)
        corrupted_logits = model(corrupted)
    results["clean logit diff"] = logit_diff(clean_logits)
    results["corrupted logit diff"] = logit_diff(corrupted_logits)
    results["logits of one sequence"] = model(clean[0])
    # direct logit attribution of each head (no norm folding on either side: the raw head outputs)
    directions = model.tokens_to_residual_directions(answers[:, 0]) - model.tokens_to_residual_directions(answers[:, 1])
    per_head, labels = clean_cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    results["head labels"] = labels
    results["head DLA"] = (per_head * directions).sum(-1).mean(-1)
    accumulated = clean_cache.accumulated_resid(layer=-1, pos_slice=-1)
    results["accumulated resid"] = accumulated
    results["embed component"] = model.embed(clean)
    results["final norm"] = model.ln_final(clean_cache["resid_post", 1])
    results["unembed of final norm"] = model.unembed(clean_cache["ln_final.hook_normalized"])
    results["loss_fn"] = model.loss_fn(clean_logits, clean)
    results["W_Q of block 1"] = model.blocks[1].attn.W_Q
    results["W_out of block 0"] = model.blocks[0].mlp.W_out

    # activation patching of the residual stream, position by position
    def patch_resid(resid: torch.Tensor, hook: Any, position: int) -> torch.Tensor:
        resid[:, position] = clean_cache[hook.name][:, position]
        return resid

    patched = torch.zeros(model.cfg.n_layers, clean.shape[1])
    for layer in range(model.cfg.n_layers):
        for position in range(clean.shape[1]):
            hook_fn = functools.partial(patch_resid, position=position)
            with torch.no_grad():
                logits = model.run_with_hooks(corrupted, fwd_hooks=[(utils.get_act_name("resid_pre", layer), hook_fn)])
            patched[layer, position] = logit_diff(logits)
    results["activation patching"] = patched

    # attribution patching (forward and backward caches via add_hook)
    def resid_filter(name: str) -> bool:
        return name.endswith("resid_pre")

    def get_cache_fwd_and_bwd(tokens: torch.Tensor) -> tuple:
        model.reset_hooks()
        cache, grad_cache = {}, {}

        def forward_cache_hook(act: torch.Tensor, hook: Any) -> None:
            cache[hook.name] = act.detach()

        def backward_cache_hook(act: torch.Tensor, hook: Any) -> None:
            grad_cache[hook.name] = act.detach()

        model.add_hook(resid_filter, forward_cache_hook, "fwd")
        model.add_hook(resid_filter, backward_cache_hook, "bwd")
        value = logit_diff(model(tokens))
        value.backward()
        model.reset_hooks()
        return value.item(), ActivationCache(cache, model), ActivationCache(grad_cache, model)

    _, clean_fwd, _ = get_cache_fwd_and_bwd(clean)
    _, corrupted_fwd, corrupted_grad = get_cache_fwd_and_bwd(corrupted)
    results["attribution patching"] = torch.stack(
        [
            ((clean_fwd["resid_pre", layer] - corrupted_fwd["resid_pre", layer]) * corrupted_grad["resid_pre", layer])
            .sum(-1)
            .mean(0)
            for layer in range(model.cfg.n_layers)
        ]
    )

    # head detection
    results["previous token heads"] = detect_head(model, "w5 w6 w7 w8 w5 w6 w7 w8", "previous_token_head")
    results["induction heads"] = detect_head(model, "w5 w6 w7 w8 w5 w6 w7 w8", "induction_head")

    # generation with a hook
    def steer(resid: torch.Tensor, hook: Any) -> torch.Tensor:
        return resid + 0.5 * model.W_U[:, 7]

    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_post", steer)]):
        results["steered generation"] = model.generate(
            "w5 w6 w7", max_new_tokens=5, do_sample=False, stop_at_eos=False, verbose=False
        )
    results["generated tokens"] = model.generate(
        clean[:1], max_new_tokens=4, do_sample=False, stop_at_eos=False, verbose=False, use_past_kv_cache=False
    )

    # utils
    results["lm_cross_entropy_loss"] = utils.lm_cross_entropy_loss(clean_logits, clean, per_token=True)
    results["sample_logits greedy"] = utils.sample_logits(clean_logits[:, -1], temperature=0.0)
    results["get_act_name"] = [utils.get_act_name("pattern", 1), utils.get_act_name("scale", 0, "ln2")]
    results["gelu_new"] = utils.gelu_new(accumulated)
    results["solu"] = utils.solu(accumulated)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        utils.test_prompt("w5 w6 w7 w8 w9 w5 w6 w7", "w8", model, top_k=3)
        utils.test_prompt("w5 w6 w7", ["w8", "w9"], model, top_k=2)
    results["test_prompt output"] = out.getvalue()
    return results


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours.keys() == theirs.keys()
    for key, a in ours.items():
        b = theirs[key]
        if isinstance(a, torch.Tensor):
            a, b = a.detach().float(), b.detach().float()
            assert a.shape == b.shape, (key, a.shape, b.shape)
            worst = (a - b).abs().max().item() if a.numel() else 0.0
            assert torch.allclose(a, b, atol=TOL, rtol=TOL), f"{key}: max abs difference {worst:.3g}"
        else:
            assert a == b, (key, a, b)
