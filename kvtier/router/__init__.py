"""A KV-cache-aware router over many kvtier instances (`kvtier router`).

It follows every instance's KV events (kvtier.events) into an index block hash -> {instance:
tiers}, hashes each prompt as the engines do, and sends the request where the longest prefix is
cached, weighed against load; an OpenAI-compatible HTTP front-end proxies the request there.
Nothing here imports torch.
"""
