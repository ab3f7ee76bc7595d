"""das_jax.bench"""
