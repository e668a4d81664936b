"""The V1 scheduler: one token budget per step shared by running and waiting requests."""
