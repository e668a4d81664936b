"""What crosses a process boundary: configuration, messages and the environment registry.

Every other tokenmill package may import this one; it imports nothing of the project.
"""
