"""das_jax.engine"""
