"""A discrete-event simulator that drives the policy core in virtual time.

Standard library only, like `core/`: the same `Scheduler` objects the sidecar runs, against an
engine whose steps cost what a cost profile says (`scheduler_svc/profiles`: an A100 estimate by
default, the H200 measurements, or a file of the user's), with seeded workloads (`workload.py`).
"""
