"""Sampling state of the persistent batch, one class per feature (worker/sample/*.py), and
the container that builds a step's SamplingMetadata from them (states.py)."""

from tokenmill.worker.sample.base import SamplingState, StepRows, TokenRecord
from tokenmill.worker.sample.states import ADJUSTERS, SamplingStates

__all__ = ["ADJUSTERS", "SamplingState", "SamplingStates", "StepRows", "TokenRecord"]
