"""`release_trace_caches`: jax's tracing caches go, compiled programs stay."""
import jax
import jax.numpy as jnp

from das_jax.malloc import release_trace_caches


def test_release_trace_caches_keeps_compiled_programs():
    compiled = []
    listener = (lambda event, duration, **kw: compiled.append(str(kw.get("fun_name")))
                if event == "/jax/core/compile/backend_compile_duration" else None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        release_trace_caches(force=True)  # starts watching compiles

        def program_f(x):
            return jnp.tanh(x @ x.T).sum()
        f = jax.jit(program_f)
        x = jnp.ones((8, 8))
        eager = float((x + 1.0).sum())  # eager ops: their programs are kept too
        expected = float(f(x))
        assert compiled.count("jit(program_f)") == 1
        assert release_trace_caches(force=True)
        assert not release_trace_caches()  # nothing compiled since: nothing to drop
        assert float(f(x)) == expected
        assert compiled.count("jit(program_f)") == 1  # the same executable, not rebuilt
        n = len(compiled)
        assert float((x + 1.0).sum()) == eager and len(compiled) == n
        # (another program computes the reference: equal up to float rounding)
        assert abs(float(f(jnp.ones((4, 8)))) - 16.0 * float(jnp.tanh(8.0))) <= 1e-5
        assert compiled.count("jit(program_f)") == 2  # a new shape still compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
