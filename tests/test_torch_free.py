"""The training process does not import torch (~0.3 GB of memory): tensorboardX, which imports
torch whenever it is installed, is loaded with torch blocked (`run_log._summary_writer_class`);
the GGUF tokenizer is tests/test_gguf_tokenizer.py's."""
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
