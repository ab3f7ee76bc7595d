"""Decoder-only transformer family (Llama, Qwen2, Qwen3, SmolLM2) and its loaders."""
from das_jax.models.config import ModelConfig, ModelConfigError, RopeScaling
from das_jax.models.transformer import KVCache, forward, forward_hidden, init_params, lm_head, token_logprobs

__all__ = ["ModelConfig", "ModelConfigError", "RopeScaling", "KVCache", "forward", "forward_hidden",
           "init_params", "lm_head", "token_logprobs"]
