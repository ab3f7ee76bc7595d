"""das_jax.rl"""
