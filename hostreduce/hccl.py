"""The public import path of TF Adapter's ``hccl`` face (``import hostreduce.hccl``): the
module is :mod:`hostreduce.hccl`, registered under this name too."""
import sys

from .tf_adapter import hccl as _face

sys.modules[__name__] = _face
