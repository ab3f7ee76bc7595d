"""das_jax.data"""
