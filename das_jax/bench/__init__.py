"""das_jax.bench: benchmarks (`das-jax bench ...`, see `das_jax.cli.bench`).

- `engine_bench`: decode throughput of the verify step and `Engine.generate` vs HF transformers,
  and the memory-bandwidth floor of a step.
- `drafter_bench`: drafter latency / acceptance / memory on synthetic RL traffic.
- `rollout_bench`: rollout time per drafter over RL epochs on a real model (identity check,
  trace recording, replay prediction, plots); its core `run_bench(BenchSetup)` takes an engine
  and tokenized prompts.
- `replay`: trace format (`write_trace` / `read_trace`), the simulator `simulate`
  (`Engine.generate`'s own scheduler on recorded tokens), `replay_epochs`, `paper_workload`; `das_jax.cli.bench_replay` drives it.
- `gpu_lease_check`: the one GPU check a device lease runs (one JSON; `lease_plan`: its shapes
  and time estimate); `gpu_check --from-json` fits the cost model and replays from that JSON.

Modules here import jax lazily (the command registration, `das_jax.cli.bench`, imports none).
"""
