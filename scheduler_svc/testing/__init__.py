"""Test doubles and helpers shipped with the package: a backend that scripts an engine (unit
tests only; integration tests run the real Triton), test certificates, and `until`."""
