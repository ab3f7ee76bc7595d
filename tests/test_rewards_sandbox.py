"""Tests for the code reward and its sandbox. Every hostile program here must cost exactly one
zero reward; the test process and the files it owns must be untouched."""

import os
import threading
import time

import pytest

from das_jax.data import load_humaneval, reward_kwargs
from das_jax.rl.rewards import build_program, code_reward, make_code_reward, run_in_sandbox, sandbox_capabilities

HUMANEVAL = "/work/shared/data/humaneval/HumanEval.jsonl.gz"
SLACK_S = 3.0


@pytest.fixture(scope="module")
def he0():
    return load_humaneval(HUMANEVAL, limit=1)[0]


def _reward(problem, completion, fn=code_reward):
    return fn([""], [completion], **reward_kwargs([problem]))[0]


def _uid_procs(uid):
    """Live (non-zombie) processes owned by ``uid``."""
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


def test_canonical_passes_wrong_fails(he0):
    assert _reward(he0, he0.metadata["canonical_solution"]) == 1.0
    assert _reward(he0, "    return False\n") == 0.0
    assert _reward(he0, "    return (\n") == 0.0  # syntax error
    # a chat-style answer: full function in a fenced block
    full = "Here you go:\n```python\n" + he0.prompt + he0.metadata["canonical_solution"] + "```\nDone."
    assert _reward(he0, full) == 1.0
    # harness passed as `answer` only (Problem.answer of a code problem)
    prog_answer = code_reward([""], [he0.metadata["canonical_solution"]], answer=[he0.answer],
                              code_prompt=[he0.prompt])
    assert prog_answer == [1.0]


def test_parallel_batch(he0):
    comps = [he0.metadata["canonical_solution"], "    return True\n", he0.metadata["canonical_solution"], "    1/0\n"]
    kw = reward_kwargs([he0] * 4)
    assert code_reward([""] * 4, comps, **kw) == [1.0, 0.0, 1.0, 0.0]


def test_early_exit_is_not_a_pass(he0):
    assert _reward(he0, "    return 1\nimport sys\nsys.exit(0)\n") == 0.0
    assert _reward(he0, "    return 1\nimport os\nos._exit(0)\n") == 0.0


def test_infinite_loop_times_out(he0):
    fn = make_code_reward(timeout_s=1.0)
    t0 = time.monotonic()
    assert _reward(he0, "    while True:\n        pass\n", fn) == 0.0
    assert _reward(he0, "    pass\nwhile True:\n    pass\n", fn) == 0.0
    assert time.monotonic() - t0 < 2 * (1.0 + SLACK_S)
    r = run_in_sandbox("while True:\n    pass\n", timeout_s=1.0)
    assert r.status == "timeout" and not r.passed and r.elapsed_s < 1.0 + SLACK_S


def test_huge_allocation(he0):
    assert _reward(he0, "    x = bytearray(50 * 10**9)\n    return True\n") == 0.0
    r = run_in_sandbox("x = bytearray(50 * 10**9)\n")
    assert r.status == "failed" and "MemoryError" in r.stderr


def test_cannot_delete_outside_files(he0, tmp_path):
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
    # attack at import time, then a correct solution: the reward may be 1, the file must survive
    _reward(he0, he0.metadata["canonical_solution"] + "\n" + attack)
    # attack without catching errors: reward 0
    assert _reward(he0, "    pass\n" + attack.replace("    except Exception:\n        pass\n", "    finally:\n        pass\n")) == 0.0
    r = run_in_sandbox(f"import os\nos.remove({str(sentinel)!r})\n")
    assert not r.passed and ("PermissionError" in r.stderr)
    assert sentinel.read_text() == "keep me"
    assert sentinel_dir.is_dir()


def test_sandbox_cwd_is_fresh_and_removed():
    r = run_in_sandbox("import os\nprint(os.getcwd(), os.environ['HOME'], os.listdir('.'))\nopen('junk.txt', 'w').write('x')\n")
    assert r.passed, r.stderr
    cwd, home, listing = r.stdout.split(" ", 2)
    assert cwd == home and listing.strip() == "[]"
    assert not os.path.exists(cwd)  # deleted afterwards


def test_no_network(he0):
    code = "    import socket\n    s = socket.socket()\n    s.connect(('127.0.0.1', 80))\n    return True\n"
    assert _reward(he0, code) == 0.0
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


def test_fork_bomb_guarded(he0):
    t0 = time.monotonic()
    bomb = "    import os\n    while True:\n        os.fork()\n"
    assert _reward(he0, bomb, make_code_reward(timeout_s=2.0)) == 0.0
    bomb2 = "    import subprocess\n    while True:\n        subprocess.Popen(['sleep', '100'])\n"
    assert _reward(he0, bomb2, make_code_reward(timeout_s=2.0)) == 0.0
    assert time.monotonic() - t0 < 2 * (2.0 + SLACK_S)


def test_fork_bomb_bypassing_guard_is_contained():
    caps = sandbox_capabilities()
    if not (caps.drop_privileges and caps.pid_namespace):
        pytest.skip(f"needs privilege drop + PID namespace to contain a real fork bomb safely: {caps}")
    before = set(_uid_procs(caps.drop_uid))  # e.g. another suite's sandboxes
    bomb = "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()\n"
    t0 = time.monotonic()
    r = run_in_sandbox(bomb, timeout_s=2.0, max_procs=16)
    assert not r.passed and time.monotonic() - t0 < 2.0 + SLACK_S
    deadline = time.monotonic() + 5.0
    while set(_uid_procs(caps.drop_uid)) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_uid_procs(caps.drop_uid)) - before


def test_code_reward_from_thread(he0):
    out = []
    t = threading.Thread(target=lambda: out.append(_reward(he0, he0.metadata["canonical_solution"])))
    t.start()
    t.join(timeout=30)
    assert out == [1.0]


def test_build_program_and_errors(he0):
    prog = build_program("    return True\n", code_prompt="def f(x):\n", test="def check(c):\n    assert c(1)\n",
                         entry_point="f")
    assert prog.startswith("def f(x):\n    return True\n") and prog.rstrip().endswith("check(f)")
    with pytest.raises(ValueError, match="test"):
        code_reward([""], ["x"], problem_id=["p"])
