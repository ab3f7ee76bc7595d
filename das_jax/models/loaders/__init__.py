"""Model loaders: local HF safetensors directory, GGUF file, HF hub id (see `das_jax.models.loading`)."""
