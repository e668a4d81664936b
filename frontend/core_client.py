"""Engine-core clients: how the frontend reaches EngineCore, behind one interface.

`InprocClient` builds the EngineCore in the caller's process and steps it directly (for
debugging and the torchrun external launcher); the multiprocess clients that talk to a
separate engine-core process over ZeroMQ implement the same methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(config: EngineConfig) -> EngineCoreClient:
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (one engine step's worth)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def engine_config(self) -> EngineConfig:
        """The config as the core settled it (e.g. max_model_len after auto-fit)."""


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        # The one place the frontend builds a core itself.
        from tokenmill.core.engine_core import EngineCore

        self.engine_core: Any = EngineCore(config)

    @property
    def engine_config(self) -> EngineConfig:
        return self.engine_core.config

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        if self.engine_core is not None:
            self.engine_core.shutdown()
            self.engine_core = None
