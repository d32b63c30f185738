"""Estimator-style training on hostreduce: ``model_fn`` returns an ``EstimatorSpec``
whose ``host_call`` runs the optimizer on the host after gradients are all-reduced."""
from .estimator import Estimator
from .mode_keys import ModeKeys
from .names import restore_variables
from .numpy_input import numpy_input_fn
from .run_config import RunConfig
from .spec import EstimatorSpec, host_train_spec
from .training import EvalSpec, TrainSpec, train_and_evaluate
from ..host.gradients import compute_gradients
from ..strategies import InputContext

__all__ = [
    "Estimator",
    "EstimatorSpec",
    "EvalSpec",
    "InputContext",
    "ModeKeys",
    "RunConfig",
    "TrainSpec",
    "compute_gradients",
    "host_train_spec",
    "numpy_input_fn",
    "restore_variables",
    "train_and_evaluate",
]
