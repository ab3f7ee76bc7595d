"""Loading and saving run configs: YAML plus `--set a.b=v` overrides, type-checked against the
schema (`das_jax.config.schema`), then validated across sections (`das_jax.config.validation`).

Every YAML key is validated: unknown keys are rejected with the list of valid keys (and a "did you
mean"), values are type-checked against the field's annotation (ints are accepted for floats,
lists become tuples, `null` only where the field is optional), enum-like fields are checked
against their choices. This module does not import JAX (so `platform` can still be applied before
JAX initialises; see `apply_platform`).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from das_jax.config.schema import Config, ConfigError
from das_jax.config.validation import validate
from das_jax.models import sources

__all__ = ["parse_override", "apply_overrides", "config_from_dict", "load_config",
           "config_to_dict", "save_config", "apply_platform", "apply_compilation_cache",
           "compilation_cache_dir"]


# ----- removed keys ----------------------------------------------------------------------------------
# Keys that had no effect and were removed: (section, key) -> (the old default, what to do instead).
# A config.yaml written before the removal holds the old default, which is dropped (it asked for
# nothing); any other value is rejected with the hint.
_REMOVED_KEYS = {
    ("train", "resume"): (None, "resume a run with `das-jax train --resume RUN_DIR`"),
    ("train", "log_every"): (1, "every step is logged to metrics.jsonl"),
    ("das", "enabled"): (True, "choose the speculation with the top-level key `drafter` "
                               "(drafter: none disables it)"),
}


def _removed_key_error(section: str, key: str) -> ConfigError:
    return ConfigError(f"{section}.{key} is no longer a config key; "
                       f"{_REMOVED_KEYS[(section, key)][1]}")


def _drop_removed_keys(raw: dict) -> dict:
    out = dict(raw)
    for (section, key), (old_default, _) in _REMOVED_KEYS.items():
        sec = out.get(section)
        if isinstance(sec, Mapping) and key in sec:
            if sec[key] != old_default or isinstance(sec[key], bool) != isinstance(old_default,
                                                                                   bool):
                raise _removed_key_error(section, key)
            out[section] = {k: v for k, v in sec.items() if k != key}
    return out


# ----- generic dataclass <-> dict with validation ------------------------------------------------

def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is tuple:
        args = typing.get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against annotation `tp` (converting int -> float, list -> tuple)."""
    origin = typing.get_origin(tp)
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            try:
                return _coerce(value, inner[0], key)
            except ConfigError:
                raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} "
                                  f"({type(value).__name__})") from None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _from_dict(tp, value, key + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} "
                              f"({type(value).__name__})")
        (item_tp, *_) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 (PyYAML) reads `1e-6` (no dot) as a string: accept numeric strings.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected float, got {value!r} ({type(value).__name__})")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected int, got {value!r} ({type(value).__name__})")
        return value
    if tp is bool or tp is str:
        if not isinstance(value, tp):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r} "
                              f"({type(value).__name__})")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # pragma: no cover


def _unknown_key_error(cls, name: str, prefix: str) -> ConfigError:
    valid = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
    where = f"section {prefix[:-1]!r}" if prefix else "the top level"
    return ConfigError(f"unknown key {prefix + name!r}{hint}; valid keys in {where}: "
                       f"{', '.join(valid)}")


def _from_dict(cls, raw: Mapping[str, Any], prefix: str = ""):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in raw.items():
        if not isinstance(name, str) or name not in fields:
            raise _unknown_key_error(cls, str(name), prefix)
        key = prefix + name
        value = _coerce(value, hints[name], key)
        choices = fields[name].metadata.get("choices")
        if callable(choices):
            choices = choices()
        if choices is not None and value is not None and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}: invalid value {value!r}{hint}; choices: "
                              f"{', '.join(map(str, choices))}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own checks (e.g. DASConfig's)
        raise ConfigError(f"{prefix[:-1] or 'config'}: {e}") from None


def _to_plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_to_plain(v) for v in value]
    return value


# ----- YAML ---------------------------------------------------------------------------------------

def _yaml_error(where: str, e: yaml.YAMLError, lines: bool = True) -> ConfigError:
    """One line: `WHERE:LINE:COL: invalid YAML: <what>; fix ...` (PyYAML's own message spans
    several lines with a caret under the spot)."""
    mark = getattr(e, "problem_mark", None)
    at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None and lines else ""
    what = "; ".join(str(p).strip() for p in (getattr(e, "context", None),
                                              getattr(e, "problem", None)) if p)
    what = what or " ".join(str(e).split())
    return ConfigError(f"{where}{at}: invalid YAML: {what}; fix the YAML syntax there")


def _check_duplicate_keys(node, where: str, prefix: str = "", seen_nodes=None,
                          lines: bool = True) -> None:
    """Refuses a mapping that holds a key twice (PyYAML keeps the last one silently, so a second
    `grpo:` section would drop the first one's settings)."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:          # an alias of a node checked already
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else None
            if name is not None and k.tag != "tag:yaml.org,2002:merge":
                line = k.start_mark.line + 1
                if name in seen:
                    kind = "section" if isinstance(v, yaml.MappingNode) else "key"
                    fix = ("merge the two sections into one" if kind == "section" else
                           "keep only the value you mean")
                    at = f"{where}:{line}" if lines else where
                    first = f"first on line {seen[name]}; " if lines else ""
                    raise ConfigError(f"{at}: duplicate {kind} {prefix + name!r} ({first}YAML "
                                      f"would keep only the last); {fix}")
                seen[name] = line
            _check_duplicate_keys(v, where, f"{prefix}{name if name is not None else '?'}.",
                                  seen_nodes, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicate_keys(item, where, f"{prefix[:-1]}[{i}].", seen_nodes, lines)


def _load_yaml(text: str, where: str, prefix: str = "", lines: bool = True) -> Any:
    """`yaml.safe_load(text)`, refusing duplicate mapping keys; errors are one-line
    `ConfigError`s that start with `where` (a file name, then `:LINE`, or with `lines` false
    `override '...'`, which names no line); `prefix`: the key path of `text`'s top level."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicate_keys(node, where, prefix, lines=lines)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise _yaml_error(where, e, lines) from None
    finally:
        loader.dispose()


# ----- public API ---------------------------------------------------------------------------------

def parse_override(text: str) -> tuple[list[str], Any]:
    """`"a.b=v"` -> (["a", "b"], yaml.safe_load("v")). An empty value is the empty string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value "
                          "(e.g. grpo.beta=0.04)")
    key, _, raw = text.partition("=")
    path = [p.strip() for p in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"override {text!r}: empty key component in {key!r}")
    value = (_load_yaml(raw, f"override {text!r}: value", ".".join(path) + ".", lines=False)
             if raw.strip() else "")
    return path, value


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Applies `a.b=v` overrides to a raw (unvalidated) nested dict; returns a new dict."""
    out = _deep_copy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node, cls, prefix = out, Config, ""
        for i, name in enumerate(path):
            fields = {f.name: f for f in dataclasses.fields(cls)}
            if name not in fields:
                if (prefix[:-1], name) in _REMOVED_KEYS:
                    raise _removed_key_error(prefix[:-1], name)
                raise _unknown_key_error(cls, name, prefix)
            sub = typing.get_type_hints(cls)[name]
            if i == len(path) - 1:
                node[name] = value
            else:
                if not dataclasses.is_dataclass(sub):
                    raise ConfigError(f"override {text!r}: {prefix}{name} is not a section")
                node = node.setdefault(name, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"override {text!r}: {prefix}{name} is not a mapping")
                cls, prefix = sub, prefix + name + "."
    return out


def _deep_copy(x):
    if isinstance(x, dict):
        return {k: _deep_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deep_copy(v) for v in x]
    return x


def config_from_dict(raw: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> Config:
    """Validates a raw nested dict (as read from YAML), applies overrides, returns a `Config`."""
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping at the top level, got {type(raw).__name__}")
    raw = apply_overrides(_drop_removed_keys(dict(raw)), overrides)
    return validate(_from_dict(Config, raw))


# The main job's config, relative to the repository root (`das-jax train`'s documented default
# run, and the job `das-jax bench async-train` times).
MAIN_JOB_CONFIG = "configs/smollm2-135m-arith.yaml"


def main_job_config() -> str:
    """The main job's config file: `MAIN_JOB_CONFIG` under the working directory when it is
    there, else in the checkout das_jax runs from (a source or editable install), else
    `MAIN_JOB_CONFIG` itself (for the caller's "no such file" error)."""
    if Path(MAIN_JOB_CONFIG).is_file():
        return MAIN_JOB_CONFIG
    checkout = Path(__file__).resolve().parents[2] / MAIN_JOB_CONFIG
    return str(checkout) if checkout.is_file() else MAIN_JOB_CONFIG


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """Loads a YAML config file (None: all defaults), applies `--set` overrides, validates.

    Raises:
      ConfigError: unreadable/invalid YAML, unknown keys, wrong types, invalid choices or
        cross-field constraint violations; the message names the key and where the bad value
        came from (the file, or the `--set KEY=VALUE` that made the config invalid).
    """
    raw: Any = {}
    if path is not None:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            raise ConfigError(f"{path}:{line}: invalid UTF-8; save the config as UTF-8") from None
        raw = _load_yaml(text, str(path))
    try:
        return config_from_dict(raw, overrides)
    except ConfigError as e:
        raise ConfigError(_blame(raw, path, overrides, str(e))) from None


def _blame(raw: Any, path, overrides: Sequence[str], msg: str) -> str:
    """`msg` prefixed with what holds the bad value: the config file, when it is invalid on its
    own, else the first `--set KEY=VALUE` after which the config fails with this message."""
    if msg.startswith("override "):
        return msg                       # a malformed --set names itself
    where = f"{path}: " if path is not None else ""
    for k in range(len(overrides) + 1):
        try:
            config_from_dict(raw, overrides[:k])
        except ConfigError as e:
            if str(e) == msg:
                return f"--set {overrides[k - 1]}: {msg}" if k else where + msg
    return where + msg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict (tuples as lists), suitable for YAML/JSON; round-trips through
    `config_from_dict`."""
    return _to_plain(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Writes the resolved config as YAML (creating parent directories)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


_PLATFORM_ENV = {"cpu": "cpu", "gpu": "gpu", "tpu": "tpu"}


def compilation_cache_dir(cfg: Config) -> str | None:
    """The persistent compilation cache directory `cfg.compilation_cache` names: None when it is
    off (null), `<das-jax cache>/jax-compilation-cache` for "default", else the path (with `~`
    expanded); `JAX_COMPILATION_CACHE_DIR` in the environment wins over all three."""
    env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if env:
        return env
    if cfg.compilation_cache is None or cfg.compilation_cache == "":
        return None
    if cfg.compilation_cache == "default":
        return os.path.join(sources.cache_dir(), "jax-compilation-cache")
    return os.path.abspath(os.path.expanduser(cfg.compilation_cache))


def apply_compilation_cache(cfg: Config) -> str | None:
    """Turns JAX's persistent compilation cache on in `compilation_cache_dir(cfg)` (or off when it
    is None) and returns the directory. Every compiled program is stored (JAX's
    `jax_persistent_cache_min_compile_time_secs` set to 0 unless its environment variable is set).
    Call it before the first compile: JAX decides once per process whether the cache is used.

    Raises:
      ConfigError: the directory cannot be created.
    """
    # deferred import: jax (not loaded by importing this module)
    import jax

    path = compilation_cache_dir(cfg)
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"compilation_cache: cannot create {path} ({e.strerror}); set "
                              "compilation_cache to a writable directory, or null to turn it "
                              "off") from None
    jax.config.update("jax_compilation_cache_dir", path)
    if path is not None and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # every program, not only those compiling for over JAX's default 1 s: a run compiles
        # dozens of small ones (sampling, bookkeeping) whose compiles add up to most of a resume's
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def apply_platform(cfg: Config) -> None:
    """Sets `JAX_PLATFORMS` from `cfg.platform` (no-op when None), then initialises JAX on it, so
    a platform this machine lacks is reported here, before any model is loaded. Must run before
    JAX creates its backends.

    Raises:
      ConfigError: JAX is already initialised on another platform, or JAX cannot use the
        requested platform on this machine (no GPU / TPU, or a jax build without its support).
    """
    if cfg.platform is None:
        return
    want = _PLATFORM_ENV[cfg.platform]
    if "jax" in sys.modules:
        try:
            # deferred import: jax (not loaded by importing this module)
            from jax._src import xla_bridge
            initialised = bool(getattr(xla_bridge, "_backends", {}))
        except Exception:  # pragma: no cover - private API moved
            initialised = False
        if initialised:
            # deferred import: jax (not loaded by importing this module)
            import jax
            current = jax.default_backend()
            if current != want and not (want == "gpu" and current in ("cuda", "rocm")):
                raise ConfigError(
                    f"platform={cfg.platform!r} but JAX is already initialised on {current!r}; "
                    "set the platform before anything touches JAX (or export JAX_PLATFORMS)")
            return
    os.environ["JAX_PLATFORMS"] = want
    # deferred import: jax (not loaded by importing this module)
    import jax
    try:
        jax.devices()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        kind = "GPU (CUDA or ROCm)" if cfg.platform == "gpu" else cfg.platform.upper()
        raise ConfigError(
            f"platform={cfg.platform!r}: JAX cannot use a {kind} on this machine "
            f"(JAX says: {first}); set platform: cpu (or null to let JAX choose), or install a "
            f"jax build with {cfg.platform.upper()} support (e.g. pip install -U 'jax[cuda12]' "
            "for an NVIDIA GPU)") from None
