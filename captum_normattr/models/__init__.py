r"""Architecture adapters, tensor capture and model loading."""
from captum_normattr.models.adapters import UnsupportedModelError, get_adapter, supported_families
from captum_normattr.models.capture.session import recording
from captum_normattr.models.loading import default_model_path, load_default_model

__all__ = [
    "UnsupportedModelError",
    "get_adapter",
    "supported_families",
    "recording",
    "default_model_path",
    "load_default_model",
]
