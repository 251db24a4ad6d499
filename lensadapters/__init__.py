"""lensadapters: TransformerLens-style hook points on unmodified Hugging Face models."""

from lensadapters import _moved
from lensadapters._version import __version__
from lensadapters.adapters import hf
from lensadapters.adapters.generic import GenericAdapterWarning
from lensadapters.adapters.hookspecs import HOOKSPEC_VERSION, hookimpl, hookspec
from lensadapters.adapters.layers import innermost_layer, wrapped_layers
from lensadapters.adapters.protocol import Hooked
from lensadapters.adapters.registry import Registry, get_registry
from lensadapters.adapters.variants import ContractVariant, contract_variants
from lensadapters.analysis.cache import ActivationCache, get_act_name
from lensadapters.analysis.cache_analysis import DecompositionUndefinedError
from lensadapters.analysis.factored_matrix import FactoredMatrix
from lensadapters.api.hooked_model import HookedModel
from lensadapters.api.tl_call import Output, TransformerLensKeywordError
from lensadapters.api.tokens import NoTokenizerError
from lensadapters.api.unfired import UnfiredHookWarning
from lensadapters.errors import (
    HookReturnError,
    LensAdaptersError,
    NotCausalError,
    PluginConflictError,
    PluginValidationError,
    UnknownHookError,
    UnsupportedModelError,
    WeightUnavailableError,
)
from lensadapters.hooks import specs as _specs
from lensadapters.hooks.hook_point import HookPoint, is_recomputing
from lensadapters.hooks.offload import live_parameters
from lensadapters.hooks.specs import *  # noqa: F403  (the description language: specs.__all__)
from lensadapters.integrations.harvest import HarvestMismatchError, harvest, load_harvest

_moved.install()  # old paths inside the moved subpackages (lensadapters.harvest.runner...)

# The old path lensadapters.harvest (a module) is loaded now, so that importing it (or lensadapters.harvest.runner)
# later does not rebind the package's `harvest` to that module: `from lensadapters import harvest` stays the function.
import lensadapters.harvest as _old_harvest_path  # noqa: E402,F401
from lensadapters.integrations.harvest import harvest  # noqa: E402,F811

__all__ = [
    "__version__",
    "ActivationCache",
    "get_act_name",
    "HookReturnError",
    "NotCausalError",
    "LensAdaptersError",
    "PluginConflictError",
    "PluginValidationError",
    "UnknownHookError",
    "UnsupportedModelError",
    "WeightUnavailableError",
    "HookPoint",
    "HookedModel",
    "HOOKSPEC_VERSION",
    "hookimpl",
    "hookspec",
    "Registry",
    "get_registry",
    *_specs.__all__,
    "is_recomputing",
    "live_parameters",
    "Hooked",
    "GenericAdapterWarning",
    "UnfiredHookWarning",
    "ContractVariant",
    "contract_variants",
    "wrapped_layers",
    "innermost_layer",
    "hf",
    # TransformerLens analysis layer
    "FactoredMatrix",
    "Output",
    "TransformerLensKeywordError",
    "NoTokenizerError",
    "DecompositionUndefinedError",
    # activation harvesting
    "harvest",
    "load_harvest",
    "HarvestMismatchError",
]
