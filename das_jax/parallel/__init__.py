"""Device meshes and sharding rules (`das_jax.parallel.sharding`)."""
