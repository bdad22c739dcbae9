"""Running a real Triton Inference Server: the bundled binary and its launcher."""
