"""A native build that fails degrades to the torch reference with one warning naming the op and the reason;
when that back end was forced, the failure is an error instead."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.native]


def test_broken_cpp_source_falls_back_with_one_warning_and_forced_backend_raises(tmp_path):
    script = textwrap.dedent(
        f"""
        import json, pathlib, shutil, warnings
        import torch
        import palestra.kernels.build as build

        src = pathlib.Path({str(tmp_path)!r}) / "csrc"
        shutil.copytree(build.csrc_dir(), src)
        broken = src / "cpu" / "advantages.cpp"
        broken.write_text(broken.read_text() + "\\nthis is not C++;\\n")
        build.csrc_dir = lambda: src  # build from the broken copy

        import palestra.kernels as K
        from palestra.kernels.dispatch import set_backend

        r, v = torch.randn(2, 5), torch.randn(2, 5)
        m = torch.ones(2, 5, dtype=torch.bool)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            adv, _ = K.gae(r, v, m, 0.9, 0.8)
            K.gae(r, v, m, 0.9, 0.8)
        set_backend("torch")
        ref, _ = K.gae(r, v, m, 0.9, 0.8)
        set_backend("cpp")
        try:
            K.gae(r, v, m, 0.9, 0.8)
            forced = None
        except build.KernelBuildError as e:
            forced = str(e)
        print(json.dumps({{
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
            "same_as_reference": bool(torch.equal(adv, ref)),
            "forced": forced,
        }}))
        """
    )
    env = {**os.environ, "PALESTRA_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # a first build says so before it starts (it can take a minute), and a failed one claims no success
    assert "palestra: building the C++ kernels (palestra_cpu; first run only)..." in done.stderr
    assert "palestra: built the C++ kernels" not in done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["warnings"]) == 1, result["warnings"]
    warning = result["warnings"][0]
    assert "\n" not in warning
    assert "'gae'" in warning and "cpp back end unavailable" in warning and "advantages.cpp" in warning, warning
    assert result["same_as_reference"]
    assert result["forced"] and "'gae'" in result["forced"] and "advantages.cpp" in result["forced"]
