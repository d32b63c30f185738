"""TF Adapter's names on hostreduce: ``npu.distribute`` (``distribute``) and HCCL's ops
and group management (``hccl``). Both are thin maps onto :mod:`hostreduce.ops`; the
public import paths are ``hostreduce.distribute`` and ``hostreduce.hccl``."""
