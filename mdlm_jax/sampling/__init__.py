"""Fixed-shape, jit-compiled samplers for masked diffusion models and their AR twin."""
