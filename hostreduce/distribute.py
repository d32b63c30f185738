"""The public import path of TF Adapter's ``distribute`` face (``import hostreduce.distribute``): the
module is :mod:`hostreduce.distribute`, registered under this name too."""
import sys

from .tf_adapter import distribute as _face

sys.modules[__name__] = _face
