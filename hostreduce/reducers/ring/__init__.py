"""The ring reducer: bandwidth-optimal ring all-reduce between hosts over gRPC, a
shared-memory data path between peers on one host, negotiated execution order and
tensor fusion."""
