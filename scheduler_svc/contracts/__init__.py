"""Formats shared across the sidecar's parts, pure: a request's sampling (every front to the
Triton client), TensorRT-LLM's tensor contract (the client, the engine front, the ensemble's
preprocessing and the reference engine) and the spec gate's result file (the tool and the
running sidecar)."""
