"""Integrations: running a HookedModel inside other tools' loops.

``harvest`` (activation datasets, resumable, under ``torchrun``), ``training`` (probes trained from the Hugging
Face ``Trainer``). Uses the user API below it; the CLI and the test kit sit above.
"""
