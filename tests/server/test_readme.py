"""The README's client example runs against a real server and matches the reference."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import torch
from moegemm.kernels import quantize_activations, quantize_weights, reference_float64
from moegemm.kernels.testing import SPEC_TOLERANCE, rel_error

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_client_example(server):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "the README has no python example"
    code = blocks[0].replace("http://127.0.0.1:8000", server.url)
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), scope)  # noqa: S102 -- our own README
    out, w, x = scope["out"], scope["w"], scope["x"]
    assert printed.getvalue().strip() == "(10, 256) bfloat16"

    # The server quantized both sides as SPEC 1.1 says; do the same here.
    fp8 = torch.float8_e4m3fn
    wq, w_scale = quantize_weights(torch.from_numpy(w.astype(np.float32)), fp8)
    xq, x_scale = quantize_activations(torch.from_numpy(x.astype(np.float32)), fp8)
    ref = reference_float64(xq, wq, x_scale, w_scale, torch.tensor([3, 0, 5, 2]))
    got = torch.from_numpy(out.astype(np.float32))
    assert rel_error(got, ref) <= SPEC_TOLERANCE
    server.http.delete("/v1/weights/experts")


def test_the_metrics_the_readme_names_are_served(server):
    """Every ``moegemm_*`` metric the README names is in ``/metrics`` (after one call, which
    the request counts need), and the README names every family served."""
    server.http.get("/v1/info")
    named = set(re.findall(r"`(moegemm_[a-z_]+)", README.read_text()))
    served = {line.split()[2].removesuffix("_total")
              for line in server.http.get("/metrics").text.splitlines()
              if line.startswith("# TYPE ") and not line.split()[2].endswith("_created")}
    assert {"moegemm_requests_total", "moegemm_queue_seconds"} <= named
    families = {name.removesuffix("_total") for name in named}
    assert families <= served, families - served
    assert served <= families, served - families
