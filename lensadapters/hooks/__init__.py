"""Hook machinery (bottom layer): hook points, per-forward frames, sites and the modules they read.

``hook_point`` (:class:`HookPoint`), ``frames`` (per-forward state, recomputation tags), ``sites`` (the reusable
core sites and the :class:`~lensadapters.hooks.sites.Site` protocol), ``attention``/``rotary``/``norms`` (what the
sites compute), ``specs`` (the description language a plugin answers in), ``guard``/``copying`` (module
integrity, settings copied onto instances), ``distributed``/``offload`` (live parameters under FSDP and
accelerate). Nothing here imports the plugin system, the wiring, the user API or anything above it.
"""
