"""The generic adapter's contract on families no plugin claims that the automatic description serves in full: every
block described (norms, queries, keys and values, rotary, MLP, weights), every point verified at wrap time, and the
contract suite's properties (values, edits, patching, patterns against HF eager, generation, gradients, weights
reproducing the projections) holding on tiny configs that vary each family's own choices.

Cohere 2 (sliding and global layers, parallel blocks, interleaved rotary), SmolLM3 (layers without RoPE), OLMo 3
(norms after the branches only, q/k norms over the projection width, per-layer-type rotary), GLM-4 (sandwich norms,
fused gate-up, interleaved partial rotary), EXAONE 4 (post-norm-only blocks with per-head q/k norms, sliding layers
without RoPE), Helium (interleaved rotary), Ernie 4.5, Seed-OSS, Apertus (xIELU, q/k norms), Hunyuan (q/k norms after
rotary), Arcee (ReLU² MLP without a gate), Ministral (sliding and full layers); Cohere, Granite and StableLM are in
``test_generic_architectures.py``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hypothesis import strategies as st
from transformers import AutoConfig

from lensadapters.testing.generic import GenericContract

VOCAB = 96
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _configs(model_type: str, **extra: Any) -> st.SearchStrategy:
    @st.composite
    def configs(draw: Any) -> Any:
        heads = draw(st.sampled_from([2, 4]))
        kv = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
        layers = draw(st.integers(1, 3))
        fixed = {k: (draw(v) if isinstance(v, st.SearchStrategy) else v) for k, v in extra.items()}
        fixed = {k: (v(layers) if callable(v) else v) for k, v in fixed.items()}
        return AutoConfig.for_model(
            model_type,
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=32 // heads,
            max_position_embeddings=64,
            **IDS,
            **fixed,
        )

    return configs()


#: sliding (window 3) and full-attention layers, alternating
ALTERNATING = dict(
    sliding_window=3,
    layer_types=lambda n: [("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(n)],
)


class _Described(GenericContract):
    described = branches = attention_function = patterns = final_norm = True
    model_type: ClassVar[str]
    #: the family's own config fields (a strategy is drawn, a function is given the number of layers)
    fields: ClassVar[dict[str, Any]] = {}

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        return _configs(cls.model_type, **cls.fields)


class TestCohere2(_Described):
    model_type, fields = "cohere2", ALTERNATING


class TestSmolLM3(_Described):
    model_type, fields = "smollm3", dict(no_rope_layers=lambda n: [int(i % 2 == 0) for i in range(n)])


class TestOlmo3(_Described):
    model_type, fields = "olmo3", ALTERNATING


class TestGlm4(_Described):
    model_type, fields = "glm4", dict(partial_rotary_factor=st.sampled_from([0.5, 1.0]), attention_bias=st.booleans())


class TestExaone4(_Described):
    model_type, fields = "exaone4", ALTERNATING


class TestHelium(_Described):
    model_type, fields = "helium", dict(attention_bias=st.booleans(), mlp_bias=st.booleans())


class TestErnie45(_Described):
    model_type, fields = "ernie4_5", dict(use_bias=st.booleans())


class TestSeedOss(_Described):
    model_type, fields = "seed_oss", dict(attention_bias=st.booleans())


class TestApertus(_Described):
    model_type = "apertus"  # xIELU activation, q/k norms


class TestHunyuanDense(_Described):
    model_type = "hunyuan_v1_dense"  # q/k norms after rotary


class TestArcee(_Described):
    model_type = "arcee"  # ReLU² MLP without a gate


class TestMinistral(_Described):
    model_type, fields = "ministral", ALTERNATING
