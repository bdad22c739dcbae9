# Triton with this project's Python package, which the pre/postprocessing steps (and, for the
# CPU repository, the reference engine) import. BASE_IMAGE comes from deploy/versions.env:
#   TRITON_TRTLLM_IMAGE for the GPU stack (TensorRT-LLM backend, EXTRAS empty),
#   TRITON_CPU_IMAGE for the CPU stack (Python backend, EXTRAS=engine for torch + transformers).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
ARG EXTRAS=""
WORKDIR /opt/scheduler_svc
COPY pyproject.toml constraints.txt README.md ./
COPY protos ./protos
COPY scheduler_svc ./scheduler_svc
COPY reference_engine ./reference_engine
COPY model_repo ./model_repo
# Ubuntu 24.04's Python is "externally managed"; this image is ours, so install into it.
# The gRPC stubs are generated first: Triton's preStop runs `scheduler-svc drain`.
RUN pip install --no-cache-dir --break-system-packages -c constraints.txt grpcio-tools \
 && python3 -m scheduler_svc.tools.protogen \
 && pip install --no-cache-dir --break-system-packages \
      --extra-index-url https://download.pytorch.org/whl/cpu \
      -c constraints.txt ".${EXTRAS:+[${EXTRAS}]}"
