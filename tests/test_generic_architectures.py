"""The generic adapter on thirteen decoder-only architectures that no plugin describes.

Each class draws tiny configs that vary the family's own choices (parallel or sequential blocks, multi-query and
grouped attention, partial rotary, q/k norms, sliding windows, ALiBi, branch multipliers...) and declares what the
generic adapter finds there; :class:`lensadapters.testing.generic.GenericContract` checks the rest. Families whose
attention does not go through transformers' attention interface (Falcon, BLOOM, GPT-Neo; CodeGen up to transformers
5.23; StableLM under transformers 4.x) get no pattern points and no hook_z; BLOOM adds the residual inside its
attention and MLP modules, so it gets no hook_attn_out/hook_mlp_out; BioGPT has no MLP module, and the automatic
description reads its MLP projections from the layer itself.
"""

from __future__ import annotations

from typing import Any

import transformers
from hypothesis import strategies as st
from packaging.version import Version
from transformers import (
    BioGptConfig,
    BloomConfig,
    CodeGenConfig,
    CohereConfig,
    FalconConfig,
    GPTBigCodeConfig,
    GPTNeoConfig,
    GraniteConfig,
    OlmoConfig,
    PersimmonConfig,
    PhiConfig,
    StableLmConfig,
    Starcoder2Config,
)

from lensadapters.testing.generic import GenericContract

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
# transformers 5.24 gave CodeGen the attention interface (and sdpa); before, it computed attention itself (eager only)
TRANSFORMERS_5_24 = Version(transformers.__version__) >= Version("5.24")
VOCAB = 96
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


@st.composite
def _shape(draw: Any) -> dict:
    """Layers, heads and key/value heads of a tiny model (width 32)."""
    heads = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    return dict(layers=draw(st.integers(1, 3)), heads=heads, kv=kv, width=32)


def _llama_like(config_class: type, **extra: Any) -> st.SearchStrategy:
    @st.composite
    def configs(draw: Any) -> Any:
        s = draw(_shape())
        fixed = {k: (draw(v) if isinstance(v, st.SearchStrategy) else v) for k, v in extra.items()}
        return config_class(
            vocab_size=VOCAB,
            hidden_size=s["width"],
            intermediate_size=48,
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv"],
            max_position_embeddings=64,
            **IDS,
            **fixed,
        )

    return configs()


#: the sizes of a tiny model: width, layers, heads, MLP width, positions
SIZES = (st.just(32), st.integers(1, 3), st.sampled_from([2, 4]), st.just(48), st.just(64))
LLAMA_NAMES = "hidden_size num_hidden_layers num_attention_heads intermediate_size max_position_embeddings"


def _builds(config_class: type, names: str, ids: dict = IDS, **fields: Any) -> st.SearchStrategy:
    """Configs of ``config_class`` of the tiny sizes (``names``: the config's names for width, layers, heads, MLP
    width and positions, ``-`` for one it lacks), vocabulary ``VOCAB``, the token ids ``ids`` and ``fields`` (a
    strategy is drawn, any other value is fixed; they may replace sizes)."""
    sized = {name: size for name, size in zip(names.split(), SIZES) if name != "-"}
    fixed = {"vocab_size": VOCAB, **ids, **fields}
    drawn = {k: v if isinstance(v, st.SearchStrategy) else st.just(v) for k, v in fixed.items()}
    return st.builds(config_class, **{**sized, **drawn})


class TestFalcon(GenericContract):
    attn_implementations = ("sdpa", "eager")
    # attention in its own code: described (patterns by the softmax capture) where the probe verifies it
    branches, attention_function, patterns, final_norm = True, None, None, True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        @st.composite
        def configs(draw: Any) -> Any:
            s = draw(_shape())
            new = draw(st.booleans())
            return FalconConfig(
                vocab_size=VOCAB,
                hidden_size=s["width"],
                num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"],
                num_kv_heads=s["kv"] if new else None,
                new_decoder_architecture=new,
                parallel_attn=new or draw(st.booleans()),
                alibi=False if new else draw(st.booleans()),
                bias=draw(st.booleans()),
                multi_query=not new and draw(st.booleans()),
                **IDS,
            )

        return configs()


class TestBloom(GenericContract):
    attn_implementations = ("eager",)
    branches, attention_function, patterns, final_norm = None, None, None, True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        post_ln = dict(apply_residual_connection_post_layernorm=st.booleans())
        return _builds(BloomConfig, "hidden_size n_layer n_head - -", **post_ln)


class TestGPTNeo(GenericContract):
    attn_implementations = ("eager",)
    branches, attention_function, patterns, final_norm, described = True, True, True, True, True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        @st.composite
        def configs(draw: Any) -> Any:
            kinds = draw(st.lists(st.sampled_from(["global", "local"]), min_size=1, max_size=3))
            return GPTNeoConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_layers=len(kinds),
                attention_types=[[[kind], 1] for kind in kinds],
                num_heads=draw(st.sampled_from([2, 4])),
                intermediate_size=48,
                window_size=3,
                max_position_embeddings=64,
                **IDS,
            )

        return configs()


class TestCodeGen(GenericContract):
    attn_implementations = ("sdpa", "eager") if TRANSFORMERS_5_24 else ("eager",)
    branches, final_norm = True, True
    attention_function = patterns = TRANSFORMERS_5_24

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        names, ids = "n_embd n_layer n_head n_inner n_positions", dict(bos_token_id=1, eos_token_id=2)
        return _builds(CodeGenConfig, names, ids, n_head=4, rotary_dim=st.sampled_from([4, 8]))


class TestStableLm(GenericContract):
    # transformers 4.x computes StableLM's attention itself (eager: a softmax; sdpa: a call in its code), both
    # described and captured
    branches = attention_function = patterns = final_norm = True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        # (transformers 4.x cannot initialize StableLM's bias-free q/k norms)
        return _llama_like(
            StableLmConfig,
            use_parallel_residual=st.booleans(),
            qk_layernorm=st.booleans() if TRANSFORMERS_5 else False,
            use_qkv_bias=st.booleans(),
            partial_rotary_factor=st.sampled_from([0.25, 0.5, 1.0]),
        )


class TestStarcoder2(GenericContract):
    branches = attention_function = patterns = final_norm = True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        return _llama_like(Starcoder2Config, sliding_window=st.sampled_from([None, 3]), use_bias=st.booleans())


class TestGPTBigCode(GenericContract):
    branches = attention_function = patterns = final_norm = True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        return _builds(GPTBigCodeConfig, "n_embd n_layer n_head n_inner n_positions", multi_query=st.booleans())


class TestCohere(GenericContract):
    branches = attention_function = patterns = final_norm = True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        return _llama_like(CohereConfig, use_qk_norm=False, logit_scale=st.sampled_from([1.0, 0.25]))


class TestGranite(GenericContract):
    """Granite scales both branches by ``residual_multiplier`` before adding them (ibm-granite's checkpoints: 0.22):
    described all the same, the constant carried by the block (``BlockLayout.attn_scale``/``mlp_scale``), its
    ``hook_attn_out``/``hook_mlp_out`` what the layer adds and ``W_O``/``W_out`` including it."""

    described = branches = attention_function = patterns = final_norm = True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        return _llama_like(
            GraniteConfig,
            residual_multiplier=st.sampled_from([1.0, 0.5, 0.22]),
            embedding_multiplier=st.sampled_from([1.0, 4.0]),
            attention_multiplier=st.just(0.3),
            logits_scaling=st.just(2.0),
        )


class TestOlmo(GenericContract):
    branches = attention_function = patterns = final_norm = True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        return _llama_like(OlmoConfig, clip_qkv=st.sampled_from([None, 0.5]))


class TestPhi(GenericContract):
    branches = attention_function = patterns = final_norm = True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        return _llama_like(PhiConfig, qk_layernorm=st.booleans(), partial_rotary_factor=st.sampled_from([0.5, 1.0]))


class TestPersimmon(GenericContract):
    branches = attention_function = patterns = final_norm = True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        own = dict(num_attention_heads=4, qk_layernorm=st.booleans(), partial_rotary_factor=st.sampled_from([0.5, 1.0]))
        return _builds(PersimmonConfig, LLAMA_NAMES, **own)


class TestBioGpt(GenericContract):
    # its MLP is two projections in the layer itself: described from the layer's modules (nested pre-LN parts)
    branches, attention_function, patterns, described = True, True, True, True

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        return _builds(BioGptConfig, LLAMA_NAMES, scale_embedding=st.booleans())
