"""Backends the sidecar forwards generation to: the adapter protocol and Triton's adapter."""
