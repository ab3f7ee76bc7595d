"""das_jax.drafter"""
