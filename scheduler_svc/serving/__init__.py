"""The sidecar process: `app` composes it (listeners, TLS, credentials), `service` admits and
answers requests, `loop` runs the core's policy over them, `rows` carries each dispatched row to
its backend, and `fronts/` (wire <-> service) and `backends/` (service <-> Triton) sit at its
two edges."""
