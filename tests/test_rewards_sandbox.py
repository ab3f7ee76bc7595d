"""Tests for the code reward and its sandbox.

Every hostile completion here must cost exactly one zero reward, and the test process, its files
and the host must be untouched. The forging attacks are written against both designs: the old
launcher (verdict = a secret token written by the process that ran the untrusted code) and the
current one (verdict from a separate tests sandbox; the solution sandbox returns plain data).
"""

import gzip
import json
import logging
import os
import threading
import time

import pytest

from das_jax.rl.rewards import (
    CheckResult,
    SandboxLimits,
    build_program,
    check_solution,
    code_reward,
    make_code_reward,
    SandboxUnavailableError,
    run_in_sandbox,
    sandbox_capabilities,
)
from das_jax.rl.rewards import sandbox as sandbox_mod
from das_jax.rl.rewards.code_check import free_names, stub_functions
from das_jax.rl.rewards.sandbox_child import wire

HUMANEVAL = "/work/shared/data/humaneval/HumanEval.jsonl.gz"
SLACK_S = 5.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two small problems in HumanEval's format (prompt = signature + docstring; test = check(candidate)).
CLOSE = {
    "code_prompt": 'from typing import List\n\n\ndef has_close(numbers: List[float], threshold: float) -> bool:\n'
                   '    """True if two numbers of the list are closer than threshold."""\n',
    "test": "\n\ndef check(candidate):\n"
            "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n"
            "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False\n"
            "    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True\n"
            "    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 0.5) == False\n",
    "entry_point": "has_close",
    "canonical": "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n",
}
# The tests use a helper from the prompt (poly) and math.fabs, as HumanEval/32 does.
ZERO = {
    "code_prompt": "import math\n\n\ndef poly(xs: list, x: float):\n"
                   "    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n\n\n"
                   'def find_zero(xs: list):\n    """A zero of the polynomial with coefficients xs."""\n',
    "test": "\n\ndef check(candidate):\n    import math\n"
            "    for coeffs in ([1, 2], [-6, 11, -6, 1], [3, -1, 2, 5]):\n"
            "        solution = candidate(list(coeffs))\n"
            "        assert math.fabs(poly(coeffs, solution)) < 1e-4\n",
    "entry_point": "find_zero",
    "canonical": "    lo, hi = -1.0, 1.0\n    while poly(xs, lo) * poly(xs, hi) > 0:\n        lo, hi = 2 * lo, 2 * hi\n"
                 "    while hi - lo > 1e-10:\n        mid = (lo + hi) / 2\n"
                 "        if poly(xs, mid) * poly(xs, lo) > 0:\n            lo = mid\n        else:\n            hi = mid\n"
                 "    return lo\n",
}


def _reward(problem, completion, fn=code_reward):
    cols = {k: [problem[k]] for k in ("code_prompt", "test", "entry_point")}
    return fn([""], [completion], **cols)[0]


def _host_procs_of(uid):
    """Live (non-zombie) host processes owned by ``uid``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                st = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in st.splitlines() if ":" in line)
        if int(fields.get("Uid", "0").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            out.append(int(pid))
    return out


def _assert_no_procs_left(uid, wait_s=5.0):
    deadline = time.monotonic() + wait_s
    while _host_procs_of(uid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _host_procs_of(uid) == []


def _require_isolation():
    caps = sandbox_capabilities()
    if not caps.isolated:
        pytest.skip(f"Linux namespaces unavailable on this machine ({caps.reason}); the sandbox runs degraded")
    return caps


# ------------------------------------------------------------------------------------ correctness
def test_canonical_passes_wrong_fails():
    for prob in (CLOSE, ZERO):
        assert _reward(prob, prob["canonical"]) == 1.0
        assert _reward(prob, "") == 0.0  # the stub returns None
        assert _reward(prob, "    return 0\n") == 0.0
        assert _reward(prob, "    return (\n") == 0.0  # syntax error
    # a chat-style answer: the full function in a fenced block
    full = "Here you go:\n```python\n" + CLOSE["code_prompt"] + CLOSE["canonical"] + "```\nDone."
    assert _reward(CLOSE, full) == 1.0
    # harness passed as `answer` only (Problem.answer of a code problem): stubs found in the prompt
    harness = CLOSE["test"] + "\n\ncheck(has_close)\n"
    assert code_reward([""], [CLOSE["canonical"]], answer=[harness], code_prompt=[CLOSE["code_prompt"]]) == [1.0]
    # no prompt at all (MBPP style): the tests' free names are the solution's functions
    assert code_reward([""], ["def add(a, b):\n    return a + b\n"], answer=["assert add(2, 3) == 5\n"]) == [1.0]
    assert code_reward([""], ["def add(a, b):\n    return a - b\n"], answer=["assert add(2, 3) == 5\n"]) == [0.0]


def test_parallel_batch():
    comps = [CLOSE["canonical"], "    return True\n", CLOSE["canonical"], "    1/0\n"]
    cols = {k: [CLOSE[k]] * 4 for k in ("code_prompt", "test", "entry_point")}
    assert code_reward([""] * 4, comps, **cols) == [1.0, 0.0, 1.0, 0.0]


def test_values_keep_their_python_semantics():
    pair = {"code_prompt": "def pair(a):\n    '''(a, a)'''\n", "entry_point": "pair",
            "test": "def check(candidate):\n    assert candidate(1) == (1, 1)\n    assert candidate(2.5) == (2.5, 2.5)\n"}
    assert _reward(pair, "    return (a, a)\n") == 1.0
    assert _reward(pair, "    return [a, a]\n") == 0.0  # a list is not equal to a tuple
    from collections import namedtuple
    assert namedtuple  # a tuple subclass crosses as its base type
    assert _reward(pair, "    from collections import namedtuple\n    return namedtuple('P', 'x y')(a, a)\n") == 1.0
    # an exception the tests expect crosses as the same builtin type; an unknown one does not
    raises = {"code_prompt": "def sqrt(x):\n    '''sqrt; ValueError if x < 0'''\n", "entry_point": "sqrt",
              "test": "def check(candidate):\n    assert candidate(4) == 2\n"
                      "    try:\n        candidate(-1)\n    except ValueError:\n        pass\n"
                      "    else:\n        assert False\n"}
    assert _reward(raises, "    if x < 0:\n        raise ValueError(x)\n    return x ** 0.5\n") == 1.0
    assert _reward(raises, "    class E(Exception):\n        pass\n    if x < 0:\n        raise E()\n"
                           "    return x ** 0.5\n") == 0.0
    assert _reward(raises, "    return x ** 0.5 if x >= 0 else 0\n") == 0.0


def test_wire_format_round_trip_and_rejects():
    values = [None, True, 0, -(10 ** 30), 1.5, float("inf"), "é\n", b"\x00\xff", 1 + 2j, [1, (2, 3)], (),
              {(1, 2): {"a": [None]}, 3: frozenset({1})}, {1, 2}]
    for v in values:
        back = wire.decode(wire.loads(wire.dumps(wire.encode(v))))
        assert back == v and type(back) is type(v)
    nan = wire.decode(wire.loads(wire.dumps(wire.encode(float("nan")))))
    assert nan != nan

    class Evil(int):
        def __eq__(self, other):
            return True

    assert type(wire.decode(wire.encode(Evil(3)))) is int and wire.decode(wire.encode(Evil(3))) == 3
    for bad in (object(), lambda: 0, iter([1]), type):
        with pytest.raises(wire.WireError):
            wire.encode(bad)
    deep = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(wire.WireError):
        wire.encode(deep)
    for msg in ('{"x": 1}', '{"t": 1}', '{"d": [[1]]}', '{"f": "oops"}', '{"t": [], "s": []}'):
        with pytest.raises(wire.WireError):
            wire.decode(json.loads(msg))
    with pytest.raises(wire.WireError):
        wire.loads("NaN")


def test_free_names_and_stubs():
    assert stub_functions(CLOSE["code_prompt"]) == ["has_close"]
    assert stub_functions(ZERO["code_prompt"]) == ["find_zero"]  # poly has a body: a trusted helper
    assert free_names(ZERO["code_prompt"], ZERO["test"] + "\ncheck(find_zero)\n") == []
    assert free_names("import math\nassert f(math.pi) == g(x=1)\nfor i in range(3):\n    h(i)\n") == ["f", "g", "h"]


def test_build_program_and_errors():
    prog = build_program("    return True\n", code_prompt="def f(x):\n", test="def check(c):\n    assert c(1)\n",
                         entry_point="f")
    assert prog.startswith("def f(x):\n    return True\n") and prog.rstrip().endswith("check(f)")
    with pytest.raises(ValueError, match="test"):
        code_reward([""], ["x"], problem_id=["p"])
    with pytest.raises(ValueError, match="memory_mb"):
        make_code_reward(memory_mb=256, max_procs=16)
    # unusable tests (a dataset problem) cost that sample only
    assert code_reward([""] * 2, ["def f():\n    return 1\n"] * 2, answer=["assert f() ==", "assert f() == 1"]) \
        == [0.0, 1.0]


# ------------------------------------------------------------------------------- forged verdicts
# The object compares equal to everything: under the old design (tests in the same process)
# every `assert candidate(x) == y` passed, reward 1.0.
EQ_ATTACK = (
    "    class Anything:\n"
    "        def __eq__(self, other):\n            return True\n"
    "        def __ne__(self, other):\n            return False\n"
    "        def __lt__(self, other):\n            return True\n"
    "        __gt__ = __le__ = __ge__ = __lt__\n"
    "        def __hash__(self):\n            return 0\n"
    "    return Anything()\n"
)

# Walks sys._getframe() up to the launcher, collects every secret-looking string and every
# descriptor it can find, writes the secrets and forged verdicts to every descriptor, then exits
# with status 0 before any test runs. Under the old design (commit 41ef7c8: the launcher kept the
# success token in a local and accepted it on stdout) this scored 1.0.
FRAME_ATTACK = '''    return None
import os, sys
_secrets, _fds = [], set(range(0, 64))
_f = sys._getframe()
while _f is not None:
    for _scope in (_f.f_locals, _f.f_globals):
        for _v in list(_scope.values()):
            if isinstance(_v, str) and 16 <= len(_v) <= 128 and _v.isalnum():
                _secrets.append(_v)
            if isinstance(_v, int) and 0 <= _v < 1024:
                _fds.add(_v)
            if isinstance(_v, dict):
                _fds.update(x for x in _v.values() if isinstance(x, int) and 0 <= x < 1024)
    _f = _f.f_back
try:
    _fds.update(int(x) for x in os.listdir("/proc/self/fd"))
except OSError:
    pass
_forged = [b"done\\n", b'{"verdict": "pass", "calls": 7}\\n', b'{"id": 0, "ok": true}\\n']
_forged += [("\\n" + s + "\\n").encode() for s in _secrets]
for _fd in sorted(_fds):
    for _msg in _forged:
        try:
            os.write(_fd, _msg)
        except OSError:
            pass
os._exit(0)
'''


def test_object_equal_to_everything_scores_zero():
    assert _reward(CLOSE, EQ_ATTACK) == 0.0
    # subclasses of plain types cross as their base value: their __eq__ never runs in the tests
    assert _reward(CLOSE, "    class T(int):\n        def __eq__(self, o):\n            return True\n"
                          "        __hash__ = int.__hash__\n    return T(7)\n") == 0.0
    assert _reward(ZERO, EQ_ATTACK) == 0.0  # math.fabs(poly(xs, Anything())) -> the call fails


def test_frame_walking_token_forgery_scores_zero():
    assert _reward(CLOSE, FRAME_ATTACK) == 0.0
    assert _reward(ZERO, FRAME_ATTACK) == 0.0
    # the same attack does forge a signal kept in the attacked process: that is why rewards do not
    # use run_in_sandbox's `passed` (it proves the attack works, so the test above can fail)
    control = FRAME_ATTACK.replace("    return None\n", "", 1).replace("_forged += [", "_forged = _forged[:1] + 0 * [")
    assert run_in_sandbox(control).passed


def test_cheats_score_zero():
    cheats = {
        "exit before the asserts": "    return None\nimport sys\nsys.exit(0)\n",
        "os._exit before the asserts": "    return None\nimport os\nos._exit(0)\n",
        "exit inside the call": "    import sys\n    sys.exit(0)\n",
        "os._exit inside the call": "    import os\n    os._exit(0)\n",
        "print success markers": "    print('done')\n    print('{\"verdict\": \"pass\", \"calls\": 4}', flush=True)\n"
                                 "    return None\n",
        "monkeypatch builtins": "    return None\nimport builtins\nbuiltins.AssertionError = None\n"
                                "builtins.abs = lambda x: 0\n",
        "redefine check": "    return None\ndef check(candidate):\n    pass\n",
    }
    for name, code in cheats.items():
        assert _reward(CLOSE, code) == 0.0, name
    # HumanEval/32-style tests call math.fabs: patching it (which made a wrong answer pass when the
    # tests shared the solution's process) changes nothing in the tests' own process
    assert _reward(ZERO, "    return 0.0\nimport math\nmath.fabs = lambda x: 0.0\n") == 0.0
    assert _reward(ZERO, "    return 0.0\ndef poly(xs, x):\n    return 0.0\n") == 0.0


def test_infinite_loop_times_out():
    fn = make_code_reward(timeout_s=1.0)
    t0 = time.monotonic()
    assert _reward(CLOSE, "    while True:\n        pass\n", fn) == 0.0
    assert _reward(CLOSE, "    pass\nwhile True:\n    pass\n", fn) == 0.0
    assert time.monotonic() - t0 < 2 * (1.0 + SLACK_S)
    r = run_in_sandbox("while True:\n    pass\n", timeout_s=1.0)
    assert r.status == "timeout" and not r.passed and r.elapsed_s < 1.0 + SLACK_S
    res = check_solution("def f():\n    while True:\n        pass\n", "assert f() == 1\n",
                         limits=SandboxLimits(timeout_s=1.0))
    assert isinstance(res, CheckResult) and res.status == "timeout" and not res.passed


def test_timeout_kills_the_whole_sandbox_with_its_children():
    _require_isolation()
    prog = (
        "import ctypes, os, time\n"
        "print(os.getuid(), flush=True)\n"
        "if os.fork() == 0:\n"
        "    ctypes.CDLL(None).setsid()  # leave the process group\n"
        "    while True:\n        time.sleep(1)\n"
        "while True:\n    pass\n"
    )
    r = run_in_sandbox(prog, timeout_s=1.5, guard=False, max_procs=4)
    assert r.status == "timeout", r.stderr
    _assert_no_procs_left(int(r.stdout.split()[0]))


def _sandbox_uid_procs():
    lo, hi = sandbox_mod._UID_RANGE
    out = set()
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if lo <= uid < hi:
            out.add(int(pid))
    return out


def test_sandboxes_die_with_the_caller(tmp_path):
    caps = sandbox_capabilities()
    if not caps.prefix or "--pdeathsig" not in caps.prefix or not caps.drop_privileges:
        pytest.skip(f"needs setpriv --pdeathsig and a fresh uid per sandbox: {caps}")
    script = (
        "import os, sys, threading, time\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "from das_jax.rl.rewards import SandboxLimits, check_solution\n"
        "threading.Thread(target=lambda: check_solution('import time\\ndef f():\\n    time.sleep(1000)\\n',\n"
        "    'assert f() == 1\\n', limits=SandboxLimits(timeout_s=100)), daemon=True).start()\n"
        "time.sleep(2.0)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    import subprocess
    import sys

    before = _sandbox_uid_procs()
    # the killed caller cannot delete its host-side job dirs: keep them under tmp_path
    subprocess.run([sys.executable, "-c", script], timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)})
    deadline = time.monotonic() + 5.0
    while _sandbox_uid_procs() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _sandbox_uid_procs() - before


def test_fork_bombs_are_contained():
    assert _reward(CLOSE, "    import os\n    while True:\n        os.fork()\n", make_code_reward(timeout_s=2.0)) == 0.0
    assert _reward(CLOSE, "    import subprocess\n    while True:\n        subprocess.Popen(['sleep', '100'])\n",
                   make_code_reward(timeout_s=2.0)) == 0.0
    bomb = "import ctypes, os\nprint(os.getuid(), flush=True)\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()\n"
    # default max_procs=1: no fork at all; max_procs=16: at most 16 processes, all killed at the end
    # (each has its own CPU limit: the wall-clock backstop ends the group)
    for max_procs in (1, 16):
        t0 = time.monotonic()
        r = run_in_sandbox(bomb, timeout_s=2.0, guard=False, max_procs=max_procs, wall_timeout_s=4.0)
        assert not r.passed and time.monotonic() - t0 < 4.0 + SLACK_S
        if sandbox_capabilities().drop_privileges:
            _assert_no_procs_left(int(r.stdout.split()[0]))


def test_memory_limit_bounds_the_sandbox_as_a_whole():
    three_children = (
        "import os\n"
        "pids = []\n"
        "for _ in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            x = bytes(700 * 2**20)  # calloc: reserved, not touched\n"
        "            os._exit(0)\n"
        "        except MemoryError:\n"
        "            os._exit(3)\n"
        "    pids.append(pid)\n"
        "codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]\n"
        "assert codes == [0, 0, 0], f'children exit codes {codes}'\n"
    )
    # no fork allowed (default)
    r = run_in_sandbox(three_children, memory_mb=1024, guard=False)
    assert not r.passed and "BlockingIOError" in r.stderr, r.stderr
    # forks allowed: 1 GiB is shared out, so no child gets 700 MB
    r = run_in_sandbox(three_children, memory_mb=1024, max_procs=4, guard=False)
    assert not r.passed and "children exit codes [3, 3, 3]" in r.stderr, r.stderr
    # controls: one process may take 700 MB; three children may fork under a larger budget
    assert run_in_sandbox("x = bytes(700 * 2**20)\n", memory_mb=1024).passed
    small = three_children.replace("700 * 2**20", "2**20")
    assert run_in_sandbox(small, memory_mb=1024, max_procs=4, guard=False).passed
    # and a huge allocation fails cleanly
    r = run_in_sandbox("x = bytearray(50 * 10**9)\n")
    assert r.status == "failed" and "MemoryError" in r.stderr
    assert _reward(CLOSE, "    x = bytearray(50 * 10**9)\n    return True\n") == 0.0


# ------------------------------------------------------------------------------------ isolation
def test_nothing_outside_the_sandbox_is_readable(tmp_path):
    _require_isolation()
    secret = tmp_path / "secret.txt"  # under the host's /tmp
    secret.write_text("host secret")
    paths = [str(secret), str(tmp_path), os.path.join(REPO, "das_jax", "__init__.py"), REPO, "/work",
             HUMANEVAL, "/etc/passwd", "/root/.bashrc", "/home", "/var", "/run"]
    prog = (
        "import json, os\n"
        f"paths = {paths!r}\n"
        "res = {'exists': [p for p in paths if os.path.exists(p)], 'read': []}\n"
        "for p in paths:\n"
        "    try:\n"
        "        with open(p, 'rb') as f:\n"
        "            f.read(1)\n"
        "        res['read'].append(p)\n"
        "    except OSError:\n"
        "        pass\n"
        "pids = sorted(int(x) for x in os.listdir('/proc') if x.isdigit())\n"
        "cmdlines = []\n"
        "for pid in pids:\n"
        "    try:\n"
        "        cmdlines.append(open(f'/proc/{pid}/cmdline', 'rb').read().decode(errors='replace'))\n"
        "    except OSError:\n"
        "        pass\n"
        "res['pids'] = pids\n"
        "res['pytest_seen'] = any('pytest' in c for c in cmdlines)\n"
        "res['tmp'] = os.listdir('/tmp')\n"
        "print(json.dumps(res))\n"
    )
    r = run_in_sandbox(prog)
    assert r.passed, r.stderr
    res = json.loads(r.stdout)
    assert res["exists"] == [] and res["read"] == []
    assert res["pids"] == [1, 2] and not res["pytest_seen"]  # host /proc is not visible: supervisor + program
    assert res["tmp"] == []  # a private, empty /tmp
    assert secret.read_text() == "host secret"


def test_files_written_do_not_persist():
    _require_isolation()
    mark = f"das_jax_sbx_mark_{os.getpid()}_{time.monotonic_ns()}"
    prog = (
        "import os\n"
        f"mark = {mark!r}\n"
        "for d in ('/tmp', '/dev/shm', os.getcwd(), os.environ['HOME']):\n"
        "    with open(os.path.join(d, mark), 'w') as f:\n"
        "        f.write('x')\n"
        "blocked = []\n"
        "for d in ('/', '/usr', '/etc', '/root', '/proc'):\n"
        "    try:\n"
        "        open(os.path.join(d, mark), 'w').close()\n"
        "    except OSError:\n"
        "        blocked.append(d)\n"
        "print(os.getcwd(), ','.join(blocked))\n"
    )
    r = run_in_sandbox(prog)
    assert r.passed, r.stderr
    cwd, blocked = r.stdout.split()
    assert blocked.split(",") == ["/", "/usr", "/etc", "/root", "/proc"]
    for d in ("/tmp", "/dev/shm", cwd):
        assert not os.path.exists(os.path.join(d, mark))
    # a writable tmpfs is size-capped
    r = run_in_sandbox("open('/tmp/big', 'wb').write(b'x' * (40 * 2**20))\n", max_file_mb=16)
    assert not r.passed


def test_cannot_delete_outside_files(tmp_path):
    sentinel_dir = tmp_path / "precious"
    sentinel_dir.mkdir()
    sentinel = sentinel_dir / "sentinel.txt"
    sentinel.write_text("keep me")
    attack = (
        "import os, shutil, posix, pathlib\n"
        f"P = {str(sentinel)!r}\n"
        f"D = {str(sentinel_dir)!r}\n"
        "for f in (lambda: os.remove(P), lambda: os.unlink(P), lambda: posix.unlink(P),\n"
        "          lambda: pathlib.Path(P).unlink(), lambda: shutil.rmtree(D),\n"
        "          lambda: open(P, 'w').write('pwned'), lambda: os.system('rm -rf ' + D)):\n"
        "    try:\n"
        "        f()\n"
        "    except Exception:\n"
        "        pass\n"
    )
    assert _reward(CLOSE, CLOSE["canonical"] + "\n" + attack) == 1.0  # the attack is harmless
    r = run_in_sandbox(attack, guard=False)
    assert r.passed, r.stderr
    assert sentinel.read_text() == "keep me" and sentinel_dir.is_dir()


def test_no_network():
    code = "    import socket\n    s = socket.socket()\n    s.connect(('127.0.0.1', 80))\n    return True\n"
    assert _reward(CLOSE, code) == 0.0
    r = run_in_sandbox("import _socket\n_socket.socket()\n")
    assert not r.passed and "PermissionError" in r.stderr
    if sandbox_capabilities().net_namespace:
        # even without the guard, there is no network inside the namespace
        prog = (
            "import socket\n"
            "try:\n"
            "    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
            "except OSError:\n"
            "    pass\n"
            "else:\n"
            "    raise SystemExit('network reachable')\n"
            "with open('/proc/net/dev') as f:\n"
            "    ifaces = [l.split(':')[0].strip() for l in f.readlines()[2:]]\n"
            "assert ifaces == ['lo'], ifaces\n"
        )
        r = run_in_sandbox(prog, guard=False)
        assert r.passed, r.stderr


def test_code_reward_from_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(_reward(CLOSE, CLOSE["canonical"])))
    t.start()
    t.join(timeout=60)
    assert out == [1.0]


# ------------------------------------------------------------------- degraded machines, exploits
# Reads every job file / tests it can find in the temp dirs, and answers with the expected values
# it finds there (the attack that scored 1.0 in the old degraded mode).
GLOB_ATTACK = """    import glob, json, os, re, tempfile
    found = []
    for root in {tmps!r} + [tempfile.gettempdir(), '/tmp', '/dev/shm']:
        for p in glob.glob(os.path.join(root, '**'), recursive=True):
            try:
                with open(p, errors='replace') as f:
                    found.append(f.read())
            except OSError:
                pass
    for text in found:
        if 'assert candidate' in text:
            m = re.search(r'candidate\\((\\[.*?\\]), ([0-9.]+)\\) == (True|False)', text)
            if m and eval(m.group(1)) == numbers and float(m.group(2)) == threshold:
                return m.group(3) == 'True'
    raise RuntimeError(f'read {{len(found)}} files')
"""
# Reads the HumanEval dataset and returns what its canonical solution returns.
DATASET_ATTACK = """    import gzip, json
    with gzip.open({path!r}, 'rt') as f:
        rows = [json.loads(line) for line in f]
    row = next(r for r in rows if r['entry_point'] == 'has_close_elements')
    g = {{}}
    exec(row['prompt'] + row['canonical_solution'], g)
    return g['has_close_elements'](numbers, threshold)
"""
KILL_PARENT = "    return None\nimport ctypes, os\nctypes.CDLL(None).kill(os.getppid(), 9)\n"


def _sbx_dirs(pid=None):
    import glob
    import tempfile

    return glob.glob(os.path.join(tempfile.gettempdir(), f"das_jax_sbx_{'' if pid is None else pid}*"))


@pytest.fixture
def no_unshare(monkeypatch):
    """This machine as one without unshare (Docker without CAP_SYS_ADMIN, some clusters)."""
    monkeypatch.setattr(sandbox_mod, "_which_unshare", lambda: None)
    monkeypatch.setattr(sandbox_mod, "_warned_unisolated", False)
    sandbox_capabilities(refresh=True)
    yield
    monkeypatch.undo()
    sandbox_capabilities(refresh=True)


def test_without_isolation_code_rewards_refuse_in_one_line(no_unshare):
    caps = sandbox_capabilities()
    assert not caps.isolated and caps.reason == "unshare not found on PATH (util-linux)"
    for call in (lambda: _reward(CLOSE, CLOSE["canonical"]), lambda: make_code_reward().self_test(),
                 lambda: run_in_sandbox("pass")):
        with pytest.raises(SandboxUnavailableError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "unshare not found on PATH" in msg and "util-linux" in msg
        assert "user namespaces" in msg and "unisolated" in msg
    # combine_rewards / safe_reward do not turn the refusal into zeros
    from das_jax.rl.rewards import combine_rewards
    with pytest.raises(SandboxUnavailableError):
        combine_rewards([code_reward])([""], [CLOSE["canonical"]],
                                       **{k: [CLOSE[k]] for k in ("code_prompt", "test", "entry_point")})


def test_degraded_reason_is_concrete(monkeypatch):
    """A failing user-namespace probe is named by what failed, never "()"."""
    fail = ("sh", "-c", "echo 'unshare: unshare failed: Operation not permitted' >&2; exit 1", "--")
    cands = [sandbox_mod.SandboxCapabilities("user-namespaces", fail, True, True, True, True,
                                             sandbox_mod._interpreters()[0])]
    monkeypatch.setattr(sandbox_mod, "_candidates", lambda: cands)
    monkeypatch.setattr(sandbox_mod, "_userns_disabled", lambda: "")
    try:
        caps = sandbox_capabilities(refresh=True)
        assert caps.mode == "none"
        assert caps.reason == "user namespaces disabled: unshare: unshare failed: Operation not permitted"
        with pytest.raises(SandboxUnavailableError, match="Operation not permitted"):
            make_code_reward(sandbox="unisolated").self_test()
    finally:
        monkeypatch.undo()
        sandbox_capabilities(refresh=True)


def test_unisolated_opt_in_judges_and_withstands_the_exploits(no_unshare, caplog, tmp_path):
    import tempfile

    with caplog.at_level(logging.WARNING, logger="das_jax.rl.rewards.sandbox"):
        fn = make_code_reward(sandbox="unisolated", timeout_s=2.0)
        fn.self_test()
    assert sandbox_capabilities().mode == "unisolated"
    assert any("UNISOLATED" in r.getMessage() and "unshare not found on PATH" in r.getMessage()
               for r in caplog.records)
    assert _reward(CLOSE, CLOSE["canonical"], fn) == 1.0 and _reward(CLOSE, "    return 0\n", fn) == 0.0
    assert _reward(CLOSE, EQ_ATTACK, fn) == 0.0
    assert _reward(CLOSE, FRAME_ATTACK, fn) == 0.0
    # the tests, the expected values and the dataset cannot be read
    attack = GLOB_ATTACK.format(tmps=[tempfile.gettempdir(), str(tmp_path)])
    assert _reward(CLOSE, attack, fn) == 0.0
    if os.path.exists(HUMANEVAL):
        assert _reward(CLOSE, DATASET_ATTACK.format(path=HUMANEVAL), fn) == 0.0
    # the trainer cannot be signalled (the kill fails, a correct solution after it is judged as
    # such), and no sandbox dir stays behind
    assert _reward(CLOSE, KILL_PARENT + CLOSE["code_prompt"] + CLOSE["canonical"], fn) == 1.0
    assert _reward(CLOSE, "    import ctypes, os\n    ctypes.CDLL(None).kill(-1, 9)\n    return True\n", fn) == 0.0
    assert _sbx_dirs(os.getpid()) == []
    # CPU limits hold
    assert run_in_sandbox("while True:\n    pass\n", timeout_s=1.0, sandbox="unisolated").status == "timeout"


def test_exploits_score_zero_in_the_default_mode(tmp_path):
    import tempfile

    _require_isolation()
    assert _reward(CLOSE, GLOB_ATTACK.format(tmps=[tempfile.gettempdir(), str(tmp_path)])) == 0.0
    if os.path.exists(HUMANEVAL):
        assert _reward(CLOSE, DATASET_ATTACK.format(path=HUMANEVAL)) == 0.0
    assert _reward(CLOSE, KILL_PARENT) == 0.0


def _runner_procs():
    """Live sandbox runner processes (by command line)."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"sandbox_child/runner.py" in cmd and state != "Z":
            out.append(int(p))
    return set(out)


@pytest.mark.parametrize("mode", ["isolated", "unisolated"])
def test_dead_trainer_leaves_no_sandbox_dirs_or_processes(mode, tmp_path):
    """The caller is SIGKILLed while a sandbox runs: its processes die and its dirs go."""
    import glob
    import subprocess
    import sys

    if mode == "isolated":
        _require_isolation()
    script = (
        "import os, sys, threading, time\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "from das_jax.rl.rewards import sandbox as s\n"
        "from das_jax.rl.rewards import SandboxLimits, check_solution\n"
        + ("s._which_unshare = lambda: None\n" if mode == "unisolated" else "") +
        "threading.Thread(target=lambda: check_solution('import time\\ndef f():\\n    time.sleep(1000)\\n',\n"
        f"    'assert f() == 1\\n', limits=SandboxLimits(timeout_s=100), sandbox={mode!r}), daemon=True).start()\n"
        "time.sleep(3.0)\n"
        "print(os.getpid(), flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    before = _runner_procs()
    out = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    pid = int(out.stdout.split()[0])

    def left():
        return [p for root in (str(tmp_path), "/tmp", "/var/tmp", "/dev/shm")
                for p in glob.glob(os.path.join(root, f"das_jax_sbx_{pid}_*"))]

    deadline = time.monotonic() + 10.0
    while (left() or _runner_procs() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left() == [] and _runner_procs() - before == set()


def test_control_flow_exceptions_do_not_cross():
    prob = {"code_prompt": "def f(x):\n    '''2 x'''\n", "entry_point": "f",
            "test": "def check(candidate):\n"
                    "    assert all(map(lambda p: candidate(p[0]) == p[1], [(1, 2), (2, 4), (3, 6)]))\n"}
    assert _reward(prob, "    return 2 * x\n") == 1.0
    for exc in ("StopIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit", "StopAsyncIteration"):
        assert _reward(prob, f"    raise {exc}\n") == 0.0, exc
    # what the tests see: one fixed type (plain builtin errors also as themselves)
    seen = ("def check(candidate):\n    try:\n        candidate(1)\n"
            "    except Exception as e:\n        assert type(e).__name__ == {name!r}, type(e).__name__\n"
            "        assert {check}\n    else:\n        assert False\n")
    probe = {"code_prompt": "def f(x):\n    '''?'''\n", "entry_point": "f"}
    assert _reward({**probe, "test": seen.format(name="CandidateCallError", check="True")},
                   "    raise StopIteration\n") == 1.0
    value = {**probe, "test": seen.format(name="CandidateValueError", check="isinstance(e, ValueError)")}
    assert _reward(value, "    raise ValueError(x)\n") == 1.0
    assert _reward(value, "    class ValueError(StopIteration):\n        pass\n    raise ValueError\n") == 0.0


def test_big_ints_and_large_results_cross():
    big = {"code_prompt": "def f(n):\n    '''10 ** n + 1'''\n", "entry_point": "f",
           "test": "def check(candidate):\n    assert candidate(5000) == 10 ** 5000 + 1\n"}
    assert _reward(big, "    return 10 ** n + 1\n") == 1.0
    assert _reward(big, "    return 10 ** n\n") == 0.0
    arg = {"code_prompt": "def g(x):\n    '''x + 1'''\n", "entry_point": "g",
           "test": "def check(candidate):\n    assert candidate(-(10 ** 5000)) == 1 - 10 ** 5000\n"}
    assert _reward(arg, "    return x + 1\n") == 1.0
    # a 20 MB result (over the old 16 MB limit) crosses
    large = {"code_prompt": "def h(n):\n    '''n x'''\n", "entry_point": "h",
             "test": "def check(candidate):\n    assert candidate(20_000_000) == 'x' * 20_000_000\n"}
    assert _reward(large, "    return 'x' * n\n") == 1.0
    # over the limit: reported as such and counted, not a silent 0
    fn = make_code_reward(max_message_mb=1)
    small = dict(large, test="def check(candidate):\n    assert candidate(2_000_000) == 'x' * 2_000_000\n")
    assert _reward(small, "    return 'x' * n\n", fn) == 0.0
    assert fn.events.take() == {"too_large": 1}
    res = check_solution("def h(n):\n    return 'x' * n\n", "assert h(2_000_000)\n", max_message_mb=1)
    assert res.status == "too_large"
    res = check_solution("def h(s):\n    return 1\n", "assert h('x' * 2_000_000)\n", max_message_mb=1)
    assert res.status == "too_large"


def test_values_nested_past_the_wire_limit_are_reported_as_too_large():
    """A correct result (or argument) nested deeper than the wire allows is reported and counted
    as `too_large`, like an oversize message, not a silent failure; shallow ones cross."""
    nest = {"code_prompt": "def f(n):\n    \"\"\"n nested lists\"\"\"\n", "entry_point": "f",
            "test": "def check(candidate):\n    x = []\n    for _ in range(100):\n"
                    "        x = [x]\n    assert candidate(100) == x\n"}
    sol = "    x = []\n    for _ in range(n):\n        x = [x]\n    return x\n"
    fn = make_code_reward()
    assert _reward(nest, sol, fn) == 0.0
    assert fn.events.take() == {"too_large": 1}
    shallow = dict(nest, test=nest["test"].replace("100", "30"))
    assert _reward(shallow, sol) == 1.0
    res = check_solution("def g(x):\n    return 1\n",
                         "x = []\nfor _ in range(100):\n    x = [x]\nassert g(x) == 1\n")
    assert res.status == "too_large"


# appended to a completion: burns {s} seconds of CPU once, when the solution is loaded
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}:\n    pass\n"


def test_time_limit_counts_the_solution_cpu_not_the_machine_load(caplog):
    """Six correct samples, each burning 0.6 s of CPU, six workers on (at most) 2 cores with a
    1 s limit: 3.6 s of CPU in all, more than the limit in wall-clock terms. All pass."""
    fn = make_code_reward(timeout_s=1.0, num_workers=6)
    cols = {k: [CLOSE[k]] * 6 for k in ("code_prompt", "test", "entry_point")}
    sol = CLOSE["canonical"] + BURN.format(s=0.6)
    assert fn([""] * 6, [sol] * 6, **cols) == [1.0] * 6
    assert fn.events.take() == {}
    # a sample over its CPU time is a counted, logged timeout
    with caplog.at_level(logging.WARNING, logger="das_jax.rl.rewards.code_reward"):
        assert fn([""] * 2, [CLOSE["canonical"] + BURN.format(s=3), sol], **{k: v[:2] for k, v in cols.items()}) \
            == [0.0, 1.0]
    assert fn.events.take() == {"timeout": 1}
    assert sum("timeout 1" in r.getMessage() for r in caplog.records) == 1


def test_self_test_passes_here_and_stops_a_broken_sandbox(monkeypatch):
    import tempfile

    make_code_reward().self_test()
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/das_jax_no_tmp")
    with pytest.raises(SandboxUnavailableError) as e:
        make_code_reward().self_test()
    assert "\n" not in str(e.value) and "rewards.sandbox" in str(e.value) and "self-test" in str(e.value)


def test_default_workers_from_the_cpu_count():
    from das_jax.rl.rewards import default_workers

    assert default_workers() == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="sandbox"):
        make_code_reward(sandbox="none")


@pytest.mark.slow
def test_all_humaneval_canonical_solutions_pass_and_stubs_fail():
    if not os.path.exists(HUMANEVAL):
        pytest.skip(f"HumanEval file not present at {HUMANEVAL}")
    with gzip.open(HUMANEVAL, "rt") as f:
        rows = [json.loads(line) for line in f]
    cols = {"code_prompt": [r["prompt"] for r in rows], "test": [r["test"] for r in rows],
            "entry_point": [r["entry_point"] for r in rows]}
    n = len(rows)
    fn = make_code_reward(timeout_s=10.0)
    assert fn([""] * n, [r["canonical_solution"] for r in rows], **cols) == [1.0] * n
    assert fn([""] * n, [""] * n, **cols) == [0.0] * n
    k = 20
    assert fn([""] * k, [EQ_ATTACK] * k, **{c: v[:k] for c, v in cols.items()}) == [0.0] * k


# ------------------------------------------------------------------------ config / trainer hooks
def test_rewards_config_section_builds_the_code_reward():
    from das_jax.config import ConfigError, config_from_dict
    from das_jax.rl.rewards import reward_fns_from_config

    cfg = config_from_dict({}, ["grpo.reward_funcs=[code, format]", "rewards.sandbox=unisolated",
                                "rewards.workers=3", "rewards.timeout_s=2"])
    code, fmt = reward_fns_from_config(cfg.grpo.reward_funcs, cfg.rewards)
    assert code.sandbox == "unisolated" and code is not code_reward and fmt.__name__ == "format_reward"
    for bad, key in (("rewards.sandbox=none", "rewards.sandbox"), ("rewards.workers=0", "rewards.workers"),
                     ("rewards.timeout_s=0", "rewards.timeout_s")):
        with pytest.raises(ConfigError, match=key):
            config_from_dict({}, [bad])


def test_train_refuses_in_one_line_before_the_model_loads(no_unshare, tmp_path, capsys):
    from das_jax.cli import main

    rc = main(["train", "--set", f"output_dir={tmp_path / 'run'}", "--set", "model.source=/nonexistent/model",
               "--set", "grpo.reward_funcs=[code]", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "unshare not found on PATH" in err[0] and "rewards.sandbox: unisolated" in err[0]
    assert "/nonexistent/model" not in err[0]  # stopped before the model


def test_trainer_reports_reward_timeouts(tmp_path):
    from das_jax.config import config_from_dict
    from das_jax.data import Problem
    from das_jax.rl.rewards import RewardEvents
    from das_jax.rl.trainer import GRPOTrainer
    from das_jax.testing import CharTokenizer, tiny_model_config, tiny_params

    calls = []

    def reward(prompts, completions, **kw):
        reward.events.add("timeout", 2)
        return [0.5] * len(completions)

    reward.events = RewardEvents()
    reward.self_test = lambda: calls.append("self_test")
    cfg = config_from_dict({
        "output_dir": str(tmp_path / "run"), "drafter": "none",
        "data": {"kind": "arithmetic", "chat": False, "instruction": ""},
        "rollout": {"max_new_tokens": 4, "temperature": 1.0, "max_slots": 4, "max_cache_len": 64},
        "grpo": {"num_generations": 2, "prompts_per_step": 1, "micro_batch_size": 2, "beta": 0.0},
        "train": {"steps": 1, "save_every": 0, "seed": 0}})
    mc = tiny_model_config()
    trainer = GRPOTrainer(cfg, model=(mc, tiny_params(mc), CharTokenizer()),
                          problems=[Problem("p0", "1 plus 1", "2")], reward_fns=[reward])
    assert calls == ["self_test"]
    records = trainer.train(progress=False)
    assert records[0]["reward_timeouts"] == 2
