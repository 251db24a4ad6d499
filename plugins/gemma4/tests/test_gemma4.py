"""Gemma 4 (text): the contract suite over random tiny Gemma 4 configs (transformers 5.x only: Gemma 4 is not in
transformers 4.x)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.gemma4", reason="Gemma 4 needs transformers 5.x")
pytestmark = pytest.mark.transformers5_only

from lensadapters_gemma4.testing import Gemma4Contract, gemma4_config  # noqa: E402

from lensadapters.testing.families import RefusalChecks  # noqa: E402


class TestGemma4(Gemma4Contract, RefusalChecks):
    """The plugin's contract suite (``lensadapters_gemma4.testing``, also run by ``lensadapters check gemma4``)."""

    example_config = gemma4_config

    def test_unknown_rope_type_is_refused(self) -> None:
        from lensadapters import UnsupportedModelError

        model = self.example_model()
        rotary = model.model.rotary_emb
        rotary.rope_type = {k: "interleaved_future_rope" for k in rotary.rope_type}
        with pytest.raises(UnsupportedModelError, match="rope type 'interleaved_future_rope'"):
            self.wrap(model)
