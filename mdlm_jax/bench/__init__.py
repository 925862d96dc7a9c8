"""The benchmarks the project keeps, one module per command of `python -m
mdlm_jax.bench {train,sample,serve,kernels,humaneval,agent,longctx,passkey}`:
each prints JSON (`--json`, `--out`) and saves its plot as a PNG; the figures
in docs/benchmarks.md come from them."""
