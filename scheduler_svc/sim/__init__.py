"""A discrete-event simulator that drives the policy core in virtual time.

Standard library only, like `core/`: the same `Scheduler` objects the sidecar runs, against a
cost model of TensorRT-LLM on an A100 (`costmodel.py`), with seeded workloads (`workload.py`).
"""
