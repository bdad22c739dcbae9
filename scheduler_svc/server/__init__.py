"""The gRPC fronts (scheduler.v1, KServe v2, admin, health) and the server that hosts them."""
