"""Engines: the rollout servers behind one SGLang-compatible HTTP contract (DESIGN.md).

`server` (builtin CPU engine, `gyre-engine`) runs `core` (continuous batching, prefix cache,
weight updates) over `runner` (KV-cached forward, sampling); `protocol` is the pure request /
response contract; `client` talks to builtin and SGLang servers alike; `launch` starts either as
a child process; `kv_transfer` moves cached prefixes between builtin engines over Mooncake.
"""
