"""The plugin system: how a model's plugins are found, asked and checked.

``hookspecs`` (the ``lensadapters_*`` hook specifications), ``registry`` (entry points, selection), ``protocol``
(:class:`~lensadapters.adapters.protocol.Hooked`, what a plugin may use of a wrapped model), ``plugin_calls``,
``validation``, ``defaults`` (the core's own fallback implementations), ``variants``, ``layers`` (adapter
wrappers such as PEFT's), ``hf`` (description helpers for Hugging Face families), ``generic`` (the automatic
adapter) and ``moe`` (MoE descriptions and sites). Imports only :mod:`lensadapters.hooks` below it.
"""
