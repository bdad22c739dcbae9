# The sidecar's image: slim, non-root, healthy when its gRPC health service says SERVING.
#   docker build -t scheduler-svc:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY protos ./protos
COPY scheduler_svc ./scheduler_svc
COPY reference_engine ./reference_engine
# Generate the protobuf stubs (the build's job, never committed), then build a wheel.
RUN pip install --no-cache-dir -c constraints.txt grpcio-tools \
 && python -m scheduler_svc.tools.protogen \
 && pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim
COPY constraints.txt /tmp/constraints.txt
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir -c /tmp/constraints.txt /wheels/*.whl \
 && rm -rf /wheels /tmp/constraints.txt \
 && useradd --system --uid 10001 --no-create-home sidecar
COPY deploy/k8s/overlays/cpu/sidecar.yaml /etc/scheduler-svc/config.yaml
USER 10001
EXPOSE 50051 8080 9464
# Health on the admin listener: on loopback it stays plaintext whatever server.tls says, so the
# check holds with TLS on the client port too.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["scheduler-svc", "health", "--address", "127.0.0.1:50052"]
ENTRYPOINT ["scheduler-svc"]
# 0.0.0.0 within the container's own network (publishing it is `-p`'s decision); Admin stays on
# the container's loopback. It refuses to start without credentials: mount a credentials file
# and add `--credentials-file FILE`, or add `--anonymous client` to serve without credentials on
# purpose (docs/sidecar.md, Credentials and roles).
CMD ["serve", "--config", "/etc/scheduler-svc/config.yaml", "--host", "0.0.0.0"]
