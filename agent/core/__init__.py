"""The pure planning core: score, split, replication, routes, failover decisions, election, router bookkeeping, wire validation. No asyncio, sockets, onnxruntime, clock or randomness."""
