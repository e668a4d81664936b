"""Executors: how EngineCore reaches its workers (the only place core/ imports worker/)."""
