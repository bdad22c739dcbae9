"""Engine cost profiles: what one engine step costs on a GPU, and the engine's shape there.

A profile is data with provenance (`data/*.json`): a linear step model, the engine's shape
(sequences, token budget, KV pool from the GPU's memory arithmetic) and, for a measured profile,
the raw measurements it was fitted to. The reference engine's emulated timing and the simulator
read the same `CostProfile`. Standard library only, like `core/`: the engine imports it inside
Triton's Python backend, the simulator in virtual time, and neither may pull anything else in.
"""

from scheduler_svc.profiles.fit import StepFit, StepPoint, fit_steps
from scheduler_svc.profiles.profile import (
    BUNDLED,
    DEFAULT_PROFILE,
    CostProfile,
    load_profile,
    profile_from_mapping,
    read_profile_file,
)

__all__ = [
    "BUNDLED",
    "DEFAULT_PROFILE",
    "CostProfile",
    "StepFit",
    "StepPoint",
    "fit_steps",
    "load_profile",
    "profile_from_mapping",
    "read_profile_file",
]
