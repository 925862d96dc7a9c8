"""Benchmarks: python -m mdlm_jax.bench {train} [--json]."""
