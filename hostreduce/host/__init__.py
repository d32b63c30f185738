"""Host-resident training state: where variables live, how gradients are taken on the
device, and how the optimizer update runs on the host (Keras 3, tf_keras and TF1
optimizers)."""
from .apply import apply_gradients, fused_apply_supported
from .gradients import compute_gradients
from .tf1 import tf1_optimizer_scope
from .variables import VariableStore

__all__ = ["apply_gradients", "compute_gradients", "fused_apply_supported", "tf1_optimizer_scope", "VariableStore"]
