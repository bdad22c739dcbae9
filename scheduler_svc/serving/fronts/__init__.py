"""The sidecar's fronts (scheduler.v1, KServe v2, admin, health over gRPC; the OpenAI and generate
routes over HTTP) and the process that hosts them on its listeners (app.py)."""
