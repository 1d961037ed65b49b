"""Models: a registry, the paper's LeNet, flat parameter vectors and the orthonormal coefficient subspace."""

from fedtailor.models.flat import FlatLayout, get_flat, set_flat
from fedtailor.models.lenet import MLP, LeNet
from fedtailor.models.registry import MODELS, build_model, num_parameters

__all__ = ["MLP", "MODELS", "FlatLayout", "LeNet", "build_model", "get_flat", "num_parameters", "set_flat"]
