"""The TensorFlow side of parameter-server training: the Keras optimizer that pushes
gradients to the ps (``keras``), capturing an optimizer's update rule for the ps
(``capture``), row caches standing in for tables the ps shard by rows (``rowcache``)
and their initial value, computed by blocks of rows on the chief (``initial_rows``),
lookup ids read from the batch (``direct_ids``), what ps tasks do when a script
reaches training (``roles``) and the strategy's ``tf.distribute`` surface for custom
loops with a ``ClusterCoordinator`` (``coordinator``). The service itself (``hostreduce.ps``) never imports
TensorFlow."""
