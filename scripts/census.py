"""The census of every causal-LM model type of the installed transformers: ``python scripts/census.py [--markdown]
[MODEL_TYPE ...]`` (see :mod:`lensadapters.testing.census`)."""

from lensadapters.testing.census import main

if __name__ == "__main__":
    raise SystemExit(main())
