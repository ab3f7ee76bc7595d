"""das-jax runs without torch: tensorboardX, which imports torch whenever it is installed, is
loaded with torch blocked (`run_log._summary_writer_class`), and a GGUF file's tokenizer is built
without torch, whether torch is installed (it is not imported) or not (simulated by blocking it)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorboardX")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_logger_writes_tensorboard_without_torch(tmp_path):
    code = (
        "import sys\n"
        "from das_jax.rl.run_log import RunLogger\n"
        f"logger = RunLogger({str(tmp_path)!r}, total_steps=1, progress=False, heartbeat_s=0)\n"
        "assert logger._tb is not None\n"
        "logger._tb.add_scalar('x', 1.0, 1)\n"
        "logger.close()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('torch') is not None:\n"
        "    import torch  # the block is lifted: torch stays importable\n"
        "    assert torch.zeros(2).sum().item() == 0\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert list((tmp_path / "tb").iterdir())  # the event file was written


def test_gguf_tokenizer_without_torch(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf_tokenizer import write_tokenizer_gguf
    path = write_tokenizer_gguf(tmp_path / "tok.gguf")
    code = ("import sys\n"
            "{block}"
            "from das_jax.models.tokenizer import Tokenizer\n"
            f"t = Tokenizer.from_gguf({path!r}, [2])\n"
            "assert sys.modules.get('torch') is None, 'torch imported'\n"
            "print(t.chat_prompt_ids('abc t', system='s'), t.encode('<think>ab'),\n"
            "      t.eos_token_ids)\n")
    outs = []
    for block in ("sys.modules['torch'] = None  # as if torch were not installed\n", ""):
        out = subprocess.run([sys.executable, "-c", code.format(block=block)], cwd=REPO,
                             capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO),
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        outs.append(out.stdout)
    assert outs[0] == outs[1] != ""
