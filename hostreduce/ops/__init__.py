"""TensorFlow collectives on the job's engine, shared by every compatibility face
(``hostreduce.horovod``, ``hostreduce.tf_adapter``): the job (``job``: where this
process sits, which engine reduces), process sets (``process_sets``), tensor collectives
(``tensors``), wire compression of tensors (``compression``), the distributed Keras
optimizer (``optimizer``) and gradient tape (``tape``). A face maps its peer's names
onto these; none of it is Horovod- or Ascend-specific."""
