"""TF Adapter's names on hostreduce: ``npu.distribute`` (``distribute``), HCCL's ops
and group management (``hccl``) and ``npu.open()`` (``device``). ``distribute`` and
``hccl`` are thin maps onto :mod:`hostreduce.ops`; the public paths are
``hostreduce.distribute``, ``hostreduce.hccl`` and ``hostreduce.open``, so a script's
``import npu_device as npu`` becomes ``import hostreduce as npu``."""
