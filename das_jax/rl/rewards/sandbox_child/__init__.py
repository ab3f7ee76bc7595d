"""The child side of the code sandbox (:mod:`das_jax.rl.rewards.sandbox` launches it).

These modules run inside the sandbox, as scripts, with only the standard library: the host executes
``python -I -S runner.py [tag]``, and ``runner`` imports its siblings ``wire`` (the plain-data wire
format) and ``confine`` (mounts, limits, privilege drop, Landlock, seccomp, the reliability guard)
as top-level modules. So none of them imports das_jax or anything but the standard library. The
tests import ``das_jax.rl.rewards.sandbox_child.wire`` for the wire format; the package imports
none of them.
"""
