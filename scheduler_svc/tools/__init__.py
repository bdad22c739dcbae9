"""Offline tools around the sidecar, never imported by the serving process: the benchmarks
(`bench/`), chaos, the spec-gate runner, model-repository rendering, the proto build and the
launcher of a real Triton (`triton/`)."""
