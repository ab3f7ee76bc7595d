"""das-jax: distribution-aware speculative decoding (DAS) for RL rollouts, in JAX.

Subpackages: `models` (transformer + loaders), `engine` (KV cache, verify step, generate),
`drafter` (suffix-tree and baseline drafters), `rl` (rewards, GRPO, trainer), `data` (datasets),
`bench` (benchmarks).
"""
__version__ = "0.1.0"
