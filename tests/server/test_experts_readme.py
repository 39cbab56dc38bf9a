"""The README's "Serve a MoE layer" example runs against a real server, on a small
synthetic checkpoint under the name it uses, and matches the float64 chain."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import torch
from moegemm.kernels import quantize_weights
from moegemm.kernels.testing import rel_error
from moegemm.kernels.testing_ffn import FFN_TOLERANCE, ExpertProblem
from safetensors.torch import save_file

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_moe_example(server):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    [code] = [b for b in blocks if "load_experts_checkpoint" in b]
    g, h, i = 16, 256, 128
    tensors, w13, w2 = {}, [], []
    for e in range(g):
        gate, up = (torch.randn(2, i, h) / h ** 0.5).to(torch.bfloat16)
        down = (torch.randn(h, i) / i ** 0.5).to(torch.bfloat16)
        for name, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            tensors[f"model.layers.3.mlp.experts.{e}.{name}.weight"] = t
        w13.append(torch.cat([gate, up]).float())
        w2.append(down.float())
    (server.weights_dir / "Qwen3-30B-A3B").mkdir()
    save_file(tensors, str(server.weights_dir / "Qwen3-30B-A3B" / "model.safetensors"))

    scope: dict = {}
    printed = io.StringIO()
    program = compile(code.replace("http://127.0.0.1:8000", server.url), str(README), "exec")
    with contextlib.redirect_stdout(printed):
        exec(program, scope)  # noqa: S102 -- our own README
    assert printed.getvalue().strip() == f"(16, {h}) bfloat16"

    fp8 = torch.float8_e4m3fn
    p = ExpertProblem(torch.stack(w13), torch.stack(w2), *quantize_weights(torch.stack(w13), fp8),
                      *quantize_weights(torch.stack(w2), fp8), fp8)
    x = torch.from_numpy(scope["x"].astype(np.float32)).to(torch.bfloat16)
    ids = torch.from_numpy(scope["topk_ids"])
    weights = torch.from_numpy(scope["topk_weights"])
    ref = p.moe_reference(*p.quantized(x), ids, weights)
    got = torch.from_numpy(scope["out"].astype(np.float32))
    assert rel_error(got, ref) <= FFN_TOLERANCE
    assert server.http.delete("/v1/experts/layer3").status_code == 204
