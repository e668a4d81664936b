"""The EngineCore side: engine loop, scheduler, KV cache manager, block pool, executors.

Nothing here imports tokenmill.worker except core/executor/, which starts the workers.
"""
