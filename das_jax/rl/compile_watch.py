"""What a run compiled: `CompileWatch` counts this process's JAX compilations (through
`jax.monitoring`, imported on first use) and `describe_compiles` says them in one line."""
from __future__ import annotations

import threading
from typing import Any

from das_jax.rl.console_log import fmt_seconds


class CompileWatch:
    """Counts the JAX compilations of this process through `jax.monitoring` (jaxpr tracing,
    lowering and XLA compile events).

    `so_far()` / `take()` return what was compiled since the last `take()` (which resets):
    (seconds, {program name: count}).
    """

    _EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
               "/jax/core/compile/jaxpr_to_mlir_module_duration",
               "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        # deferred import: jax (not loaded by importing this module)
        import jax
        self._jax = jax
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._programs: dict[str, int] = {}
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kw: Any) -> None:
        if event not in self._EVENTS:
            return
        with self._lock:
            self._seconds += duration
            if event == self._EVENTS[-1]:
                name = str(kw.get("fun_name", "?"))
                name = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
                self._programs[name] = self._programs.get(name, 0) + 1

    def so_far(self) -> tuple[float, dict[str, int]]:
        with self._lock:
            return self._seconds, dict(self._programs)

    def take(self) -> tuple[float, dict[str, int]]:
        with self._lock:
            out = (self._seconds, dict(self._programs))
            self._seconds, self._programs = 0.0, {}
        return out

    def close(self) -> None:
        try:
            self._jax.monitoring.unregister_event_duration_listener(self._on_event)
        except (AttributeError, ValueError):  # pragma: no cover - older jax / already removed
            pass


def describe_compiles(seconds: float, programs: dict[str, int], min_count: int = 1) -> str:
    """`compiled 13 programs (verify x9, prefill_insert x3, train_step) in 41.2 s`: the programs
    the engine and trainer jit by name (single-op programs from eager jnp calls are counted, not
    named)."""
    named = {k: v for k, v in programs.items()
             if k in ("verify", "verify_packed", "prefill_insert", "prefill_packed",
                      "gather_rows", "train_step", "_compute_logprobs_jit") and v >= min_count}
    parts = [f"{k.strip('_').removesuffix('_jit')}" + (f" x{v}" if v > 1 else "")
             for k, v in sorted(named.items(), key=lambda kv: -kv[1])]
    small = sum(programs.values()) - sum(named.values())
    if small:
        parts.append(f"{small} small")
    return (f"compiled {sum(programs.values())} programs ({', '.join(parts)}) in "
            f"{fmt_seconds(seconds)}")
