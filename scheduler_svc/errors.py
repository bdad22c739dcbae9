"""The project's error tree. Each error has a fixed `type` string (usable as a metric label).

SchedulerSvcError
└── LauncherError                 the embedded Triton could not be started or stopped
    ├── TritonNotInstalledError   no bundled tritonserver (install the `triton` extra)
    ├── BackendStubMissingError   no Python backend stub for this interpreter
    ├── PortInUseError            a requested port is taken
    ├── ModelLoadError            a model failed to load; names the model and Triton's reason
    ├── TritonExitedError         tritonserver exited for another reason
    └── TritonStartTimeoutError   tritonserver did not become ready in time
"""

from __future__ import annotations


class SchedulerSvcError(Exception):
    """Base of every error scheduler_svc raises on purpose."""

    type = "internal"


class LauncherError(SchedulerSvcError):
    type = "launcher"


class TritonNotInstalledError(LauncherError):
    type = "triton_not_installed"


class BackendStubMissingError(LauncherError):
    type = "backend_stub_missing"


class PortInUseError(LauncherError):
    type = "port_in_use"

    def __init__(self, service: str, port: int) -> None:
        super().__init__(
            f"the {service} port {port} is already in use; choose another (0 picks a free one)"
        )
        self.service = service
        self.port = port


class ModelLoadError(LauncherError):
    type = "model_load_failed"

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(f"model '{model}' failed to load: {reason}")
        self.model = model
        self.reason = reason


class TritonExitedError(LauncherError):
    type = "triton_exited"


class TritonStartTimeoutError(LauncherError):
    type = "triton_start_timeout"
