"""KV cache bookkeeping on the core side: block pool, per-request block tables, sizing."""
