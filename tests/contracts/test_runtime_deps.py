"""No transformers at run time: the whole path runs with transformers, huggingface_hub, accelerate and
compressed-tensors made unimportable, and imports nothing beyond torch, numpy, safetensors, tqdm and regex.

tests/contracts/test_architecture.py checks the import statements; this runs the code. A fresh interpreter blocks the test-only
packages with an import hook, then does what a user does (1-process group, sharded load, calibration with
SmoothQuant + GPTQ, export, reload, perplexity) and reports which top-level modules it imported that neither the
standard library nor the declared dependencies (themselves imported first, with what they import) account for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from _paths import test_dirs

SCRIPT = r"""
import importlib.abc, json, sys
BLOCKED = {"transformers", "huggingface_hub", "accelerate", "compressed_tensors"}
ATTEMPTS = []  # also an import that is tried and its failure caught

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            ATTEMPTS.append(name)
            raise ImportError(f"{name} is blocked: shardcal must not need it at run time")
        return None

sys.meta_path.insert(0, Block())
import numpy, regex, safetensors.torch, torch, torch.distributed, torch.distributed.fsdp, tqdm, tqdm.auto  # the deps
before = {m.split(".")[0] for m in sys.modules}

sys.path[:0] = TESTS
from _tiny_models import make_tiny_checkpoint
import shardcal
from shardcal.runtime.distributed import init_distributed
from shardcal.data.perplexity import perplexity
from shardcal.models import from_pretrained, load_pretrained

init_distributed()
folder = make_tiny_checkpoint(OUT, "qwen2_moe")
model = load_pretrained(folder)
ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
report = shardcal.calibrate(model, ids, "w8a8-int8-sq-gptq", batch_size=2, progress=True)
shardcal.export_checkpoint(model, OUT + "/export", recipe="w8a8-int8-sq-gptq", report=report)
value = perplexity(from_pretrained(OUT + "/export"), ids)
after = {m.split(".")[0] for m in sys.modules}
internal = {m for m in after if m.startswith("_") or m == "cython_runtime"}  # interpreter and C-extension internals
new = after - before - internal - set(sys.stdlib_module_names)
print(json.dumps({"new": sorted(new), "perplexity": value, "blocked": sorted(set(ATTEMPTS) | (BLOCKED & after))}))
"""


def test_the_whole_path_runs_without_transformers(tmp_path):
    script = SCRIPT.replace("TESTS", repr(test_dirs())).replace("OUT", repr(str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["new"] == ["shardcal"] and result["blocked"] == [], result
    assert 1.0 < result["perplexity"] < 1e4


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
