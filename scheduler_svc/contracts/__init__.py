"""Formats shared across the sidecar's parts, pure: the files and tensors one side writes and
another reads (the spec gate's result; TensorRT-LLM's word lists)."""
