"""Loaded by Python at start-up when this directory is on PYTHONPATH (run.sh puts it
there): ``horovod.tensorflow`` and ``horovod.tensorflow.keras`` (and ``horovod.keras``)
become ``hostreduce.horovod`` and ``hostreduce.horovod.keras``: an import alias only,
so that Horovod's own test files run unmodified on hostreduce. Horovod's other modules
(``horovod.common.util``, ``horovod.runner...``) stay Horovod's; its small
``horovod/tensorflow/util.py`` is loaded on its own (it needs only TensorFlow). Where
Horovod is not installed, ``horovod`` itself is an empty package, so that the aliases
still import.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

ALIASES = {
    "horovod.tensorflow": "hostreduce.horovod",
    "horovod.tensorflow.keras": "hostreduce.horovod.keras",
    "horovod.keras": "hostreduce.horovod.keras",
    "horovod.tensorflow.elastic": "hostreduce.horovod.elastic",
    "horovod.tensorflow.keras.elastic": "hostreduce.horovod.keras.elastic",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "horovod" and importlib.machinery.PathFinder.find_spec(name, path) is None:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        if name in ALIASES:
            return importlib.util.spec_from_loader(name, self)
        if name == "horovod.tensorflow.util":
            spec = importlib.util.find_spec("horovod")
            if spec is None or not spec.submodule_search_locations:
                return None
            util = os.path.join(list(spec.submodule_search_locations)[0], "tensorflow", "util.py")
            return importlib.util.spec_from_file_location(name, util)
        return None

    def create_module(self, spec):
        if spec.name == "horovod":
            return None  # the default: an empty package
        return importlib.import_module(ALIASES[spec.name])

    def exec_module(self, module):
        pass


if os.environ.get("HOSTREDUCE_HOROVOD_ALIAS", "1") == "1":
    sys.meta_path.insert(0, _Alias())
