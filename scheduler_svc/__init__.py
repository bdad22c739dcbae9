"""scheduler_svc: a gRPC scheduling sidecar for LLM serving on NVIDIA Triton Inference Server."""

__version__ = "0.1.0"
