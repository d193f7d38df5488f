"""The capacity planner: a request trace simulated on the engine's own KV cache code (the
KVCacheManager and the offload tiers' caches and eviction policies) with a cost model in place of
a model, to size device, host and disk tiers (`kvtier plan`)."""
