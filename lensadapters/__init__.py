"""lensadapters: TransformerLens-style hook points on unmodified Hugging Face models."""

from . import hf
from ._version import __version__
from .cache import ActivationCache, get_act_name
from .cache_analysis import DecompositionUndefinedError
from .errors import (
    HookReturnError,
    LensAdaptersError,
    PluginConflictError,
    PluginValidationError,
    UnknownHookError,
    UnsupportedModelError,
    WeightUnavailableError,
)
from .factored_matrix import FactoredMatrix
from .generic import GenericAdapterWarning
from .harvest import HarvestMismatchError, harvest, load_harvest
from .hook_point import HookPoint, is_recomputing
from .hooked_model import HookedModel
from .hookspecs import HOOKSPEC_VERSION, hookimpl, hookspec
from .layers import innermost_layer, wrapped_layers
from .offload import live_parameters
from .protocol import Hooked
from .registry import Registry, get_registry
from .specs import (
    Architecture,
    BlockLayout,
    FusedGateUp,
    FusedQKV,
    HookedConfig,
    LinearWeight,
    MLPLayout,
    ModelLayout,
    NormSpec,
    ProjectionNorm,
    RotarySpec,
    SeparateQKV,
)
from .tl_call import Output, TransformerLensKeywordError
from .tokens import NoTokenizerError
from .variants import ContractVariant, contract_variants

__all__ = [
    "__version__",
    "ActivationCache",
    "get_act_name",
    "HookReturnError",
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
    "Architecture",
    "BlockLayout",
    "FusedQKV",
    "HookedConfig",
    "LinearWeight",
    "MLPLayout",
    "ModelLayout",
    "NormSpec",
    "RotarySpec",
    "SeparateQKV",
    "is_recomputing",
    "live_parameters",
    "Hooked",
    "GenericAdapterWarning",
    "ContractVariant",
    "contract_variants",
    "wrapped_layers",
    "innermost_layer",
    "FusedGateUp",
    "ProjectionNorm",
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
