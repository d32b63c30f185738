"""What every hostreduce network service shares: gRPC channel and server options
(``grpc_options``), mutual authentication with the job's secret (``auth``), bounded
admission of connections before they authenticate (``admission``), and glibc malloc
tuning for processes that move large messages (``malloc``). The ring (``reducers/ring``)
and the parameter servers (``ps``) are built on it; it knows nothing of either."""
