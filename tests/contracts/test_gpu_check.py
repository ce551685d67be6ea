"""The prepared GPU check keeps working: its whole code path runs here on CPU with tiny widths (``--smoke``)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_on_cpu(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--device", "cpu", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["devices"]["ok"] and result["wide"]["ok"] and result["wide"]["layers"] == 2
    assert "reloaded export vs fake-quant logits" in proc.stdout
